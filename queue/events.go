package queue

import (
	"context"
	"log/slog"

	"github.com/redis/go-redis/v9"

	"kami/domain"
)

// Events publishes every order status change on the order's Redis channel,
// so a GraphQL subscription in any server process hears it.
type Events struct {
	rdb  redis.UniversalClient
	keys Keys
	log  *slog.Logger
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
	if err := e.rdb.Publish(context.WithoutCancel(ctx), e.keys.OrderChannel(orderNo), string(status)).Err(); err != nil {
		e.log.WarnContext(ctx, "order event not published", "order", orderNo, "status", status, "err", err)
	}
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
