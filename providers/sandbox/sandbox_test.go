package sandbox_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"kami/domain/money"
	"kami/providers"
	"kami/providers/fault"
	"kami/providers/providertest"
	"kami/providers/sandbox"
)

const secret = "sandbox-test-secret"

// newSandbox returns a sandbox whose FaultTimeout hangs briefly, so the
// contract's timeout tests stay fast.
func newSandbox(t *testing.T, mod func(*sandbox.Config)) *sandbox.Provider {
	t.Helper()
	cfg := sandbox.Config{Secret: secret, BaseURL: "https://shop.example/", Timeout: 150 * time.Millisecond}
	if mod != nil {
		mod(&cfg)
	}
	p, err := sandbox.New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return p
}

func harness(p *sandbox.Provider) providertest.Harness {
	return providertest.Harness{
		Provider: p,
		Pay: func(t testing.TB, orderNo string, amountFen int64) (http.Header, []byte) {
			h, b, err := p.Pay(orderNo, amountFen)
			if err != nil {
				t.Fatalf("sandbox Pay(%s): %v", orderNo, err)
			}
			return h, b
		},
		RefundNotification: func(t testing.TB, refundNo string) (http.Header, []byte) {
			h, b, err := p.RefundNotification(refundNo)
			if err != nil {
				t.Fatalf("sandbox RefundNotification(%s): %v", refundNo, err)
			}
			return h, b
		},
		Forge: func(t testing.TB, orderNo string, amountFen int64) (http.Header, []byte) {
			return sandbox.Signed("not the sandbox secret", sandbox.PaymentNotification(orderNo, "SBFORGED", amountFen, time.Now()))
		},
		OtherMerchant: func(t testing.TB, orderNo string, amountFen int64) (http.Header, []byte) {
			n := sandbox.PaymentNotification(orderNo, "SBOTHER", amountFen, time.Now())
			n.Merchant = "another-shop"
			return sandbox.Signed(secret, n)
		},
		InjectFault:          p.InjectFault,
		Refunded:             p.Refunded,
		SupportsClose:        true,
		SupportsQueryPayment: true,
	}
}

func TestContract(t *testing.T) {
	t.Parallel()
	providertest.Run(t, harness(newSandbox(t, nil)))
}

func TestNewRefusesBadConfig(t *testing.T) {
	t.Parallel()
	for name, cfg := range map[string]sandbox.Config{
		"NoSecret":      {BaseURL: "https://shop.example"},
		"NoBaseURL":     {Secret: secret},
		"RelativeURL":   {Secret: secret, BaseURL: "/shop"},
		"OtherScheme":   {Secret: secret, BaseURL: "ftp://shop.example"},
		"QueryInBase":   {Secret: secret, BaseURL: "https://shop.example/?x=1"},
		"NotAURLAtAll":  {Secret: secret, BaseURL: "::"},
		"HostlessHTTPS": {Secret: secret, BaseURL: "https:///path"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			if _, err := sandbox.New(cfg); err == nil {
				t.Errorf("New(%+v) accepted it", cfg)
			}
		})
	}
}

func TestCreatePaymentURL(t *testing.T) {
	t.Parallel()
	p := newSandbox(t, nil)
	exp := time.Now().Add(time.Minute)
	a, err := p.CreatePayment(t.Context(), providers.PaymentRequest{OrderNo: "K2026/1", AmountFen: 1250, ExpiresAt: exp})
	if err != nil {
		t.Fatal(err)
	}
	if want := "https://shop.example/sandbox/pay/K2026%2F1"; a.URL != want || a.Kind != providers.ActionRedirect || !a.ExpiresAt.Equal(exp) {
		t.Errorf("CreatePayment = %+v, want a redirect to %s expiring %v", a, want, exp)
	}
}

