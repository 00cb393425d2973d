package main

import (
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/robfig/cron/v3"

	"kami/domain"
	"kami/graph"
	"kami/mail"
	"kami/queue"
)

// Config is every KAMI_* setting. Each has a default that works on a fresh
// machine; load reads them and names the setting at fault when one is bad.
type Config struct {
	Addr      string // KAMI_ADDR, default :8080
	PublicURL string // KAMI_PUBLIC_URL: how buyers and gateways reach kami; default http://localhost<addr>
	// ReturnURL is where a buyer goes back to after paying
	// (KAMI_RETURN_URL): the storefront's order page. Default: kami's
	// playground, which opens the order's query (see returnLink).
	ReturnURL     string
	DataDir       string        // KAMI_DATA_DIR, default ./data
	DatabaseURL   string        // KAMI_DATABASE_URL; empty: SQLite file in the data dir
	DBMaxConns    int           // KAMI_DB_MAX_CONNS, default 20 (servers only)
	RedisURL      string        // KAMI_REDIS_URL; empty: an in-process Redis
	RedisPrefix   string        // KAMI_REDIS_PREFIX, default kami:
	AdminToken    string        // KAMI_ADMIN_TOKEN; generated into the data dir if unset
	CardKey       []byte        // KAMI_CARD_KEY; generated into the data dir if unset
	OrderTTL      time.Duration // KAMI_ORDER_TTL, default 15m
	RefundBackoff []time.Duration
	ReconcileCron string // KAMI_RECONCILE_CRON, default "0 30 3 * * *" (03:30 daily, with seconds)
	// StatementCron is KAMI_STATEMENT_CRON: when the gateways' statements
	// are reconciled. Default "CRON_TZ=Asia/Shanghai 0 30 10 * * *": the
	// gateways publish the day before's statement in the morning, Beijing
	// time (WeChat Pay after 10:00).
	StatementCron string
	LatePayment   domain.LatePaymentPolicy
	MaxQuantity   int // KAMI_MAX_QUANTITY, default 100
	MaxPendingPerContact,
	MaxPendingPerAddress int
	// MaxLockedPerContact and MaxLockedPerAddress cap the cards held by
	// unpaid orders (KAMI_MAX_LOCKED_PER_CONTACT, default 100,
	// KAMI_MAX_LOCKED_PER_ADDRESS, default 200; 0: no cap).
	MaxLockedPerContact, MaxLockedPerAddress int
	SandboxSecret                            string // KAMI_SANDBOX_SECRET; see sandboxEnabled
	// SandboxGivesCodesAway (KAMI_SANDBOX_GIVES_CODES_AWAY=1) offers the
	// sandbox to buyers beside real providers; see sandboxForBuyers.
	SandboxGivesCodesAway bool
	// TrustedProxies (KAMI_TRUSTED_PROXIES, KAMI_TRUSTED_PROXY_HEADER)
	// finds the client address behind reverse proxies.
	TrustedProxies graph.TrustedProxies
	// Introspection (KAMI_GRAPHQL_INTROSPECTION): on by default, off by
	// default when a real provider is configured.
	Introspection bool
	// MetricsToken (KAMI_METRICS_TOKEN), when set, is the bearer token
	// /metrics asks for.
	MetricsToken string
	// MaxSubscriptionsPerConnection (KAMI_MAX_SUBSCRIPTIONS_PER_CONNECTION,
	// default 20): the operations one WebSocket may start over its life,
	// failed and completed ones included; MaxWebSocketsPerAddress
	// (KAMI_MAX_WEBSOCKETS_PER_ADDRESS, default 50); 0: no cap.
	MaxSubscriptionsPerConnection, MaxWebSocketsPerAddress int
	LogFormat                                              string // KAMI_LOG_FORMAT: text (default) or json
	LogLevel                                               slog.Level
	AlertWebhook                                           string // KAMI_ALERT_WEBHOOK: WeCom, DingTalk or Slack incoming webhook; empty: log only
	// CloseCheckRetry (KAMI_CLOSE_CHECK_RETRY, default 1m) is how long a
	// due order whose pre-close check had no clear answer from its gateway
	// waits before it is checked again (domain.Shop.CheckRetry).
	CloseCheckRetry time.Duration
	// ProviderTimeout bounds each call to a payment gateway
	// (KAMI_PROVIDER_TIMEOUT, default 10s).
	ProviderTimeout time.Duration
	// MaxUploadBytes bounds a file import's upload (KAMI_MAX_UPLOAD_BYTES,
	// default 32 MiB); a larger one is refused before it is read whole.
	MaxUploadBytes int64
	// PprofAddr (KAMI_PPROF_ADDR), when set, serves Go's profiles
	// (/debug/pprof/) on this loopback address; default off.
	PprofAddr string

	// Workers tunes the queue workers; tests shorten its intervals.
	// KAMI_SWEEP_EVERY (default 1m) is how often the sweeper rebuilds what
	// Redis lost; KAMI_QUEUE_LEASE (default 30s) how long a claimed close
	// or refund task is held before another process may take it back.
	Workers queue.Config
	// ClockSkew (KAMI_FAULT_CLOCK_SKEW, like 3s or -2s; default 0) offsets
	// the clock the ledger and the workers judge due times by. Test-only:
	// the fault campaign (chaos/) starts one process with a skewed clock
	// to prove that a process whose clock is off cannot close orders early
	// or take others' work. Never set it in a shop.
	ClockSkew time.Duration
	// BodyReadTimeout bounds how long a request body may take to arrive
	// (10s); WriteTimeout how long each write of a response may take to
	// reach the client (30s); SubscriptionPoll is how often subscriptions
	// read their orders again while Redis is away (5s). Tests shorten them.
	BodyReadTimeout, WriteTimeout, SubscriptionPoll time.Duration

	// Webhooks tunes the signed outgoing webhooks (KAMI_WEBHOOK_*): see
	// loadWebhookConfig.
	Webhooks domain.WebhookConfig

	Alipay AlipaySettings
	Wechat WechatSettings
	// Mail (KAMI_SMTP_URL, KAMI_MAIL_FROM, KAMI_SHOP_NAME) mails a paid
	// order's codes to a buyer whose contact is an email address; nil
	// when KAMI_SMTP_URL is unset.
	Mail *mail.Config

	// Where the secrets left unset were read from or written to (see
	// ensureSecrets), for the start's welcome lines; "" when the setting
	// gave them. The generated flags mark those written on this start.
	adminTokenFile, cardKeyFile, sandboxSecretFile string
	generatedAdminToken, generatedCardKey          bool
}

