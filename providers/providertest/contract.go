package providertest

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/fnv"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"kami/providers"
)

// What the contract expects of an emulator, beyond the Harness doc comments:
//
//   - Faults are global to the emulator, so Run must not share an emulator
//     with another Run going on at the same time. The subtests that inject
//     faults run one after another, after all the others have finished.
//   - An emulator that answers a refund with PROCESSING must report it
//     SUCCEEDED within settleQueries QueryRefund calls: tests do not sleep.
//   - FaultTimeout on a refund makes no refund; FaultTimeoutAfterEffect makes
//     it and loses the answer.
//   - Order and refund numbers are at most 32 characters of [0-9A-Za-z], the
//     narrowest form any gateway accepts (WeChat's out_trade_no).
//   - A provider that is a providers.StatementSource serves the statement of
//     a day that has begun with its books so far (alipayemu and wechatemu
//     with EarlyStatements; the sandbox always), so that the suite need not
//     wait for tomorrow.

// maxNotificationBytes is the largest notification a provider must accept;
// anything larger is refused before it is parsed.
const maxNotificationBytes = 64 << 10

// settleQueries bounds how many QueryRefund calls a PROCESSING refund may take
// to finish in an emulator.
const settleQueries = 5

// callTimeout guards every provider call of the suite, so that a provider
// without its own client timeout fails the test instead of hanging it.
const callTimeout = 30 * time.Second

type suite struct {
	h     Harness
	p     providers.Provider
	nonce string // tells apart the numbers of two runs against one emulator
	seq   atomic.Uint64
}

func run(t *testing.T, h Harness) {
	t.Helper()
	checkHarness(t, h)
	s := &suite{h: h, p: h.Provider, nonce: randomHex(t, 3)}

	// The group returns only when all its parallel subtests have finished,
	// so the fault subtests below never see (or disturb) another call.
	t.Run("Parallel", func(t *testing.T) {
		t.Run("Name", s.testName)
		t.Run("CreatePayment", s.testCreatePayment)
		t.Run("CreatePaymentUnknownMethod", s.testCreatePaymentUnknownMethod)
		t.Run("PaymentNotification", s.testPaymentNotification)
		t.Run("NotificationIDsDiffer", s.testNotificationIDsDiffer)
		t.Run("InvalidNotifications", s.testInvalidNotifications)
		t.Run("Acknowledge", s.testAcknowledge)
		t.Run("Refund", s.testRefund)
		t.Run("PartialRefunds", s.testPartialRefunds)
		t.Run("RefundCanceledContext", s.testRefundCanceledContext)
		t.Run("QueryRefundUnknown", s.testQueryRefundUnknown)
		t.Run("RefundNotification", s.testRefundNotification)
		t.Run("QueryPayment", s.testQueryPayment)
		t.Run("ClosePayment", s.testClosePayment)
		t.Run("Statement", s.testStatement)
		t.Run("StatementOfAQuietDay", s.testStatementOfAQuietDay)
	})
	t.Run("Faults", func(t *testing.T) {
		t.Run("RefundTimeout", s.testRefundTimeout)
		t.Run("Refund5xx", s.testRefund5xx)
		t.Run("RefundBusiness", s.testRefundBusiness)
		t.Run("RefundSlow", s.testRefundSlow)
		t.Run("RefundTimeoutAfterEffect", s.testRefundTimeoutAfterEffect)
		t.Run("QueryRefundTemporary", s.testQueryRefundTemporary)
		t.Run("QueryPaymentTemporary", s.testQueryPaymentTemporary)
		t.Run("CloseTemporary", s.testCloseTemporary)
		t.Run("StatementTemporary", s.testStatementTemporary)
	})
}

func checkHarness(t *testing.T, h Harness) {
	t.Helper()
	missing := []string{}
	if h.Provider == nil {
		missing = append(missing, "Provider")
	}
	if h.Pay == nil {
		missing = append(missing, "Pay")
	}
	if h.Forge == nil {
		missing = append(missing, "Forge")
	}
	if h.OtherMerchant == nil {
		missing = append(missing, "OtherMerchant")
	}
	if h.InjectFault == nil {
		missing = append(missing, "InjectFault")
	}
	if h.Refunded == nil {
		missing = append(missing, "Refunded")
	}
	if len(missing) > 0 {
		t.Fatalf("providertest: Harness is missing %s", strings.Join(missing, ", "))
	}
}

// ---- helpers ----

func randomHex(t *testing.T, n int) string {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatalf("random: %v", err)
	}
	return hex.EncodeToString(b)
}

// number returns a fresh order or refund number: kind letter, the subtest's
// name hash (to find it in emulator logs), the run's nonce and a counter.
// 1 + 8 + 6 + 6 = 21 characters.
func (s *suite) number(t testing.TB, kind string) string {
	h := fnv.New32a()
	h.Write([]byte(t.Name()))
	return fmt.Sprintf("%s%08x%s%06d", kind, h.Sum32(), s.nonce, s.seq.Add(1))
}

