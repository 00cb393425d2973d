// Package webhook is the wire side of kami's outgoing webhooks: the
// signature a receiver checks (Sign, Verify), and the guard that keeps an
// endpoint from pointing kami at itself or at a private network (Guard).
//
// A delivery is a POST of JSON with the header
//
//	Kami-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, t + "." + body)>
//
// (the form Stripe uses). While a secret is being rotated the header
// carries one v1 per valid secret; a receiver accepts the delivery when
// any of them matches its secret.
package webhook

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"strconv"
	"strings"
	"time"
)

// Header names of a delivery.
const (
	SignatureHeader = "Kami-Signature"
	EventIDHeader   = "Kami-Event-Id"
	EventTypeHeader = "Kami-Event-Type"
)

// Sign returns the Kami-Signature value for body sent at t, with one v1
// per secret.
func Sign(t time.Time, body []byte, secrets ...string) string {
	ts := strconv.FormatInt(t.Unix(), 10)
	var b strings.Builder
	b.WriteString("t=" + ts)
	for _, s := range secrets {
		b.WriteString(",v1=" + hex.EncodeToString(mac(s, ts, body)))
	}
	return b.String()
}

func mac(secret, ts string, body []byte) []byte {
	m := hmac.New(sha256.New, []byte(secret))
	m.Write([]byte(ts))
	m.Write([]byte("."))
	m.Write(body)
	return m.Sum(nil)
}
