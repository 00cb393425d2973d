package queue

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
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
//
// Each endpoint has a lane: at most PerEndpoint of its deliveries are
// attempted at once in this process, and at most Parallel in all. A claim
// takes no more than the free senders can start; a claimed delivery whose
// lane is full is parked: put back on the queue (with its lease ended, in
// one step) due when the lane's attempts must have ended, and made due
// again as soon as one of them does. Parking needs no sender, so after a
// claim that parked more than it started the next takes walkClaim, and
// what it cannot start for want of a sender goes back due as it was: a
// busy lane's due backlog is walked walkClaim at a time. Nothing waits for
// a batch: a sender that finishes lets the drain claim again, so an
// endpoint that hangs until the timeout holds its own lane and nothing
// else.
type WebhookWorkers struct {
	cfg   Config
	rdb   redis.UniversalClient
	keys  Keys
	hooks *domain.Webhooks
	log   *slog.Logger
	q     *DelayQueue
	bo    backoff

	// Batch caps one claim (but one walking a busy lane's backlog, which
	// takes walkClaim); Parallel is how many attempts run at once (each
	// may wait up to the webhook timeout), PerEndpoint how many of them
	// may go to one endpoint. Set before Start.
	Batch, Parallel, PerEndpoint int
	// SweepPage is how many pending deliveries the sweeper reads at a
	// time (it reads them all, page by page).
	SweepPage int

	fannedOut, attempts, redisErrors, errors, parked atomic.Int64

	lanes lanes
	// claiming is held by the one claim loop of this process; again asks
	// it to go round once more (the loop looks at it again after it lets
	// go of claiming, so a request made while it stops is not lost).
	claiming sync.Mutex
	again    atomic.Bool

	// hook, set by tests only (before the workers run), is called at the
	// named points of the claim loop and of a sender, to hold a goroutine
	// exactly there.
	hook func(point string)

	jobs
}

// at calls the test hook at point.
func (w *WebhookWorkers) at(point string) {
	if w.hook != nil {
		w.hook(point)
	}
}

// lanes are the attempts in flight, in all and per endpoint. more says
// the claim loop stopped with due deliveries possibly left (no free
// sender), so a sender that ends claims again: the loop sets it in the
// step that finds no sender free and a sender reads it in the step that
// frees its own, so a sender ending at any moment is either seen free by
// the loop or sees more.
type lanes struct {
	mu       sync.Mutex
	inFlight int
	more     bool
	by       map[int64]*lane
}

// lane is one endpoint's: its attempts in flight, and the deliveries
// parked because it was full, oldest first, to be made due again one by
// one as its senders free (at most maxRemembered: the rest come due at
// their parked time). parked may hold members no longer parked (they came
// due on their own and were started); isParked says which are. last is
// the latest time a delivery of the lane was parked until, and atLast how
// many were parked until it: the next one parked goes there or a timeout
// later, behind them all. Counted from the times, not from how many are
// parked, so a parked delivery hurried out of the front (its sender ended)
// leaves the ones behind it where they are and the next is not parked in a
// timeout that already holds a lane's worth.
type lane struct {
	inFlight int
	parked   []string
	isParked map[string]bool
	last     time.Time
	atLast   int
}

// maxRemembered bounds the parked deliveries a lane remembers.
const maxRemembered = 1000

// walkClaim is what a claim takes after one that parked more deliveries
// than it started: parking needs no sender, so a walk past a hanging
// endpoint's due backlog goes walkClaim at a time instead of a free
// sender's worth (each claim reads its deliveries' endpoints in one query
// and puts back what it parked in one script).
const walkClaim = 500

// maxClaimsPerRound bounds one round of the claim loop; the next sender
// to end or the next tick goes on.
const maxClaimsPerRound = 256

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
		q: WebhookQueue(rdb, keys), Batch: 50, Parallel: 16, PerEndpoint: 4, SweepPage: 10_000, jobs: newJobs()}
	w.lanes.by = map[int64]*lane{}
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
	// Parked counts deliveries put back on the queue because their
	// endpoint's lane was full.
	Parked   int64
	InFlight int64 // attempts running now
}