func (s *suite) orderNo(t testing.TB) string  { return s.number(t, "O") }
func (s *suite) refundNo(t testing.TB) string { return s.number(t, "R") }

func ctxFor(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), callTimeout)
	t.Cleanup(cancel)
	return ctx
}

func (s *suite) paymentRequest(orderNo string, amountFen int64) providers.PaymentRequest {
	return providers.PaymentRequest{
		OrderNo:   orderNo,
		AmountFen: amountFen,
		Subject:   "Contract test card",
		ExpiresAt: time.Now().Add(15 * time.Minute).Truncate(time.Second),
		ClientIP:  "203.0.113.7",
	}
}

// paid pays a fresh order at the emulator, delivers its notification and
// returns the event, so that refunds have a real trade to refer to.
func (s *suite) paid(t *testing.T, amountFen int64) providers.Event {
	t.Helper()
	orderNo := s.orderNo(t)
	if _, err := s.p.CreatePayment(ctxFor(t), s.paymentRequest(orderNo, amountFen)); err != nil {
		t.Fatalf("CreatePayment(%s): %v", orderNo, err)
	}
	header, body := s.h.Pay(t, orderNo, amountFen)
	ev, err := s.p.ParseNotification(ctxFor(t), header, body)
	if err != nil {
		t.Fatalf("ParseNotification of the payment of %s: %v", orderNo, err)
	}
	if ev.Kind != providers.EventPaymentSucceeded || ev.OrderNo != orderNo || ev.AmountFen != amountFen {
		t.Fatalf("payment of %s parsed to %+v", orderNo, ev)
	}
	return ev
}

func (s *suite) refundRequest(t *testing.T, ev providers.Event, refundFen int64) providers.RefundRequest {
	return providers.RefundRequest{
		RefundNo:  s.refundNo(t),
		OrderNo:   ev.OrderNo,
		TradeNo:   ev.TradeNo,
		RefundFen: refundFen,
		TotalFen:  ev.AmountFen,
		Reason:    "contract test",
	}
}

// settle returns res, or when it is PROCESSING, what QueryRefund reports once
// the refund has left that state.
func (s *suite) settle(t *testing.T, r providers.RefundRequest, res providers.RefundResult) providers.RefundResult {
	t.Helper()
	for i := 0; res.State == providers.RefundProcessing && i < settleQueries; i++ {
		var err error
		res, err = s.p.QueryRefund(ctxFor(t), r)
		if err != nil {
			t.Fatalf("QueryRefund(%s) while PROCESSING: %v", r.RefundNo, err)
		}
	}
	return res
}

// refundOK refunds r and requires it to succeed, at once or after queries.
func (s *suite) refundOK(t *testing.T, r providers.RefundRequest) providers.RefundResult {
	t.Helper()
	res, err := s.p.Refund(ctxFor(t), r)
	if err != nil {
		t.Fatalf("Refund(%s, %d fen): %v", r.RefundNo, r.RefundFen, err)
	}
	res = s.settle(t, r, res)
	if res.State != providers.RefundSucceeded {
		t.Fatalf("Refund(%s) = %+v, want %s", r.RefundNo, res, providers.RefundSucceeded)
	}
	if res.RefundFen != r.RefundFen {
		t.Errorf("Refund(%s).RefundFen = %d, want %d (this refund's amount, not the trade's total)", r.RefundNo, res.RefundFen, r.RefundFen)
	}
	return res
}

// wantRefunded checks what the emulator refunded under refundNo.
func (s *suite) wantRefunded(t *testing.T, refundNo string, want int64) {
	t.Helper()
	fen, calls := s.h.Refunded(refundNo)
	if fen != want {
		t.Errorf("emulator refunded %d fen under %s (after %d calls), want %d", fen, refundNo, calls, want)
	}
}

// wantKind requires err to be a *providers.Error of kind from this provider.
func (s *suite) wantKind(t *testing.T, what string, err error, kind providers.ErrorKind) {
	t.Helper()
	if err == nil {
		t.Fatalf("%s: no error, want %s", what, kind)
	}
	var pe *providers.Error
	if !errors.As(err, &pe) {
		t.Fatalf("%s: error %T %q is not a *providers.Error", what, err, err)
	}
	if pe.Kind != kind {
		t.Fatalf("%s: kind %s (%v), want %s", what, pe.Kind, err, kind)
	}
	if pe.Provider != s.p.Name() {
		t.Errorf("%s: Error.Provider = %q, want %q", what, pe.Provider, s.p.Name())
	}
	if pe.Op == "" {
		t.Errorf("%s: Error.Op is empty", what)
	}
}

