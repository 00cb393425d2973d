package queue

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"kami/domain"
)

// Config tunes the workers. Zero values take the defaults.
type Config struct {
	CloseBatch     int           // members per claim and per close transaction; default 500
	CloseDrainers  int           // close drains running in parallel in this process; default 4 (see withDefaults)
	RefundBatch    int           // refunds per claim; default 50
	RefundParallel int           // refund attempts running at once; default 4
	Lease          time.Duration // how long a claim holds its members; default 30s
	RecoverEvery   time.Duration // how often expired leases go back; default 5s (cron: at least 1s)
	SweepEvery     time.Duration // how often the database is swept for lost schedules; default 1m
	SweepPage      int           // pending orders per sweeper page; default 1000
	// WakeCap is the longest the close waker sleeps without looking at the
	// queue's head (members scheduled by other processes); default 200ms.
	WakeCap time.Duration
	// CloseGather is the least time between two drains of the waker. Under
	// load orders fall due a millisecond apart; draining each at once would
	// close them one transaction apiece. Waiting this long lets them gather
	// into batches, at the price of this much more due-to-closed lag;
	// default 50ms.
	CloseGather time.Duration
	// MaxBackoff is the longest pause after Redis or database errors;
	// default 1s: the pause still to run when Redis is back (a failover
	// finished, a restart) is how late the closes resume, and one claim a
	// second from each process costs a Redis that is away nothing.
	MaxBackoff time.Duration
	// Now is the clock claims, leases and due times are judged by; default
	// the ledger's DBTime (the database's clock as this process knows it),
	// kept in step by SyncClock at start and at every lease recovery, so
	// that a process with a fast clock neither claims orders early nor
	// takes over another process's leases.
	Now func() time.Time
}

func (c Config) withDefaults(l *domain.Ledger) Config {
	def := func(v *int, d int) {
		if *v <= 0 {
			*v = d
		}
	}
	defD := func(v *time.Duration, d time.Duration) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&c.CloseBatch, 500)
	c.CloseBatch = min(c.CloseBatch, MaxClaim)
	// A drain's batch is a chain of round trips and statements (claim,
	// pre-close check, one transaction, commit, ack) during which the
	// database works on one core or waits for its WAL flush: two drains
	// left a restart's backlog drain using half a core of PostgreSQL on
	// an otherwise idle 2-core machine.
	def(&c.CloseDrainers, 4)
	def(&c.RefundBatch, 50)
	def(&c.RefundParallel, 4)
	def(&c.SweepPage, 1000)
	defD(&c.Lease, 30*time.Second)
	defD(&c.RecoverEvery, 5*time.Second)
	defD(&c.SweepEvery, time.Minute)
	defD(&c.WakeCap, 200*time.Millisecond)
	defD(&c.CloseGather, 50*time.Millisecond)
	defD(&c.MaxBackoff, time.Second)
	if c.Now == nil {
		c.Now = l.DBTime
	}
	return c
}

// Stats are the workers' counters since start, for the metrics layer.
type Stats struct {
	Closed        int64 // orders this process closed (PENDING → CLOSED)
	Skipped       int64 // claimed orders that had moved on (paid, closed elsewhere)
	NotDue        int64 // claimed before their expires_at; rescheduled
	Deferred      int64 // due, but their pre-close check had no clear answer; rescheduled
	Unknown       int64 // members naming no order or refund: logged and acked
	CloseErrors   int64 // close batches that failed (their lease brings them back)
	Refunds       int64 // refund attempts made
	RefundErrors  int64 // refund attempts that failed with an error
	Recovered     int64 // members put back after their lease expired
	Swept         int64 // schedules the sweeper restored
	SweptClosed   int64 // overdue orders the sweeper closed itself while Redis was down
	RedisErrors   int64 // Redis calls that failed
	LatencyCount  int64 // closes with a due-to-closed latency observed
	LatencySumNS  int64 // sum of those latencies
	LatencyMaxNS  int64 // the largest one
	LastSweepRows int64 // pending orders the last sweep read
	StockRepairs  int64 // stock counters the sweeper found wrong and rebuilt
}

