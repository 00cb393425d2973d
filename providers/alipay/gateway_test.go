package alipay_test

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"kami/providers"
	"kami/providers/alipay"
	"kami/providers/alipay/alipayemu"
	"kami/providers/providertest"
)

func wantErr(t *testing.T, what string, err error, kind providers.ErrorKind, code string) *providers.Error {
	t.Helper()
	var pe *providers.Error
	if !errors.As(err, &pe) {
		t.Fatalf("%s: err = %v (%T), want *providers.Error %s", what, err, err, kind)
	}
	if pe.Kind != kind || (code != "" && pe.Code != code) || pe.Provider != "alipay" || pe.Op == "" {
		t.Fatalf("%s: err = %+v, want %s %s", what, pe, kind, code)
	}
	return pe
}

func paidTrade(t *testing.T, b *bundle, orderNo string, fen int64) providers.Event {
	t.Helper()
	h, body, err := b.emu.Pay(orderNo, fen)
	if err != nil {
		t.Fatal(err)
	}
	ev, err := b.client.ParseNotification(context.Background(), h, body)
	if err != nil {
		t.Fatal(err)
	}
	return ev
}

func refundOf(ev providers.Event, refundNo string, fen int64) providers.RefundRequest {
	return providers.RefundRequest{RefundNo: refundNo, OrderNo: ev.OrderNo, TradeNo: ev.TradeNo, RefundFen: fen, TotalFen: ev.AmountFen}
}

// Every fault the emulator injects, on every op, maps to the kind the
// ledger needs: Temporary when the outcome is unknown, Rejected when the
// gateway said no.
func TestFaultKinds(t *testing.T) {
	t.Parallel()
	type call func(ctx context.Context, b *bundle) error
	ops := map[providertest.Op]call{
		providertest.OpCreate: func(ctx context.Context, b *bundle) error {
			_, err := b.client.CreatePayment(ctx, providers.PaymentRequest{OrderNo: "O1", AmountFen: 1250, Subject: "card", Method: "qr"})
			return err
		},
		providertest.OpQueryPayment: func(ctx context.Context, b *bundle) error {
			_, err := b.client.QueryPayment(ctx, "O1")
			return err
		},
		providertest.OpClose: func(ctx context.Context, b *bundle) error {
			return b.client.ClosePayment(ctx, "O1")
		},
		providertest.OpRefund: func(ctx context.Context, b *bundle) error {
			_, err := b.client.Refund(ctx, providers.RefundRequest{RefundNo: "R1", OrderNo: "P1", RefundFen: 100, TotalFen: 1250})
			return err
		},
		providertest.OpQueryRefund: func(ctx context.Context, b *bundle) error {
			_, err := b.client.QueryRefund(ctx, providers.RefundRequest{RefundNo: "R1", OrderNo: "P1", RefundFen: 100})
			return err
		},
	}
	faults := map[providertest.Fault]struct {
		kind providers.ErrorKind // "" : the call succeeds
		code string
	}{
		providertest.FaultTimeout:            {providers.Temporary, "TIMEOUT"},
		providertest.FaultTimeoutAfterEffect: {providers.Temporary, "TIMEOUT"},
		providertest.Fault5xx:                {providers.Temporary, "HTTP_503"},
		providertest.FaultBusiness:           {providers.Rejected, ""},
		providertest.FaultSlow:               {"", ""},
		alipayemu.FaultSystemError:           {providers.Temporary, "ACQ.SYSTEM_ERROR"},
		alipayemu.FaultUnknownError:          {providers.Temporary, "isp.unknow-error"},
		alipayemu.FaultBadSignature:          {providers.Temporary, "BAD_RESPONSE_SIGNATURE"},
		alipayemu.FaultGarbage:               {providers.Temporary, "BAD_RESPONSE"},
	}
	for op, do := range ops {
		for f, want := range faults {
			if f == providertest.FaultTimeoutAfterEffect && op != providertest.OpRefund {
				continue // the same as FaultTimeout where there is no effect to see
			}
			t.Run(string(op)+"/"+string(f), func(t *testing.T) {
				t.Parallel()
				// The timeout is generous: a loaded machine must not turn
				// FaultSlow into a timeout.
				b := setup(t, setupOpts{timeout: 1500 * time.Millisecond})
				paidTrade(t, b, "P1", 1250)
				b.emu.InjectFault(op, f, 1)
				err := do(context.Background(), b)
				if want.kind == "" {
					if err != nil {
						t.Fatalf("under %s: %v, want success", f, err)
					}
				} else {
					pe := wantErr(t, string(f), err, want.kind, want.code)
					if strings.Contains(pe.Error(), "garbage") || strings.Contains(pe.Error(), "<html>") {
						t.Errorf("error quotes the answer: %v", pe)
					}
				}
				if op == providertest.OpRefund {
					fen, calls := b.emu.Refunded("R1")
					effect := f == providertest.FaultSlow || f == providertest.FaultTimeoutAfterEffect || f == alipayemu.FaultBadSignature
					if calls != 1 || (fen == 100) != effect {
						t.Errorf("under %s the emulator refunded %d fen in %d calls", f, fen, calls)
					}
				}
				// n = 1: the fault is gone for the next call.
				if err := do(context.Background(), b); err != nil {
					t.Errorf("after the fault: %v", err)
				}
			})
		}
	}
}

