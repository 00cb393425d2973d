package queue

import (
	"context"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"kami/domain"
)

// The subscribing half of Events: one pattern subscription per process,
// fanned out to the local subscribers, which catch up from the database
// whenever events may have been missed.

// Subscribe streams the order's status changes until ctx ends or the
// returned func is called; either closes the channel. The channel holds the
// latest news only: a newer status replaces one not yet read. When the
// stream was interrupted (Redis restarted, failed over or away), events may
// have been missed, so every subscriber is sent its order's status as the
// database has it (Statuses), or "" (read the order again) without
// Statuses: once the shared subscription is back, every PollInterval while
// it is not, and every ResyncInterval anyway. A subscriber compares what it
// hears with what it last saw; a status it already has means nothing new.
//
// Subscribe itself makes no Redis call: the process holds one PSUBSCRIBE
// for all order channels (started by the first Subscribe) and fans its
// messages out to the local subscribers, so Redis sees one connection per
// process whatever the number of subscriptions. A change made before that
// PSUBSCRIBE is confirmed reaches the subscriber through the catch-up that
// follows the confirmation.
func (e *Events) Subscribe(ctx context.Context, orderNo string) (<-chan domain.OrderStatus, func()) {
	sub := &subscriber{ch: make(chan domain.OrderStatus, 1)}
	h := e.startHub()
	if h == nil { // closed: nothing will ever be heard
		var once sync.Once
		stop := func() { once.Do(func() { close(sub.ch) }) }
		context.AfterFunc(ctx, stop)
		return sub.ch, stop
	}
	h.add(orderNo, sub)
	var once sync.Once
	stop := func() { once.Do(func() { h.remove(orderNo, sub) }) }
	context.AfterFunc(ctx, stop)
	return sub.ch, stop
}

// SubscriptionUp reports whether the shared subscription is confirmed by
// Redis now.
func (e *Events) SubscriptionUp() bool {
	h := e.currentHub()
	return h != nil && h.up.Load()
}

// Resubscribed is how many times the shared subscription was confirmed by
// Redis: once at the start, once more after each interruption.
func (e *Events) Resubscribed() int64 {
	if h := e.currentHub(); h != nil {
		return h.confirmed.Load()
	}
	return 0
}

func (e *Events) currentHub() *hub {
	e.hubMu.Lock()
	defer e.hubMu.Unlock()
	return e.hub
}

// startHub returns the hub, starting it on first use; nil once Close has
// begun.
func (e *Events) startHub() *hub {
	e.hubMu.Lock()
	defer e.hubMu.Unlock()
	if e.hubClosed {
		return nil
	}
	if e.hub == nil {
		e.hub = newHub(e)
	}
	return e.hub
}

// subscriber is one local subscription.
type subscriber struct {
	ch chan domain.OrderStatus // capacity 1: the latest news
}

// hub holds the process's one pattern subscription to every order channel
// and the local subscribers it feeds.
type hub struct {
	e *Events

	mu   sync.Mutex
	subs map[string]map[*subscriber]struct{} // by order number

	up        atomic.Bool
	confirmed atomic.Int64
	kick      chan struct{} // capacity 1: catch up now
	cancel    context.CancelFunc
	wg        sync.WaitGroup

	psMu sync.Mutex
	ps   *redis.PubSub // the current subscription, closed by stop to end a blocked read
}

// healthCheck is how long the shared subscription may stay silent before
// it is pinged; a ping unanswered for as long again means the connection is
// dead (a network that drops packets closes nothing).
const healthCheck = 15 * time.Second

// catchUpBatch is how many orders' statuses one catch-up query reads.
const catchUpBatch = 500

func newHub(e *Events) *hub {
	ctx, cancel := context.WithCancel(context.Background())
	h := &hub{e: e, subs: map[string]map[*subscriber]struct{}{}, kick: make(chan struct{}, 1), cancel: cancel}
	h.wg.Add(2)
	go func() { defer h.wg.Done(); h.run(ctx) }()
	go func() { defer h.wg.Done(); h.catchUpLoop(ctx) }()
	return h
}

func (h *hub) stop() {
	h.cancel()
	h.psMu.Lock()
	if h.ps != nil {
		h.ps.Close()
	}
	h.psMu.Unlock()
	h.wg.Wait()
}

func (h *hub) add(orderNo string, s *subscriber) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.subs[orderNo] == nil {
		h.subs[orderNo] = map[*subscriber]struct{}{}
	}
	h.subs[orderNo][s] = struct{}{}
}

// remove unregisters s and closes its channel; no send can follow, since
// every send holds the lock.
func (h *hub) remove(orderNo string, s *subscriber) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.subs[orderNo], s)
	if len(h.subs[orderNo]) == 0 {
		delete(h.subs, orderNo)
	}
	close(s.ch)
}

// deliver gives status to every subscriber of orderNo, replacing news they
// have not read yet; it never waits for a slow subscriber.
func (h *hub) deliver(orderNo string, status domain.OrderStatus) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for s := range h.subs[orderNo] {
		select {
		case <-s.ch:
		default:
		}
		s.ch <- status
	}
}

