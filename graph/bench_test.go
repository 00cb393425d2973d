package graph_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"

	"kami/graph"
)

// BenchmarkStorefront is what a storefront sends most, through the real
// handler on SQLite: createOrder, and the order query a buyer's page polls.
// It measures what the request limits (document size, price, depth,
// response cap, operation names) add to ordinary requests:
//
//	go test ./graph/ -run '^$' -bench Storefront -benchtime 2000x -count 5
func BenchmarkStorefront(b *testing.B) {
	bb := setup(b, options{})
	ctx := context.Background()
	id := bb.product(b, "1.00", 0)
	pid, _ := strconv.ParseInt(id, 10, 64)
	codes := make([]string, 30_000)
	for i := range codes {
		codes[i] = fmt.Sprintf("BENCH-%06d", i)
	}
	for start := 0; start < len(codes); start += 10_000 {
		if _, err := bb.ledger.ImportCards(ctx, pid, codes[start:start+10_000], "bench"); err != nil {
			b.Fatal(err)
		}
	}
	paid := bb.order(b, id, 1, "paid@example.com")
	bb.pay(b, paid.Order.OrderNo, "T-BENCH")

	// parses reports the documents parsed and validated per request: 0
	// when the query cache keeps the document (all but its first).
	parses := func(b *testing.B) func() {
		before := graph.WorkOf(bb.handler)
		return func() {
			after := graph.WorkOf(bb.handler)
			b.ReportMetric(float64(after.Parsed-before.Parsed)/float64(b.N), "parses/op")
			b.ReportMetric(float64(after.Validated-before.Validated)/float64(b.N), "validations/op")
		}
	}
	// post sends the query's text, or with hash its hash alone (an
	// automatic persisted query kami already keeps).
	post := func(b *testing.B, query string, vars map[string]any, hash ...bool) {
		payload := map[string]any{"query": query, "variables": vars}
		if len(hash) > 0 {
			payload = map[string]any{"variables": vars, "extensions": map[string]any{
				"persistedQuery": map[string]any{"version": 1, "sha256Hash": sha(query)}}}
		}
		body, _ := json.Marshal(payload)
		req := httptest.NewRequest(http.MethodPost, "/graphql", bytes.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		rec := httptest.NewRecorder()
		bb.handler.ServeHTTP(rec, req)
		if rec.Code != http.StatusOK || bytes.Contains(rec.Body.Bytes(), []byte(`"errors"`)) {
			b.Fatalf("%d %s", rec.Code, rec.Body.Bytes())
		}
	}
	const storefrontCreate = `mutation CreateOrder($in: CreateOrderInput!) { createOrder(input: $in) {
		order { orderNo status amount expiresAt } accessToken payment { kind url expiresAt } } }`
	const storefrontOrder = `query Order($no: String!, $t: String) { order(orderNo: $no, accessToken: $t) {
		orderNo status amount quantity expiresAt paidAt cards product { name price } } }`

	b.Run("createOrder", func(b *testing.B) {
		defer parses(b)()
		for i := range b.N {
			post(b, storefrontCreate, map[string]any{"in": map[string]any{"productId": id, "quantity": 1,
				"contact": fmt.Sprintf("buyer%d@example.com", i), "provider": "sandbox"}})
		}
	})
	b.Run("order", func(b *testing.B) {
		defer parses(b)()
		vars := map[string]any{"no": paid.Order.OrderNo, "t": paid.AccessToken}
		for range b.N {
			post(b, storefrontOrder, vars)
		}
	})
	// The same two by hash, once kami keeps their texts.
	for _, q := range []string{storefrontCreate, storefrontOrder} {
		body, _ := json.Marshal(map[string]any{"query": q, "extensions": map[string]any{
			"persistedQuery": map[string]any{"version": 1, "sha256Hash": sha(q)}}})
		req := httptest.NewRequest(http.MethodPost, "/graphql", bytes.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		bb.handler.ServeHTTP(httptest.NewRecorder(), req) // its answer does not matter: the text is kept
	}
	b.Run("createOrder/hash", func(b *testing.B) {
		defer parses(b)()
		for i := range b.N {
			post(b, storefrontCreate, map[string]any{"in": map[string]any{"productId": id, "quantity": 1,
				"contact": fmt.Sprintf("hash-buyer%d@example.com", i), "provider": "sandbox"}}, true)
		}
	})
	b.Run("order/hash", func(b *testing.B) {
		defer parses(b)()
		vars := map[string]any{"no": paid.Order.OrderNo, "t": paid.AccessToken}
		for range b.N {
			post(b, storefrontOrder, vars, true)
		}
	})
}