func TestCreatePaymentForms(t *testing.T) {
	t.Parallel()
	b := setup(t)
	expires := time.Now().Add(time.Hour).Truncate(time.Second)
	shanghai, err := time.LoadLocation("Asia/Shanghai")
	if err != nil {
		t.Fatal(err)
	}
	expiresText := expires.In(shanghai).Format("2006-01-02 15:04:05")
	for _, method := range []string{"", "page", "wap"} {
		t.Run("Redirect"+method, func(t *testing.T) {
			t.Parallel()
			orderNo := "O" + method + "1"
			a, err := b.client.CreatePayment(context.Background(), providers.PaymentRequest{
				OrderNo: orderNo, AmountFen: 1250, Subject: "Steam card", ExpiresAt: expires, Method: method})
			if err != nil {
				t.Fatal(err)
			}
			if a.Kind != providers.ActionRedirect || !strings.HasPrefix(a.URL, b.srv.URL+"/gateway.do?") || !a.ExpiresAt.Equal(expires) {
				t.Fatalf("action %+v", a)
			}
			u, _ := url.Parse(a.URL)
			q := u.Query()
			wantMethod := map[string]string{"": "alipay.trade.page.pay", "page": "alipay.trade.page.pay", "wap": "alipay.trade.wap.pay"}[method]
			if q.Get("method") != wantMethod || q.Get("notify_url") != b.cfg.NotifyURL || q.Get("return_url") != b.cfg.ReturnURL {
				t.Errorf("pay URL params %v", q)
			}
			var biz map[string]string
			if err := json.Unmarshal([]byte(q.Get("biz_content")), &biz); err != nil {
				t.Fatal(err)
			}
			if biz["total_amount"] != "12.50" || biz["out_trade_no"] != orderNo || biz["time_expire"] != expiresText {
				t.Errorf("biz_content %v", biz)
			}

			// Nothing exists at the gateway until the buyer opens the URL.
			if st, err := b.client.QueryPayment(context.Background(), orderNo); err != nil || st.Status != providers.TradeNotFound {
				t.Fatalf("before opening: %+v, %v", st, err)
			}
			// A URL whose amount was changed on the way is refused.
			q2 := u.Query()
			q2.Set("biz_content", strings.Replace(q.Get("biz_content"), "12.50", "0.01", 1))
			tampered := *u
			tampered.RawQuery = q2.Encode()
			if status := get(t, tampered.String()); status != http.StatusBadRequest {
				t.Errorf("tampered pay URL answered %d, want 400", status)
			}
			if status := get(t, a.URL); status != http.StatusOK {
				t.Fatalf("opening the pay URL answered %d", status)
			}
			st, err := b.client.QueryPayment(context.Background(), orderNo)
			if err != nil || st.Status != providers.TradeWaiting || st.AmountFen != 1250 {
				t.Fatalf("after opening: %+v, %v", st, err)
			}
		})
	}
	t.Run("QR", func(t *testing.T) {
		t.Parallel()
		req := providers.PaymentRequest{OrderNo: "Oqr", AmountFen: 99999, Subject: "card", Method: "qr", ExpiresAt: expires}
		a, err := b.client.CreatePayment(context.Background(), req)
		if err != nil {
			t.Fatal(err)
		}
		if a.Kind != providers.ActionQRCode || !strings.HasPrefix(a.QRCode, "https://qr.alipay.com/") {
			t.Fatalf("action %+v", a)
		}
		again, err := b.client.CreatePayment(context.Background(), req)
		if err != nil || again.QRCode != a.QRCode {
			t.Errorf("asking again: %+v, %v; want the same QR code", again, err)
		}
		view, _ := b.emu.Trade("Oqr")
		if view.TotalFen != 99999 || !view.Expire.Equal(expires) {
			t.Errorf("emulator trade %+v", view)
		}
		req.AmountFen = 100
		_, err = b.client.CreatePayment(context.Background(), req)
		wantErr(t, "same order, other amount", err, providers.Rejected, "ACQ.CONTEXT_INCONSISTENT")
	})
	t.Run("BadRequests", func(t *testing.T) {
		t.Parallel()
		for _, req := range []providers.PaymentRequest{
			{OrderNo: "", AmountFen: 100},
			{OrderNo: "O", AmountFen: 0},
			{OrderNo: "O", AmountFen: -5},
		} {
			_, err := b.client.CreatePayment(context.Background(), req)
			wantErr(t, "bad request", err, providers.Rejected, "INVALID_REQUEST")
		}
		_, err := b.client.CreatePayment(context.Background(), providers.PaymentRequest{OrderNo: "O", AmountFen: 1, Method: "app"})
		wantErr(t, "app method", err, providers.Unsupported, "")
	})
}

