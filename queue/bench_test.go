package queue_test

// Benchmarks of the close path against PostgreSQL and the real Redis; they
// skip without them. Each is one macro run: use -benchtime=1x.
//
//	go test ./queue/ -run '^$' -bench . -benchtime=1x -timeout 30m
//
// KAMI_BENCH_N (default 100000) sets the backlog drained and the pending
// orders rebuilt (BenchmarkCloseDrainChecked has its own, see there); KAMI_BENCH_ARTICLE_N (default 1000) the article loop's
// orders; KAMI_BENCH_LATENCY_SECONDS (default 5) how long 2,000 orders a
// second fall due.

import (
	"context"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/domain/domaintest"
	"kami/providers"
	"kami/providers/sandbox"
	"kami/queue"
	"kami/queue/redistest"
)

func envInt(k string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(k)); err == nil && v > 0 {
		return v
	}
	return def
}

type benchEnv struct {
	ctx    context.Context
	pe     *procEnv
	shop   *domain.Shop
	events *queue.Events
}

func newBenchEnv(b *testing.B) *benchEnv {
	b.Helper()
	rs := redistest.Open(b, redistest.Real)
	db := dbtest.Open(b, dbtest.Postgres)
	sealer, _ := domain.NewSealer(domaintest.Key())
	l := domain.NewLedger(db, sealer, domain.Config{}, domain.LogAlerter{Logger: quietLogger()})
	keys := queue.NewKeys(rs.Prefix(b))
	pe := &procEnv{db: db, ledger: l, rs: rs, keys: keys, sealer: sealer}
	ev := queue.NewEvents(rs.Client, keys, quietLogger())
	closeAtEnd(b, ev)
	shop := &domain.Shop{Ledger: l, Gate: queue.NewStockGate(rs.Client, keys, l), Scheduler: queue.NewScheduler(rs.Client, keys),
		Events: ev, Log: quietLogger()}
	return &benchEnv{ctx: context.Background(), pe: pe, shop: shop, events: ev}
}

// seed writes n pending orders expiring at due(i) and, if schedule, puts
// them on the close queue; if analyze, the tables' statistics are brought
// up to date (as autovacuum leaves them in the long run).
func (be *benchEnv) seed(b *testing.B, n int, due func(i int) time.Time, schedule, analyze bool) []string {
	b.Helper()
	pid, nos, err := seedPending(be.ctx, be.pe.db, be.pe.sealer, n, 0, due)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := be.shop.Gate.(*queue.StockGate).Repair(be.ctx, pid); err != nil {
		b.Fatal(err)
	}
	if schedule {
		items := make([]queue.Item, n)
		for i, no := range nos {
			items[i] = queue.Item{Member: no, Due: due(i)}
		}
		if _, err := queue.CloseQueue(be.pe.rs.Client, be.pe.keys).ScheduleIfAbsent(be.ctx, items); err != nil {
			b.Fatal(err)
		}
	}
	if analyze {
		if _, err := be.pe.db.ExecContext(be.ctx, "ANALYZE"); err != nil {
			b.Fatal(err)
		}
	}
	return nos
}

func (be *benchEnv) workers(b *testing.B, cfg queue.Config, skipStartSweep bool) *queue.Workers {
	b.Helper()
	if skipStartSweep {
		// Measure the drain alone: the sweeper's pass at start would read
		// the same backlog from the database (BenchmarkRebuildAfterFlush
		// measures that).
		be.pe.rs.Client.Set(be.ctx, be.pe.keys.SweepLock(), time.Now().Add(time.Hour).UnixMilli(), time.Hour)
	}
	return queue.NewWorkers(cfg, be.pe.rs.Client, be.pe.keys, be.shop, be.pe.ledger, quietLogger())
}

