// Package graph is kami's GraphQL API: the schema (schema.graphqls), the
// resolvers that convert and call package domain, and the HTTP and
// WebSocket handler that serves them.
//
// HTTP follows the GraphQL-over-HTTP spec: POST with application/json and
// GET for queries; the answer is application/graphql-response+json when the
// client accepts it (request errors then get 400) and application/json
// otherwise (200 for every well-formed request). Every error carries
// extensions.code; see present for what a client may see.
package graph

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/99designs/gqlgen/graphql"
	"github.com/99designs/gqlgen/graphql/handler"
	"github.com/99designs/gqlgen/graphql/handler/extension"
	"github.com/99designs/gqlgen/graphql/handler/transport"
	coderws "github.com/coder/websocket"
	"github.com/vektah/gqlparser/v2/ast"
	"github.com/vektah/gqlparser/v2/validator/rules"

	"kami/domain"
	"kami/graph/generated"
	"kami/graph/model"
)

// OrderEvents streams one order's status changes (queue.Events in the
// server: Redis pub/sub, so a change made in any server process arrives).
type OrderEvents interface {
	// Subscribe streams news of orderNo's status until ctx ends or the
	// returned func is called; the channel is closed then, and only then.
	// News is the new status, or the status the order has after the stream
	// was interrupted (caught up from the database), or "" for "read it
	// again".
	Subscribe(ctx context.Context, orderNo string) (<-chan domain.OrderStatus, func())
}

// QueueHealth is one delay queue's health.
type QueueHealth struct {
	Name          string
	Backlog       int64
	OldestOverdue time.Duration // 0 when nothing is overdue
}

// Health is what the stats query reports besides stock.
type Health struct {
	Queues []QueueHealth
	// CloseSuccessRate and RefundFailureRate are shares in [0, 1]; nil
	// when there is nothing to measure yet.
	CloseSuccessRate  *float64
	RefundFailureRate *float64
}

// StatsSource reports the health figures of the queues and workers.
type StatsSource interface {
	Health(ctx context.Context) (Health, error)
}

// Config is what the handler needs. Shop, Ledger and AdminToken are
// required; the rest have defaults.
type Config struct {
	Shop   *domain.Shop
	Ledger *domain.Ledger
	// Events feeds orderStatusChanged; nil: the subscription sends the
	// current status and then only ends when the client leaves.
	Events OrderEvents
	// Stats feeds the queue and rate figures of the stats query; nil:
	// those are empty.
	Stats StatsSource
	// Reconciler and Statements run the nightly reconciliation and the
	// statement reconciliation for runReconciliation and
	// reconcileStatements; nil: those answer UNAVAILABLE.
	Reconciler *domain.Reconciler
	Statements *domain.StatementReconciler
	// Webhooks manages the outgoing webhooks; nil: their fields answer
	// UNAVAILABLE.
	Webhooks *domain.Webhooks
	// AdminToken is KAMI_ADMIN_TOKEN; an empty token admits nobody.
	AdminToken string
	Logger     *slog.Logger

	MaxBodyBytes int64 // request body limit, and WebSocket message limit; default 1 MiB (413 above it)
	// MaxUploadBytes is the body limit of a file upload (importCardFile,
	// multipart); default 32 MiB (413 above it).
	MaxUploadBytes int64
	MaxDepth       int // query depth limit; default 10 (15 under __schema and __type)
	MaxComplexity  int // query complexity limit, introspection included; default 1000
	// MaxTokens, MaxFields and MaxAliases bound a document before it is
	// validated (see documentLimits); defaults 2000, 200 and 30.
	MaxTokens, MaxFields, MaxAliases int
	// MaxResponseBytes caps one response over HTTP; default 4 MiB.
	MaxResponseBytes int
	// DisableIntrospection refuses __schema and __type (the playground
	// then has no schema to show); __typename always works.
	DisableIntrospection bool
	// MaxSubscriptionsPerConnection caps the operations one WebSocket
	// starts over its life (every subscribe message, also one that fails
	// or has completed; see operationCap), MaxConnectionsPerAddress the
	// WebSockets one client address (domain.AddressKey) holds open; 0: no
	// cap.
	MaxSubscriptionsPerConnection, MaxConnectionsPerAddress int
	// KeepAlive is the WebSocket keep-alive interval; default 10s.
	KeepAlive time.Duration
	// AllowedOrigins are the host patterns whose pages may open a
	// WebSocket (coder/websocket's OriginPatterns); default same origin
	// only. Browsers cannot forge Origin, so this is the WebSocket's CSRF
	// guard.
	AllowedOrigins []string
	// ClientAddr returns the buyer's address: for the per-address caps and
	// as the payer's IP sent to the gateways. Default: the host of the
	// request's RemoteAddr. Behind a reverse proxy, use
	// TrustedProxies.ClientAddr; X-Forwarded-For is not trusted by default
	// since any client can send it.
	ClientAddr func(r *http.Request) string
	// OnOperation, if set, hears every executed query and mutation (and
	// each subscription as it starts) with its operation name and the
	// extensions.code of its first error ("" when none), for metrics. The
	// name is one of the schema's root fields, as it is or capitalized
	// ("order", "Order", "CreateOrder"), or IntrospectionQuery;
	// "anonymous" when it has none and "other" for any other, so that
	// clients cannot make up label values.
	OnOperation func(operation, code string)
}

