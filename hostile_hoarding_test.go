package main

import (
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/providers/wechat/wechatemu"
)

// The hoarding and identity attacks, each against a whole
// server over HTTP.

func codes(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s-%05d", prefix, i)
	}
	return out
}

// lockedCards counts the cards held by unpaid orders.
func (ta *testApp) lockedCards(t *testing.T) int {
	t.Helper()
	n, err := ta.db.NewSelect().Table("card_stock").Where("status = ?", domain.CardLocked).Count(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return int(n)
}

// TestHoarderCannotLockTheShop: 20 unpaid orders of 100 from one address
// locked 2,000 cards, a whole product, for 15 minutes. With the default
// caps one address holds at most 200 cards and one contact 100, however it
// writes its contact, and a forged X-Forwarded-For changes nothing when no
// proxy is trusted.
func TestHoarderCannotLockTheShop(t *testing.T) {
	t.Parallel()
	ta := newTestApp(t, dbtest.SQLite, env{"KAMI_MAX_PENDING_PER_ADDRESS": "20"})
	p := ta.product(t, 100, codes("H", 2000)...)
	refused := 0
	for i := range 20 {
		r := ta.graphql(t, createOrderMutation, orderInput(p.ID, 100, fmt.Sprintf("hoarder%d@example.com", i), "sandbox", ""),
			"X-Forwarded-For", fmt.Sprintf("198.51.100.%d", i)) // forged: no proxy is trusted
		switch r.code() {
		case "":
		case domain.ELIMIT:
			refused++
		default:
			t.Fatalf("order %d: %+v", i, r.Errors)
		}
	}
	if locked := ta.lockedCards(t); locked != 200 || refused != 18 {
		t.Fatalf("%d cards locked and %d orders refused, want 200 and 18", locked, refused)
	}

	// One contact, written five ways, from other addresses: 100 cards.
	ta2 := newTestAppWith(t, dbtest.SQLite, env{"KAMI_TRUSTED_PROXIES": "127.0.0.1"}, nil)
	p2 := ta2.product(t, 100, codes("C", 500)...)
	for i, contact := range []string{"Buyer@Example.com", " buyer@example.com", "BUYER@EXAMPLE.COM\u200b", "ｂｕｙｅｒ＠ｅｘａｍｐｌｅ．ｃｏｍ", "buyer@example.com"} {
		r := ta2.graphql(t, createOrderMutation, orderInput(p2.ID, 40, contact, "sandbox", ""),
			"X-Forwarded-For", fmt.Sprintf("203.0.113.%d", i+1))
		want := ""
		if i >= 2 {
			want = domain.ELIMIT
		}
		if r.code() != want {
			t.Errorf("order %d as %q: %+v, want %q", i, contact, r.Errors, want)
		}
	}
	if locked := ta2.lockedCards(t); locked != 80 {
		t.Fatalf("%d cards locked by one contact, want 80", locked)
	}
	var stored []string
	ta2.db.NewSelect().Table("orders").ColumnExpr("DISTINCT contact").Scan(t.Context(), &stored)
	if len(stored) != 1 || stored[0] != "buyer@example.com" {
		t.Errorf("stored contacts %q, want one, normalized", stored)
	}
}

// TestQuantityCheckedBeforeTheStockGate: quantity 2^31 answered SOLD_OUT;
// it is BAD_INPUT, as is any quantity over the product's limit, and an
// order for a product that does not exist is NOT_FOUND without building a
// stock counter for it.
func TestQuantityCheckedBeforeTheStockGate(t *testing.T) {
	t.Parallel()
	ta := newTestApp(t, dbtest.SQLite, nil)
	p := ta.product(t, 100, codes("Q", 5)...)
	for _, qty := range []int{math.MaxInt32 + 1, 101, 1_000_000} {
		if r := ta.graphql(t, createOrderMutation, orderInput(p.ID, qty, "q@example.com", "sandbox", "")); r.code() != domain.EBADINPUT {
			t.Errorf("quantity %d: %+v, want BAD_INPUT", qty, r.Errors)
		}
	}
	if r := ta.graphql(t, createOrderMutation, orderInput(p.ID, 6, "q@example.com", "sandbox", "")); r.code() != domain.ESOLDOUT {
		t.Errorf("6 of 5 cards: %+v, want SOLD_OUT", r.Errors)
	}
	for id := int64(900_001); id < 900_051; id++ {
		if r := ta.graphql(t, createOrderMutation, orderInput(id, 1, "q@example.com", "sandbox", "")); r.code() != domain.ENOTFOUND {
			t.Fatalf("product %d: %+v, want NOT_FOUND", id, r.Errors)
		}
	}
	keys, err := ta.rdb.Keys(t.Context(), ta.keys.Prefix()+"stock:*").Result()
	if err != nil {
		t.Fatal(err)
	}
	// The real product's counter (and its operations record) only: no
	// key for a product that does not exist.
	for _, k := range keys {
		if !strings.Contains(k, fmt.Sprintf("{%d}", p.ID)) {
			t.Errorf("stock keys after 50 made-up products: %v", keys)
			break
		}
	}
}

// TestIdempotencyKeyIsNotAPassword: a replay of someone's idempotency key
// with their order's every field from another address got their access
// token. Now a key only replays to the address that used it: there it is
// the same order (a storefront's retry), elsewhere it places an order of
// its own, and the first order stays its buyer's.
func TestIdempotencyKeyIsNotAPassword(t *testing.T) {
	t.Parallel()
	ta := newTestApp(t, dbtest.SQLite, env{"KAMI_TRUSTED_PROXIES": "127.0.0.1"})
	p := ta.product(t, 100, codes("K", 5)...)
	in := orderInput(p.ID, 1, "victim@example.com", "sandbox", "order-42")
	var first, retry, thief placedOrder
	ta.graphql(t, createOrderMutation, in, "X-Forwarded-For", "2001:db8:aa:1::10").decode(t, &first)
	// The same phone, another address of its /64 (IPv6 privacy addresses).
	ta.graphql(t, createOrderMutation, in, "X-Forwarded-For", "2001:db8:aa:1::77").decode(t, &retry)
	if retry.CreateOrder.Order.OrderNo != first.CreateOrder.Order.OrderNo || retry.CreateOrder.AccessToken != first.CreateOrder.AccessToken {
		t.Fatalf("the buyer's retry: %+v, want %+v", retry, first)
	}
	ta.graphql(t, createOrderMutation, in, "X-Forwarded-For", "192.0.2.66").decode(t, &thief)
	if thief.CreateOrder.AccessToken == first.CreateOrder.AccessToken || thief.CreateOrder.Order.OrderNo == first.CreateOrder.Order.OrderNo {
		t.Fatal("a replay from another address got the buyer's order and token")
	}
	const read = `query($no: String!, $t: String) { order(orderNo: $no, accessToken: $t) { status } }`
	if r := ta.graphql(t, read, map[string]any{"no": first.CreateOrder.Order.OrderNo, "t": thief.CreateOrder.AccessToken}); r.code() != domain.ENOTFOUND {
		t.Fatalf("the thief's token on the buyer's order: %+v", r.Errors)
	}
}

// wechatApp is a whole kami with WeChat Pay (its emulator), the sandbox
// secret set beside it, and 127.0.0.1 as its trusted proxy.
func wechatApp(t *testing.T, extra env) (*testApp, *wechatemu.Server) {
	t.Helper()
	merchant, err := wechatemu.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	platform, err := wechatemu.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	const serial = "5157F09EFDC096DE15EBE81A47057A72"
	emu, err := wechatemu.New(wechatemu.Options{MerchantSerialNo: serial, MerchantPublicKey: &merchant.PublicKey, PlatformKey: platform})
	if err != nil {
		t.Fatal(err)
	}
	gw := httptest.NewServer(emu)
	t.Cleanup(gw.Close)
	key, err := wechatemu.PrivateKeyPEM(merchant)
	if err != nil {
		t.Fatal(err)
	}
	e := env{"KAMI_WECHAT_APP_ID": emu.AppID(), "KAMI_WECHAT_MCH_ID": emu.MchID(), "KAMI_WECHAT_SERIAL_NO": serial,
		"KAMI_WECHAT_PRIVATE_KEY": key, "KAMI_WECHAT_API_V3_KEY": emu.APIv3Key(),
		"KAMI_WECHAT_PLATFORM_PUBLIC_KEY": emu.PlatformPublicKeyPEM(), "KAMI_WECHAT_PLATFORM_PUBLIC_KEY_ID": emu.PlatformPublicKeyID(),
		"KAMI_WECHAT_API_BASE": gw.URL, "KAMI_PUBLIC_URL": "https://kami.test", "KAMI_TRUSTED_PROXIES": "127.0.0.1/32, 10.0.0.0/8"}
	for k, v := range extra {
		e[k] = v
	}
	return newTestApp(t, dbtest.SQLite, e), emu
}

// TestBehindTrustedProxies: behind nginx every buyer was the proxy's
// address, for the caps and as the payer's IP sent to the gateway. With
// KAMI_TRUSTED_PROXIES the client is the rightmost address in
// X-Forwarded-For that is not a trusted proxy; what the client wrote to its
// left is ignored.
func TestBehindTrustedProxies(t *testing.T) {
	t.Parallel()
	ta, emu := wechatApp(t, nil)
	p := ta.product(t, 100, codes("P", 10)...)
	for _, tc := range []struct{ xff []string }{
		{[]string{"198.51.100.7"}},
		{[]string{"198.51.100.7, 10.1.2.3"}},                 // through two trusted proxies
		{[]string{"6.6.6.6, 198.51.100.7, 10.1.2.3"}},        // the client forged the first
		{[]string{"6.6.6.6", "198.51.100.7, 10.1.2.3"}},      // as two header lines
		{[]string{"[2001:db8::1]:4711, 198.51.100.7:51000"}}, // ports, brackets
	} {
		h := []string{"Content-Type", "application/json"}
		for _, v := range tc.xff {
			h = append(h, "X-Forwarded-For", v)
		}
		in := orderInput(p.ID, 1, fmt.Sprintf("proxied-%d@example.com", len(strings.Join(tc.xff, ""))), "wechat", "")
		in["in"].(map[string]any)["method"] = "h5"
		var placed placedOrder
		ta.graphql(t, createOrderMutation, in, h...).decode(t, &placed)
		no := placed.CreateOrder.Order.OrderNo
		if ip := emu.PayerClientIP(no); ip != "198.51.100.7" {
			t.Errorf("X-Forwarded-For %q: the gateway was told the payer is %q", tc.xff, ip)
		}
		o, err := ta.ledger.Order(t.Context(), no)
		if err != nil || o.ClientAddr != "198.51.100.7" {
			t.Errorf("X-Forwarded-For %q: the order counts against %q", tc.xff, o.ClientAddr)
		}
	}
}

// TestSandboxBesideRealProviders: with WeChat Pay configured and
// KAMI_SANDBOX_SECRET set, buyers could pick the sandbox and take codes for
// free. Now it is not offered and its pay page is gone; signed sandbox
// notifications are still accepted for existing orders. With
// KAMI_SANDBOX_GIVES_CODES_AWAY=1 it is offered again.
func TestSandboxBesideRealProviders(t *testing.T) {
	t.Parallel()
	ta, _ := wechatApp(t, nil)
	p := ta.product(t, 100, codes("S", 3)...)
	if r := ta.graphql(t, createOrderMutation, orderInput(p.ID, 1, "free@example.com", "sandbox", "")); r.code() != domain.EBADINPUT {
		t.Fatalf("the sandbox beside WeChat Pay: %+v", r.Errors)
	}
	if res, err := http.Get(ta.srv.URL + "/sandbox/pay/26120100000000000001"); err != nil || res.StatusCode != http.StatusNotFound {
		t.Fatalf("the sandbox pay page: %v %v", res.StatusCode, err)
	}
	if ta.lockedCards(t) != 0 {
		t.Fatal("cards locked")
	}
	// Introspection is off by default in a shop with a real provider.
	if r := ta.graphql(t, `{ __schema { queryType { name } } }`, nil); r.code() != "GRAPHQL_VALIDATION_FAILED" {
		t.Errorf("introspection with a real provider: %+v", r.Errors)
	}

	open, _ := wechatApp(t, env{"KAMI_SANDBOX_GIVES_CODES_AWAY": "1", "KAMI_GRAPHQL_INTROSPECTION": "on"})
	p2 := open.product(t, 100, codes("S", 3)...)
	var placed placedOrder
	open.graphql(t, createOrderMutation, orderInput(p2.ID, 1, "free@example.com", "sandbox", "")).decode(t, &placed)
	if r := open.graphql(t, `{ __schema { queryType { name } } }`, nil); r.code() != "" {
		t.Errorf("introspection turned on: %+v", r.Errors)
	}
}

// TestSandboxWarnedAtStart: whenever buyers can pay with the sandbox the
// start says so, loudest beside real providers.
func TestSandboxWarnedAtStart(t *testing.T) {
	t.Parallel()
	real := env{"KAMI_ALIPAY_APP_ID": "2021000000000001"}
	for _, tc := range []struct {
		name  string
		e     env
		level string
		says  string
	}{
		{"no provider", env{}, "WARN", "anyone can take card codes"},
		{"gives codes away", env{"KAMI_SANDBOX_GIVES_CODES_AWAY": "1"}, "ERROR", "THE SANDBOX GIVES CODES AWAY"},
		{"secret beside a provider", env{"KAMI_SANDBOX_SECRET": "s"}, "INFO", "buyers cannot pick the sandbox"},
	} {
		e := env{}
		for k, v := range tc.e {
			e[k] = v
		}
		if tc.name != "no provider" {
			for k, v := range real {
				e[k] = v
			}
		}
		cfg, err := loadConfig(e.get)
		if err != nil {
			t.Fatal(err)
		}
		var out strings.Builder
		warnSandbox(cfg, slog.New(slog.NewTextHandler(&out, &slog.HandlerOptions{Level: slog.LevelDebug})))
		if !strings.Contains(out.String(), "level="+tc.level) || !strings.Contains(out.String(), tc.says) {
			t.Errorf("%s: %q", tc.name, out.String())
		}
	}
}
