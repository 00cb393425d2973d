package wechat_test

import (
	"crypto/rsa"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"kami/providers/wechat"
	"kami/providers/wechat/wechatemu"
)

const merchantSerial = "3775B6A45ACD588826D15E583A95F5DD********"

// RSA keys take a while to make; every test shares these.
var keys = sync.OnceValues(func() (*testKeys, error) {
	var k testKeys
	var err error
	for _, p := range []**rsa.PrivateKey{&k.merchant, &k.platform, &k.stranger} {
		if *p, err = wechatemu.GenerateKey(); err != nil {
			return nil, err
		}
	}
	if k.merchantPEM, err = wechatemu.PrivateKeyPEM(k.merchant); err != nil {
		return nil, err
	}
	if k.strangerPEM, err = wechatemu.PrivateKeyPEM(k.stranger); err != nil {
		return nil, err
	}
	return &k, nil
})

type testKeys struct {
	merchant, platform, stranger *rsa.PrivateKey
	merchantPEM, strangerPEM     string
}

// bundle is what a test needs: an emulated gateway on a loopback server and
// a client configured for it.
type bundle struct {
	keys   *testKeys
	emu    *wechatemu.Server
	srv    *httptest.Server
	cfg    wechat.Config
	client *wechat.Client
}

type setupOptions struct {
	emu func(*wechatemu.Options)
	cfg func(*wechat.Config)
}

func setup(t testing.TB, o setupOptions) *bundle {
	t.Helper()
	k, err := keys()
	if err != nil {
		t.Fatalf("keys: %v", err)
	}
	opts := wechatemu.Options{
		MerchantSerialNo:  merchantSerial,
		MerchantPublicKey: &k.merchant.PublicKey,
		PlatformKey:       k.platform,
		SlowDelay:         200 * time.Millisecond,
	}
	if o.emu != nil {
		o.emu(&opts)
	}
	emu, err := wechatemu.New(opts)
	if err != nil {
		t.Fatalf("wechatemu.New: %v", err)
	}
	srv := httptest.NewServer(emu)
	t.Cleanup(srv.Close)

	cfg := wechat.Config{
		AppID:               emu.AppID(),
		MchID:               emu.MchID(),
		SerialNo:            merchantSerial,
		PrivateKey:          k.merchantPEM,
		APIv3Key:            emu.APIv3Key(),
		PlatformPublicKey:   emu.PlatformPublicKeyPEM(),
		PlatformPublicKeyID: emu.PlatformPublicKeyID(),
		APIBase:             srv.URL,
		NotifyURL:           "https://shop.example.com/webhooks/wechat",
		Timeout:             time.Second,
	}
	if o.cfg != nil {
		o.cfg(&cfg)
	}
	client, err := wechat.New(cfg)
	if err != nil {
		t.Fatalf("wechat.New: %v", err)
	}
	return &bundle{keys: k, emu: emu, srv: srv, cfg: cfg, client: client}
}

// must unwraps an emulator notification for a test.
func must(t testing.TB) func(http.Header, []byte, error) (http.Header, []byte) {
	return func(h http.Header, b []byte, err error) (http.Header, []byte) {
		t.Helper()
		if err != nil {
			t.Fatalf("emulator: %v", err)
		}
		return h, b
	}
}
