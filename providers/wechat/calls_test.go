package wechat_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"kami/providers"
	"kami/providers/providertest"
	"kami/providers/wechat"
)

func payment(t testing.TB, orderNo string, fen int64) providers.PaymentRequest {
	return providers.PaymentRequest{
		OrderNo: orderNo, AmountFen: fen, Subject: "月卡 30 天", ClientIP: "203.0.113.7",
		ExpiresAt: time.Now().Add(15 * time.Minute).Truncate(time.Second),
	}
}

func wantErr(t *testing.T, what string, err error, kind providers.ErrorKind, code string) *providers.Error {
	t.Helper()
	var pe *providers.Error
	if !errors.As(err, &pe) {
		t.Fatalf("%s: error %v (%T), want *providers.Error", what, err, err)
	}
	if pe.Kind != kind || (code != "" && pe.Code != code) {
		t.Fatalf("%s: %v, want kind %s code %q", what, err, kind, code)
	}
	return pe
}

// paid creates and pays orderNo, returning its trade number.
func paid(t *testing.T, b *bundle, orderNo string, fen int64) string {
	t.Helper()
	if _, err := b.client.CreatePayment(t.Context(), payment(t, orderNo, fen)); err != nil {
		t.Fatalf("CreatePayment: %v", err)
	}
	h, body := must(t)(b.emu.Pay(orderNo, fen))
	ev, err := b.client.ParseNotification(t.Context(), h, body)
	if err != nil {
		t.Fatalf("payment notification: %v", err)
	}
	return ev.TradeNo
}

func TestCreatePayment(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ctx := t.Context()

	p := payment(t, "CREATE0001", 1250)
	a, err := b.client.CreatePayment(ctx, p)
	if err != nil {
		t.Fatalf("native: %v", err)
	}
	if a.Kind != providers.ActionQRCode || !strings.HasPrefix(a.QRCode, "weixin://") || !a.ExpiresAt.Equal(p.ExpiresAt) {
		t.Errorf("native: %+v", a)
	}

	p = payment(t, "CREATE0002", 99)
	p.Method = "h5"
	a, err = b.client.CreatePayment(ctx, p)
	if err != nil {
		t.Fatalf("h5: %v", err)
	}
	if a.Kind != providers.ActionRedirect || !strings.HasPrefix(a.URL, "https://") {
		t.Errorf("h5: %+v", a)
	}

	p.OrderNo, p.ClientIP = "CREATE0003", ""
	_, err = b.client.CreatePayment(ctx, p)
	wantErr(t, "h5 without the buyer's IP", err, providers.Rejected, "PARAM_ERROR")

	p = payment(t, "CREATE0004", 100)
	p.Method = "jsapi"
	_, err = b.client.CreatePayment(ctx, p)
	wantErr(t, "jsapi", err, providers.Unsupported, "")

	// The gateway refuses, the adapter says so with the gateway's code.
	_, err = b.client.CreatePayment(ctx, payment(t, "CREATE0001", 1300))
	wantErr(t, "same order number, other amount", err, providers.Rejected, "INVALID_REQUEST")
	_, err = b.client.CreatePayment(ctx, payment(t, "CREATE0005", 0))
	wantErr(t, "zero amount", err, providers.Rejected, "PARAM_ERROR")

	// A number that gopay would paste into a URL path is refused before.
	_, err = b.client.CreatePayment(ctx, payment(t, "../v3/refund", 100))
	wantErr(t, "order number with a path", err, providers.Rejected, "PARAM_ERROR")

	paid(t, b, "CREATE0006", 100)
	_, err = b.client.CreatePayment(ctx, payment(t, "CREATE0006", 100))
	wantErr(t, "paid order", err, providers.Rejected, "ORDERPAID")
}

