package graph_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/99designs/gqlgen/graphql/introspection"
	"github.com/uptrace/bun"

	"kami/domain"
	"kami/graph"
)

// The hostile-traffic attacks on the GraphQL cost, each against the real
// handler. Each is refused with its code, and the work it caused is
// counted, never timed: the documents parsed and validated, and the fields
// priced (asked their complexity, whichever walk asks).

// fanOut is a query spreading fragment F0, where each Fi spreads F(i+1)
// twice: n fragments in a few hundred bytes whose expansion has 2^n fields.
func fanOut(n int) string {
	var b strings.Builder
	b.WriteString("{ products { ...F0 } }\n")
	for i := range n {
		fmt.Fprintf(&b, "fragment F%d on Product { id ...F%d ...F%d }\n", i, i+1, i+1)
	}
	fmt.Fprintf(&b, "fragment F%d on Product { id }\n", n)
	return b.String()
}

// TestFragmentFanOutIsPricedOnce: 26 fragments each spreading the next
// twice (under 1.2 KB) cost 14 s of CPU before they were refused; 40 would
// have cost days. Each fragment is now priced once: one field asked per
// field written, and a small fan-out is priced exactly.
func TestFragmentFanOutIsPricedOnce(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	b.product(t, "1.00", 1)
	for _, n := range []int{26, 40} {
		before := graph.WorkOf(b.handler)
		r := b.do(t, anon, fanOut(n), nil)
		r.wantCode(t, "COMPLEXITY_LIMIT_EXCEEDED")
		priced := graph.WorkOf(b.handler).Priced - before.Priced
		// Each fragment holds one field.
		if limit := int64(n + 10); priced > limit {
			t.Errorf("%d fragments: %d fields priced, want at most %d", n, priced, limit)
		}
		t.Logf("%d fragments (%d bytes): %d fields priced", n, len(fanOut(n)), priced)
	}
	// Priced right: F5 costs 1, F4 3, F3 7, ... F0 63; products 64.
	var got struct{ Products []struct{ ID string } }
	b.do(t, anon, fanOut(5), nil).decode(t, &got)
	if len(got.Products) != 1 {
		t.Fatalf("products %+v", got.Products)
	}
	b2 := setup(t, options{mod: func(c *graph.Config) { c.MaxComplexity = 63 }})
	b2.do(t, anon, fanOut(5), nil).wantCode(t, "COMPLEXITY_LIMIT_EXCEEDED")
	b3 := setup(t, options{mod: func(c *graph.Config) { c.MaxComplexity = 64 }})
	if r := b3.do(t, anon, fanOut(5), nil); len(r.Errors) > 0 {
		t.Fatalf("a fan-out costing 64 under a limit of 64: %+v", r.Errors)
	}
}

// TestRepeatedFieldsRefusedBeforeValidation: {products{id id id … ×16000}}
// (48 KB) cost 19 s in validation, and a 650 KB body minutes. Such
// documents are refused by their size before gqlgen validates anything.
func TestRepeatedFieldsRefusedBeforeValidation(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	b.product(t, "1.00", 1)
	// Thirty fragments of eight fields: 241 fields, few tokens each.
	var many strings.Builder
	many.WriteString("{ products { ")
	for i := range 30 {
		fmt.Fprintf(&many, "...F%d ", i)
	}
	many.WriteString("} }")
	for i := range 30 {
		fmt.Fprintf(&many, " fragment F%d on Product { id name price description active maxPerOrder stock createdAt }", i)
	}
	for _, probe := range []struct{ name, query string }{
		{"16,000 copies (48 KB)", "{ products { " + strings.Repeat("id ", 16_000) + "} }"},
		{"216,000 copies (650 KB)", "{ products { " + strings.Repeat("id ", 216_000) + "} }"},
		{"11 copies of one field", "{ products { " + strings.Repeat("id ", 11) + "} }"},
		{"241 fields", many.String()},
		{"31 aliases", "{ " + aliases(31, "products { id }") + " }"},
	} {
		before := graph.WorkOf(b.handler)
		b.do(t, anon, probe.query, nil).wantCode(t, "QUERY_TOO_LARGE")
		after := graph.WorkOf(b.handler)
		if after.Validated != before.Validated || after.Priced != before.Priced {
			t.Errorf("%s: validated %d and priced %d fields, want neither", probe.name, after.Validated-before.Validated, after.Priced-before.Priced)
		}
	}
	// Within the limits, a repeated field is still served.
	var got struct{ Products []struct{ ID string } }
	b.do(t, anon, "{ products { "+strings.Repeat("id ", 10)+"} }", nil).decode(t, &got)
	if len(got.Products) != 1 {
		t.Fatalf("products %+v", got.Products)
	}
}

