package wechat_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"kami/providers"
	"kami/providers/wechat/wechatemu"
)

func wantInvalid(t *testing.T, ev providers.Event, err error, reason string) {
	t.Helper()
	var pe *providers.Error
	if !errors.As(err, &pe) || pe.Kind != providers.Invalid {
		t.Fatalf("ParseNotification = %+v, %v; want Kind %s", ev, err, providers.Invalid)
	}
	if ev != (providers.Event{}) {
		t.Errorf("a refused notification returned an event: %+v", ev)
	}
	if pe.Provider != "wechat" || pe.Op == "" {
		t.Errorf("error %+v lacks provider or op", pe)
	}
	if reason != "" && !strings.Contains(pe.Message, reason) {
		t.Errorf("reason %q, want it to mention %q", pe.Message, reason)
	}
}

func TestNotificationRefused(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	res := func(mch, app string) map[string]any { return b.emu.PaymentResource("REFUSED0001", 1250, mch, app) }
	pay := func(n wechatemu.Notification) wechatemu.Notification {
		n.EventType, n.OriginalType = "TRANSACTION.SUCCESS", "transaction"
		if n.Resource == nil {
			n.Resource = res(b.emu.MchID(), b.emu.AppID())
		}
		return n
	}
	cases := []struct {
		name   string
		build  func() (http.Header, []byte, error)
		reason string
	}{
		{"wrong mchid", func() (http.Header, []byte, error) {
			return b.emu.Notify(pay(wechatemu.Notification{Resource: res("1900009999", b.emu.AppID())}))
		}, "mchid"},
		{"wrong appid", func() (http.Header, []byte, error) {
			return b.emu.Notify(pay(wechatemu.Notification{Resource: res(b.emu.MchID(), "wx0000000000other")}))
		}, "appid"},
		{"other merchant", func() (http.Header, []byte, error) { return b.emu.OtherMerchant("REFUSED0002", 100) }, "mchid"},
		{"forged signature", func() (http.Header, []byte, error) { return b.emu.Forge("REFUSED0003", 100) }, "signature"},
		{"stale timestamp (replay)", func() (http.Header, []byte, error) {
			return b.emu.Notify(pay(wechatemu.Notification{Time: time.Now().Add(-6 * time.Minute)}))
		}, "Timestamp"},
		{"timestamp from the future", func() (http.Header, []byte, error) {
			return b.emu.Notify(pay(wechatemu.Notification{Time: time.Now().Add(6 * time.Minute)}))
		}, "Timestamp"},
		{"bad serial", func() (http.Header, []byte, error) {
			return b.emu.Notify(pay(wechatemu.Notification{Serial: "PUB_KEY_ID_0000000000000000000000000000000000"}))
		}, "Serial"},
		{"encrypted with another API v3 key", func() (http.Header, []byte, error) {
			return b.emu.Notify(pay(wechatemu.Notification{APIv3Key: strings.Repeat("k", 32)}))
		}, "decrypt"},
		{"payment without resource", func() (http.Header, []byte, error) {
			return b.emu.Notify(wechatemu.Notification{EventType: "TRANSACTION.SUCCESS"})
		}, "resource"},
		{"refund of another merchant", func() (http.Header, []byte, error) {
			return b.emu.Notify(wechatemu.Notification{EventType: "REFUND.SUCCESS", OriginalType: "refund", Resource: map[string]any{
				"mchid": "1900009999", "out_trade_no": "REFUSED0004", "out_refund_no": "R1", "refund_status": "SUCCESS",
				"amount": map[string]any{"total": 100, "refund": 100},
			}})
		}, "mchid"},
		{"other event of another merchant", func() (http.Header, []byte, error) {
			return b.emu.Notify(wechatemu.Notification{EventType: "TRANSACTION.CLOSED", OriginalType: "transaction", Resource: map[string]any{"mchid": "1900009999"}})
		}, "mchid"},
		{"oversized body", func() (http.Header, []byte, error) {
			// Correctly signed, but bigger than any notification.
			return b.emu.Notify(pay(wechatemu.Notification{Summary: strings.Repeat("x", 70<<10)}))
		}, "bytes"},
		{"no headers", func() (http.Header, []byte, error) {
			_, body, err := b.emu.Pay("REFUSED0005", 100)
			return http.Header{}, body, err
		}, "headers"},
		{"header from another notification", func() (http.Header, []byte, error) {
			h, _, err := b.emu.Pay("REFUSED0006", 100)
			_, body, err2 := b.emu.Pay("REFUSED0007", 100)
			return h, body, errors.Join(err, err2)
		}, "signature"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			h, body := must(t)(c.build())
			ev, err := b.client.ParseNotification(t.Context(), h, body)
			wantInvalid(t, ev, err, c.reason)
		})
	}
}

