package graph_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/coder/websocket"
	"github.com/redis/go-redis/v9"

	"kami/domain"
	"kami/domain/domaintest"
	"kami/graph"
	"kami/queue"
	"kami/queue/redistest"
)

// wsClient speaks graphql-transport-ws or the older graphql-ws over a real
// WebSocket connection.
type wsClient struct {
	t     testing.TB
	ctx   context.Context
	conn  *websocket.Conn
	proto string
}

type wsMsg struct {
	ID      string          `json:"id,omitempty"`
	Type    string          `json:"type"`
	Payload json.RawMessage `json:"payload,omitempty"`
}

const (
	transportWS = "graphql-transport-ws"
	legacyWS    = "graphql-ws"
)

func dialWS(t testing.TB, srv *httptest.Server, proto string, initPayload map[string]any) *wsClient {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	conn, _, err := websocket.Dial(ctx, strings.Replace(srv.URL, "http", "ws", 1)+"/graphql", &websocket.DialOptions{Subprotocols: []string{proto}})
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	c := &wsClient{t: t, ctx: ctx, conn: conn, proto: proto}
	if conn.Subprotocol() != proto {
		t.Fatalf("subprotocol %q, want %q", conn.Subprotocol(), proto)
	}
	payload, _ := json.Marshal(initPayload)
	c.send(wsMsg{Type: "connection_init", Payload: payload})
	if m := c.read(); m.Type != "connection_ack" {
		t.Fatalf("init answered %+v", m)
	}
	return c
}

func (c *wsClient) close() { c.conn.Close(websocket.StatusNormalClosure, "") }

func (c *wsClient) send(m wsMsg) {
	c.t.Helper()
	b, _ := json.Marshal(m)
	if err := c.conn.Write(c.ctx, websocket.MessageText, b); err != nil {
		c.t.Fatalf("write: %v", err)
	}
}

// read returns the next message that is not a keep-alive.
func (c *wsClient) read() wsMsg {
	c.t.Helper()
	for {
		_, b, err := c.conn.Read(c.ctx)
		if err != nil {
			c.t.Fatalf("read: %v", err)
		}
		var m wsMsg
		if err := json.Unmarshal(b, &m); err != nil {
			c.t.Fatalf("message %s: %v", b, err)
		}
		switch m.Type {
		case "ka", "pong":
			continue
		case "ping":
			c.send(wsMsg{Type: "pong"})
			continue
		}
		return m
	}
}

func (c *wsClient) subscribe(id, query string, vars map[string]any) {
	payload, _ := json.Marshal(map[string]any{"query": query, "variables": vars})
	typ := "subscribe"
	if c.proto == legacyWS {
		typ = "start"
	}
	c.send(wsMsg{ID: id, Type: typ, Payload: payload})
}

func (c *wsClient) unsubscribe(id string) {
	typ := "complete"
	if c.proto == legacyWS {
		typ = "stop"
	}
	c.send(wsMsg{ID: id, Type: typ})
}

type event struct {
	Data struct {
		OrderStatusChanged struct {
			OrderNo, Status string
			Cards           []string
		}
	}
	Errors []gqlError
}

// next reads the next event of subscription id; done is true when the
// server completed it instead.
func (c *wsClient) next(id string) (ev event, done bool) {
	c.t.Helper()
	m := c.read()
	for m.Type == "complete" && m.ID != id {
		// gqlgen also completes subscriptions the client stopped, and
		// after an error: late news of an earlier id.
		m = c.read()
	}
	if m.ID != id {
		c.t.Fatalf("message for %q, want %q: %+v", m.ID, id, m)
	}
	switch m.Type {
	case "next", "data":
		if err := json.Unmarshal(m.Payload, &ev); err != nil {
			c.t.Fatalf("payload %s: %v", m.Payload, err)
		}
		return ev, false
	case "complete":
		return ev, true
	case "error":
		var errs []gqlError
		json.Unmarshal(m.Payload, &errs)
		if len(errs) == 0 {
			var one gqlError
			json.Unmarshal(m.Payload, &one)
			errs = []gqlError{one}
		}
		ev.Errors = errs
		return ev, false
	}
	c.t.Fatalf("unexpected message %+v", m)
	return ev, false
}

func (c *wsClient) nextStatus(id string) string {
	c.t.Helper()
	ev, done := c.next(id)
	if done || len(ev.Errors) > 0 {
		c.t.Fatalf("subscription %s: done=%v errors=%+v", id, done, ev.Errors)
	}
	return ev.Data.OrderStatusChanged.Status
}

func (c *wsClient) wantComplete(id string) {
	c.t.Helper()
	if ev, done := c.next(id); !done {
		c.t.Fatalf("subscription %s: %+v, want complete", id, ev)
	}
}

