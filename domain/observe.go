package domain

import "time"

// Observer hears what the Shop does, for metrics. Every method must be
// cheap and must not block: it runs on the hot paths.
type Observer interface {
	// OrderPlaced counts an order placed; OrderRefused one refused, by
	// error code (SOLD_OUT, LIMIT_EXCEEDED, UNAVAILABLE, ...).
	OrderPlaced()
	OrderRefused(code string)
	// OrderClosed counts one order of a close batch by outcome; for a
	// timeout close that closed it, lateBy is how long after its due time.
	OrderClosed(reason CloseReason, outcome CloseOutcome, lateBy time.Duration)
	// CloseFailed counts a close batch whose transaction failed.
	CloseFailed(orders int)
	// PaymentRecorded counts a payment by outcome.
	PaymentRecorded(outcome PaymentOutcome)
	// RefundAttempt counts a refund attempt by result ("succeeded",
	// "retry", "failed", "processing": the provider accepted it and is
	// still processing it) and its number (1 for the first).
	RefundAttempt(result string, attempt int)
}

// nopObserver is the Observer of a Shop that has none.
type nopObserver struct{}

func (nopObserver) OrderPlaced()                                         {}
func (nopObserver) OrderRefused(string)                                  {}
func (nopObserver) OrderClosed(CloseReason, CloseOutcome, time.Duration) {}
func (nopObserver) CloseFailed(int)                                      {}
func (nopObserver) PaymentRecorded(PaymentOutcome)                       {}
func (nopObserver) RefundAttempt(string, int)                            {}

func (s *Shop) observer() Observer {
	if s.Observer != nil {
		return s.Observer
	}
	return nopObserver{}
}