// fault injects f on op until the returned func (or the test's end) clears it.
func (s *suite) fault(t *testing.T, op Op, f Fault) (clear func()) {
	t.Helper()
	s.h.InjectFault(op, f, 0)
	clear = func() { s.h.InjectFault(op, FaultNone, 0) }
	t.Cleanup(clear)
	return clear
}

func sameEvent(a, b providers.Event) bool {
	return a.Kind == b.Kind && a.NotifyID == b.NotifyID && a.OrderNo == b.OrderNo &&
		a.TradeNo == b.TradeNo && a.AmountFen == b.AmountFen && a.PaidAt.Equal(b.PaidAt) &&
		a.RefundNo == b.RefundNo && a.RefundFen == b.RefundFen && a.Merchant == b.Merchant
}

// ---- parallel subtests ----

func (s *suite) testName(t *testing.T) {
	t.Parallel()
	name := s.p.Name()
	if name == "" || name != strings.ToLower(name) || url.PathEscape(name) != name || strings.Contains(name, "/") {
		t.Fatalf("Name() = %q: want a lower-case path segment for /webhooks/{provider}", name)
	}
}

func (s *suite) testCreatePayment(t *testing.T) {
	t.Parallel()
	req := s.paymentRequest(s.orderNo(t), 1250)
	before := time.Now()
	check := func(a providers.PaymentAction) {
		t.Helper()
		switch a.Kind {
		case providers.ActionRedirect:
			u, err := url.Parse(a.URL)
			if err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Host == "" {
				t.Errorf("redirect URL %q is not an absolute http(s) URL (%v)", a.URL, err)
			}
		case providers.ActionQRCode:
			if strings.TrimSpace(a.QRCode) == "" {
				t.Errorf("QR action without QRCode: %+v", a)
			}
		default:
			t.Errorf("action kind %q, want %s or %s", a.Kind, providers.ActionRedirect, providers.ActionQRCode)
		}
		if a.ExpiresAt.IsZero() {
			t.Errorf("action has no ExpiresAt")
		} else if !a.ExpiresAt.After(before) || a.ExpiresAt.After(req.ExpiresAt.Add(time.Second)) {
			t.Errorf("action ExpiresAt %v, want after now and not after the order's %v", a.ExpiresAt, req.ExpiresAt)
		}
	}
	a, err := s.p.CreatePayment(ctxFor(t), req)
	if err != nil {
		t.Fatalf("CreatePayment: %v", err)
	}
	check(a)

	// A client retrying createOrder asks again with the same arguments.
	again, err := s.p.CreatePayment(ctxFor(t), req)
	if err != nil {
		t.Fatalf("CreatePayment again with the same arguments: %v", err)
	}
	check(again)
	if again.Kind != a.Kind {
		t.Errorf("CreatePayment again: kind %s, first %s", again.Kind, a.Kind)
	}
}

func (s *suite) testCreatePaymentUnknownMethod(t *testing.T) {
	t.Parallel()
	req := s.paymentRequest(s.orderNo(t), 1250)
	req.Method = "no-such-method"
	a, err := s.p.CreatePayment(ctxFor(t), req)
	s.wantKind(t, "CreatePayment with an unknown Method", err, providers.Unsupported)
	if a != (providers.PaymentAction{}) {
		t.Errorf("CreatePayment with an unknown Method returned an action: %+v", a)
	}
}

func (s *suite) testPaymentNotification(t *testing.T) {
	t.Parallel()
	// Amounts whose decimal forms trip up float conversions and padding.
	for _, amount := range []int64{1, 10, 100, 1250, 99999, 12345678} {
		t.Run(fmt.Sprint(amount), func(t *testing.T) {
			t.Parallel()
			orderNo := s.orderNo(t)
			if _, err := s.p.CreatePayment(ctxFor(t), s.paymentRequest(orderNo, amount)); err != nil {
				t.Fatalf("CreatePayment: %v", err)
			}
			header, body := s.h.Pay(t, orderNo, amount)
			ev, err := s.p.ParseNotification(ctxFor(t), header.Clone(), bytes.Clone(body))
			if err != nil {
				t.Fatalf("ParseNotification: %v", err)
			}
			if ev.Kind != providers.EventPaymentSucceeded {
				t.Errorf("Kind = %s, want %s", ev.Kind, providers.EventPaymentSucceeded)
			}
			if ev.OrderNo != orderNo {
				t.Errorf("OrderNo = %q, want %q", ev.OrderNo, orderNo)
			}
			if ev.AmountFen != amount {
				t.Errorf("AmountFen = %d, want %d", ev.AmountFen, amount)
			}
			if ev.TradeNo == "" {
				t.Errorf("no TradeNo")
			}
			if ev.NotifyID == "" {
				t.Errorf("no NotifyID")
			}
			if ev.PaidAt.IsZero() {
				t.Errorf("no PaidAt")
			}
			if ev.Merchant == "" {
				t.Errorf("no Merchant")
			}
			if ev.RefundNo != "" || ev.RefundFen != 0 {
				t.Errorf("payment event carries a refund: %q %d", ev.RefundNo, ev.RefundFen)
			}

			// A redelivery is the same notification: it must parse the same,
			// NotifyID included, so that it deduplicates.
			ev2, err := s.p.ParseNotification(ctxFor(t), header.Clone(), bytes.Clone(body))
			if err != nil {
				t.Fatalf("ParseNotification again: %v", err)
			}
			if !sameEvent(ev, ev2) {
				t.Errorf("the same notification parsed twice differs:\n%+v\n%+v", ev, ev2)
			}
		})
	}
}

