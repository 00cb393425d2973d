// Command kami is the backend of an automatic card-code shop: see
// README.md and ARCHITECTURE.md.
//
//	kami            run the server (the default)
//	kami migrate    apply database migrations and exit
//	kami audit      check the ledger's invariants; exit 1 with one line per violation
//	kami reconcile  run the nightly reconciliation once, now
package main

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"
	"github.com/robfig/cron/v3"
	"github.com/uptrace/bun"

	"kami/domain"
	"kami/graph"
	"kami/graph/playground"
	"kami/migrations"
	"kami/providers"
	"kami/providers/alipay"
	"kami/providers/sandbox"
	"kami/providers/wechat"
	"kami/queue"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	tuneGC(ctx, os.Getenv)
	if err := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "kami:", err)
		os.Exit(1)
	}
}

// errAuditFailed makes `kami audit` exit non-zero after printing violations.
var errAuditFailed = errors.New("the ledger audit found violations")

func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	cmd := "serve"
	if len(args) > 0 {
		cmd = args[0]
	}
	cfg, err := loadConfig(getenv)
	if err != nil {
		return err
	}
	logger := newLogger(cfg, stderr)
	slog.SetDefault(logger)
	queue.RouteRedisLogs(logger)
	switch cmd {
	case "serve":
		return serve(ctx, cfg, logger, stdout)
	case "migrate":
		db, err := openDB(ctx, cfg)
		if err != nil {
			return err
		}
		defer db.Close()
		applied, err := migrations.Migrate(ctx, db)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "applied %d migrations %v\n", len(applied), applied)
		return nil
	case "audit":
		if err := cfg.ensureSecrets(); err != nil {
			return err
		}
		db, err := openMigrated(ctx, cfg, logger)
		if err != nil {
			return err
		}
		defer db.Close()
		ledger, err := newLedger(cfg, db, domain.LogAlerter{Logger: logger})
		if err != nil {
			return err
		}
		vs, err := ledger.Audit(ctx)
		if err != nil {
			return err
		}
		for _, v := range vs {
			fmt.Fprintln(stdout, v)
		}
		if len(vs) > 0 {
			return errAuditFailed
		}
		fmt.Fprintln(stdout, "ledger audit: clean")
		return nil
	case "reconcile":
		return reconcileCommand(ctx, cfg, logger, stdout)
	case "help", "-h", "--help":
		fmt.Fprintln(stdout, "usage: kami [serve|migrate|audit|reconcile]")
		return nil
	default:
		return fmt.Errorf("unknown command %q (want serve, migrate, audit or reconcile)", cmd)
	}
}

// errReconcileNeedsRedis refuses `kami reconcile` on the in-process Redis.
var errReconcileNeedsRedis = errors.New("kami reconcile needs the Redis the server uses, and KAMI_REDIS_URL is unset: " +
	"this command would start an in-process Redis of its own that the running server never sees, so its repairs " +
	"(stock counters, close and refund schedules) would go nowhere. With the embedded defaults the server runs the " +
	"reconciliation itself every night (KAMI_RECONCILE_CRON, 03:30 by default), and an admin runs it now inside the " +
	"server with the GraphQL mutation runReconciliation. To run it from here, set KAMI_REDIS_URL and " +
	"KAMI_DATABASE_URL to what the server uses")

// reconcileCommand is `kami reconcile`: one run now, its summary printed
// once on stdout.
func reconcileCommand(ctx context.Context, cfg *Config, logger *slog.Logger, stdout io.Writer) error {
	if cfg.RedisURL == "" {
		return errReconcileNeedsRedis
	}
	a, err := newApp(ctx, cfg, logger)
	if err != nil {
		return err
	}
	defer a.Close(context.Background())
	a.reconciler.Log = nil // its summary is printed once, on stdout
	run, err := a.reconciler.Run(ctx)
	if errors.Is(err, domain.ErrReconcileRunning) {
		return errors.New("reconcile: another process is running it right now; nothing done")
	}
	if err != nil {
		return fmt.Errorf("reconcile: %w", err)
	}
	fmt.Fprintln(stdout, "reconcile:", run.Summary)
	if run.Error != "" || run.Violations > 0 {
		return fmt.Errorf("reconcile: %s", or(run.Error, "ledger violations found"))
	}
	return nil
}

