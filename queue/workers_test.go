package queue_test

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/domain/domaintest"
	"kami/queue"
	"kami/queue/redistest"
)

const ttl = 15 * time.Minute

// counterRight waits until the product's stock counter equals its lockable
// cards in the database.
func (e *env) counterRight(t *testing.T, productID int64) {
	t.Helper()
	var last string
	defer func() {
		if t.Failed() {
			t.Log("last seen:", last)
		}
	}()
	eventually(t, 10*time.Second, "stock counter matches the database", func() bool {
		cs, err := e.ledger.StockCounts(e.ctx, productID)
		if err != nil {
			t.Fatal(err)
		}
		n, ok, err := e.gate.Counter(e.ctx, productID)
		last = fmt.Sprintf("counter %d (present %v, err %v), database %+v", n, ok, err, cs[productID])
		return err == nil && ok && n == cs[productID].Lockable
	})
}

func TestWorkersCloseDueOrders(t *testing.T) {
	combos(t, func(t *testing.T, db *bun.DB, rs *redistest.Server) {
		e := newEnv(t, db, rs, domain.Config{OrderTTL: ttl})
		p := e.product(t, 60)
		var nos []string
		for i := range 40 {
			placed, err := e.placeViaShop(t, p, fmt.Sprintf("b%d@example.com", i))
			if err != nil {
				t.Fatal(err)
			}
			nos = append(nos, placed.Order.OrderNo)
		}
		// A member that names no order: logged, acked, counted.
		if err := e.sched.ScheduleClose(e.ctx, "00000000000000000000", e.clock.Now()); err != nil {
			t.Fatal(err)
		}
		sub, stop := e.events.Subscribe(e.ctx, nos[0])
		defer stop()
		w := e.workers(t, queue.Config{CloseBatch: 7})
		eventually(t, 10*time.Second, "the unknown member is acked", func() bool { return w.Stats().Unknown == 1 })
		if n := pendingCount(t, db); n != 40 {
			t.Fatalf("%d orders pending before their time, want 40", n)
		}
		e.clock.Advance(ttl)
		eventually(t, 20*time.Second, "every due order closed", func() bool { return pendingCount(t, db) == 0 })
		closedOnce(t, db, nos)
		mustAudit(t, e.ledger)
		e.counterRight(t, p.ID)
		// An empty status is the hub's "look again" (a catch-up without a
		// status reader, as here: after a command of this process failed
		// on a busy machine); the order's own status follows or came first.
	wait:
		for {
			select {
			case st := <-sub:
				if st == "" {
					if got, err := e.ledger.Order(e.ctx, nos[0]); err == nil && got.Status == domain.OrderClosed {
						break wait
					}
					continue
				}
				if st != domain.OrderClosed {
					t.Errorf("event %s, want CLOSED", st)
				}
				break wait
			case <-time.After(domaintest.MinPatience):
				t.Error("no CLOSED event for a subscribed order")
				break wait
			}
		}
		eventually(t, 5*time.Second, "closes counted", func() bool {
			st := w.Stats()
			return st.Closed == 40 && st.LatencyCount == 40
		})
		eventually(t, 5*time.Second, "queues empty", func() bool {
			cq, _, err := w.QueueStats(e.ctx)
			return err == nil && cq.Backlog == 0 && cq.Leased == 0
		})
	})
}

// TestWorkersCloseJustAfterDue: the close waker sleeps until the next due
// order and closes it then. Its latency (due to closed) is measured by
// BenchmarkDueToClosedLatency and logged here; it is not asserted, since it
// measures the machine as much as the waker (under -race with other jobs
// beside, a drain alone can take a second).
func TestWorkersCloseJustAfterDue(t *testing.T) {
	t.Parallel()
	rs := redistest.Open(t, redistest.Mini)
	db := dbtest.Open(t, dbtest.SQLite)
	e := newEnv(t, db, rs, domain.Config{OrderTTL: 700 * time.Millisecond})
	e.ledger.Now, e.ledger.DBClock = time.Now, time.Now // real time: the waker's own timing
	p := e.product(t, 20)
	w := e.workers(t, queue.Config{WakeCap: time.Second})
	for i := range 10 {
		if _, err := e.placeViaShop(t, p, fmt.Sprintf("b%d@example.com", i)); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, 10*time.Second, "all closed and counted", func() bool { return pendingCount(t, db) == 0 && w.Stats().Closed == 10 })
	t.Logf("worst due-to-closed latency %s", time.Duration(w.Stats().LatencyMaxNS))
}