type counters struct {
	closed, skipped, notDue, deferred, unknown, closeErrors, refunds, refundErrors atomic.Int64
	recovered, swept, sweptClosed, redisErrors                                     atomic.Int64
	latCount, latSum, latMax, lastSweepRows, stockRepairs                          atomic.Int64
}

// Workers drain the close and refund queues into the ledger, bring back
// expired leases and rebuild lost schedules from the database. They run in
// the server process on a robfig cron; several processes may share one Redis
// and one database: each order's close takes effect once (the ledger's
// conditional update), each claim goes to one worker.
type Workers struct {
	cfg    Config
	rdb    redis.UniversalClient
	keys   Keys
	shop   *domain.Shop
	ledger *domain.Ledger
	log    *slog.Logger

	closeQ, refundQ *DelayQueue
	gate            *StockGate

	// OnClosed, if set before Start, hears the due-to-closed latency of
	// every order this process closes.
	OnClosed func(latency time.Duration)

	c        counters
	wake     chan struct{}
	wakeAt   atomic.Int64 // unix ms the waker sleeps until
	drainMu  sync.Mutex
	again    atomic.Bool
	closeBO  backoff
	refundBO backoff

	jobs
}

// NewWorkers returns the workers for shop's ledger. shop.Scheduler, if it
// is a *Scheduler, learns to wake the close waker for orders due soon;
// shop.Gate, if it is a *StockGate, has its missing counters rebuilt by the
// sweeper.
func NewWorkers(cfg Config, rdb redis.UniversalClient, keys Keys, shop *domain.Shop, ledger *domain.Ledger, logger *slog.Logger) *Workers {
	if logger == nil {
		logger = slog.Default()
	}
	cfg = cfg.withDefaults(ledger)
	w := &Workers{cfg: cfg, rdb: rdb, keys: keys, shop: shop, ledger: ledger, log: logger.With("component", "queue"),
		closeQ: CloseQueue(rdb, keys), refundQ: RefundQueue(rdb, keys),
		wake: make(chan struct{}, 1)}
	w.closeBO.max, w.refundBO.max = cfg.MaxBackoff, cfg.MaxBackoff
	if s, ok := shop.Scheduler.(*Scheduler); ok {
		s.onSchedule = w.wakeFor
	}
	if g, ok := shop.Gate.(*StockGate); ok {
		w.gate = g
	}
	// A claimed batch must be closed before its lease ends, or lease
	// recovery hands it to another process that asks the gateways again:
	// the pre-close check gets a third of the lease, the close the rest.
	if budget := cfg.Lease / 3; shop.CheckBudget <= 0 || shop.CheckBudget > budget {
		shop.CheckBudget = budget
	}
	return w
}

// Stats returns the counters.
func (w *Workers) Stats() Stats {
	c := &w.c
	return Stats{Closed: c.closed.Load(), Skipped: c.skipped.Load(), NotDue: c.notDue.Load(), Deferred: c.deferred.Load(), Unknown: c.unknown.Load(),
		CloseErrors: c.closeErrors.Load(), Refunds: c.refunds.Load(), RefundErrors: c.refundErrors.Load(),
		Recovered: c.recovered.Load(), Swept: c.swept.Load(), SweptClosed: c.sweptClosed.Load(), RedisErrors: c.redisErrors.Load(),
		LatencyCount: c.latCount.Load(), LatencySumNS: c.latSum.Load(), LatencyMaxNS: c.latMax.Load(), LastSweepRows: c.lastSweepRows.Load(),
		StockRepairs: c.stockRepairs.Load()}
}

// QueueStats reads both queues' backlog and lag.
func (w *Workers) QueueStats(ctx context.Context) (closeQ, refundQ QueueStats, err error) {
	now := w.cfg.Now()
	if closeQ, err = w.closeQ.Stats(ctx, now); err != nil {
		return
	}
	refundQ, err = w.refundQ.Stats(ctx, now)
	return
}

