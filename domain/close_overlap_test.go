package domain_test

import (
	"fmt"
	"sync"
	"testing"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
)

// TestRaceOverlappingClosesOnTheDatabaseClock: close batches that share
// orders, run at once on the database's own clock (the statement's
// CURRENT_TIMESTAMP on PostgreSQL, not a test's stand-in) while the same
// orders are paid, end with each order once: closed with its two cards
// recycled, one journal entry and one order.closed event, or paid with
// its two cards sold and no close written; never both, never twice. And
// without a deadlock: the payments, grouped in batches in the order they
// arrive, lock their orders in order_no order as the closes do.
func TestRaceOverlappingClosesOnTheDatabaseClock(t *testing.T) {
	t.Parallel()
	dbtest.Servers(t, func(t *testing.T, db *bun.DB) {
		deadlocks := &deadlockLog{}
		db = db.WithQueryHook(deadlocks)
		b := setup(t, db, domain.Config{})
		const n = 120
		p := b.product(t, 100, 2*n)
		orders := make([]*domain.Order, n)
		for i := range orders {
			orders[i] = b.order(t, p, 2).Order
		}
		// The test clock starts days before the database's: every order
		// is due by the database's clock.
		b.ledger.DBClock = nil
		var wg sync.WaitGroup
		errs := make(chan error, 4*n)
		for w := range 6 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				// Worker w closes batches of 20 starting at 10*w: each
				// order is in two or three workers' batches.
				for start := (10 * w) % n; start < n; start += 20 {
					var batch []string
					for _, o := range orders[start:min(start+20, n)] {
						batch = append(batch, o.OrderNo)
					}
					if _, err := b.ledger.CloseOrders(b.ctx, batch, domain.CloseTimeout); err != nil {
						errs <- fmt.Errorf("close: %w", err)
					}
				}
			}()
		}
		for _, o := range orders[:n/2] {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if _, err := b.ledger.RecordPayment(b.ctx, domain.Payment{Provider: "sandbox", NotifyID: "N" + o.OrderNo,
					OrderNo: o.OrderNo, TradeNo: "T" + o.OrderNo, AmountFen: o.AmountFen}); err != nil {
					errs <- fmt.Errorf("pay %s: %w", o.OrderNo, err)
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
		for _, o := range orders {
			got, err := b.ledger.Order(b.ctx, o.OrderNo)
			if err != nil {
				t.Fatal(err)
			}
			cards := b.cardStatuses(t, o.OrderNo)
			var returns, closedEvents int
			if err := db.NewSelect().Table("stock_flow").ColumnExpr("COUNT(*)").Where("order_no = ? AND change_type = ?", o.OrderNo, domain.FlowReturn).Scan(b.ctx, &returns); err != nil {
				t.Fatal(err)
			}
			if err := db.NewSelect().Table("events").ColumnExpr("COUNT(*)").Where("subject = ? AND type = ?", o.OrderNo, domain.EventOrderClosed).Scan(b.ctx, &closedEvents); err != nil {
				t.Fatal(err)
			}
			switch {
			case got.Status == domain.OrderPaid && cards[domain.CardSold] == 2 && len(cards) == 1 && returns == 0 && closedEvents == 0:
			case got.Status == domain.OrderRefunding && cards[domain.CardRecycled] == 2 && len(cards) == 1 && returns == 1 && closedEvents == 1:
				// closed, then its payment came: refunded
			case got.Status == domain.OrderClosed && cards[domain.CardRecycled] == 2 && len(cards) == 1 && returns == 1 && closedEvents == 1:
			default:
				t.Errorf("order %s ended %s with cards %v, %d return entries, %d order.closed events", o.OrderNo, got.Status, cards, returns, closedEvents)
			}
		}
		if n := deadlocks.n.Load(); n > 0 {
			t.Errorf("%d statements ended in a deadlock", n)
		}
		b.mustAudit(t)
	})
}
