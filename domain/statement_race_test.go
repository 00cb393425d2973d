package domain_test

import (
	"sync"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/providers"
)

// TestRaceSettlingPaths runs every path that can record one payment at
// once, for real, on the server databases: the buyer's notification
// (delivered twice), syncOrder, two statement reconciliations (as two
// processes would, the lock left out on purpose) and, for half of the
// orders, the close. Whatever wins, each order ends either delivered once
// or closed with its late payment refunded once: never closed with the
// money kept, never delivered twice, never refunded twice.
func TestRaceSettlingPaths(t *testing.T) {
	t.Parallel()
	dbtest.Servers(t, func(t *testing.T, db *bun.DB) {
		gw := alipayGateway(t)
		sb := newStatementBundle(t, db, gw, domain.Config{OrderTTL: time.Minute})
		const rounds, perRound = 3, 12
		// Enough cards for every order to be delivered: whichever path
		// wins, a closed order's cards come back only when the close won.
		sb.p = sb.product(t, 1250, rounds*perRound)
		for round := 0; round < rounds; round++ {
			orders := make([]*domain.Order, perRound)
			notes := make([]note, perRound)
			for i := range orders {
				orders[i] = sb.place(t)
				notes[i] = gw.pay(t, orders[i].OrderNo, orders[i].AmountFen)
			}
			// The second half falls due and is closed without asking the
			// gateway (as when that question failed), racing the rest.
			sb.clock.Advance(2 * time.Minute)
			var closing []string
			for _, o := range orders[perRound/2:] {
				closing = append(closing, o.OrderNo)
			}
			day := providers.DayOf(time.Now())

			var wg sync.WaitGroup
			start := make(chan struct{})
			goAll := func(fn func()) {
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					fn()
				}()
			}
			for i := range orders {
				for copies := 0; copies < 2; copies++ {
					goAll(func() { sb.shop.HandleNotification(sb.ctx, gw.name, notes[i].header, notes[i].body) })
				}
				goAll(func() { sb.shop.SyncOrder(sb.ctx, orders[i].OrderNo, "admin") })
			}
			for range 2 {
				goAll(func() {
					if _, err := sb.rec.Reconcile(sb.ctx, "", gw.name, day); err != nil {
						t.Errorf("reconcile: %v", err)
					}
				})
			}
			goAll(func() { sb.shop.CloseOrders(sb.ctx, closing, domain.CloseTimeout) })
			close(start)
			wg.Wait()

			for _, o := range orders {
				cur := sb.order(t, o.OrderNo)
				refunds := sb.refundsOf(t, o.OrderNo)
				sells := sb.sells(t, o.OrderNo)
				switch cur.Status {
				case domain.OrderPaid:
					if sells != 1 || len(refunds) != 0 || sb.cardStatuses(t, o.OrderNo)[domain.CardSold] != 1 {
						t.Errorf("round %d: %s PAID with %d sales and refunds %+v", round, o.OrderNo, sells, refunds)
					}
				case domain.OrderRefunding:
					if sells != 0 || len(refunds) != 1 || refunds[0].Cause != domain.CauseLatePayment || refunds[0].TradeNo != cur.TradeNo {
						t.Errorf("round %d: %s REFUNDING with %d sales and refunds %+v", round, o.OrderNo, sells, refunds)
					}
				default:
					t.Errorf("round %d: %s paid at the gateway ended %s", round, o.OrderNo, cur.Status)
				}
			}
		}
		sb.mustAudit(t)
	})
}