func (c Config) withDefaults() Config {
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.MaxBodyBytes <= 0 {
		c.MaxBodyBytes = 1 << 20
	}
	if c.MaxUploadBytes <= 0 {
		c.MaxUploadBytes = DefaultMaxUploadBytes
	}
	if c.MaxDepth <= 0 {
		c.MaxDepth = 10
	}
	if c.MaxComplexity <= 0 {
		c.MaxComplexity = 1000
	}
	if c.MaxTokens <= 0 {
		c.MaxTokens = defaultMaxTokens
	}
	if c.MaxFields <= 0 {
		c.MaxFields = defaultMaxFields
	}
	if c.MaxAliases <= 0 {
		c.MaxAliases = defaultMaxAliases
	}
	if c.MaxResponseBytes <= 0 {
		c.MaxResponseBytes = 4 << 20
	}
	if c.KeepAlive <= 0 {
		c.KeepAlive = 10 * time.Second
	}
	if c.ClientAddr == nil {
		c.ClientAddr = RemoteHost
	}
	return c
}

// DefaultMaxUploadBytes is KAMI_MAX_UPLOAD_BYTES's default: room for about
// 1.5 million codes of 20 characters.
const DefaultMaxUploadBytes = 32 << 20

// RemoteHost is the host part of r.RemoteAddr.
func RemoteHost(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return r.RemoteAddr
	}
	return host
}

