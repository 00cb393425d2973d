package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/coder/websocket"
)

// Helpers for the hostile-traffic tests: GraphQL over HTTP and
// over a WebSocket against a whole server.

// gqlErr is one GraphQL error.
type gqlErr struct {
	Message    string
	Extensions struct{ Code string }
}

// gqlResult is a decoded GraphQL response.
type gqlResult struct {
	Status int
	Data   json.RawMessage
	Errors []gqlErr
}

func (r gqlResult) code() string {
	if len(r.Errors) == 0 {
		return ""
	}
	return r.Errors[0].Extensions.Code
}

// decode unpacks the data, failing on errors.
func (r gqlResult) decode(t *testing.T, v any) {
	t.Helper()
	if len(r.Errors) > 0 {
		t.Fatalf("errors %+v", r.Errors)
	}
	if err := json.Unmarshal(r.Data, v); err != nil {
		t.Fatalf("data %s: %v", r.Data, err)
	}
}

// graphql posts one GraphQL request with the given headers ("Name",
// "value" pairs).
func (ta *testApp) graphql(t *testing.T, query string, vars map[string]any, header ...string) gqlResult {
	t.Helper()
	b, _ := json.Marshal(map[string]any{"query": query, "variables": vars})
	req, _ := http.NewRequest(http.MethodPost, ta.srv.URL+"/graphql", bytes.NewReader(b))
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Add(header[i], header[i+1])
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	raw, _ := io.ReadAll(res.Body)
	out := gqlResult{Status: res.StatusCode}
	if err := json.Unmarshal(raw, &out); err != nil {
		t.Fatalf("response %d %q: %v", res.StatusCode, raw, err)
	}
	return out
}

const createOrderMutation = `mutation CreateOrder($in: CreateOrderInput!) { createOrder(input: $in) {
	order { orderNo status quantity contact } accessToken payment { kind url } } }`

// placedOrder is createOrder's answer.
type placedOrder struct {
	CreateOrder struct {
		Order struct {
			OrderNo, Status, Contact string
			Quantity                 int
		}
		AccessToken string
	}
}

// orderInput is createOrder's input.
func orderInput(productID int64, qty int, contact, provider, key string) map[string]any {
	in := map[string]any{"productId": productID, "quantity": qty, "contact": contact, "provider": provider}
	if key != "" {
		in["idempotencyKey"] = key
	}
	return map[string]any{"in": in}
}

// ws speaks graphql-transport-ws to the server.
type ws struct {
	t       *testing.T
	ctx     context.Context
	conn    *websocket.Conn
	pending map[string][]wsMessage // read, for another subscription
}

type wsMessage struct {
	ID      string          `json:"id,omitempty"`
	Type    string          `json:"type"`
	Payload json.RawMessage `json:"payload,omitempty"`
}

// dialWS opens a WebSocket; a refused upgrade returns nil and the status.
func (ta *testApp) dialWS(t *testing.T, header http.Header) (*ws, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	conn, res, err := websocket.Dial(ctx, strings.Replace(ta.srv.URL, "http", "ws", 1)+"/graphql",
		&websocket.DialOptions{Subprotocols: []string{"graphql-transport-ws"}, HTTPHeader: header})
	if err != nil {
		if res != nil {
			return nil, res.StatusCode
		}
		t.Fatalf("dial: %v", err)
	}
	t.Cleanup(func() { conn.CloseNow() })
	c := &ws{t: t, ctx: ctx, conn: conn, pending: map[string][]wsMessage{}}
	c.send(wsMessage{Type: "connection_init"})
	if m := c.read(); m.Type != "connection_ack" {
		t.Fatalf("init: %+v", m)
	}
	return c, http.StatusSwitchingProtocols
}

func (c *ws) send(m wsMessage) {
	c.t.Helper()
	b, _ := json.Marshal(m)
	if err := c.conn.Write(c.ctx, websocket.MessageText, b); err != nil {
		c.t.Fatalf("write: %v", err)
	}
}

func (c *ws) read() wsMessage {
	c.t.Helper()
	for {
		_, b, err := c.conn.Read(c.ctx)
		if err != nil {
			c.t.Fatalf("read: %v", err)
		}
		var m wsMessage
		if err := json.Unmarshal(b, &m); err != nil {
			c.t.Fatalf("message %s: %v", b, err)
		}
		switch m.Type {
		case "ping":
			c.send(wsMessage{Type: "pong"})
		case "pong", "ka":
		default:
			return m
		}
	}
}

const watchOrder = `subscription Watch($no: String!, $t: String) { orderStatusChanged(orderNo: $no, accessToken: $t) { orderNo status } }`

func (c *ws) subscribe(id, orderNo, token string) {
	payload, _ := json.Marshal(map[string]any{"query": watchOrder, "variables": map[string]any{"no": orderNo, "t": token}})
	c.send(wsMessage{ID: id, Type: "subscribe", Payload: payload})
}

// operation sends query as the operation id (its name) and reads up to
// its end: complete, or an error.
func (c *ws) operation(id, query string) {
	c.t.Helper()
	payload, _ := json.Marshal(map[string]any{"query": query})
	c.send(wsMessage{ID: id, Type: "subscribe", Payload: payload})
	for {
		if _, code, done := c.event(id); done || code != "" {
			return
		}
	}
}

// closed reads until the server closes the socket and returns its close
// status (-1 if it ended without one).
func (c *ws) closed() websocket.StatusCode {
	c.t.Helper()
	for {
		if _, _, err := c.conn.Read(c.ctx); err != nil {
			return websocket.CloseStatus(err)
		}
	}
}

// event is the next message for id: its status, the code of its error,
// or complete.
func (c *ws) event(id string) (status, code string, complete bool) {
	c.t.Helper()
	var m wsMessage
	if q := c.pending[id]; len(q) > 0 {
		m, c.pending[id] = q[0], q[1:]
	} else {
		for m = c.read(); m.ID != id; m = c.read() {
			c.pending[m.ID] = append(c.pending[m.ID], m)
		}
	}
	switch m.Type {
	case "complete":
		return "", "", true
	case "error":
		var errs []gqlErr
		json.Unmarshal(m.Payload, &errs)
		if len(errs) > 0 {
			return "", errs[0].Extensions.Code, false
		}
		return "", "?", false
	}
	var p struct {
		Data struct {
			OrderStatusChanged struct{ Status string }
		}
		Errors []gqlErr
	}
	json.Unmarshal(m.Payload, &p)
	if len(p.Errors) > 0 {
		return "", p.Errors[0].Extensions.Code, false
	}
	return p.Data.OrderStatusChanged.Status, "", false
}

// wantStatus reads id's next event and wants status.
func (c *ws) wantStatus(id, want string) {
	c.t.Helper()
	if st, code, done := c.event(id); st != want {
		c.t.Fatalf("subscription %s: status %q code %q complete %v, want %s", id, st, code, done, want)
	}
}
