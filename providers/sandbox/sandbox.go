// Package sandbox is kami's built-in payment provider, for running a shop
// without merchant accounts and for tests of the whole system.
//
// The sandbox is its own gateway, in process. Its gateway side is Pay (what
// the pay page at /sandbox/pay/{orderNo} calls when the buyer presses Pay):
// it records the trade as paid and returns the signed notification, which
// the page hands to kami's webhook. Its client side is the
// providers.Provider methods. The gateway's memory is the Provider's:
//
//   - a trade is WAITING once CreatePayment made it, PAID once Pay paid it,
//     CLOSED once ClosePayment closed it unpaid (or refunds returned all of
//     it); a trade it never saw is NOT_FOUND;
//   - refunds are kept by refund number; the same number twice refunds once.
//
// Memory is lost on restart, as nothing in the sandbox is money. A
// notification built with Signed and posted straight to the webhook is a
// notification only: the gateway does not learn of that payment, as with a
// forged one. Tests use that to send payments a real gateway would not
// (after a close, with a wrong amount). PayLate is the gateway's own late
// payment: it takes the money for a trade the shop closed, as when a
// buyer's payment crosses the close, and the pay page offers it on a
// CLOSED order so that the refund path can be watched.
//
// A notification is POST /webhooks/sandbox with the JSON body of
// Notification and the header X-Kami-Signature: the hex HMAC-SHA256 of the
// raw body keyed with the secret (KAMI_SANDBOX_SECRET).
package sandbox

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"kami/domain/money"
	"kami/providers"
	"kami/providers/fault"
)

// Name is the sandbox's registry name and webhook path segment.
const Name = "sandbox"

// DefaultMerchant is the merchant id when Config.Merchant is empty.
const DefaultMerchant = "sandbox"

var _ providers.Provider = (*Provider)(nil)

// Config configures the sandbox.
type Config struct {
	// Secret keys the notifications' HMAC. Required.
	Secret string
	// BaseURL is kami's public base URL ("https://shop.example"); pay URLs
	// are {BaseURL}/sandbox/pay/{orderNo}. Required.
	BaseURL string
	// FailRefunds makes every refund a business error (Rejected), to try
	// the refund failure paths by hand.
	FailRefunds bool
	// Merchant is the merchant id events carry; a notification naming
	// another is refused. Default DefaultMerchant.
	Merchant string
	// Timeout stands for the client timeout of a real gateway: how long a
	// call under fault.Timeout hangs before it fails. Default 1s.
	Timeout time.Duration
	// Now is the gateway's clock. Default time.Now.
	Now func() time.Time
}

// Provider is the sandbox gateway and its client. It is safe for concurrent
// use.
type Provider struct {
	secret      []byte
	baseURL     string
	failRefunds bool
	merchant    string
	timeout     time.Duration
	now         func() time.Time
	faults      fault.Table // injected faults, by op

	mu      sync.Mutex
	trades  map[string]*trade  // by order number
	refunds map[string]*refund // by refund number
	calls   map[string]int     // refund calls received, by refund number
}

type trade struct {
	status      providers.TradeStatus
	amountFen   int64
	expiresAt   time.Time
	tradeNo     string
	paidAt      time.Time
	refundedFen int64
	// the payment notification, sent again as it was when paid again
	header http.Header
	body   []byte
}

type refund struct {
	req providers.RefundRequest
	id  string
	at  time.Time // when it was made, for the statement
}