func TestPayAfterCloseIsRefused(t *testing.T) {
	t.Parallel()
	p := newSandbox(t, nil)
	if err := p.ClosePayment(t.Context(), "K1"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := p.Pay("K1", 100); !errors.Is(err, sandbox.ErrTradeClosed) {
		t.Errorf("Pay after close: %v, want ErrTradeClosed", err)
	}
	if _, _, err := p.Pay("K2", 100); err != nil {
		t.Fatal(err)
	}
	err := p.ClosePayment(t.Context(), "K2")
	if providers.KindOf(err) != providers.Rejected {
		t.Errorf("ClosePayment of a paid trade: %v, want Rejected", err)
	}
}

func TestPayTwiceRedelivers(t *testing.T) {
	t.Parallel()
	p := newSandbox(t, nil)
	h1, b1, err := p.Pay("K1", 100)
	if err != nil {
		t.Fatal(err)
	}
	h2, b2, err := p.Pay("K1", 999)
	if err != nil {
		t.Fatal(err)
	}
	if string(b1) != string(b2) || h1.Get(sandbox.SignatureHeader) != h2.Get(sandbox.SignatureHeader) {
		t.Errorf("paying a paid trade again sent another notification:\n%s\n%s", b1, b2)
	}
}

func TestFailRefunds(t *testing.T) {
	t.Parallel()
	p := newSandbox(t, func(c *sandbox.Config) { c.FailRefunds = true })
	r := providers.RefundRequest{RefundNo: "R1", OrderNo: "K1", RefundFen: 100, TotalFen: 100}
	_, err := p.Refund(t.Context(), r)
	if providers.KindOf(err) != providers.Rejected {
		t.Errorf("Refund with FailRefunds: %v, want Rejected", err)
	}
	if fen, calls := p.Refunded("R1"); fen != 0 || calls != 1 {
		t.Errorf("Refunded = %d fen after %d calls, want 0 after 1", fen, calls)
	}
	q, err := p.QueryRefund(t.Context(), r)
	if err != nil || q.State != providers.RefundNotFound {
		t.Errorf("QueryRefund of a refused refund = %+v, %v; want NOT_FOUND", q, err)
	}
}

// A late payment posted straight to the webhook is unknown to the sandbox
// gateway; its refund must still succeed, as the sandbox promises (ARCHITECTURE.md).
func TestRefundOfPaymentTheGatewayNeverSaw(t *testing.T) {
	t.Parallel()
	p := newSandbox(t, nil)
	if err := p.ClosePayment(t.Context(), "K1"); err != nil {
		t.Fatal(err)
	}
	res, err := p.Refund(t.Context(), providers.RefundRequest{RefundNo: "R1", OrderNo: "K1", TradeNo: "T1", RefundFen: 500, TotalFen: 500})
	if err != nil || res.State != providers.RefundSucceeded || res.RefundFen != 500 {
		t.Errorf("Refund = %+v, %v", res, err)
	}
}

func TestRefundMoreThanPaidIsRejected(t *testing.T) {
	t.Parallel()
	p := newSandbox(t, nil)
	if _, _, err := p.Pay("K1", 1000); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Refund(t.Context(), providers.RefundRequest{RefundNo: "R1", OrderNo: "K1", RefundFen: 600, TotalFen: 1000}); err != nil {
		t.Fatal(err)
	}
	_, err := p.Refund(t.Context(), providers.RefundRequest{RefundNo: "R2", OrderNo: "K1", RefundFen: 600, TotalFen: 1000})
	if providers.KindOf(err) != providers.Rejected {
		t.Errorf("refunding 1200 of 1000 fen: %v, want Rejected", err)
	}
	if _, err := p.Refund(t.Context(), providers.RefundRequest{RefundNo: "R3", OrderNo: "K1", RefundFen: 400, TotalFen: 1000}); err != nil {
		t.Fatal(err)
	}
	if st, err := p.QueryPayment(t.Context(), "K1"); err != nil || st.Status != providers.TradeClosed {
		t.Errorf("QueryPayment of a fully refunded trade = %+v, %v; want CLOSED", st, err)
	}
}

func TestFaultCountRunsOut(t *testing.T) {
	t.Parallel()
	p := newSandbox(t, nil)
	p.InjectFault(fault.OpQueryPayment, fault.Server5xx, 2)
	for i, want := range []bool{true, true, false} {
		_, err := p.QueryPayment(t.Context(), "K1")
		if (err != nil) != want {
			t.Errorf("call %d: error %v, want error %v", i+1, err, want)
		}
	}
}

// ---- notifications ----

func TestParseNotification(t *testing.T) {
	t.Parallel()
	p := newSandbox(t, nil)
	paidAt := "2026-05-01T10:00:00+08:00"
	good := func(body string) (providers.Event, error) {
		return p.ParseNotification(t.Context(), sandbox.SignedBody(secret, []byte(body)), []byte(body))
	}

	ev, err := good(`{"orderNo":"K1","tradeNo":"T1","amount":"12.5","paidAt":"` + paidAt + `"}`)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := time.Parse(time.RFC3339, paidAt)
	if ev.Kind != providers.EventPaymentSucceeded || ev.OrderNo != "K1" || ev.TradeNo != "T1" || ev.AmountFen != 1250 ||
		!ev.PaidAt.Equal(want) || ev.Merchant != sandbox.DefaultMerchant || len(ev.NotifyID) != 64 {
		t.Errorf("payment parsed to %+v", ev)
	}

	ev, err = good(`{"type":"refund_failed","orderNo":"K1","tradeNo":"T1","refundNo":"R1","amount":"3.00"}`)
	if err != nil || ev.Kind != providers.EventRefundFailed || ev.RefundNo != "R1" || ev.RefundFen != 300 {
		t.Errorf("failed refund parsed to %+v, %v", ev, err)
	}

	for name, body := range map[string]string{
		"AmountNumber":      `{"orderNo":"K1","tradeNo":"T1","amount":12.50,"paidAt":"` + paidAt + `"}`,
		"AmountThreePlaces": `{"orderNo":"K1","tradeNo":"T1","amount":"12.505","paidAt":"` + paidAt + `"}`,
		"AmountExponent":    `{"orderNo":"K1","tradeNo":"T1","amount":"1e3","paidAt":"` + paidAt + `"}`,
		"AmountNegative":    `{"orderNo":"K1","tradeNo":"T1","amount":"-1.00","paidAt":"` + paidAt + `"}`,
		"AmountZero":        `{"orderNo":"K1","tradeNo":"T1","amount":"0.00","paidAt":"` + paidAt + `"}`,
		"NoPaidAt":          `{"orderNo":"K1","tradeNo":"T1","amount":"1.00"}`,
		"BadPaidAt":         `{"orderNo":"K1","tradeNo":"T1","amount":"1.00","paidAt":"yesterday"}`,
		"NoOrderNo":         `{"tradeNo":"T1","amount":"1.00","paidAt":"` + paidAt + `"}`,
		"ControlInOrderNo":  `{"orderNo":"K\n1","tradeNo":"T1","amount":"1.00","paidAt":"` + paidAt + `"}`,
		"UnknownField":      `{"orderNo":"K1","tradeNo":"T1","amount":"1.00","paidAt":"` + paidAt + `","extra":1}`,
		"TrailingData":      `{"orderNo":"K1","tradeNo":"T1","amount":"1.00","paidAt":"` + paidAt + `"}{}`,
		"UnknownType":       `{"type":"chargeback","orderNo":"K1","tradeNo":"T1","amount":"1.00","paidAt":"` + paidAt + `"}`,
		"RefundNoRefundNo":  `{"type":"refund","orderNo":"K1","tradeNo":"T1","amount":"1.00"}`,
		"PaymentRefundNo":   `{"orderNo":"K1","tradeNo":"T1","refundNo":"R1","amount":"1.00","paidAt":"` + paidAt + `"}`,
		"OtherMerchant":     `{"orderNo":"K1","tradeNo":"T1","amount":"1.00","paidAt":"` + paidAt + `","merchant":"x"}`,
		"NotAnObject":       `["K1","T1"]`,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ev, err := good(body)
			if providers.KindOf(err) != providers.Invalid || ev != (providers.Event{}) {
				t.Errorf("ParseNotification(%s) = %+v, %v; want Invalid", body, ev, err)
			}
		})
	}
}

