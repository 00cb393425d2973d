package domain_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
)

// outboxEvents lists the outbox's events of type t, oldest first.
func outboxEvents(t testing.TB, b *bundle, typ domain.EventType) []domain.Event {
	t.Helper()
	var evs []domain.Event
	if err := b.db.NewSelect().Model(&evs).Where("type = ?", typ).Order("id").Scan(b.ctx); err != nil {
		t.Fatal(err)
	}
	return evs
}

// TestOutboxEvents: each ledger change that a seller hears of writes its
// one event with it: a payment (also one delivered in a shared batch, and
// not again when redelivered), a close, a confirmed refund, a refund that
// gave up, a low-stock crossing. The payload is the object as an admin
// sees it and never holds a code.
func TestOutboxEvents(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{RefundBackoff: []time.Duration{time.Minute}})
		b.endpoint(t, b.hooks(domain.WebhookConfig{}), "http://127.0.0.1:1/hook", false, domain.EventOrderPaid) // the events wait for the dispatcher
		p := b.product(t, 1250, 5)

		paid := b.order(t, p, 2).Order
		b.pay(t, paid, "T1", "N1")
		b.pay(t, paid, "T1", "N1") // a redelivery changes nothing
		evs := outboxEvents(t, b, domain.EventOrderPaid)
		if len(evs) != 1 || evs[0].Subject != paid.OrderNo || evs[0].FannedOut {
			t.Fatalf("order.paid events: %+v", evs)
		}
		var o domain.OrderObject
		if err := json.Unmarshal([]byte(evs[0].Payload), &o); err != nil {
			t.Fatal(err)
		}
		if o.OrderNo != paid.OrderNo || o.Status != domain.OrderPaid || o.Amount != "25.00" || o.TradeNo == nil || *o.TradeNo != "T1" ||
			o.PaidAt == nil || o.Contact != "buyer@example.com" || len(o.Cards) != 0 {
			t.Fatalf("order.paid payload: %s", evs[0].Payload)
		}
		if strings.Contains(evs[0].Payload, "CODE-") {
			t.Fatalf("a code in the outbox: %s", evs[0].Payload)
		}

		closing := b.order(t, p, 1).Order
		b.clock.Advance(time.Hour)
		if _, err := b.ledger.CloseOrders(b.ctx, []string{closing.OrderNo}, domain.CloseTimeout); err != nil {
			t.Fatal(err)
		}
		if evs := outboxEvents(t, b, domain.EventOrderClosed); len(evs) != 1 || evs[0].Subject != closing.OrderNo ||
			!strings.Contains(evs[0].Payload, `"status":"CLOSED"`) || strings.Contains(evs[0].Payload, `"closedAt":null`) {
			t.Fatalf("order.closed events: %+v", evs)
		}

		r, err := b.ledger.RequestRefund(b.ctx, paid.OrderNo, "", "admin")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := b.ledger.RefundAttemptFailed(b.ctx, r.RefundNo, 0, "gateway said no"); err != nil {
			t.Fatal(err)
		}
		if evs := outboxEvents(t, b, domain.EventRefundFailed); len(evs) != 0 {
			t.Fatalf("refund.failed before the last attempt: %+v", evs)
		}
		if _, err := b.ledger.RefundAttemptFailed(b.ctx, r.RefundNo, 1, "gateway said no"); err != nil {
			t.Fatal(err)
		}
		if _, err := b.ledger.RefundAttemptFailed(b.ctx, r.RefundNo, 1, "gateway said no"); err != nil { // reported twice
			t.Fatal(err)
		}
		if evs := outboxEvents(t, b, domain.EventRefundFailed); len(evs) != 1 || evs[0].Subject != r.RefundNo ||
			!strings.Contains(evs[0].Payload, `"status":"FAILED"`) || !strings.Contains(evs[0].Payload, `"orderNo":"`+paid.OrderNo+`"`) {
			t.Fatalf("refund.failed events: %+v", evs)
		}
		for range 2 {
			if _, _, err := b.ledger.RefundSucceeded(b.ctx, r.RefundNo, "P1"); err != nil {
				t.Fatal(err)
			}
		}
		if evs := outboxEvents(t, b, domain.EventOrderRefunded); len(evs) != 1 || evs[0].Subject != paid.OrderNo ||
			!strings.Contains(evs[0].Payload, `"status":"REFUNDED"`) {
			t.Fatalf("order.refunded events: %+v", evs)
		}

		if _, err := b.ledger.UpdateProduct(b.ctx, p.ID, domain.ProductInput{LowStockThreshold: ptr(3)}, "admin"); err != nil {
			t.Fatal(err)
		}
		if evs := outboxEvents(t, b, domain.EventStockLow); len(evs) != 1 ||
			!strings.Contains(evs[0].Payload, `"stock":3`) || !strings.Contains(evs[0].Payload, `"lowStockThreshold":3`) {
			t.Fatalf("stock.low events: %+v", evs)
		}
	})
}

// TestEventsBornFannedOutWithoutEndpoints: while no webhook endpoint is
// enabled, an event is written fanned out already, and the dispatcher has
// nothing to mark; once one is, events wait for the dispatcher, which
// makes the endpoint's deliveries; a disabled or deleted endpoint counts
// as none.
func TestEventsBornFannedOutWithoutEndpoints(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		h := b.hooks(domain.WebhookConfig{})
		p := b.product(t, 100, 10)
		closeOne := func(step string, wantFannedOut bool) {
			t.Helper()
			for _, batch := range [][]string{{b.order(t, p, 1).Order.OrderNo}, {b.order(t, p, 1).Order.OrderNo, b.order(t, p, 1).Order.OrderNo}} {
				if _, err := b.ledger.CloseOrders(b.ctx, batch, domain.CloseCancel); err != nil {
					t.Fatal(err)
				}
				for _, no := range batch {
					var fanned bool
					if err := db.NewSelect().Model((*domain.Event)(nil)).Column("fanned_out").Where("subject = ?", no).Scan(b.ctx, &fanned); err != nil {
						t.Fatal(err)
					}
					if fanned != wantFannedOut {
						t.Errorf("%s: order %s's order.closed written fanned out: %v, want %v", step, no, fanned, wantFannedOut)
					}
				}
			}
		}
		closeOne("no endpoint", true)
		if ds, taken, err := h.FanOut(b.ctx, 100); err != nil || taken != 0 || len(ds) != 0 {
			t.Fatalf("fan-out with no endpoint: %v, %d taken, %v", ds, taken, err)
		}
		e, _ := b.endpoint(t, h, "http://127.0.0.1:1/hook", false, domain.EventOrderClosed)
		closeOne("an enabled endpoint", false)
		if ds := fanOut(t, b, h); len(ds) != 3 {
			t.Fatalf("fan-out with an enabled endpoint: %d deliveries, want 3", len(ds))
		}
		off := false
		if _, err := h.UpdateEndpoint(b.ctx, e.ID, domain.WebhookEndpointInput{Enabled: &off}, "admin"); err != nil {
			t.Fatal(err)
		}
		closeOne("a disabled endpoint", true)
		on := true
		if _, err := h.UpdateEndpoint(b.ctx, e.ID, domain.WebhookEndpointInput{Enabled: &on}, "admin"); err != nil {
			t.Fatal(err)
		}
		closeOne("the endpoint enabled again", false)
		fanOut(t, b, h)
		if _, err := h.DeleteEndpoint(b.ctx, e.ID, "admin"); err != nil {
			t.Fatal(err)
		}
		closeOne("a deleted endpoint", true)
	})
}