// Start starts the cron jobs and the close waker, and runs the sweeper once
// in the background. Jobs: close drain and refund drain every second, lease
// recovery every RecoverEvery, the sweeper every SweepEvery.
func (w *Workers) Start(ctx context.Context) error {
	if err := w.begin(ctx, "queue workers"); err != nil {
		return err
	}
	w.syncClock()
	return w.run(w.log, "queue worker", []cronJob{
		{"* * * * * *", func() { w.drainClose() }},
		{"* * * * * *", func() { w.drainRefunds() }},
		{every(w.cfg.RecoverEvery), func() { w.recoverLeases() }},
		{every(w.cfg.SweepEvery), func() { w.sweepLocked() }},
	}, w.waker, w.startupSweep)
}

// Stop stops scheduling jobs and waits for the running ones to finish their
// batch. If ctx ends first, the work in flight is cancelled (its leases
// bring it back) and ctx's error is returned.
func (w *Workers) Stop(ctx context.Context) error { return w.stop(ctx) }

func every(d time.Duration) string { return "@every " + max(d, time.Second).String() }

// --- close ---------------------------------------------------------------

// DrainClose claims and closes due orders until none is due. Safe to call
// from anywhere; a drain already running in this process runs once more
// instead.
func (w *Workers) DrainClose() { w.drainClose() }

// drainClose reports false when another drain was running (it goes round
// once more instead).
func (w *Workers) drainClose() bool {
	w.again.Store(true)
	for w.again.Load() && !w.stopping() && w.closeBO.ready() {
		if !w.drainMu.TryLock() {
			return false // the running drain sees again and goes round once more
		}
		w.again.Store(false)
		var wg sync.WaitGroup
		for range w.cfg.CloseDrainers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for !w.stopping() && w.closeBO.ready() {
					n, err := w.closeOnce(w.ctx)
					if err != nil {
						d := w.closeBO.fail()
						w.log.Warn("close drain failed; backing off", "err", err, "pause", d)
						return
					}
					w.closeBO.ok()
					if n < w.cfg.CloseBatch {
						return
					}
				}
			}()
		}
		wg.Wait()
		w.drainMu.Unlock()
	}
	return true
}

// closeOnce claims one batch, closes it in one ledger transaction and acks
// it. It returns how many members it claimed.
func (w *Workers) closeOnce(ctx context.Context) (int, error) {
	c, err := w.closeQ.Claim(ctx, w.cfg.Now(), w.cfg.CloseBatch, w.cfg.Lease)
	if err != nil {
		w.c.redisErrors.Add(1)
		return 0, fmt.Errorf("claim: %w", err)
	}
	if len(c.Members) == 0 {
		return 0, nil
	}
	if err := w.closeMembers(ctx, c); err != nil {
		return len(c.Members), err
	}
	return len(c.Members), nil
}

// closeMembers closes a claimed batch and acks it once the database has
// committed; on a database error nothing is acked and the lease brings the
// batch back.
func (w *Workers) closeMembers(ctx context.Context, c Claimed) error {
	rs, err := w.shop.CloseOrders(ctx, c.Members, domain.CloseTimeout)
	if err != nil {
		w.c.closeErrors.Add(1)
		return fmt.Errorf("close %d orders: %w", len(c.Members), err)
	}
	now := w.cfg.Now()
	var resched []Item
	for _, r := range rs {
		switch r.Outcome {
		case domain.Closed:
			w.c.closed.Add(1)
			w.observe(now.Sub(r.ExpiresAt))
		case domain.CloseSkipped:
			w.c.skipped.Add(1)
		case domain.CloseNotDue:
			w.c.notDue.Add(1)
			resched = append(resched, Item{Member: r.OrderNo, Due: r.ExpiresAt})
		case domain.CloseDeferred:
			// Its gateway gave no clear "not paid": it stays open and
			// comes back when it is to be checked again.
			w.c.deferred.Add(1)
			resched = append(resched, Item{Member: r.OrderNo, Due: r.RetryAt})
		case domain.CloseMissing:
			w.c.unknown.Add(1)
			w.log.Warn("close queue named an order that does not exist; dropped", "member", r.OrderNo)
		}
	}
	for _, it := range resched {
		// Rescheduled before the ack, so the member is never nowhere.
		if err := w.closeQ.Schedule(ctx, it.Member, it.Due); err != nil {
			w.c.redisErrors.Add(1)
			return fmt.Errorf("reschedule %s: %w", it.Member, err)
		}
	}
	// Members without a result (paid during the pre-close check, or listed
	// twice) are finished too: the ledger has decided them.
	if _, err := w.closeQ.Ack(ctx, c.Until, c.Members...); err != nil {
		// Harmless: the lease brings them back and the ledger skips them.
		w.c.redisErrors.Add(1)
		w.log.Warn("ack after close failed; the lease will bring the batch back", "err", err)
	}
	return nil
}

