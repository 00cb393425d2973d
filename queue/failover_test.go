package queue_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/domain/domaintest"
	"kami/providers"
	"kami/providers/sandbox"
	"kami/queue"
	"kami/queue/redistest"
)

// kamiProc is one kami process on the cluster and the shared database: its
// own Redis client (queue.Connect), ledger, stock gate, scheduler, event
// stream, shop and workers, on the real clock.
type kamiProc struct {
	ledger  *domain.Ledger
	gate    *queue.StockGate
	sched   *queue.Scheduler
	events  *queue.Events
	shop    *domain.Shop
	workers *queue.Workers
}

func startKamiProc(t *testing.T, c *redistest.Cluster, db *bun.DB, keys queue.Keys, cfg domain.Config) *kamiProc {
	t.Helper()
	rdb, closeRedis, err := queue.Connect(context.Background(), c.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { closeRedis() })
	sealer, _ := domain.NewSealer(domaintest.Key())
	p := &kamiProc{ledger: domain.NewLedger(db, sealer, cfg, domain.LogAlerter{Logger: quietLogger()})}
	p.gate = queue.NewStockGate(rdb, keys, p.ledger)
	p.sched = queue.NewScheduler(rdb, keys)
	p.events = queue.NewEvents(rdb, keys, quietLogger())
	p.events.Statuses = p.ledger.OrderStatuses
	closeAtEnd(t, p.events)
	sb, err := sandbox.New(sandbox.Config{Secret: "test-secret", BaseURL: "http://127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	p.shop = &domain.Shop{Ledger: p.ledger, Gate: p.gate, Scheduler: p.sched, Events: p.events, Log: quietLogger(),
		Providers: providers.NewRegistry(sb)}
	p.workers = queue.NewWorkers(queue.Config{Lease: 2 * time.Second, RecoverEvery: time.Second, SweepEvery: time.Second},
		rdb, keys, p.shop, p.ledger, quietLogger())
	if err := p.workers.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute) // a deadline for a hang, never a speed
		defer cancel()
		if err := p.workers.Stop(ctx); err != nil {
			t.Errorf("stop workers: %v", err)
		}
	})
	return p
}

// watched is a subscription a test holds to an order, in the other process
// than the one that places and pays it, and the status it must end with.
type watched struct {
	no   string
	ch   <-chan domain.OrderStatus
	want domain.OrderStatus
}

// flow places orders through one process until stopped: half of them are
// paid at once, the others left to close (through Shop, as the GraphQL
// mutations do); each is watched from the other
// process. It records when orders were refused and when they were placed.
type flow struct {
	mu      sync.Mutex
	placed  []string
	watches []watched
	served  []time.Time // when each order was placed
	refused atomic.Int64
}

func (f *flow) run(ctx context.Context, t *testing.T, p, other *kamiProc, productID int64) {
	for i := 0; ctx.Err() == nil; i++ {
		co, err := p.shop.PlaceOrder(ctx, domain.PlaceOrderInput{ProductID: productID, Quantity: 1,
			Contact: fmt.Sprintf("buyer%d@example.com", i), Provider: sandbox.Name}, "", "")
		if domain.ErrorCode(err) == domain.EUNAVAILABLE {
			f.refused.Add(1)
			// Pacing, not synchronisation: a buyer tries again a moment
			// later, rather than as fast as a refused connection answers.
			time.Sleep(10 * time.Millisecond)
			continue
		}
		if err != nil {
			if ctx.Err() == nil {
				t.Errorf("PlaceOrder: %v", err)
			}
			return
		}
		o := co.Order
		ch, stop := other.events.Subscribe(context.Background(), o.OrderNo)
		t.Cleanup(stop)
		w := watched{no: o.OrderNo, ch: ch, want: domain.OrderClosed}
		if i%2 == 0 {
			res, err := p.shop.RecordPayment(context.WithoutCancel(ctx), domain.Payment{Provider: sandbox.Name, OrderNo: o.OrderNo,
				TradeNo: "T" + o.OrderNo, AmountFen: o.AmountFen, PaidAt: time.Now(), Raw: "{}"})
			if err != nil {
				t.Errorf("pay %s: %v", o.OrderNo, err)
			}
			if res != nil && res.Outcome == domain.PaymentDelivered {
				// Otherwise it was paid after its close, on a busy
				// machine: its subscription ends at CLOSED.
				w.want = domain.OrderPaid
			}
		}
		f.mu.Lock()
		f.placed = append(f.placed, o.OrderNo)
		f.watches = append(f.watches, w)
		f.served = append(f.served, time.Now())
		f.mu.Unlock()
	}
}

// firstServedAfter is when the first order placed after t was placed.
func (f *flow) firstServedAfter(at time.Time) (time.Time, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, s := range f.served {
		if s.After(at) {
			return s, true
		}
	}
	return time.Time{}, false
}

func (f *flow) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.placed)
}