func newLogger(cfg *Config, w io.Writer) *slog.Logger {
	opts := &slog.HandlerOptions{Level: cfg.LogLevel}
	if cfg.LogFormat == "json" {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

func openDB(ctx context.Context, cfg *Config) (*bun.DB, error) {
	return domain.OpenDB(ctx, cfg.DatabaseURL, cfg.DataDir, domain.DBOptions{MaxOpenConns: cfg.DBMaxConns})
}

func openMigrated(ctx context.Context, cfg *Config, logger *slog.Logger) (*bun.DB, error) {
	db, err := openDB(ctx, cfg)
	if err != nil {
		return nil, err
	}
	applied, err := migrations.Migrate(ctx, db)
	if err != nil {
		db.Close()
		return nil, err
	}
	if len(applied) > 0 {
		logger.Info("migrations applied", "migrations", applied)
	}
	return db, nil
}

func newLedger(cfg *Config, db *bun.DB, alerts domain.Alerter) (*domain.Ledger, error) {
	sealer, err := domain.NewSealer(cfg.CardKey)
	if err != nil {
		return nil, err
	}
	l := domain.NewLedger(db, sealer, domain.Config{
		OrderTTL: cfg.OrderTTL, MaxQuantity: cfg.MaxQuantity, LatePayment: cfg.LatePayment,
		RefundBackoff:        cfg.RefundBackoff,
		MaxPendingPerContact: cfg.MaxPendingPerContact, MaxPendingPerAddress: cfg.MaxPendingPerAddress,
		MaxLockedPerContact: cfg.MaxLockedPerContact, MaxLockedPerAddress: cfg.MaxLockedPerAddress,
		Mail: cfg.Mail != nil,
	}, alerts)
	if skew := cfg.ClockSkew; skew != 0 { // test-only: KAMI_FAULT_CLOCK_SKEW
		l.Now = func() time.Time { return time.Now().Add(skew) }
	}
	return l, nil
}

// newProviders builds the registry from the enabled settings; a bad setting
// stops the start with a message that names it.
func newProviders(cfg *Config) (*providers.Registry, *sandbox.Provider, error) {
	var ps []providers.Provider
	var sb *sandbox.Provider
	if cfg.sandboxEnabled() {
		var err error
		sb, err = sandbox.New(sandbox.Config{Secret: cfg.SandboxSecret, BaseURL: cfg.PublicURL, Timeout: cfg.ProviderTimeout})
		if err != nil {
			return nil, nil, err
		}
		ps = append(ps, sb)
	}
	if cfg.Alipay.enabled() {
		c, err := alipay.New(alipay.Config{AppID: cfg.Alipay.AppID, PrivateKey: cfg.Alipay.PrivateKey,
			AlipayPublicKey: cfg.Alipay.PublicKey, Gateway: cfg.Alipay.Gateway, SellerID: cfg.Alipay.SellerID,
			NotifyURL: cfg.PublicURL + "/webhooks/alipay", ReturnURL: cfg.ReturnURL, Timeout: cfg.ProviderTimeout})
		if err != nil {
			return nil, nil, err
		}
		ps = append(ps, c)
	}
	if cfg.Wechat.enabled() {
		c, err := wechat.New(wechat.Config{AppID: cfg.Wechat.AppID, MchID: cfg.Wechat.MchID, SerialNo: cfg.Wechat.SerialNo,
			PrivateKey: cfg.Wechat.PrivateKey, APIv3Key: cfg.Wechat.APIv3Key, PlatformPublicKey: cfg.Wechat.PlatformPublicKey,
			PlatformPublicKeyID: cfg.Wechat.PlatformPublicKeyID, APIBase: cfg.Wechat.APIBase,
			NotifyURL: cfg.PublicURL + "/webhooks/wechat", Timeout: cfg.ProviderTimeout})
		if err != nil {
			return nil, nil, err
		}
		ps = append(ps, c)
	}
	reg := providers.NewRegistry(ps...)
	if sb != nil && !cfg.sandboxForBuyers() {
		reg.NotForBuyers(sandbox.Name)
	}
	return reg, sb, nil
}

// warnSandbox says loudly at start when buyers can pay with the sandbox,
// that is take codes without paying.
func warnSandbox(cfg *Config, logger *slog.Logger) {
	switch {
	case cfg.sandboxForBuyers() && cfg.realProvider():
		logger.Error("THE SANDBOX GIVES CODES AWAY: buyers can pick the sandbox provider and take card codes without paying, "+
			"because KAMI_SANDBOX_GIVES_CODES_AWAY=1; never set it in a shop that sells", "setting", "KAMI_SANDBOX_GIVES_CODES_AWAY")
	case cfg.sandboxForBuyers():
		logger.Warn("no payment provider is configured, so the built-in sandbox takes the payments: anyone can take card codes " +
			"without paying; right for trying kami out, never for a shop that sells (set KAMI_ALIPAY_* or KAMI_WECHAT_*)")
	case cfg.sandboxEnabled():
		logger.Info("KAMI_SANDBOX_SECRET is set beside real providers: signed sandbox notifications are accepted, " +
			"but buyers cannot pick the sandbox")
	}
}

// warnClockSkew says loudly at start that the ledger's clock is moved by
// the fault campaign's test-only setting: in a shop it would close orders
// early or late and judge every due time wrong.
func warnClockSkew(cfg *Config, logger *slog.Logger) {
	if cfg.ClockSkew == 0 {
		return
	}
	logger.Error("THE LEDGER'S CLOCK IS SKEWED: KAMI_FAULT_CLOCK_SKEW is set, a test-only setting for the fault campaign (chaos/); "+
		"orders are closed and due times judged by a clock that is off; never set it in a shop", "setting", "KAMI_FAULT_CLOCK_SKEW",
		"skew", cfg.ClockSkew.String())
}

// warnEviction warns, at start, of every Redis server that drops keys
// when it is full (queue.Eviction says what that costs kami), and says so
// when it cannot tell. Checked once: a CONFIG SET later is not seen.
func warnEviction(ctx context.Context, rdb redis.UniversalClient, logger *slog.Logger) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	evicting, err := queue.Evictions(ctx, rdb)
	for _, e := range evicting {
		logger.Warn("Redis evicts keys when it is full: kami's close schedules, stock counters, locks and stock "+
			"operation records may be dropped; the database rebuilds them, but closes and orders wait meanwhile "+
			"and a lock may have two holders. Set maxmemory-policy noeviction, or no maxmemory, for kami's Redis",
			"redis", e.Addr, "maxmemory_policy", e.Policy, "maxmemory_bytes", e.MaxMemory)
	}
	if err != nil {
		logger.Info("could not read Redis's maxmemory-policy; kami wants noeviction (or no maxmemory)", "err", err)
	}
}

// app is one kami server process, built from a Config.
type app struct {
	cfg        *Config
	log        *slog.Logger
	db         *bun.DB
	rdb        redis.UniversalClient
	keys       queue.Keys
	ledger     *domain.Ledger
	shop       *domain.Shop
	sandbox    *sandbox.Provider
	events     *queue.Events
	metrics    *metrics
	alerts     *alerter
	workers    *queue.Workers
	mail       *queue.MailWorker // nil when KAMI_SMTP_URL is unset
	hooks      *domain.Webhooks
	hookers    *queue.WebhookWorkers
	reconciler *domain.Reconciler
	statements *domain.StatementReconciler
	cron       *cron.Cron
	handler    http.Handler
	closers    []func(context.Context) error // run in reverse order at shutdown
}

// newApp opens everything a server needs; start starts its background
// work; Close releases it all.
func newApp(ctx context.Context, cfg *Config, logger *slog.Logger) (_ *app, err error) {
	if err := cfg.ensureSecrets(); err != nil {
		return nil, err
	}
	a := &app{cfg: cfg, log: logger, keys: queue.NewKeys(cfg.RedisPrefix)}
	defer func() {
		if err != nil {
			a.Close(context.Background())
		}
	}()
	if a.db, err = openMigrated(ctx, cfg, logger); err != nil {
		return nil, err
	}
	a.closers = append(a.closers, func(context.Context) error { return a.db.Close() })
	rdb, closeRedis, err := queue.Connect(ctx, cfg.RedisURL)
	if err != nil {
		return nil, fmt.Errorf("KAMI_REDIS_URL: %w", err)
	}
	a.rdb = rdb
	a.closers = append(a.closers, func(context.Context) error { return closeRedis() })
	if cfg.RedisURL != "" { // the in-process Redis never fills up
		warnEviction(ctx, rdb, logger)
	}

	a.metrics = newMetrics(a.queueStats)
	a.alerts = newAlerter(logger, cfg.AlertWebhook, cfg.PublicURL, a.metrics.Alert)
	a.closers = append(a.closers, a.alerts.Close)
	if a.ledger, err = newLedger(cfg, a.db, a.alerts); err != nil {
		return nil, err
	}
	a.metrics.watchGroups(a.ledger)
	a.metrics.watchStock(a.ledger)
	reg, sb, err := newProviders(cfg)
	if err != nil {
		return nil, err
	}
	a.sandbox = sb
	warnSandbox(cfg, logger)
	warnClockSkew(cfg, logger)
	events := queue.NewEvents(rdb, a.keys, logger)
	events.Statuses, events.PollInterval = a.ledger.OrderStatuses, cfg.SubscriptionPoll
	a.events = events
	a.closers = append(a.closers, func(ctx context.Context) error { events.Close(ctx); return nil })
	gate := queue.NewStockGate(rdb, a.keys, a.ledger)
	a.shop = &domain.Shop{Ledger: a.ledger, Gate: gate, Scheduler: queue.NewScheduler(rdb, a.keys), Events: events,
		Providers: reg, Log: logger, PublicBaseURL: cfg.PublicURL, PreCloseCheck: true, ProviderTimeout: cfg.ProviderTimeout, CheckRetry: cfg.CloseCheckRetry, Observer: a.metrics}
	a.workers = queue.NewWorkers(cfg.Workers, rdb, a.keys, a.shop, a.ledger, logger)
	if cfg.Mail != nil {
		if a.mail, err = newMailWorker(cfg, rdb, a.keys, a.shop, a.metrics.reg, logger); err != nil {
			return nil, err
		}
	}
	a.hooks = domain.NewWebhooks(a.ledger, cfg.Webhooks, a.alerts, logger)
	a.hooks.OnAttempt = a.metrics.WebhookAttempt
	a.metrics.watchWebhooks(a.hooks)
	a.hookers = queue.NewWebhookWorkers(cfg.Workers, rdb, a.keys, a.hooks, logger)
	a.reconciler = &domain.Reconciler{Shop: a.shop, Schedules: sweeper{a.workers}, Stock: gate,
		Lock: queue.NewLocker(rdb, a.keys), Alerts: a.alerts, OnRun: a.metrics.Reconciled, Log: logger}
	a.statements = &domain.StatementReconciler{Shop: a.shop, Lock: queue.NewLocker(rdb, a.keys), Alerts: a.alerts,
		ManualOnly: []string{sandbox.Name}, OnRun: a.metrics.StatementRun}
	a.handler = a.routes(events)
	return a, nil
}

// sweeper adapts the queue's sweeper to the reconciliation.
type sweeper struct{ w *queue.Workers }

func (s sweeper) Rebuild(ctx context.Context) (int, error) {
	res, err := s.w.Sweep(ctx)
	return res.Scheduled + res.Refunds + res.StockRebuilds + res.StockRepairs, err
}

// start starts the queue workers and the nightly reconciliation; Close
// stops them, waiting for the jobs in flight.
func (a *app) start(ctx context.Context) error {
	if err := a.workers.Start(ctx); err != nil {
		return err
	}
	a.closers = append(a.closers, a.workers.Stop)
	if a.mail != nil {
		if err := a.mail.Start(ctx); err != nil {
			return err
		}
		a.closers = append(a.closers, a.mail.Stop)
	}
	if err := a.hookers.Start(ctx); err != nil {
		return err
	}
	a.closers = append(a.closers, a.hookers.Stop)
	a.cron = cron.New(cron.WithSeconds(), cron.WithChain(cron.Recover(cronLog{a.log}), cron.SkipIfStillRunning(cronLog{a.log})))
	if _, err := a.cron.AddFunc(a.cfg.ReconcileCron, func() { a.reconcile(context.Background()) }); err != nil {
		return fmt.Errorf("KAMI_RECONCILE_CRON: %w", err)
	}
	if _, err := a.cron.AddFunc(a.cfg.StatementCron, func() { a.reconcileStatements(context.Background()) }); err != nil {
		return fmt.Errorf("KAMI_STATEMENT_CRON: %w", err)
	}
	a.cron.Start()
	a.closers = append(a.closers, func(ctx context.Context) error {
		select {
		case <-a.cron.Stop().Done():
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	})
	return nil
}

// reconcile runs the reconciliation once: the nightly run. Its summary
// line is logged by the Reconciler, as an admin's run is.
func (a *app) reconcile(ctx context.Context) (*domain.ReconcileRun, error) {
	return a.reconciler.Run(ctx)
}

// reconcileStatements runs the scheduled statement reconciliation; each
// run logs its own line.
func (a *app) reconcileStatements(ctx context.Context) {
	if _, err := a.statements.Run(ctx, ""); errors.Is(err, domain.ErrReconcileRunning) {
		a.log.Info("statement reconciliation skipped: another process is running it")
	} else if err != nil {
		a.log.Error("statement reconciliation failed", "err", err)
	}
}

// queueStats reads both delay queues for /metrics and the stats query.
func (a *app) queueStats(ctx context.Context) ([]queueStat, error) {
	c, r, err := a.workers.QueueStats(ctx)
	if err != nil {
		return nil, err
	}
	h, err := a.hookers.QueueStats(ctx)
	if err != nil {
		return nil, err
	}
	stats := []queueStat{
		{Name: "close", Backlog: c.Backlog, Leased: c.Leased, OldestOverdue: c.OldestOverdue},
		{Name: "refund", Backlog: r.Backlog, Leased: r.Leased, OldestOverdue: r.OldestOverdue},
		{Name: "webhook", Backlog: h.Backlog, Leased: h.Leased, OldestOverdue: h.OldestOverdue},
	}
	if a.mail != nil {
		m, err := a.mail.QueueStats(ctx)
		if err != nil {
			return nil, err
		}
		stats = append(stats, queueStat{Name: "mail", Backlog: m.Backlog, Leased: m.Leased, OldestOverdue: m.OldestOverdue})
	}
	return stats, nil
}

// Health feeds the GraphQL stats query.
func (a *app) Health(ctx context.Context) (graph.Health, error) {
	qs, err := a.queueStats(ctx)
	if err != nil {
		return graph.Health{}, domain.Errorf(domain.EUNAVAILABLE, "the queues cannot be read right now")
	}
	var h graph.Health
	for _, q := range qs {
		h.Queues = append(h.Queues, graph.QueueHealth{Name: q.Name, Backlog: q.Backlog, OldestOverdue: q.OldestOverdue})
	}
	h.CloseSuccessRate = a.metrics.closeSuccessRate()
	if h.RefundFailureRate, err = a.ledger.RefundFailureRate(ctx); err != nil {
		return graph.Health{}, err
	}
	return h, nil
}

type cronLog struct{ l *slog.Logger }

func (c cronLog) Info(msg string, kv ...any) { c.l.Debug("cron: "+msg, kv...) }
func (c cronLog) Error(err error, msg string, kv ...any) {
	c.l.Error("cron: "+msg, append(kv, "err", err)...)
}

// Close stops what newApp and start started, newest first.
func (a *app) Close(ctx context.Context) error {
	var errs []error
	for i := len(a.closers) - 1; i >= 0; i-- {
		errs = append(errs, a.closers[i](ctx))
	}
	a.closers = nil
	return errors.Join(errs...)
}

// maxWebhookBody bounds a notification body; the gateways send a few KiB.
const maxWebhookBody = 64 << 10

func (a *app) routes(events *queue.Events) http.Handler {
	mux := http.NewServeMux()
	gcfg := graph.Config{Shop: a.shop, Ledger: a.ledger, Events: events, Stats: a, Webhooks: a.hooks,
		Reconciler: a.reconciler, Statements: a.statements,
		AdminToken: a.cfg.AdminToken, Logger: a.log, OnOperation: a.metrics.GraphQL, MaxUploadBytes: a.cfg.MaxUploadBytes,
		ClientAddr: a.cfg.TrustedProxies.ClientAddr, DisableIntrospection: !a.cfg.Introspection,
		MaxSubscriptionsPerConnection: a.cfg.MaxSubscriptionsPerConnection, MaxConnectionsPerAddress: a.cfg.MaxWebSocketsPerAddress}
	mux.Handle("/graphql", graph.NewHandler(gcfg))
	mux.Handle("GET "+graph.ExportPath, graph.NewExportHandler(gcfg))
	pg := playground.Handler("/graphql")
	mux.Handle("GET /{$}", pg)
	mux.Handle("GET "+playground.Prefix, pg)
	mux.Handle("GET /favicon.ico", pg)
	mux.Handle("GET /metrics", metricsHandler(a.metrics.reg, a.cfg.MetricsToken))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		io.WriteString(w, "ok\n")
	})
	mux.HandleFunc("GET /readyz", a.ready)
	mux.HandleFunc("POST /webhooks/{provider}", a.webhook)
	if a.sandbox != nil && a.cfg.sandboxForBuyers() {
		mux.Handle("/sandbox/pay/", a.sandbox.PayPage(a.payPageOrder, func(ctx context.Context, h http.Header, body []byte) error {
			_, err := a.shop.HandleNotification(ctx, sandbox.Name, h, body)
			return err
		}))
	}
	return writeDeadline(a.cfg.WriteTimeout, bodyDeadline(a.cfg.BodyReadTimeout, mux))
}