func (s *suite) testNotificationIDsDiffer(t *testing.T) {
	t.Parallel()
	a, b := s.paid(t, 500), s.paid(t, 500)
	if a.NotifyID == b.NotifyID {
		t.Errorf("two payments share NotifyID %q: the second would be dropped as a duplicate", a.NotifyID)
	}
	if a.TradeNo == b.TradeNo {
		t.Errorf("two payments share TradeNo %q", a.TradeNo)
	}
}

func (s *suite) testInvalidNotifications(t *testing.T) {
	t.Parallel()
	type notification struct {
		header http.Header
		body   []byte
	}
	cases := map[string]func(t *testing.T) notification{
		"Forged": func(t *testing.T) notification {
			h, b := s.h.Forge(t, s.orderNo(t), 1250)
			return notification{h, b}
		},
		"OtherMerchant": func(t *testing.T) notification {
			h, b := s.h.OtherMerchant(t, s.orderNo(t), 1250)
			return notification{h, b}
		},
		"Tampered": func(t *testing.T) notification {
			orderNo := s.orderNo(t)
			h, b := s.h.Pay(t, orderNo, 1250)
			if other := s.orderNo(t); len(other) == len(orderNo) && bytes.Contains(b, []byte(orderNo)) {
				return notification{h, bytes.ReplaceAll(b, []byte(orderNo), []byte(other))}
			}
			// The order number is not in clear text (WeChat encrypts the
			// resource): change one character in the middle instead.
			b = bytes.Clone(b)
			i := len(b) / 2
			if b[i] == 'A' {
				b[i] = 'B'
			} else {
				b[i] = 'A'
			}
			return notification{h, b}
		},
		"Empty": func(t *testing.T) notification {
			return notification{http.Header{}, nil}
		},
		"Garbage": func(t *testing.T) notification {
			return notification{http.Header{"Content-Type": {"application/json"}}, []byte("\x00\xff{not a notification]]")}
		},
		"GarbageJSON": func(t *testing.T) notification {
			return notification{http.Header{"Content-Type": {"application/json"}}, []byte(`{"id":1,"resource":null,"amount":"-1"}`)}
		},
		"Oversized": func(t *testing.T) notification {
			// A genuine notification padded with whitespace past the limit.
			h, b := s.h.Pay(t, s.orderNo(t), 1250)
			pad := bytes.Repeat([]byte(" "), max(0, maxNotificationBytes+1-len(b)))
			return notification{h, append(bytes.Clone(b), pad...)}
		},
		"HugeGarbage": func(t *testing.T) notification {
			return notification{http.Header{}, bytes.Repeat([]byte("a"), 4*maxNotificationBytes)}
		},
	}
	for name, build := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			n := build(t)
			ev, err := s.p.ParseNotification(ctxFor(t), n.header, n.body)
			s.wantKind(t, "ParseNotification", err, providers.Invalid)
			if ev != (providers.Event{}) {
				t.Errorf("a refused notification returned an event: %+v", ev)
			}
		})
	}
}

func (s *suite) testAcknowledge(t *testing.T) {
	t.Parallel()
	ok := httptest.NewRecorder()
	s.p.Acknowledge(ok, nil)
	if ok.Code < 200 || ok.Code >= 300 {
		t.Fatalf("Acknowledge(nil) wrote status %d, want 2xx", ok.Code)
	}
	const secret = "db password hunter2 at 10.0.0.5"
	for name, err := range map[string]error{
		"Invalid": &providers.Error{Kind: providers.Invalid, Provider: s.p.Name(), Op: "notification", Message: secret},
		"Other":   errors.New(secret),
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			fail := httptest.NewRecorder()
			s.p.Acknowledge(fail, err)
			if fail.Code < 400 && bytes.Equal(fail.Body.Bytes(), ok.Body.Bytes()) {
				t.Errorf("Acknowledge(err) wrote status %d and the success body %q: the gateway would not send again", fail.Code, fail.Body)
			}
			if strings.Contains(fail.Body.String(), "hunter2") {
				t.Errorf("Acknowledge(err) leaked the error text to the gateway: %q", fail.Body)
			}
		})
	}
}

