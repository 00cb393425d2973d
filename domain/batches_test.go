package domain_test

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
)

// memGate is an in-memory domain.StockGate with the Redis gate's
// all-or-nothing Take, for the Shop's flows.
type memGate struct {
	mu sync.Mutex
	n  map[int64]int
}

func (g *memGate) Take(_ context.Context, productID int64, qty int) (bool, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.n[productID] < qty {
		return false, nil
	}
	g.n[productID] -= qty
	return true, nil
}

func (g *memGate) GiveBack(_ context.Context, productID int64, qty int) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.n[productID] += qty
	return nil
}

func (g *memGate) count(productID int64) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.n[productID]
}

// batchOf returns the batch of the cards an order holds or held.
func (b *bundle) batchOf(t testing.TB, orderNo string) int64 {
	t.Helper()
	var id int64
	if err := b.db.NewSelect().Table("card_stock").ColumnExpr("MIN(batch_id)").Where("order_no = ?", orderNo).Scan(b.ctx, &id); err != nil {
		t.Fatal(err)
	}
	return id
}

func (b *bundle) journal(t testing.TB, productID int64, ty domain.FlowType) int {
	t.Helper()
	var n int
	if err := b.db.NewSelect().Table("stock_flow").ColumnExpr("COALESCE(SUM(quantity), 0)").
		Where("product_id = ?", productID).Where("change_type = ?", ty).Scan(b.ctx, &n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestRecallBatch: a batch whose cards are sold, held by an unpaid order,
// recycled and still unsold is recalled. Its lockable cards are withdrawn
// at once (and taken from the stock gate), the sold ones stay sold and
// their orders are listed, the held one is withdrawn when its order
// closes instead of going back on sale; a late payment cannot revive it;
// the other batch is untouched; a second recall is refused and changes
// nothing; the books balance throughout.
func TestRecallBatch(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{LatePayment: domain.LateDeliver})
		gate := &memGate{n: map[int64]int{}}
		shop := &domain.Shop{Ledger: b.ledger, Gate: gate}
		p := b.product(t, 100, 0)
		bad, err := shop.ImportCards(b.ctx, p.ID, []string{"BAD-1", "BAD-2", "BAD-3", "BAD-4"}, "admin")
		if err != nil {
			t.Fatal(err)
		}
		badID := bad.Batch.ID
		sold := b.order(t, p, 1)     // paid: its card is SOLD
		held := b.order(t, p, 1)     // stays PENDING: LOCKED
		recycled := b.order(t, p, 1) // closed: RECYCLED
		b.pay(t, sold.Order, "T-SOLD", "N-SOLD")
		if _, err := b.ledger.CloseOrders(b.ctx, []string{recycled.Order.OrderNo}, domain.CloseCancel); err != nil {
			t.Fatal(err)
		}
		good, err := shop.ImportCards(b.ctx, p.ID, []string{"GOOD-1", "GOOD-2"}, "admin")
		if err != nil {
			t.Fatal(err)
		}
		if gate.count(p.ID) != 6 {
			t.Fatalf("gate %d after imports, want 6", gate.count(p.ID))
		}
		for _, o := range []*domain.PlacedOrder{sold, held, recycled} {
			if got := b.batchOf(t, o.Order.OrderNo); got != badID {
				t.Fatalf("order %s took a card of batch %d, want %d", o.Order.OrderNo, got, badID)
			}
		}

		rec, err := shop.RecallBatch(b.ctx, badID, "supplier: codes already redeemed", "admin")
		if err != nil {
			t.Fatal(err)
		}
		if rec.Withdrawn != 2 || rec.Locked != 1 || rec.Sold != 1 || rec.Batch.Status != domain.BatchRecalled ||
			rec.Batch.RecallReason != "supplier: codes already redeemed" || rec.Batch.RecalledAt.IsZero() {
			t.Fatalf("recall %+v (batch %+v), want 2 withdrawn (UNSOLD + RECYCLED), 1 locked, 1 sold", rec, rec.Batch)
		}
		counts, _ := b.ledger.StockCounts(b.ctx, p.ID)
		if c := counts[p.ID]; c.Lockable != 2 || c.Withdrawn != 2 || c.Locked != 1 || c.Sold != 1 {
			t.Fatalf("stock %+v, want 2 lockable (the good batch), 2 withdrawn, 1 locked, 1 sold", c)
		}
		if gate.count(p.ID) != 4 {
			t.Fatalf("gate %d after the recall, want 4 (6 less the 2 withdrawn)", gate.count(p.ID))
		}
		// The orders that got or hold the batch's codes, to refund or watch.
		page, err := b.ledger.BatchOrders(b.ctx, badID, 0, 10)
		if err != nil {
			t.Fatal(err)
		}
		var nos []string
		for _, o := range page.Orders {
			nos = append(nos, o.OrderNo+":"+string(o.Status))
		}
		sort.Strings(nos)
		want := []string{held.Order.OrderNo + ":PENDING", sold.Order.OrderNo + ":PAID"}
		sort.Strings(want)
		if strings.Join(nos, " ") != strings.Join(want, " ") {
			t.Fatalf("batch orders %v, want %v", nos, want)
		}
		if _, err := b.ledger.RequestRefund(b.ctx, sold.Order.OrderNo, "bad code from a recalled batch", "admin"); err != nil {
			t.Fatalf("refund of a delivered order of the batch: %v", err)
		}

		// Twice: CONFLICT, nothing moves.
		flows := b.stockState(t).flows
		_, err = shop.RecallBatch(b.ctx, badID, "again", "admin")
		wantCode(t, err, domain.ECONFLICT)
		if b.stockState(t).flows != flows || gate.count(p.ID) != 4 {
			t.Fatal("a second recall changed something")
		}
		_, err = shop.RecallBatch(b.ctx, 999999, "nope", "admin")
		wantCode(t, err, domain.ENOTFOUND)
		_, err = shop.RecallBatch(b.ctx, good.Batch.ID, "  ", "admin")
		wantCode(t, err, domain.EBADINPUT)

		// The held card: its order closes, the card is withdrawn, not recycled.
		b.clock.Advance(time.Hour)
		rs, err := shop.CloseOrders(b.ctx, []string{held.Order.OrderNo}, domain.CloseTimeout)
		if err != nil || rs[0].Outcome != domain.Closed || rs[0].Released != 0 || rs[0].Withdrawn != 1 || rs[0].Inconsistent {
			t.Fatalf("close of the holding order: %+v, %v", rs, err)
		}
		if got := b.cardStatuses(t, held.Order.OrderNo); got[domain.CardWithdrawn] != 1 || len(got) != 1 {
			t.Fatalf("the held card is %v, want WITHDRAWN", got)
		}
		if gate.count(p.ID) != 4 {
			t.Fatalf("gate %d: the close gave a withdrawn card back", gate.count(p.ID))
		}
		// A late payment for the recycled-then-withdrawn order cannot
		// deliver it (LateDeliver is on): it is refunded.
		late := b.pay(t, recycled.Order, "T-LATE", "N-LATE")
		if late.Outcome != domain.PaymentLateRefund {
			t.Fatalf("late payment for a withdrawn card: %s, want LATE_REFUND", late.Outcome)
		}
		if b.journal(t, p.ID, domain.FlowWithdraw) != 2 || b.journal(t, p.ID, domain.FlowWithdrawLocked) != 1 {
			t.Fatalf("journal: %d withdrawn, %d withdrawn at close; want 2 and 1",
				b.journal(t, p.ID, domain.FlowWithdraw), b.journal(t, p.ID, domain.FlowWithdrawLocked))
		}
		// The good batch still sells.
		o := b.order(t, p, 2)
		if got := b.batchOf(t, o.Order.OrderNo); got != good.Batch.ID {
			t.Fatalf("sold from batch %d, want the good one", got)
		}
		stock, err := b.ledger.BatchStocks(b.ctx, []int64{badID, good.Batch.ID})
		if err != nil {
			t.Fatal(err)
		}
		if s := stock[badID]; s[domain.CardWithdrawn] != 3 || s[domain.CardSold] != 1 || len(s) != 2 {
			t.Fatalf("recalled batch stock %v", s)
		}
		if s := stock[good.Batch.ID]; s[domain.CardLocked] != 2 || len(s) != 1 {
			t.Fatalf("good batch stock %v", s)
		}
		b.mustAudit(t)
	})
}