const watch = `subscription($no: String!, $t: String) { orderStatusChanged(orderNo: $no, accessToken: $t) { orderNo status cards } }`

func TestSubscriptionPaidAndClosed(t *testing.T) {
	t.Parallel()
	for _, proto := range []string{transportWS, legacyWS} {
		t.Run(proto, func(t *testing.T) {
			t.Parallel()
			b := setup(t, options{})
			srv := httptest.NewServer(b.handler)
			t.Cleanup(srv.Close)
			id := b.product(t, "1.00", 3)
			c := dialWS(t, srv, proto, nil)
			defer c.close()

			paid := b.order(t, id, 1, "me@example.com")
			c.subscribe("1", watch, map[string]any{"no": paid.Order.OrderNo, "t": paid.AccessToken})
			if ev, _ := c.next("1"); ev.Data.OrderStatusChanged.Status != "PENDING" || ev.Data.OrderStatusChanged.Cards != nil {
				t.Fatalf("first event %+v, want PENDING without codes", ev)
			}
			// The bundle's events only push (nothing polls), so PAID can
			// only arrive because the change was pushed.
			b.pay(t, paid.Order.OrderNo, "T-1")
			ev, _ := c.next("1")
			if got := ev.Data.OrderStatusChanged; got.Status != "PAID" || len(got.Cards) != 1 || got.Cards[0] != codeOf(id, 0) {
				t.Fatalf("after payment: %+v", ev)
			}
			c.wantComplete("1")

			closed := b.order(t, id, 1, "me@example.com")
			c.subscribe("2", watch, map[string]any{"no": closed.Order.OrderNo, "t": closed.AccessToken})
			if s := c.nextStatus("2"); s != "PENDING" {
				t.Fatalf("first event %s", s)
			}
			b.do(t, anon, `mutation($no: String!, $t: String!) { cancelOrder(orderNo: $no, accessToken: $t) { status } }`,
				map[string]any{"no": closed.Order.OrderNo, "t": closed.AccessToken}).decode(t, &struct{}{})
			if s := c.nextStatus("2"); s != "CLOSED" {
				t.Fatalf("after cancel: %s", s)
			}
			c.wantComplete("2")

			// A final order: its status, then complete at once.
			c.subscribe("3", watch, map[string]any{"no": paid.Order.OrderNo, "t": paid.AccessToken})
			if s := c.nextStatus("3"); s != "PAID" {
				t.Fatalf("subscribe to a paid order: %s", s)
			}
			c.wantComplete("3")

			// Someone else's token, or none: NOT_FOUND / UNAUTHENTICATED, nothing streamed.
			c.subscribe("4", watch, map[string]any{"no": closed.Order.OrderNo, "t": paid.AccessToken})
			if ev, _ := c.next("4"); len(ev.Errors) != 1 || ev.Errors[0].Extensions.Code != domain.ENOTFOUND {
				t.Fatalf("wrong token: %+v", ev)
			}
		})
	}
}

func TestSubscriptionAuth(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	srv := httptest.NewServer(b.handler)
	t.Cleanup(srv.Close)
	id := b.product(t, "1.00", 1)
	o := b.order(t, id, 1, "me@example.com")

	anonConn := dialWS(t, srv, transportWS, nil)
	defer anonConn.close()
	anonConn.subscribe("1", watch, map[string]any{"no": o.Order.OrderNo})
	if ev, _ := anonConn.next("1"); len(ev.Errors) != 1 || ev.Errors[0].Extensions.Code != domain.EUNAUTH {
		t.Fatalf("no token: %+v", ev)
	}

	// An admin (token in connection_init, as browsers cannot set headers) needs no access token.
	adminConn := dialWS(t, srv, transportWS, map[string]any{"Authorization": string(admin)})
	defer adminConn.close()
	adminConn.subscribe("1", watch, map[string]any{"no": o.Order.OrderNo})
	if s := adminConn.nextStatus("1"); s != "PENDING" {
		t.Fatalf("admin: %s", s)
	}
	b.pay(t, o.Order.OrderNo, "T-1")
	ev, _ := adminConn.next("1")
	if ev.Data.OrderStatusChanged.Status != "PAID" || len(ev.Data.OrderStatusChanged.Cards) != 1 {
		t.Fatalf("admin after payment: %+v", ev)
	}
	adminConn.wantComplete("1")

	// Bad subscriptions are refused without harm.
	anonConn.subscribe("2", `subscription { orderStatusChanged(orderNo: "x") { nope } }`, nil)
	if ev, _ := anonConn.next("2"); len(ev.Errors) == 0 || ev.Errors[0].Extensions.Code != "GRAPHQL_VALIDATION_FAILED" {
		t.Fatalf("unknown field: %+v", ev)
	}
}

