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
	default:
		e.dropped.Add(1)
	}
}

// Dropped is how many events were dropped because the buffer was full
// (Redis slow or away).
func (e *Events) Dropped() int64 { return e.dropped.Load() }

func (e *Events) start() {
	e.pending = make(chan event, 10_000)
	e.done = make(chan struct{})
	go e.publish()
}

// publish sends the buffered events in pipelines of up to 500. Events a
// pipeline could not publish (the node it went to died, the cluster is
// failing over) are sent again, after a pause that grows to a second, with
// the next ones: an event lost on the publishing side would reach a
// subscriber in another process only at its next resync, a minute later.
// A status sent again is harmless: a subscriber skips a status it has.
func (e *Events) publish() {
	defer close(e.done)
	ctx := context.Background()
	var unsent []event
	wait := 50 * time.Millisecond
	for {
		batch := unsent
		if len(unsent) == 0 {
			ev, ok := <-e.pending
			if !ok {
				return
			}
			batch = []event{ev}
		} else {
			select {
			case ev, ok := <-e.pending:
				if !ok {
					e.send(ctx, unsent) // the last try, at Close
					return
				}
				batch = append(batch, ev)
			case <-time.After(wait):
			}
		}
	more:
		for len(batch) < 500 {
			select {
			case ev, ok := <-e.pending:
				if !ok {
					break more
				}
				batch = append(batch, ev)
			default:
				break more
			}
		}
		unsent = e.send(ctx, batch)
		if len(unsent) == 0 {
			wait = 50 * time.Millisecond
			continue
		}
		wait = min(2*wait, time.Second)
		if over := len(unsent) - maxUnsent; over > 0 {
			// The oldest go: a subscriber reads its order again at its
			// next resync.
			unsent = unsent[over:]
			e.dropped.Add(int64(over))
		}
	}
}

// maxUnsent bounds the events kept to be published again while Redis is
// away.
const maxUnsent = 10_000

// send publishes events in one pipeline and returns those that failed.
func (e *Events) send(ctx context.Context, events []event) []event {
	pipe := e.rdb.Pipeline()
	cmds := make([]*redis.IntCmd, len(events))
	for i, ev := range events {
		cmds[i] = pipe.Publish(ctx, ev.channel, string(ev.status))
	}
	_, err := pipe.Exec(ctx)
	if err == nil {
		return nil
	}
	var failed []event
	for i, c := range cmds {
		if c.Err() != nil {
			failed = append(failed, events[i])
		}
	}
	e.log.Warn("order events not published; sending them again", "events", len(failed), "err", err)
	return failed
}

// Close publishes what is buffered, stops the publisher and the shared
// subscription. Subscriptions still open hear nothing more; they end with
// their contexts.
func (e *Events) Close() {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return
	}
	e.closed = true
	e.once.Do(e.start)
	close(e.pending)
	e.mu.Unlock()
	<-e.done
	e.hubMu.Lock()
	h := e.hub
	e.hubClosed = true
	e.hubMu.Unlock()
	if h != nil {
		h.stop()
	}
}