// TestRaceRecall runs a recall against the live orders that hold, take,
// pay for or give back one of its batch's cards, for real, many times on
// each server database. Every run ends in exactly one of the outcomes
// below, and never with a card of the recalled batch on sale:
//
//   - order vs recall: the order gets the card (the recall finds it
//     LOCKED, and it is withdrawn when the order closes), or the recall
//     withdraws it first (the order is SOLD_OUT);
//   - close vs recall: the close withdraws the card (the recall came
//     first) or recycles it and the recall then withdraws it;
//   - pay vs recall: the payment always delivers the card (a recall never
//     touches a LOCKED card), and the recall counts it as locked or sold.
func TestRaceRecall(t *testing.T) {
	t.Parallel()
	dbtest.Servers(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		const runs = 60
		race := func(a, c func()) {
			var wg sync.WaitGroup
			start := make(chan struct{})
			for _, f := range []func(){a, c} {
				wg.Add(1)
				go func() { defer wg.Done(); <-start; f() }()
			}
			close(start)
			wg.Wait()
		}
		outcomes := map[string]int{}
		for i := 0; i < runs; i++ {
			// Order vs recall.
			p := b.product(t, 100, 1)
			batch := b.onlyBatch(t, p.ID)
			var placed *domain.PlacedOrder
			var placeErr, recallErr error
			var rec *domain.Recall
			race(func() {
				placed, placeErr = b.ledger.PlaceOrder(b.ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: fmt.Sprintf("r%d", i), Provider: "sandbox"})
			}, func() { rec, recallErr = b.ledger.RecallBatch(b.ctx, batch, "bad", "admin") })
			if recallErr != nil {
				t.Fatalf("recall: %v", recallErr)
			}
			switch {
			case placeErr == nil && rec.Withdrawn == 0 && rec.Locked == 1:
				outcomes["order first"]++
				b.clock.Advance(time.Hour)
				rs, err := b.ledger.CloseOrders(b.ctx, []string{placed.Order.OrderNo}, domain.CloseTimeout)
				if err != nil || rs[0].Withdrawn != 1 || rs[0].Released != 0 {
					t.Fatalf("close after the recall: %+v, %v", rs, err)
				}
			case domain.ErrorCode(placeErr) == domain.ESOLDOUT && rec.Withdrawn == 1 && rec.Locked == 0:
				outcomes["recall first"]++
			default:
				t.Fatalf("order vs recall: order %v, recall %+v", placeErr, rec)
			}
			b.wantWithdrawn(t, p.ID)

			// Close vs recall.
			p = b.product(t, 100, 1)
			batch = b.onlyBatch(t, p.ID)
			o := b.order(t, p, 1)
			b.clock.Advance(time.Hour)
			var closed []domain.CloseResult
			var closeErr error
			race(func() { closed, closeErr = b.ledger.CloseOrders(b.ctx, []string{o.Order.OrderNo}, domain.CloseTimeout) },
				func() { rec, recallErr = b.ledger.RecallBatch(b.ctx, batch, "bad", "admin") })
			if closeErr != nil || recallErr != nil {
				t.Fatalf("close %v, recall %v", closeErr, recallErr)
			}
			switch c := closed[0]; {
			case c.Withdrawn == 1 && c.Released == 0 && rec.Withdrawn == 0 && rec.Locked == 1:
				outcomes["recall before close"]++
			case c.Released == 1 && c.Withdrawn == 0 && rec.Withdrawn == 1:
				outcomes["close before recall"]++
			default:
				t.Fatalf("close vs recall: close %+v, recall %+v", c, rec)
			}
			b.wantWithdrawn(t, p.ID)

			// Pay vs recall.
			p = b.product(t, 100, 1)
			batch = b.onlyBatch(t, p.ID)
			o = b.order(t, p, 1)
			var paid *domain.PaymentResult
			var payErr error
			race(func() {
				paid, payErr = b.ledger.RecordPayment(b.ctx, domain.Payment{Provider: "sandbox", OrderNo: o.Order.OrderNo,
					TradeNo: "T" + o.Order.OrderNo, AmountFen: o.Order.AmountFen})
			}, func() { rec, recallErr = b.ledger.RecallBatch(b.ctx, batch, "bad", "admin") })
			if payErr != nil || recallErr != nil || paid.Outcome != domain.PaymentDelivered || rec.Withdrawn != 0 || rec.Locked+rec.Sold != 1 {
				t.Fatalf("pay vs recall: payment %+v (%v), recall %+v (%v)", paid, payErr, rec, recallErr)
			}
			if got := b.cardStatuses(t, o.Order.OrderNo); got[domain.CardSold] != 1 {
				t.Fatalf("paid order's card %v, want SOLD", got)
			}
			if rec.Sold == 1 {
				outcomes["pay before recall"]++
			} else {
				outcomes["recall before pay"]++
			}
		}
		t.Logf("outcomes over %d runs of each race: %v", runs, outcomes)
		b.mustAudit(t)
	})
}

