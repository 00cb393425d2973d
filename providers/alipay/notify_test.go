package alipay_test

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"kami/providers"
	"kami/providers/alipay"
	"kami/providers/alipay/alipayemu"
)

// wantInvalid requires a refusal of kind Invalid with code and no event.
func wantInvalid(t *testing.T, ev providers.Event, err error, code string) {
	t.Helper()
	var pe *providers.Error
	if !errors.As(err, &pe) {
		t.Fatalf("err = %v (%T), want *providers.Error", err, err)
	}
	if pe.Kind != providers.Invalid || pe.Code != code || pe.Op != "notification" || pe.Provider != "alipay" {
		t.Fatalf("err = %+v, want Invalid %s", pe, code)
	}
	if ev != (providers.Event{}) {
		t.Errorf("refused notification returned %+v", ev)
	}
}

func parse(t *testing.T, c *alipay.Client, body []byte) (providers.Event, error) {
	t.Helper()
	return c.ParseNotification(context.Background(), alipayemu.NotificationHeader(), body)
}

func TestNotificationPayment(t *testing.T) {
	t.Parallel()
	paidAt := time.Date(2026, 3, 1, 4, 5, 6, 0, time.UTC) // 12:05:06 in Beijing
	b := setup(t, setupOpts{now: func() time.Time { return paidAt }})
	h, body, err := b.emu.Pay("O100", 1250)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(body), "gmt_payment=2026-03-01+12%3A05%3A06") {
		t.Fatalf("emulator's gmt_payment is not Beijing time: %s", body)
	}
	ev, err := b.client.ParseNotification(context.Background(), h, body)
	if err != nil {
		t.Fatal(err)
	}
	view, _ := b.emu.Trade("O100")
	want := providers.Event{Kind: providers.EventPaymentSucceeded, OrderNo: "O100", TradeNo: view.TradeNo,
		AmountFen: 1250, Merchant: b.emu.AppID()}
	got := ev
	got.NotifyID, got.PaidAt = "", time.Time{}
	if got != want || ev.NotifyID == "" || !ev.PaidAt.Equal(paidAt) {
		t.Errorf("event %+v, want %+v paid at %v", ev, want, paidAt)
	}
}

// TestSellerIDOnlyWhenConfigured: without KAMI_ALIPAY_SELLER_ID any
// seller_id passes, as before the setting existed.
func TestSellerIDOnlyWhenConfigured(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cfg := b.cfg
	cfg.SellerID = ""
	c, err := alipay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	fields := b.emu.PaymentFields("O210", 1250)
	fields["seller_id"] = "2088000000000007"
	if ev, err := parse(t, c, b.emu.Notification(fields)); err != nil || ev.Kind != providers.EventPaymentSucceeded {
		t.Fatalf("another seller without the setting: %+v, %v", ev, err)
	}
	if _, err := parse(t, b.client, b.emu.Notification(fields)); codeOf(err) != alipay.CodeWrongSeller {
		t.Fatalf("another seller with the setting: %v", err)
	}
}

func TestNotificationStates(t *testing.T) {
	t.Parallel()
	b := setup(t)
	base := b.emu.PaymentFields("O200", 1250)
	cases := map[string]struct {
		edit func(map[string]string)
		kind providers.EventKind
		code string // refusal code when kind is ""
	}{
		"Success":  {func(map[string]string) {}, providers.EventPaymentSucceeded, ""},
		"Finished": {func(f map[string]string) { f["trade_status"] = "TRADE_FINISHED" }, providers.EventPaymentSucceeded, ""},
		"Waiting":  {func(f map[string]string) { f["trade_status"] = "WAIT_BUYER_PAY"; delete(f, "gmt_payment") }, providers.EventIgnored, ""},
		"Closed":   {func(f map[string]string) { f["trade_status"] = "TRADE_CLOSED" }, providers.EventIgnored, ""},
		"Refund":   {func(f map[string]string) { f["out_biz_no"], f["refund_fee"] = "R1", "4.00" }, providers.EventRefundSucceeded, ""},
		"RefundClosed": {func(f map[string]string) {
			f["out_biz_no"], f["refund_fee"], f["trade_status"] = "R1", "12.50", "TRADE_CLOSED"
		}, providers.EventRefundSucceeded, ""},
		"ThreeDecimals": {func(f map[string]string) { f["total_amount"] = "12.505" }, "", alipay.CodeMalformed},
		"FloatAmount":   {func(f map[string]string) { f["total_amount"] = "1.25e1" }, "", alipay.CodeMalformed},
		"NegativeFee":   {func(f map[string]string) { f["out_biz_no"], f["refund_fee"] = "R1", "-4.00" }, "", alipay.CodeMalformed},
		"RefundThreeDp": {func(f map[string]string) { f["out_biz_no"], f["refund_fee"] = "R1", "4.001" }, "", alipay.CodeMalformed},
		"UnknownState":  {func(f map[string]string) { f["trade_status"] = "TRADE_PENDING" }, "", alipay.CodeMalformed},
		"NoNotifyID":    {func(f map[string]string) { delete(f, "notify_id") }, "", alipay.CodeMalformed},
		"NoTradeNo":     {func(f map[string]string) { delete(f, "trade_no") }, "", alipay.CodeMalformed},
		"BadPaidTime":   {func(f map[string]string) { f["gmt_payment"] = "2026-13-01 00:00:00" }, "", alipay.CodeMalformed},
		"OtherApp":      {func(f map[string]string) { f["app_id"] = alipayemu.OtherAppID }, "", alipay.CodeWrongAppID},
		"OtherSeller":   {func(f map[string]string) { f["seller_id"] = "2088000000000007" }, "", alipay.CodeWrongSeller},
		"NoSeller":      {func(f map[string]string) { delete(f, "seller_id") }, "", alipay.CodeWrongSeller},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			fields := map[string]string{}
			for k, v := range base {
				fields[k] = v
			}
			tc.edit(fields)
			ev, err := parse(t, b.client, b.emu.Notification(fields))
			if tc.kind == "" {
				wantInvalid(t, ev, err, tc.code)
				return
			}
			if err != nil {
				t.Fatalf("ParseNotification: %v", err)
			}
			if ev.Kind != tc.kind || ev.OrderNo != "O200" || ev.NotifyID != fields["notify_id"] {
				t.Errorf("event %+v, want %s", ev, tc.kind)
			}
			if tc.kind == providers.EventRefundSucceeded {
				want, _ := map[string]int64{"Refund": 400, "RefundClosed": 1250}[name]
				if ev.RefundNo != "R1" || ev.RefundFen != want {
					t.Errorf("refund event %+v, want R1 of %d fen", ev, want)
				}
			}
		})
	}
}