// New returns a sandbox provider, or an error naming the bad setting.
func New(cfg Config) (*Provider, error) {
	if cfg.Secret == "" {
		return nil, errors.New("sandbox: KAMI_SANDBOX_SECRET is empty")
	}
	u, err := url.Parse(cfg.BaseURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.RawQuery != "" || u.Fragment != "" {
		return nil, fmt.Errorf("sandbox: base URL %q is not an absolute http(s) URL", cfg.BaseURL)
	}
	p := &Provider{
		secret:      []byte(cfg.Secret),
		baseURL:     strings.TrimRight(cfg.BaseURL, "/"),
		failRefunds: cfg.FailRefunds,
		merchant:    cfg.Merchant,
		timeout:     cfg.Timeout,
		now:         cfg.Now,
		trades:      map[string]*trade{},
		refunds:     map[string]*refund{},
		calls:       map[string]int{},
	}
	if p.merchant == "" {
		p.merchant = DefaultMerchant
	}
	if p.timeout <= 0 {
		p.timeout = time.Second
	}
	if p.now == nil {
		p.now = time.Now
	}
	return p, nil
}

// Name returns "sandbox".
func (p *Provider) Name() string { return Name }

// CreatePayment makes the trade WAITING and returns the pay page's URL.
// Method must be "" or "page". A trade already paid or closed is Rejected.
func (p *Provider) CreatePayment(ctx context.Context, r providers.PaymentRequest) (providers.PaymentAction, error) {
	const op = "create_payment"
	if r.Method != "" && r.Method != "page" {
		return providers.PaymentAction{}, p.fail(providers.Unsupported, op, "", "unknown method "+r.Method, nil)
	}
	if !validID(r.OrderNo) || r.AmountFen <= 0 || r.AmountFen > money.MaxFen || r.ExpiresAt.IsZero() {
		return providers.PaymentAction{}, p.fail(providers.Rejected, op, "INVALID_REQUEST", "order number, amount or expiry missing or out of range", nil)
	}
	f, err := p.before(ctx, fault.OpCreate, op)
	if err != nil {
		return providers.PaymentAction{}, err
	}
	p.mu.Lock()
	t := p.trades[r.OrderNo]
	switch {
	case t == nil:
		p.trades[r.OrderNo] = &trade{status: providers.TradeWaiting, amountFen: r.AmountFen, expiresAt: r.ExpiresAt}
	case t.status == providers.TradeWaiting:
		t.amountFen, t.expiresAt = r.AmountFen, r.ExpiresAt
	default:
		p.mu.Unlock()
		return providers.PaymentAction{}, p.fail(providers.Rejected, op, "TRADE_"+string(t.status), "trade is "+strings.ToLower(string(t.status)), nil)
	}
	p.mu.Unlock()
	if err := p.after(ctx, f, op); err != nil {
		return providers.PaymentAction{}, err
	}
	return providers.PaymentAction{
		Kind:      providers.ActionRedirect,
		URL:       p.PayURL(r.OrderNo),
		ExpiresAt: r.ExpiresAt,
	}, nil
}

// PayURL is the pay page of orderNo.
func (p *Provider) PayURL(orderNo string) string {
	return p.baseURL + "/sandbox/pay/" + url.PathEscape(orderNo)
}

// Acknowledge answers 200 "OK" for nil, 400 "FAIL" for a notification that
// failed verification and 500 "FAIL" for anything else. The error's text
// stays in kami.
func (p *Provider) Acknowledge(w http.ResponseWriter, err error) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	switch {
	case err == nil:
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write([]byte("OK"))
	case providers.KindOf(err) == providers.Invalid:
		w.WriteHeader(http.StatusBadRequest)
		_, _ = w.Write([]byte("FAIL"))
	default:
		w.WriteHeader(http.StatusInternalServerError)
		_, _ = w.Write([]byte("FAIL"))
	}
}

// Refund refunds at once. The same RefundNo again returns the first refund
// and moves nothing. With FailRefunds every refund is Rejected, as is one
// that would refund more than a known trade was paid.
func (p *Provider) Refund(ctx context.Context, r providers.RefundRequest) (providers.RefundResult, error) {
	const op = "refund"
	if !validID(r.RefundNo) || !validID(r.OrderNo) || r.RefundFen <= 0 || r.RefundFen > money.MaxFen || (r.TotalFen > 0 && r.RefundFen > r.TotalFen) {
		return providers.RefundResult{}, p.fail(providers.Rejected, op, "INVALID_REQUEST", "refund number, order number or amount missing or out of range", nil)
	}
	if err := ctx.Err(); err != nil {
		return providers.RefundResult{}, p.fail(providers.Temporary, op, "", "not sent", err)
	}
	p.mu.Lock()
	p.calls[r.RefundNo]++
	p.mu.Unlock()

	f, err := p.before(ctx, fault.OpRefund, op)
	if err != nil {
		return providers.RefundResult{}, err
	}
	if p.failRefunds {
		return providers.RefundResult{}, p.fail(providers.Rejected, op, "REFUND_DISABLED", "sandbox refunds are configured to fail", nil)
	}
	res, code := p.refund(r)
	if code != "" {
		return providers.RefundResult{}, p.fail(providers.Rejected, op, code, "refund refused", nil)
	}
	if err := p.after(ctx, f, op); err != nil {
		return providers.RefundResult{}, err
	}
	return res, nil
}