// AlipaySettings are the KAMI_ALIPAY_* settings.
type AlipaySettings struct{ AppID, PrivateKey, PublicKey, Gateway, SellerID string }

// WechatSettings are the KAMI_WECHAT_* settings.
type WechatSettings struct {
	AppID, MchID, SerialNo, PrivateKey, APIv3Key, PlatformPublicKey, PlatformPublicKeyID, APIBase string
}

func (a AlipaySettings) enabled() bool {
	return a.AppID != "" || a.PrivateKey != "" || a.PublicKey != ""
}

func (w WechatSettings) enabled() bool {
	return w.AppID != "" || w.MchID != "" || w.PrivateKey != "" || w.APIv3Key != ""
}

// realProvider: Alipay or WeChat Pay is configured.
func (c *Config) realProvider() bool { return c.Alipay.enabled() || c.Wechat.enabled() }

// sandboxEnabled: the sandbox provider runs (its webhook verifies
// notifications signed with KAMI_SANDBOX_SECRET) when its secret is set,
// when no real provider is configured (a fresh machine, so a newcomer can
// click through a purchase), or when it is offered to buyers. A shop with
// merchant settings and none of these has no sandbox.
func (c *Config) sandboxEnabled() bool {
	return c.SandboxSecret != "" || !c.realProvider() || c.SandboxGivesCodesAway
}

// sandboxForBuyers: buyers may pick the sandbox for new orders, and its pay
// page is served. Anyone can then take codes without paying, so beside a
// real provider only KAMI_SANDBOX_GIVES_CODES_AWAY=1 allows it.
func (c *Config) sandboxForBuyers() bool {
	return c.sandboxEnabled() && (!c.realProvider() || c.SandboxGivesCodesAway)
}