func get(t *testing.T, u string) int {
	t.Helper()
	res, err := http.Get(u)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, res.Body)
	res.Body.Close()
	return res.StatusCode
}

func TestQueryPaymentStates(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	now := time.Date(2026, 3, 1, 4, 0, 0, 0, time.UTC)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	b := setup(t, setupOpts{now: clock})
	ctx := context.Background()

	if _, err := b.client.CreatePayment(ctx, providers.PaymentRequest{OrderNo: "Oexp", AmountFen: 100, Method: "qr", ExpiresAt: now.Add(15 * time.Minute)}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.client.CreatePayment(ctx, providers.PaymentRequest{OrderNo: "Opay", AmountFen: 100, Method: "qr", ExpiresAt: now.Add(15 * time.Minute)}); err != nil {
		t.Fatal(err)
	}
	ev := paidTrade(t, b, "Opay", 100)
	st, err := b.client.QueryPayment(ctx, "Opay")
	if err != nil || st != (providers.TradeState{Status: providers.TradePaid, TradeNo: ev.TradeNo, AmountFen: 100, PaidAt: st.PaidAt}) || !st.PaidAt.Equal(now) {
		t.Errorf("paid: %+v, %v", st, err)
	}
	if st, err := b.client.QueryPayment(ctx, "Oexp"); err != nil || st.Status != providers.TradeWaiting {
		t.Errorf("waiting: %+v, %v", st, err)
	}
	mu.Lock()
	now = now.Add(16 * time.Minute)
	mu.Unlock()
	if st, err := b.client.QueryPayment(ctx, "Oexp"); err != nil || st.Status != providers.TradeClosed {
		t.Errorf("after time_expire: %+v, %v", st, err)
	}
	// A paid trade cannot be closed; the gateway says so.
	err = b.client.ClosePayment(ctx, "Opay")
	wantErr(t, "closing a paid trade", err, providers.Rejected, "ACQ.TRADE_STATUS_ERROR")
	// Refunded in full, the trade reads as closed.
	if _, err := b.client.Refund(ctx, refundOf(ev, "Rall", 100)); err != nil {
		t.Fatal(err)
	}
	if st, err := b.client.QueryPayment(ctx, "Opay"); err != nil || st.Status != providers.TradeClosed || st.TradeNo != ev.TradeNo {
		t.Errorf("fully refunded: %+v, %v", st, err)
	}
}

func TestRefunds(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	ev := paidTrade(t, b, "O1", 1250)

	// The gateway refuses more than was paid (kami checks too, when it
	// knows the total; here it does not).
	over := refundOf(ev, "Rover", 1251)
	over.TotalFen = 0
	_, err := b.client.Refund(ctx, over)
	wantErr(t, "refund above the paid amount", err, providers.Rejected, "ACQ.REFUND_AMT_NOT_EQUAL_TOTAL")
	over.TotalFen = 1250
	_, err = b.client.Refund(ctx, over)
	wantErr(t, "refund above the total", err, providers.Rejected, "INVALID_REQUEST")
	if fen, calls := b.emu.Refunded("Rover"); fen != 0 || calls != 1 {
		t.Errorf("emulator: %d fen in %d calls, want 0 in 1 (the second never left kami)", fen, calls)
	}

	r := refundOf(ev, "R1", 500)
	for i := range 3 {
		res, err := b.client.Refund(ctx, r)
		if err != nil || res.State != providers.RefundSucceeded || res.RefundFen != 500 || res.ProviderRefundID != ev.TradeNo {
			t.Fatalf("refund #%d: %+v, %v", i+1, res, err)
		}
	}
	if fen, calls := b.emu.Refunded("R1"); fen != 500 || calls != 3 {
		t.Errorf("emulator: %d fen in %d calls, want 500 in 3", fen, calls)
	}
	// The repeats were answered fund_change N and settled by a query.
	if n := b.emu.Calls("alipay.trade.fastpay.refund.query"); n != 2 {
		t.Errorf("%d refund queries, want 2 (one per repeat)", n)
	}

	// An unpaid trade cannot be refunded.
	if _, err := b.client.CreatePayment(ctx, providers.PaymentRequest{OrderNo: "Ounpaid", AmountFen: 100, Method: "qr"}); err != nil {
		t.Fatal(err)
	}
	_, err = b.client.Refund(ctx, providers.RefundRequest{RefundNo: "R2", OrderNo: "Ounpaid", RefundFen: 100})
	wantErr(t, "refund of an unpaid trade", err, providers.Rejected, "ACQ.TRADE_STATUS_ERROR")
	// Nor one that does not exist; querying its refund finds nothing.
	_, err = b.client.Refund(ctx, providers.RefundRequest{RefundNo: "R3", OrderNo: "Onone", RefundFen: 100})
	wantErr(t, "refund of no trade", err, providers.Rejected, "ACQ.TRADE_NOT_EXIST")
	if q, err := b.client.QueryRefund(ctx, providers.RefundRequest{RefundNo: "R3", OrderNo: "Onone"}); err != nil || q.State != providers.RefundNotFound {
		t.Errorf("query of a refund on no trade: %+v, %v", q, err)
	}
	for _, bad := range []providers.RefundRequest{{OrderNo: "O1", RefundFen: 1}, {RefundNo: "R", RefundFen: 1}, {RefundNo: "R", OrderNo: "O1"}} {
		_, err := b.client.Refund(ctx, bad)
		wantErr(t, "malformed refund", err, providers.Rejected, "INVALID_REQUEST")
	}
}

// The emulator refuses what the real gateway refuses: a request signed by a
// key that is not the app's, or naming another app.
func TestEmulatorChecksRequests(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	stranger, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}

	cfg := b.cfg
	cfg.PrivateKey = string(pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(stranger)}))
	c, err := alipay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.QueryPayment(ctx, "O1")
	wantErr(t, "request signed by another key", err, providers.Rejected, "isv.invalid-signature")
	_, err = c.Refund(ctx, providers.RefundRequest{RefundNo: "R1", OrderNo: "O1", RefundFen: 1})
	wantErr(t, "refund signed by another key", err, providers.Rejected, "isv.invalid-signature")
	if _, calls := b.emu.Refunded("R1"); calls != 0 {
		t.Errorf("emulator counted %d refund calls from an unsigned request", calls)
	}

	cfg = b.cfg
	cfg.AppID = "2021000000000777"
	c, err = alipay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.QueryPayment(ctx, "O1")
	wantErr(t, "request for another app", err, providers.Rejected, "isv.invalid-app-id")

	// And the adapter refuses answers not signed by the gateway's key.
	cfg = b.cfg
	pub, _ := x509.MarshalPKIXPublicKey(&stranger.PublicKey)
	cfg.AlipayPublicKey = string(pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub}))
	c, err = alipay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	paidTrade(t, b, "O2", 100)
	_, err = c.QueryPayment(ctx, "O2")
	wantErr(t, "answer verified with another key", err, providers.Temporary, "BAD_RESPONSE_SIGNATURE")

	// A request that is not a signed form at all.
	res, err := http.Post(b.srv.URL+"/gateway.do", "application/x-www-form-urlencoded", strings.NewReader("method=alipay.trade.query&app_id="+b.emu.AppID()))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if !strings.Contains(string(body), `"sub_code":"isv.missing-signature"`) {
		t.Errorf("unsigned request answered %s", body)
	}
}

func TestCanceledContextIsTemporary(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := b.client.QueryPayment(ctx, "O1")
	wantErr(t, "canceled", err, providers.Temporary, "CANCELED")
}