func (b *bundle) onlyBatch(t testing.TB, productID int64) int64 {
	t.Helper()
	page, err := b.ledger.ListBatches(b.ctx, productID, 0, 10)
	if err != nil || len(page.Batches) != 1 {
		t.Fatalf("batches of product %d: %+v, %v", productID, page, err)
	}
	return page.Batches[0].ID
}

// wantWithdrawn: the product's one card is WITHDRAWN, nothing is on sale.
func (b *bundle) wantWithdrawn(t testing.TB, productID int64) {
	t.Helper()
	counts, err := b.ledger.StockCounts(b.ctx, productID)
	if err != nil {
		t.Fatal(err)
	}
	if c := counts[productID]; c.Withdrawn != 1 || c.Lockable != 0 || c.Locked != 0 {
		t.Fatalf("product %d stock %+v, want its one card WITHDRAWN", productID, c)
	}
}

// TestAuditBatches: the audit finds what a recall or a batch must never
// leave: a withdrawn card of a batch never recalled, a card on sale in a
// recalled batch, a batch whose count is not its cards', and the journal
// out of step with withdrawn cards.
func TestAuditBatches(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 0)
		good, err := b.ledger.ImportCards(b.ctx, p.ID, []string{"A-1", "A-2"}, "admin")
		if err != nil {
			t.Fatal(err)
		}
		bad, err := b.ledger.ImportCards(b.ctx, p.ID, []string{"B-1", "B-2"}, "admin")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := b.ledger.RecallBatch(b.ctx, bad.Batch.ID, "bad", "admin"); err != nil {
			t.Fatal(err)
		}
		b.mustAudit(t)
		// Damage the books the ways the audit must catch, bypassing the ledger.
		exec := func(q string, args ...any) {
			t.Helper()
			if _, err := db.ExecContext(b.ctx, q, args...); err != nil {
				t.Fatal(err)
			}
		}
		exec("UPDATE card_stock SET status = 'WITHDRAWN' WHERE id = (SELECT MIN(id) FROM card_stock WHERE batch_id = ?)", good.Batch.ID)
		exec("UPDATE card_stock SET status = 'UNSOLD' WHERE id = (SELECT MIN(id) FROM card_stock WHERE batch_id = ?)", bad.Batch.ID)
		exec("UPDATE card_batch SET imported = 5 WHERE id = ?", good.Batch.ID)
		// One more withdrawn than the journal knows.
		exec("UPDATE card_stock SET status = 'WITHDRAWN' WHERE id = (SELECT MAX(id) FROM card_stock WHERE batch_id = ?)", good.Batch.ID)
		vs, err := b.ledger.Audit(b.ctx)
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, v := range vs {
			got = append(got, v.Rule+" "+v.Subject)
		}
		sort.Strings(got)
		for _, want := range []string{
			"withdrawn_card card", // WITHDRAWN cards of an active batch, an UNSOLD card of a recalled one
			fmt.Sprintf("card_batch batch %d", good.Batch.ID),
			fmt.Sprintf("stock_flow product %d", p.ID),
		} {
			found := 0
			for _, g := range got {
				if strings.HasPrefix(g, want) {
					found++
				}
			}
			if found == 0 || (want == "withdrawn_card card" && found != 3) {
				t.Errorf("audit %v: %d of %q", got, found, want)
			}
		}
	})
}
