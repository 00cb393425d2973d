package queue_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/domain/domaintest"
	"kami/queue"
	"kami/queue/redistest"
)

func TestMain(m *testing.M) {
	if os.Getenv("KAMI_TEST_LOG") == "" {
		// go-redis logs every failed dial; the Redis-down tests make many.
		redis.SetLogger(discardLogger{})
	}
	if os.Getenv(workerEnv) != "" {
		os.Exit(workerMain())
	}
	os.Exit(m.Run())
}

type discardLogger struct{}

func (discardLogger) Printf(context.Context, string, ...any) {}

func quietLogger() *slog.Logger {
	if os.Getenv("KAMI_TEST_LOG") != "" {
		return slog.Default()
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// env is what a queue test needs: a ledger over a fresh database, a Redis
// under the test's own prefix, and the shop wired to the gate, scheduler
// and event stream built on it.
type env struct {
	ctx    context.Context
	db     *bun.DB
	ledger *domain.Ledger
	clock  *domaintest.Clock
	redis  *redistest.Server
	keys   queue.Keys
	gate   *queue.StockGate
	sched  *queue.Scheduler
	events *queue.Events
	shop   *domain.Shop
}

func newEnv(t testing.TB, db *bun.DB, rs *redistest.Server, cfg domain.Config) *env {
	t.Helper()
	sealer, err := domain.NewSealer(domaintest.Key())
	if err != nil {
		t.Fatal(err)
	}
	e := &env{ctx: context.Background(), db: db, redis: rs, keys: queue.NewKeys(rs.Prefix(t)),
		clock: domaintest.NewClock(time.Now().UTC().Truncate(time.Second))}
	e.ledger = domain.NewLedger(db, sealer, cfg, domain.LogAlerter{Logger: quietLogger()})
	e.ledger.Now, e.ledger.DBClock = e.clock.Now, e.clock.Now // the database's clock too: tests move time
	e.gate = queue.NewStockGate(rs.Client, e.keys, e.ledger)
	// How long a take waits for another's rebuild before giving up: a bound
	// for a dead process, never a speed to meet.
	e.gate.RebuildWait = domaintest.MinPatience
	e.sched = queue.NewScheduler(rs.Client, e.keys)
	e.events = queue.NewEvents(rs.Client, e.keys, quietLogger())
	closeAtEnd(t, e.events)
	e.shop = &domain.Shop{Ledger: e.ledger, Gate: e.gate, Scheduler: e.sched, Events: e.events, Log: quietLogger()}
	return e
}

// workers starts workers with a test-sized config; they stop when the test
// ends.
func (e *env) workers(t testing.TB, cfg queue.Config) *queue.Workers {
	t.Helper()
	if cfg.Lease == 0 {
		cfg.Lease = 2 * time.Second
	}
	if cfg.RecoverEvery == 0 {
		cfg.RecoverEvery = time.Second
	}
	if cfg.SweepEvery == 0 {
		cfg.SweepEvery = time.Second
	}
	w := queue.NewWorkers(cfg, e.redis.Client, e.keys, e.shop, e.ledger, quietLogger())
	startUntilCleanup(t, e.ctx, "workers", w.Start, w.Stop)
	return w
}

// startUntilCleanup starts a worker and stops it when the test ends.
func startUntilCleanup(t testing.TB, ctx context.Context, what string, start, stop func(context.Context) error) {
	t.Helper()
	if err := start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute) // a deadline for a hang, never a speed
		defer cancel()
		if err := stop(ctx); err != nil {
			t.Errorf("stop %s: %v", what, err)
		}
	})
}

// product creates a product with n cards.
func (e *env) product(t testing.TB, n int) *domain.Product {
	t.Helper()
	name, price := "Game key", int64(1000)
	p, err := e.ledger.CreateProduct(e.ctx, domain.ProductInput{Name: &name, PriceFen: &price}, "test")
	if err != nil {
		t.Fatal(err)
	}
	for start := 0; start < n; start += domain.MaxCodesPerCall {
		codes := make([]string, min(n-start, domain.MaxCodesPerCall))
		for i := range codes {
			codes[i] = fmt.Sprintf("CODE-%d-%06d", p.ID, start+i)
		}
		if _, err := e.ledger.ImportCards(e.ctx, p.ID, codes, "test"); err != nil {
			t.Fatal(err)
		}
	}
	return p
}