// Two kami processes on PostgreSQL and a Redis Cluster place, pay and close
// orders while the master holding the stock counter is killed (SIGKILL),
// and then the master holding the close queue. Once the cluster is ok
// again: no order is lost or doubled, every order ends PAID or CLOSED, the
// counter equals the database's free cards, the audit is clean and every
// subscription (held in the other process) heard its order's final
// status. How long kami refused orders and closed nothing after the
// cluster was ok again is measured and logged, never asserted.
func TestClusterFailoverLosesNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a Redis Cluster and kills its masters")
	}
	c := redistest.StartCluster(t)
	db := dbtest.Open(t, dbtest.Postgres)
	rs := c.Server(t)
	e := newEnv(t, db, rs, domain.Config{})
	p := e.product(t, 5000)
	cfg := domain.Config{OrderTTL: 2 * time.Second}
	procs := []*kamiProc{startKamiProc(t, c, db, e.keys, cfg), startKamiProc(t, c, db, e.keys, cfg)}
	closed := func() int64 { return procs[0].workers.Stats().Closed + procs[1].workers.Stats().Closed }

	ctx, stopFlow := context.WithCancel(context.Background())
	var flows [2]flow
	var wg sync.WaitGroup
	for i := range procs {
		wg.Add(1)
		go func() { defer wg.Done(); flows[i].run(ctx, t, procs[i], procs[1-i], p.ID) }()
	}
	placedCount := func() int { return flows[0].count() + flows[1].count() }
	eventually(t, 0, "orders flowing", func() bool { return placedCount() >= 50 })

	// The stock counter's master dies: takes fail until the failover.
	victim := c.MasterOf(e.keys.Stock(p.ID))
	victim.Stop()
	killed := time.Now()
	c.WaitOK()
	ok := time.Now()
	var served time.Time
	eventually(t, 0, "an order placed after the failover", func() bool {
		s0, ok0 := flows[0].firstServedAfter(ok)
		s1, ok1 := flows[1].firstServedAfter(ok)
		switch {
		case ok0 && (!ok1 || s0.Before(s1)):
			served = s0
		case ok1:
			served = s1
		}
		return ok0 || ok1
	})
	t.Logf("stock counter's master killed: the cluster was ok %s after the kill; the first order was placed %s after that",
		ok.Sub(killed).Round(time.Millisecond), served.Sub(ok).Round(time.Millisecond))

	// The close queue's master dies (the stock counter's new master, when
	// the close queue shares it).
	victim = c.MasterOf(e.keys.CloseQueue())
	victim.Stop()
	killed = time.Now()
	c.WaitOK()
	ok = time.Now()
	before := closed()
	eventually(t, 0, "orders closed after the failover", func() bool { return closed() > before })
	t.Logf("close queue's master killed: the cluster was ok %s after the kill; the first close came %s after that",
		ok.Sub(killed).Round(time.Millisecond), time.Since(ok).Round(time.Millisecond))

	more := placedCount() + 50
	eventually(t, 0, "orders flowing after the failovers", func() bool { return placedCount() >= more })
	stopFlow()
	wg.Wait()
	t.Logf("%d orders placed, %d refusals while Redis was failing over", placedCount(), flows[0].refused.Load()+flows[1].refused.Load())

	// Nothing lost: every order placed is in the database and ends PAID or
	// CLOSED, each as its subscription in the other process heard.
	eventually(t, 0, "every order paid or closed", func() bool { return pendingCount(t, db) == 0 })
	var nos []string
	for i := range flows {
		nos = append(nos, flows[i].placed...)
	}
	statuses, err := e.ledger.OrderStatuses(e.ctx, nos)
	if err != nil {
		t.Fatal(err)
	}
	for i := range flows {
		for _, w := range flows[i].watches {
			if st := statuses[w.no]; st != w.want && !(w.want == domain.OrderClosed && st != domain.OrderPending) {
				t.Errorf("order %s is %q, want %s", w.no, st, w.want)
			}
			heard(t, w, statuses[w.no])
		}
	}
	// The counter equals the database: a write the failover lost (the
	// replica had not got it) is repaired by the sweeper.
	eventually(t, 0, "the stock counter equal to the database's free cards", func() bool {
		n, ok, err := e.gate.Counter(e.ctx, p.ID)
		return err == nil && ok && n == e.lockable(t, p.ID)
	})
	mustAudit(t, e.ledger)
}

// heard waits until the subscription w hears final (the order's status in
// the database at the end); it fails when the subscription ends first.
func heard(t *testing.T, w watched, final domain.OrderStatus) {
	t.Helper()
	var last domain.OrderStatus
	timeout := time.After(30 * time.Second) // a bound for a hang, never a speed
	for {
		select {
		case s, ok := <-w.ch:
			if !ok {
				t.Fatalf("the subscription to %s ended after %q, before %s", w.no, last, final)
			}
			if s == final {
				return
			}
			last = s
		case <-timeout:
			t.Fatalf("the subscription to %s heard %q, never %s", w.no, last, final)
		}
	}
}