func (s *suite) testRefund(t *testing.T) {
	t.Parallel()
	ev := s.paid(t, 1250)
	r := s.refundRequest(t, ev, 1250)
	s.refundOK(t, r)
	s.wantRefunded(t, r.RefundNo, 1250)

	q, err := s.p.QueryRefund(ctxFor(t), r)
	if err != nil {
		t.Fatalf("QueryRefund: %v", err)
	}
	if q = s.settle(t, r, q); q.State != providers.RefundSucceeded || q.RefundFen != 1250 {
		t.Errorf("QueryRefund = %+v, want %s of 1250 fen", q, providers.RefundSucceeded)
	}

	// The same refund number again is the same refund: it reports success
	// and moves no more money.
	s.refundOK(t, r)
	s.wantRefunded(t, r.RefundNo, 1250)
	if _, calls := s.h.Refunded(r.RefundNo); calls < 2 {
		t.Errorf("emulator saw %d refund calls for %s, want at least 2", calls, r.RefundNo)
	}
}

func (s *suite) testPartialRefunds(t *testing.T) {
	t.Parallel()
	ev := s.paid(t, 1000)
	a := s.refundRequest(t, ev, 300)
	b := s.refundRequest(t, ev, 700)
	s.refundOK(t, a)
	s.refundOK(t, b)
	s.wantRefunded(t, a.RefundNo, 300)
	s.wantRefunded(t, b.RefundNo, 700)
	for _, r := range []providers.RefundRequest{a, b} {
		q, err := s.p.QueryRefund(ctxFor(t), r)
		if err != nil {
			t.Fatalf("QueryRefund(%s): %v", r.RefundNo, err)
		}
		if q = s.settle(t, r, q); q.State != providers.RefundSucceeded || q.RefundFen != r.RefundFen {
			t.Errorf("QueryRefund(%s) = %+v, want %s of %d fen", r.RefundNo, q, providers.RefundSucceeded, r.RefundFen)
		}
	}
}

func (s *suite) testRefundCanceledContext(t *testing.T) {
	t.Parallel()
	ev := s.paid(t, 1250)
	r := s.refundRequest(t, ev, 1250)
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	_, err := s.p.Refund(ctx, r)
	s.wantKind(t, "Refund with a canceled context", err, providers.Temporary)
	s.wantRefunded(t, r.RefundNo, 0)
}

func (s *suite) testQueryRefundUnknown(t *testing.T) {
	t.Parallel()
	ev := s.paid(t, 1250)
	r := s.refundRequest(t, ev, 1250)
	q, err := s.p.QueryRefund(ctxFor(t), r)
	if err != nil {
		t.Fatalf("QueryRefund of a refund never made: %v (want state %s, no error)", err, providers.RefundNotFound)
	}
	if q.State != providers.RefundNotFound {
		t.Errorf("QueryRefund of a refund never made = %+v, want %s", q, providers.RefundNotFound)
	}
	s.wantRefunded(t, r.RefundNo, 0)
}

func (s *suite) testRefundNotification(t *testing.T) {
	t.Parallel()
	if s.h.RefundNotification == nil {
		t.Skip("the gateway sends no refund notifications")
	}
	ev := s.paid(t, 1250)
	r := s.refundRequest(t, ev, 400)
	s.refundOK(t, r)
	header, body := s.h.RefundNotification(t, r.RefundNo)
	if body == nil {
		t.Skip("the gateway sends no refund notifications")
	}
	got, err := s.p.ParseNotification(ctxFor(t), header, body)
	if err != nil {
		t.Fatalf("ParseNotification of the refund notification: %v", err)
	}
	if got.Kind != providers.EventRefundSucceeded || got.RefundNo != r.RefundNo {
		t.Errorf("refund notification parsed to %+v, want %s for %s", got, providers.EventRefundSucceeded, r.RefundNo)
	}
	if got.OrderNo != "" && got.OrderNo != r.OrderNo {
		t.Errorf("refund notification names order %q, want %q", got.OrderNo, r.OrderNo)
	}
	if got.RefundFen != r.RefundFen {
		t.Errorf("refund notification RefundFen = %d, want %d", got.RefundFen, r.RefundFen)
	}
	if got.NotifyID == "" || got.NotifyID == ev.NotifyID {
		t.Errorf("refund notification NotifyID = %q (payment's %q): want its own", got.NotifyID, ev.NotifyID)
	}
}

