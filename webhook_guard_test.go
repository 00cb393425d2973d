package main

import (
	"context"
	"errors"
	"testing"

	"kami/domain/webhook"
)

// TestWebhookGuardKnowsKami: the guard the settings build refuses kami's
// own listen addresses (KAMI_ADDR on all interfaces, KAMI_PPROF_ADDR) even
// with KAMI_WEBHOOK_ALLOW_PRIVATE=1, and lets another local port through.
func TestWebhookGuardKnowsKami(t *testing.T) {
	t.Parallel()
	c, err := loadConfig(env{"KAMI_ADDR": ":9000", "KAMI_PPROF_ADDR": "127.0.0.1:6060", "KAMI_PUBLIC_URL": "https://shop.example.com",
		"KAMI_WEBHOOK_ALLOW_PRIVATE": "1"}.get)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, u := range []string{"http://127.0.0.1:9000/", "http://[::1]:09000/", "http://127.0.0.1:6060/debug/pprof/"} {
		if err := c.Webhooks.Guard.CheckURL(ctx, u); !errors.Is(err, webhook.ErrRefused) {
			t.Errorf("CheckURL(%s) = %v, want refused as kami itself", u, err)
		}
	}
	if err := c.Webhooks.Guard.CheckURL(ctx, "http://127.0.0.1:9001/"); err != nil {
		t.Errorf("another local port refused: %v", err)
	}
}
