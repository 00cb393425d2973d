package sandbox

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"time"
	"unicode/utf8"

	"kami/domain/money"
	"kami/providers"
)

// SignatureHeader carries the hex HMAC-SHA256 of the raw body.
const SignatureHeader = "X-Kami-Signature"

// MaxNotificationBytes bounds a notification body; larger ones are refused
// unread.
const MaxNotificationBytes = 64 << 10

// maxIDLen bounds order, trade, refund and merchant ids in a notification.
const maxIDLen = 64

// Notification types. An empty Type is a payment.
const (
	TypePayment      = "payment"
	TypeRefund       = "refund"
	TypeRefundFailed = "refund_failed"
)

// Notification is the JSON body of POST /webhooks/sandbox. Amount is a
// decimal string ("12.50"): for a payment the amount paid, for a refund the
// amount refunded.
type Notification struct {
	Type     string `json:"type,omitempty"`
	OrderNo  string `json:"orderNo"`
	TradeNo  string `json:"tradeNo"`
	Amount   string `json:"amount"`
	PaidAt   string `json:"paidAt,omitempty"` // RFC 3339; required for a payment
	RefundNo string `json:"refundNo,omitempty"`
	// Merchant, when given, must be the configured merchant id. The secret
	// already says who signed; the field lets tests check that a notification
	// meant for another shop is refused.
	Merchant string `json:"merchant,omitempty"`
}

// PaymentNotification is the notification for a payment of amountFen.
func PaymentNotification(orderNo, tradeNo string, amountFen int64, paidAt time.Time) Notification {
	return Notification{
		OrderNo: orderNo,
		TradeNo: tradeNo,
		Amount:  money.Format(amountFen),
		PaidAt:  paidAt.UTC().Format(time.RFC3339),
	}
}

// Sign returns the hex HMAC-SHA256 of body keyed with secret, the value of
// the X-Kami-Signature header.
func Sign(secret string, body []byte) string {
	m := hmac.New(sha256.New, []byte(secret))
	m.Write(body)
	return hex.EncodeToString(m.Sum(nil))
}

// Signed encodes n and signs it with secret: the header and body to POST to
// /webhooks/sandbox.
func Signed(secret string, n Notification) (http.Header, []byte) {
	body, err := json.Marshal(n)
	if err != nil {
		panic("sandbox: encoding a notification: " + err.Error()) // only strings: cannot fail
	}
	return SignedBody(secret, body), body
}

// SignedBody returns the headers for body signed with secret; tests use it
// to sign bodies that Signed would never produce.
func SignedBody(secret string, body []byte) http.Header {
	h := http.Header{}
	h.Set("Content-Type", "application/json")
	h.Set(SignatureHeader, Sign(secret, body))
	return h
}

// NotifyID is the notification id of body: an identical redelivery has the
// same id and is deduplicated, any other notification has another.
func NotifyID(body []byte) string {
	sum := sha256.Sum256(body)
	return hex.EncodeToString(sum[:])
}

// ParseNotification verifies the signature, then the fields, of a sandbox
// notification. It records nothing: the sandbox gateway learns of payments
// through Pay, not through kami's webhook.
func (p *Provider) ParseNotification(ctx context.Context, header http.Header, body []byte) (providers.Event, error) {
	if len(body) > MaxNotificationBytes {
		return providers.Event{}, p.invalid("body larger than 64 KiB")
	}
	if !p.verify(header, body) {
		return providers.Event{}, p.invalid("bad or missing " + SignatureHeader)
	}
	var n Notification
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&n); err != nil {
		return providers.Event{}, p.invalid("body is not a notification")
	}
	if _, err := dec.Token(); err != io.EOF {
		return providers.Event{}, p.invalid("data after the notification")
	}
	ev, msg := p.event(n)
	if msg != "" {
		return providers.Event{}, p.invalid(msg)
	}
	ev.NotifyID = NotifyID(body)
	return ev, nil
}

func (p *Provider) verify(header http.Header, body []byte) bool {
	got, err := hex.DecodeString(strings.TrimSpace(header.Get(SignatureHeader)))
	if err != nil || len(got) != sha256.Size {
		return false
	}
	m := hmac.New(sha256.New, p.secret)
	m.Write(body)
	return hmac.Equal(got, m.Sum(nil))
}

// event checks a verified notification's fields; msg says what is wrong.
func (p *Provider) event(n Notification) (ev providers.Event, msg string) {
	if n.Merchant != "" && n.Merchant != p.merchant {
		return ev, "notification for another merchant"
	}
	if !validID(n.OrderNo) || !validID(n.TradeNo) {
		return ev, "bad orderNo or tradeNo"
	}
	amount, err := money.Parse(n.Amount)
	if err != nil || amount <= 0 {
		return ev, "bad amount"
	}
	var paidAt time.Time
	if n.PaidAt != "" {
		if paidAt, err = time.Parse(time.RFC3339, n.PaidAt); err != nil {
			return ev, "bad paidAt"
		}
	}
	ev = providers.Event{OrderNo: n.OrderNo, TradeNo: n.TradeNo, PaidAt: paidAt, Merchant: p.merchant}
	switch n.Type {
	case "", TypePayment:
		if n.RefundNo != "" {
			return providers.Event{}, "payment with a refundNo"
		}
		if paidAt.IsZero() {
			return providers.Event{}, "payment without paidAt"
		}
		ev.Kind, ev.AmountFen = providers.EventPaymentSucceeded, amount
	case TypeRefund, TypeRefundFailed:
		if !validID(n.RefundNo) {
			return providers.Event{}, "refund without a good refundNo"
		}
		ev.Kind, ev.RefundNo, ev.RefundFen = providers.EventRefundSucceeded, n.RefundNo, amount
		if n.Type == TypeRefundFailed {
			ev.Kind = providers.EventRefundFailed
		}
	default:
		return providers.Event{}, "unknown type"
	}
	return ev, ""
}

func validID(s string) bool {
	if s == "" || len(s) > maxIDLen || !utf8.ValidString(s) {
		return false
	}
	for _, r := range s {
		if r < 0x21 || r == 0x7f {
			return false
		}
	}
	return true
}

func (p *Provider) invalid(msg string) error {
	return &providers.Error{Kind: providers.Invalid, Provider: Name, Op: "notification", Message: msg}
}
