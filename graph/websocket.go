package graph

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"

	"github.com/99designs/gqlgen/graphql/handler/transport"
)

// Anyone can open a WebSocket, so what one client may hold open is capped:
// WebSockets per client address (addrCount, checked before the upgrade) and
// operations per WebSocket over its life (operationCap, checked before the
// operation is parsed). A subscription is cheap (one goroutine and one
// entry in the process's shared Redis subscription, see queue.Events), but
// not free.

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

// operationCap wraps the WebSocket implementation so that every operation
// a client starts on one WebSocket (a graphql-transport-ws "subscribe" or
// graphql-ws "start" message, whatever its kind) takes one of the
// connection's max places for the rest of the connection's life, also when
// it fails to parse, is refused, or completes: a socket that has started
// max operations is closed (1008, policy violation) at the next one. Only
// counting the operations open at a time let one socket churn operations
// without end (subscribe, fail or complete, subscribe again), each a
// goroutine and a parse that no HTTP request limit saw; queries and
// mutations sent over the socket were not counted at all. The count is
// taken from the message itself, before gqlgen parses its payload.
type operationCap struct {
	transport.WebsocketImplementation
	max int // 0: no cap
}

func (c operationCap) Accept(w http.ResponseWriter, r *http.Request, opts transport.WebsocketAcceptOptions) (transport.WebsocketConn, error) {
	conn, err := c.WebsocketImplementation.Accept(w, r, opts)
	if err != nil || c.max <= 0 {
		return conn, err
	}
	return &cappedConn{WebsocketConn: conn, max: c.max}, nil
}

// closePolicyViolation is RFC 6455's close code for a peer that broke the
// server's policy.
const closePolicyViolation = 1008

// cappedConn counts the operations started on one connection. gqlgen reads
// a connection's messages from one goroutine at a time, so started needs no
// lock.
type cappedConn struct {
	transport.WebsocketConn
	max, started int
}

func (c *cappedConn) NextReader() (int, io.Reader, error) {
	kind, r, err := c.WebsocketConn.NextReader()
	if err != nil {
		return kind, r, err
	}
	// The implementation has read the whole message (within the read
	// limit) already; reading it again costs a copy.
	b, err := io.ReadAll(r)
	if err != nil {
		return kind, nil, err
	}
	// Read the type as gqlgen reads the message (the first JSON value,
	// whatever follows it), so that no message is an operation to gqlgen
	// and not to the count.
	var m struct {
		Type string `json:"type"`
	}
	if json.NewDecoder(bytes.NewReader(b)).Decode(&m) == nil && (m.Type == "subscribe" || m.Type == "start") {
		if c.started++; c.started > c.max {
			c.WebsocketConn.WriteClose(closePolicyViolation, fmt.Sprintf("this connection started %d operations; open a new one", c.max))
			return kind, nil, transport.ErrWebsocketClosed
		}
	}
	return kind, bytes.NewReader(b), nil
}

// SetReadLimit and SetReadDeadline pass gqlgen's optional calls through:
// without them the payload read limit would be lost.
func (c *cappedConn) SetReadLimit(limit int64) {
	if l, ok := c.WebsocketConn.(transport.WebsocketReadLimiter); ok {
		l.SetReadLimit(limit)
	}
}

func (c *cappedConn) SetReadDeadline(t time.Time) error {
	if d, ok := c.WebsocketConn.(transport.WebsocketReadDeadliner); ok {
		return d.SetReadDeadline(t)
	}
	return nil
}