// loadConfig reads the environment through getenv.
func loadConfig(getenv func(string) string) (*Config, error) {
	c := &Config{
		Addr:          or(getenv("KAMI_ADDR"), ":8080"),
		DataDir:       or(getenv("KAMI_DATA_DIR"), "data"),
		DatabaseURL:   getenv("KAMI_DATABASE_URL"),
		RedisURL:      strings.TrimSpace(getenv("KAMI_REDIS_URL")), // blank: the in-process Redis, as in Connect
		RedisPrefix:   or(getenv("KAMI_REDIS_PREFIX"), "kami:"),
		AdminToken:    getenv("KAMI_ADMIN_TOKEN"),
		LogFormat:     or(getenv("KAMI_LOG_FORMAT"), "text"),
		SandboxSecret: getenv("KAMI_SANDBOX_SECRET"),
		AlertWebhook:  getenv("KAMI_ALERT_WEBHOOK"),
		MetricsToken:  strings.TrimSpace(getenv("KAMI_METRICS_TOKEN")),
		Alipay: AlipaySettings{AppID: getenv("KAMI_ALIPAY_APP_ID"), PrivateKey: getenv("KAMI_ALIPAY_PRIVATE_KEY"),
			PublicKey: getenv("KAMI_ALIPAY_PUBLIC_KEY"), Gateway: getenv("KAMI_ALIPAY_GATEWAY"), SellerID: getenv("KAMI_ALIPAY_SELLER_ID")},
		Wechat: WechatSettings{AppID: getenv("KAMI_WECHAT_APP_ID"), MchID: getenv("KAMI_WECHAT_MCH_ID"),
			SerialNo: getenv("KAMI_WECHAT_SERIAL_NO"), PrivateKey: getenv("KAMI_WECHAT_PRIVATE_KEY"),
			APIv3Key: getenv("KAMI_WECHAT_API_V3_KEY"), PlatformPublicKey: getenv("KAMI_WECHAT_PLATFORM_PUBLIC_KEY"),
			PlatformPublicKeyID: getenv("KAMI_WECHAT_PLATFORM_PUBLIC_KEY_ID"), APIBase: getenv("KAMI_WECHAT_API_BASE")},
	}
	var errs []error
	bad := func(name, why string) { errs = append(errs, fmt.Errorf("%s: %s", name, why)) }

	c.PublicURL = strings.TrimRight(getenv("KAMI_PUBLIC_URL"), "/")
	if c.PublicURL == "" {
		host := c.Addr
		if strings.HasPrefix(host, ":") {
			host = "localhost" + host
		}
		c.PublicURL = "http://" + host
	}
	if !strings.HasPrefix(c.PublicURL, "http://") && !strings.HasPrefix(c.PublicURL, "https://") {
		bad("KAMI_PUBLIC_URL", "want an http:// or https:// URL")
	}
	c.ReturnURL = strings.TrimSpace(getenv("KAMI_RETURN_URL"))
	if c.ReturnURL == "" {
		c.ReturnURL = c.PublicURL + "/"
	} else if u, err := url.Parse(c.ReturnURL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.Fragment != "" {
		bad("KAMI_RETURN_URL", "want an absolute http:// or https:// URL without a #fragment")
	}
	var err error
	if c.OrderTTL, err = duration(getenv("KAMI_ORDER_TTL"), 15*time.Minute); err != nil || c.OrderTTL < time.Second || c.OrderTTL > 24*time.Hour {
		bad("KAMI_ORDER_TTL", "want a duration from 1s to 24h, like 15m")
	}
	if c.Workers.SweepEvery, err = duration(getenv("KAMI_SWEEP_EVERY"), time.Minute); err != nil || c.Workers.SweepEvery < time.Second || c.Workers.SweepEvery > 24*time.Hour {
		bad("KAMI_SWEEP_EVERY", "want a duration from 1s to 24h, like 1m")
	}
	if c.Workers.Lease, err = duration(getenv("KAMI_QUEUE_LEASE"), 30*time.Second); err != nil || c.Workers.Lease < time.Second || c.Workers.Lease > time.Hour {
		bad("KAMI_QUEUE_LEASE", "want a duration from 1s to 1h, like 30s")
	}
	if c.CloseCheckRetry, err = duration(getenv("KAMI_CLOSE_CHECK_RETRY"), domain.DefaultCheckRetry); err != nil || c.CloseCheckRetry < time.Second || c.CloseCheckRetry > time.Hour {
		bad("KAMI_CLOSE_CHECK_RETRY", "want a duration from 1s to 1h, like 1m")
	}
	if c.ClockSkew, err = duration(getenv("KAMI_FAULT_CLOCK_SKEW"), 0); err != nil || c.ClockSkew < -time.Hour || c.ClockSkew > time.Hour {
		bad("KAMI_FAULT_CLOCK_SKEW", "want a duration from -1h to 1h, like 3s (test-only)")
	}
	if c.ProviderTimeout, err = duration(getenv("KAMI_PROVIDER_TIMEOUT"), 10*time.Second); err != nil || c.ProviderTimeout < 100*time.Millisecond || c.ProviderTimeout > 2*time.Minute {
		bad("KAMI_PROVIDER_TIMEOUT", "want a duration from 100ms to 2m, like 10s")
	}
	if c.RefundBackoff, err = durations(getenv("KAMI_REFUND_BACKOFF"), domain.DefaultRefundBackoff); err != nil {
		bad("KAMI_REFUND_BACKOFF", err.Error())
	}
	c.ReconcileCron = or(getenv("KAMI_RECONCILE_CRON"), "0 30 3 * * *")
	c.StatementCron = or(getenv("KAMI_STATEMENT_CRON"), "CRON_TZ=Asia/Shanghai 0 30 10 * * *")
	// Both are checked here, with the other settings, so that a bad one
	// stops every command (migrate, audit too) before anything is touched.
	for name, spec := range map[string]string{"KAMI_RECONCILE_CRON": c.ReconcileCron, "KAMI_STATEMENT_CRON": c.StatementCron} {
		if _, err := cronParser.Parse(spec); err != nil {
			bad(name, "want a cron spec with seconds, like 0 30 3 * * * or CRON_TZ=Asia/Shanghai 0 30 10 * * *")
		}
	}
	switch lp := domain.LatePaymentPolicy(or(getenv("KAMI_LATE_PAYMENT"), string(domain.LateRefund))); lp {
	case domain.LateRefund, domain.LateDeliver:
		c.LatePayment = lp
	default:
		bad("KAMI_LATE_PAYMENT", "want refund or deliver")
	}
	for _, s := range []struct {
		name string
		dst  *int
		def  int
	}{
		{"KAMI_MAX_QUANTITY", &c.MaxQuantity, 100},
		{"KAMI_MAX_PENDING_PER_CONTACT", &c.MaxPendingPerContact, 5},
		{"KAMI_MAX_PENDING_PER_ADDRESS", &c.MaxPendingPerAddress, 20},
		{"KAMI_MAX_LOCKED_PER_CONTACT", &c.MaxLockedPerContact, 100},
		{"KAMI_MAX_LOCKED_PER_ADDRESS", &c.MaxLockedPerAddress, 200},
		{"KAMI_MAX_SUBSCRIPTIONS_PER_CONNECTION", &c.MaxSubscriptionsPerConnection, 20},
		{"KAMI_MAX_WEBSOCKETS_PER_ADDRESS", &c.MaxWebSocketsPerAddress, 50},
		{"KAMI_DB_MAX_CONNS", &c.DBMaxConns, 20},
	} {
		if *s.dst, err = integer(getenv(s.name), s.def); err != nil || *s.dst < 0 {
			bad(s.name, "want a whole number, 0 or more")
		}
	}
	if c.AdminToken != "" && len(c.AdminToken) < minAdminToken {
		bad("KAMI_ADMIN_TOKEN", fmt.Sprintf("at least %d characters (it is %d); make one with `openssl rand -hex 32`, or unset it to have one generated", minAdminToken, len(c.AdminToken)))
	}
	if c.MetricsToken != "" && len(c.MetricsToken) < minAdminToken {
		bad("KAMI_METRICS_TOKEN", fmt.Sprintf("at least %d characters; make one with `openssl rand -hex 32`", minAdminToken))
	}
	if c.SandboxGivesCodesAway, err = flag(getenv("KAMI_SANDBOX_GIVES_CODES_AWAY"), false); err != nil {
		bad("KAMI_SANDBOX_GIVES_CODES_AWAY", "want 1 (on) or 0 (off)")
	}
	if c.Introspection, err = flag(getenv("KAMI_GRAPHQL_INTROSPECTION"), !c.realProvider()); err != nil {
		bad("KAMI_GRAPHQL_INTROSPECTION", "want on or off")
	}
	if c.TrustedProxies, err = graph.ParseTrustedProxies(getenv("KAMI_TRUSTED_PROXIES")); err != nil {
		bad("KAMI_TRUSTED_PROXIES", err.Error())
	} else if c.TrustedProxies, err = c.TrustedProxies.ReadingHeader(getenv("KAMI_TRUSTED_PROXY_HEADER")); err != nil {
		bad("KAMI_TRUSTED_PROXY_HEADER", err.Error())
	}
	c.BodyReadTimeout, c.WriteTimeout, c.SubscriptionPoll = 10*time.Second, 30*time.Second, 5*time.Second
	if c.MaxUploadBytes, err = byteSize(getenv("KAMI_MAX_UPLOAD_BYTES"), graph.DefaultMaxUploadBytes); err != nil || c.MaxUploadBytes < 1<<10 || c.MaxUploadBytes > 8<<30 {
		bad("KAMI_MAX_UPLOAD_BYTES", "want a size from 1KiB to 8GiB, like 33554432, 32MiB or 512KiB")
	}
	if c.PprofAddr = strings.TrimSpace(getenv("KAMI_PPROF_ADDR")); c.PprofAddr != "" {
		if err := checkPprofAddr(c.PprofAddr); err != nil {
			bad("KAMI_PPROF_ADDR", err.Error())
		}
	}
	if c.AlertWebhook != "" && !strings.HasPrefix(c.AlertWebhook, "https://") && !strings.HasPrefix(c.AlertWebhook, "http://") {
		bad("KAMI_ALERT_WEBHOOK", "want an http(s) URL")
	}
	if c.MaxQuantity == 0 {
		bad("KAMI_MAX_QUANTITY", "must be at least 1")
	}
	switch c.LogFormat {
	case "text", "json":
	default:
		bad("KAMI_LOG_FORMAT", "want text or json")
	}
	if err := c.LogLevel.UnmarshalText([]byte(or(getenv("KAMI_LOG_LEVEL"), "info"))); err != nil {
		bad("KAMI_LOG_LEVEL", "want debug, info, warn or error")
	}
	if c.Mail, err = mailSettings(getenv); err != nil {
		errs = append(errs, err)
	}
	if err := loadWebhookConfig(c, getenv); err != nil {
		errs = append(errs, err)
	}
	if raw := getenv("KAMI_CARD_KEY"); raw != "" {
		if c.CardKey, err = domain.ParseCardKey(raw); err != nil {
			errs = append(errs, err)
		}
	}
	return c, errors.Join(errs...)
}

// mailSettings reads KAMI_SMTP_URL, KAMI_MAIL_FROM, KAMI_SHOP_NAME
// (default "kami") and KAMI_SMTP_TIMEOUT (each step of a send: connect,
// each command, the message's end and its reply; default 30s); nil when
// no SMTP server is set.
func mailSettings(getenv func(string) string) (*mail.Config, error) {
	shop := or(getenv("KAMI_SHOP_NAME"), "kami")
	var errs []error
	if err := mail.CheckShopName(shop); err != nil {
		errs = append(errs, fmt.Errorf("KAMI_SHOP_NAME: %w", err))
	}
	raw := strings.TrimSpace(getenv("KAMI_SMTP_URL"))
	if raw == "" {
		return nil, errors.Join(errs...)
	}
	srv, err := mail.ParseServer(raw)
	if err != nil {
		errs = append(errs, fmt.Errorf("KAMI_SMTP_URL: %w", err))
	}
	from, err := mail.ParseFrom(getenv("KAMI_MAIL_FROM"))
	if err != nil {
		errs = append(errs, fmt.Errorf("KAMI_MAIL_FROM: %w (needed with KAMI_SMTP_URL)", err))
	}
	timeout, err := duration(getenv("KAMI_SMTP_TIMEOUT"), 30*time.Second)
	if err != nil || timeout < time.Second || timeout > 10*time.Minute {
		errs = append(errs, errors.New("KAMI_SMTP_TIMEOUT: want a duration from 1s to 10m, like 30s"))
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return &mail.Config{Server: srv, From: from, ShopName: shop, Timeout: timeout}, nil
}

// cronParser reads cron specs as the server's cron does (cron.WithSeconds).
var cronParser = cron.NewParser(cron.Second | cron.Minute | cron.Hour | cron.Dom | cron.Month | cron.Dow | cron.Descriptor)

// ensureSecrets fills the secrets left unset from files in the data dir,
// generating them there on the first start.
func (c *Config) ensureSecrets() error {
	if err := os.MkdirAll(c.DataDir, 0o700); err != nil {
		return fmt.Errorf("KAMI_DATA_DIR: %w", err)
	}
	var err error
	if c.AdminToken == "" {
		c.adminTokenFile = filepath.Join(c.DataDir, "admin_token")
		if c.AdminToken, c.generatedAdminToken, err = secretFile(c.adminTokenFile, domain.NewCardKey); err != nil {
			return fmt.Errorf("KAMI_ADMIN_TOKEN: %w", err)
		}
	}
	if c.CardKey == nil {
		c.cardKeyFile = filepath.Join(c.DataDir, "card_key")
		var raw string
		if raw, c.generatedCardKey, err = secretFile(c.cardKeyFile, domain.NewCardKey); err != nil {
			return fmt.Errorf("KAMI_CARD_KEY: %w", err)
		}
		if c.CardKey, err = domain.ParseCardKey(raw); err != nil {
			return fmt.Errorf("%w (in %s)", err, c.cardKeyFile)
		}
	}
	if c.sandboxEnabled() && c.SandboxSecret == "" {
		c.sandboxSecretFile = filepath.Join(c.DataDir, "sandbox_secret")
		if c.SandboxSecret, _, err = secretFile(c.sandboxSecretFile, domain.NewCardKey); err != nil {
			return fmt.Errorf("KAMI_SANDBOX_SECRET: %w", err)
		}
	}
	return nil
}

// secretFile reads a secret from path, or writes a new one there (0600).
func secretFile(path string, gen func() string) (string, bool, error) {
	b, err := os.ReadFile(path)
	if err == nil {
		if s := strings.TrimSpace(string(b)); s != "" {
			return s, false, nil
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return "", false, err
	}
	s := gen()
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		if errors.Is(err, os.ErrExist) { // another process wrote it first
			return secretFile(path, gen)
		}
		return "", false, err
	}
	defer f.Close()
	if _, err := f.WriteString(s + "\n"); err != nil {
		return "", false, err
	}
	return s, true, f.Sync()
}

func or(v, def string) string {
	if v = strings.TrimSpace(v); v == "" {
		return def
	}
	return v
}

func duration(v string, def time.Duration) (time.Duration, error) {
	if v = strings.TrimSpace(v); v == "" {
		return def, nil
	}
	return time.ParseDuration(v)
}

func durations(v string, def []time.Duration) ([]time.Duration, error) {
	if v = strings.TrimSpace(v); v == "" {
		return def, nil
	}
	var out []time.Duration
	for _, part := range strings.Split(v, ",") {
		d, err := time.ParseDuration(strings.TrimSpace(part))
		if err != nil || d <= 0 {
			return nil, fmt.Errorf("want positive durations separated by commas, like 1m,5m,30m; %q is not one", part)
		}
		out = append(out, d)
	}
	if len(out) > 20 {
		return nil, errors.New("at most 20 steps")
	}
	return out, nil
}

// minAdminToken is the shortest admin (and metrics) token kami accepts: a
// token guessed online at any rate must not be within reach. Generated
// tokens are 64 characters.
const minAdminToken = 32

// flag reads an on/off setting: 1, on, true, yes or 0, off, false, no.
func flag(v string, def bool) (bool, error) {
	switch strings.ToLower(strings.TrimSpace(v)) {
	case "":
		return def, nil
	case "1", "on", "true", "yes":
		return true, nil
	case "0", "off", "false", "no":
		return false, nil
	}
	return false, errors.New("not on or off")
}

// byteSize reads a size in bytes, with an optional KiB, MiB or GiB.
func byteSize(v string, def int64) (int64, error) {
	v = strings.TrimSpace(v)
	if v == "" {
		return def, nil
	}
	unit := int64(1)
	for suffix, u := range map[string]int64{"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30} {
		if strings.HasSuffix(v, suffix) {
			v, unit = strings.TrimSpace(strings.TrimSuffix(v, suffix)), u
			break
		}
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 || n > (1<<62)/unit {
		return 0, errors.New("not a size")
	}
	return n * unit, nil
}

func integer(v string, def int) (int, error) {
	if v = strings.TrimSpace(v); v == "" {
		return def, nil
	}
	return strconv.Atoi(v)
}

// returnLink is the link back from a pay page for orderNo: ReturnURL with
// orderNo=<no> added to its query. Only the order number, which kami made,
// comes from the request; the rest is configuration, so the link cannot be
// pointed anywhere else.
func (c *Config) returnLink(orderNo string) string {
	u, err := url.Parse(c.ReturnURL)
	if err != nil { // loadConfig checked it
		return c.PublicURL + "/"
	}
	q := u.Query()
	q.Set("orderNo", orderNo)
	u.RawQuery = q.Encode()
	return u.String()
}

// loadWebhookConfig reads the KAMI_WEBHOOK_* settings:
// KAMI_WEBHOOK_TIMEOUT (default 10s) bounds one delivery attempt;
// KAMI_WEBHOOK_RETRY_FOR (default 72h) is how long a delivery is retried,
// waits doubling from KAMI_WEBHOOK_BACKOFF (default 30s) to at most 6h,
// before it is FAILED and alerted; KAMI_WEBHOOK_ALLOW_PRIVATE=1 lets
// endpoints point at loopback, link-local and private addresses (never at
// kami itself: KAMI_PUBLIC_URL, KAMI_ADDR, KAMI_PPROF_ADDR).
func loadWebhookConfig(c *Config, getenv func(string) string) error {
	var errs []error
	bad := func(name, want string) { errs = append(errs, fmt.Errorf("%s: %s", name, want)) }
	w := &c.Webhooks
	var err error
	if w.Timeout, err = duration(getenv("KAMI_WEBHOOK_TIMEOUT"), 10*time.Second); err != nil || w.Timeout < 100*time.Millisecond || w.Timeout > time.Minute {
		bad("KAMI_WEBHOOK_TIMEOUT", "want a duration from 100ms to 1m, like 10s")
	}
	if w.BackoffBase, err = duration(getenv("KAMI_WEBHOOK_BACKOFF"), 30*time.Second); err != nil || w.BackoffBase < time.Second || w.BackoffBase > time.Hour {
		bad("KAMI_WEBHOOK_BACKOFF", "want a duration from 1s to 1h, like 30s")
	}
	if w.RetryFor, err = duration(getenv("KAMI_WEBHOOK_RETRY_FOR"), 72*time.Hour); err != nil || w.RetryFor < time.Minute || w.RetryFor > 30*24*time.Hour {
		bad("KAMI_WEBHOOK_RETRY_FOR", "want a duration from 1m to 720h, like 72h")
	}
	if w.Keep, err = duration(getenv("KAMI_WEBHOOK_KEEP"), 30*24*time.Hour); err != nil || w.Keep < time.Hour || w.Keep > 10*365*24*time.Hour {
		bad("KAMI_WEBHOOK_KEEP", "want a duration from 1h to 87600h, like 720h")
	}
	if w.Guard.AllowPrivate, err = flag(getenv("KAMI_WEBHOOK_ALLOW_PRIVATE"), false); err != nil {
		bad("KAMI_WEBHOOK_ALLOW_PRIVATE", "want 1 (on) or 0 (off)")
	}
	w.Guard.Self = c.PublicURL
	w.Guard.Listen = []string{c.Addr}
	if pprof := strings.TrimSpace(getenv("KAMI_PPROF_ADDR")); pprof != "" {
		w.Guard.Listen = append(w.Guard.Listen, pprof)
	}
	return errors.Join(errs...)
}