func (h *hub) orderNos() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	nos := make([]string, 0, len(h.subs))
	for no := range h.subs {
		nos = append(nos, no)
	}
	return nos
}

// run keeps the pattern subscription: it subscribes, feeds the messages to
// the subscribers, and when the connection breaks or goes silent it makes a
// new one, waiting longer after each failure (up to a second).
func (h *hub) run(ctx context.Context) {
	pattern := h.e.keys.OrderChannelPattern()
	wait := 100 * time.Millisecond
	for ctx.Err() == nil {
		h.psMu.Lock()
		if ctx.Err() != nil { // stopped meanwhile: stop found no subscription to close
			h.psMu.Unlock()
			return
		}
		ps := h.e.rdb.PSubscribe(ctx, pattern)
		h.ps = ps
		h.psMu.Unlock()
		if err := h.receive(ctx, ps, &wait); err != nil && ctx.Err() == nil {
			h.e.log.Warn("order subscriptions interrupted; subscribers catch up from the database", "err", err, "retry_in", wait)
		}
		ps.Close()
		h.setUp(false)
		if c, ok := h.e.rdb.(*redis.ClusterClient); ok {
			// The node of the subscription may have failed over: the
			// next PSUBSCRIBE goes where the layout says, so look again.
			c.ReloadState(ctx)
		}
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
		wait = min(2*wait, time.Second)
	}
}

// receive reads the subscription until it fails or ctx ends.
func (h *hub) receive(ctx context.Context, ps *redis.PubSub, wait *time.Duration) error {
	pinged := false
	for {
		msg, err := ps.ReceiveTimeout(ctx, healthCheck)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				if pinged {
					return errors.New("no answer to a ping")
				}
				if err := ps.Ping(ctx); err != nil {
					return err
				}
				pinged = true
				continue
			}
			return err
		}
		pinged = false
		switch m := msg.(type) {
		case *redis.Subscription:
			if m.Kind == "psubscribe" {
				h.confirmed.Add(1)
				*wait = 100 * time.Millisecond
				h.setUp(true)
			}
		case *redis.Message:
			if no, ok := h.e.keys.OrderNoOf(m.Channel); ok {
				h.deliver(no, domain.OrderStatus(m.Payload))
			}
		}
	}
}

// setUp records whether the subscription is live. Every confirmation is a
// new start: events may have been missed before it, so the subscribers
// catch up now; going down changes how often they do.
func (h *hub) setUp(up bool) {
	was := h.up.Swap(up)
	if up || was {
		select {
		case h.kick <- struct{}{}:
		default:
		}
	}
}

// catchUpLoop sends every subscriber its order's status from the database
// when kicked, and every PollInterval while the subscription is down, every
// ResyncInterval while it is up. On a Redis Cluster it also catches up
// once the process's commands stopped failing as a failover makes them
// fail: an event published during the failover may never have reached
// this process's subscription, though the subscription itself held (a
// PUBLISH to the master that died, or lost on its way between nodes).
func (h *hub) catchUpLoop(ctx context.Context) {
	poll, resync := h.e.PollInterval, h.e.ResyncInterval
	if poll <= 0 {
		poll = 5 * time.Second
	}
	if resync <= 0 {
		resync = time.Minute
	}
	timer := time.NewTimer(poll) // not up yet
	defer timer.Stop()
	var settle <-chan time.Time
	if _, cluster := h.e.rdb.(*redis.ClusterClient); cluster {
		t := time.NewTicker(failoverSettle)
		defer t.Stop()
		settle = t.C
	}
	seen, failing := failuresOf(h.e.rdb), false
	for {
		select {
		case <-ctx.Done():
			return
		case <-h.kick:
		case <-timer.C:
		case <-settle:
			// Caught up after a tick without new failures: the
			// cluster answers again.
			n := failuresOf(h.e.rdb)
			if n != seen {
				seen, failing = n, true
				continue
			}
			if !failing {
				continue
			}
			failing = false
		}
		h.catchUp(ctx)
		next := resync
		if !h.up.Load() {
			next = poll
		}
		timer.Reset(next)
	}
}

// failoverSettle is how often a hub on a Redis Cluster looks whether its
// process's commands failed since it last looked.
const failoverSettle = time.Second

func (h *hub) catchUp(ctx context.Context) {
	nos := h.orderNos()
	if len(nos) == 0 {
		return
	}
	if h.e.Statuses == nil {
		for _, no := range nos {
			h.deliver(no, "")
		}
		return
	}
	for start := 0; start < len(nos); start += catchUpBatch {
		chunk := nos[start:min(start+catchUpBatch, len(nos))]
		rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		statuses, err := h.e.Statuses(rctx, chunk)
		cancel()
		if err != nil {
			if ctx.Err() == nil {
				h.e.log.Warn("order subscriptions cannot catch up from the database; trying again", "err", err)
			}
			return
		}
		for no, st := range statuses {
			h.deliver(no, st)
		}
	}
}
