package main

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"kami/domain"
	"kami/graph"
	"kami/queue"
)

// Config is every KAMI_* setting. Each has a default that works on a fresh
// machine; load reads them and names the setting at fault when one is bad.
type Config struct {
	Addr          string        // KAMI_ADDR, default :8080
	PublicURL     string        // KAMI_PUBLIC_URL: how buyers and gateways reach kami; default http://localhost<addr>
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
	LatePayment   domain.LatePaymentPolicy
	MaxQuantity   int // KAMI_MAX_QUANTITY, default 100
	MaxPendingPerContact,
	MaxPendingPerAddress int
	SandboxSecret string // KAMI_SANDBOX_SECRET; see sandboxEnabled
	LogFormat     string // KAMI_LOG_FORMAT: text (default) or json
	LogLevel      slog.Level
	AlertWebhook  string // KAMI_ALERT_WEBHOOK: WeCom, DingTalk or Slack incoming webhook; empty: log only
	// ProviderTimeout bounds each call to a payment gateway
	// (KAMI_PROVIDER_TIMEOUT, default 10s).
	ProviderTimeout time.Duration
	// MaxUploadBytes bounds a file import's upload (KAMI_MAX_UPLOAD_BYTES,
	// default 32 MiB); a larger one is refused before it is read whole.
	MaxUploadBytes int64

	// Workers tunes the queue workers; tests shorten its intervals.
	Workers queue.Config

	Alipay AlipaySettings
	Wechat WechatSettings

	// generated lists the secrets this start generated, to print once.
	generated []string
}

// AlipaySettings are the KAMI_ALIPAY_* settings.
type AlipaySettings struct{ AppID, PrivateKey, PublicKey, Gateway string }

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

// sandboxEnabled: the sandbox runs when its secret is set, or when no real
// provider is configured (a fresh machine), so a newcomer can click through
// a purchase. A shop with merchant settings and no sandbox secret has no
// sandbox.
func (c *Config) sandboxEnabled() bool {
	return c.SandboxSecret != "" || (!c.Alipay.enabled() && !c.Wechat.enabled())
}

// loadConfig reads the environment through getenv.
func loadConfig(getenv func(string) string) (*Config, error) {
	c := &Config{
		Addr:          or(getenv("KAMI_ADDR"), ":8080"),
		DataDir:       or(getenv("KAMI_DATA_DIR"), "data"),
		DatabaseURL:   getenv("KAMI_DATABASE_URL"),
		RedisURL:      getenv("KAMI_REDIS_URL"),
		RedisPrefix:   or(getenv("KAMI_REDIS_PREFIX"), "kami:"),
		AdminToken:    getenv("KAMI_ADMIN_TOKEN"),
		LogFormat:     or(getenv("KAMI_LOG_FORMAT"), "text"),
		SandboxSecret: getenv("KAMI_SANDBOX_SECRET"),
		AlertWebhook:  getenv("KAMI_ALERT_WEBHOOK"),
		Alipay: AlipaySettings{AppID: getenv("KAMI_ALIPAY_APP_ID"), PrivateKey: getenv("KAMI_ALIPAY_PRIVATE_KEY"),
			PublicKey: getenv("KAMI_ALIPAY_PUBLIC_KEY"), Gateway: getenv("KAMI_ALIPAY_GATEWAY")},
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
	var err error
	if c.OrderTTL, err = duration(getenv("KAMI_ORDER_TTL"), 15*time.Minute); err != nil || c.OrderTTL < time.Second || c.OrderTTL > 24*time.Hour {
		bad("KAMI_ORDER_TTL", "want a duration from 1s to 24h, like 15m")
	}
	if c.ProviderTimeout, err = duration(getenv("KAMI_PROVIDER_TIMEOUT"), 10*time.Second); err != nil || c.ProviderTimeout < 100*time.Millisecond || c.ProviderTimeout > 2*time.Minute {
		bad("KAMI_PROVIDER_TIMEOUT", "want a duration from 100ms to 2m, like 10s")
	}
	if c.RefundBackoff, err = durations(getenv("KAMI_REFUND_BACKOFF"), domain.DefaultRefundBackoff); err != nil {
		bad("KAMI_REFUND_BACKOFF", err.Error())
	}
	c.ReconcileCron = or(getenv("KAMI_RECONCILE_CRON"), "0 30 3 * * *")
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
		{"KAMI_DB_MAX_CONNS", &c.DBMaxConns, 20},
	} {
		if *s.dst, err = integer(getenv(s.name), s.def); err != nil || *s.dst < 0 {
			bad(s.name, "want a whole number, 0 or more")
		}
	}
	if c.MaxUploadBytes, err = byteSize(getenv("KAMI_MAX_UPLOAD_BYTES"), graph.DefaultMaxUploadBytes); err != nil || c.MaxUploadBytes < 1<<10 || c.MaxUploadBytes > 8<<30 {
		bad("KAMI_MAX_UPLOAD_BYTES", "want a size from 1KiB to 8GiB, like 33554432, 32MiB or 512KiB")
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
	if raw := getenv("KAMI_CARD_KEY"); raw != "" {
		if c.CardKey, err = domain.ParseCardKey(raw); err != nil {
			errs = append(errs, err)
		}
	}
	return c, errors.Join(errs...)
}

// ensureSecrets fills the secrets left unset from files in the data dir,
// generating them there on the first start.
func (c *Config) ensureSecrets() error {
	if err := os.MkdirAll(c.DataDir, 0o700); err != nil {
		return fmt.Errorf("KAMI_DATA_DIR: %w", err)
	}
	if c.AdminToken == "" {
		tok, gen, err := secretFile(filepath.Join(c.DataDir, "admin_token"), func() string { return domain.NewCardKey() })
		if err != nil {
			return fmt.Errorf("KAMI_ADMIN_TOKEN: %w", err)
		}
		c.AdminToken = tok
		if gen {
			c.generated = append(c.generated, "KAMI_ADMIN_TOKEN="+tok)
		}
	}
	if c.CardKey == nil {
		raw, gen, err := secretFile(filepath.Join(c.DataDir, "card_key"), domain.NewCardKey)
		if err != nil {
			return fmt.Errorf("KAMI_CARD_KEY: %w", err)
		}
		if c.CardKey, err = domain.ParseCardKey(raw); err != nil {
			return fmt.Errorf("%w (in %s)", err, filepath.Join(c.DataDir, "card_key"))
		}
		if gen {
			c.generated = append(c.generated, "KAMI_CARD_KEY written to "+filepath.Join(c.DataDir, "card_key")+": back it up, card codes cannot be read without it")
		}
	}
	if c.sandboxEnabled() && c.SandboxSecret == "" {
		sec, _, err := secretFile(filepath.Join(c.DataDir, "sandbox_secret"), domain.NewCardKey)
		if err != nil {
			return fmt.Errorf("KAMI_SANDBOX_SECRET: %w", err)
		}
		c.SandboxSecret = sec
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