func (s *suite) testQueryPayment(t *testing.T) {
	t.Parallel()
	if !s.h.SupportsQueryPayment {
		t.Skip("the gateway cannot be asked about a payment")
	}
	st, err := s.p.QueryPayment(ctxFor(t), s.orderNo(t))
	if err != nil {
		t.Fatalf("QueryPayment of a trade never created: %v (want %s, no error)", err, providers.TradeNotFound)
	}
	if st.Status != providers.TradeNotFound {
		t.Errorf("QueryPayment of a trade never created = %+v, want %s", st, providers.TradeNotFound)
	}

	orderNo := s.orderNo(t)
	if _, err := s.p.CreatePayment(ctxFor(t), s.paymentRequest(orderNo, 1250)); err != nil {
		t.Fatalf("CreatePayment: %v", err)
	}
	// A page payment may exist at the gateway only once the buyer opened it.
	st, err = s.p.QueryPayment(ctxFor(t), orderNo)
	if err != nil {
		t.Fatalf("QueryPayment of an unpaid trade: %v", err)
	}
	if st.Status != providers.TradeWaiting && st.Status != providers.TradeNotFound {
		t.Errorf("QueryPayment of an unpaid trade = %+v, want %s or %s", st, providers.TradeWaiting, providers.TradeNotFound)
	}

	// The notification is not delivered first: a lost notification is what
	// the query is for.
	header, body := s.h.Pay(t, orderNo, 1250)
	st, err = s.p.QueryPayment(ctxFor(t), orderNo)
	if err != nil {
		t.Fatalf("QueryPayment of a paid trade: %v", err)
	}
	if st.Status != providers.TradePaid || st.AmountFen != 1250 || st.TradeNo == "" {
		t.Errorf("QueryPayment of a paid trade = %+v, want %s of 1250 fen with a TradeNo", st, providers.TradePaid)
	}
	ev, err := s.p.ParseNotification(ctxFor(t), header, body)
	if err != nil {
		t.Fatalf("ParseNotification: %v", err)
	}
	if ev.TradeNo != st.TradeNo {
		t.Errorf("query TradeNo %q, notification TradeNo %q", st.TradeNo, ev.TradeNo)
	}
}

func (s *suite) testClosePayment(t *testing.T) {
	t.Parallel()
	if !s.h.SupportsClose {
		if err := s.p.ClosePayment(ctxFor(t), s.orderNo(t)); err != nil {
			t.Errorf("ClosePayment without gateway support must be a no-op, got %v", err)
		}
		return
	}
	if err := s.p.ClosePayment(ctxFor(t), s.orderNo(t)); err != nil {
		t.Errorf("ClosePayment of a trade never created: %v, want no error", err)
	}

	orderNo := s.orderNo(t)
	if _, err := s.p.CreatePayment(ctxFor(t), s.paymentRequest(orderNo, 1250)); err != nil {
		t.Fatalf("CreatePayment: %v", err)
	}
	var before providers.TradeState
	if s.h.SupportsQueryPayment {
		var err error
		if before, err = s.p.QueryPayment(ctxFor(t), orderNo); err != nil {
			t.Fatalf("QueryPayment before close: %v", err)
		}
	}
	if err := s.p.ClosePayment(ctxFor(t), orderNo); err != nil {
		t.Fatalf("ClosePayment of an unpaid trade: %v", err)
	}
	if err := s.p.ClosePayment(ctxFor(t), orderNo); err != nil {
		t.Errorf("ClosePayment again: %v, want no error", err)
	}

	// Closing a paid trade must not look like success: the close path would
	// then close an order whose buyer has paid.
	paid := s.paid(t, 1250)
	s.wantKind(t, "ClosePayment of a paid trade", s.p.ClosePayment(ctxFor(t), paid.OrderNo), providers.Rejected)

	if !s.h.SupportsQueryPayment {
		return
	}
	after, err := s.p.QueryPayment(ctxFor(t), orderNo)
	if err != nil {
		t.Fatalf("QueryPayment after close: %v", err)
	}
	// A trade the gateway never knew of (a page payment nobody opened) may
	// stay unknown; one it knew must now be closed.
	if after.Status != providers.TradeClosed && !(before.Status == providers.TradeNotFound && after.Status == providers.TradeNotFound) {
		t.Errorf("QueryPayment after close = %+v (before close %s), want %s", after, before.Status, providers.TradeClosed)
	}
}

// ---- fault subtests: sequential, each clears its fault ----

// refundAfterTemporary retries r once the fault is gone and requires that
// the refund happens exactly once.
func (s *suite) refundAfterTemporary(t *testing.T, r providers.RefundRequest) {
	t.Helper()
	s.refundOK(t, r)
	s.wantRefunded(t, r.RefundNo, r.RefundFen)
}

func (s *suite) testRefundTimeout(t *testing.T) {
	ev := s.paid(t, 1250)
	r := s.refundRequest(t, ev, 1250)
	clear := s.fault(t, OpRefund, FaultTimeout)
	_, err := s.p.Refund(ctxFor(t), r)
	s.wantKind(t, "Refund under FaultTimeout", err, providers.Temporary)
	clear()
	s.refundAfterTemporary(t, r)
}

func (s *suite) testRefund5xx(t *testing.T) {
	ev := s.paid(t, 1250)
	r := s.refundRequest(t, ev, 1250)
	clear := s.fault(t, OpRefund, Fault5xx)
	_, err := s.p.Refund(ctxFor(t), r)
	s.wantKind(t, "Refund under Fault5xx", err, providers.Temporary)
	clear()
	s.refundAfterTemporary(t, r)
}