func waitDrained(b *testing.B, be *benchEnv, q *queue.DelayQueue, within time.Duration) {
	b.Helper()
	deadline := time.Now().Add(within)
	for {
		st, err := q.Stats(be.ctx, time.Now())
		if err != nil {
			b.Fatal(err)
		}
		if st.Backlog == 0 && st.Leased == 0 {
			return
		}
		if time.Now().After(deadline) {
			b.Fatalf("not drained within %s: %+v", within, st)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// BenchmarkCloseDrain: closes per second draining a backlog of N due
// orders with the workers (claims of 500, one transaction per batch, four
// drains in parallel).
func BenchmarkCloseDrain(b *testing.B) {
	n := envInt("KAMI_BENCH_N", 100_000)
	for range b.N {
		benchDrain(b, n, queue.Config{}, nil, true)
	}
}

// BenchmarkCloseDrainChecked is BenchmarkCloseDrain as a restart finds
// its backlog in go run ./bench -drain: the pre-close check on (the
// sandbox asked about each order), and the tables not analyzed since the
// orders were written, as a burst of orders leaves them until autovacuum
// comes round. KAMI_BENCH_DRAIN_N (default 20000) sets the backlog;
// KAMI_BENCH_DRAINERS and KAMI_BENCH_BATCH the workers' CloseDrainers and
// CloseBatch (default theirs).
func BenchmarkCloseDrainChecked(b *testing.B) {
	n := envInt("KAMI_BENCH_DRAIN_N", 20_000)
	cfg := queue.Config{CloseDrainers: envInt("KAMI_BENCH_DRAINERS", 0), CloseBatch: envInt("KAMI_BENCH_BATCH", 0)}
	for range b.N {
		benchDrain(b, n, cfg, func(be *benchEnv) {
			sb, err := sandbox.New(sandbox.Config{Secret: "bench-secret", BaseURL: "http://127.0.0.1"})
			if err != nil {
				b.Fatal(err)
			}
			be.shop.Providers, be.shop.PreCloseCheck = providers.NewRegistry(sb), true
		}, false)
	}
}

// benchDrain seeds n due orders on the close queue, starts the workers
// and reports how fast they close them all. setup, if set, adjusts the
// shop first.
func benchDrain(b *testing.B, n int, cfg queue.Config, setup func(*benchEnv), analyze bool) {
	b.StopTimer()
	be := newBenchEnv(b)
	if setup != nil {
		setup(be)
	}
	past := time.Now().Add(-time.Minute)
	be.seed(b, n, func(i int) time.Time { return past.Add(time.Duration(i) * time.Microsecond) }, true, analyze)
	w := be.workers(b, cfg, true)
	b.StartTimer()
	start := time.Now()
	if err := w.Start(be.ctx); err != nil {
		b.Fatal(err)
	}
	waitDrained(b, be, queue.CloseQueue(be.pe.rs.Client, be.pe.keys), 10*time.Minute)
	took := time.Since(start)
	b.StopTimer()
	w.Stop(be.ctx)
	if p := pendingCount(b, be.pe.db); p != 0 {
		b.Fatalf("%d orders still pending", p)
	}
	if st := w.Stats(); st.Closed != int64(n) {
		b.Fatalf("closed %d, want %d", st.Closed, n)
	}
	b.ReportMetric(float64(n)/took.Seconds(), "closes/s")
	b.ReportMetric(took.Seconds(), "s/drain")
}

// BenchmarkArticleLoop is the article's loop as the baseline: every second
// ZRANGEBYSCORE ... LIMIT 0 100, then ZREM each member and close it in its
// own transaction (through the same close path, one order at a time).
// "poll1s" is the loop as written; "nosleep" polls again at once, to show
// the ceiling of one transaction per order.
func BenchmarkArticleLoop(b *testing.B) {
	n := envInt("KAMI_BENCH_ARTICLE_N", 1000)
	for _, poll := range []time.Duration{time.Second, 0} {
		name := "poll1s"
		if poll == 0 {
			name = "nosleep"
		}
		b.Run(name, func(b *testing.B) {
			for range b.N {
				b.StopTimer()
				be := newBenchEnv(b)
				past := time.Now().Add(-time.Minute)
				be.seed(b, n, func(i int) time.Time { return past.Add(time.Duration(i) * time.Microsecond) }, true, true)
				key := be.pe.keys.CloseQueue()
				rdb := be.pe.rs.Client
				b.StartTimer()
				start := time.Now()
				closed := articleLoop(b, be, rdb, key, poll)
				took := time.Since(start)
				b.StopTimer()
				if closed != n {
					b.Fatalf("closed %d, want %d", closed, n)
				}
				b.ReportMetric(float64(n)/took.Seconds(), "closes/s")
			}
		})
	}
}

func articleLoop(b *testing.B, be *benchEnv, rdb redis.UniversalClient, key string, poll time.Duration) int {
	closed := 0
	for {
		tick := time.Now()
		due, err := rdb.ZRangeByScore(be.ctx, key, &redis.ZRangeBy{Min: "-inf",
			Max: strconv.FormatInt(time.Now().UnixMilli(), 10), Offset: 0, Count: 100}).Result()
		if err != nil {
			b.Fatal(err)
		}
		if len(due) == 0 {
			return closed
		}
		for _, no := range due {
			if n, err := rdb.ZRem(be.ctx, key, no).Result(); err != nil || n == 0 {
				continue // another poller took it
			}
			rs, err := be.shop.CloseOrders(be.ctx, []string{no}, domain.CloseTimeout)
			if err != nil {
				b.Fatal(err)
			}
			if rs[0].Outcome == domain.Closed {
				closed++
			}
		}
		if poll > 0 {
			time.Sleep(time.Until(tick.Add(poll)))
		}
	}
}

// BenchmarkDueToClosedLatency: 2,000 orders a second fall due for a few
// seconds (scheduled ahead, as placed orders are); the latency from each
// order's expires_at to its close committed, p50 and p99.
func BenchmarkDueToClosedLatency(b *testing.B) {
	secs := envInt("KAMI_BENCH_LATENCY_SECONDS", 5)
	const rate = 2000
	n := secs * rate
	for range b.N {
		b.StopTimer()
		be := newBenchEnv(b)
		// Seeded an hour ahead, then moved to fall due two seconds from
		// now, so the seeding time does not turn into a backlog.
		base := time.Now().Add(time.Hour)
		due := func(i int) time.Time { return base.Add(time.Duration(i) * time.Second / rate) }
		nos := be.seed(b, n, due, false, true)
		first := time.Now().Add(2 * time.Second)
		shift := base.Sub(first)
		for _, table := range []string{"orders", "pending_order"} {
			if _, err := be.pe.db.ExecContext(be.ctx, "UPDATE "+table+" SET expires_at = expires_at - make_interval(secs => ?)", shift.Seconds()); err != nil {
				b.Fatal(err)
			}
		}
		items := make([]queue.Item, n)
		for i, no := range nos {
			items[i] = queue.Item{Member: no, Due: due(i).Add(-shift)}
		}
		if _, err := queue.CloseQueue(be.pe.rs.Client, be.pe.keys).ScheduleIfAbsent(be.ctx, items); err != nil {
			b.Fatal(err)
		}
		w := be.workers(b, queue.Config{}, true)
		var mu sync.Mutex
		lats := make([]time.Duration, 0, n)
		w.OnClosed = func(d time.Duration) {
			mu.Lock()
			lats = append(lats, d)
			mu.Unlock()
		}
		if err := w.Start(be.ctx); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		time.Sleep(time.Until(first))
		waitDrained(b, be, queue.CloseQueue(be.pe.rs.Client, be.pe.keys), time.Minute)
		b.StopTimer()
		w.Stop(be.ctx)
		mu.Lock()
		slices.Sort(lats)
		got := len(lats)
		mu.Unlock()
		if got != n {
			b.Fatalf("%d closes observed, want %d", got, n)
		}
		q := func(p float64) float64 {
			return float64(lats[min(int(p*float64(got)), got-1)]) / float64(time.Millisecond)
		}
		b.ReportMetric(q(0.50), "p50-ms")
		b.ReportMetric(q(0.99), "p99-ms")
		b.ReportMetric(q(1), "max-ms")
	}
}

// BenchmarkRebuildAfterFlush: N pending orders, Redis empty (as after
// FLUSHALL): the time for one sweep to put every one back on the queue.
func BenchmarkRebuildAfterFlush(b *testing.B) {
	n := envInt("KAMI_BENCH_N", 100_000)
	for range b.N {
		b.StopTimer()
		be := newBenchEnv(b)
		later := time.Now().Add(15 * time.Minute)
		be.seed(b, n, func(i int) time.Time { return later.Add(time.Duration(i) * time.Microsecond) }, false, true)
		be.pe.rs.Wipe(b, be.pe.keys.Prefix())
		w := be.workers(b, queue.Config{}, false)
		b.StartTimer()
		start := time.Now()
		res, err := w.Sweep(be.ctx)
		took := time.Since(start)
		b.StopTimer()
		if err != nil {
			b.Fatal(err)
		}
		st, _ := queue.CloseQueue(be.pe.rs.Client, be.pe.keys).Stats(be.ctx, time.Now())
		if res.Scheduled != n || st.Backlog != int64(n) {
			b.Fatalf("rebuilt %d (queue %d), want %d", res.Scheduled, st.Backlog, n)
		}
		b.ReportMetric(took.Seconds(), "s/rebuild")
		b.ReportMetric(float64(n)/took.Seconds(), "orders/s")
	}
}

// BenchmarkStockTake: what a take of the stock gate costs Redis itself,
// the time its script holds the server (and every command behind it), as
// "redis-µs/take" from INFO commandstats. Not one macro run: give it many
// takes, and the same number when comparing versions,
//
//	go test ./queue/ -run '^$' -bench StockTake -benchtime=200000x
//
// The Redis is a private one, so that no other test's scripts are counted
// with the takes; the counter never runs short, so no take rebuilds it.
func BenchmarkStockTake(b *testing.B) {
	node := redistest.StartPrivate(b)
	rs := &redistest.Server{Kind: redistest.Real, URL: node.URL}
	rs.Client = rs.NewClient(b)
	e := newEnv(b, dbtest.Open(b, dbtest.Postgres), rs, domain.Config{})
	const productID = 1
	if err := rs.Client.Set(e.ctx, e.keys.Stock(productID), 1<<62, 0).Err(); err != nil {
		b.Fatal(err)
	}
	take := func() bool {
		ok, err := e.gate.Take(e.ctx, productID, 1)
		if err != nil || !ok {
			b.Errorf("take: %v %v", ok, err)
			return false
		}
		return true
	}
	take() // loads the script: EVAL, not counted below
	calls, usec := scriptStats(b, node)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() && take() {
		}
	})
	b.StopTimer()
	callsAfter, usecAfter := scriptStats(b, node)
	if callsAfter-calls != b.N {
		b.Fatalf("%d scripts ran for %d takes", callsAfter-calls, b.N)
	}
	b.ReportMetric(float64(usecAfter-usec)/float64(b.N), "redis-µs/take")
}