// Stats returns the counters.
func (w *WebhookWorkers) Stats() WebhookStats {
	w.lanes.mu.Lock()
	inFlight := w.lanes.inFlight
	w.lanes.mu.Unlock()
	return WebhookStats{FannedOut: w.fannedOut.Load(), Attempts: w.attempts.Load(), Errors: w.errors.Load(), RedisErrors: w.redisErrors.Load(),
		Parked: w.parked.Load(), InFlight: int64(inFlight)}
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
// Workers never started are stopped too: the attempts a direct Drain
// started are waited for, and no Drain starts any after.
func (w *WebhookWorkers) Stop(ctx context.Context) error { return w.stop(ctx) }

// Drain fans out new events and starts an attempt at every due delivery
// its lane has room for; it does not wait for them (a sender that ends
// claims again, so there is no batch to wait for), started or not: Stop
// does.
func (w *WebhookWorkers) Drain() {
	if w.stopping() || !w.bo.ready() {
		return
	}
	if err := w.fanOut(w.ctx); err != nil {
		d := w.bo.fail()
		w.log.Warn("webhook fan-out failed; backing off", "err", err, "pause", d)
		return
	}
	w.claimDue()
}

// claimDue runs the claim loop, or, when it is running, has it go round
// once more: the request (again) is made before the lock is tried, and the
// loop looks for one after it lets go of the lock, so a request is either
// seen by the loop or made when the lock is free.
func (w *WebhookWorkers) claimDue() {
	w.again.Store(true)
	for w.again.Load() && !w.stopping() && w.bo.ready() {
		if !w.claiming.TryLock() {
			return // the running loop sees again and goes round once more
		}
		w.again.Store(false)
		w.claimRound()
		w.at("claim-loop-done")
		w.claiming.Unlock()
	}
}

// claimRound claims what the free senders can start until nothing is due
// or no sender is free. After a claim that parked more than it started,
// the next takes walkClaim (it is walking a busy lane's backlog); one
// whose members did not all find a sender ends the walk.
func (w *WebhookWorkers) claimRound() {
	walking := false
	for range maxClaimsPerRound {
		if w.stopping() {
			return
		}
		w.lanes.mu.Lock()
		free := max(w.Parallel, 1) - w.lanes.inFlight
		if free <= 0 {
			w.lanes.more = true
		}
		w.lanes.mu.Unlock()
		if free <= 0 {
			w.at("no-free-sender")
			return
		}
		n := min(max(w.Batch, 1), free)
		if walking {
			n = max(n, walkClaim)
		}
		c, err := w.q.Claim(w.ctx, w.cfg.Now(), n, w.cfg.Lease)
		if err != nil {
			w.redisErrors.Add(1)
			d := w.bo.fail()
			w.log.Warn("webhook claim failed; backing off", "err", err, "pause", d)
			return
		}
		w.bo.ok()
		got, err := w.dispatch(c)
		if err != nil {
			d := w.bo.fail()
			w.log.Warn("webhook lanes could not be read; backing off", "err", err, "pause", d)
			return
		}
		if len(c.Members) < n && !got.hurried && got.putBack == 0 {
			w.setMore(false)
			return
		}
		walking = got.parked > got.started && got.putBack == 0
	}
	w.setMore(true)
}

// setMore sets lanes.more.
func (w *WebhookWorkers) setMore(more bool) {
	w.lanes.mu.Lock()
	w.lanes.more = more
	w.lanes.mu.Unlock()
}

// dispatched is what dispatch did with a claim's members: started in a
// sender, parked (their lane full), put back due as they were (their lane
// had room, no sender was free); hurried says it made parked deliveries
// due again.
type dispatched struct {
	started, parked, putBack int
	hurried                  bool
}

// dispatch starts a sender for every claimed delivery whose lane has room
// while senders are free, parks those whose lane is full, and puts the
// rest back as they were: a claim that walks a busy lane's backlog takes
// more than the free senders, and what it cannot start waits at the head
// of the queue for the next sender to end.
func (w *WebhookWorkers) dispatch(c Claimed) (dispatched, error) {
	var out dispatched
	if len(c.Members) == 0 {
		return out, nil
	}
	asQueued := func(i int) Item { return Item{Member: c.Members[i], Due: c.Due[i]} }
	ids := make([]int64, 0, len(c.Members))
	for _, m := range c.Members {
		if id, err := strconv.ParseInt(m, 10, 64); err == nil {
			ids = append(ids, id)
		}
	}
	endpoints, err := w.hooks.DeliveryEndpoints(w.ctx, ids)
	if err != nil {
		// Back on the queue as they were; their lease brings back any
		// this cannot put back.
		all := make([]Item, len(c.Members))
		for i := range c.Members {
			all[i] = asQueued(i)
		}
		if _, rerr := w.q.Release(w.ctx, c.Until, all...); rerr != nil {
			w.redisErrors.Add(1)
		}
		w.errors.Add(1)
		return out, err
	}
	// A member naming no delivery goes through lane 0, where deliver
	// drops it.
	endpointOf := func(m string) int64 {
		id, _ := strconv.ParseInt(m, 10, 64)
		return endpoints[id]
	}
	// A parked delivery's slot: the k-th delivery waiting in its lane
	// cannot be sent before k/PerEndpoint rounds of the lane's attempts
	// have ended, so it is parked that many timeouts out: behind the
	// ones parked before it, PerEndpoint of them per timeout (lane.slot;
	// one hurried out of the front leaves the others where they are).
	// Parked all at one time, a hanging endpoint's backlog would come due
	// together every timeout and be walked again ahead of every other
	// endpoint's deliveries.
	now := w.cfg.Now()
	timeout := max(w.hooks.Config.Timeout, time.Second)
	var parked []Item
	var back []Item
	waiting := map[int64]bool{}
	w.lanes.mu.Lock()
	for i, m := range c.Members {
		ep := endpointOf(m)
		l := w.lanes.get(ep)
		switch {
		case l.inFlight >= max(w.PerEndpoint, 1):
			if !waiting[ep] && len(l.isParked) == 0 {
				// Nothing of the lane's waits (this claim's are
				// remembered below): the spread starts over.
				l.last, l.atLast = time.Time{}, 0
			}
			waiting[ep] = true
			parked = append(parked, Item{Member: m, Due: l.slot(now, timeout, max(w.PerEndpoint, 1))})
		case w.lanes.inFlight >= max(w.Parallel, 1):
			back = append(back, asQueued(i))
			w.lanes.drop(ep, l)
		default:
			l.inFlight++
			w.lanes.inFlight++
			delete(l.isParked, m) // came due on its own: not to be hurried
			w.wg.Add(1)
			go w.send(c.Until, m, ep)
			out.started++
		}
	}
	w.lanes.mu.Unlock()
	// Put back due as they were: nothing waits longer than it would have
	// unclaimed. Left leased if this fails: the lease brings them back.
	out.putBack = len(back)
	if _, err := w.q.Release(w.ctx, c.Until, back...); err != nil {
		w.redisErrors.Add(1)
		w.log.Warn("webhook deliveries no sender was free for could not be put back; their lease brings them back", "deliveries", len(back), "err", err)
	}
	if len(parked) == 0 {
		return out, nil
	}
	// Due when the lane's attempts ahead of them must have ended; made
	// due sooner as those end (hurry).
	n, err := w.q.Release(w.ctx, c.Until, parked...)
	if err != nil {
		// Left leased: the lease brings them back.
		w.redisErrors.Add(1)
		w.log.Warn("webhook deliveries of a busy endpoint could not be put back; their lease brings them back", "deliveries", len(parked), "err", err)
		return out, nil
	}
	w.parked.Add(int64(n))
	out.parked = n
	// Remembered only now that they are on the queue: a sender that ended
	// before finds the lane with room below, one that ends after finds
	// them remembered.
	w.lanes.mu.Lock()
	touched := map[int64]bool{}
	for _, it := range parked {
		ep := endpointOf(it.Member)
		w.lanes.get(ep).remember(it.Member)
		touched[ep] = true
	}
	w.lanes.mu.Unlock()
	for ep := range touched {
		if w.hurry(ep) > 0 {
			out.hurried = true
		}
	}
	return out, nil
}

// get returns ep's lane, made on first use. Under l.mu.
func (l *lanes) get(ep int64) *lane {
	ln := l.by[ep]
	if ln == nil {
		ln = &lane{isParked: map[string]bool{}}
		l.by[ep] = ln
	}
	return ln
}

// slot is when the next delivery parked in the lane is due: behind the
// ones parked before it, per of them per timeout, the first a timeout from
// now, none later than the one maxRemembered deliveries back would be.
func (l *lane) slot(now time.Time, timeout time.Duration, per int) time.Time {
	first, latest := now.Add(timeout), now.Add(time.Duration(1+maxRemembered/per)*timeout)
	switch {
	case l.last.Before(first):
		l.last, l.atLast = first, 0
	case l.atLast >= per:
		if next := l.last.Add(timeout); !next.After(latest) {
			l.last, l.atLast = next, 0
		} else {
			return latest
		}
	}
	l.atLast++
	return l.last
}

// remember notes a parked delivery, once.
func (l *lane) remember(m string) {
	if l.isParked[m] || len(l.parked) >= maxRemembered {
		return
	}
	l.isParked[m] = true
	l.parked = append(l.parked, m)
}

// hurry makes as many of ep's parked deliveries due now as its lane has
// free senders, skipping those no longer on the queue (claimed again,
// delivered by another process), and reports how many it made due.
func (w *WebhookWorkers) hurry(ep int64) int {
	moved := 0
	for {
		w.lanes.mu.Lock()
		l := w.lanes.get(ep)
		var ms []string
		for want := max(w.PerEndpoint, 1) - l.inFlight - moved; len(ms) < want && len(l.parked) > 0; {
			m := l.parked[0]
			l.parked = l.parked[1:]
			if l.isParked[m] {
				delete(l.isParked, m)
				ms = append(ms, m)
			}
		}
		w.lanes.drop(ep, l)
		w.lanes.mu.Unlock()
		if len(ms) == 0 {
			return moved
		}
		n, err := w.q.Advance(w.ctx, w.cfg.Now(), ms...)
		if err != nil {
			// They come due at their parked time.
			w.redisErrors.Add(1)
			return moved
		}
		moved += n
	}
}

// drop forgets a lane with nothing in flight and nothing parked. Under
// l.mu.
func (l *lanes) drop(ep int64, ln *lane) {
	if ln.inFlight == 0 && len(ln.parked) == 0 {
		delete(l.by, ep)
	}
}

// send attempts one delivery in its lane, then frees the lane's sender:
// a parked delivery of the lane is made due, and the drain claims again
// if there is more to do.
func (w *WebhookWorkers) send(until time.Time, member string, ep int64) {
	defer w.wg.Done()
	defer w.at("sender-done")
	w.deliver(w.ctx, until, member)
	w.lanes.mu.Lock()
	l := w.lanes.get(ep)
	l.inFlight--
	w.lanes.inFlight--
	w.lanes.drop(ep, l)
	more := w.lanes.more // with the sender freed: see lanes
	w.lanes.mu.Unlock()
	if w.stopping() {
		return // what it parked comes due at its parked time
	}
	if w.hurry(ep) > 0 || more {
		w.claimDue()
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
	// Every PENDING delivery, due or not (a FLUSHALL lost the retries
	// scheduled for later too), page by page: a hanging endpoint's
	// backlog, oldest first, must not fill one bounded read and keep the
	// other endpoints' deliveries off the queue.
	var after *domain.DeliveryDue
	for {
		ds, err := w.hooks.DueDeliveries(ctx, w.cfg.Now().Add(100*365*24*time.Hour), after, max(w.SweepPage, 1))
		if err != nil {
			return added, err
		}
		items := make([]Item, len(ds))
		for i, d := range ds {
			items[i] = Item{Member: strconv.FormatInt(d.ID, 10), Due: d.Due}
		}
		n, err := w.q.ScheduleIfAbsent(ctx, items)
		added += n
		if err != nil {
			w.redisErrors.Add(1)
			return added, err
		}
		if len(ds) < max(w.SweepPage, 1) {
			break
		}
		after = &ds[len(ds)-1]
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
