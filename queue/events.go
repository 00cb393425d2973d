package queue

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/redis/go-redis/v9"

	"kami/domain"
)

// Events publishes every order status change on the order's Redis channel,
// so a GraphQL subscription in any server process hears it. Publishing never
// holds up the caller (a close batch of 500 orders must not wait for 500
// round trips): changes go through a buffer to one goroutine that pipelines
// them. Close stops it.
type Events struct {
	rdb  redis.UniversalClient
	keys Keys
	log  *slog.Logger

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

func (e *Events) publish() {
	defer close(e.done)
	ctx := context.Background()
	for ev := range e.pending {
		pipe := e.rdb.Pipeline()
		pipe.Publish(ctx, ev.channel, string(ev.status))
	more:
		for n := 1; n < 500; n++ {
			select {
			case ev, ok := <-e.pending:
				if !ok {
					break more
				}
				pipe.Publish(ctx, ev.channel, string(ev.status))
			default:
				break more
			}
		}
		if _, err := pipe.Exec(ctx); err != nil {
			e.log.Warn("order events not published", "events", pipe.Len(), "err", err)
		}
	}
}

// Close publishes what is buffered and stops the publisher.
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
}

// Subscribe streams the order's status changes until ctx ends or the
// returned func is called; either closes the channel and ends the
// subscription's goroutine. The subscription is live when Subscribe
// returns, so a change published after it is not missed. If Redis cannot be
// reached the channel is closed at once (the stream ended).
func (e *Events) Subscribe(ctx context.Context, orderNo string) (<-chan domain.OrderStatus, func()) {
	out := make(chan domain.OrderStatus, 8)
	ctx, cancel := context.WithCancel(ctx)
	ps := e.rdb.Subscribe(ctx, e.keys.OrderChannel(orderNo))
	if _, err := ps.Receive(ctx); err != nil {
		e.log.WarnContext(ctx, "order subscription failed", "order", orderNo, "err", err)
		ps.Close()
		cancel()
		close(out)
		return out, func() {}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer close(out)
		defer ps.Close()
		msgs := ps.Channel()
		for {
			select {
			case <-ctx.Done():
				return
			case m, ok := <-msgs:
				if !ok {
					return
				}
				select {
				case out <- domain.OrderStatus(m.Payload):
				case <-ctx.Done():
					return
				}
			}
		}
	}()
	return out, func() {
		cancel()
		<-done
	}
}