// TestSubscriptionAcrossProcesses: two handlers, each with its own Redis
// client and queue.Events, stand for two server processes, on one Redis and
// on a Redis Cluster (kami's own cluster client). A change made through one
// reaches a subscriber of the other by the push: the catch-up polls are an
// hour apart here, so nothing else could bring it in time.
func TestSubscriptionAcrossProcesses(t *testing.T) {
	t.Parallel()
	t.Run("miniredis", func(t *testing.T) {
		t.Parallel()
		m := miniredis.RunT(t)
		subscriptionAcrossProcesses(t, func() redis.UniversalClient { return redis.NewClient(&redis.Options{Addr: m.Addr()}) })
	})
	t.Run("cluster", func(t *testing.T) {
		t.Parallel()
		if testing.Short() {
			t.Skip("starts a Redis Cluster")
		}
		c := redistest.StartCluster(t)
		subscriptionAcrossProcesses(t, func() redis.UniversalClient {
			rdb, _, err := queue.Connect(context.Background(), c.URL)
			if err != nil {
				t.Fatal(err)
			}
			return rdb
		})
	})
}

func subscriptionAcrossProcesses(t *testing.T, client func() redis.UniversalClient) {
	keys := queue.NewKeys(fmt.Sprintf("kami-test-%d:", time.Now().UnixNano()))
	newEvents := func() *queue.Events {
		rdb := client()
		t.Cleanup(func() { rdb.Close() })
		ev := queue.NewEvents(rdb, keys, quietLogger())
		ev.PollInterval, ev.ResyncInterval = time.Hour, time.Hour
		t.Cleanup(func() { ev.Close(context.Background()) }) // a Redis of the test, up to the end
		return ev
	}
	processA, processB := newEvents(), newEvents()

	b := setup(t, options{events: processB}) // the subscriber's process listens through B
	b.shop.Events = processA                 // changes are published by process A
	srv := httptest.NewServer(b.handler)
	t.Cleanup(srv.Close)
	id := b.product(t, "1.00", 2)

	for _, end := range []string{"PAID", "CLOSED"} {
		o := b.order(t, id, 1, "me@example.com")
		c := dialWS(t, srv, transportWS, nil)
		c.subscribe("1", watch, map[string]any{"no": o.Order.OrderNo, "t": o.AccessToken})
		if s := c.nextStatus("1"); s != "PENDING" {
			t.Fatalf("first: %s", s)
		}
		if end == "PAID" {
			b.pay(t, o.Order.OrderNo, "T-X")
		} else {
			if _, err := b.shop.CancelOrder(b.ctx, o.Order.OrderNo, o.AccessToken); err != nil {
				t.Fatal(err)
			}
		}
		if s := c.nextStatus("1"); s != end {
			t.Fatalf("got %s, want %s", s, end)
		}
		c.wantComplete("1")
		c.close()
	}
}

// TestSubscribeUnsubscribeLeaksNothing runs 1,000 subscribe/unsubscribe
// cycles and waits for the goroutine count to come back to where it
// started.
func TestSubscribeUnsubscribeLeaksNothing(t *testing.T) {
	// Not parallel: it counts the process's goroutines.
	b := setup(t, options{mod: func(c *graph.Config) { c.KeepAlive = time.Hour }})
	srv := httptest.NewServer(b.handler)
	t.Cleanup(srv.Close)
	id := b.product(t, "1.00", 1)
	o := b.order(t, id, 1, "me@example.com")
	vars := map[string]any{"no": o.Order.OrderNo, "t": o.AccessToken}

	settle := func() int {
		runtime.GC()
		return runtime.NumGoroutine()
	}
	before := settle()
	for round, proto := range []string{transportWS, legacyWS} {
		c := dialWS(t, srv, proto, nil)
		for i := range 500 {
			sid := fmt.Sprintf("%d-%d", round, i)
			c.subscribe(sid, watch, vars)
			if s := c.nextStatus(sid); s != "PENDING" {
				t.Fatalf("cycle %s: %s", sid, s)
			}
			c.unsubscribe(sid)
		}
		c.close()
	}
	eventually(t, 5*time.Second, "subscriptions released", func() bool { return b.events.live.Load() == 0 })
	const tolerance = 3
	var now int
	deadline := time.Now().Add(domaintest.MinPatience) // goroutines wind down at the machine's pace
	for now = settle(); now > before+tolerance && time.Now().Before(deadline); now = settle() {
		time.Sleep(10 * time.Millisecond)
	}
	if now > before+tolerance {
		buf := make([]byte, 1<<16)
		t.Fatalf("goroutines: %d before, %d after 1,000 cycles\n%s", before, now, buf[:runtime.Stack(buf, true)])
	}
	t.Logf("goroutines: %d before, %d after", before, now)
}