func (s *suite) testRefundBusiness(t *testing.T) {
	ev := s.paid(t, 1250)
	r := s.refundRequest(t, ev, 1250)
	s.fault(t, OpRefund, FaultBusiness)
	_, err := s.p.Refund(ctxFor(t), r)
	s.wantKind(t, "Refund under FaultBusiness", err, providers.Rejected)
	s.wantRefunded(t, r.RefundNo, 0)
}

func (s *suite) testRefundSlow(t *testing.T) {
	ev := s.paid(t, 1250)
	r := s.refundRequest(t, ev, 1250)
	s.fault(t, OpRefund, FaultSlow)
	s.refundOK(t, r)
	s.wantRefunded(t, r.RefundNo, 1250)
}

// The promise the late-payment flow rests on: a refund whose answer was lost
// is found by QueryRefund, and retrying it never refunds twice.
func (s *suite) testRefundTimeoutAfterEffect(t *testing.T) {
	ev := s.paid(t, 1250)
	r := s.refundRequest(t, ev, 1250)
	clear := s.fault(t, OpRefund, FaultTimeoutAfterEffect)
	_, err := s.p.Refund(ctxFor(t), r)
	s.wantKind(t, "Refund under FaultTimeoutAfterEffect", err, providers.Temporary)
	clear()
	s.wantRefunded(t, r.RefundNo, 1250)

	q, err := s.p.QueryRefund(ctxFor(t), r)
	if err != nil {
		t.Fatalf("QueryRefund after a lost answer: %v", err)
	}
	if q = s.settle(t, r, q); q.State != providers.RefundSucceeded || q.RefundFen != 1250 {
		t.Fatalf("QueryRefund after a lost answer = %+v, want %s of 1250 fen", q, providers.RefundSucceeded)
	}
	s.refundOK(t, r)
	s.wantRefunded(t, r.RefundNo, 1250)
}

func (s *suite) testQueryRefundTemporary(t *testing.T) {
	ev := s.paid(t, 1250)
	r := s.refundRequest(t, ev, 1250)
	s.refundOK(t, r)
	for _, f := range []Fault{FaultTimeout, Fault5xx} {
		t.Run(string(f), func(t *testing.T) {
			clear := s.fault(t, OpQueryRefund, f)
			q, err := s.p.QueryRefund(ctxFor(t), r)
			// Above all a failed query must not look like "never refunded",
			// which would make the caller refund again.
			s.wantKind(t, "QueryRefund under "+string(f), err, providers.Temporary)
			if q.State == providers.RefundNotFound {
				t.Errorf("QueryRefund under %s reported %s", f, q.State)
			}
			clear()
			q, err = s.p.QueryRefund(ctxFor(t), r)
			if err != nil || s.settle(t, r, q).State != providers.RefundSucceeded {
				t.Errorf("QueryRefund once the fault is gone = %+v, %v", q, err)
			}
		})
	}
}

func (s *suite) testQueryPaymentTemporary(t *testing.T) {
	if !s.h.SupportsQueryPayment {
		t.Skip("the gateway cannot be asked about a payment")
	}
	for _, f := range []Fault{FaultTimeout, Fault5xx} {
		t.Run(string(f), func(t *testing.T) {
			ev := s.paid(t, 1250)
			s.fault(t, OpQueryPayment, f)
			st, err := s.p.QueryPayment(ctxFor(t), ev.OrderNo)
			// A failed query must not read as "not paid": the order would
			// be closed with the buyer's money taken.
			s.wantKind(t, "QueryPayment under "+string(f), err, providers.Temporary)
			if st.Status == providers.TradeNotFound || st.Status == providers.TradeWaiting || st.Status == providers.TradeClosed {
				t.Errorf("QueryPayment under %s reported %s", f, st.Status)
			}
		})
	}
}

func (s *suite) testCloseTemporary(t *testing.T) {
	if !s.h.SupportsClose {
		t.Skip("the gateway cannot close a payment")
	}
	orderNo := s.orderNo(t)
	if _, err := s.p.CreatePayment(ctxFor(t), s.paymentRequest(orderNo, 1250)); err != nil {
		t.Fatalf("CreatePayment: %v", err)
	}
	clear := s.fault(t, OpClose, Fault5xx)
	err := s.p.ClosePayment(ctxFor(t), orderNo)
	// A close that did not happen must not report success: the trade could
	// still be paid.
	s.wantKind(t, "ClosePayment under Fault5xx", err, providers.Temporary)
	clear()
	if err := s.p.ClosePayment(ctxFor(t), orderNo); err != nil {
		t.Errorf("ClosePayment once the fault is gone: %v", err)
	}
}

// ---- statements ----

func (s *suite) statements(t *testing.T) providers.StatementSource {
	t.Helper()
	src, ok := s.p.(providers.StatementSource)
	if !ok {
		t.Skip("the provider publishes no statement")
	}
	return src
}

