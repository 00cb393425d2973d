package queue

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"kami/domain"
)

// MailQueue is the order-mail queue under keys: members are mail_sends ids.
func MailQueue(rdb redis.UniversalClient, keys Keys) *DelayQueue {
	return NewDelayQueue(rdb, keys.MailQueue(), keys.MailLease())
}

// MailScheduler puts mails on the mail queue: the shop's side of
// MailWorker, for a process that records payments.
type MailScheduler struct{ q *DelayQueue }

var _ domain.MailScheduler = (*MailScheduler)(nil)

// NewMailScheduler returns the scheduler of the mail queue under keys.
func NewMailScheduler(rdb redis.UniversalClient, keys Keys) *MailScheduler {
	return &MailScheduler{q: MailQueue(rdb, keys)}
}

// ScheduleMail puts mail id on the queue, due at due.
func (s *MailScheduler) ScheduleMail(ctx context.Context, id int64, due time.Time) error {
	return s.q.Schedule(ctx, strconv.FormatInt(id, 10), due)
}

// MailStats are the mail worker's counters since start.
type MailStats struct {
	Claimed     int64 // mails claimed from the queue
	Errors      int64 // attempts that failed with a database error (their lease brings them back)
	RedisErrors int64
	Recovered   int64 // members put back after their lease expired
	Swept       int64 // schedules the sweeper restored
}

// MailWorker sends the order mails of the mail queue (domain.Mailer), on
// the same shape as Workers: a drain every second, lease recovery, and a
// sweeper that rebuilds the queue from the database (every QUEUED mail,
// and every SENDING one at its deadline) after Redis lost it. Several
// processes may run one: each claim goes to one worker, and the ledger's
// conditional update lets one attempt at a mail run at a time.
type MailWorker struct {
	cfg    Config
	rdb    redis.UniversalClient
	keys   Keys
	q      *DelayQueue
	mailer *domain.Mailer
	log    *slog.Logger

	claimed, errs, redisErrs, recovered, swept atomic.Int64

	bo backoff
	jobs
}

// mailBatch is how many mails one claim takes; mailParallel how many are
// sent at once.
const (
	mailBatch    = 20
	mailParallel = 4
)

// NewMailWorker returns the worker for mailer. cfg's Lease, RecoverEvery,
// SweepEvery, MaxBackoff and Now apply as for Workers.
func NewMailWorker(cfg Config, rdb redis.UniversalClient, keys Keys, mailer *domain.Mailer, logger *slog.Logger) *MailWorker {
	if logger == nil {
		logger = slog.Default()
	}
	cfg = cfg.withDefaults(mailer.Ledger)
	w := &MailWorker{cfg: cfg, rdb: rdb, keys: keys, q: MailQueue(rdb, keys), mailer: mailer,
		log: logger.With("component", "mail")}
	w.bo.max = cfg.MaxBackoff
	return w
}

// Stats returns the counters.
func (w *MailWorker) Stats() MailStats {
	return MailStats{Claimed: w.claimed.Load(), Errors: w.errs.Load(), RedisErrors: w.redisErrs.Load(),
		Recovered: w.recovered.Load(), Swept: w.swept.Load()}
}

// QueueStats reads the mail queue's backlog and lag.
func (w *MailWorker) QueueStats(ctx context.Context) (QueueStats, error) {
	return w.q.Stats(ctx, w.cfg.Now())
}

// Start starts the drain, lease recovery and the sweeper, and sweeps once
// in the background.
func (w *MailWorker) Start(ctx context.Context) error {
	return w.startQueueJobs(ctx, "mail worker", w.log, w.cfg, w.Drain, w.recoverLeases, w.sweepLocked)
}

// Stop stops the jobs and waits for the attempts under way. If ctx ends
// first they are cancelled (their deadline in the database brings them
// back) and ctx's error is returned.
func (w *MailWorker) Stop(ctx context.Context) error { return w.stop(ctx) }

// Drain claims due mails and attempts each until none is due.
func (w *MailWorker) Drain() {
	for !w.stopping() && w.bo.ready() {
		c, err := w.q.Claim(w.ctx, w.cfg.Now(), mailBatch, w.cfg.Lease)
		if err != nil {
			w.redisErrs.Add(1)
			d := w.bo.fail()
			w.log.Warn("mail claim failed; backing off", "err", err, "pause", d)
			return
		}
		w.bo.ok()
		w.claimed.Add(int64(len(c.Members)))
		eachClaimed(c.Members, mailParallel, func(member string) { w.deliver(w.ctx, c.Until, member) })
		if len(c.Members) < mailBatch {
			return
		}
	}
}

// deliver makes one attempt at a claimed mail and puts it back on the
// queue for its next due time, or acks it once it is done.
func (w *MailWorker) deliver(ctx context.Context, until time.Time, member string) {
	id, err := strconv.ParseInt(member, 10, 64)
	var m *domain.MailSend
	if err == nil {
		m, err = w.mailer.Deliver(ctx, id)
	}
	switch {
	case err != nil && (domain.ErrorCode(err) == domain.ENOTFOUND || id == 0):
		w.log.Warn("mail queue named a mail that does not exist; dropped", "member", member)
	case err != nil:
		// Left leased: the lease brings it back.
		w.errs.Add(1)
		w.log.Warn("mail attempt failed", "mail", member, "err", err)
		return
	case m.Status == domain.MailQueued || m.Status == domain.MailSending:
		// Not due yet, retried later, or under way elsewhere until its
		// deadline: rescheduled before the ack, so it is never nowhere.
		if err := w.q.Schedule(ctx, member, m.NextDueAt); err != nil {
			w.redisErrs.Add(1)
			return
		}
	}
	if _, err := w.q.Ack(ctx, until, member); err != nil {
		w.redisErrs.Add(1)
	}
}

func (w *MailWorker) recoverLeases() {
	n, err := w.q.Recover(w.ctx, w.cfg.Now())
	if err != nil {
		w.redisErrs.Add(1)
		w.log.Warn("mail lease recovery failed", "err", err)
		return
	}
	w.recovered.Add(int64(n))
}

// sweepLocked sweeps unless another process swept within half an
// interval.
func (w *MailWorker) sweepLocked() {
	if w.stopping() {
		return
	}
	ttl := max(w.cfg.SweepEvery/2, time.Second)
	now := time.Now()
	got, err := sweepLock(w.ctx, w.rdb, w.keys.MailSweepLock(), now, ttl)
	if err != nil || !got {
		if err != nil {
			w.redisErrs.Add(1)
		}
		return
	}
	if _, err := w.Sweep(w.ctx); err != nil {
		w.log.Warn("mail sweep failed", "err", err)
	}
}

// Sweep puts every open mail (QUEUED at its due time, SENDING at its
// attempt's deadline) that is neither queued nor leased back on the queue,
// and reports how many.
func (w *MailWorker) Sweep(ctx context.Context) (int, error) {
	open, err := w.mailer.Ledger.OpenMails(ctx, 10_000)
	if err != nil {
		return 0, fmt.Errorf("open mails: %w", err)
	}
	items := make([]Item, len(open))
	for i, m := range open {
		items[i] = Item{Member: strconv.FormatInt(m.ID, 10), Due: m.NextDueAt}
	}
	n, err := w.q.ScheduleIfAbsent(ctx, items)
	if err != nil {
		w.redisErrs.Add(1)
		return n, fmt.Errorf("schedule open mails: %w", err)
	}
	w.swept.Add(int64(n))
	if n > 0 {
		w.log.Info("sweeper restored mail schedules", "mails", n)
	}
	return n, nil
}