func aliases(n int, field string) string {
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, "a%d: %s ", i, field)
	}
	return b.String()
}

// TestNoWorkForAClientThatLeft: a request whose client has gone is neither
// validated nor executed.
func TestNoWorkForAClientThatLeft(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	b.product(t, "1.00", 1)
	before, selects := graph.WorkOf(b.handler), b.queries.selects.Load()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	req := httptest.NewRequestWithContext(ctx, http.MethodPost, "/graphql", strings.NewReader(body(`{ products { id name stock } }`, nil)))
	req.Header.Set("Content-Type", appJSON)
	b.handler.ServeHTTP(httptest.NewRecorder(), req)
	after := graph.WorkOf(b.handler)
	if after.Validated != before.Validated || after.Parsed != before.Parsed || b.queries.selects.Load() != selects {
		t.Errorf("for a client that left: parsed %d, validated %d, %d SELECTs", after.Parsed-before.Parsed,
			after.Validated-before.Validated, b.queries.selects.Load()-selects)
	}
}

// TestIntrospectionAmplification: 1,000 aliased __schema selections
// (109 KB) answered 17 MB and took ~380 MB. Now introspection counts
// towards the price and the depth, an operation introspects once, the
// alias and token limits refuse the document before anything runs, and a
// response has a size cap.
func TestIntrospectionAmplification(t *testing.T) {
	// Not parallel: it measures the process's allocations.
	b := setup(t, options{})
	probe := "{ " + aliases(1000, "__schema { types { name fields { name type { name } } } }") + "}"
	before := graph.WorkOf(b.handler)
	var m0, m1 runtime.MemStats
	runtime.ReadMemStats(&m0)
	resp := httptest.NewRecorder()
	req := httptest.NewRequest(http.MethodPost, "/graphql", strings.NewReader(body(probe, nil)))
	req.Header.Set("Content-Type", appJSON)
	b.handler.ServeHTTP(resp, req)
	runtime.ReadMemStats(&m1)
	if !bytes.Contains(resp.Body.Bytes(), []byte("QUERY_TOO_LARGE")) || resp.Body.Len() > 1024 {
		t.Fatalf("1,000 __schema: %d bytes %.300s", resp.Body.Len(), resp.Body.Bytes())
	}
	if after := graph.WorkOf(b.handler); after.Validated != before.Validated {
		t.Errorf("the probe was validated")
	}
	if alloc := m1.TotalAlloc - m0.TotalAlloc; alloc > 8<<20 {
		t.Errorf("the probe allocated %d bytes, want under 8 MiB", alloc)
	}

	// Two introspection roots in one operation, even within the limits.
	for _, q := range []string{
		`{ a: __schema { queryType { name } } b: __schema { queryType { name } } }`,
		`{ __schema { queryType { name } } __type(name: "Order") { name } }`,
		`{ ...A ...B } fragment A on Query { __schema { queryType { name } } } fragment B on Query { __type(name: "Order") { name } }`,
	} {
		b.do(t, anon, q, nil).wantCode(t, "GRAPHQL_VALIDATION_FAILED")
	}
	// Introspection is priced: the full query is over a limit of 100, and
	// nests deeper than an ordinary query may.
	small := setup(t, options{mod: func(c *graph.Config) { c.MaxComplexity = 100 }})
	small.do(t, anon, introspection.Query, nil).wantCode(t, "COMPLEXITY_LIMIT_EXCEEDED")
	deep := `{ __type(name: "Order") { fields { type ` + strings.Repeat("{ ofType ", 14) + "{ name }" + strings.Repeat(" }", 14) + ` } } }`
	b.do(t, anon, deep, nil).wantCode(t, "DEPTH_LIMIT_EXCEEDED")

	// A response over the cap is not sent.
	capped := setup(t, options{mod: func(c *graph.Config) { c.MaxResponseBytes = 2000 }})
	resp = httptest.NewRecorder()
	req = httptest.NewRequest(http.MethodPost, "/graphql", strings.NewReader(body(introspection.Query, nil)))
	req.Header.Set("Content-Type", appJSON)
	capped.handler.ServeHTTP(resp, req)
	if !bytes.Contains(resp.Body.Bytes(), []byte("RESPONSE_TOO_LARGE")) || resp.Body.Len() > 2000 {
		t.Fatalf("over the response cap: %d bytes %.200s", resp.Body.Len(), resp.Body.Bytes())
	}
}

