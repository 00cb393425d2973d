package graph_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/99designs/gqlgen/client"
	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/domain/domaintest"
	"kami/graph"
	"kami/providers"
	"kami/providers/sandbox"
)

const (
	adminToken    = "admin-token-for-tests"
	sandboxSecret = "sandbox-secret-for-tests"
)

var cardKey = domaintest.Key()

// memEvents is an in-process event stream: domain.Events for the shop and
// graph.OrderEvents for the subscriptions.
type memEvents struct {
	mu   sync.Mutex
	subs map[string]map[chan domain.OrderStatus]bool
	// live counts open subscriptions, so tests can wait for one.
	live atomic.Int64
}

func newMemEvents() *memEvents {
	return &memEvents{subs: map[string]map[chan domain.OrderStatus]bool{}}
}

func (e *memEvents) OrderChanged(_ context.Context, orderNo string, status domain.OrderStatus) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for ch := range e.subs[orderNo] {
		select {
		case ch <- status:
		default: // a slow subscriber rereads the order on its next event
		}
	}
}

func (e *memEvents) Subscribe(ctx context.Context, orderNo string) (<-chan domain.OrderStatus, func()) {
	ch := make(chan domain.OrderStatus, 16)
	e.mu.Lock()
	if e.subs[orderNo] == nil {
		e.subs[orderNo] = map[chan domain.OrderStatus]bool{}
	}
	e.subs[orderNo][ch] = true
	e.mu.Unlock()
	e.live.Add(1)
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		<-ctx.Done()
		e.mu.Lock()
		delete(e.subs[orderNo], ch)
		close(ch)
		e.mu.Unlock()
		e.live.Add(-1)
	}()
	return ch, func() { cancel(); <-done }
}

// queryCounter counts the statements a database runs, and the SELECTs
// among them.
type queryCounter struct{ all, selects atomic.Int64 }

func (q *queryCounter) BeforeQuery(ctx context.Context, _ *bun.QueryEvent) context.Context {
	return ctx
}
func (q *queryCounter) AfterQuery(_ context.Context, ev *bun.QueryEvent) {
	q.all.Add(1)
	if strings.HasPrefix(strings.TrimSpace(strings.ToUpper(ev.Query)), "SELECT") {
		q.selects.Add(1)
	}
}

// bundle is what an API test needs.
type bundle struct {
	ctx     context.Context
	db      *bun.DB
	ledger  *domain.Ledger
	shop    *domain.Shop
	sandbox *sandbox.Provider
	events  *memEvents
	queries *queryCounter
	handler http.Handler
	client  *client.Client
}

type options struct {
	kind   dbtest.Kind
	ledger domain.Config
	events graph.OrderEvents // default the bundle's memEvents
	stats  graph.StatsSource
	mod    func(*graph.Config)
	hook   bun.QueryHook // another hook on the database, beside the counter
}

func setup(t testing.TB, opts options) *bundle {
	t.Helper()
	if opts.kind == "" {
		opts.kind = dbtest.SQLite
	}
	b := &bundle{ctx: context.Background(), db: dbtest.Open(t, opts.kind), events: newMemEvents(), queries: &queryCounter{}}
	b.db = b.db.WithQueryHook(b.queries)
	if opts.hook != nil {
		b.db = b.db.WithQueryHook(opts.hook)
	}
	sealer, err := domain.NewSealer(cardKey)
	if err != nil {
		t.Fatal(err)
	}
	b.ledger = domain.NewLedger(b.db, sealer, opts.ledger, domain.LogAlerter{Logger: quietLogger()})
	b.sandbox, err = sandbox.New(sandbox.Config{Secret: sandboxSecret, BaseURL: "http://shop.test"})
	if err != nil {
		t.Fatal(err)
	}
	b.shop = &domain.Shop{Ledger: b.ledger, Events: b.events, Providers: providers.NewRegistry(b.sandbox), Log: quietLogger()}
	var events graph.OrderEvents = b.events
	if opts.events != nil {
		events = opts.events
	}
	cfg := graph.Config{Shop: b.shop, Ledger: b.ledger, Events: events, Stats: opts.stats, AdminToken: adminToken,
		Logger: quietLogger(), KeepAlive: 50 * time.Millisecond}
	if opts.mod != nil {
		opts.mod(&cfg)
	}
	b.handler = graph.NewHandler(cfg)
	b.client = client.New(b.handler)
	return b
}

func quietLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(discard{}, &slog.HandlerOptions{Level: slog.LevelError + 1}))
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

// gqlError is one error of a response.
type gqlError struct {
	Message    string `json:"message"`
	Path       []any  `json:"path"`
	Extensions struct {
		Code string `json:"code"`
	} `json:"extensions"`
}

