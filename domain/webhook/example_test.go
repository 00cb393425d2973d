package webhook_test

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"time"

	"kami/domain/webhook"
)

// verifyKamiSignature is what a receiver runs on every delivery (it needs
// nothing from kami): header is the Kami-Signature value, body the raw
// request body. It refuses a signature older (or newer) than five minutes,
// a replay, and a body that no v1 signs.
func verifyKamiSignature(header string, body []byte, secret string, now time.Time) bool {
	var ts string
	var sigs []string
	for _, part := range strings.Split(header, ",") {
		k, v, _ := strings.Cut(part, "=")
		switch k {
		case "t":
			ts = v
		case "v1":
			sigs = append(sigs, v)
		}
	}
	sec, err := strconv.ParseInt(ts, 10, 64)
	if err != nil || now.Sub(time.Unix(sec, 0)).Abs() > 5*time.Minute {
		return false
	}
	m := hmac.New(sha256.New, []byte(secret))
	m.Write([]byte(ts + "."))
	m.Write(body)
	want := hex.EncodeToString(m.Sum(nil))
	for _, sig := range sigs {
		if hmac.Equal([]byte(sig), []byte(want)) {
			return true
		}
	}
	return false
}

// A receiver checks every delivery before it trusts it, and deduplicates
// by the event id (Kami-Event-Id): deliveries are at least once. Here a
// genuine delivery is accepted; a forged, a tampered and a stale one are
// refused.
func Example() {
	secret := "whsec_example" // shown once when the endpoint was created
	receiver := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if !verifyKamiSignature(r.Header.Get("Kami-Signature"), body, secret, time.Now()) {
			http.Error(w, "bad signature", http.StatusBadRequest)
			return
		}
		// ... handle the event r.Header.Get("Kami-Event-Id") once ...
	})

	body := `{"id":"1","type":"order.paid"}`
	for _, c := range []struct {
		name     string
		signedAt time.Time
		signedBy []string
		sent     string
	}{
		{"genuine", time.Now(), []string{secret}, body},
		{"rotating", time.Now(), []string{"whsec_new", secret}, body},
		{"forged", time.Now(), []string{"whsec_guessed"}, body},
		{"tampered", time.Now(), []string{secret}, strings.Replace(body, "1", "2", 1)},
		{"stale", time.Now().Add(-time.Hour), []string{secret}, body},
	} {
		req := httptest.NewRequest(http.MethodPost, "/kami", strings.NewReader(c.sent))
		req.Header.Set(webhook.SignatureHeader, webhook.Sign(c.signedAt, []byte(body), c.signedBy...))
		rec := httptest.NewRecorder()
		receiver.ServeHTTP(rec, req)
		fmt.Println(c.name, rec.Code)
	}
	// Output:
	// genuine 200
	// rotating 200
	// forged 400
	// tampered 400
	// stale 400
}
