// Package providers is the one seam between kami and the payment gateways.
//
// Every gateway (Alipay, WeChat Pay v3, the built-in sandbox) implements
// Provider. Adapters even out the gateways' habits so that the ledger sees one
// vocabulary: amounts in integer fen, one Event type for notifications, one
// RefundResult for refunds and one error type whose Kind says whether trying
// again can help.
package providers

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sort"
	"time"
)

// Provider is a payment gateway. Every method that calls out is idempotent
// when called again with the same arguments: the refund number is the
// gateway's out_request_no / out_refund_no, so a retried Refund never refunds
// twice.
type Provider interface {
	// Name is the registry key and the {provider} of /webhooks/{provider}.
	Name() string

	// CreatePayment asks the gateway for what the buyer must do to pay.
	CreatePayment(ctx context.Context, p PaymentRequest) (PaymentAction, error)

	// ParseNotification verifies a notification's signature and the
	// merchant/app id it names, and returns what it reports. It never trusts
	// an unverified field. Errors are *Error with Kind Invalid.
	ParseNotification(ctx context.Context, header http.Header, body []byte) (Event, error)

	// Acknowledge writes the answer the gateway expects: success when err is
	// nil, the gateway's failure form otherwise (so it sends again later).
	Acknowledge(w http.ResponseWriter, err error)

	// Refund asks the gateway to refund. A refund that the gateway accepted
	// but has not finished is RefundProcessing, not an error.
	Refund(ctx context.Context, r RefundRequest) (RefundResult, error)

	// QueryRefund asks for the state of a refund made with r.RefundNo.
	// A refund the gateway never heard of is RefundNotFound.
	QueryRefund(ctx context.Context, r RefundRequest) (RefundResult, error)

	// QueryPayment asks whether the payment for orderNo was made.
	QueryPayment(ctx context.Context, orderNo string) (TradeState, error)

	// ClosePayment tells the gateway that orderNo can no longer be paid.
	// Closing a trade the gateway never created is not an error.
	ClosePayment(ctx context.Context, orderNo string) error
}

// PaymentRequest is what kami knows when a buyer must pay.
type PaymentRequest struct {
	OrderNo   string
	AmountFen int64
	Subject   string
	ExpiresAt time.Time
	ClientIP  string
	// Method picks the form of payment; empty means the provider's default.
	// alipay: "page" (default), "wap", "qr"; wechat: "native" (default), "h5";
	// sandbox: "page".
	Method string
}

// PaymentActionKind says how the buyer pays.
type PaymentActionKind string

const (
	ActionRedirect PaymentActionKind = "REDIRECT" // open URL
	ActionQRCode   PaymentActionKind = "QR_CODE"  // show QRCode as a QR image
)

// PaymentAction is what the buyer must do to pay.
type PaymentAction struct {
	Kind      PaymentActionKind
	URL       string
	QRCode    string
	ExpiresAt time.Time
}

// EventKind names what a notification reports.
type EventKind string

const (
	EventPaymentSucceeded EventKind = "PAYMENT_SUCCEEDED"
	EventRefundSucceeded  EventKind = "REFUND_SUCCEEDED"
	EventRefundFailed     EventKind = "REFUND_FAILED"
	// EventIgnored is a verified notification that needs no action (a trade
	// that was created or closed, say); it is acknowledged and recorded.
	EventIgnored EventKind = "IGNORED"
)

// Event is a verified notification.
type Event struct {
	Kind EventKind
	// NotifyID identifies this notification at the gateway (notify_id,
	// WeChat's id); with the provider name it deduplicates deliveries.
	NotifyID  string
	OrderNo   string // kami's order number (out_trade_no)
	TradeNo   string // the gateway's trade number
	AmountFen int64  // amount paid (payment events) or the order total
	PaidAt    time.Time
	RefundNo  string // kami's refund number (refund events)
	RefundFen int64
	// Merchant is the app id / merchant id the notification named, already
	// checked against the configured one.
	Merchant string
}

// RefundRequest identifies a refund. The same RefundNo always means the same
// refund.
type RefundRequest struct {
	RefundNo  string
	OrderNo   string
	TradeNo   string
	RefundFen int64
	TotalFen  int64 // the amount that was paid
	Reason    string
}

// RefundState is the gateway's view of a refund.
type RefundState string

