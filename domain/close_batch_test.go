package domain_test

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
)

// TestCloseBatchMixed: one close batch of orders in every state (due and
// unpaid on two products and two batches, one of them recalled; not yet
// due; paid; closed before; missing; listed twice) closes exactly the
// due unpaid ones, once each: their cards recycled (withdrawn for the
// recalled batch), one journal entry and one order.closed event each,
// and exactly their cards given back to the stock gate. Run again, it
// changes nothing.
func TestCloseBatchMixed(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{OrderTTL: 10 * time.Minute})
		gate := &memGate{n: map[int64]int{}}
		shop := &domain.Shop{Ledger: b.ledger, Gate: gate}
		pa, pb := b.product(t, 100, 10), b.product(t, 250, 10)
		pc := b.product(t, 300, 0)
		bad, err := b.ledger.ImportCards(b.ctx, pc.ID, []string{"BAD-1"}, "admin")
		if err != nil {
			t.Fatal(err)
		}
		// Contacts that a batch's arrays must carry as they are.
		odd := []string{`a"quote"@example.com`, `back\slash{x},y@example.com`, `'apos'@例子.cn`, `NULL`}
		placeAs := func(p *domain.Product, qty int, contact string) *domain.Order {
			t.Helper()
			placed, err := b.ledger.PlaceOrder(b.ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: qty, Contact: contact, Provider: "sandbox"})
			if err != nil {
				t.Fatalf("PlaceOrder: %v", err)
			}
			return placed.Order
		}
		dueA1, dueA2 := placeAs(pa, 2, odd[0]), placeAs(pa, 1, odd[1])
		dueB := placeAs(pb, 3, odd[2])
		onRecalled := placeAs(pc, 1, odd[3]) // takes BAD-1, the only card of pc
		if _, err := b.ledger.ImportCards(b.ctx, pc.ID, []string{"GOOD-1"}, "admin"); err != nil {
			t.Fatal(err)
		}
		onGood := b.order(t, pc, 1).Order
		if got := b.batchOf(t, onRecalled.OrderNo); got != bad.Batch.ID {
			t.Fatalf("order took a card of batch %d, want %d", got, bad.Batch.ID)
		}
		recallShop := &domain.Shop{Ledger: b.ledger, Gate: &memGate{n: map[int64]int{}}}
		if _, err := recallShop.RecallBatch(b.ctx, bad.Batch.ID, "codes redeemed", "admin"); err != nil {
			t.Fatal(err)
		}
		paid := b.order(t, pa, 1).Order
		b.pay(t, paid, "T-PAID", "N-PAID")
		cancelled := b.order(t, pb, 1).Order
		if _, err := b.ledger.CloseOrders(b.ctx, []string{cancelled.OrderNo}, domain.CloseCancel); err != nil {
			t.Fatal(err)
		}
		b.clock.Advance(6 * time.Minute)
		notDue := b.order(t, pa, 1).Order
		b.clock.Advance(5 * time.Minute) // the first orders are due, notDue is not

		batch := []string{dueB.OrderNo, notDue.OrderNo, dueA1.OrderNo, "NOPE-1", paid.OrderNo, onRecalled.OrderNo,
			cancelled.OrderNo, dueA2.OrderNo, onGood.OrderNo, dueA1.OrderNo}
		rs, err := shop.CloseOrders(b.ctx, batch, domain.CloseTimeout)
		if err != nil {
			t.Fatal(err)
		}
		type want struct {
			outcome             domain.CloseOutcome
			status              domain.OrderStatus
			released, withdrawn int
		}
		wants := map[string]want{
			dueA1.OrderNo:      {domain.Closed, domain.OrderClosed, 2, 0},
			dueA2.OrderNo:      {domain.Closed, domain.OrderClosed, 1, 0},
			dueB.OrderNo:       {domain.Closed, domain.OrderClosed, 3, 0},
			onRecalled.OrderNo: {domain.Closed, domain.OrderClosed, 0, 1},
			onGood.OrderNo:     {domain.Closed, domain.OrderClosed, 1, 0},
			notDue.OrderNo:     {domain.CloseNotDue, domain.OrderPending, 0, 0},
			paid.OrderNo:       {domain.CloseSkipped, domain.OrderPaid, 0, 0},
			cancelled.OrderNo:  {domain.CloseSkipped, domain.OrderClosed, 0, 0},
			"NOPE-1":           {domain.CloseMissing, "", 0, 0},
		}
		if len(rs) != len(wants) {
			t.Fatalf("%d results, want %d: %+v", len(rs), len(wants), rs)
		}
		for i, r := range rs {
			if i > 0 && rs[i-1].OrderNo >= r.OrderNo {
				t.Fatalf("results not in order_no order: %+v", rs)
			}
			w, ok := wants[r.OrderNo]
			if !ok || r.Outcome != w.outcome || r.Status != w.status || r.Released != w.released || r.Withdrawn != w.withdrawn || r.Inconsistent {
				t.Errorf("%s: %+v, want %+v", r.OrderNo, r, w)
			}
		}
		if r := byNo(rs, notDue.OrderNo); !r.ExpiresAt.Equal(notDue.ExpiresAt) {
			t.Errorf("not due: expires %v, want %v (its reschedule)", r.ExpiresAt, notDue.ExpiresAt)
		}
		// Exactly the closed orders' recycled cards went back to the gate.
		if gate.count(pa.ID) != 3 || gate.count(pb.ID) != 3 || gate.count(pc.ID) != 1 {
			t.Fatalf("given back %v, want A 3, B 3, C 1", gate.n)
		}
		for no, w := range wants {
			cards := b.cardStatuses(t, no)
			switch {
			case no == notDue.OrderNo && cards[domain.CardLocked] == 1 && len(cards) == 1:
			case no == paid.OrderNo && cards[domain.CardSold] == 1 && len(cards) == 1:
			case no == cancelled.OrderNo && cards[domain.CardRecycled] == 1 && len(cards) == 1:
			case no == "NOPE-1" && len(cards) == 0:
			case w.outcome == domain.Closed && cards[domain.CardRecycled] == w.released && cards[domain.CardWithdrawn] == w.withdrawn &&
				len(cards) == min(w.released, 1)+min(w.withdrawn, 1):
			default:
				t.Errorf("%s: cards %v", no, cards)
			}
		}
		// One journal entry per closed order and kind, of its quantity.
		var flows []domain.StockFlow
		if err := db.NewSelect().Model(&flows).Where("change_type IN (?)", bun.List([]domain.FlowType{domain.FlowReturn, domain.FlowWithdrawLocked})).
			Where("order_no IN (?)", bun.List(batch)).Order("order_no").Scan(b.ctx); err != nil {
			t.Fatal(err)
		}
		gotFlows := map[string]domain.StockFlow{}
		for _, f := range flows {
			if _, twice := gotFlows[f.OrderNo]; twice || (f.OrderNo != cancelled.OrderNo && !f.CreatedAt.Equal(b.clock.Now())) {
				t.Errorf("journal entry %+v (twice %v)", f, twice)
			}
			gotFlows[f.OrderNo] = f
		}
		for no, w := range wants {
			f, ok := gotFlows[no]
			switch {
			case no == cancelled.OrderNo: // its entry is of its own close
			case w.outcome != domain.Closed && ok:
				t.Errorf("%s: journal %+v for an order not closed", no, f)
			case w.outcome == domain.Closed && w.withdrawn > 0 && (f.ChangeType != domain.FlowWithdrawLocked || f.Quantity != w.withdrawn || f.ProductID != pc.ID):
				t.Errorf("%s: journal %+v, want %d withdrawn", no, f, w.withdrawn)
			case w.outcome == domain.Closed && w.released > 0 && (f.ChangeType != domain.FlowReturn || f.Quantity != w.released):
				t.Errorf("%s: journal %+v, want %d returned", no, f, w.released)
			}
		}
		// One order.closed event per closed order, carrying its contact
		// exactly as stored.
		contacts := map[string]string{dueA1.OrderNo: dueA1.Contact, dueA2.OrderNo: dueA2.Contact, dueB.OrderNo: dueB.Contact,
			onRecalled.OrderNo: onRecalled.Contact, onGood.OrderNo: onGood.Contact, cancelled.OrderNo: cancelled.Contact}
		evs := outboxEvents(t, b, domain.EventOrderClosed)
		if len(evs) != len(contacts) {
			t.Fatalf("%d order.closed events, want %d", len(evs), len(contacts))
		}
		for _, e := range evs {
			var o domain.OrderObject
			if err := json.Unmarshal([]byte(e.Payload), &o); err != nil {
				t.Fatalf("payload %q: %v", e.Payload, err)
			}
			c, ok := contacts[e.Subject]
			if !ok || o.OrderNo != e.Subject || o.Status != domain.OrderClosed || o.Contact != c || o.ClosedAt == nil {
				t.Errorf("event %+v: %+v", e, o)
			}
			delete(contacts, e.Subject)
		}
		// Again: nothing more closes, nothing more is given back.
		rs, err = shop.CloseOrders(b.ctx, batch, domain.CloseTimeout)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range rs {
			if r.Outcome == domain.Closed {
				t.Errorf("closed twice: %+v", r)
			}
		}
		if gate.count(pa.ID) != 3 || gate.count(pb.ID) != 3 || gate.count(pc.ID) != 1 {
			t.Fatalf("given back %v after the second run, want unchanged", gate.n)
		}
		if n := len(outboxEvents(t, b, domain.EventOrderClosed)); n != 6 {
			t.Fatalf("%d order.closed events after the second run, want 6", n)
		}
		b.mustAudit(t)
	})
}