// result is a decoded response.
type result struct {
	Data   json.RawMessage
	Errors []gqlError
}

// decode unpacks the data into v, failing on errors.
func (r result) decode(t testing.TB, v any) {
	t.Helper()
	if len(r.Errors) > 0 {
		t.Fatalf("unexpected errors: %+v", r.Errors)
	}
	if err := json.Unmarshal(r.Data, v); err != nil {
		t.Fatalf("decode %s: %v", r.Data, err)
	}
}

// wantCode checks the response failed with exactly one error of code.
func (r result) wantCode(t testing.TB, code string) gqlError {
	t.Helper()
	if len(r.Errors) != 1 || r.Errors[0].Extensions.Code != code {
		t.Fatalf("errors %+v (data %s), want one %s", r.Errors, r.Data, code)
	}
	return r.Errors[0]
}

// as is who sends a request.
type as string

const (
	anon  as = ""
	admin as = "Bearer " + adminToken
)

// do runs a query through gqlgen's client against the real handler.
func (b *bundle) do(t testing.TB, who as, query string, vars map[string]any) result {
	t.Helper()
	opts := []client.Option{}
	if who != anon {
		opts = append(opts, client.AddHeader("Authorization", string(who)))
	}
	for k, v := range vars {
		opts = append(opts, client.Var(k, v))
	}
	resp, err := b.client.RawPost(query, opts...)
	if err != nil {
		t.Fatalf("post: %v", err)
	}
	var r result
	if resp.Data != nil {
		r.Data, _ = json.Marshal(resp.Data)
	}
	if resp.Errors != nil {
		if err := json.Unmarshal(resp.Errors, &r.Errors); err != nil {
			t.Fatalf("errors %s: %v", resp.Errors, err)
		}
	}
	return r
}

// product creates a product with n codes through the API.
func (b *bundle) product(t testing.TB, price string, n int) string {
	t.Helper()
	var created struct {
		CreateProduct struct{ ID string }
	}
	b.do(t, admin, `mutation($in: CreateProductInput!) { createProduct(input: $in) { id } }`,
		map[string]any{"in": map[string]any{"name": "Game key", "price": price}}).decode(t, &created)
	if n > 0 {
		codes := make([]string, n)
		for i := range codes {
			codes[i] = codeOf(created.CreateProduct.ID, i)
		}
		var imported struct {
			ImportCards struct{ Imported, Duplicates int }
		}
		b.do(t, admin, `mutation($p: ID!, $c: [String!]!) { importCards(productId: $p, codes: $c) { imported duplicates } }`,
			map[string]any{"p": created.CreateProduct.ID, "c": codes}).decode(t, &imported)
		if imported.ImportCards.Imported != n {
			t.Fatalf("imported %+v, want %d", imported, n)
		}
	}
	return created.CreateProduct.ID
}

func codeOf(productID string, i int) string { return fmt.Sprintf("CODE-%s-%03d", productID, i) }

// placed is a createOrder answer.
type placed struct {
	Order struct {
		OrderNo string
		Status  string
		Amount  string
	}
	AccessToken string
	Payment     struct {
		Kind      string
		URL       string
		QRCode    json.RawMessage // null and "" differ
		ExpiresAt string
	}
}

func (b *bundle) order(t testing.TB, productID string, qty int, contact string) placed {
	t.Helper()
	var out struct{ CreateOrder placed }
	b.do(t, anon, createOrder, map[string]any{"in": map[string]any{
		"productId": productID, "quantity": qty, "contact": contact, "provider": "sandbox"}}).decode(t, &out)
	return out.CreateOrder
}

const createOrder = `mutation($in: CreateOrderInput!) { createOrder(input: $in) {
	order { orderNo status amount } accessToken payment { kind url qrCode expiresAt } } }`

// pay delivers a signed sandbox payment notification for the order.
func (b *bundle) pay(t testing.TB, orderNo, tradeNo string) {
	t.Helper()
	o, err := b.ledger.Order(b.ctx, orderNo)
	if err != nil {
		t.Fatal(err)
	}
	h, body := sandbox.Signed(sandboxSecret, sandbox.PaymentNotification(orderNo, tradeNo, o.AmountFen, time.Now()))
	if _, err := b.shop.HandleNotification(b.ctx, sandbox.Name, h, body); err != nil {
		t.Fatalf("payment: %v", err)
	}
}

// eventually waits for a condition; see domaintest.Eventually.
var eventually = domaintest.Eventually

func jsonMarshal(v any) ([]byte, error) { return json.Marshal(v) }

func jsonUnmarshal(t testing.TB, raw []byte, v any) {
	t.Helper()
	if err := json.Unmarshal(raw, v); err != nil {
		t.Fatalf("decode %s: %v", raw, err)
	}
}
