package queue_test

import (
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/providers"
	"kami/providers/sandbox"
	"kami/queue"
	"kami/queue/redistest"
)

// A payment after the close becomes a refund: the one scheduled by the shop
// and the one whose schedule was lost (written by the ledger alone) are both
// refunded by the refund drain, once.
func TestRefundDrainAndLostRefundSchedules(t *testing.T) {
	combos(t, func(t *testing.T, db *bun.DB, rs *redistest.Server) {
		e := newEnv(t, db, rs, domain.Config{OrderTTL: ttl})
		sb, err := sandbox.New(sandbox.Config{Secret: "test-secret", BaseURL: "http://127.0.0.1", Now: e.clock.Now})
		if err != nil {
			t.Fatal(err)
		}
		e.shop.Providers = providers.NewRegistry(sb)
		p := e.product(t, 5)
		nos := e.place(t, p, 2)
		e.clock.Advance(ttl)
		w := e.workers(t, queue.Config{})
		eventually(t, 10*time.Second, "orders closed", func() bool { return pendingCount(t, db) == 0 })
		pay := func(no string) domain.Payment {
			o, err := e.ledger.Order(e.ctx, no)
			if err != nil {
				t.Fatal(err)
			}
			return domain.Payment{Provider: sandbox.Name, OrderNo: no, TradeNo: "T" + no, AmountFen: o.AmountFen, PaidAt: e.clock.Now(), Raw: "{}"}
		}
		if res, err := e.shop.RecordPayment(e.ctx, pay(nos[0])); err != nil || res.Outcome != domain.PaymentLateRefund {
			t.Fatalf("late payment: %+v %v", res, err)
		}
		// The process died before scheduling this one's refund.
		if res, err := e.ledger.RecordPayment(e.ctx, pay(nos[1])); err != nil || res.Outcome != domain.PaymentLateRefund {
			t.Fatalf("late payment: %+v %v", res, err)
		}
		for _, no := range nos {
			eventually(t, 15*time.Second, "order "+no+" refunded", func() bool {
				o, err := e.ledger.Order(e.ctx, no)
				return err == nil && o.Status == domain.OrderRefunded
			})
		}
		mustAudit(t, e.ledger)
		// Attempts are counted just after the commit that refunds.
		eventually(t, 5*time.Second, "two refund attempts counted", func() bool { return w.Stats().Refunds >= 2 })
		eventually(t, 5*time.Second, "refund queue drained", func() bool {
			_, rq, err := w.QueueStats(e.ctx)
			return err == nil && rq.Backlog == 0 && rq.Leased == 0
		})
	})
}