func TestParseNotificationSignature(t *testing.T) {
	t.Parallel()
	p := newSandbox(t, nil)
	header, body, err := p.Pay("K1", 1250)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.ParseNotification(t.Context(), header, body); err != nil {
		t.Fatalf("genuine notification: %v", err)
	}
	upper := header.Clone()
	upper.Set(sandbox.SignatureHeader, strings.ToUpper(header.Get(sandbox.SignatureHeader)))
	if _, err := p.ParseNotification(t.Context(), upper, body); err != nil {
		t.Errorf("upper-case hex signature: %v", err)
	}

	// Signed by the right key and valid JSON once the padding is skipped:
	// only the size limit refuses it.
	oversized := append([]byte(strings.Repeat(" ", sandbox.MaxNotificationBytes)), body...)

	tampered := []byte(strings.Replace(string(body), `"12.50"`, `"1.50"`, 1))
	if string(tampered) == string(body) {
		t.Fatalf("amount not found in %s", body)
	}
	otherKey := sandbox.SignedBody("another secret", body)
	truncated := header.Clone()
	truncated.Set(sandbox.SignatureHeader, header.Get(sandbox.SignatureHeader)[:32])
	notHex := header.Clone()
	notHex.Set(sandbox.SignatureHeader, strings.Repeat("zz", 32))
	for name, c := range map[string]struct {
		header http.Header
		body   []byte
	}{
		"TamperedAmount": {header, tampered},
		"OtherKey":       {otherKey, body},
		"NoSignature":    {http.Header{}, body},
		"Truncated":      {truncated, body},
		"NotHex":         {notHex, body},
		"Oversized":      {sandbox.SignedBody(secret, oversized), oversized},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ev, err := p.ParseNotification(t.Context(), c.header, c.body)
			var pe *providers.Error
			if !errors.As(err, &pe) || pe.Kind != providers.Invalid || ev != (providers.Event{}) {
				t.Errorf("ParseNotification = %+v, %v; want an Invalid *providers.Error", ev, err)
			}
		})
	}
}