func TestNotificationEvents(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	ctx := t.Context()

	// Payment.
	if _, err := b.client.CreatePayment(ctx, payment(t, "EVENTS0001", 1250)); err != nil {
		t.Fatal(err)
	}
	h, body := must(t)(b.emu.Pay("EVENTS0001", 1250))
	ev, err := b.client.ParseNotification(ctx, h, body)
	if err != nil {
		t.Fatalf("payment: %v", err)
	}
	st, err := b.client.QueryPayment(ctx, "EVENTS0001")
	if err != nil {
		t.Fatal(err)
	}
	want := providers.Event{Kind: providers.EventPaymentSucceeded, NotifyID: ev.NotifyID, OrderNo: "EVENTS0001",
		TradeNo: st.TradeNo, AmountFen: 1250, PaidAt: st.PaidAt, Merchant: b.emu.MchID()}
	if ev.NotifyID == "" || !ev.PaidAt.Equal(want.PaidAt) || ev.PaidAt.IsZero() {
		t.Errorf("payment event %+v, want %+v", ev, want)
	}
	ev.PaidAt = want.PaidAt
	if ev != want {
		t.Errorf("payment event %+v, want %+v", ev, want)
	}

	// Refunds: success, then one that the bank refuses.
	refund := func(no string, fen int64) providers.RefundRequest {
		r := providers.RefundRequest{RefundNo: no, OrderNo: "EVENTS0001", TradeNo: st.TradeNo, RefundFen: fen, TotalFen: 1250, Reason: "测试退款"}
		if _, err := b.client.Refund(ctx, r); err != nil {
			t.Fatalf("Refund %s: %v", no, err)
		}
		return r
	}
	refund("EVREFUND1", 250)
	h, body = must(t)(b.emu.RefundNotification("EVREFUND1"))
	ev, err = b.client.ParseNotification(ctx, h, body)
	if err != nil {
		t.Fatalf("refund notification: %v", err)
	}
	if ev.Kind != providers.EventRefundSucceeded || ev.RefundNo != "EVREFUND1" || ev.RefundFen != 250 ||
		ev.OrderNo != "EVENTS0001" || ev.TradeNo != st.TradeNo || ev.AmountFen != 1250 || ev.Merchant != b.emu.MchID() {
		t.Errorf("refund event %+v", ev)
	}

	for _, status := range []string{"ABNORMAL", "CLOSED"} {
		no := "EVREFUND" + status
		r := refund(no, 100)
		if err := b.emu.SetRefundStatus(no, status); err != nil {
			t.Fatal(err)
		}
		h, body = must(t)(b.emu.RefundNotification(no))
		ev, err = b.client.ParseNotification(ctx, h, body)
		if err != nil {
			t.Fatalf("REFUND.%s: %v", status, err)
		}
		if ev.Kind != providers.EventRefundFailed || ev.RefundNo != no {
			t.Errorf("REFUND.%s event %+v, want %s", status, ev, providers.EventRefundFailed)
		}
		q, err := b.client.QueryRefund(ctx, r)
		if err != nil || q.State != providers.RefundFailed {
			t.Errorf("QueryRefund of a %s refund = %+v, %v; want %s", status, q, err, providers.RefundFailed)
		}
	}

	// Verified notifications that need nothing done.
	for name, n := range map[string]wechatemu.Notification{
		"other event type": {EventType: "TRANSACTION.CLOSED", OriginalType: "transaction",
			Resource: map[string]any{"mchid": b.emu.MchID(), "out_trade_no": "EVENTS0002"}},
		"no resource": {EventType: "MCHTRANSFER.BILL.FINISHED"},
		"payment not SUCCESS": {EventType: "TRANSACTION.SUCCESS", OriginalType: "transaction",
			Resource: map[string]any{"mchid": b.emu.MchID(), "appid": b.emu.AppID(), "out_trade_no": "EVENTS0003", "trade_state": "PAYERROR"}},
	} {
		h, body := must(t)(b.emu.Notify(n))
		ev, err := b.client.ParseNotification(ctx, h, body)
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		if ev.Kind != providers.EventIgnored || ev.NotifyID == "" || ev.AmountFen != 0 || ev.TradeNo != "" {
			t.Errorf("%s: event %+v, want %s with a NotifyID and nothing else", name, ev, providers.EventIgnored)
		}
	}
}

func TestAcknowledge(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})

	ok := httptest.NewRecorder()
	b.client.Acknowledge(ok, nil)
	if ok.Code != http.StatusOK || ok.Body.Len() != 0 {
		t.Errorf("success: %d %q, want 200 with no body", ok.Code, ok.Body)
	}

	for _, c := range []struct {
		err    error
		status int
	}{
		{&providers.Error{Kind: providers.Invalid, Provider: "wechat", Op: "notification", Message: "signature does not verify"}, http.StatusBadRequest},
		{errors.New("database is locked"), http.StatusInternalServerError},
	} {
		w := httptest.NewRecorder()
		b.client.Acknowledge(w, c.err)
		if w.Code != c.status {
			t.Errorf("Acknowledge(%v): status %d, want %d", c.err, w.Code, c.status)
		}
		var body struct{ Code, Message string }
		if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil || body.Code != "FAIL" || body.Message == "" {
			t.Errorf("Acknowledge(%v): body %q, want {\"code\":\"FAIL\",\"message\":...}", c.err, w.Body)
		}
		if bytes.Contains(w.Body.Bytes(), []byte("signature")) || bytes.Contains(w.Body.Bytes(), []byte("database")) {
			t.Errorf("Acknowledge(%v) told the sender why: %q", c.err, w.Body)
		}
		if ct := w.Header().Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
			t.Errorf("Acknowledge(%v): Content-Type %q", c.err, ct)
		}
	}
}