// writeDeadline gives every write of a response d to reach the client: a
// client that asks for a large answer and does not read it is cut off
// then, instead of holding the handler's goroutine and the answer's bytes
// for as long as it keeps the connection. The deadline is set at each
// write, not at the start, so a handler may work as long as it must (an
// import, a call to a gateway) and a stream (the export) may last as long
// as its client keeps reading. A WebSocket is not concerned: the server
// lifts a connection's deadlines when it is hijacked.
func writeDeadline(d time.Duration, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		dw := &deadlineWriter{ResponseWriter: w, rc: http.NewResponseController(w), d: d}
		next.ServeHTTP(dw, r)
		dw.extend() // what is still buffered is sent once the handler returns
	})
}

// deadlineWriter moves the connection's write deadline d past every write,
// header and flush. Unwrap lets http.ResponseController (and the WebSocket
// library's hijack) reach the server's own writer.
type deadlineWriter struct {
	http.ResponseWriter
	rc *http.ResponseController
	d  time.Duration
}

func (w *deadlineWriter) extend() { w.rc.SetWriteDeadline(time.Now().Add(w.d)) }

func (w *deadlineWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// WriteHeader moves the deadline only for an informational (1xx) header,
// which the server writes at once; any other status is written with the
// body, at a Write, a Flush or the handler's end, which move it.
func (w *deadlineWriter) WriteHeader(status int) {
	if status < http.StatusOK {
		w.extend()
	}
	w.ResponseWriter.WriteHeader(status)
}

func (w *deadlineWriter) Write(p []byte) (int, error) {
	w.extend()
	return w.ResponseWriter.Write(p)
}

func (w *deadlineWriter) Flush() {
	w.extend()
	w.rc.Flush()
}

// bodyDeadline gives every request with a body d to send it: a client announcing 100 KB and sending 10 bytes is cut off then
// (the handler reads a timeout) instead of holding its connection open.
// The deadline is lifted once the body has been read, so the handler's own
// work is not cut short. A file upload is read while it is imported, for
// as long as the import takes: once the upload transport has checked the
// admin token (graph.RollingBody), its deadline moves on with every
// read that brings data, so only a stalled upload is cut. The deadline of
// any other body, multipart or not, never moves: a stranger sending a byte
// every few seconds is cut off after d wherever they send it. A WebSocket
// handshake has no body, so its connection gets no deadline to keep; an
// Upgrade header does not spare a body its deadline (the server reads up
// to 256 KB of a body its handler left unread before it answers).
func bodyDeadline(d time.Duration, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Body != nil && r.Body != http.NoBody {
			rc := http.NewResponseController(w)
			if rc.SetReadDeadline(time.Now().Add(d)) == nil {
				r.Body = &deadlineBody{ReadCloser: r.Body, rc: rc, d: d}
			}
		}
		next.ServeHTTP(w, r)
	})
}