func FuzzParseNotification(f *testing.F) {
	p, err := sandbox.New(sandbox.Config{Secret: secret, BaseURL: "https://shop.example"})
	if err != nil {
		f.Fatal(err)
	}
	_, body, _ := p.Pay("K1", 1250)
	f.Add(body, true, "")
	f.Add(body, false, sandbox.Sign(secret, body))
	f.Add(body, false, sandbox.Sign("x", body))
	_, refund := sandbox.Signed(secret, sandbox.Notification{Type: sandbox.TypeRefund, OrderNo: "K1", TradeNo: "T", RefundNo: "R1", Amount: "0.01"})
	f.Add(refund, true, "")
	f.Add([]byte(`{"orderNo":"K1","tradeNo":"T1","amount":"99999999.99","paidAt":"2026-01-01T00:00:00Z"}`), true, "")
	f.Add([]byte(`{"orderNo":"","amount":"1e400"}`), true, "")
	f.Add([]byte{}, false, "")
	f.Fuzz(func(t *testing.T, body []byte, sign bool, sig string) {
		header := http.Header{}
		header.Set(sandbox.SignatureHeader, sig)
		if sign {
			header = sandbox.SignedBody(secret, body)
		}
		ev, err := p.ParseNotification(context.Background(), header, body)
		if err != nil {
			var pe *providers.Error
			if !errors.As(err, &pe) || pe.Kind != providers.Invalid || ev != (providers.Event{}) {
				t.Fatalf("refusal = %+v, %v; want an Invalid *providers.Error and no event", ev, err)
			}
			return
		}
		if !strings.EqualFold(strings.TrimSpace(header.Get(sandbox.SignatureHeader)), sandbox.Sign(secret, body)) {
			t.Fatalf("accepted a body its signature does not cover: %q", body)
		}
		if len(body) > sandbox.MaxNotificationBytes {
			t.Fatalf("accepted %d bytes", len(body))
		}
		if ev.NotifyID != sandbox.NotifyID(body) || ev.OrderNo == "" || ev.TradeNo == "" || ev.Merchant != sandbox.DefaultMerchant {
			t.Fatalf("accepted event %+v", ev)
		}
		switch ev.Kind {
		case providers.EventPaymentSucceeded:
			if ev.AmountFen <= 0 || ev.AmountFen > money.MaxFen || ev.PaidAt.IsZero() || ev.RefundNo != "" {
				t.Fatalf("payment event %+v", ev)
			}
		case providers.EventRefundSucceeded, providers.EventRefundFailed:
			if ev.RefundFen <= 0 || ev.RefundFen > money.MaxFen || ev.RefundNo == "" {
				t.Fatalf("refund event %+v", ev)
			}
		default:
			t.Fatalf("event kind %q", ev.Kind)
		}
	})
}

