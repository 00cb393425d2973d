package main

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/coder/websocket"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/providers/sandbox"
	"kami/queue/redistest"
)

// The WebSocket attacks and the Redis failover of subscriptions,
// against a whole server on a redis-server of the test's own, which the
// test counts the clients of and restarts.

func privateRedisApp(t *testing.T, r *redistest.Private, extra env, mod func(*Config)) *testApp {
	t.Helper()
	e := env{"KAMI_REDIS_URL": r.URL, "KAMI_REDIS_PREFIX": "kami-ws-test:"}
	for k, v := range extra {
		e[k] = v
	}
	return newTestAppWith(t, dbtest.SQLite, e, mod)
}

// placeFor places an order through the shop for a subscription to watch.
func (ta *testApp) placeFor(t *testing.T, p *domain.Product, contact string) *domain.Checkout {
	t.Helper()
	co, err := ta.shop.PlaceOrder(t.Context(), domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: contact, Provider: "sandbox"}, "", "")
	if err != nil {
		t.Fatal(err)
	}
	return co
}

// paySandbox pays an order through the sandbox webhook.
func (ta *testApp) paySandbox(t *testing.T, o *domain.Order, tradeNo string) {
	t.Helper()
	h, b := sandbox.Signed("test-secret", sandbox.PaymentNotification(o.OrderNo, tradeNo, o.AmountFen, time.Now()))
	if status, answer := ta.post(t, "/webhooks/sandbox", h, b); status != 200 {
		t.Fatalf("payment of %s: %d %q", o.OrderNo, status, answer)
	}
}

// TestWebSocketsCannotExhaustRedis: one WebSocket with 300 subscriptions
// added 300 Redis clients, and a few such sockets exhausted the Redis every
// instance shares. Now a process holds one Redis subscription whatever the
// number of subscriptions, a WebSocket starts at most
// KAMI_MAX_SUBSCRIPTIONS_PER_CONNECTION operations, an address holds at
// most KAMI_MAX_WEBSOCKETS_PER_ADDRESS sockets.
func TestWebSocketsCannotExhaustRedis(t *testing.T) {
	t.Parallel()
	r := redistest.StartPrivate(t)
	ta := privateRedisApp(t, r, env{"KAMI_MAX_SUBSCRIPTIONS_PER_CONNECTION": "20", "KAMI_MAX_WEBSOCKETS_PER_ADDRESS": "5"}, nil)
	p := ta.product(t, 100, codes("WS", 5)...)
	co := ta.placeFor(t, p, "ws@example.com")
	no, token := co.Order.OrderNo, co.AccessToken

	first, _ := ta.dialWS(t, nil)
	first.subscribe("0", no, token)
	first.wantStatus("0", "PENDING")
	eventually(t, 10*time.Second, "the shared subscription is up", ta.events.SubscriptionUp)
	one := r.Clients()

	sockets := []*ws{first}
	for len(sockets) < 5 {
		c, status := ta.dialWS(t, nil)
		if c == nil {
			t.Fatalf("socket %d refused: %d", len(sockets)+1, status)
		}
		sockets = append(sockets, c)
	}
	for n, c := range sockets {
		for i := range 20 {
			if n == 0 && i == 0 {
				continue // the first one's first
			}
			id := fmt.Sprint(i)
			c.subscribe(id, no, token)
			c.wantStatus(id, "PENDING")
		}
	}
	if many := r.Clients(); many > one {
		t.Fatalf("Redis clients: %d with one subscription, %d with 100", one, many)
	}
	t.Logf("Redis clients: %d with one subscription and with 100", one)

	// A 6th socket from the address is refused; the 21st operation on a
	// socket closes it, which gives its place back.
	if c, status := ta.dialWS(t, nil); c != nil || status != http.StatusTooManyRequests {
		t.Fatalf("a 6th socket: %v %d, want 429", c != nil, status)
	}
	sockets[1].subscribe("21st", no, token)
	if status := sockets[1].closed(); status != websocket.StatusPolicyViolation {
		t.Fatalf("the 21st subscription: close status %v, want policy violation", status)
	}
	eventually(t, 10*time.Second, "a socket's place given back", func() bool {
		c, _ := ta.dialWS(t, nil)
		return c != nil
	})

	// Every subscription still hears the payment, once, and completes.
	ta.paySandbox(t, co.Order, "T-WS")
	for _, c := range []*ws{sockets[0], sockets[2], sockets[3], sockets[4]} {
		for i := range 20 {
			id := fmt.Sprint(i)
			c.wantStatus(id, "PAID")
			if _, _, done := c.event(id); !done {
				t.Fatalf("subscription %s did not complete after PAID", id)
			}
		}
	}
}

