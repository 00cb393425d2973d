package queue_test

import (
	"sync"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/queue"
	"kami/queue/redistest"
)

// TestPaidOrdersLeaveTheCloseQueue: a payment takes its order's close task
// off the queue, and out of the lease of a worker that claimed it, as does
// a buyer's cancel, so the backlog counts only orders that can still
// close; the sweeper does not put them back.
func TestPaidOrdersLeaveTheCloseQueue(t *testing.T) {
	combos(t, func(t *testing.T, db *bun.DB, rs *redistest.Server) {
		e := newEnv(t, db, rs, domain.Config{OrderTTL: ttl})
		p := e.product(t, 30)
		nos := e.place(t, p, 30)
		for _, no := range nos {
			o, err := e.ledger.Order(e.ctx, no)
			if err != nil {
				t.Fatal(err)
			}
			if err := e.sched.ScheduleClose(e.ctx, no, o.ExpiresAt); err != nil {
				t.Fatal(err)
			}
		}
		// A worker holds one of them, as if the payment raced its close.
		claimed, err := e.sched.Close.Claim(e.ctx, e.clock.Now().Add(ttl), 1, time.Minute)
		if err != nil || len(claimed.Members) != 1 {
			t.Fatalf("claim: %+v %v", claimed, err)
		}
		var unpaid, cancelled string
		for _, no := range nos {
			switch {
			case no == claimed.Members[0]:
			case unpaid == "":
				unpaid = no
			case cancelled == "":
				cancelled = no
			}
		}
		if _, err := e.shop.CloseOrders(e.ctx, []string{cancelled}, domain.CloseCancel); err != nil {
			t.Fatal(err)
		}
		// Every other order is paid, all at once, so the payments batch.
		var wg sync.WaitGroup
		for _, no := range nos {
			if no == unpaid || no == cancelled {
				continue
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				o, err := e.ledger.Order(e.ctx, no)
				if err != nil {
					t.Error(err)
					return
				}
				res, err := e.shop.RecordPayment(e.ctx, domain.Payment{Provider: "sandbox", OrderNo: no, TradeNo: "T" + no,
					AmountFen: o.AmountFen, PaidAt: e.clock.Now(), Raw: "{}"})
				if err != nil || res.Outcome != domain.PaymentDelivered {
					t.Errorf("pay %s: %+v %v", no, res, err)
				}
			}()
		}
		wg.Wait()

		st, err := e.sched.Close.Stats(e.ctx, e.clock.Now())
		if err != nil || st.Backlog != 1 || st.Leased != 0 {
			t.Fatalf("close queue after the payments: %+v %v, want the one unpaid order queued and nothing leased", st, err)
		}
		w := queue.NewWorkers(queue.Config{}, rs.Client, e.keys, e.shop, e.ledger, quietLogger())
		if res, err := w.Sweep(e.ctx); err != nil || res.Scheduled != 0 || res.Pending != 1 {
			t.Fatalf("sweep: %+v %v", res, err)
		}
		if st, _ := e.sched.Close.Stats(e.ctx, e.clock.Now()); st.Backlog != 1 {
			t.Fatalf("close queue after the sweep: %+v", st)
		}
	})
}