func TestRefundRules(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ctx := t.Context()
	tradeNo := paid(t, b, "REFUNDS001", 1000)

	r := providers.RefundRequest{RefundNo: "RFD1", OrderNo: "REFUNDS001", RefundFen: 1001, TotalFen: 1000}
	_, err := b.client.Refund(ctx, r)
	wantErr(t, "refund above the paid amount", err, providers.Rejected, "INVALID_REQUEST")

	r.RefundFen = 600
	res, err := b.client.Refund(ctx, r)
	if err != nil || res.State != providers.RefundSucceeded || res.RefundFen != 600 || res.ProviderRefundID == "" {
		t.Fatalf("refund 600 of 1000: %+v, %v", res, err)
	}
	// By the trade number alone, as the gateway also allows.
	r2 := providers.RefundRequest{RefundNo: "RFD2", TradeNo: tradeNo, RefundFen: 401, TotalFen: 1000}
	_, err = b.client.Refund(ctx, r2)
	wantErr(t, "second refund above what is left", err, providers.Rejected, "INVALID_REQUEST")
	r2.RefundFen = 400
	if res, err := b.client.Refund(ctx, r2); err != nil || res.State != providers.RefundSucceeded {
		t.Fatalf("refund of the rest by transaction_id: %+v, %v", res, err)
	}

	// The same number with another amount is not a new refund.
	r.RefundFen = 300
	_, err = b.client.Refund(ctx, r)
	wantErr(t, "same refund number, other amount", err, providers.Rejected, "INVALID_REQUEST")
	if fen, calls := b.emu.Refunded("RFD1"); fen != 600 || calls != 3 {
		t.Errorf("emulator: RFD1 refunded %d in %d calls, want 600 in 3", fen, calls)
	}

	_, err = b.client.Refund(ctx, providers.RefundRequest{RefundNo: "RFD3", OrderNo: "NEVERMADE1", RefundFen: 1, TotalFen: 1})
	wantErr(t, "refund of an unknown trade", err, providers.Rejected, "RESOURCE_NOT_EXISTS")

	if _, err := b.client.CreatePayment(ctx, payment(t, "REFUNDS002", 100)); err != nil {
		t.Fatal(err)
	}
	_, err = b.client.Refund(ctx, providers.RefundRequest{RefundNo: "RFD4", OrderNo: "REFUNDS002", RefundFen: 100, TotalFen: 100})
	wantErr(t, "refund of an unpaid trade", err, providers.Rejected, "INVALID_REQUEST")

	st, err := b.client.QueryPayment(ctx, "REFUNDS001")
	if err != nil || st.Status != providers.TradePaid || st.TradeNo != tradeNo || st.AmountFen != 1000 {
		t.Errorf("QueryPayment of a refunded trade = %+v, %v; want %s (REFUND is still paid)", st, err, providers.TradePaid)
	}
}

func TestQueryAndClose(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ctx := t.Context()

	if _, err := b.client.CreatePayment(ctx, payment(t, "CLOSE00001", 100)); err != nil {
		t.Fatal(err)
	}
	if st, err := b.client.QueryPayment(ctx, "CLOSE00001"); err != nil || st.Status != providers.TradeWaiting {
		t.Fatalf("unpaid: %+v, %v", st, err)
	}
	if err := b.client.ClosePayment(ctx, "CLOSE00001"); err != nil {
		t.Fatal(err)
	}
	if st, err := b.client.QueryPayment(ctx, "CLOSE00001"); err != nil || st.Status != providers.TradeClosed {
		t.Fatalf("closed: %+v, %v", st, err)
	}

	paid(t, b, "CLOSE00002", 100)
	err := b.client.ClosePayment(ctx, "CLOSE00002")
	wantErr(t, "close of a paid trade", err, providers.Rejected, "ORDERPAID")
}

// A trade whose payment failed at the bank (PAYERROR) can still be paid:
// WeChat says to close it before giving up on it. It must not read as
// closed, or the pre-close check closes the order without closing the
// trade and the buyer can still pay it.
func TestAPaymentErrorIsNotAClosedTrade(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ctx := t.Context()
	if _, err := b.client.CreatePayment(ctx, payment(t, "PAYERR0001", 100)); err != nil {
		t.Fatal(err)
	}
	if err := b.emu.SetTradeState("PAYERR0001", "PAYERROR"); err != nil {
		t.Fatal(err)
	}
	if st, err := b.client.QueryPayment(ctx, "PAYERR0001"); err != nil || st.Status != providers.TradeWaiting {
		t.Fatalf("payment error: %+v, %v (want %s)", st, err, providers.TradeWaiting)
	}
}