// TestSubscriptionSurvivesRedisRestart: after a failover 3 of 9
// subscriptions completed after PENDING without ever sending PAID. A
// subscription now completes only with a final status: while Redis is away
// it reads its order again every SubscriptionPoll, and when Redis is back
// the shared subscription is made again, every subscriber catches up, and
// events flow again.
func TestSubscriptionSurvivesRedisRestart(t *testing.T) {
	t.Parallel()
	t.Run("paid while Redis is away", func(t *testing.T) {
		t.Parallel()
		r := redistest.StartPrivate(t)
		ta := privateRedisApp(t, r, nil, func(c *Config) { c.SubscriptionPoll = 100 * time.Millisecond })
		p := ta.product(t, 100, codes("R", 2)...)
		co := ta.placeFor(t, p, "r@example.com")
		c, _ := ta.dialWS(t, nil)
		c.subscribe("1", co.Order.OrderNo, co.AccessToken)
		c.wantStatus("1", "PENDING")
		eventually(t, 10*time.Second, "the shared subscription is up", ta.events.SubscriptionUp)

		r.Stop()
		eventually(t, 30*time.Second, "Redis noticed gone", func() bool { return !ta.events.SubscriptionUp() })
		ta.paySandbox(t, co.Order, "T-R1") // its event cannot be published
		c.wantStatus("1", "PAID")
		if _, _, done := c.event("1"); !done {
			t.Fatal("no complete after PAID")
		}
	})
	t.Run("paid while away, caught up on return", func(t *testing.T) {
		t.Parallel()
		r := redistest.StartPrivate(t)
		// No polling: only the catch-up on return can bring the news.
		ta := privateRedisApp(t, r, nil, func(c *Config) { c.SubscriptionPoll = time.Hour })
		p := ta.product(t, 100, codes("R", 3)...)
		away, later := ta.placeFor(t, p, "away@example.com"), ta.placeFor(t, p, "later@example.com")
		c, _ := ta.dialWS(t, nil)
		c.subscribe("away", away.Order.OrderNo, away.AccessToken)
		c.wantStatus("away", "PENDING")
		c.subscribe("later", later.Order.OrderNo, later.AccessToken)
		c.wantStatus("later", "PENDING")
		eventually(t, 10*time.Second, "the shared subscription is up", ta.events.SubscriptionUp)
		before := ta.events.Resubscribed()

		r.Stop()
		eventually(t, 30*time.Second, "Redis noticed gone", func() bool { return !ta.events.SubscriptionUp() })
		ta.paySandbox(t, away.Order, "T-R2")
		r.Start()
		eventually(t, 30*time.Second, "the shared subscription made again", func() bool {
			return ta.events.SubscriptionUp() && ta.events.Resubscribed() > before
		})
		c.wantStatus("away", "PAID")
		if _, _, done := c.event("away"); !done {
			t.Fatal("no complete after PAID")
		}
		// Events flow on the new subscription: a cancel made now arrives.
		if _, err := ta.shop.CancelOrder(t.Context(), later.Order.OrderNo, later.AccessToken); err != nil {
			t.Fatal(err)
		}
		c.wantStatus("later", "CLOSED")
		if _, _, done := c.event("later"); !done {
			t.Fatal("no complete after CLOSED")
		}
	})
}

// TestWebSocketOperationsCountOverItsLife: the cap counted only the
// subscriptions open at a time, so one socket churned operations without
// end: a subscription refused for its token, a query or a document that
// does not parse took no place, and one that completed gave its place
// back. Every operation a socket starts now takes a place for the rest of
// its life, whatever becomes of it, and the one past the cap closes the
// socket.
func TestWebSocketOperationsCountOverItsLife(t *testing.T) {
	t.Parallel()
	ta := newTestAppWith(t, dbtest.SQLite, env{"KAMI_MAX_SUBSCRIPTIONS_PER_CONNECTION": "5"}, nil)
	p := ta.product(t, 100, codes("OPS", 2)...)
	co := ta.placeFor(t, p, "ops@example.com")
	paid := ta.placeFor(t, p, "paid@example.com")
	ta.paySandbox(t, paid.Order, "T-OPS")

	c, _ := ta.dialWS(t, nil)
	c.subscribe("wrong-token", co.Order.OrderNo, "not-the-token")
	if _, code, _ := c.event("wrong-token"); code != domain.ENOTFOUND {
		t.Fatalf("a wrong token: %q, want NOT_FOUND", code)
	}
	c.operation("query", `{ products { id } }`)
	c.operation("garbage", `{ products {`)
	c.operation("mutation", `mutation { cancelOrder(orderNo: "1", accessToken: "x") { status } }`)
	c.subscribe("paid", paid.Order.OrderNo, paid.AccessToken) // completes at once
	c.wantStatus("paid", "PAID")
	if _, _, done := c.event("paid"); !done {
		t.Fatal("a paid order's subscription did not complete")
	}
	// Five operations started, none open: the sixth closes the socket.
	c.subscribe("sixth", co.Order.OrderNo, co.AccessToken)
	if status := c.closed(); status != websocket.StatusPolicyViolation {
		t.Fatalf("the sixth operation: close status %v, want policy violation", status)
	}
	// A new socket starts afresh.
	again, _ := ta.dialWS(t, nil)
	again.subscribe("1", co.Order.OrderNo, co.AccessToken)
	again.wantStatus("1", "PENDING")

	// gqlgen reads the first JSON value of a message and ignores what
	// follows; the count reads messages the same way, so bytes after the
	// message do not hide an operation from it.
	trailing, _ := ta.dialWS(t, nil)
	for i := range 6 {
		raw := fmt.Sprintf(`{"id":"t%d","type":"subscribe","payload":{"query":"{ products { id } }"}} trailing`, i)
		if err := trailing.conn.Write(trailing.ctx, websocket.MessageText, []byte(raw)); err != nil {
			break // closed
		}
	}
	if status := trailing.closed(); status != websocket.StatusPolicyViolation {
		t.Fatalf("six operations with trailing bytes: close status %v, want policy violation", status)
	}
}
