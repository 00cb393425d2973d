package queue_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/queue"
	"kami/queue/redistest"
)

// sweepReadHook notes how many close tasks were due when the sweeper
// first read the PENDING orders.
type sweepReadHook struct {
	q    *queue.DelayQueue
	now  func() time.Time
	once sync.Once
	due  chan int64
}

func (h *sweepReadHook) BeforeQuery(ctx context.Context, e *bun.QueryEvent) context.Context {
	if strings.Contains(e.Query, "ORDER BY expires_at, order_no") { // Ledger.PendingOrders
		h.once.Do(func() {
			st, err := h.q.Stats(ctx, h.now())
			if err != nil {
				st.Due = -1
			}
			h.due <- st.Due
		})
	}
	return ctx
}

func (h *sweepReadHook) AfterQuery(context.Context, *bun.QueryEvent) {}

// TestStartupSweepLetsTheDrainGoFirst: a process that starts with a
// backlog of due orders on its close queue (a restart) lets the drain work
// it off before the sweeper reads every PENDING order, which would compete
// with the drain for the database and put back on the queue the orders
// closed meanwhile. The sweep still comes, and restores the schedule
// Redis lost.
func TestStartupSweepLetsTheDrainGoFirst(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		db dbtest.Kind
		rk redistest.Kind
	}{{dbtest.SQLite, redistest.Mini}, {dbtest.Postgres, redistest.Real}} {
		t.Run(string(c.db)+"/"+string(c.rk), func(t *testing.T) {
			t.Parallel()
			db := dbtest.Open(t, c.db)
			e := newEnv(t, db, redistest.Open(t, c.rk), domain.Config{OrderTTL: ttl})
			const n, batch = 60, 5
			p := e.product(t, n+1)
			var nos []string
			for i := range n + 1 {
				placed, err := e.placeViaShop(t, p, fmt.Sprintf("b%d@example.com", i))
				if err != nil {
					t.Fatal(err)
				}
				nos = append(nos, placed.Order.OrderNo)
			}
			q := queue.CloseQueue(e.redis.Client, e.keys)
			lost := nos[n]
			if err := e.redis.Client.ZRem(e.ctx, q.Key(), lost).Err(); err != nil { // its schedule lost
				t.Fatal(err)
			}
			e.clock.Advance(ttl)
			hook := &sweepReadHook{q: q, now: e.clock.Now, due: make(chan int64, 1)}
			//lint:ignore SA1019 the workers started below use this very db; WithQueryHook would hand them another
			db.AddQueryHook(hook)
			e.workers(t, queue.Config{CloseBatch: batch, CloseDrainers: 1, SweepEvery: time.Hour})
			eventually(t, 30*time.Second, "every order closed, the lost one too", func() bool { return pendingCount(t, db) == 0 })
			closedOnce(t, db, nos)
			select {
			case due := <-hook.due:
				if due < 0 || due > batch {
					t.Fatalf("the sweeper read the pending orders with %d closes due, want at most one claim's worth (%d)", due, batch)
				}
			default:
				// Every order was closed, the lost one too, so the sweep ran
				// and read them (its statement is what the hook looks for).
				t.Fatal("the hook never saw the sweeper's read of the PENDING orders")
			}
		})
	}
}