const (
	RefundSucceeded  RefundState = "SUCCEEDED"
	RefundProcessing RefundState = "PROCESSING"
	RefundFailed     RefundState = "FAILED"    // the gateway will not refund
	RefundNotFound   RefundState = "NOT_FOUND" // the gateway never received it
)

// RefundResult is the answer to Refund and QueryRefund.
type RefundResult struct {
	State            RefundState
	ProviderRefundID string
	RefundFen        int64
	// Detail is the gateway's code and message, for the refund's last error
	// and for people; never shown to buyers.
	Detail string
}

// TradeStatus is the gateway's view of a payment.
type TradeStatus string

const (
	TradeNotFound TradeStatus = "NOT_FOUND" // no such trade at the gateway
	TradeWaiting  TradeStatus = "WAITING"   // created, not paid
	TradePaid     TradeStatus = "PAID"      // paid (also when later refunded in part)
	TradeClosed   TradeStatus = "CLOSED"    // closed unpaid, or fully refunded
)

// TradeState is the answer to QueryPayment.
type TradeState struct {
	Status    TradeStatus
	TradeNo   string
	AmountFen int64
	PaidAt    time.Time
}

// ErrorKind says what a caller may do about an error.
type ErrorKind string

const (
	// Temporary: timeout, connection failure, HTTP 5xx, the gateway's
	// "system busy". The outcome is unknown: query before trying again.
	Temporary ErrorKind = "TEMPORARY"
	// Rejected: the gateway answered with a business error; trying the same
	// again will not help.
	Rejected ErrorKind = "REJECTED"
	// Invalid: a notification failed verification or could not be parsed.
	Invalid ErrorKind = "INVALID"
	// Unsupported: the provider cannot do this (a Method it does not know).
	Unsupported ErrorKind = "UNSUPPORTED"
)

// Error is the only error type a Provider returns.
type Error struct {
	Kind     ErrorKind
	Provider string
	Op       string // "refund", "query_refund", "notification", ...
	Code     string // the gateway's code, when it gave one
	Message  string
	Err      error
}

func (e *Error) Error() string {
	s := fmt.Sprintf("%s %s: %s", e.Provider, e.Op, e.Kind)
	if e.Code != "" {
		s += " " + e.Code
	}
	if e.Message != "" {
		s += ": " + e.Message
	}
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

func (e *Error) Unwrap() error { return e.Err }

// KindOf returns the Kind of a provider error, Temporary for anything else:
// an error we do not understand leaves the outcome unknown.
func KindOf(err error) ErrorKind {
	var pe *Error
	if errors.As(err, &pe) {
		return pe.Kind
	}
	return Temporary
}

// Registry holds the enabled providers by name. Every enabled provider
// verifies its notifications and refunds its payments; a provider may be
// enabled without being offered to buyers for new orders (the sandbox
// beside real merchants: see NotForBuyers).
type Registry struct {
	byName   map[string]Provider
	withheld map[string]bool
}

// NewRegistry returns a registry of ps; two providers with one name is a
// programming error.
func NewRegistry(ps ...Provider) *Registry {
	r := &Registry{byName: map[string]Provider{}, withheld: map[string]bool{}}
	for _, p := range ps {
		if _, dup := r.byName[p.Name()]; dup {
			panic("providers: duplicate provider " + p.Name())
		}
		r.byName[p.Name()] = p
	}
	return r
}

// NotForBuyers keeps the named provider from new orders; it still answers
// its notifications and refunds. Call it while setting up, before use.
func (r *Registry) NotForBuyers(name string) *Registry {
	r.withheld[name] = true
	return r
}

// Get returns the provider called name.
func (r *Registry) Get(name string) (Provider, bool) {
	p, ok := r.byName[name]
	return p, ok
}

// Offered returns the provider called name if buyers may order with it.
func (r *Registry) Offered(name string) (Provider, bool) {
	if r.withheld[name] {
		return nil, false
	}
	return r.Get(name)
}

// Names lists the enabled providers, sorted.
func (r *Registry) Names() []string {
	return r.names(func(string) bool { return true })
}

// OfferedNames lists the providers buyers may order with, sorted.
func (r *Registry) OfferedNames() []string {
	return r.names(func(n string) bool { return !r.withheld[n] })
}

func (r *Registry) names(keep func(string) bool) []string {
	names := make([]string, 0, len(r.byName))
	for n := range r.byName {
		if keep(n) {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	return names
}