// TestWorkersGatherDueOrdersIntoBatches: orders that are due together are
// closed in one transaction, not one each, whichever drain (the waker's or
// the cron's) finds them: a claim takes every due order at once. On the
// test's clock all twenty fall due at one step, so the count does not
// depend on how fast the machine places them or wakes the drains.
func TestWorkersGatherDueOrdersIntoBatches(t *testing.T) {
	t.Parallel()
	rs := redistest.Open(t, redistest.Mini)
	db := dbtest.Open(t, dbtest.SQLite)
	closes := &closeCounter{}
	db = db.WithQueryHook(closes)
	e := newEnv(t, db, rs, domain.Config{OrderTTL: ttl})
	p := e.product(t, 20)
	w := e.workers(t, queue.Config{})
	for i := range 20 {
		if _, err := e.placeViaShop(t, p, fmt.Sprintf("b%d@example.com", i)); err != nil {
			t.Fatal(err)
		}
		e.clock.Advance(5 * time.Millisecond) // due one after another...
	}
	e.clock.Advance(ttl) // ...and all due by now
	eventually(t, 10*time.Second, "all closed", func() bool { return pendingCount(t, db) == 0 && w.Stats().Closed == 20 })
	if n := closes.n.Load(); n != 1 {
		t.Errorf("20 due orders closed in %d transactions, want 1", n)
	}
}

// closeCounter counts the statements that close orders.
type closeCounter struct{ n atomic.Int64 }

func (c *closeCounter) BeforeQuery(ctx context.Context, _ *bun.QueryEvent) context.Context {
	return ctx
}

func (c *closeCounter) AfterQuery(_ context.Context, ev *bun.QueryEvent) {
	if strings.HasPrefix(ev.Query, `UPDATE "orders" SET status = 'CLOSED'`) {
		c.n.Add(1)
	}
}

func TestFlushMidRun(t *testing.T) {
	combos(t, func(t *testing.T, db *bun.DB, rs *redistest.Server) {
		e := newEnv(t, db, rs, domain.Config{OrderTTL: ttl})
		p := e.product(t, 250)
		var first, second []string
		for i := range 100 {
			placed, err := e.placeViaShop(t, p, fmt.Sprintf("a%d@example.com", i))
			if err != nil {
				t.Fatal(err)
			}
			first = append(first, placed.Order.OrderNo)
		}
		e.clock.Advance(5 * time.Minute)
		for i := range 100 {
			placed, err := e.placeViaShop(t, p, fmt.Sprintf("b%d@example.com", i))
			if err != nil {
				t.Fatal(err)
			}
			second = append(second, placed.Order.OrderNo)
		}
		w := e.workers(t, queue.Config{CloseBatch: 30})
		e.clock.Advance(ttl - 5*time.Minute)
		eventually(t, 20*time.Second, "the first hundred closed", func() bool { return pendingCount(t, db) == 100 })
		// Redis loses everything: the second hundred's schedules and the
		// stock counter.
		rs.Wipe(t, e.keys.Prefix())
		e.clock.Advance(5 * time.Minute)
		eventually(t, 20*time.Second, "the second hundred closed after the flush", func() bool { return pendingCount(t, db) == 0 })
		closedOnce(t, db, append(first, second...))
		mustAudit(t, e.ledger)
		e.counterRight(t, p.ID)
		// Restored schedules are counted just after they are written, and
		// may close before that.
		eventually(t, 5*time.Second, "the sweeper counted at least 100 restored schedules", func() bool { return w.Stats().Swept >= 100 })
	})
}

func TestCrashWindowBetweenCommitAndSchedule(t *testing.T) {
	combos(t, func(t *testing.T, db *bun.DB, rs *redistest.Server) {
		e := newEnv(t, db, rs, domain.Config{OrderTTL: ttl})
		p := e.product(t, 80)
		// Committed in the database, never scheduled: the process died
		// between the commit and the ZADD.
		lost := e.place(t, p, 50)
		e.clock.Advance(time.Minute)
		lostLater := e.place(t, p, 20)
		w := e.workers(t, queue.Config{})
		eventually(t, 10*time.Second, "the sweeper found the lost schedules", func() bool { return w.Stats().Swept >= 70 })
		e.clock.Advance(ttl)
		eventually(t, 20*time.Second, "every order closed", func() bool { return pendingCount(t, db) == 0 })
		closedOnce(t, db, append(lost, lostLater...))
		mustAudit(t, e.ledger)
	})
}

