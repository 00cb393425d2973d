package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"time"

	"kami/providers/sandbox"
)

// The place phase's load runs on the same cores as kami, PostgreSQL and
// Redis, so what the load generator spends is taken from them. net/http's
// client spends about twice what the same requests need (a reader and a
// writer goroutine per connection, a channel hand-off per request, a
// second JSON decode). A worker of the place phase therefore speaks
// HTTP/1.1 on one keep-alive connection of its own: it writes the same
// request bytes a storefront would (the headers net/http sends, minus
// its User-Agent) and reads every answer whole with net/http's own
// response parser. -load-client net/http runs the place phase on
// net/http's client instead, for comparison.

// storefront is what a place-phase worker sends: an order, and the
// sandbox gateway's payment notification for it.
type storefront interface {
	// createOrder places order i of the run and returns its number and
	// amount.
	createOrder(ctx context.Context, i int) (orderNo, amount string, err error)
	pay(ctx context.Context, orderNo, amount string) error
	close()
}

// orderBody is createOrder's request body for order i: the same document
// and variables for every order but the contact.
type orderBody struct {
	head, tail []byte // around the order's number in its contact
}

func newOrderBody(productID, runID string) orderBody {
	const mark = "\x00i\x00"
	b, err := json.Marshal(map[string]any{"query": createOrderQuery, "variables": map[string]any{
		"in": map[string]any{"productId": productID, "quantity": 1,
			"contact": fmt.Sprintf("buyer-%s-%s@bench.test", runID, mark), "provider": "sandbox"}}})
	if err != nil {
		panic(err) // strings and an int: cannot fail
	}
	marked, _ := json.Marshal(mark)
	marked = marked[1 : len(marked)-1]
	head, tail, ok := bytes.Cut(b, marked)
	if !ok {
		panic("bench: the contact's mark is not in the createOrder body")
	}
	return orderBody{head: head, tail: tail}
}

func (b orderBody) appendFor(dst []byte, i int) []byte {
	dst = append(dst, b.head...)
	dst = strconv.AppendInt(dst, int64(i), 10)
	return append(dst, b.tail...)
}

// createOrderAnswer is the part of createOrder's answer the load reads.
type createOrderAnswer struct {
	Data *struct {
		CreateOrder struct {
			Order struct {
				OrderNo string `json:"orderNo"`
				Amount  string `json:"amount"`
			} `json:"order"`
		} `json:"createOrder"`
	} `json:"data"`
	Errors []gqlError `json:"errors"`
}

// orderAnswer turns an HTTP answer to createOrder into the order or a
// callError, as client.graphql does.
func orderAnswer(status int, raw []byte) (orderNo, amount string, err error) {
	var r createOrderAnswer
	if err := json.Unmarshal(raw, &r); err != nil {
		return "", "", &callError{fmt.Sprintf("HTTP_%d", status), truncate(string(raw), 200)}
	}
	if len(r.Errors) > 0 {
		code := r.Errors[0].Extensions.Code
		if code == "" {
			code = fmt.Sprintf("HTTP_%d", status)
		}
		return "", "", &callError{code, r.Errors[0].Message}
	}
	if status != http.StatusOK || r.Data == nil || r.Data.CreateOrder.Order.OrderNo == "" {
		return "", "", &callError{fmt.Sprintf("HTTP_%d", status), truncate(string(raw), 200)}
	}
	o := r.Data.CreateOrder.Order
	return o.OrderNo, o.Amount, nil
}

// wireClient is one worker's keep-alive connection to kami.
type wireClient struct {
	host   string // host:port
	secret string
	body   orderBody
	conn   net.Conn
	br     *bufio.Reader
	out    []byte // the request being written
	in     []byte // the answer's body
}

func newWireClient(base, secret string, body orderBody) (*wireClient, error) {
	u, err := url.Parse(base)
	if err != nil || u.Scheme != "http" || u.Host == "" {
		return nil, fmt.Errorf("the wire client needs an http://host:port URL, not %q", base)
	}
	return &wireClient{host: u.Host, secret: secret, body: body}, nil
}

func (w *wireClient) close() {
	if w.conn != nil {
		w.conn.Close()
		w.conn = nil
	}
}