// ---- pay page ----

type shop struct {
	mu     sync.Mutex
	orders map[string]sandbox.PageOrder
	events []providers.Event
	bodies [][]byte
	refuse bool // the webhook fails
}

func (s *shop) lookup(_ context.Context, orderNo string) (sandbox.PageOrder, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	o, ok := s.orders[orderNo]
	if !ok {
		return sandbox.PageOrder{}, sandbox.ErrOrderNotFound
	}
	return o, nil
}

// notify is kami's webhook in small: verify, then record.
func (s *shop) notify(p *sandbox.Provider) func(context.Context, http.Header, []byte) error {
	return func(ctx context.Context, header http.Header, body []byte) error {
		ev, err := p.ParseNotification(ctx, header, body)
		s.mu.Lock()
		defer s.mu.Unlock()
		s.bodies = append(s.bodies, body)
		if err != nil {
			return err
		}
		if s.refuse {
			return errors.New("database is down at 10.0.0.5")
		}
		s.events = append(s.events, ev)
		// What kami does with a payment: deliver a PENDING order, refund
		// one that closed.
		if o, ok := s.orders[ev.OrderNo]; ok && ev.Kind == providers.EventPaymentSucceeded {
			switch o.Status {
			case "PENDING":
				o.Status = "PAID"
			case "CLOSED":
				o.Status = "REFUNDING"
			}
			s.orders[ev.OrderNo] = o
		}
		return nil
	}
}

type pageBundle struct {
	p       *sandbox.Provider
	shop    *shop
	handler http.Handler
	now     time.Time
}

func setupPage(t *testing.T) pageBundle {
	t.Helper()
	now := time.Date(2026, 5, 1, 10, 0, 0, 0, time.UTC)
	p := newSandbox(t, func(c *sandbox.Config) { c.Now = func() time.Time { return now } })
	s := &shop{orders: map[string]sandbox.PageOrder{
		"K1": {OrderNo: "K1", Subject: `Steam <b>100</b> & "card"`, AmountFen: 1250, ExpiresAt: now.Add(14*time.Minute + 5*time.Second), Status: "PENDING",
			ReturnURL: "https://shop.example/orders?orderNo=K1"},
		"K2": {OrderNo: "K2", Subject: "Steam 50", AmountFen: 5000, ExpiresAt: now.Add(-time.Minute), Status: "CLOSED",
			ReturnURL: "https://shop.example/orders?orderNo=K2"},
	}}
	return pageBundle{p: p, shop: s, handler: p.PayPage(s.lookup, s.notify(p)), now: now}
}

