package queue_test

import (
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/uptrace/bun"

	"kami/domain"
	"kami/providers"
	"kami/providers/fault"
	"kami/providers/sandbox"
	"kami/queue"
	"kami/queue/redistest"
)

// TestDeferredCloseComesBack: a due order whose gateway does not answer
// the pre-close question is not closed, and its close task is not lost:
// it goes back on the queue at the time to check again, and once the
// gateway answers the order closes.
func TestDeferredCloseComesBack(t *testing.T) {
	combos(t, func(t *testing.T, db *bun.DB, rs *redistest.Server) {
		e := newEnv(t, db, rs, domain.Config{OrderTTL: ttl})
		sb, err := sandbox.New(sandbox.Config{Secret: "test-secret", BaseURL: "http://127.0.0.1", Now: e.clock.Now})
		if err != nil {
			t.Fatal(err)
		}
		e.shop.Providers = providers.NewRegistry(sb)
		e.shop.PreCloseCheck = true
		e.shop.CheckRetry = time.Minute
		sb.InjectFault(fault.OpQueryPayment, fault.Server5xx, 0) // until cleared
		p := e.product(t, 2)
		nos := e.place(t, p, 1)
		e.clock.Advance(ttl)
		retryAt := e.clock.Now().Add(time.Minute)
		w := e.workers(t, queue.Config{Lease: 3 * time.Second})
		if e.shop.CheckBudget != time.Second {
			t.Fatalf("check budget %s under a lease of 3s, want a third of it", e.shop.CheckBudget)
		}

		eventually(t, 10*time.Second, "the order deferred", func() bool { return w.Stats().Deferred >= 1 })
		// Rescheduled first, then acked: it is never nowhere.
		eventually(t, 10*time.Second, "its close task back on the queue at the retry time, and no longer leased", func() bool {
			score, err := rs.Client.ZScore(e.ctx, e.keys.CloseQueue(), nos[0]).Result()
			_, lerr := rs.Client.ZScore(e.ctx, e.keys.CloseLease(), nos[0]).Result()
			return err == nil && int64(score) >= retryAt.UnixMilli() && lerr == redis.Nil
		})
		if o, err := e.ledger.Order(e.ctx, nos[0]); err != nil || o.Status != domain.OrderPending {
			t.Fatalf("order %+v, %v; want PENDING while its gateway does not answer", o, err)
		}

		sb.InjectFault(fault.OpQueryPayment, fault.None, 0)
		e.clock.Advance(time.Minute)
		w.DrainClose()
		eventually(t, 10*time.Second, "the order closed once its gateway answered", func() bool { return pendingCount(t, db) == 0 })
		closedOnce(t, db, nos)
		mustAudit(t, e.ledger)
	})
}