func TestRedisDownMidRun(t *testing.T) {
	for _, dk := range []dbtest.Kind{dbtest.SQLite, dbtest.Postgres, dbtest.MySQL} {
		t.Run(string(dk), func(t *testing.T) {
			t.Parallel()
			rs := redistest.Open(t, redistest.Mini)
			db := dbtest.Open(t, dk)
			e := newEnv(t, db, rs, domain.Config{OrderTTL: ttl})
			p := e.product(t, 100)
			var nos []string
			for i := range 30 {
				placed, err := e.placeViaShop(t, p, fmt.Sprintf("a%d@example.com", i))
				if err != nil {
					t.Fatal(err)
				}
				nos = append(nos, placed.Order.OrderNo)
			}
			w := e.workers(t, queue.Config{})
			addr := rs.Mini.Addr()
			rs.Mini.Close()
			if _, err := e.placeViaShop(t, p, "down@example.com"); domain.ErrorCode(err) != domain.EUNAVAILABLE {
				t.Fatalf("order with Redis down: %v, want UNAVAILABLE", err)
			}
			e.clock.Advance(ttl)
			// Redis is down: the sweeper closes overdue orders itself.
			eventually(t, 20*time.Second, "overdue orders closed with Redis down", func() bool { return pendingCount(t, db) == 0 })
			if w.Stats().RedisErrors == 0 {
				t.Error("no Redis errors counted while Redis was down")
			}
			if err := rs.Mini.Restart(); err != nil {
				t.Fatal(err)
			}
			if rs.Mini.Addr() != addr {
				t.Fatalf("restarted on %s, was %s", rs.Mini.Addr(), addr)
			}
			// Back: the queue drains what it still held (already closed:
			// skipped) and closes new orders.
			for i := range 20 {
				var placed *domain.PlacedOrder
				// The clients find Redis again within their dial backoff;
				// until then ordering answers UNAVAILABLE (retryable).
				eventually(t, 10*time.Second, "ordering resumes", func() bool {
					var err error
					placed, err = e.placeViaShop(t, p, fmt.Sprintf("b%d@example.com", i))
					if err != nil && domain.ErrorCode(err) != domain.EUNAVAILABLE {
						t.Fatal(err)
					}
					return err == nil
				})
				nos = append(nos, placed.Order.OrderNo)
			}
			e.clock.Advance(ttl)
			eventually(t, 20*time.Second, "orders closed after Redis came back", func() bool { return pendingCount(t, db) == 0 })
			eventually(t, 10*time.Second, "queue drained", func() bool {
				cq, _, err := w.QueueStats(e.ctx)
				return err == nil && cq.Backlog == 0 && cq.Leased == 0
			})
			closedOnce(t, db, nos)
			mustAudit(t, e.ledger)
			// Stopped first: the sweeper (every second here) closes
			// overdue orders itself whenever it finds Redis away, and
			// gives their cards back after its commit; the waits above
			// can end between the two (the close queue's members of
			// those orders acked as already closed). Stop waits for it.
			if err := w.Stop(e.ctx); err != nil {
				t.Fatal(err)
			}
			// A close committed while Redis was away may give its cards
			// back only once Redis is back, after the counter was rebuilt
			// from a database that already counts them: the counter can
			// then stand above the database (it refuses nothing the
			// database would sell; the card lock refuses the rest), never
			// below. The reconciliation's repair sets it right.
			n, ok, err := e.gate.Counter(e.ctx, p.ID)
			cs, _ := e.ledger.StockCounts(e.ctx, p.ID)
			if err != nil || !ok || n < cs[p.ID].Lockable {
				t.Fatalf("counter %d (present %v, %v) below the database's %d lockable cards; left dirty %v; workers %+v",
					n, ok, err, cs[p.ID].Lockable, e.gate.Dirty(p.ID), w.Stats())
			}
			if _, err := e.gate.Repair(e.ctx, p.ID); err != nil {
				t.Fatal(err)
			}
			e.counterRight(t, p.ID)
		})
	}
}
