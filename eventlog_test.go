package main

import (
	"encoding/json"
	"log/slog"
	"strings"
	"testing"
	"time"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/domain/domaintest"
	"kami/providers/sandbox"
)

// TestBusinessEventsLogged walks an order through payment, another through
// its buyer's cancel and a late payment to its refund, and reads kami's
// JSON log: each change of state is one info line with the order, from and
// to, the cause, the provider and the amount, and no line holds a card
// code, an access token or the buyer's contact.
func TestBusinessEventsLogged(t *testing.T) {
	t.Parallel()
	ta := newTestApp(t, dbtest.SQLite, nil)
	var logs domaintest.LogBuffer
	ta.shop.Log = slog.New(slog.NewJSONHandler(&logs, nil))
	ctx := t.Context()
	p := ta.product(t, 1250, "SECRET-CODE-A", "SECRET-CODE-B")
	const contact = "buyer@example.com"
	place := func() *domain.Checkout {
		co, err := ta.shop.PlaceOrder(ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: contact, Provider: "sandbox"}, "", "127.0.0.1")
		if err != nil {
			t.Fatal(err)
		}
		return co
	}
	pay := func(orderNo, tradeNo string) {
		h, b := sandbox.Signed("test-secret", sandbox.PaymentNotification(orderNo, tradeNo, 1250, time.Now()))
		if status, body := ta.post(t, "/webhooks/sandbox", h, b); status != 200 {
			t.Fatalf("pay %s: %d %s", orderNo, status, body)
		}
	}
	paid := place()
	pay(paid.Order.OrderNo, "SB-PAID")
	cancelled := place()
	if _, err := ta.shop.CancelOrder(ctx, cancelled.Order.OrderNo, cancelled.AccessToken); err != nil {
		t.Fatal(err)
	}
	pay(cancelled.Order.OrderNo, "SB-LATE")
	late, err := ta.ledger.Order(ctx, cancelled.Order.OrderNo)
	if err != nil || late.Status != domain.OrderRefunding {
		t.Fatalf("late payment: %v %v", late, err)
	}
	refunds, err := ta.ledger.DueRefunds(ctx, time.Now().Add(time.Hour), 10)
	if err != nil || len(refunds) != 1 {
		t.Fatalf("refunds %v %v", refunds, err)
	}
	if _, err := ta.shop.ProcessRefund(ctx, refunds[0].RefundNo); err != nil {
		t.Fatal(err)
	}

	type line struct {
		Level, Msg, Order, From, To, Cause, Provider, Amount, Refund string
	}
	var lines []line
	for _, raw := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		for _, secret := range []string{"SECRET-CODE", paid.AccessToken, cancelled.AccessToken, contact} {
			if strings.Contains(raw, secret) {
				t.Errorf("a log line holds a secret (%s): %s", secret, raw)
			}
		}
		var l line
		if err := json.Unmarshal([]byte(raw), &l); err != nil {
			t.Fatalf("log line %q: %v", raw, err)
		}
		lines = append(lines, l)
	}
	a, b := paid.Order.OrderNo, cancelled.Order.OrderNo
	want := []line{
		{"INFO", "order placed", a, "", "PENDING", "new order", "sandbox", "12.50", ""},
		{"INFO", "order paid", a, "PENDING", "PAID", "payment", "sandbox", "12.50", ""},
		{"INFO", "order placed", b, "", "PENDING", "new order", "sandbox", "12.50", ""},
		{"INFO", "order closed", b, "PENDING", "CLOSED", "cancel", "", "", ""},
		{"INFO", "late payment", b, "CLOSED", "REFUNDING", "paid after the close: refunded", "sandbox", "12.50", refunds[0].RefundNo},
		{"INFO", "order refunded", b, "REFUNDING", "REFUNDED", string(refunds[0].Cause), "sandbox", "12.50", refunds[0].RefundNo},
	}
	var events []line
	for _, l := range lines {
		if l.Order != "" {
			events = append(events, l)
		}
	}
	if len(events) != len(want) {
		t.Fatalf("business events:\n%s\nwant %d lines", logs.String(), len(want))
	}
	for i := range want {
		if events[i] != want[i] {
			t.Errorf("event %d: %+v\nwant %+v", i, events[i], want[i])
		}
	}
}
