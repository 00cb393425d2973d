package domain_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
)

// TestRaceSoldOut: 2,000 buyers at once for 100 cards, through two ledgers
// (two processes, each grouping its own orders). Exactly 100 get an
// order, every other one is told SOLD_OUT, and the books balance.
func TestRaceSoldOut(t *testing.T) {
	t.Parallel()
	dbtest.Servers(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 100)
		// A second process's ledger on the same database: its own batches
		// race the first one's for the same cards.
		other := domain.NewLedger(db, b.ledger.Sealer(), domain.Config{}, b.alerts)
		const buyers = 2000
		var ok, soldOut atomic.Int64
		var wg sync.WaitGroup
		start := make(chan struct{})
		errs := make(chan error, buyers)
		for i := 0; i < buyers; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				ledger := b.ledger
				if i%2 == 1 {
					ledger = other
				}
				_, err := ledger.PlaceOrder(b.ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1,
					Contact: fmt.Sprintf("buyer-%d", i), Provider: "sandbox"})
				switch domain.ErrorCode(err) {
				case "":
					ok.Add(1)
				case domain.ESOLDOUT:
					soldOut.Add(1)
				default:
					errs <- err
				}
			}()
		}
		close(start)
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Errorf("unexpected error: %v", err)
		}
		if ok.Load() != 100 || soldOut.Load() != buyers-100 {
			t.Fatalf("%d orders placed and %d sold out; want 100 and %d", ok.Load(), soldOut.Load(), buyers-100)
		}
		counts, _ := b.ledger.StockCounts(b.ctx, p.ID)
		if c := counts[p.ID]; c.Locked != 100 || c.Lockable != 0 {
			t.Fatalf("stock %+v, want 100 locked, 0 lockable", c)
		}
		b.mustAudit(t)
	})
}

// TestRaceCloseVersusPay: 1,000 due orders, each closed by a batch closer
// while its payment (delivered twice, as gateways do) races in. Every order
// ends either PAID with its card SOLD, or, when the close won, REFUNDING
// with its card RECYCLED and exactly one refund: never both, never neither.
func TestRaceCloseVersusPay(t *testing.T) {
	t.Parallel()
	dbtest.Servers(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		const n = 1000
		p := b.product(t, 100, n)
		orders := make([]*domain.Order, n)
		for i := range orders {
			orders[i] = b.order(t, p, 1).Order
		}
		b.clock.Advance(time.Hour)

		ctx, cancel := context.WithTimeout(b.ctx, 5*time.Minute)
		defer cancel()
		var wg sync.WaitGroup
		errs := make(chan error, 4*n)
		// Closers take batches of 10, as the close worker does.
		for start := 0; start < n; start += 10 {
			batch := make([]string, 0, 10)
			for _, o := range orders[start:min(start+10, n)] {
				batch = append(batch, o.OrderNo)
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				if _, err := b.ledger.CloseOrders(ctx, batch, domain.CloseTimeout); err != nil {
					errs <- fmt.Errorf("close: %w", err)
				}
			}()
		}
		for _, o := range orders {
			for copy := 0; copy < 2; copy++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					_, err := b.ledger.RecordPayment(ctx, domain.Payment{Provider: "sandbox", NotifyID: "N" + o.OrderNo,
						OrderNo: o.OrderNo, TradeNo: "T" + o.OrderNo, AmountFen: o.AmountFen})
					if err != nil {
						errs <- fmt.Errorf("pay %s: %w", o.OrderNo, err)
					}
				}()
			}
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}

		var paid, refunded int
		for _, o := range orders {
			got, err := b.ledger.Order(b.ctx, o.OrderNo)
			if err != nil {
				t.Fatal(err)
			}
			cards := b.cardStatuses(t, o.OrderNo)
			refunds, _ := db.NewSelect().Table("refund_order").Where("order_no = ?", o.OrderNo).Count(b.ctx)
			switch {
			case got.Status == domain.OrderPaid && cards[domain.CardSold] == 1 && len(cards) == 1 && refunds == 0:
				paid++
			case got.Status == domain.OrderRefunding && cards[domain.CardRecycled] == 1 && len(cards) == 1 && refunds == 1:
				refunded++
			default:
				t.Errorf("order %s ended %s with cards %v and %d refunds", o.OrderNo, got.Status, cards, refunds)
			}
		}
		t.Logf("%d paid, %d closed then refunded", paid, refunded)
		if paid+refunded != n {
			t.Fatalf("%d + %d != %d", paid, refunded, n)
		}
		b.mustAudit(t)
	})
}
