package domain

import (
	"context"
	"log/slog"
	"strconv"

	"kami/domain/money"
)

// Business events. Every change of an order's state, and every refund
// attempt, is one info line for the person on call: what happened to
// order X, from which state to which, why, through which provider, for how
// much. The line is one slog call; its attributes are built only when info
// is enabled, and a card code, an access token or a buyer's contact never
// appears in it.

// event is one business event line.
type event struct {
	msg      string
	order    string
	from, to OrderStatus // "" when the order's state did not move (from: a new order)
	cause    string
	provider string
	fen      int64 // the amount the event is about; < 0: none
	extra    []slog.Attr
}

// logEvent writes e at info.
func (s *Shop) logEvent(ctx context.Context, e event) {
	l := s.log()
	if !l.Enabled(ctx, slog.LevelInfo) {
		return
	}
	attrs := make([]slog.Attr, 0, 7+len(e.extra))
	attrs = append(attrs, slog.String("order", e.order))
	if e.from != "" {
		attrs = append(attrs, slog.String("from", string(e.from)))
	}
	if e.to != "" {
		attrs = append(attrs, slog.String("to", string(e.to)))
	}
	if e.cause != "" {
		attrs = append(attrs, slog.String("cause", e.cause))
	}
	if e.provider != "" {
		attrs = append(attrs, slog.String("provider", e.provider))
	}
	if e.fen >= 0 {
		attrs = append(attrs, slog.String("amount", money.Format(e.fen)))
	}
	attrs = append(attrs, e.extra...)
	l.LogAttrs(ctx, slog.LevelInfo, e.msg, attrs...)
}

// logPlaced: a new order holds its cards until it is paid or closes.
func (s *Shop) logPlaced(ctx context.Context, o *Order) {
	s.logEvent(ctx, event{msg: "order placed", order: o.OrderNo, to: OrderPending, cause: "new order",
		provider: o.Provider, fen: o.AmountFen, extra: []slog.Attr{
			slog.Int64("product", o.ProductID), slog.Int("quantity", o.Quantity),
			slog.Time("expires_at", o.ExpiresAt)}})
}

// logClosed: a batch's orders that closed, each on its own line.
func (s *Shop) logClosed(ctx context.Context, r CloseResult, reason CloseReason) {
	s.logEvent(ctx, event{msg: "order closed", order: r.OrderNo, from: OrderPending, to: OrderClosed,
		cause: string(reason), fen: -1, extra: []slog.Attr{slog.Int("cards_released", r.Released)}})
}

// logPayment: what a recorded payment did to its order.
func (s *Shop) logPayment(ctx context.Context, p Payment, res *PaymentResult) {
	e := event{order: p.OrderNo, provider: p.Provider, fen: p.AmountFen,
		extra: []slog.Attr{slog.String("trade", p.TradeNo)}}
	switch res.Outcome {
	case PaymentDelivered:
		e.msg, e.from, e.to, e.cause = "order paid", OrderPending, OrderPaid, "payment"
	case PaymentLateRefund:
		e.msg, e.from, e.to, e.cause = "late payment", OrderClosed, OrderRefunding, "paid after the close: refunded"
	case PaymentLateDelivered:
		e.msg, e.from, e.to, e.cause = "late payment", OrderClosed, OrderPaid, "paid after the close: delivered (KAMI_LATE_PAYMENT=deliver)"
	case PaymentDuplicateRefunds:
		e.msg, e.cause = "second payment", "the order was already paid with another trade: refunded"
	default:
		return // a duplicate notification changed nothing
	}
	if res.Refund != nil {
		e.extra = append(e.extra, slog.String("refund", res.Refund.RefundNo))
	}
	s.logEvent(ctx, e)
}

// logRefunded: the provider confirmed a refund; from is the order's state
// before (REFUNDING), or "" when the refund did not move the order (a
// second payment's refund leaves the order PAID).
func (s *Shop) logRefunded(ctx context.Context, r *Refund, o *Order, via string) {
	e := event{msg: "refund succeeded", order: r.OrderNo, cause: string(r.Cause), provider: r.Provider, fen: r.AmountFen,
		extra: []slog.Attr{slog.String("refund", r.RefundNo), slog.String("confirmed_by", via)}}
	if o != nil && o.Status == OrderRefunded {
		e.msg, e.from, e.to = "order refunded", OrderRefunding, OrderRefunded
	}
	s.logEvent(ctx, e)
}

// logRefundAttempt: an attempt that did not refund; result is "retry" or
// "failed" (gave up: the alert follows), or "processing" (the provider
// accepted it and is still processing it: not a failure).
func (s *Shop) logRefundAttempt(ctx context.Context, r *Refund, attempt int, result, detail string) {
	extra := []slog.Attr{slog.String("refund", r.RefundNo), slog.Int("attempt", attempt),
		slog.String("result", result), slog.String("detail", detail)}
	if result != "failed" && !r.NextRetryAt.IsZero() {
		extra = append(extra, slog.Time("next_attempt", r.NextRetryAt))
	}
	msg := "refund attempt failed"
	if result == "processing" {
		msg = "refund processing at the provider"
	}
	s.logEvent(ctx, event{msg: msg, order: r.OrderNo, cause: string(r.Cause),
		provider: r.Provider, fen: r.AmountFen, extra: extra})
}

// logRefundRequested: an admin refunds a delivered order, or retries a
// refund that gave up.
func (s *Shop) logRefundRequested(ctx context.Context, r *Refund, from OrderStatus, actor string) {
	e := event{msg: "refund requested", order: r.OrderNo, cause: string(r.Cause), provider: r.Provider, fen: r.AmountFen,
		extra: []slog.Attr{slog.String("refund", r.RefundNo), slog.String("by", actor)}}
	if from == OrderPaid {
		e.from, e.to = OrderPaid, OrderRefunding
	} else {
		e.msg = "refund retried"
		e.extra = append(e.extra, slog.String("attempts_so_far", strconv.Itoa(r.RetryCount)))
	}
	s.logEvent(ctx, e)
}