// Each injected fault, on each call, comes out as the kind the ledger acts on.
func TestFaultKinds(t *testing.T) {
	t.Parallel()
	type call func(ctx context.Context, c *wechat.Client, no string) error
	calls := map[providertest.Op]call{
		providertest.OpCreate: func(ctx context.Context, c *wechat.Client, no string) error {
			_, err := c.CreatePayment(ctx, payment(t, no, 100))
			return err
		},
		providertest.OpRefund: func(ctx context.Context, c *wechat.Client, no string) error {
			_, err := c.Refund(ctx, providers.RefundRequest{RefundNo: "R" + no, OrderNo: no, RefundFen: 100, TotalFen: 100})
			return err
		},
		providertest.OpQueryRefund: func(ctx context.Context, c *wechat.Client, no string) error {
			_, err := c.QueryRefund(ctx, providers.RefundRequest{RefundNo: "R" + no, OrderNo: no})
			return err
		},
		providertest.OpQueryPayment: func(ctx context.Context, c *wechat.Client, no string) error {
			_, err := c.QueryPayment(ctx, no)
			return err
		},
		providertest.OpClose: func(ctx context.Context, c *wechat.Client, no string) error {
			return c.ClosePayment(ctx, no)
		},
	}
	faults := []struct {
		f    providertest.Fault
		kind providers.ErrorKind // "" means success
	}{
		{providertest.FaultTimeout, providers.Temporary},
		{providertest.Fault5xx, providers.Temporary},
		{providertest.FaultBusiness, providers.Rejected},
		{providertest.FaultSlow, ""},
		{providertest.FaultTimeoutAfterEffect, providers.Temporary},
	}
	for op, call := range calls {
		for _, f := range faults {
			t.Run(string(op)+"/"+string(f.f), func(t *testing.T) {
				t.Parallel()
				// One emulator per case: faults are global to it.
				b := setup(t, setupOptions{})
				ctx := t.Context()
				no := "FAULT" + strings.ToUpper(strings.ReplaceAll(string(op)+string(f.f), "-", ""))
				no = no[:min(len(no), 32)]
				// Make every call succeed without a fault: a paid trade
				// with a refund (the close then is of another trade).
				paid(t, b, no, 100)
				if op == providertest.OpQueryRefund {
					if err := calls[providertest.OpRefund](ctx, b.client, no); err != nil {
						t.Fatal(err)
					}
				}
				target := no
				if op == providertest.OpClose || op == providertest.OpCreate {
					target = no[:len(no)-1] + "Z"
				}
				n := 1
				if f.f == providertest.Fault5xx {
					n = 2 // both forms: the gateway's 500 and the balancer's 503
				}
				b.emu.InjectFault(op, f.f, n)
				for range n {
					err := call(ctx, b.client, target)
					if f.kind == "" {
						if err != nil {
							t.Fatalf("%s under %s: %v, want success", op, f.f, err)
						}
						continue
					}
					pe := wantErr(t, string(op)+" under "+string(f.f), err, f.kind, "")
					if pe.Provider != "wechat" || pe.Op == "" {
						t.Errorf("error %+v lacks provider or op", pe)
					}
				}
				// The fault is used up: the same call now works.
				if err := call(ctx, b.client, target); err != nil {
					t.Errorf("%s after the fault: %v", op, err)
				}
			})
		}
	}
}

// An answer signed by anyone but the platform key is never believed, and a
// "not found" least of all: it would make kami refund or close again.
func TestAnswersMustBeSignedByThePlatform(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ctx := t.Context()
	paid(t, b, "MITM000001", 100)
	b.emu.SignAnswersWith(b.keys.stranger, "")

	_, err := b.client.CreatePayment(ctx, payment(t, "MITM000002", 100))
	wantErr(t, "create, answer signed by a stranger", err, providers.Temporary, "")
	st, err := b.client.QueryPayment(ctx, "MITM000001")
	wantErr(t, "query, answer signed by a stranger", err, providers.Temporary, "")
	if st.Status != "" {
		t.Errorf("query returned a status from an unverified answer: %+v", st)
	}
	st, err = b.client.QueryPayment(ctx, "MITM000003")
	wantErr(t, "ORDER_NOT_EXIST signed by a stranger", err, providers.Temporary, "")
	q, err := b.client.QueryRefund(ctx, providers.RefundRequest{RefundNo: "MITMREFUND"})
	wantErr(t, "RESOURCE_NOT_EXISTS signed by a stranger", err, providers.Temporary, "")
	if q.State == providers.RefundNotFound || st.Status == providers.TradeNotFound {
		t.Errorf("an unverified not-found was believed: %+v %+v", q, st)
	}
	err = b.client.ClosePayment(ctx, "MITM000004")
	wantErr(t, "close, ORDER_NOT_EXIST signed by a stranger", err, providers.Temporary, "")

	// An answer under a serial gopay has no key for must not send gopay
	// to download platform certificates.
	for _, serial := range []string{"5157F09EFDC096DE15EBE81A47057A72", "PUB_KEY_ID_0000000000000000000000000000000000"} {
		b.emu.SignAnswersWith(b.keys.platform, serial)
		_, err = b.client.QueryPayment(ctx, "MITM000001")
		wantErr(t, "answer under serial "+serial, err, providers.Temporary, "")
		err = b.client.ClosePayment(ctx, "MITM000005")
		wantErr(t, "ORDER_NOT_EXIST under serial "+serial, err, providers.Temporary, "")
	}
	if u := b.emu.UnknownRequests(); len(u) != 0 {
		t.Errorf("the client made calls of its own: %v", u)
	}

	b.emu.SignAnswersWith(nil, "")
	if st, err := b.client.QueryPayment(ctx, "MITM000001"); err != nil || st.Status != providers.TradePaid {
		t.Errorf("with the real key again: %+v, %v", st, err)
	}
}

