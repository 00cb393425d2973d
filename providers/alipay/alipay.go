// Package alipay is the Alipay open-platform provider, built on the gopay
// Alipay client (RSA2, public-key mode). It speaks to the gateway for QR
// payments, queries, closes and refunds, builds signed page/wap pay URLs
// locally, and verifies with Alipay's public key the asynchronous
// notifications, every successful answer (gopay does that) and every signed
// business error (we do: gopay does not, and ACQ.TRADE_NOT_EXIST taken on
// trust would read "nothing to close" or "never paid").
//
// Errors are *providers.Error only. gopay returns an error for a business
// failure (code != 10000); that becomes Rejected with Alipay's sub_code,
// except Alipay's "try again" codes (ACQ.SYSTEM_ERROR, isp.*, code 20000),
// which, like timeouts, transport failures and HTTP errors, are Temporary.
package alipay

import (
	"crypto/rsa"
	"crypto/x509"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"time"
	// The gateway works in Beijing time (timestamp, time_expire,
	// gmt_payment). Embedding the zone database keeps that right on hosts
	// without /usr/share/zoneinfo (scratch and distroless images).
	_ "time/tzdata"

	goalipay "github.com/go-pay/gopay/alipay"

	"kami/providers"
)

// Name is the provider's registry key.
const Name = "alipay"

// ProductionGateway is where gopay sends requests; Config.Gateway replaces it.
const ProductionGateway = "https://openapi.alipay.com/gateway.do"

// DefaultTimeout bounds one gateway call when Config.Timeout is zero.
const DefaultTimeout = 15 * time.Second

// beijing is the gateway's time zone.
var beijing = mustBeijing()

func mustBeijing() *time.Location {
	loc, err := time.LoadLocation("Asia/Shanghai")
	if err != nil {
		// Unreachable with time/tzdata embedded; China has no DST.
		return time.FixedZone("CST", 8*3600)
	}
	return loc
}

// alipayTime is the layout of every time the gateway reads or writes.
const alipayTime = "2006-01-02 15:04:05"

// Config is the merchant setup. Keys may be PEM text, a path to a PEM file,
// or the bare base64 key from Alipay's console.
type Config struct {
	AppID           string // KAMI_ALIPAY_APP_ID
	PrivateKey      string // KAMI_ALIPAY_PRIVATE_KEY: the app's RSA private key
	AlipayPublicKey string // KAMI_ALIPAY_PUBLIC_KEY: Alipay's public key, to verify
	Gateway         string // KAMI_ALIPAY_GATEWAY: base URL; empty is production
	// SellerID is KAMI_ALIPAY_SELLER_ID: the merchant's Alipay user id
	// (2088…, a PID). When set, a notification naming another seller_id is
	// refused: an app id can be authorised to act for several merchants,
	// and only payments to this shop's account pay its orders.
	SellerID  string
	NotifyURL string
	ReturnURL string
	Timeout   time.Duration // per gateway call; zero is DefaultTimeout
}

// Client is the Alipay provider.
type Client struct {
	appID    string
	sellerID string // "" when not configured
	pub      *rsa.PublicKey
	gateway  *url.URL // nil: production
	api      *goalipay.Client
	dl       *http.Client // downloads bills from the address the gateway gives
}

var _ providers.Provider = (*Client)(nil)

// New checks cfg and builds the client. Errors name the setting at fault and
// never repeat a key.
func New(cfg Config) (*Client, error) {
	appID := strings.TrimSpace(cfg.AppID)
	if appID == "" {
		return nil, fmt.Errorf("KAMI_ALIPAY_APP_ID: not set")
	}
	if strings.ContainsAny(appID, " \t\r\n&=") {
		return nil, fmt.Errorf("KAMI_ALIPAY_APP_ID: not an app id")
	}
	sellerID := strings.TrimSpace(cfg.SellerID)
	if sellerID != "" && !isSellerID(sellerID) {
		return nil, fmt.Errorf("KAMI_ALIPAY_SELLER_ID: want the 16-digit Alipay user id (PID) starting 2088")
	}
	priv, err := parsePrivateKey(cfg.PrivateKey)
	if err != nil {
		return nil, fmt.Errorf("KAMI_ALIPAY_PRIVATE_KEY: %w", err)
	}
	pub, err := parsePublicKey(cfg.AlipayPublicKey)
	if err != nil {
		return nil, fmt.Errorf("KAMI_ALIPAY_PUBLIC_KEY: %w", err)
	}
	if pub.Equal(&priv.PublicKey) {
		return nil, fmt.Errorf("KAMI_ALIPAY_PUBLIC_KEY: is the app's own public key, want Alipay's")
	}
	var gw *url.URL
	if s := strings.TrimSpace(cfg.Gateway); s != "" {
		if gw, err = parseGateway(s); err != nil {
			return nil, fmt.Errorf("KAMI_ALIPAY_GATEWAY: %w", err)
		}
	}
	timeout := cfg.Timeout
	if timeout <= 0 {
		timeout = DefaultTimeout
	}

	// gopay wants the bare base64 body; it adds the PEM lines itself. We
	// hand it our parsed key so that its parse errors (which quote the
	// key) can never happen.
	api, err := goalipay.NewClient(appID, base64.StdEncoding.EncodeToString(x509.MarshalPKCS1PrivateKey(priv)), true)
	if err != nil {
		return nil, fmt.Errorf("KAMI_ALIPAY_PRIVATE_KEY: gopay refused the key")
	}
	pubDER, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		return nil, fmt.Errorf("KAMI_ALIPAY_PUBLIC_KEY: %w", err)
	}
	// Despite its comment, AutoVerifySign accepts a plain PUBLIC KEY block
	// and then verifies every successful answer in public-key mode.
	api.AutoVerifySign(pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pubDER}))
	api.SetLocation("Asia/Shanghai")
	api.SetBodySize(1) // MiB; answers are a few KiB
	if cfg.NotifyURL != "" {
		api.SetNotifyUrl(cfg.NotifyURL)
	}
	if cfg.ReturnURL != "" {
		api.SetReturnUrl(cfg.ReturnURL)
	}
	hc := api.GetHttpClient()
	hc.SetTimeout(timeout)
	hc.SetTransport(&transport{target: gw, base: http.DefaultTransport.(*http.Transport).Clone()})
	// A bill is larger than an answer: its download gets more time.
	dl := &http.Client{Timeout: max(6*timeout, time.Minute), Transport: http.DefaultTransport.(*http.Transport).Clone()}
	return &Client{appID: appID, sellerID: sellerID, pub: pub, gateway: gw, api: api, dl: dl}, nil
}

// isSellerID: an Alipay user id is 16 digits starting 2088.
func isSellerID(s string) bool {
	if len(s) != 16 || !strings.HasPrefix(s, "2088") {
		return false
	}
	for _, r := range s {
		if r < '0' || r > '9' {
			return false
		}
	}
	return true
}

// Name implements providers.Provider.
func (c *Client) Name() string { return Name }