// deadlineBody lifts the connection's read deadline at the end of the body,
// and once rolling moves it d past every read that brought data.
type deadlineBody struct {
	io.ReadCloser
	rc      *http.ResponseController
	d       time.Duration
	rolling atomic.Bool
}

var _ graph.RollingBody = (*deadlineBody)(nil)

// RollDeadline lets the deadline move on from now.
func (b *deadlineBody) RollDeadline() {
	if !b.rolling.Swap(true) {
		b.rc.SetReadDeadline(time.Now().Add(b.d))
	}
}

func (b *deadlineBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	switch {
	case errors.Is(err, io.EOF):
		b.rc.SetReadDeadline(time.Time{})
	case n > 0 && b.rolling.Load():
		b.rc.SetReadDeadline(time.Now().Add(b.d))
	}
	return n, err
}

// metricsScrapesAtOnce bounds the scrapes /metrics answers at once; more
// are answered 503 at once. Each scrape reads the database (the stock, the
// webhook outbox, the mails waiting: up to 5 s each) and Redis, and
// /metrics is open to anyone when KAMI_METRICS_TOKEN is unset: unbounded,
// a flood of scrapes would hold the connections the orders and payments
// need. Two let a pair of Prometheus servers scrape together.
const metricsScrapesAtOnce = 2