func (w *Workers) observe(lat time.Duration) {
	if lat < 0 {
		lat = 0
	}
	w.c.latCount.Add(1)
	w.c.latSum.Add(int64(lat))
	for {
		cur := w.c.latMax.Load()
		if int64(lat) <= cur || w.c.latMax.CompareAndSwap(cur, int64(lat)) {
			break
		}
	}
	if w.OnClosed != nil {
		w.OnClosed(lat)
	}
}

// waker sleeps until the close queue's next member is due (at most
// WakeCap) and drains then, so an order closes just after its due time
// instead of up to a cron tick later.
func (w *Workers) waker() {
	var drained time.Time
	for !w.stopping() {
		sleep := w.cfg.WakeCap
		due, ok, err := w.closeQ.NextDue(w.ctx)
		switch {
		case err != nil:
			w.c.redisErrors.Add(1)
			sleep = max(sleep, w.closeBO.fail())
		case ok:
			if d := due.Sub(w.cfg.Now()); d <= 0 {
				if gather := w.cfg.CloseGather - time.Since(drained); gather > 0 {
					sleep = gather
				} else if !w.closeBO.ready() {
					sleep = w.closeBO.wait()
				} else {
					drained = time.Now()
					if w.drainClose() {
						continue
					}
				}
			} else {
				sleep = min(d, sleep)
			}
		}
		w.wakeAt.Store(time.Now().Add(sleep).UnixMilli())
		t := time.NewTimer(sleep)
		select {
		case <-w.stopped:
		case <-w.ctx.Done():
		case <-w.wake:
		case <-t.C:
		}
		t.Stop()
	}
}

// wakeFor wakes the waker if due comes before its planned wake-up.
func (w *Workers) wakeFor(due time.Time) {
	if due.Sub(w.cfg.Now()) < time.Duration(w.wakeAt.Load()-time.Now().UnixMilli())*time.Millisecond {
		select {
		case w.wake <- struct{}{}:
		default:
		}
	}
}

// --- refunds ---------------------------------------------------------------

func (w *Workers) drainRefunds() {
	for !w.stopping() && w.refundBO.ready() {
		c, err := w.refundQ.Claim(w.ctx, w.cfg.Now(), w.cfg.RefundBatch, w.cfg.Lease)
		if err != nil {
			w.c.redisErrors.Add(1)
			d := w.refundBO.fail()
			w.log.Warn("refund claim failed; backing off", "err", err, "pause", d)
			return
		}
		w.refundBO.ok()
		eachClaimed(c.Members, w.cfg.RefundParallel, func(no string) { w.refundOne(w.ctx, c.Until, no) })
		if len(c.Members) < w.cfg.RefundBatch {
			return
		}
	}
}

func (w *Workers) refundOne(ctx context.Context, until time.Time, refundNo string) {
	w.c.refunds.Add(1)
	r, err := w.shop.ProcessRefund(ctx, refundNo)
	switch {
	case domain.ErrorCode(err) == domain.ENOTFOUND:
		w.c.unknown.Add(1)
		w.log.Warn("refund queue named a refund that does not exist; dropped", "member", refundNo)
	case err != nil:
		// Left leased: the lease brings it back for another attempt.
		w.c.refundErrors.Add(1)
		w.log.Warn("refund attempt failed", "refund", refundNo, "err", err)
		return
	case r.Status == domain.RefundProcessing && !r.NextRetryAt.IsZero():
		// Not due yet in the database, or retried later: keep it queued.
		if err := w.refundQ.Schedule(ctx, refundNo, r.NextRetryAt); err != nil {
			w.c.redisErrors.Add(1)
			return
		}
	}
	if _, err := w.refundQ.Ack(ctx, until, refundNo); err != nil {
		w.c.redisErrors.Add(1)
	}
}

