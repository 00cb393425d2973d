package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"kami/providers/sandbox"
)

// The wire client sends the bytes net/http's client would for the same
// order: the same JSON body (a storefront's document and variables).
func TestOrderBodyIsWhatTheNetHTTPClientSends(t *testing.T) {
	b := newOrderBody("42", "run\"x")
	for _, i := range []int{0, 7, 12345} {
		want, err := json.Marshal(map[string]any{"query": createOrderQuery, "variables": map[string]any{
			"in": map[string]any{"productId": "42", "quantity": 1,
				"contact": fmt.Sprintf("buyer-%s-%d@bench.test", "run\"x", i), "provider": "sandbox"}}})
		if err != nil {
			t.Fatal(err)
		}
		if got := b.appendFor(nil, i); string(got) != string(want) {
			t.Errorf("order %d:\n got %s\nwant %s", i, got, want)
		}
	}
}

// The wire client against a server that answers with a length, chunked,
// and with Connection: close: every answer is read whole, a closed
// connection is dialled again, and the requests are well formed (the
// notification's signature verifies).
func TestWireClientSpeaksHTTP(t *testing.T) {
	const secret = "bench-test-secret"
	var n, conns atomic.Int64
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil || r.Method != http.MethodPost || r.Header.Get("Content-Type") != "application/json" {
			http.Error(w, "bad request", http.StatusBadRequest)
			return
		}
		k := n.Add(1)
		switch r.URL.Path {
		case "/graphql":
			var req struct {
				Query     string `json:"query"`
				Variables struct {
					In struct {
						Contact string `json:"contact"`
					} `json:"in"`
				} `json:"variables"`
			}
			if json.Unmarshal(body, &req) != nil || req.Query != createOrderQuery {
				http.Error(w, "bad body", http.StatusBadRequest)
				return
			}
			if strings.Contains(req.Variables.In.Contact, "-2@") {
				w.Header().Set("Content-Type", "application/json")
				fmt.Fprint(w, `{"errors":[{"message":"sold out","extensions":{"code":"OUT_OF_STOCK"}}],"data":null}`)
				return
			}
			if k%3 == 0 {
				w.Header().Set("Connection", "close")
			}
			answer := fmt.Sprintf(`{"data":{"createOrder":{"order":{"orderNo":"K%d","status":"PENDING","amount":"1.00"}}}}`, k)
			if k%2 == 0 {
				// Chunked: flushed before the end.
				io.WriteString(w, answer[:10])
				w.(http.Flusher).Flush()
				io.WriteString(w, answer[10:])
				return
			}
			w.Header().Set("Content-Length", fmt.Sprint(len(answer)))
			io.WriteString(w, answer)
		case "/webhooks/sandbox":
			if r.Header.Get(sandbox.SignatureHeader) != sandbox.Sign(secret, body) {
				http.Error(w, "bad signature", http.StatusUnauthorized)
				return
			}
			io.WriteString(w, "success")
		default:
			http.NotFound(w, r)
		}
	}))
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	defer srv.Close()

	w, err := newWireClient(srv.URL, secret, newOrderBody("1", "t"))
	if err != nil {
		t.Fatal(err)
	}
	defer w.close()
	ctx := context.Background()
	for i := 0; i < 12; i++ {
		orderNo, amount, err := w.createOrder(ctx, i)
		if i == 2 {
			if ce, ok := err.(*callError); !ok || ce.code != "OUT_OF_STOCK" {
				t.Fatalf("order 2: want OUT_OF_STOCK, got %v", err)
			}
			continue
		}
		if err != nil || !strings.HasPrefix(orderNo, "K") || amount != "1.00" {
			t.Fatalf("order %d: %q %q %v", i, orderNo, amount, err)
		}
		if err := w.pay(ctx, orderNo, amount); err != nil {
			t.Fatalf("pay %s: %v", orderNo, err)
		}
	}
	bad, err := newWireClient(srv.URL, "another secret", newOrderBody("1", "t"))
	if err != nil {
		t.Fatal(err)
	}
	defer bad.close()
	if err := bad.pay(ctx, "K1", "1.00"); err == nil || errCode(err) != "HTTP_401" {
		t.Fatalf("a badly signed notification: want HTTP_401, got %v", err)
	}
	if c := conns.Load(); c < 3 {
		t.Errorf("the server closed connections on every third request, but the client dialled %d times", c)
	}
}
