package queue

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"kami/domain"
)

// WebhookWorkers deliver the outbox: every second they fan new events out
// into deliveries (domain.Webhooks.FanOut) and put them on the webhook
// delay queue, then claim the due deliveries and attempt each. A delivery
// that failed goes back on the queue at its next attempt's time. The
// database decides every step (the attempt is taken by a conditional
// update); the queue only schedules, and the sweeper rebuilds it from the
// database when Redis lost it.
type WebhookWorkers struct {
	cfg   Config
	rdb   redis.UniversalClient
	keys  Keys
	hooks *domain.Webhooks
	log   *slog.Logger
	q     *DelayQueue
	bo    backoff

	// Batch is how many deliveries one claim takes; Parallel how many are
	// attempted at once (each may wait up to the webhook timeout).
	Batch, Parallel int

	fannedOut, attempts, redisErrors, errors atomic.Int64

	jobs
}

// WebhookQueue is the webhook delivery queue under keys.
func WebhookQueue(rdb redis.UniversalClient, keys Keys) *DelayQueue {
	return NewDelayQueue(rdb, keys.WebhookQueue(), keys.WebhookLease())
}

// NewWebhookWorkers returns the delivery workers for hooks; cfg's Lease,
// RecoverEvery, SweepEvery, MaxBackoff and Now apply.
func NewWebhookWorkers(cfg Config, rdb redis.UniversalClient, keys Keys, hooks *domain.Webhooks, logger *slog.Logger) *WebhookWorkers {
	if logger == nil {
		logger = slog.Default()
	}
	cfg = cfg.withDefaults(hooks.Ledger)
	w := &WebhookWorkers{cfg: cfg, rdb: rdb, keys: keys, hooks: hooks, log: logger.With("component", "webhooks"),
		q: WebhookQueue(rdb, keys), Batch: 50, Parallel: 8, jobs: newJobs()}
	w.bo.max = cfg.MaxBackoff
	hooks.Schedule = w.schedule
	// A delivery in flight when its lease ends is claimed again and found
	// not due (its attempt pushed its due time past the request's
	// timeout): the lease need not cover the request.
	return w
}

// WebhookStats are the workers' counters since start.
type WebhookStats struct {
	FannedOut   int64 // events fanned out by this process
	Attempts    int64 // delivery attempts made or looked at
	Errors      int64 // attempts that failed with an error of kami's (database)
	RedisErrors int64
}

// Stats returns the counters.
func (w *WebhookWorkers) Stats() WebhookStats {
	return WebhookStats{FannedOut: w.fannedOut.Load(), Attempts: w.attempts.Load(), Errors: w.errors.Load(), RedisErrors: w.redisErrors.Load()}
}

// QueueStats reads the delivery queue's backlog and lag.
func (w *WebhookWorkers) QueueStats(ctx context.Context) (QueueStats, error) {
	return w.q.Stats(ctx, w.cfg.Now())
}

// Start starts the jobs: the drain every second, lease recovery every
// RecoverEvery, the sweeper every SweepEvery and once now.
func (w *WebhookWorkers) Start(ctx context.Context) error {
	return w.startQueueJobs(ctx, "webhook workers", w.log, w.cfg, w.Drain, w.recoverLeases, w.sweepLocked)
}

// Stop stops the jobs and waits for the attempts in flight; if ctx ends
// first they are cancelled (their deliveries come back after their lease).
func (w *WebhookWorkers) Stop(ctx context.Context) error { return w.stop(ctx) }

// Drain fans out new events and attempts every due delivery.
func (w *WebhookWorkers) Drain() {
	if w.stopping() || !w.bo.ready() {
		return
	}
	if err := w.fanOut(w.ctx); err != nil {
		d := w.bo.fail()
		w.log.Warn("webhook fan-out failed; backing off", "err", err, "pause", d)
		return
	}
	for !w.stopping() {
		c, err := w.q.Claim(w.ctx, w.cfg.Now(), w.Batch, w.cfg.Lease)
		if err != nil {
			w.redisErrors.Add(1)
			d := w.bo.fail()
			w.log.Warn("webhook claim failed; backing off", "err", err, "pause", d)
			return
		}
		w.bo.ok()
		eachClaimed(c.Members, w.Parallel, func(m string) { w.deliver(w.ctx, c.Until, m) })
		if len(c.Members) < w.Batch {
			return
		}
	}
}