// The emulator is what proves the adapter; it must refuse what the real
// gateway refuses.
func TestEmulatorRefusesBadRequests(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ctx := t.Context()

	// A merchant key the gateway does not know.
	cfg := b.cfg
	cfg.PrivateKey = b.keys.strangerPEM
	stranger, err := wechat.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	_, err = stranger.CreatePayment(ctx, payment(t, "SIGNED0001", 100))
	wantErr(t, "request signed with an unknown key", err, providers.Rejected, "SIGN_ERROR")

	// Another certificate serial.
	cfg = b.cfg
	cfg.SerialNo = "00000000000000000000000000000000"
	other, err := wechat.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	_, err = other.QueryPayment(ctx, "SIGNED0001")
	wantErr(t, "request naming another serial", err, providers.Rejected, "SIGN_ERROR")

	// No Authorization, or a replayed one on another body.
	for name, auth := range map[string]string{
		"none":    "",
		"garbage": "WECHATPAY2-SHA256-RSA2048 mchid=1900000109",
		"wrong signature": `WECHATPAY2-SHA256-RSA2048 mchid="` + b.emu.MchID() + `",nonce_str="abc",timestamp="` +
			strconv.FormatInt(time.Now().Unix(), 10) + `",serial_no="` + merchantSerial + `",signature="AAAA"`,
	} {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, b.srv.URL+"/v3/pay/transactions/out-trade-no/SIGNED0001?mchid="+b.emu.MchID(), nil)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(res.Body)
		res.Body.Close()
		if res.StatusCode != http.StatusUnauthorized || !strings.Contains(string(body), `"SIGN_ERROR"`) {
			t.Errorf("%s Authorization: %d %s, want 401 SIGN_ERROR", name, res.StatusCode, body)
		}
	}
}

// Errors carry the gateway's code and message for people, never a key or
// the raw answer.
func TestErrorsDoNotLeak(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ctx := t.Context()
	paid(t, b, "LEAK000001", 100)
	var errs []error
	b.emu.InjectFault(providertest.OpRefund, providertest.FaultBusiness, 1)
	_, err := b.client.Refund(ctx, providers.RefundRequest{RefundNo: "LEAKR1", OrderNo: "LEAK000001", RefundFen: 100, TotalFen: 100})
	errs = append(errs, err)
	b.emu.SignAnswersWith(b.keys.stranger, "")
	_, err = b.client.QueryPayment(ctx, "LEAK000001")
	errs = append(errs, err)
	b.emu.SignAnswersWith(nil, "")
	b.emu.InjectFault(providertest.OpQueryPayment, providertest.Fault5xx, 2)
	for range 2 {
		_, err = b.client.QueryPayment(ctx, "LEAK000001")
		errs = append(errs, err)
	}
	for _, err := range errs {
		if err == nil {
			t.Fatal("no error")
		}
		msg := err.Error()
		for _, leak := range []string{b.cfg.APIv3Key, "PRIVATE KEY", "{", "<html", "transaction_id", "success_time"} {
			if strings.Contains(msg, leak) {
				t.Errorf("error %q contains %q", msg, leak)
			}
		}
	}
	if pe := wantErr(t, "business", errs[0], providers.Rejected, "NOT_ENOUGH"); pe.Message == "" {
		t.Errorf("business error without the gateway's message: %+v", pe)
	}
}
