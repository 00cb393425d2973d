package alipay_test

import (
	"context"
	"errors"
	"maps"
	"net/url"
	"testing"

	"kami/providers"
	"kami/providers/alipay/alipayemu"
)

// FuzzParseNotification feeds the parser bodies and content types. It must
// never panic, must refuse with Kind Invalid and no event, and may accept a
// body only if its (non-empty) fields are exactly those of a notification
// the gateway signed: nothing unsigned ever becomes an event.
func FuzzParseNotification(f *testing.F) {
	b := setup(f)
	signed := []map[string]string{}
	add := func(body []byte, isSigned bool) {
		f.Add("application/x-www-form-urlencoded; charset=utf-8", body)
		if isSigned {
			form, err := url.ParseQuery(string(body))
			if err != nil {
				f.Fatal(err)
			}
			signed = append(signed, nonEmpty(form))
		}
	}
	_, pay, err := b.emu.Pay("O20260301000001", 1250)
	if err != nil {
		f.Fatal(err)
	}
	add(pay, true)
	ev, err := b.client.ParseNotification(context.Background(), alipayemu.NotificationHeader(), pay)
	if err != nil {
		f.Fatal(err)
	}
	if _, err := b.client.Refund(context.Background(), providers.RefundRequest{RefundNo: "R1", OrderNo: ev.OrderNo, TradeNo: ev.TradeNo, RefundFen: 250}); err != nil {
		f.Fatal(err)
	}
	_, refund, err := b.emu.RefundNotification("R1")
	if err != nil {
		f.Fatal(err)
	}
	add(refund, true)
	fields := b.emu.PaymentFields("O2", 1)
	fields["trade_status"] = "WAIT_BUYER_PAY"
	add(b.emu.Notification(fields), true)
	fields["total_amount"] = "0.015"
	add(b.emu.Notification(fields), true)
	_, forged := b.emu.Forge("O3", 100)
	add(forged, false)
	_, other := b.emu.OtherApp("O4", 100)
	add(other, true)
	add(nil, false)
	add([]byte("sign=&sign_type=RSA2&app_id="+b.emu.AppID()), false)
	f.Add("application/json", []byte(`{"notify_id":"1"}`))

	f.Fuzz(func(t *testing.T, contentType string, body []byte) {
		header := alipayemu.NotificationHeader()
		header.Set("Content-Type", contentType)
		ev, err := b.client.ParseNotification(context.Background(), header, body)
		if err != nil {
			var pe *providers.Error
			if !errors.As(err, &pe) || pe.Kind != providers.Invalid {
				t.Fatalf("error %v is not an Invalid *providers.Error", err)
			}
			if ev != (providers.Event{}) {
				t.Fatalf("refusal with an event: %+v", ev)
			}
			return
		}
		form, perr := url.ParseQuery(string(body))
		if perr != nil {
			t.Fatalf("accepted a body that is not a form: %q", body)
		}
		got := nonEmpty(form)
		for _, s := range signed {
			if maps.Equal(got, s) {
				if ev.Kind == "" || ev.Merchant != b.emu.AppID() {
					t.Fatalf("accepted event %+v", ev)
				}
				return
			}
		}
		t.Fatalf("accepted a body the gateway never signed: %q → %+v", body, ev)
	})
}

func nonEmpty(form url.Values) map[string]string {
	m := map[string]string{}
	for k, vs := range form {
		for _, v := range vs {
			if v != "" {
				m[k] = v
			}
		}
	}
	return m
}