// place places n orders of one card each through the shop (gate, ledger,
// schedule), from a few goroutines.
func (e *env) place(t testing.TB, p *domain.Product, n int) []string {
	t.Helper()
	nos := make([]string, n)
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < n; i += 4 {
				placed, err := e.shop.Ledger.PlaceOrder(e.ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1,
					Contact: fmt.Sprintf("buyer%d@example.com", i), Provider: "sandbox"})
				if err != nil {
					errs <- err
					return
				}
				nos[i] = placed.Order.OrderNo
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("PlaceOrder: %v", err)
	}
	return nos
}

// placeViaShop places one order through Shop.PlaceOrder's gate path
// without a provider: gate take, ledger, schedule (what Shop does, minus the
// payment action that needs a provider registry).
func (e *env) placeViaShop(t testing.TB, p *domain.Product, contact string) (*domain.PlacedOrder, error) {
	t.Helper()
	ok, err := e.gate.Take(e.ctx, p.ID, 1)
	if err != nil {
		return nil, domain.Errorf(domain.EUNAVAILABLE, "ordering is paused for a moment; try again")
	}
	if !ok {
		return nil, domain.Errorf(domain.ESOLDOUT, "sold out")
	}
	placed, err := e.ledger.PlaceOrder(e.ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: contact, Provider: "sandbox"})
	if err != nil {
		e.gate.GiveBack(e.ctx, p.ID, 1)
		return nil, err
	}
	if err := e.sched.ScheduleClose(e.ctx, placed.Order.OrderNo, placed.Order.ExpiresAt); err != nil {
		t.Logf("schedule failed (the sweeper will): %v", err)
	}
	return placed, nil
}

// mustAudit fails the test on any ledger violation.
func mustAudit(t testing.TB, l *domain.Ledger) {
	t.Helper()
	vs, err := l.Audit(context.Background())
	if err != nil {
		t.Fatalf("Audit: %v", err)
	}
	for _, v := range vs {
		t.Errorf("audit: %s", v)
	}
}

// closedOnce checks that every order in nos is CLOSED with exactly one
// type-3 stock flow row, and that no other order got one.
func closedOnce(t testing.TB, db *bun.DB, nos []string) {
	t.Helper()
	ctx := context.Background()
	var rows []struct {
		OrderNo string `bun:"order_no"`
		N       int    `bun:"n"`
	}
	if err := db.NewSelect().Table("stock_flow").Column("order_no").ColumnExpr("COUNT(*) AS n").
		Where("change_type = ?", domain.FlowReturn).Group("order_no").Scan(ctx, &rows); err != nil {
		t.Fatal(err)
	}
	flows := map[string]int{}
	for _, r := range rows {
		flows[r.OrderNo] = r.N
	}
	want := map[string]bool{}
	for _, no := range nos {
		want[no] = true
		if flows[no] != 1 {
			t.Errorf("order %s has %d close flows, want 1", no, flows[no])
		}
	}
	for no, n := range flows {
		if !want[no] {
			t.Errorf("order %s was not to be closed but has %d close flows", no, n)
		}
	}
	n, err := db.NewSelect().Table("orders").Where("order_no IN (?)", bun.List(nos)).Where("status = ?", domain.OrderClosed).Count(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if int(n) != len(nos) {
		t.Errorf("%d of %d orders CLOSED", n, len(nos))
	}
}

// pendingCount counts PENDING orders.
func pendingCount(t testing.TB, db *bun.DB) int {
	t.Helper()
	n, err := db.NewSelect().Table("orders").Where("status = ?", domain.OrderPending).Count(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return int(n)
}

// eventually waits for a condition; see domaintest.Eventually.
var eventually = domaintest.Eventually

// combos runs fn for each database kind with each Redis kind, as parallel
// subtests.
func combos(t *testing.T, fn func(t *testing.T, db *bun.DB, rs *redistest.Server)) {
	t.Helper()
	for _, dk := range []dbtest.Kind{dbtest.SQLite, dbtest.Postgres, dbtest.MySQL} {
		for _, rk := range []redistest.Kind{redistest.Mini, redistest.Real} {
			t.Run(string(dk)+"/"+string(rk), func(t *testing.T) {
				t.Parallel()
				rs := redistest.Open(t, rk)
				fn(t, dbtest.Open(t, dk), rs)
			})
		}
	}
}