// TestIntrospectionOff: with introspection off, __schema and __type are
// refused; __typename, which clients add by themselves, still works.
func TestIntrospectionOff(t *testing.T) {
	t.Parallel()
	b := setup(t, options{mod: func(c *graph.Config) { c.DisableIntrospection = true }})
	b.product(t, "1.00", 1)
	b.do(t, anon, `{ __schema { queryType { name } } }`, nil).wantCode(t, "GRAPHQL_VALIDATION_FAILED")
	b.do(t, anon, `{ __type(name: "Order") { name } }`, nil).wantCode(t, "GRAPHQL_VALIDATION_FAILED")
	var got struct {
		Products []struct {
			Typename string `json:"__typename"`
		}
	}
	b.do(t, anon, `{ products { __typename } }`, nil).decode(t, &got)
	if len(got.Products) != 1 || got.Products[0].Typename != "Product" {
		t.Fatalf("__typename: %+v", got)
	}
}

// TestOneCreateOrderPerRequest: several createOrder in one mutation are
// refused before any runs (one refused alias nulled the whole data, and
// the placed orders' tokens were lost with their cards still locked).
func TestOneCreateOrderPerRequest(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	id := b.product(t, "1.00", 5)
	in := func(contact string) string {
		return fmt.Sprintf(`createOrder(input: {productId: %q, quantity: 1, contact: %q, provider: "sandbox"}) { accessToken }`, id, contact)
	}
	for _, q := range []string{
		`mutation { a: ` + in("a@example.com") + ` b: ` + in("b@example.com") + ` }`,
		`mutation { ...M } fragment M on Mutation { a: ` + in("a@example.com") + ` b: ` + in("b@example.com") + ` }`,
	} {
		b.do(t, anon, q, nil).wantCode(t, "GRAPHQL_VALIDATION_FAILED")
	}
	if n, _ := b.db.NewSelect().Table("orders").Count(b.ctx); n != 0 {
		t.Fatalf("%d orders placed by refused requests", n)
	}
	var one struct{ A struct{ AccessToken string } }
	b.do(t, anon, `mutation { a: `+in("a@example.com")+` }`, nil).decode(t, &one)
	if one.A.AccessToken == "" {
		t.Fatal("one createOrder: no token")
	}
}

// errorLogs counts the error-level lines written through it.
type errorLogs struct{ n atomic.Int64 }

func (e *errorLogs) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelError }
func (e *errorLogs) Handle(context.Context, slog.Record) error    { e.n.Add(1); return nil }
func (e *errorLogs) WithAttrs([]slog.Attr) slog.Handler           { return e }
func (e *errorLogs) WithGroup(string) slog.Handler                { return e }

// TestBadScalarIsBadInput: a malformed scalar in an argument is the
// caller's mistake: BAD_INPUT, and nothing logged as an error.
func TestBadScalarIsBadInput(t *testing.T) {
	t.Parallel()
	logs := &errorLogs{}
	b := setup(t, options{mod: func(c *graph.Config) { c.Logger = slog.New(logs) }})
	for _, q := range []string{
		`{ orders(filter: {createdFrom: "yesterday"}) { edges { cursor } } }`,
		`query($t: Time) { orders(filter: {createdBefore: $t}) { edges { cursor } } }`,
	} {
		r := b.do(t, admin, q, map[string]any{"t": "soon"})
		if len(r.Errors) == 0 || r.Errors[0].Extensions.Code != domain.EBADINPUT {
			t.Errorf("%s: %+v, want BAD_INPUT", q, r.Errors)
		}
	}
	if n := logs.n.Load(); n != 0 {
		t.Errorf("%d error logs for bad input", n)
	}
}

// TestOperationNamesAreBounded: metrics hear an operation's name only when
// kami knows it; 500 made-up names are one label value.
func TestOperationNamesAreBounded(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	seen := map[string]bool{}
	b := setup(t, options{mod: func(c *graph.Config) {
		c.OnOperation = func(op, _ string) { mu.Lock(); seen[op] = true; mu.Unlock() }
	}})
	for i := range 500 {
		b.do(t, anon, fmt.Sprintf(`query Probe%d { products { id } }`, i), nil)
	}
	b.do(t, anon, `query Products { products { id } }`, nil)
	b.do(t, anon, `query products { products { id } }`, nil)
	b.do(t, anon, `{ products { id } }`, nil)
	mu.Lock()
	defer mu.Unlock()
	want := map[string]bool{"other": true, "Products": true, "products": true, "anonymous": true}
	if len(seen) != len(want) {
		t.Fatalf("operation labels %v, want %v", seen, want)
	}
	for k := range want {
		if !seen[k] {
			t.Errorf("operation labels %v, want %v", seen, want)
		}
	}
}

