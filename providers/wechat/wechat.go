// Package wechat is the WeChat Pay API v3 provider, an adapter over gopay's
// v3 client (github.com/go-pay/gopay/wechat/v3).
//
// It uses the "WeChat Pay public key" mode: responses and notifications are
// verified with the platform public key and its ID (PUB_KEY_ID_...), never
// with downloaded platform certificates, so the client makes no call of its
// own behind kami's back (see noCertDownload).
package wechat

import (
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"

	wv3 "github.com/go-pay/gopay/wechat/v3"

	"kami/providers"
)

// Name is the provider's registry key and its /webhooks/{provider} name.
const Name = "wechat"

// DefaultAPIBase is the production gateway.
const DefaultAPIBase = "https://api.mch.weixin.qq.com"

// DefaultTimeout bounds one call to the gateway when Config.Timeout is zero.
const DefaultTimeout = 10 * time.Second

// publicKeyIDPrefix starts every WeChat Pay public key ID. gopay treats an
// answer signed under any other serial as a platform certificate it has not
// seen yet and goes to download /v3/certificates; requiring the prefix keeps
// the client in public key mode.
const publicKeyIDPrefix = "PUB_KEY_ID_"

// Config holds the merchant settings, one field per KAMI_WECHAT_* variable.
type Config struct {
	AppID    string // KAMI_WECHAT_APP_ID
	MchID    string // KAMI_WECHAT_MCH_ID
	SerialNo string // KAMI_WECHAT_SERIAL_NO: serial of the merchant API certificate
	// PrivateKey is the merchant API private key (apiclient_key.pem), as
	// PEM text or a path to a PEM file. KAMI_WECHAT_PRIVATE_KEY.
	PrivateKey string
	APIv3Key   string // KAMI_WECHAT_API_V3_KEY, 32 bytes
	// PlatformPublicKey is WeChat Pay's public key (PEM text or path) and
	// PlatformPublicKeyID its ID. KAMI_WECHAT_PLATFORM_PUBLIC_KEY and
	// KAMI_WECHAT_PLATFORM_PUBLIC_KEY_ID.
	PlatformPublicKey   string
	PlatformPublicKeyID string
	// APIBase overrides the gateway's base URL (KAMI_WECHAT_API_BASE). A
	// path prefix is kept in requests but not signed, as the gateway behind a
	// prefix-stripping proxy expects.
	APIBase string
	// NotifyURL is where WeChat Pay sends payment and refund notifications
	// (kami's /webhooks/wechat).
	NotifyURL string
	Timeout   time.Duration
}

// Client is the WeChat Pay v3 provider.
type Client struct {
	appID       string
	mchID       string
	notifyURL   string
	apiV3Key    string
	platformKey *rsa.PublicKey
	platformID  string
	gp          *wv3.ClientV3
	now         func() time.Time
}

var _ providers.Provider = (*Client)(nil)

// New checks cfg and builds a client. An error names the KAMI_WECHAT_*
// setting that is wrong and never repeats a key.
func New(cfg Config) (*Client, error) {
	required := []struct{ env, val string }{
		{"KAMI_WECHAT_APP_ID", cfg.AppID},
		{"KAMI_WECHAT_MCH_ID", cfg.MchID},
		{"KAMI_WECHAT_SERIAL_NO", cfg.SerialNo},
		{"KAMI_WECHAT_PRIVATE_KEY", cfg.PrivateKey},
		{"KAMI_WECHAT_API_V3_KEY", cfg.APIv3Key},
		{"KAMI_WECHAT_PLATFORM_PUBLIC_KEY", cfg.PlatformPublicKey},
		{"KAMI_WECHAT_PLATFORM_PUBLIC_KEY_ID", cfg.PlatformPublicKeyID},
	}
	for _, r := range required {
		if strings.TrimSpace(r.val) == "" {
			return nil, fmt.Errorf("wechat: %s is not set", r.env)
		}
	}
	for _, r := range required[:3] {
		if strings.TrimSpace(r.val) != r.val || strings.ContainsAny(r.val, "\"\r\n") {
			return nil, fmt.Errorf("wechat: %s has spaces, quotes or line breaks", r.env)
		}
	}
	if len(cfg.APIv3Key) != 32 {
		return nil, errors.New("wechat: KAMI_WECHAT_API_V3_KEY must be 32 bytes")
	}
	if !strings.HasPrefix(cfg.PlatformPublicKeyID, publicKeyIDPrefix) {
		return nil, fmt.Errorf("wechat: KAMI_WECHAT_PLATFORM_PUBLIC_KEY_ID must start with %s", publicKeyIDPrefix)
	}

	privPEM, err := loadPEM(cfg.PrivateKey)
	if err != nil {
		return nil, fmt.Errorf("wechat: KAMI_WECHAT_PRIVATE_KEY: %w", err)
	}
	if _, err := parsePrivateKey(privPEM); err != nil {
		return nil, fmt.Errorf("wechat: KAMI_WECHAT_PRIVATE_KEY: %w", err)
	}
	pubPEM, err := loadPEM(cfg.PlatformPublicKey)
	if err != nil {
		return nil, fmt.Errorf("wechat: KAMI_WECHAT_PLATFORM_PUBLIC_KEY: %w", err)
	}
	pub, err := parsePublicKey(pubPEM)
	if err != nil {
		return nil, fmt.Errorf("wechat: KAMI_WECHAT_PLATFORM_PUBLIC_KEY: %w", err)
	}

	base := DefaultAPIBase
	if cfg.APIBase != "" {
		base, err = checkAPIBase(cfg.APIBase)
		if err != nil {
			return nil, fmt.Errorf("wechat: KAMI_WECHAT_API_BASE: %w", err)
		}
	}
	timeout := cfg.Timeout
	if timeout < 0 {
		return nil, errors.New("wechat: timeout must not be negative")
	}
	if timeout == 0 {
		timeout = DefaultTimeout
	}

	// gopay's own errors quote the key text, so they are never passed on:
	// the keys were checked above and a failure here is ours to report.
	gp, err := wv3.NewClientV3(cfg.MchID, cfg.SerialNo, cfg.APIv3Key, string(privPEM))
	if err != nil {
		return nil, errors.New("wechat: KAMI_WECHAT_PRIVATE_KEY: gopay refused the key")
	}
	// Public key mode with automatic verification of every 2xx answer.
	if err := gp.AutoVerifySignByPublicKey(pubPEM, cfg.PlatformPublicKeyID); err != nil {
		return nil, errors.New("wechat: KAMI_WECHAT_PLATFORM_PUBLIC_KEY: gopay refused the key")
	}
	// gopay has a host setter (SetProxyHost): no transport rewriting needed.
	gp.SetProxyHost(base)
	hc := gp.GetHttpClient()
	hc.SetTimeout(timeout)
	hc.SetTransport(noCertDownload{next: hc.HttpClient.Transport})

	return &Client{
		appID:       cfg.AppID,
		mchID:       cfg.MchID,
		notifyURL:   cfg.NotifyURL,
		apiV3Key:    cfg.APIv3Key,
		platformKey: pub,
		platformID:  cfg.PlatformPublicKeyID,
		gp:          gp,
		now:         time.Now,
	}, nil
}