func (b pageBundle) do(method, target string, header http.Header) *httptest.ResponseRecorder {
	req := httptest.NewRequest(method, target, nil)
	for k, v := range header {
		req.Header[k] = v
	}
	rec := httptest.NewRecorder()
	b.handler.ServeHTTP(rec, req)
	return rec
}

func TestPayPageShowsOrder(t *testing.T) {
	t.Parallel()
	b := setupPage(t)
	rec := b.do("GET", "/sandbox/pay/K1", nil)
	page := rec.Body.String()
	if rec.Code != http.StatusOK || !strings.HasPrefix(rec.Header().Get("Content-Type"), "text/html") {
		t.Fatalf("GET = %d %s", rec.Code, rec.Header().Get("Content-Type"))
	}
	for _, want := range []string{
		"¥12.50",
		"Steam &lt;b&gt;100&lt;/b&gt; &amp; &#34;card&#34;", // escaped, never markup
		"14:05", // the countdown without script
		`data-expires="` + "1777630445000" + `"`,
		`<form id="pay" method="post">`,
	} {
		if !strings.Contains(page, want) {
			t.Errorf("page lacks %q:\n%s", want, page)
		}
	}
	if strings.Contains(page, "<b>100") {
		t.Errorf("subject was not escaped")
	}
	if b.now.Add(14*time.Minute+5*time.Second).UnixMilli() != 1777630445000 {
		t.Fatalf("the test's expiry constant is wrong")
	}
	csp := rec.Header().Get("Content-Security-Policy")
	if !strings.Contains(page, `<script nonce="`) || !strings.Contains(csp, "script-src 'nonce-") {
		t.Errorf("script not allowed by nonce: CSP %q", csp)
	}
}

func TestPayPageUnknownOrder(t *testing.T) {
	t.Parallel()
	b := setupPage(t)
	for _, path := range []string{"/sandbox/pay/NOPE", "/sandbox/pay/" + strings.Repeat("x", 200)} {
		if rec := b.do("GET", path, nil); rec.Code != http.StatusNotFound {
			t.Errorf("GET %s = %d, want 404", path[:min(len(path), 30)], rec.Code)
		}
		if rec := b.do("POST", path, nil); rec.Code != http.StatusNotFound {
			t.Errorf("POST %s = %d, want 404", path[:min(len(path), 30)], rec.Code)
		}
	}
	if len(b.shop.bodies) != 0 {
		t.Errorf("an unknown order was notified")
	}
}

func TestPayPagePays(t *testing.T) {
	t.Parallel()
	b := setupPage(t)
	rec := b.do("POST", "/sandbox/pay/K1", http.Header{"Sec-Fetch-Site": {"same-origin"}})
	if rec.Code != http.StatusOK || !strings.Contains(rec.Body.String(), "accepted") {
		t.Fatalf("POST = %d:\n%s", rec.Code, rec.Body)
	}
	if len(b.shop.events) != 1 {
		t.Fatalf("notify received %d verified events, want 1", len(b.shop.events))
	}
	ev := b.shop.events[0]
	if ev.Kind != providers.EventPaymentSucceeded || ev.OrderNo != "K1" || ev.AmountFen != 1250 || !ev.PaidAt.Equal(b.now) {
		t.Errorf("notified event %+v", ev)
	}
	st, err := b.p.QueryPayment(t.Context(), "K1")
	if err != nil || st.Status != providers.TradePaid || st.TradeNo != ev.TradeNo || st.AmountFen != 1250 {
		t.Errorf("QueryPayment after paying = %+v, %v", st, err)
	}
	// The answer shows the order as the shop has it now: PAID, no Pay
	// button, and the way back to the order.
	for name, page := range map[string]string{"answer": rec.Body.String(), "page": b.do("GET", "/sandbox/pay/K1", nil).Body.String()} {
		if !strings.Contains(page, `<strong id="status">PAID</strong>`) || strings.Contains(page, "<form") || strings.Contains(page, "PENDING") ||
			!strings.Contains(page, `<a id="back" href="https://shop.example/orders?orderNo=K1">`) {
			t.Errorf("%s after paying:\n%s", name, page)
		}
	}
}

