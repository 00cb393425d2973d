package domain_test

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
)

// TestAuditOnLiveTraffic: the audit runs while orders are placed, paid and
// closed, and reports nothing on a correct ledger: it reads one consistent
// snapshot, so a transaction that commits between two of its queries is
// not half seen. It still reports a real violation planted meanwhile.
// Before, each check read the ledger as it was at that moment, and the
// journal and the card counts, read one after the other, disagreed
// whenever an order moved in between.
func TestAuditOnLiveTraffic(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 400)
		stop := make(chan struct{})
		var wg sync.WaitGroup
		var moved atomic.Int64
		for w := range 3 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; ; i++ {
					select {
					case <-stop:
						return
					default:
					}
					placed, err := b.ledger.PlaceOrder(b.ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1 + i%2,
						Contact: fmt.Sprintf("w%d-%d@example.com", w, i), Provider: "sandbox"})
					if domain.ErrorCode(err) == domain.ESOLDOUT {
						continue
					}
					if err != nil {
						t.Errorf("PlaceOrder: %v", err)
						return
					}
					o := placed.Order
					if i%5 == 0 { // one in five is paid, the rest close and free their cards
						_, err = b.ledger.RecordPayment(b.ctx, domain.Payment{Provider: o.Provider, NotifyID: "N-" + o.OrderNo,
							OrderNo: o.OrderNo, TradeNo: "T-" + o.OrderNo, AmountFen: o.AmountFen, PaidAt: b.clock.Now(), Raw: "{}"})
					} else {
						_, err = b.ledger.CloseOrders(b.ctx, []string{o.OrderNo}, domain.CloseCancel)
					}
					if err != nil {
						t.Errorf("move %s: %v", o.OrderNo, err)
						return
					}
					moved.Add(1)
				}
			}()
		}
		for range 40 {
			vs, err := b.ledger.Audit(b.ctx)
			if err != nil {
				t.Fatalf("Audit: %v", err)
			}
			for _, v := range vs {
				t.Errorf("audit on live traffic, a correct ledger: %s", v)
			}
		}
		// A real violation, planted while the traffic runs: a card LOCKED
		// by no order.
		var card int64
		for planted := false; !planted; {
			if err := db.NewSelect().Table("card_stock").Column("id").Where("product_id = ?", p.ID).
				Where("status IN (?)", bun.List([]domain.CardStatus{domain.CardUnsold, domain.CardRecycled})).
				OrderExpr("id DESC").Limit(1).Scan(b.ctx, &card); err != nil {
				t.Fatal(err)
			}
			res, err := db.NewUpdate().Table("card_stock").Set("status = ?", domain.CardLocked).Set("order_no = ?", "NO-SUCH-ORDER").
				Where("id = ?", card).Where("status IN (?)", bun.List([]domain.CardStatus{domain.CardUnsold, domain.CardRecycled})).Exec(b.ctx)
			if err != nil {
				t.Fatal(err)
			}
			n, _ := res.RowsAffected()
			planted = n == 1 // else an order locked it first: take another
		}
		vs, err := b.ledger.Audit(b.ctx)
		close(stop)
		wg.Wait()
		if err != nil {
			t.Fatal(err)
		}
		found := false
		for _, v := range vs {
			if v.Rule == "locked_without_pending" && v.Subject == fmt.Sprintf("card %d", card) {
				found = true
			}
		}
		if !found {
			t.Errorf("the planted LOCKED card without an order was not reported: %v", vs)
		}
		if moved.Load() == 0 {
			t.Error("no order moved while the audit ran")
		}
	})
}