// noCertDownload stops gopay's one call of its own: when an answer names a
// serial it has no key for (and not PUB_KEY_ID_...), gopay goes to download
// platform certificates from /v3/certificates, signed with the merchant key,
// and would trust whatever comes back. In public key mode that answer is
// simply unverified; the call then fails as Temporary.
type noCertDownload struct{ next http.RoundTripper }

func (t noCertDownload) RoundTrip(r *http.Request) (*http.Response, error) {
	if strings.HasSuffix(r.URL.Path, "/v3/certificates") {
		return nil, errors.New("wechat: platform certificate download refused: public key mode")
	}
	return t.next.RoundTrip(r)
}

// Name implements providers.Provider.
func (c *Client) Name() string { return Name }

// loadPEM returns s when it is PEM text, else the content of the file s
// names. Its errors never quote s: s may be a key pasted without its PEM
// armour.
func loadPEM(s string) ([]byte, error) {
	if strings.Contains(s, "-----BEGIN") {
		return []byte(s), nil
	}
	b, err := os.ReadFile(s)
	if err != nil {
		return nil, errors.New("neither PEM text nor a readable PEM file")
	}
	if !strings.Contains(string(b), "-----BEGIN") {
		return nil, errors.New("the file holds no PEM block")
	}
	return b, nil
}

func parsePrivateKey(b []byte) (*rsa.PrivateKey, error) {
	block, _ := pem.Decode(b)
	if block == nil {
		return nil, errors.New("no PEM block")
	}
	if k, err := x509.ParsePKCS1PrivateKey(block.Bytes); err == nil {
		return k, nil
	}
	k, err := x509.ParsePKCS8PrivateKey(block.Bytes)
	if err != nil {
		return nil, errors.New("not a PKCS#1 or PKCS#8 private key")
	}
	rk, ok := k.(*rsa.PrivateKey)
	if !ok {
		return nil, errors.New("not an RSA private key")
	}
	return rk, nil
}

func parsePublicKey(b []byte) (*rsa.PublicKey, error) {
	block, _ := pem.Decode(b)
	if block == nil {
		return nil, errors.New("no PEM block")
	}
	var key any
	var err error
	switch block.Type {
	case "PUBLIC KEY":
		key, err = x509.ParsePKIXPublicKey(block.Bytes)
	case "RSA PUBLIC KEY":
		key, err = x509.ParsePKCS1PublicKey(block.Bytes)
	case "CERTIFICATE":
		var cert *x509.Certificate
		cert, err = x509.ParseCertificate(block.Bytes)
		if err == nil {
			key = cert.PublicKey
		}
	default:
		return nil, fmt.Errorf("PEM block %q is not a public key", block.Type)
	}
	if err != nil {
		return nil, errors.New("unreadable public key")
	}
	rk, ok := key.(*rsa.PublicKey)
	if !ok {
		return nil, errors.New("not an RSA public key")
	}
	return rk, nil
}

func checkAPIBase(s string) (string, error) {
	u, err := url.Parse(s)
	if err != nil {
		return "", errors.New("not a URL")
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return "", errors.New("scheme must be http or https")
	}
	if u.Host == "" || u.User != nil || u.RawQuery != "" || u.Fragment != "" {
		return "", errors.New("must be scheme://host[:port][/prefix] with no query")
	}
	return strings.TrimSuffix(s, "/"), nil
}
