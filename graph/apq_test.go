package graph_test

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"

	"kami/graph"
)

// persisted is a request body of an automatic persisted query: the
// document's hash, with its text or without it ("").
func persisted(query, hash string, vars map[string]any) string {
	p := map[string]any{"extensions": map[string]any{"persistedQuery": map[string]any{"version": 1, "sha256Hash": hash}}}
	if query != "" {
		p["query"] = query
	}
	if vars != nil {
		p["variables"] = vars
	}
	b, _ := json.Marshal(p)
	return string(b)
}

func sha(query string) string {
	h := sha256.Sum256([]byte(query))
	return hex.EncodeToString(h[:])
}

// TestPersistedQueries: a storefront sends a document's text with its
// hash once, and the hash alone after that; the document is then neither
// parsed nor validated again. An unknown hash is PERSISTED_QUERY_NOT_FOUND
// and changes nothing; a hash that is not the text's is refused.
func TestPersistedQueries(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	p := b.product(t, "1.00", 3)
	srv := httptest.NewServer(b.handler)
	defer srv.Close()
	in := func(contact string) map[string]any {
		return map[string]any{"in": map[string]any{"productId": p, "quantity": 1, "contact": contact, "provider": "sandbox"}}
	}
	hash := sha(createOrder)
	orders := func() int {
		n, err := b.db.NewSelect().Table("orders").Count(b.ctx)
		if err != nil {
			t.Fatal(err)
		}
		return int(n)
	}

	// Unknown: nothing runs, under either media type.
	for _, accept := range []string{gqlResp, appJSON} {
		queries := b.queries.all.Load()
		r := post(t, srv, accept, appJSON, persisted("", hash, in("a@example.com")))
		if len(r.Errors) != 1 || r.Errors[0].Extensions.Code != "PERSISTED_QUERY_NOT_FOUND" || r.Errors[0].Message != "PersistedQueryNotFound" || r.hasData {
			t.Fatalf("%s: unknown hash answered %d %+v (data %s)", accept, r.status, r.Errors, r.Data)
		}
		if want := map[string]int{gqlResp: 400, appJSON: 200}[accept]; r.status != want {
			t.Errorf("%s: unknown hash answered %d, want %d", accept, r.status, want)
		}
		if b.queries.all.Load() != queries || orders() != 0 {
			t.Fatalf("an unknown hash ran %d queries, %d orders", b.queries.all.Load()-queries, orders())
		}
	}
	// A hash that is not the text's.
	r := post(t, srv, gqlResp, appJSON, persisted(createOrder, sha("something else"), in("a@example.com")))
	if len(r.Errors) != 1 || r.Errors[0].Extensions.Code != "BAD_REQUEST" || orders() != 0 {
		t.Fatalf("a wrong hash: %d %+v, %d orders", r.status, r.Errors, orders())
	}

	// The text with its hash, then the hash alone.
	var got struct{ CreateOrder placed }
	post(t, srv, gqlResp, appJSON, persisted(createOrder, hash, in("a@example.com"))).decode(t, &got)
	before := graph.WorkOf(b.handler)
	for _, contact := range []string{"b@example.com", "c@example.com"} {
		got = struct{ CreateOrder placed }{}
		post(t, srv, gqlResp, appJSON, persisted("", hash, in(contact))).decode(t, &got)
		if got.CreateOrder.Order.Status != "PENDING" || got.CreateOrder.AccessToken == "" {
			t.Fatalf("by hash: %+v", got.CreateOrder)
		}
	}
	if after := graph.WorkOf(b.handler); after.Parsed != before.Parsed || after.Validated != before.Validated {
		t.Errorf("a known hash was parsed %d and validated %d times again", after.Parsed-before.Parsed, after.Validated-before.Validated)
	}
	if orders() != 3 {
		t.Fatalf("%d orders, want 3", orders())
	}

	// GET carries the extension as a parameter.
	q := `{ products { id } }`
	get(t, srv, gqlResp, url.Values{"query": {q}, "extensions": {`{"persistedQuery":{"version":1,"sha256Hash":"` + sha(q) + `"}}`}}).decode(t, &struct{}{})
	var products struct{ Products []struct{ ID string } }
	get(t, srv, gqlResp, url.Values{"extensions": {`{"persistedQuery":{"version":1,"sha256Hash":"` + sha(q) + `"}}`}}).decode(t, &products)
	if len(products.Products) != 1 {
		t.Fatalf("GET by hash: %+v", products)
	}
}

// TestPersistedQueriesKeepTheLimits: a document sent by its hash meets
// every limit a document sent as text meets: the size limits, the depth
// and the price under this request's variables. A text too long to keep
// is not kept.
func TestPersistedQueriesKeepTheLimits(t *testing.T) {
	t.Parallel()
	b := setup(t, options{mod: func(c *graph.Config) { c.MaxComplexity, c.MaxDepth = 60, 5 }})
	b.product(t, "1.00", 1)
	srv := httptest.NewServer(b.handler)
	defer srv.Close()
	try := func(query string, vars map[string]any, code string) {
		t.Helper()
		for _, text := range []string{query, ""} { // sent, then by hash
			r := post(t, srv, gqlResp, appJSON, persisted(text, sha(query), vars))
			if len(r.Errors) != 1 || r.Errors[0].Extensions.Code != code || r.hasData {
				t.Fatalf("sent with text %v: %d %+v (data %s), want %s", text != "", r.status, r.Errors, r.Data, code)
			}
		}
	}
	try("{ "+aliases(31, "products { id }")+" }", nil, "QUERY_TOO_LARGE")
	try(`{ refunds { edges { node { order { product { id } } } } } }`, nil, "DEPTH_LIMIT_EXCEEDED")
	// Cheap with a small page, too dear with a large one: priced per request.
	list := `query($n: Int) { orders(first: $n) { edges { node { orderNo status amount contact } } } }`
	post(t, srv, gqlResp, appJSON, persisted(list, sha(list), map[string]any{"n": 2}), "Authorization", string(admin)).decode(t, &struct{}{})
	r := post(t, srv, gqlResp, appJSON, persisted("", sha(list), map[string]any{"n": 100}), "Authorization", string(admin))
	if len(r.Errors) != 1 || r.Errors[0].Extensions.Code != "COMPLEXITY_LIMIT_EXCEEDED" {
		t.Fatalf("a dear page by hash: %d %+v", r.status, r.Errors)
	}
	// A text over the length kept answers, but is not kept.
	long := "{ products { id } }" + strings.Repeat(" ", 5000)
	post(t, srv, gqlResp, appJSON, persisted(long, sha(long), nil)).decode(t, &struct{}{})
	r = post(t, srv, gqlResp, appJSON, persisted("", sha(long), nil))
	if len(r.Errors) != 1 || r.Errors[0].Extensions.Code != "PERSISTED_QUERY_NOT_FOUND" {
		t.Fatalf("a long text by hash: %d %+v, want it not kept", r.status, r.Errors)
	}
}