// roundTrip writes the request in w.out (headers and body) and reads the
// answer's status and body. Any failure closes the connection: a POST is
// never sent again on a new one, so an error is an error.
func (w *wireClient) roundTrip(ctx context.Context) (int, []byte, error) {
	if w.conn == nil {
		d := net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}
		conn, err := d.DialContext(ctx, "tcp", w.host)
		if err != nil {
			return 0, nil, &callError{"TRANSPORT", err.Error()}
		}
		w.conn, w.br = conn, bufio.NewReaderSize(conn, 8<<10)
	}
	deadline := time.Now().Add(30 * time.Second)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	_ = w.conn.SetDeadline(deadline)
	if _, err := w.conn.Write(w.out); err != nil {
		w.close()
		return 0, nil, &callError{"TRANSPORT", err.Error()}
	}
	resp, err := http.ReadResponse(w.br, nil)
	if err != nil {
		w.close()
		return 0, nil, &callError{"TRANSPORT", err.Error()}
	}
	w.in = w.in[:0]
	buf := bytes.NewBuffer(w.in)
	_, err = buf.ReadFrom(io.LimitReader(resp.Body, 16<<20))
	resp.Body.Close()
	w.in = buf.Bytes()
	if err != nil {
		w.close()
		return 0, nil, &callError{"TRANSPORT", err.Error()}
	}
	if resp.Close {
		w.close()
	}
	return resp.StatusCode, w.in, nil
}

// startPost begins a POST request of n body bytes in w.out.
func (w *wireClient) startPost(path string, n int) {
	w.out = append(w.out[:0], "POST "...)
	w.out = append(w.out, path...)
	w.out = append(w.out, " HTTP/1.1\r\nHost: "...)
	w.out = append(w.out, w.host...)
	w.out = append(w.out, "\r\nContent-Length: "...)
	w.out = strconv.AppendInt(w.out, int64(n), 10)
	w.out = append(w.out, "\r\n"...)
}

func (w *wireClient) header(name, value string) {
	w.out = append(w.out, name...)
	w.out = append(w.out, ": "...)
	w.out = append(w.out, value...)
	w.out = append(w.out, "\r\n"...)
}

func (w *wireClient) createOrder(ctx context.Context, i int) (string, string, error) {
	// The body goes after the headers; its length is known first.
	n := len(w.body.head) + len(strconv.Itoa(i)) + len(w.body.tail)
	w.startPost("/graphql", n)
	w.header("Content-Type", "application/json")
	w.header("Accept", "application/graphql-response+json, application/json")
	w.out = append(w.out, "\r\n"...)
	w.out = w.body.appendFor(w.out, i)
	status, raw, err := w.roundTrip(ctx)
	if err != nil {
		return "", "", err
	}
	return orderAnswer(status, raw)
}

func (w *wireClient) pay(ctx context.Context, orderNo, amount string) error {
	header, body := sandbox.Signed(w.secret, payNotification(orderNo, amount))
	w.startPost("/webhooks/sandbox", len(body))
	names := make([]string, 0, len(header))
	for name := range header {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		for _, v := range header[name] {
			w.header(name, v)
		}
	}
	w.out = append(w.out, "\r\n"...)
	w.out = append(w.out, body...)
	status, _, err := w.roundTrip(ctx)
	if err != nil {
		return err
	}
	if status != http.StatusOK {
		return &callError{fmt.Sprintf("HTTP_%d", status), "webhook refused"}
	}
	return nil
}

// payNotification is the sandbox gateway's notification that orderNo was
// paid amount just now.
func payNotification(orderNo, amount string) sandbox.Notification {
	return sandbox.Notification{OrderNo: orderNo, TradeNo: "BT" + orderNo, Amount: amount,
		PaidAt: time.Now().UTC().Format(time.RFC3339)}
}

// httpStorefront is a place-phase worker on net/http's client.
type httpStorefront struct {
	c                *client
	vars             map[string]any
	productID, runID string
}

func (h *httpStorefront) createOrder(ctx context.Context, i int) (string, string, error) {
	h.vars["in"] = map[string]any{"productId": h.productID, "quantity": 1,
		"contact": fmt.Sprintf("buyer-%s-%d@bench.test", h.runID, i), "provider": "sandbox"}
	var data createOrderData
	if err := h.c.graphql(ctx, createOrderQuery, h.vars, false, &data); err != nil {
		return "", "", err
	}
	o := data.CreateOrder.Order
	return o.OrderNo, o.Amount, nil
}

func (h *httpStorefront) pay(ctx context.Context, orderNo, amount string) error {
	return h.c.pay(ctx, orderNo, amount)
}

func (h *httpStorefront) close() {}