// fanOut turns every waiting event into deliveries and queues them. A
// delivery that could not be queued is queued by the sweeper.
func (w *WebhookWorkers) fanOut(ctx context.Context) error {
	for !w.stopping() {
		ds, taken, err := w.hooks.FanOut(ctx, 200)
		if err != nil {
			return err
		}
		w.fannedOut.Add(int64(taken))
		if err := w.schedule(ctx, ds); err != nil {
			return err
		}
		if taken < 200 {
			return nil
		}
	}
	return nil
}

// schedule puts deliveries on the queue at their due times.
func (w *WebhookWorkers) schedule(ctx context.Context, ds []domain.DeliveryDue) error {
	for _, d := range ds {
		if err := w.q.Schedule(ctx, strconv.FormatInt(d.ID, 10), d.Due); err != nil {
			w.redisErrors.Add(1)
			return fmt.Errorf("queue delivery %d: %w", d.ID, err)
		}
	}
	return nil
}

// deliver attempts one claimed delivery and acks it; a PENDING one goes
// back on the queue first, at its next attempt's time.
func (w *WebhookWorkers) deliver(ctx context.Context, until time.Time, member string) {
	w.attempts.Add(1)
	id, err := strconv.ParseInt(member, 10, 64)
	var d *domain.WebhookDelivery
	if err == nil {
		d, err = w.hooks.Deliver(ctx, id)
	}
	switch {
	case err != nil && domain.ErrorCode(err) != domain.ENOTFOUND && !errors.Is(err, strconv.ErrSyntax):
		// Left leased: the lease brings it back.
		w.errors.Add(1)
		w.log.Warn("webhook delivery failed", "delivery", member, "err", err)
		return
	case err != nil:
		w.log.Warn("webhook queue named a delivery that does not exist; dropped", "member", member)
	case d.Status == domain.DeliveryPending:
		if err := w.q.Schedule(ctx, member, d.NextAttemptAt); err != nil {
			w.redisErrors.Add(1)
			return
		}
	}
	if _, err := w.q.Ack(ctx, until, member); err != nil {
		w.redisErrors.Add(1)
	}
}

func (w *WebhookWorkers) recoverLeases() {
	n, err := w.q.Recover(w.ctx, w.cfg.Now())
	if err != nil {
		w.redisErrors.Add(1)
		w.log.Warn("webhook lease recovery failed", "err", err)
		return
	}
	if n > 0 {
		w.log.Info("expired webhook leases put back", "deliveries", n)
	}
}

// sweepLocked runs Sweep unless another process swept within half an
// interval.
func (w *WebhookWorkers) sweepLocked() {
	if w.stopping() {
		return
	}
	ttl := max(w.cfg.SweepEvery/2, time.Second)
	now := time.Now()
	got, err := sweepLock(w.ctx, w.rdb, w.keys.WebhookSweepLock(), now, ttl)
	if err != nil || !got {
		return // Redis down: there is no queue to rebuild
	}
	if _, err := w.Sweep(w.ctx); err != nil {
		w.log.Warn("webhook sweep failed", "err", err)
	}
}

// Sweep rebuilds the delivery queue from the database: events not fanned
// out yet are fanned out, and every PENDING delivery that is neither
// queued nor leased is queued at its next attempt's time. It reports how
// many deliveries it queued.
func (w *WebhookWorkers) Sweep(ctx context.Context) (int, error) {
	if err := w.fanOut(ctx); err != nil {
		return 0, err
	}
	added := 0
	// Every PENDING delivery, due or not: a FLUSHALL lost the retries
	// scheduled for later too.
	ds, err := w.hooks.DueDeliveries(ctx, w.cfg.Now().Add(100*365*24*time.Hour), 10_000)
	if err != nil {
		return 0, err
	}
	items := make([]Item, len(ds))
	for i, d := range ds {
		items[i] = Item{Member: strconv.FormatInt(d.ID, 10), Due: d.Due}
	}
	if added, err = w.q.ScheduleIfAbsent(ctx, items); err != nil {
		w.redisErrors.Add(1)
		return added, err
	}
	if added > 0 {
		w.log.Info("webhook sweeper restored deliveries", "deliveries", added)
	}
	// The delivery log and the outbox keep KAMI_WEBHOOK_KEEP; a failure
	// here delays the clean-up to the next sweep and loses nothing.
	if ds, evs, err := w.hooks.Prune(ctx, 10_000); err != nil {
		w.log.Warn("webhook sweeper could not prune the delivery log", "err", err)
	} else if ds+evs > 0 {
		w.log.Info("webhook sweeper pruned the delivery log", "deliveries", ds, "events", evs)
	}
	return added, nil
}