// testStatement: the statement of a day lists the trades paid on it, with
// the numbers, amount and time their notifications gave, and the refunds
// made on it; a trade never paid is not in it. Other subtests pay at the
// same emulator, so only this test's rows are looked at.
func (s *suite) testStatement(t *testing.T) {
	t.Parallel()
	src := s.statements(t)
	a, b := s.paid(t, 1250), s.paid(t, 77)
	unpaid := s.orderNo(t)
	if _, err := s.p.CreatePayment(ctxFor(t), s.paymentRequest(unpaid, 500)); err != nil {
		t.Fatalf("CreatePayment: %v", err)
	}
	r := s.refundRequest(t, a, 300)
	s.refundOK(t, r)
	refundDay := providers.DayOf(time.Now())

	day := providers.DayOf(a.PaidAt)
	st, err := src.Statement(ctxFor(t), day)
	if err != nil {
		t.Fatalf("Statement(%s): %v", day, err)
	}
	if st.Provider != s.p.Name() || st.Day != day {
		t.Errorf("statement of %q %s, want %q %s", st.Provider, st.Day, s.p.Name(), day)
	}
	trades := map[string]providers.StatementTrade{}
	for _, tr := range st.Trades {
		trades[tr.OrderNo] = tr
	}
	for _, ev := range []providers.Event{a, b} {
		if providers.DayOf(ev.PaidAt) != day {
			continue // paid after midnight: in the next day's statement
		}
		tr, ok := trades[ev.OrderNo]
		if !ok {
			t.Errorf("the paid trade of %s is not in the statement of %s", ev.OrderNo, day)
			continue
		}
		if tr.TradeNo != ev.TradeNo || tr.AmountFen != ev.AmountFen || tr.Status != providers.TradePaid ||
			!tr.PaidAt.Truncate(time.Second).Equal(ev.PaidAt.Truncate(time.Second)) {
			t.Errorf("statement trade %+v, notification %+v", tr, ev)
		}
	}
	if _, ok := trades[unpaid]; ok {
		t.Errorf("the unpaid trade %s is in the statement", unpaid)
	}
	if refundDay != day {
		return // refunded after midnight
	}
	var found []providers.StatementRefund
	for _, sr := range st.Refunds {
		if sr.RefundNo == r.RefundNo {
			found = append(found, sr)
		}
	}
	if len(found) != 1 || found[0].AmountFen != 300 || found[0].Status != providers.RefundSucceeded ||
		found[0].OrderNo != a.OrderNo || (found[0].TradeNo != "" && found[0].TradeNo != a.TradeNo) {
		t.Errorf("statement refunds for %s: %+v, want one SUCCEEDED of 300 fen on %s", r.RefundNo, found, a.OrderNo)
	}
}

// testStatementOfAQuietDay: a day on which nothing happened is an empty
// statement, not an error.
func (s *suite) testStatementOfAQuietDay(t *testing.T) {
	t.Parallel()
	src := s.statements(t)
	quiet, err := providers.ParseDay("2001-01-01")
	if err != nil {
		t.Fatal(err)
	}
	st, err := src.Statement(ctxFor(t), quiet)
	if err != nil {
		t.Fatalf("Statement of a quiet day: %v", err)
	}
	if len(st.Trades)+len(st.Refunds) != 0 {
		t.Errorf("a quiet day's statement lists %d trades and %d refunds", len(st.Trades), len(st.Refunds))
	}
}

// testStatementTemporary: a statement that could not be had is an error,
// never an empty statement (which would say nothing was paid), nor one that
// reads as not published yet.
func (s *suite) testStatementTemporary(t *testing.T) {
	src := s.statements(t)
	s.paid(t, 1250)
	cases := []StatementFault{{OpStatement, FaultTimeout, providers.Temporary}, {OpStatement, Fault5xx, providers.Temporary}}
	for _, c := range append(cases, s.h.StatementFaults...) {
		t.Run(string(c.Op)+"/"+string(c.Fault), func(t *testing.T) {
			s.h.InjectFault(c.Op, c.Fault, 1)
			t.Cleanup(func() { s.h.InjectFault(c.Op, FaultNone, 0) })
			st, err := src.Statement(ctxFor(t), providers.DayOf(time.Now()))
			s.wantKind(t, "Statement under "+string(c.Fault), err, c.Kind)
			if st != nil {
				t.Errorf("Statement under %s returned a statement: %+v", c.Fault, st)
			}
			if providers.NotReady(err) {
				t.Errorf("Statement under %s reads as not published yet", c.Fault)
			}
			s.h.InjectFault(c.Op, FaultNone, 0)
			if _, err := src.Statement(ctxFor(t), providers.DayOf(time.Now())); err != nil {
				t.Errorf("Statement once the fault is gone: %v", err)
			}
		})
	}
}
