package graph

import (
	"context"
	"sync"
	"sync/atomic"

	"kami/domain"
)

// Anyone can open a WebSocket, so what one client may hold open is capped:
// WebSockets per client address (addrCount, checked before the upgrade) and
// subscriptions per WebSocket (subscriptionCap, checked before the
// subscription reads anything). A subscription is cheap (one goroutine and
// one entry in the process's shared Redis subscription, see
// queue.Events), but not free.

// addrCount counts the open WebSockets of each client address.
type addrCount struct {
	max  int // 0: no cap
	mu   sync.Mutex
	open map[string]int
}

func newAddrCount(max int) *addrCount {
	return &addrCount{max: max, open: map[string]int{}}
}

// acquire takes one of key's places; false when it has none left.
func (c *addrCount) acquire(key string) (release func(), ok bool) {
	if c.max <= 0 {
		return func() {}, true
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.open[key] >= c.max {
		return nil, false
	}
	c.open[key]++
	var once sync.Once
	return func() {
		once.Do(func() {
			c.mu.Lock()
			defer c.mu.Unlock()
			if c.open[key]--; c.open[key] == 0 {
				delete(c.open, key)
			}
		})
	}, true
}

// subscriptionCap counts the subscriptions open on one WebSocket. The
// connection's context carries it (gqlgen derives every subscription's
// context from the upgrade request's).
type subscriptionCap struct {
	max  int
	open atomic.Int64
}

type subscriptionCapKey struct{}

func withSubscriptionCap(ctx context.Context, max int) context.Context {
	if max <= 0 {
		return ctx
	}
	return context.WithValue(ctx, subscriptionCapKey{}, &subscriptionCap{max: max})
}

// takeSubscription takes one of the connection's subscription places:
// LIMIT_EXCEEDED when it has none left. release gives it back (once).
func takeSubscription(ctx context.Context) (release func(), err error) {
	c, _ := ctx.Value(subscriptionCapKey{}).(*subscriptionCap)
	if c == nil {
		return func() {}, nil
	}
	if c.open.Add(1) > int64(c.max) {
		c.open.Add(-1)
		return nil, domain.Errorf(domain.ELIMIT, "this connection has %d subscriptions open; end one first", c.max)
	}
	var once sync.Once
	return func() { once.Do(func() { c.open.Add(-1) }) }, nil
}