// refund records r unless its number is known; code is a business error.
func (p *Provider) refund(r providers.RefundRequest) (res providers.RefundResult, code string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if rf := p.refunds[r.RefundNo]; rf != nil {
		return rf.result(), ""
	}
	// Only a trade paid through Pay has a known amount. A payment posted
	// straight to the webhook (a test's late payment) is refunded on trust:
	// the design promises that sandbox refunds succeed.
	t := p.trades[r.OrderNo]
	if t != nil && t.tradeNo == "" {
		t = nil
	}
	if t != nil && t.refundedFen+r.RefundFen > t.amountFen {
		return res, "REFUND_AMOUNT_EXCEEDED"
	}
	rf := &refund{req: r, id: p.newID("SBR"), at: p.now().UTC().Truncate(time.Second)}
	p.refunds[r.RefundNo] = rf
	if t != nil {
		t.refundedFen += r.RefundFen
		if t.refundedFen == t.amountFen {
			t.status = providers.TradeClosed
		}
	}
	return rf.result(), ""
}

func (rf *refund) result() providers.RefundResult {
	return providers.RefundResult{
		State:            providers.RefundSucceeded,
		ProviderRefundID: rf.id,
		RefundFen:        rf.req.RefundFen,
		Detail:           "SUCCESS",
	}
}

// QueryRefund reports a refund made under r.RefundNo, or RefundNotFound.
func (p *Provider) QueryRefund(ctx context.Context, r providers.RefundRequest) (providers.RefundResult, error) {
	const op = "query_refund"
	f, err := p.before(ctx, fault.OpQueryRefund, op)
	if err != nil {
		return providers.RefundResult{}, err
	}
	p.mu.Lock()
	res := providers.RefundResult{State: providers.RefundNotFound}
	if rf := p.refunds[r.RefundNo]; rf != nil {
		res = rf.result()
	}
	p.mu.Unlock()
	if err := p.after(ctx, f, op); err != nil {
		return providers.RefundResult{}, err
	}
	return res, nil
}

// QueryPayment reports the sandbox's view of the trade of orderNo.
func (p *Provider) QueryPayment(ctx context.Context, orderNo string) (providers.TradeState, error) {
	const op = "query_payment"
	f, err := p.before(ctx, fault.OpQueryPayment, op)
	if err != nil {
		return providers.TradeState{}, err
	}
	p.mu.Lock()
	st := providers.TradeState{Status: providers.TradeNotFound}
	if t := p.trades[orderNo]; t != nil {
		st = providers.TradeState{Status: t.status, TradeNo: t.tradeNo, PaidAt: t.paidAt}
		if t.tradeNo != "" {
			st.AmountFen = t.amountFen
		}
	}
	p.mu.Unlock()
	if err := p.after(ctx, f, op); err != nil {
		return providers.TradeState{}, err
	}
	return st, nil
}

// ClosePayment closes the trade of orderNo so that Pay refuses it. A trade
// the sandbox never saw is closed too (so a page left open cannot pay it);
// a paid one is Rejected with code TRADE_PAID.
func (p *Provider) ClosePayment(ctx context.Context, orderNo string) error {
	const op = "close"
	f, err := p.before(ctx, fault.OpClose, op)
	if err != nil {
		return err
	}
	p.mu.Lock()
	t := p.trades[orderNo]
	switch {
	case t == nil:
		p.trades[orderNo] = &trade{status: providers.TradeClosed}
	case t.tradeNo != "":
		p.mu.Unlock()
		return p.fail(providers.Rejected, op, "TRADE_PAID", "trade was paid", nil)
	default:
		t.status = providers.TradeClosed
	}
	p.mu.Unlock()
	return p.after(ctx, f, op)
}

// ErrTradeClosed is returned by Pay for a trade that ClosePayment closed.
var ErrTradeClosed = errors.New("sandbox: trade is closed")