// metricsHandler serves reg's metrics, behind token when it is set.
func metricsHandler(reg *prometheus.Registry, token string) http.Handler {
	return bearerOnly(token, promhttp.HandlerFor(reg, promhttp.HandlerOpts{MaxRequestsInFlight: metricsScrapesAtOnce}))
}

// bearerOnly asks for "Authorization: Bearer token" when token is set.
func bearerOnly(token string, next http.Handler) http.Handler {
	if token == "" {
		return next
	}
	want := sha256.Sum256([]byte("Bearer " + token))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got := sha256.Sum256([]byte(r.Header.Get("Authorization")))
		if subtle.ConstantTimeCompare(got[:], want[:]) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="metrics"`)
			http.Error(w, "this needs the metrics token (Authorization: Bearer …)", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// webhook receives a provider's notification: verify, apply once, answer
// in the provider's form. A refusal changes nothing and is logged with its
// reason; the gateway sends again later when told so.
func (a *app) webhook(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("provider")
	if _, ok := a.shop.Providers.Get(name); !ok {
		http.Error(w, "unknown provider", http.StatusNotFound)
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxWebhookBody))
	if err != nil {
		var tooLarge *http.MaxBytesError
		if errors.As(err, &tooLarge) {
			a.log.Warn("webhook refused", "provider", name, "reason", "body too large")
			http.Error(w, "body too large", http.StatusRequestEntityTooLarge)
			return
		}
		a.log.Warn("webhook refused", "provider", name, "reason", "body not read in time or unreadable")
		http.Error(w, "body not read", http.StatusRequestTimeout)
		return
	}
	p, err := a.shop.HandleNotification(r.Context(), name, r.Header, body)
	result := "ok"
	if err != nil {
		result = "refused"
		if providers.KindOf(err) == providers.Invalid {
			result = "invalid"
		} else if domain.ErrorCode(err) == domain.EINTERNAL {
			result = "error"
		}
		a.log.Warn("webhook refused", "provider", name, "reason", err.Error(), "remote", r.RemoteAddr)
	}
	a.metrics.Webhook(name, result)
	if domain.ErrorCode(err) == domain.EBADINPUT {
		// Verified, but it does not match its order (amount, provider):
		// refused as a bad request, not a fault of ours. It is recorded, so
		// the gateway's redelivery is acknowledged without another alert.
		err = &providers.Error{Kind: providers.Invalid, Provider: name, Op: "notification", Err: err}
	}
	p.Acknowledge(w, err)
}

func (a *app) payPageOrder(ctx context.Context, orderNo string) (sandbox.PageOrder, error) {
	o, err := a.ledger.Order(ctx, orderNo)
	if c := domain.ErrorCode(err); c == domain.ENOTFOUND || c == domain.EBADINPUT {
		// BAD_INPUT: a number no order can have (too long).
		return sandbox.PageOrder{}, sandbox.ErrOrderNotFound
	}
	if err != nil {
		return sandbox.PageOrder{}, err
	}
	subject := "Order " + o.OrderNo
	if p, err := a.ledger.Product(ctx, o.ProductID); err == nil {
		subject = p.Name
	}
	return sandbox.PageOrder{OrderNo: o.OrderNo, Subject: subject, AmountFen: o.AmountFen, ExpiresAt: o.ExpiresAt, Status: string(o.Status),
		ReturnURL: a.cfg.returnLink(o.OrderNo)}, nil
}

// ready answers 200 when the database answers and every migration is
// applied, 503 with the reason otherwise.
func (a *app) ready(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	if err := a.db.PingContext(ctx); err != nil {
		w.WriteHeader(http.StatusServiceUnavailable)
		io.WriteString(w, "database: not answering\n")
		return
	}
	if pending, err := migrations.Pending(ctx, a.db); err != nil || len(pending) > 0 {
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintf(w, "migrations: %d pending\n", len(pending))
		return
	}
	if err := a.rdb.Ping(ctx).Err(); err != nil {
		w.WriteHeader(http.StatusServiceUnavailable)
		io.WriteString(w, "redis: not answering\n")
		return
	}
	io.WriteString(w, "ready\n")
}

// welcome tells the person who started kami, in words, where to go next:
// the playground, where the admin token is, what the sandbox is. Secrets
// generated on this start are said once, here.
func welcome(w io.Writer, cfg *Config, providers []string) {
	fmt.Fprintf(w, "\nkami is ready. Open %s/ in a browser for the GraphQL playground.\n", cfg.PublicURL)
	switch {
	case cfg.adminTokenFile == "":
		fmt.Fprintln(w, "Admin calls need the header \"Authorization: Bearer <KAMI_ADMIN_TOKEN>\" (the token you set).")
	case cfg.generatedAdminToken:
		fmt.Fprintf(w, "An admin token was generated and kept in %s: admin calls need the header\n  Authorization: Bearer %s\n", cfg.adminTokenFile, cfg.AdminToken)
	default:
		fmt.Fprintf(w, "Admin calls need the header \"Authorization: Bearer <token>\" with the token kept in %s.\n", cfg.adminTokenFile)
	}
	if cfg.generatedCardKey {
		fmt.Fprintf(w, "A card key was generated in %s: back it up, card codes cannot be read without it.\n", cfg.cardKeyFile)
	}
	if cfg.sandboxEnabled() {
		where := "KAMI_SANDBOX_SECRET"
		if cfg.sandboxSecretFile != "" {
			where = cfg.sandboxSecretFile
		}
		fmt.Fprintf(w, "The sandbox payment provider is on: orders with provider \"sandbox\" are paid on kami's own pay page\n"+
			"  (%s/sandbox/pay/<orderNo>) and no real money moves; its notifications are signed with the secret in %s.\n", cfg.PublicURL, where)
	}
	fmt.Fprintf(w, "Payment providers: %s. The README's quick start walks a whole purchase.\n\n", strings.Join(providers, ", "))
}

// serve runs the server until ctx ends, then shuts down gracefully: stop
// taking requests, finish those in flight, stop background jobs, close pools.
func serve(ctx context.Context, cfg *Config, logger *slog.Logger, stdout io.Writer) error {
	a, err := newApp(ctx, cfg, logger)
	if err != nil {
		return err
	}
	if err := a.start(ctx); err != nil {
		a.Close(context.Background())
		return err
	}
	ln, err := net.Listen("tcp", cfg.Addr)
	if err != nil {
		a.Close(context.Background())
		return fmt.Errorf("KAMI_ADDR: %w", err)
	}
	if cfg.PprofAddr != "" {
		stopPprof, err := servePprof(cfg.PprofAddr, logger)
		if err != nil {
			ln.Close()
			a.Close(context.Background())
			return err
		}
		defer stopPprof()
	}
	srv := &http.Server{Handler: a.handler, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	logger.Info("kami is serving", "addr", ln.Addr().String(), "public_url", cfg.PublicURL,
		"database", a.db.Dialect().Name().String(), "providers", a.shop.Providers.Names())
	welcome(stdout, cfg, a.shop.Providers.Names())

	select {
	case err = <-served:
	case <-ctx.Done():
	}
	logger.Info("shutting down")
	shutdownCtx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if serr := srv.Shutdown(shutdownCtx); serr != nil {
		logger.Warn("http shutdown", "err", serr)
	}
	if cerr := a.Close(shutdownCtx); cerr != nil {
		logger.Warn("close", "err", cerr)
	}
	if errors.Is(err, http.ErrServerClosed) {
		err = nil
	}
	logger.Info("stopped")
	return err
}