// --- leases ----------------------------------------------------------------

// syncClock measures the database's clock again (see Ledger.SyncClock);
// on failure the last measure stands.
func (w *Workers) syncClock() {
	if err := w.ledger.SyncClock(w.ctx); err != nil {
		w.log.Warn("reading the database's clock failed; keeping the last offset", "err", err)
	}
}

func (w *Workers) recoverLeases() {
	w.syncClock() // leases are judged by the database's clock
	now := w.cfg.Now()
	for _, q := range []*DelayQueue{w.closeQ, w.refundQ} {
		n, err := q.Recover(w.ctx, now)
		if err != nil {
			w.c.redisErrors.Add(1)
			w.log.Warn("lease recovery failed", "queue", q.Key(), "err", err)
			continue
		}
		if n > 0 {
			w.c.recovered.Add(int64(n))
			w.log.Info("expired leases put back", "queue", q.Key(), "members", n)
		}
	}
	w.kick()
}

func (w *Workers) kick() {
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// --- sweeper ---------------------------------------------------------------

// sweepLocked runs the sweeper unless another process swept within half an
// interval. With Redis unreachable it sweeps anyway: then it is the only
// close path.
func (w *Workers) sweepLocked() {
	if w.stopping() {
		return
	}
	ttl := max(w.cfg.SweepEvery/2, time.Second)
	now := time.Now()
	got, err := sweepLock(w.ctx, w.rdb, w.keys.SweepLock(), now, ttl)
	if err == nil && !got {
		return
	}
	if _, err := w.Sweep(w.ctx); err != nil {
		w.log.Warn("sweep failed", "err", err)
	}
}

// startupSweep is the sweeper's pass at start. It first lets the close
// drain work off a backlog of due orders (more than one claim's worth),
// for at most SweepEvery: a queue that holds them was not lost, and the
// pass reads every PENDING order, which would compete with the drain for
// the database and put back on the queue the orders closed between its
// read and its write (each then claimed once more, to be skipped). With
// Redis unreachable it sweeps at once: it is then the only close path.
func (w *Workers) startupSweep() {
	deadline := time.Now().Add(w.cfg.SweepEvery)
	for !w.stopping() && time.Now().Before(deadline) {
		st, err := w.closeQ.Stats(w.ctx, w.cfg.Now())
		if err != nil || st.Due <= int64(w.cfg.CloseBatch) {
			break
		}
		t := time.NewTimer(100 * time.Millisecond)
		select {
		case <-w.stopped:
		case <-w.ctx.Done():
		case <-t.C:
		}
		t.Stop()
	}
	w.sweepLocked()
}

// SweepResult reports one sweep.
type SweepResult struct {
	Pending       int // PENDING orders read
	Scheduled     int // of them, put back on the close queue
	ClosedDirect  int // overdue orders closed straight from the database (Redis down)
	Refunds       int // due refunds put back on the refund queue
	StockRebuilds int // missing stock counters rebuilt
	StockRepairs  int // stock counters that disagreed with the database, rebuilt
}

// Sweep rebuilds what Redis lost from the database: every PENDING order
// missing from the close queue (and not leased) is scheduled at its
// expires_at, so an overdue one is closed at once by the drain; due
// PROCESSING refunds are queued; stock counters that are missing or
// disagree with the database are rebuilt (StockGate.Check). Orders
// are read in pages from pending_order's (expires_at, order_no) index. If Redis cannot be
// reached, overdue orders are closed straight through the ledger instead.
func (w *Workers) Sweep(ctx context.Context) (SweepResult, error) {
	var res SweepResult
	// Counters first: rebuilt while no close of this sweep is in flight,
	// the database count includes every give-back a lost counter missed.
	if w.gate != nil {
		ps, err := w.ledger.Products(ctx, true)
		if err != nil {
			return res, fmt.Errorf("products: %w", err)
		}
		ids := make([]int64, len(ps))
		for i, p := range ps {
			ids[i] = p.ID
		}
		if _, err := w.gate.ResetDirty(ctx); err != nil {
			w.c.redisErrors.Add(1)
		}
		res.StockRebuilds, res.StockRepairs, err = w.gate.Check(ctx, ids)
		if err != nil {
			w.c.redisErrors.Add(1)
			w.log.Warn("stock counters not checked", "err", err)
		}
		if res.StockRepairs > 0 {
			w.c.stockRepairs.Add(int64(res.StockRepairs))
			w.log.Warn("stock counters disagreed with the database; rebuilt", "counters", res.StockRepairs)
		}
	}
	now := w.cfg.Now()
	var redisErr, closeErr error
	err := w.ledger.PendingPages(ctx, time.Time{}, w.cfg.SweepPage, func(page []domain.PendingOrder) (bool, error) {
		res.Pending += len(page)
		if redisErr == nil {
			items := make([]Item, len(page))
			for i, o := range page {
				items[i] = Item{Member: o.OrderNo, Due: o.ExpiresAt}
			}
			n, err := w.closeQ.ScheduleIfAbsent(ctx, items)
			res.Scheduled += n
			redisErr = err
		}
		if redisErr == nil {
			return true, nil
		}
		// Redis is down: close the overdue ones ourselves. Pages come in
		// expires_at order, so the first not-due order ends it.
		var due []string
		for _, o := range page {
			if !o.ExpiresAt.After(now) {
				due = append(due, o.OrderNo)
			}
		}
		if len(due) > 0 {
			rs, err := w.shop.CloseOrders(ctx, due, domain.CloseTimeout)
			if err != nil {
				closeErr = err
				return false, nil
			}
			for _, r := range rs {
				if r.Outcome == domain.Closed {
					res.ClosedDirect++
					w.c.closed.Add(1)
					w.observe(w.cfg.Now().Sub(r.ExpiresAt))
				}
			}
		}
		return len(due) == len(page), nil
	})
	if err != nil {
		return res, fmt.Errorf("pending orders: %w", err)
	}
	if closeErr != nil {
		return res, fmt.Errorf("close overdue orders: %w", closeErr)
	}
	w.c.lastSweepRows.Store(int64(res.Pending))
	w.c.swept.Add(int64(res.Scheduled))
	w.c.sweptClosed.Add(int64(res.ClosedDirect))
	if redisErr != nil {
		w.c.redisErrors.Add(1)
		return res, fmt.Errorf("schedule pending orders: %w", redisErr)
	}
	if res.Scheduled > 0 {
		w.log.Info("sweeper restored close schedules", "orders", res.Scheduled, "pending", res.Pending)
		w.kick()
	}
	refunds, err := w.ledger.DueRefunds(ctx, now, 10_000)
	if err != nil {
		return res, fmt.Errorf("due refunds: %w", err)
	}
	items := make([]Item, len(refunds))
	for i, r := range refunds {
		items[i] = Item{Member: r.RefundNo, Due: r.NextRetryAt}
	}
	if res.Refunds, err = w.refundQ.ScheduleIfAbsent(ctx, items); err != nil {
		w.c.redisErrors.Add(1)
		return res, fmt.Errorf("schedule due refunds: %w", err)
	}
	return res, nil
}

// --- helpers ---------------------------------------------------------------

// backoff pauses a loop after failures, doubling up to max.
type backoff struct {
	mu    sync.Mutex
	fails int
	until time.Time
	max   time.Duration
}

func (b *backoff) ready() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return !time.Now().Before(b.until)
}

func (b *backoff) wait() time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	return max(time.Until(b.until), time.Millisecond)
}

func (b *backoff) fail() time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.fails++
	d := min(50*time.Millisecond<<min(b.fails, 10), b.max)
	b.until = time.Now().Add(d)
	return d
}

func (b *backoff) ok() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.fails = 0
	b.until = time.Time{}
}

// cronLogger sends robfig cron's log to slog; its chatter goes to debug.
type cronLogger struct{ l *slog.Logger }

func (c cronLogger) Info(msg string, kv ...any) { c.l.Debug("cron: "+msg, kv...) }

func (c cronLogger) Error(err error, msg string, kv ...any) {
	c.l.Error("cron: "+msg, append(kv, "err", err)...)
}