// ErrUnknownRefund is returned by RefundNotification for a refund number the
// sandbox never refunded.
var ErrUnknownRefund = errors.New("sandbox: no such refund")

// Pay is the gateway taking the buyer's money: it records the trade of
// orderNo as paid with amountFen, whether CreatePayment made it or not, and
// returns the signed notification to deliver to POST /webhooks/sandbox.
// Paying a paid trade takes nothing more and returns its first notification
// again, byte for byte (a redelivery). A closed trade cannot be paid.
func (p *Provider) Pay(orderNo string, amountFen int64) (http.Header, []byte, error) {
	return p.pay(orderNo, amountFen, false)
}

// PayLate is Pay for a trade the shop closed: the gateway takes the money
// anyway, as when a buyer's payment crosses the shop's close. It is how
// the pay page simulates a late payment, for the refund path to be seen.
// A paid trade returns its first notification again, as with Pay.
func (p *Provider) PayLate(orderNo string, amountFen int64) (http.Header, []byte, error) {
	return p.pay(orderNo, amountFen, true)
}

func (p *Provider) pay(orderNo string, amountFen int64, evenIfClosed bool) (http.Header, []byte, error) {
	if !validID(orderNo) || amountFen <= 0 || amountFen > money.MaxFen {
		return nil, nil, fmt.Errorf("sandbox: cannot pay %d fen for order %q", amountFen, orderNo)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	t := p.trades[orderNo]
	if t == nil {
		t = &trade{status: providers.TradeWaiting}
		p.trades[orderNo] = t
	}
	if t.tradeNo != "" {
		return t.header.Clone(), append([]byte(nil), t.body...), nil
	}
	if t.status == providers.TradeClosed && !evenIfClosed {
		return nil, nil, ErrTradeClosed
	}
	t.status = providers.TradePaid
	t.amountFen = amountFen
	t.tradeNo = p.newID("SB")
	t.paidAt = p.now().UTC().Truncate(time.Second)
	n := PaymentNotification(orderNo, t.tradeNo, amountFen, t.paidAt)
	n.Merchant = p.merchant
	t.header, t.body = Signed(string(p.secret), n)
	return t.header.Clone(), append([]byte(nil), t.body...), nil
}

// RefundNotification returns the signed notification of the refund made
// under refundNo, as a gateway sends when a refund finishes.
func (p *Provider) RefundNotification(refundNo string) (http.Header, []byte, error) {
	p.mu.Lock()
	rf := p.refunds[refundNo]
	p.mu.Unlock()
	if rf == nil {
		return nil, nil, ErrUnknownRefund
	}
	h, b := Signed(string(p.secret), Notification{
		Type:     TypeRefund,
		OrderNo:  rf.req.OrderNo,
		TradeNo:  nonEmpty(rf.req.TradeNo, rf.id),
		Amount:   money.Format(rf.req.RefundFen),
		RefundNo: refundNo,
		Merchant: p.merchant,
	})
	return h, b, nil
}

// Refunded is what the sandbox refunded under refundNo, and how many refund
// calls with that number it received.
func (p *Provider) Refunded(refundNo string) (fen int64, calls int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if rf := p.refunds[refundNo]; rf != nil {
		fen = rf.req.RefundFen
	}
	return fen, p.calls[refundNo]
}

// tradeState is the gateway's view of orderNo for the pay page.
func (p *Provider) tradeState(orderNo string) providers.TradeStatus {
	p.mu.Lock()
	defer p.mu.Unlock()
	if t := p.trades[orderNo]; t != nil {
		if t.tradeNo != "" {
			return providers.TradePaid // also once refunded: the money was taken
		}
		return t.status
	}
	return providers.TradeNotFound
}

func (p *Provider) newID(prefix string) string {
	b := make([]byte, 6)
	_, _ = rand.Read(b) // crypto/rand.Read never fails
	return prefix + p.now().UTC().Format("20060102150405") + hex.EncodeToString(b)
}

func (p *Provider) fail(kind providers.ErrorKind, op, code, msg string, err error) error {
	return &providers.Error{Kind: kind, Provider: Name, Op: op, Code: code, Message: msg, Err: err}
}

func nonEmpty(a, b string) string {
	if a != "" {
		return a
	}
	return b
}
