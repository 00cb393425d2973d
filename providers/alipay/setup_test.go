package alipay_test

import (
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"kami/providers"
	"kami/providers/alipay"
	"kami/providers/alipay/alipayemu"
	"kami/providers/providertest"
)

// appKey is the app's key pair, made once: RSA key generation is the slow
// part of setting up an emulator.
var appKey = sync.OnceValue(newKey)

// gatewayKey is the emulators' "Alipay" key, shared for the same reason;
// every emulator still keeps its own trades.
var gatewayKey = sync.OnceValue(newKey)

// forgeKey signs the forgeries.
var forgeKey = sync.OnceValue(newKey)

func newKey() *rsa.PrivateKey {
	k, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		panic(err)
	}
	return k
}

func appKeyPEM() string {
	return string(pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(appKey())}))
}

// bundle is what a test needs: an emulator, its server and an adapter
// pointed at it.
type bundle struct {
	emu    *alipayemu.Server
	srv    *httptest.Server
	client *alipay.Client
	cfg    alipay.Config
}

type setupOpts struct {
	timeout time.Duration
	now     func() time.Time
	// early makes the emulator publish today's bill at once.
	early bool
}

func setup(t testing.TB, opts ...setupOpts) *bundle {
	t.Helper()
	var o setupOpts
	if len(opts) > 0 {
		o = opts[0]
	}
	if o.timeout == 0 {
		o.timeout = time.Second
	}
	emu, err := alipayemu.New(alipayemu.Options{
		AppPublicKey: &appKey().PublicKey,
		GatewayKey:   gatewayKey(),
		ForgeKey:     forgeKey(),
		Hold:         5 * time.Second,
		Slow:         100 * time.Millisecond,
		Now:          o.now,

		EarlyStatements: o.early,
	})
	if err != nil {
		t.Fatalf("alipayemu.New: %v", err)
	}
	srv := httptest.NewServer(emu)
	t.Cleanup(srv.Close)
	cfg := alipay.Config{
		AppID:           emu.AppID(),
		PrivateKey:      appKeyPEM(),
		AlipayPublicKey: emu.PublicKeyPEM(),
		Gateway:         srv.URL,
		SellerID:        alipayemu.SellerID,
		NotifyURL:       "https://shop.example.com/webhooks/alipay",
		ReturnURL:       "https://shop.example.com/paid",
		Timeout:         o.timeout,
	}
	c, err := alipay.New(cfg)
	if err != nil {
		t.Fatalf("alipay.New: %v", err)
	}
	return &bundle{emu: emu, srv: srv, client: c, cfg: cfg}
}

func (b *bundle) harness() providertest.Harness {
	must := func(t testing.TB, h http.Header, body []byte, err error) (http.Header, []byte) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return h, body
	}
	return providertest.Harness{
		Provider: b.client,
		Pay: func(t testing.TB, orderNo string, amountFen int64) (http.Header, []byte) {
			h, body, err := b.emu.Pay(orderNo, amountFen)
			return must(t, h, body, err)
		},
		RefundNotification: func(t testing.TB, refundNo string) (http.Header, []byte) {
			h, body, err := b.emu.RefundNotification(refundNo)
			return must(t, h, body, err)
		},
		Forge: func(t testing.TB, orderNo string, amountFen int64) (http.Header, []byte) {
			return b.emu.Forge(orderNo, amountFen)
		},
		OtherMerchant: func(t testing.TB, orderNo string, amountFen int64) (http.Header, []byte) {
			return b.emu.OtherApp(orderNo, amountFen)
		},
		InjectFault: b.emu.InjectFault,
		Refunded:    b.emu.Refunded,
		StatementFaults: []providertest.StatementFault{
			{Op: providertest.OpStatement, Fault: providertest.FaultBusiness, Kind: providers.Rejected},
			{Op: providertest.OpStatement, Fault: alipayemu.FaultBadSignature, Kind: providers.Temporary},
			{Op: alipayemu.OpDownload, Fault: providertest.Fault5xx, Kind: providers.Temporary},
			{Op: alipayemu.OpDownload, Fault: alipayemu.FaultGarbage, Kind: providers.Temporary},
			{Op: alipayemu.OpDownload, Fault: alipayemu.FaultTruncated, Kind: providers.Temporary},
		},
		SupportsClose:        true,
		SupportsQueryPayment: true,
	}
}

func TestContract(t *testing.T) {
	t.Parallel()
	providertest.Run(t, setup(t, setupOpts{early: true}).harness())
}