// TestLongDocumentsAreNotKept: documents are kept parsed to spare their
// validation, but only short ones, with their prices: a hundred distinct
// 200 KB documents leave the memory where it was.
func TestLongDocumentsAreNotKept(t *testing.T) {
	// Not parallel: it measures the process's heap.
	b := setup(t, options{})
	heap := func() uint64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	before := heap()
	for i := range 100 {
		name := fmt.Sprintf("T%03d%s", i, strings.Repeat("x", 200_000))
		if r := b.do(t, anon, `{ __type(name: "`+name+`") { name } }`, nil); len(r.Errors) > 0 {
			t.Fatalf("document %d: %+v", i, r.Errors)
		}

	}
	grown := int64(heap()) - int64(before)
	runtime.KeepAlive(b.handler) // its caches are what is measured
	if grown > 8<<20 {
		t.Fatalf("the heap grew by %d bytes after 100 documents of 200 KB", grown)
	}
}

// TestOverlongOrderNumberIsBadInput: a 10 KB "order number" was looked up
// in the database, and its NOT_FOUND echoed all 10 KB back. No order has a
// number longer than the column, so every operation that takes one answers
// BAD_INPUT without a statement, without echoing it.
func TestOverlongOrderNumberIsBadInput(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	long := strings.Repeat("9", 10_000)
	vars := map[string]any{"no": long}
	for _, c := range []struct {
		who   as
		query string
	}{
		{anon, `query($no: String!) { order(orderNo: $no, accessToken: "x") { status } }`},
		{admin, `query($no: String!) { order(orderNo: $no) { status } }`},
		{anon, `mutation($no: String!) { cancelOrder(orderNo: $no, accessToken: "x") { status } }`},
		{admin, `mutation($no: String!) { refundOrder(orderNo: $no) { refundNo } }`},
		{admin, `mutation($no: String!) { syncOrder(orderNo: $no) { order { status } } }`},
		{admin, `query($no: String) { reveals(orderNo: $no) { edges { node { channel } } } }`},
	} {
		before := b.queries.all.Load()
		e := b.do(t, c.who, c.query, vars).wantCode(t, domain.EBADINPUT)
		if n := b.queries.all.Load() - before; n != 0 {
			t.Errorf("%s: %d statements ran, want none", c.query, n)
		}
		if len(e.Message) > 200 {
			t.Errorf("%s: a message of %d bytes echoes the number", c.query, len(e.Message))
		}
	}
}

// stallingHook holds the statements run while stall is set until their
// context ends, and says when one is held.
type stallingHook struct {
	stall atomic.Bool
	held  chan struct{}
}

func (h *stallingHook) BeforeQuery(ctx context.Context, _ *bun.QueryEvent) context.Context {
	if h.stall.Load() {
		h.held <- struct{}{}
		<-ctx.Done()
	}
	return ctx
}

func (h *stallingHook) AfterQuery(context.Context, *bun.QueryEvent) {}

// TestClientGoneIsNoError: a client that left while its query ran (a
// closed connection, a closed WebSocket) made the query fail with "context
// canceled", which the presenter logged as an internal error: anyone could
// fill the error log, and the alerts fed from it, by hanging up. The
// presenter now sees that the request's own context ended: nothing is
// logged as an error.
func TestClientGoneIsNoError(t *testing.T) {
	t.Parallel()
	logs := &errorLogs{}
	hook := &stallingHook{held: make(chan struct{}, 1)}
	b := setup(t, options{hook: hook, mod: func(c *graph.Config) { c.Logger = slog.New(logs) }})
	served := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer close(served)
		b.handler.ServeHTTP(w, r)
	}))
	defer srv.Close()

	hook.stall.Store(true)
	ctx, cancel := context.WithCancel(b.ctx)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, strings.NewReader(`{"query":"{ products { id } }"}`))
	req.Header.Set("Content-Type", "application/json")
	go func() {
		<-hook.held
		hook.stall.Store(false)
		cancel() // the client hangs up while its query runs
	}()
	if res, err := http.DefaultClient.Do(req); err == nil {
		res.Body.Close()
		t.Fatal("the request was answered")
	}
	<-served
	if n := logs.n.Load(); n != 0 {
		t.Errorf("%d error logs for a client that hung up", n)
	}
}
