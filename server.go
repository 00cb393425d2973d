// Command kami is the backend of an automatic card-code shop: see
// README.md and DESIGN.md.
//
//	kami            run the server (the default)
//	kami migrate    apply database migrations and exit
//	kami audit      check the ledger's invariants; exit 1 with one line per violation
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/migrations"
	"kami/providers"
	"kami/providers/alipay"
	"kami/providers/sandbox"
	"kami/providers/wechat"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
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
		ledger, err := newLedger(cfg, db, logger)
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
	case "help", "-h", "--help":
		fmt.Fprintln(stdout, "usage: kami [serve|migrate|audit]")
		return nil
	default:
		return fmt.Errorf("unknown command %q (want serve, migrate or audit)", cmd)
	}
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

func newLedger(cfg *Config, db *bun.DB, logger *slog.Logger) (*domain.Ledger, error) {
	sealer, err := domain.NewSealer(cfg.CardKey)
	if err != nil {
		return nil, err
	}
	return domain.NewLedger(db, sealer, domain.Config{
		OrderTTL: cfg.OrderTTL, MaxQuantity: cfg.MaxQuantity, LatePayment: cfg.LatePayment,
		RefundBackoff:        cfg.RefundBackoff,
		MaxPendingPerContact: cfg.MaxPendingPerContact, MaxPendingPerAddress: cfg.MaxPendingPerAddress,
	}, domain.LogAlerter{Logger: logger}), nil
}

// newProviders builds the registry from the enabled settings; a bad setting
// stops the start with a message that names it.
func newProviders(cfg *Config) (*providers.Registry, *sandbox.Provider, error) {
	var ps []providers.Provider
	var sb *sandbox.Provider
	if cfg.sandboxEnabled() {
		var err error
		sb, err = sandbox.New(sandbox.Config{Secret: cfg.SandboxSecret, BaseURL: cfg.PublicURL})
		if err != nil {
			return nil, nil, err
		}
		ps = append(ps, sb)
	}
	if cfg.Alipay.enabled() {
		c, err := alipay.New(alipay.Config{AppID: cfg.Alipay.AppID, PrivateKey: cfg.Alipay.PrivateKey,
			AlipayPublicKey: cfg.Alipay.PublicKey, Gateway: cfg.Alipay.Gateway,
			NotifyURL: cfg.PublicURL + "/webhooks/alipay"})
		if err != nil {
			return nil, nil, err
		}
		ps = append(ps, c)
	}
	if cfg.Wechat.enabled() {
		c, err := wechat.New(wechat.Config{AppID: cfg.Wechat.AppID, MchID: cfg.Wechat.MchID, SerialNo: cfg.Wechat.SerialNo,
			PrivateKey: cfg.Wechat.PrivateKey, APIv3Key: cfg.Wechat.APIv3Key, PlatformPublicKey: cfg.Wechat.PlatformPublicKey,
			PlatformPublicKeyID: cfg.Wechat.PlatformPublicKeyID, APIBase: cfg.Wechat.APIBase,
			NotifyURL: cfg.PublicURL + "/webhooks/wechat"})
		if err != nil {
			return nil, nil, err
		}
		ps = append(ps, c)
	}
	return providers.NewRegistry(ps...), sb, nil
}

// app is one kami server process, built from a Config.
type app struct {
	cfg     *Config
	log     *slog.Logger
	db      *bun.DB
	ledger  *domain.Ledger
	shop    *domain.Shop
	sandbox *sandbox.Provider
	handler http.Handler
	closers []func(context.Context) error // run in reverse order at shutdown
}

// newApp opens everything a server needs. Close releases it.
func newApp(ctx context.Context, cfg *Config, logger *slog.Logger) (_ *app, err error) {
	if err := cfg.ensureSecrets(); err != nil {
		return nil, err
	}
	a := &app{cfg: cfg, log: logger}
	defer func() {
		if err != nil {
			a.Close(context.Background())
		}
	}()
	if a.db, err = openMigrated(ctx, cfg, logger); err != nil {
		return nil, err
	}
	a.closers = append(a.closers, func(context.Context) error { return a.db.Close() })
	if a.ledger, err = newLedger(cfg, a.db, logger); err != nil {
		return nil, err
	}
	reg, sb, err := newProviders(cfg)
	if err != nil {
		return nil, err
	}
	a.sandbox = sb
	a.shop = &domain.Shop{Ledger: a.ledger, Providers: reg, Log: logger, PublicBaseURL: cfg.PublicURL, PreCloseCheck: true}
	a.handler = a.routes()
	return a, nil
}

// Close stops what newApp started, newest first.
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

func (a *app) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		io.WriteString(w, "ok\n")
	})
	mux.HandleFunc("GET /readyz", a.ready)
	mux.HandleFunc("POST /webhooks/{provider}", a.webhook)
	if a.sandbox != nil {
		mux.Handle("/sandbox/pay/", a.sandbox.PayPage(a.payPageOrder, func(ctx context.Context, h http.Header, body []byte) error {
			_, err := a.shop.HandleNotification(ctx, sandbox.Name, h, body)
			return err
		}))
	}
	return mux
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
		a.log.Warn("webhook refused", "provider", name, "reason", "body too large or unreadable")
		http.Error(w, "body too large", http.StatusRequestEntityTooLarge)
		return
	}
	p, err := a.shop.HandleNotification(r.Context(), name, r.Header, body)
	if err != nil {
		a.log.Warn("webhook refused", "provider", name, "reason", err.Error(), "remote", r.RemoteAddr)
	}
	p.Acknowledge(w, err)
}

func (a *app) payPageOrder(ctx context.Context, orderNo string) (sandbox.PageOrder, error) {
	o, err := a.ledger.Order(ctx, orderNo)
	if domain.ErrorCode(err) == domain.ENOTFOUND {
		return sandbox.PageOrder{}, sandbox.ErrOrderNotFound
	}
	if err != nil {
		return sandbox.PageOrder{}, err
	}
	subject := "Order " + o.OrderNo
	if p, err := a.ledger.Product(ctx, o.ProductID); err == nil {
		subject = p.Name
	}
	return sandbox.PageOrder{OrderNo: o.OrderNo, Subject: subject, AmountFen: o.AmountFen, ExpiresAt: o.ExpiresAt, Status: string(o.Status)}, nil
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
	io.WriteString(w, "ready\n")
}

// serve runs the server until ctx ends, then shuts down gracefully: stop
// taking requests, finish those in flight, stop background jobs, close pools.
func serve(ctx context.Context, cfg *Config, logger *slog.Logger, stdout io.Writer) error {
	a, err := newApp(ctx, cfg, logger)
	if err != nil {
		return err
	}
	for _, g := range cfg.generated {
		fmt.Fprintln(stdout, "generated", g)
	}
	ln, err := net.Listen("tcp", cfg.Addr)
	if err != nil {
		a.Close(context.Background())
		return fmt.Errorf("KAMI_ADDR: %w", err)
	}
	srv := &http.Server{Handler: a.handler, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	logger.Info("kami is serving", "addr", ln.Addr().String(), "public_url", cfg.PublicURL,
		"database", a.db.Dialect().Name().String(), "providers", a.shop.Providers.Names())

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