// NewHandler serves GraphQL at one path: POST and GET requests, and the
// WebSocket upgrade for subscriptions (graphql-transport-ws and the older
// graphql-ws).
func NewHandler(cfg Config) http.Handler {
	cfg = cfg.withDefaults()
	w := &work{}
	es := countedSchema{ExecutableSchema: generated.NewExecutableSchema(newSchemaConfig(cfg)), asked: &w.priced}
	srv := handler.New(es)
	srv.AddTransport(transport.Websocket{
		Implementation: operationCap{
			WebsocketImplementation: transport.CoderWebsocketImplementation{
				AcceptOptions: coderws.AcceptOptions{OriginPatterns: cfg.AllowedOrigins},
			},
			max: cfg.MaxSubscriptionsPerConnection,
		},
		KeepAlivePingInterval: cfg.KeepAlive,
		InitTimeout:           10 * time.Second,
		InitFunc:              wsInit(cfg.AdminToken),
		PayloadReadLimit:      &cfg.MaxBodyBytes,
		ErrorFunc: func(ctx context.Context, err error) {
			cfg.Logger.DebugContext(ctx, "graphql websocket closed", "err", err)
		},
	})
	srv.AddTransport(getTransport{maxResponse: cfg.MaxResponseBytes})
	srv.AddTransport(uploadTransport{maxUpload: cfg.MaxUploadBytes, maxParts: cfg.MaxBodyBytes, maxResponse: cfg.MaxResponseBytes})
	srv.AddTransport(postTransport{maxResponse: cfg.MaxResponseBytes, texts: &queryTexts{}})
	cache := newQueryCache()
	srv.SetQueryCache(cache)
	srv.SetParserTokenLimit(cfg.MaxTokens)
	// Before documentLimits: the text a hash stands for is limited as if
	// it had been sent.
	srv.Use(persistedQueries{extension.AutomaticPersistedQuery{Cache: newPersistedTexts()}})
	srv.SetValidationRulesFn(func() *rules.Rules {
		w.validated.Add(1)
		return rules.NewDefaultRules()
	})
	srv.Use(documentLimits{maxTokens: cfg.MaxTokens, maxFields: cfg.MaxFields, maxAliases: cfg.MaxAliases, cache: cache, work: w})
	if !cfg.DisableIntrospection {
		srv.Use(extension.Introspection{})
	}
	srv.Use(newOperationLimits(cfg.MaxComplexity, cfg.MaxDepth, !cfg.DisableIntrospection, w))
	srv.AroundFields(refuseUnstorableText)
	srv.SetErrorPresenter(presenter(cfg.Logger))
	srv.SetRecoverFunc(recoverer(cfg.Logger))
	known := knownOperations(es.Schema())
	// Loaders are made per response: one per query or mutation, one per
	// subscription event, so a long-lived subscription never reads a
	// stale cache. The card codes a response reveals are recorded before
	// it leaves (reveals.go).
	srv.AroundResponses(func(ctx context.Context, next graphql.ResponseHandler) *graphql.Response {
		ctx = withResponse(ctx, cfg.Ledger)
		resp := recordReveals(ctx, cfg.Ledger, cfg.Logger, next(ctx))
		if cfg.OnOperation != nil && graphql.HasOperationContext(ctx) {
			observeOperation(ctx, resp, known, cfg.OnOperation)
		}
		return resp
	})
	if cfg.OnOperation != nil {
		srv.AroundOperations(func(ctx context.Context, next graphql.OperationHandler) graphql.ResponseHandler {
			if oc := graphql.GetOperationContext(ctx); oc.Operation != nil && oc.Operation.Operation == ast.Subscription {
				cfg.OnOperation(operationName(oc, known), "")
			}
			return next(ctx)
		})
	}
	return &httpHandler{cfg: cfg, srv: srv, work: w, sockets: newAddrCount(cfg.MaxConnectionsPerAddress)}
}

// httpHandler puts the caller's identity on the request and applies the
// limits that must hold before gqlgen reads anything.
type httpHandler struct {
	cfg     Config
	srv     *handler.Server
	work    *work
	sockets *addrCount // open WebSockets by client address
}

func (h *httpHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	upgrade := r.Header.Get("Upgrade") != ""
	if !upgrade && r.Method != http.MethodGet && r.Method != http.MethodPost {
		w.Header().Set("Allow", "GET, POST")
		writeError(w, r, http.StatusMethodNotAllowed, codeBadRequest, "use GET or POST")
		return
	}
	rolling, _ := r.Body.(RollingBody) // before it is wrapped
	if r.Body != nil {
		limit := h.cfg.MaxBodyBytes
		if isUpload(r) {
			limit = h.cfg.MaxUploadBytes
		}
		r.Body = http.MaxBytesReader(w, r.Body, limit)
	}
	addr := h.cfg.ClientAddr(r)
	if upgrade {
		release, ok := h.sockets.acquire(domain.AddressKey(addr))
		if !ok {
			writeError(w, r, http.StatusTooManyRequests, domain.ELIMIT,
				fmt.Sprintf("this address has %d subscription connections open; close one first", h.cfg.MaxConnectionsPerAddress))
			return
		}
		defer release() // the WebSocket transport returns when the connection ends
	}
	ctx := withCaller(r.Context(), caller{viewer: viewerFrom(r.Header.Get("Authorization"), h.cfg.AdminToken), addr: addr, body: rolling})
	h.srv.ServeHTTP(w, r.WithContext(ctx))
}

