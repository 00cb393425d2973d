package wechat_test

import (
	"crypto"
	"crypto/rsa"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"net/http"
	"testing"

	"kami/providers"
	"kami/providers/wechat"
	"kami/providers/wechat/wechatemu"
)

// FuzzParseNotification feeds ParseNotification mutated notifications. It
// must never panic, must refuse with an Invalid *providers.Error and no
// event, and may accept only what is signed by the platform key under the
// configured key ID, which this test checks on its own.
func FuzzParseNotification(f *testing.F) {
	b := setup(f, setupOptions{})
	add := func(h http.Header, body []byte, err error) {
		if err != nil {
			f.Fatal(err)
		}
		f.Add(body, h.Get("Wechatpay-Timestamp"), h.Get("Wechatpay-Nonce"), h.Get("Wechatpay-Signature"), h.Get("Wechatpay-Serial"))
	}
	add(b.emu.Pay("FUZZORDER1", 1250))
	if _, err := b.client.Refund(f.Context(), providers.RefundRequest{RefundNo: "FUZZREFUND1", OrderNo: "FUZZORDER1", RefundFen: 50, TotalFen: 1250}); err != nil {
		f.Fatal(err)
	}
	add(b.emu.RefundNotification("FUZZREFUND1"))
	add(b.emu.Forge("FUZZORDER2", 100))
	add(b.emu.OtherMerchant("FUZZORDER3", 100))
	add(b.emu.Notify(wechatemu.Notification{EventType: "TRANSACTION.SUCCESS"}))
	add(b.emu.Notify(wechatemu.Notification{EventType: "SOMETHING.ELSE", OriginalType: "x", Resource: map[string]any{"a": 1}}))
	f.Add([]byte(`{"id":"x","event_type":"TRANSACTION.SUCCESS","resource":{"algorithm":"AEAD_AES_256_GCM","ciphertext":"","nonce":"","associated_data":""}}`), "0", "", "", "")
	f.Add([]byte{}, "", "", "", "")

	platform, err := keys()
	if err != nil {
		f.Fatal(err)
	}
	id := b.emu.PlatformPublicKeyID()

	f.Fuzz(func(t *testing.T, body []byte, ts, nonce, sig, serial string) {
		h := http.Header{}
		h.Set("Wechatpay-Timestamp", ts)
		h.Set("Wechatpay-Nonce", nonce)
		h.Set("Wechatpay-Signature", sig)
		h.Set("Wechatpay-Serial", serial)
		ev, err := b.client.ParseNotification(t.Context(), h, body)
		if err != nil {
			var pe *providers.Error
			if !errors.As(err, &pe) || pe.Kind != providers.Invalid {
				t.Fatalf("error %v is not an Invalid *providers.Error", err)
			}
			if ev != (providers.Event{}) {
				t.Fatalf("refused, yet returned %+v", ev)
			}
			return
		}
		if ev.Kind == "" || ev.NotifyID == "" {
			t.Fatalf("accepted an event without kind or id: %+v", ev)
		}
		if len(body) > wechat.MaxNotificationBytes {
			t.Fatalf("accepted a %d-byte body", len(body))
		}
		if serial != id {
			t.Fatalf("accepted serial %q", serial)
		}
		// Verified here without gopay: the adapter must not accept what
		// the platform key did not sign.
		raw, err := base64.StdEncoding.DecodeString(sig)
		sum := sha256.Sum256([]byte(ts + "\n" + nonce + "\n" + string(body) + "\n"))
		if err != nil || rsa.VerifyPKCS1v15(&platform.platform.PublicKey, crypto.SHA256, sum[:], raw) != nil {
			t.Fatalf("accepted an unverified notification: %+v", ev)
		}
	})
}