// TestPayPageExpired: past its expiry an order cannot be paid from the
// page (as a gateway told the expiry refuses it), the page says so without
// a click, and follows the order until the shop closes it.
func TestPayPageExpired(t *testing.T) {
	t.Parallel()
	b := setupPage(t)
	b.shop.orders["K1"] = sandbox.PageOrder{OrderNo: "K1", Subject: "x", AmountFen: 1250, ExpiresAt: b.now, Status: "PENDING"}
	page := b.do("GET", "/sandbox/pay/K1", nil).Body.String()
	if !strings.Contains(page, "<h1 id=\"title\">Expired</h1>") || strings.Contains(page, "<form") || !strings.Contains(page, "location.reload()") {
		t.Errorf("page of an expired order:\n%s", page)
	}
	if rec := b.do("POST", "/sandbox/pay/K1", nil); rec.Code != http.StatusConflict || len(b.shop.bodies) != 0 {
		t.Errorf("POST on an expired order = %d, %d notifications", rec.Code, len(b.shop.bodies))
	}
	// A page opened before the expiry turns itself: its script knows when.
	b.shop.orders["K1"] = sandbox.PageOrder{OrderNo: "K1", Subject: "x", AmountFen: 1250, ExpiresAt: b.now.Add(time.Second), Status: "PENDING"}
	page = b.do("GET", "/sandbox/pay/K1", nil).Body.String()
	if !strings.Contains(page, `data-expires="`) || !strings.Contains(page, `form.remove()`) {
		t.Errorf("page before the expiry has no countdown that ends the Pay button:\n%s", page)
	}
}

// TestPayPageLatePayment: a CLOSED order's page offers, clearly labelled,
// to simulate a late payment; it pays the closed trade at the gateway and
// notifies the shop, and the page then shows the refund the shop started.
func TestPayPageLatePayment(t *testing.T) {
	t.Parallel()
	b := setupPage(t)
	if err := b.p.ClosePayment(t.Context(), "K2"); err != nil { // the shop closed it
		t.Fatal(err)
	}
	page := b.do("GET", "/sandbox/pay/K2", nil).Body.String()
	if !strings.Contains(page, `<form class="late" method="post" action="K2/late">`) || !strings.Contains(page, "Sandbox only: simulate a late payment.") ||
		strings.Contains(page, `id="pay"`) {
		t.Fatalf("page of a closed order:\n%s", page)
	}
	if rec := b.do("POST", "/sandbox/pay/K2/late", http.Header{"Sec-Fetch-Site": {"cross-site"}}); rec.Code != http.StatusForbidden {
		t.Errorf("cross-site late payment = %d", rec.Code)
	}
	if rec := b.do("POST", "/sandbox/pay/K1/late", nil); rec.Code != http.StatusConflict {
		t.Errorf("late payment of a PENDING order = %d, want 409", rec.Code)
	}
	if len(b.shop.bodies) != 0 {
		t.Fatalf("refused late payments were notified")
	}
	rec := b.do("POST", "/sandbox/pay/K2/late", http.Header{"Sec-Fetch-Site": {"same-origin"}})
	if rec.Code != http.StatusOK || len(b.shop.events) != 1 {
		t.Fatalf("late payment = %d, %d events:\n%s", rec.Code, len(b.shop.events), rec.Body)
	}
	ev := b.shop.events[0]
	if ev.Kind != providers.EventPaymentSucceeded || ev.OrderNo != "K2" || ev.AmountFen != 5000 {
		t.Errorf("late payment event %+v", ev)
	}
	if st, _ := b.p.QueryPayment(t.Context(), "K2"); st.Status != providers.TradePaid || st.TradeNo != ev.TradeNo {
		t.Errorf("the gateway did not take the late payment: %+v", st)
	}
	if page := rec.Body.String(); !strings.Contains(page, `<strong id="status">REFUNDING</strong>`) || !strings.Contains(page, "location.reload()") ||
		strings.Contains(page, "<form") {
		t.Errorf("page after the late payment:\n%s", page)
	}
	// The refund of that payment goes through: the trade knows its amount.
	res, err := b.p.Refund(t.Context(), providers.RefundRequest{RefundNo: "R-K2", OrderNo: "K2", TradeNo: ev.TradeNo, RefundFen: 5000, TotalFen: 5000})
	if err != nil || res.State != providers.RefundSucceeded {
		t.Errorf("refund of the late payment: %+v %v", res, err)
	}
}