// newSchemaConfig wires the resolvers and the complexity of the lists: a
// connection costs its page size times what each node selects.
func newSchemaConfig(cfg Config) generated.Config {
	c := generated.Config{Resolvers: &Resolver{cfg: cfg}}
	page := func(first *int) int {
		if first == nil || *first < 1 {
			return 1
		}
		return min(*first, domain.MaxPageSize)
	}
	c.Complexity.Query.Orders = func(child int, _ *model.OrderFilter, first *int, _ *string) int {
		return 1 + page(first)*child
	}
	c.Complexity.Query.Cards = func(child int, _ *int64, _ *int64, _ *domain.CardStatus, first *int, _ *string) int {
		return 1 + page(first)*child
	}
	c.Complexity.Query.Batches = func(child int, _ *int64, first *int, _ *string) int {
		return 1 + page(first)*child
	}
	c.Complexity.Query.Reveals = func(child int, _ *string, _ *int64, first *int, _ *string) int {
		return 1 + page(first)*child
	}
	c.Complexity.Batch.Orders = func(child int, first *int, _ *string) int {
		return 1 + page(first)*child
	}
	c.Complexity.Query.Refunds = func(child int, _ *domain.RefundStatus, first *int, _ *string) int {
		return 1 + page(first)*child
	}
	c.Complexity.Query.StatementRuns = func(child int, _ *string, first *int, _ *string) int {
		return 1 + page(first)*child
	}
	c.Complexity.Query.StatementDifferences = func(child int, _ *int64, _ *bool, first *int, _ *string) int {
		return 1 + page(first)*child
	}
	return c
}

// observeOperation reports a query's or mutation's response to
// OnOperation; subscriptions are reported once, when they start (see
// NewHandler), not once per event.
func observeOperation(ctx context.Context, resp *graphql.Response, known map[string]bool, on func(operation, code string)) {
	oc := graphql.GetOperationContext(ctx)
	if oc.Operation != nil && oc.Operation.Operation == ast.Subscription {
		return
	}
	code := ""
	if resp != nil && len(resp.Errors) > 0 {
		if c, ok := resp.Errors[0].Extensions["code"].(string); ok {
			code = c
		} else {
			code = "INTERNAL"
		}
	}
	on(operationName(oc, known), code)
}

// operationName is the operation's name if it is a known one, "anonymous"
// without a name and "other" otherwise.
func operationName(oc *graphql.OperationContext, known map[string]bool) string {
	name := oc.OperationName
	if name == "" && oc.Operation != nil {
		name = oc.Operation.Name
	}
	switch {
	case name == "":
		return "anonymous"
	case known[name]:
		return name
	}
	return "other"
}

// knownOperations are the operation names metrics keep: the root fields
// of the schema as they are and capitalized (an operation is usually named
// after the field it asks for), and the playground's IntrospectionQuery.
func knownOperations(s *ast.Schema) map[string]bool {
	known := map[string]bool{"IntrospectionQuery": true}
	for _, root := range []*ast.Definition{s.Query, s.Mutation, s.Subscription} {
		if root == nil {
			continue
		}
		for _, f := range root.Fields {
			if strings.HasPrefix(f.Name, "__") {
				continue
			}
			known[f.Name] = true
			known[strings.ToUpper(f.Name[:1])+f.Name[1:]] = true
		}
	}
	return known
}
