package queue

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"kami/domain"
)

// Events publishes every order status change on the order's Redis channel,
// so a GraphQL subscription in any server process hears it. Publishing never
// holds up the caller (a close batch of 500 orders must not wait for 500
// round trips): changes go through a buffer to one goroutine that pipelines
// them. Close stops it.
//
// Subscribers in one process share one Redis connection (see Subscribe),
// however many they are.
type Events struct {
	rdb  redis.UniversalClient
	keys Keys
	log  *slog.Logger

	// Statuses reads orders' statuses from the database, for subscribers
	// catching up after the event stream was interrupted; nil: each
	// subscriber is told to read its order again ("").
	Statuses func(ctx context.Context, orderNos []string) (map[string]domain.OrderStatus, error)
	// PollInterval is how often every subscribed order is read again while
	// the shared subscription is down (Redis away); default 5s.
	PollInterval time.Duration
	// ResyncInterval is how often they are read again while it is up, for
	// changes whose event was lost on the publishing side (Redis away from
	// the publisher, a full buffer); default 1m.
	ResyncInterval time.Duration

	hubMu     sync.Mutex
	hub       *hub // started by the first Subscribe
	hubClosed bool

	once    sync.Once
	pending chan event
	done    chan struct{}
	mu      sync.RWMutex // held to send, and to close pending
	closed  bool
	dropped atomic.Int64
	// abort is closed when Close gives up waiting for the publisher;
	// sendCtx ends then too.
	abort      chan struct{}
	sendCtx    context.Context
	cancelSend context.CancelFunc
	// outstanding is how many buffered events are not published yet; once
	// aborted, Close has counted them as dropped.
	outMu       sync.Mutex
	outstanding int
	aborted     bool
}

type event struct {
	channel string
	status  domain.OrderStatus
}

var _ domain.Events = (*Events)(nil)

// NewEvents returns the event stream over rdb.
func NewEvents(rdb redis.UniversalClient, keys Keys, logger *slog.Logger) *Events {
	if logger == nil {
		logger = slog.Default()
	}
	return &Events{rdb: rdb, keys: keys, log: logger}
}

// OrderChanged publishes the order's new status. A lost event is not a lost
// fact: a subscriber can always read the order.
func (e *Events) OrderChanged(ctx context.Context, orderNo string, status domain.OrderStatus) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.closed {
		return
	}
	e.once.Do(e.start)
	select {
	case e.pending <- event{e.keys.OrderChannel(orderNo), status}:
		e.outMu.Lock()
		e.outstanding++
		e.outMu.Unlock()
	default:
		e.dropped.Add(1)
	}
}

// Dropped is how many events were dropped because the buffer was full
// (Redis slow or away), or left unpublished at Close's deadline.
func (e *Events) Dropped() int64 { return e.dropped.Load() }

func (e *Events) start() {
	e.pending = make(chan event, 10_000)
	e.done = make(chan struct{})
	e.abort = make(chan struct{})
	e.sendCtx, e.cancelSend = context.WithCancel(context.Background())
	go e.publish()
}

// publish sends the buffered events in pipelines of up to 500. Events a
// pipeline could not publish (the node it went to died, the cluster is
// failing over) are sent again, first in the next pipeline, after a pause
// that grows to a second: an event lost on the publishing side would reach a
// subscriber in another process only at its next resync, a minute later.
// While Redis is away the pipelines stay at 500 and the pauses at a second,
// and the events wait in the buffer (or are dropped when it is full), so
// an outage costs one pipeline a second and one warning. A status sent
// again is harmless: a subscriber skips a status it has.
func (e *Events) publish() {
	defer close(e.done)
	var batch []event // the next pipeline: events not yet published first
	wait := time.Duration(0)
	failing := false
	for {
		if len(batch) == 0 {
			ev, ok := <-e.pending
			if !ok {
				return
			}
			batch = append(batch, ev)
		}
	fill:
		for len(batch) < publishBatch {
			select {
			case ev, ok := <-e.pending:
				if !ok {
					break fill
				}
				batch = append(batch, ev)
			default:
				break fill
			}
		}
		failed, err := e.send(e.sendCtx, batch)
		if !e.published(len(batch) - len(failed)) {
			return // Close gave up on these; it counted them
		}
		batch = append(batch[:0], failed...)
		if len(failed) == 0 {
			if failing {
				e.log.Info("order events published again")
			}
			wait, failing = 0, false
			continue
		}
		if !failing {
			e.log.Warn("order events not published; sending them again until Redis answers", "events", len(failed), "err", err)
			failing = true
		}
		wait = min(max(2*wait, 50*time.Millisecond), time.Second)
		pause := time.NewTimer(wait)
		select {
		case <-pause.C:
		case <-e.abort:
			pause.Stop()
			return
		}
	}
}

// publishBatch is how many events go in one pipeline.
const publishBatch = 500

// published accounts for n events published; it reports false once Close
// has given up (the events left are then counted as dropped by Close).
func (e *Events) published(n int) bool {
	e.outMu.Lock()
	defer e.outMu.Unlock()
	if e.aborted {
		return false
	}
	e.outstanding -= n
	return true
}

// send publishes events in one pipeline and returns those that failed,
// with the pipeline's error.
func (e *Events) send(ctx context.Context, events []event) ([]event, error) {
	pipe := e.rdb.Pipeline()
	cmds := make([]*redis.IntCmd, len(events))
	for i, ev := range events {
		cmds[i] = pipe.Publish(ctx, ev.channel, string(ev.status))
	}
	_, err := pipe.Exec(ctx)
	if err == nil {
		return nil, nil
	}
	var failed []event
	for i, c := range cmds {
		if c.Err() != nil {
			failed = append(failed, events[i])
		}
	}
	return failed, err
}

// eventsCloseWait bounds how long Close waits for the events still
// buffered to be published, whatever the caller's deadline.
const eventsCloseWait = 10 * time.Second

// Close publishes what is buffered, stops the publisher and the shared
// subscription. Subscriptions still open hear nothing more; they end with
// their contexts. It waits for the buffer to be published until ctx ends
// (the shutdown's deadline) or eventsCloseWait has passed: while Redis is
// away it would wait forever.
// What is left then is dropped, counted in Dropped and logged once; a
// subscriber reads its order again at its next resync.
func (e *Events) Close(ctx context.Context) {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return
	}
	e.closed = true
	e.once.Do(e.start)
	close(e.pending)
	e.mu.Unlock()
	// However long the caller would wait, a Redis that is away does not
	// hold the shutdown past eventsCloseWait: subscribers catch up from
	// the database at their next resync.
	ctx, cancel := context.WithTimeout(ctx, eventsCloseWait)
	defer cancel()
	select {
	case <-e.done:
	case <-ctx.Done():
		e.outMu.Lock()
		e.aborted = true
		left := e.outstanding
		e.outstanding = 0
		e.outMu.Unlock()
		close(e.abort)
		// A send in flight ends with it, or when the client is closed.
		e.cancelSend()
		e.dropped.Add(int64(left))
		e.log.Warn("order events not published before the shutdown deadline; dropped", "events", left)
	}
	e.hubMu.Lock()
	h := e.hub
	e.hubClosed = true
	e.hubMu.Unlock()
	if h != nil {
		h.stop()
	}
}