func TestNotificationRefusals(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, genuine, err := b.emu.Pay("O300", 1250)
	if err != nil {
		t.Fatal(err)
	}
	form, _ := url.ParseQuery(string(genuine))
	reencode := func(edit func(url.Values)) []byte {
		f := url.Values{}
		for k, v := range form {
			f[k] = append([]string(nil), v...)
		}
		edit(f)
		return []byte(f.Encode())
	}
	_, forged := b.emu.Forge("O300", 1250)
	_, otherApp := b.emu.OtherApp("O300", 1250)

	cases := map[string]struct {
		header http.Header
		body   []byte
		code   string
	}{
		"Forged":        {alipayemu.NotificationHeader(), forged, alipay.CodeBadSignature},
		"OtherApp":      {alipayemu.NotificationHeader(), otherApp, alipay.CodeWrongAppID},
		"Unsigned":      {alipayemu.NotificationHeader(), reencode(func(f url.Values) { f.Del("sign") }), alipay.CodeBadSignature},
		"SignNotBase64": {alipayemu.NotificationHeader(), reencode(func(f url.Values) { f.Set("sign", "***") }), alipay.CodeBadSignature},
		"RSA1":          {alipayemu.NotificationHeader(), reencode(func(f url.Values) { f.Set("sign_type", "RSA") }), alipay.CodeBadSignature},
		"AmountChanged": {alipayemu.NotificationHeader(), reencode(func(f url.Values) { f.Set("total_amount", "0.01") }), alipay.CodeBadSignature},
		"FieldAdded":    {alipayemu.NotificationHeader(), reencode(func(f url.Values) { f.Set("refund_fee", "12.50") }), alipay.CodeBadSignature},
		"Repeated":      {alipayemu.NotificationHeader(), reencode(func(f url.Values) { f.Add("total_amount", "0.01") }), alipay.CodeMalformed},
		"JSON":          {http.Header{"Content-Type": {"application/json"}}, genuine, alipay.CodeMalformed},
		"BadEncoding":   {alipayemu.NotificationHeader(), []byte("a=%zz&sign=1"), alipay.CodeMalformed},
		"Oversized": {alipayemu.NotificationHeader(),
			append(bytes.Clone(genuine), bytes.Repeat([]byte("&pad=x"), alipay.MaxNotificationBytes/6)...), alipay.CodeTooLarge},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ev, err := b.client.ParseNotification(context.Background(), tc.header, tc.body)
			wantInvalid(t, ev, err, tc.code)
			if strings.Contains(err.Error(), "O300") || strings.Contains(err.Error(), form.Get("sign")[:16]) {
				t.Errorf("error %q quotes the body", err)
			}
		})
	}

	// A body just at the limit is read (and refused for what it is, not
	// for its size); one byte more is not read at all.
	at := make([]byte, alipay.MaxNotificationBytes)
	copy(at, genuine)
	for i := len(genuine); i < len(at); i++ {
		at[i] = 'x'
	}
	if _, err := parse(t, b.client, at); alipay.CodeTooLarge == codeOf(err) {
		t.Errorf("a %d-byte body was refused as too large", len(at))
	}
	if _, err := parse(t, b.client, append(at, 'x')); codeOf(err) != alipay.CodeTooLarge {
		t.Errorf("a %d-byte body: %v, want %s", len(at)+1, err, alipay.CodeTooLarge)
	}
}

func codeOf(err error) string {
	var pe *providers.Error
	if errors.As(err, &pe) {
		return pe.Code
	}
	return ""
}

func TestAcknowledge(t *testing.T) {
	t.Parallel()
	c := setup(t).client
	for _, tc := range []struct {
		err    error
		status int
		body   string
	}{
		{nil, 200, "success"},
		{&providers.Error{Kind: providers.Invalid, Message: "bad signature"}, 400, "fail"},
		{errors.New("database down"), 500, "fail"},
	} {
		w := httptest.NewRecorder()
		c.Acknowledge(w, tc.err)
		if w.Code != tc.status || w.Body.String() != tc.body {
			t.Errorf("Acknowledge(%v) = %d %q, want %d %q", tc.err, w.Code, w.Body, tc.status, tc.body)
		}
	}
}