func TestPayPageRedeliversWhenTheShopFailed(t *testing.T) {
	t.Parallel()
	b := setupPage(t)
	b.shop.refuse = true
	rec := b.do("POST", "/sandbox/pay/K1", nil)
	if rec.Code != http.StatusBadGateway {
		t.Fatalf("POST with the webhook failing = %d, want 502", rec.Code)
	}
	if strings.Contains(rec.Body.String(), "10.0.0.5") {
		t.Errorf("page shows the shop's error text")
	}
	b.shop.refuse = false
	if rec := b.do("POST", "/sandbox/pay/K1", nil); rec.Code != http.StatusOK {
		t.Fatalf("second POST = %d", rec.Code)
	}
	if len(b.shop.bodies) != 2 || string(b.shop.bodies[0]) != string(b.shop.bodies[1]) {
		t.Errorf("the retry was not the same notification: %q", b.shop.bodies)
	}
	if len(b.shop.events) != 1 {
		t.Errorf("shop recorded %d events, want 1", len(b.shop.events))
	}
}

func TestPayPageClosedTrade(t *testing.T) {
	t.Parallel()
	b := setupPage(t)
	if err := b.p.ClosePayment(t.Context(), "K1"); err != nil {
		t.Fatal(err)
	}
	if page := b.do("GET", "/sandbox/pay/K1", nil).Body.String(); strings.Contains(page, "<form") {
		t.Errorf("a closed trade's page offers to pay:\n%s", page)
	}
	if rec := b.do("POST", "/sandbox/pay/K1", nil); rec.Code != http.StatusConflict {
		t.Errorf("POST on a closed trade = %d, want 409", rec.Code)
	}
	if len(b.shop.bodies) != 0 {
		t.Errorf("a closed trade was notified")
	}
}

func TestPayPageRefusesCrossSitePost(t *testing.T) {
	t.Parallel()
	b := setupPage(t)
	rec := b.do("POST", "/sandbox/pay/K1", http.Header{"Sec-Fetch-Site": {"cross-site"}})
	if rec.Code != http.StatusForbidden {
		t.Errorf("cross-site POST = %d, want 403", rec.Code)
	}
	if len(b.shop.bodies) != 0 {
		t.Errorf("a cross-site POST paid")
	}
}

func TestPayPageLookupError(t *testing.T) {
	t.Parallel()
	p := newSandbox(t, nil)
	h := p.PayPage(func(context.Context, string) (sandbox.PageOrder, error) {
		return sandbox.PageOrder{}, errors.New("sql: connection refused at db:5432")
	}, func(context.Context, http.Header, []byte) error {
		t.Error("notify called")
		return nil
	})
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest("GET", "/sandbox/pay/K1", nil))
	if rec.Code != http.StatusInternalServerError || strings.Contains(rec.Body.String(), "5432") {
		t.Errorf("lookup failure = %d:\n%s", rec.Code, rec.Body)
	}
}
