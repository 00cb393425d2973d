package main

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"kami/domain/webhook"
)

// TestSignedWebhookEndToEnd: a whole kami with KAMI_WEBHOOK_ALLOW_PRIVATE
// on: an admin adds an endpoint over GraphQL, a buyer pays through the
// gateway, and the endpoint receives the order.paid event once, signed with
// the secret it was given; the delivery is counted in /metrics.
func TestSignedWebhookEndToEnd(t *testing.T) {
	t.Parallel()
	for _, s := range []stack{stacks[1], stacks[0]} {
		t.Run(string(s.db), func(t *testing.T) {
			t.Parallel()
			var mu sync.Mutex
			var got []*http.Request
			var bodies [][]byte
			recv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				b, _ := io.ReadAll(r.Body)
				mu.Lock()
				got, bodies = append(got, r), append(bodies, b)
				mu.Unlock()
			}))
			defer recv.Close()
			a := newAlipayApp(t, s, env{"KAMI_WEBHOOK_ALLOW_PRIVATE": "1"}).running(t)
			var created struct {
				CreateWebhookEndpoint struct{ Secret string }
			}
			a.adminGraphQL(t, `mutation($url: String!) { createWebhookEndpoint(input: {url: $url, events: ["order.paid"]}) { secret } }`,
				map[string]any{"url": recv.URL + "/kami"}, &created)
			secret := created.CreateWebhookEndpoint.Secret

			p := a.product(t, 1999, "HOOK-1")
			o := a.order(t, p)
			header, body, err := a.emu.Pay(o.OrderNo, o.AmountFen)
			if err != nil {
				t.Fatal(err)
			}
			if status, _ := a.post(t, "/webhooks/alipay", header, body); status != 200 {
				t.Fatalf("notification: %d", status)
			}
			eventually(t, 30*time.Second, "the delivery is counted", func() bool {
				return strings.Contains(a.metricsText(t), `kami_webhook_deliveries_total{outcome="delivered"} 1`)
			})
			mu.Lock()
			defer mu.Unlock()
			if len(got) != 1 {
				t.Fatalf("%d deliveries, want 1", len(got))
			}
			sig := got[0].Header.Get(webhook.SignatureHeader)
			ts, _, _ := strings.Cut(strings.TrimPrefix(sig, "t="), ",")
			unix, _ := strconv.ParseInt(ts, 10, 64)
			if sig != webhook.Sign(time.Unix(unix, 0), bodies[0], secret) {
				t.Fatalf("signature %q does not verify with the endpoint's secret", sig)
			}
			var ev struct {
				ID, Type string
				Data     struct{ OrderNo, Status string }
			}
			if err := json.Unmarshal(bodies[0], &ev); err != nil {
				t.Fatal(err)
			}
			if ev.Type != "order.paid" || ev.Data.OrderNo != o.OrderNo || ev.Data.Status != "PAID" || got[0].Header.Get(webhook.EventIDHeader) != ev.ID {
				t.Fatalf("delivery %s", bodies[0])
			}
		})
	}
}
