package queue_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/domain/domaintest"
	"kami/migrations"
	"kami/queue"
	"kami/queue/redistest"
)

// procEnv is a database and Redis that worker processes share with the test.
type procEnv struct {
	dbURL  string
	db     *bun.DB
	ledger *domain.Ledger
	rs     *redistest.Server
	keys   queue.Keys
	sealer *domain.Sealer
}

func newProcEnv(t *testing.T, dk dbtest.Kind, rk redistest.Kind) *procEnv {
	t.Helper()
	rs := redistest.Open(t, rk)
	url := dbtest.URL(t, dk)
	db, err := domain.OpenDB(context.Background(), url, t.TempDir(), domain.DBOptions{MaxOpenConns: 8})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	if _, err := migrations.Migrate(context.Background(), db); err != nil {
		t.Fatal(err)
	}
	sealer, _ := domain.NewSealer(domaintest.Key())
	l := domain.NewLedger(db, sealer, domain.Config{}, domain.LogAlerter{Logger: quietLogger()})
	return &procEnv{dbURL: url, db: db, ledger: l, rs: rs, keys: queue.NewKeys(rs.Prefix(t)), sealer: sealer}
}

// seedDue seeds n pending orders already due (real time) and schedules
// them all.
func (pe *procEnv) seedDue(t *testing.T, n int) (int64, []string) {
	t.Helper()
	ctx := context.Background()
	now := time.Now()
	pid, nos, err := seedPending(ctx, pe.db, pe.sealer, n, 10, func(i int) time.Time { return now.Add(-time.Second - time.Duration(i)*time.Microsecond) })
	if err != nil {
		t.Fatal(err)
	}
	items := make([]queue.Item, n)
	for i, no := range nos {
		items[i] = queue.Item{Member: no, Due: now.Add(-time.Second)}
	}
	if _, err := queue.CloseQueue(pe.rs.Client, pe.keys).ScheduleIfAbsent(ctx, items); err != nil {
		t.Fatal(err)
	}
	return pid, nos
}

// procCombos runs fn on each database with each Redis: the in-process one,
// the real one and a Redis Cluster of the test's own (the server databases
// only: how several processes scale out).
func procCombos(t *testing.T, fn func(t *testing.T, dk dbtest.Kind, rk redistest.Kind)) {
	for _, dk := range []dbtest.Kind{dbtest.SQLite, dbtest.Postgres, dbtest.MySQL} {
		for _, rk := range []redistest.Kind{redistest.Mini, redistest.Real, redistest.RealCluster} {
			if rk == redistest.RealCluster && dk == dbtest.SQLite {
				continue
			}
			t.Run(string(dk)+"/"+string(rk), func(t *testing.T) {
				t.Parallel()
				fn(t, dk, rk)
			})
		}
	}
}

// A worker process claims a batch, starts closing it (holding the rows in an
// open transaction) and is killed with SIGKILL: its claim comes back when
// the lease ends, and the surviving workers close every order once.
func TestWorkerKilledMidBatch(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	procCombos(t, func(t *testing.T, dk dbtest.Kind, rk redistest.Kind) {
		pe := newProcEnv(t, dk, rk)
		_, nos := pe.seedDue(t, 300)
		const lease = 2 * time.Second
		victim := startChild(t, "claim-and-hang", pe.dbURL, pe.rs.URL, pe.keys.Prefix(), lease, 120)
		claimed, _ := strconv.Atoi(victim.line(t, "claimed ", 30*time.Second))
		if claimed != 120 {
			t.Fatalf("victim claimed %d, want 120", claimed)
		}
		victim.kill9(t)
		q := queue.CloseQueue(pe.rs.Client, pe.keys)
		st, err := q.Stats(context.Background(), time.Now())
		if err != nil || st.Leased != 120 {
			t.Fatalf("after the kill: %+v %v, want 120 leased", st, err)
		}
		start := time.Now()
		survivor := startChild(t, "work", pe.dbURL, pe.rs.URL, pe.keys.Prefix(), lease, 50)
		survivor.line(t, "ready", 30*time.Second)
		// Every order closed and the queue empty. On a busy machine the
		// survivor's own batches may outlive their 2 s lease too: they come
		// back, are found closed and acked, so the queue empties after the
		// last close rather than with it.
		eventually(t, 30*time.Second, "every order closed and the queue drained", func() bool {
			st, err := q.Stats(context.Background(), time.Now())
			return pendingCount(t, pe.db) == 0 && err == nil && st.Backlog == 0 && st.Leased == 0
		})
		t.Logf("the killed worker's batch came back and closed within %s (lease %s)", time.Since(start), lease)
		if n := survivor.stop(t); n != len(nos) {
			t.Errorf("survivor closed %d, want %d", n, len(nos))
		}
		closedOnce(t, pe.db, nos)
		mustAudit(t, pe.ledger)
	})
}

// Three worker processes share one Redis and one database: every order is
// closed exactly once, and the closes add up across the processes.
func TestThreeProcessesShareTheQueues(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	procCombos(t, func(t *testing.T, dk dbtest.Kind, rk redistest.Kind) {
		pe := newProcEnv(t, dk, rk)
		n := 3000
		if dk == dbtest.SQLite {
			n = 1500 // one writer shared by three processes
		}
		var kids []*child
		for range 3 {
			c := startChild(t, "work", pe.dbURL, pe.rs.URL, pe.keys.Prefix(), 5*time.Second, 100)
			c.line(t, "ready", 30*time.Second)
			kids = append(kids, c)
		}
		// Seeded while they run: the sweepers and the drains race for them.
		_, nos := pe.seedDue(t, n)
		eventually(t, 60*time.Second, "every order closed", func() bool { return pendingCount(t, pe.db) == 0 })
		total := 0
		for _, c := range kids {
			total += c.stop(t)
		}
		if total != n {
			t.Errorf("the processes closed %d orders in all, want %d", total, n)
		}
		closedOnce(t, pe.db, nos)
		mustAudit(t, pe.ledger)
	})
}
