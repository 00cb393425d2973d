package domain_test

import (
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"kami/domain"
	"kami/providers"
	"kami/providers/alipay"
	"kami/providers/alipay/alipayemu"
	"kami/providers/fault"
	"kami/providers/wechat"
	"kami/providers/wechat/wechatemu"
)

// gateway is a real gopay client wired to its gateway emulator, with the
// test's hands on the emulator: the buyer paying, a notification for a
// payment the gateway never took, faults.
type gateway struct {
	name     string
	provider providers.Provider
	// pay makes the buyer pay orderNo at the gateway and returns the
	// notification the gateway sends (which a test may drop).
	pay func(t testing.TB, orderNo string, fen int64) note
	// phantom returns a notification, signed by the gateway, of a payment
	// the gateway's books do not have.
	phantom func(t testing.TB, orderNo string, fen int64) note
	fault   func(op fault.Op, f fault.Fault, n int)
	// refunded is what the gateway refunded under a refund number, and how
	// many refund calls named it.
	refunded func(refundNo string) (fen int64, calls int)
	// finishRefund finishes a refund the gateway left processing (see
	// slowRefundGateways).
	finishRefund func(t testing.TB, refundNo string)
}

// note is a notification as the gateway posts it.
type note struct {
	header http.Header
	body   []byte
}

// gatewayTimeout is the clients' timeout: far above a loopback answer on a
// busy machine, and what a refund whose answer is lost takes to fail.
const gatewayTimeout = 2 * time.Second

// gatewayKeys are the RSA keys of the emulators and their merchants, made
// once: making them is the slow part.
var gatewayKeys = sync.OnceValue(func() [4]*rsa.PrivateKey {
	var ks [4]*rsa.PrivateKey
	for i := range ks {
		k, err := rsa.GenerateKey(rand.Reader, 2048)
		if err != nil {
			panic(err)
		}
		ks[i] = k
	}
	return ks
})

// gateways returns an Alipay and a WeChat Pay gateway, each with its own
// emulator (serving today's statement at once).
func gateways(t testing.TB) []*gateway {
	t.Helper()
	return []*gateway{alipayGateway(t), wechatGateway(t)}
}

func alipayGateway(t testing.TB) *gateway { return alipayGatewayWith(t, true) }

// alipayGatewayWith is alipayGateway; early says whether its emulator
// serves today's statement at once (or only tomorrow, as Alipay does).
func alipayGatewayWith(t testing.TB, early bool) *gateway {
	return alipayGatewayOpts(t, func(o *alipayemu.Options) { o.EarlyStatements = early })
}

// slowRefundGateways are gateways whose refunds stay processing, as a
// refund to a bank card does for days, until finishRefund.
func slowRefundGateways(t testing.TB) []*gateway {
	return []*gateway{
		alipayGatewayOpts(t, func(o *alipayemu.Options) { o.EarlyStatements, o.RefundProcessing = true, true }),
		wechatGatewayOpts(t, func(o *wechatemu.Options) { o.RefundStaysProcessing = true }),
	}
}

func alipayGatewayOpts(t testing.TB, opts func(*alipayemu.Options)) *gateway {
	t.Helper()
	ks := gatewayKeys()
	o := alipayemu.Options{AppPublicKey: &ks[0].PublicKey, GatewayKey: ks[1], Hold: 2 * gatewayTimeout}
	opts(&o)
	emu, err := alipayemu.New(o)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(emu)
	t.Cleanup(srv.Close)
	client, err := alipay.New(alipay.Config{AppID: emu.AppID(),
		PrivateKey:      string(pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(ks[0])})),
		AlipayPublicKey: emu.PublicKeyPEM(), Gateway: srv.URL, NotifyURL: "https://shop.example.com/webhooks/alipay", Timeout: gatewayTimeout})
	if err != nil {
		t.Fatal(err)
	}
	return &gateway{
		name: alipay.Name, provider: client, fault: emu.InjectFault, refunded: emu.Refunded,
		pay: payAt(emu),
		finishRefund: func(t testing.TB, refundNo string) {
			if err := emu.FinishRefund(refundNo); err != nil {
				t.Fatal(err)
			}
		},
		phantom: func(t testing.TB, orderNo string, fen int64) note {
			return note{alipayemu.NotificationHeader(), emu.Notification(emu.PaymentFields(orderNo, fen))}
		},
	}
}

func wechatGateway(t testing.TB) *gateway { return wechatGatewayOpts(t, func(*wechatemu.Options) {}) }

func wechatGatewayOpts(t testing.TB, opts func(*wechatemu.Options)) *gateway {
	t.Helper()
	ks := gatewayKeys()
	const serial = "3775B6A45ACD588826D15E583A95F5DD00000001"
	o := wechatemu.Options{MerchantSerialNo: serial, MerchantPublicKey: &ks[2].PublicKey, PlatformKey: ks[3],
		HoldMax: 2 * gatewayTimeout, EarlyStatements: true}
	opts(&o)
	emu, err := wechatemu.New(o)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(emu)
	t.Cleanup(srv.Close)
	merchantPEM, err := wechatemu.PrivateKeyPEM(ks[2])
	if err != nil {
		t.Fatal(err)
	}
	client, err := wechat.New(wechat.Config{AppID: emu.AppID(), MchID: emu.MchID(), SerialNo: serial, PrivateKey: merchantPEM,
		APIv3Key: emu.APIv3Key(), PlatformPublicKey: emu.PlatformPublicKeyPEM(), PlatformPublicKeyID: emu.PlatformPublicKeyID(),
		APIBase: srv.URL, NotifyURL: "https://shop.example.com/webhooks/wechat", Timeout: gatewayTimeout})
	if err != nil {
		t.Fatal(err)
	}
	return &gateway{
		name: wechat.Name, provider: client, fault: emu.InjectFault, refunded: emu.Refunded,
		pay: payAt(emu),
		finishRefund: func(t testing.TB, refundNo string) {
			if err := emu.SetRefundStatus(refundNo, "SUCCESS"); err != nil {
				t.Fatal(err)
			}
		},
		phantom: func(t testing.TB, orderNo string, fen int64) note {
			t.Helper()
			h, b, err := emu.Notify(wechatemu.Notification{EventType: "TRANSACTION.SUCCESS", OriginalType: "transaction",
				Resource: emu.PaymentResource(orderNo, fen, emu.MchID(), emu.AppID())})
			if err != nil {
				t.Fatal(err)
			}
			return note{h, b}
		},
	}
}

// payAt is a gateway's pay: the emulator takes the buyer's money.
func payAt(emu interface {
	Pay(orderNo string, fen int64) (http.Header, []byte, error)
}) func(t testing.TB, orderNo string, fen int64) note {
	return func(t testing.TB, orderNo string, fen int64) note {
		t.Helper()
		h, b, err := emu.Pay(orderNo, fen)
		if err != nil {
			t.Fatal(err)
		}
		return note{h, b}
	}
}

// shopFor is a Shop over b's ledger with the gateway's provider, closing
// without asking the gateway first (as when that question failed), so
// that a test can close an order whose buyer paid.
func (b *bundle) shopFor(gws ...*gateway) *domain.Shop {
	var ps []providers.Provider
	for _, g := range gws {
		ps = append(ps, g.provider)
	}
	return &domain.Shop{Ledger: b.ledger, Providers: providers.NewRegistry(ps...), ProviderTimeout: gatewayTimeout,
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
}
