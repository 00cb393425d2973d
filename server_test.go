package main

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/domain/domaintest"
	"kami/providers/sandbox"
	"kami/queue/redistest"
)

// env is a fake environment for loadConfig.
type env map[string]string

func (e env) get(k string) string { return e[k] }

func TestConfigDefaults(t *testing.T) {
	t.Parallel()
	c, err := loadConfig(env{}.get)
	if err != nil {
		t.Fatal(err)
	}
	if c.Addr != ":8080" || c.OrderTTL != 15*time.Minute || c.RedisPrefix != "kami:" || c.LatePayment != domain.LateRefund ||
		len(c.RefundBackoff) != 5 || c.RefundBackoff[0] != time.Minute || c.PublicURL != "http://localhost:8080" || !c.sandboxEnabled() ||
		c.MaxUploadBytes != 32<<20 {
		t.Fatalf("defaults %+v", c)
	}
	for v, want := range map[string]int64{"1048576": 1 << 20, "512KiB": 512 << 10, "64 MiB": 64 << 20, "1GiB": 1 << 30} {
		if c, err := loadConfig(env{"KAMI_MAX_UPLOAD_BYTES": v}.get); err != nil || c.MaxUploadBytes != want {
			t.Errorf("KAMI_MAX_UPLOAD_BYTES=%s: %d, %v; want %d", v, c.MaxUploadBytes, err, want)
		}
	}
}

func TestConfigErrorsNameTheSetting(t *testing.T) {
	t.Parallel()
	for name, value := range map[string]string{
		"KAMI_ORDER_TTL": "soon", "KAMI_REFUND_BACKOFF": "1m,never", "KAMI_LATE_PAYMENT": "maybe",
		"KAMI_MAX_PENDING_PER_CONTACT": "-1", "KAMI_CARD_KEY": "short", "KAMI_LOG_FORMAT": "xml",
		"KAMI_PUBLIC_URL": "ftp://x", "KAMI_MAX_QUANTITY": "0", "KAMI_STATEMENT_CRON": "at ten", "KAMI_MAX_UPLOAD_BYTES": "lots",
		"KAMI_RECONCILE_CRON": "nightly", "KAMI_WEBHOOK_TIMEOUT": "forever", "KAMI_WEBHOOK_RETRY_FOR": "1s",
		"KAMI_WEBHOOK_BACKOFF": "2h", "KAMI_WEBHOOK_ALLOW_PRIVATE": "maybe",
	} {
		_, err := loadConfig(env{name: value}.get)
		if err == nil || !strings.Contains(err.Error(), name) {
			t.Errorf("%s=%q: error %v does not name it", name, value, err)
		}
	}
	// A provider with a bad setting stops the start, naming it.
	c, _ := loadConfig(env{"KAMI_ALIPAY_APP_ID": "2021000000000000"}.get)
	if _, _, err := newProviders(c); err == nil || !strings.Contains(err.Error(), "KAMI_ALIPAY_PRIVATE_KEY") {
		t.Errorf("alipay without a key: %v", err)
	}
	if c.sandboxEnabled() {
		t.Error("the sandbox is on in a shop with merchant settings and no sandbox secret")
	}
}

func TestRunCommands(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	e := env{"KAMI_DATA_DIR": dir}
	var out bytes.Buffer
	if err := run(t.Context(), []string{"migrate"}, e.get, &out, io.Discard); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	if err := run(t.Context(), []string{"audit"}, e.get, &out, io.Discard); err != nil || !strings.Contains(out.String(), "clean") {
		t.Fatalf("audit: %v %q", err, out.String())
	}
	if err := run(t.Context(), []string{"frobnicate"}, e.get, &out, io.Discard); err == nil {
		t.Fatal("unknown command accepted")
	}
}

// testAdminToken is the test server's KAMI_ADMIN_TOKEN.
const testAdminToken = "admin-token-for-tests-0123456789abcdef"

// testApp is a whole server on a fresh database of kind k.
type testApp struct {
	*app
	srv *httptest.Server
}

func newTestApp(t *testing.T, k dbtest.Kind, extra env) *testApp {
	t.Helper()
	return newTestAppWith(t, k, extra, nil)
}

// newTestAppWith is newTestApp with the loaded Config changed by mod.
func newTestAppWith(t *testing.T, k dbtest.Kind, extra env, mod func(*Config)) *testApp {
	t.Helper()
	return newTestAppLogging(t, k, extra, mod, io.Discard)
}

// newTestAppLogging is newTestAppWith with the app's log (JSON) written to
// logs.
func newTestAppLogging(t *testing.T, k dbtest.Kind, extra env, mod func(*Config), logs io.Writer) *testApp {
	t.Helper()
	e := env{"KAMI_DATA_DIR": t.TempDir(), "KAMI_DATABASE_URL": dbtest.URL(t, k), "KAMI_SANDBOX_SECRET": "test-secret",
		"KAMI_PUBLIC_URL": "http://kami.test", "KAMI_ADMIN_TOKEN": testAdminToken}
	for k, v := range extra {
		e[k] = v
	}
	cfg, err := loadConfig(e.get)
	if err != nil {
		t.Fatal(err)
	}
	if mod != nil {
		mod(cfg)
	}
	a, err := newApp(t.Context(), cfg, slog.New(slog.NewJSONHandler(logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	ta := &testApp{app: a, srv: httptest.NewServer(a.handler)}
	t.Cleanup(func() {
		ta.srv.Close()
		a.Close(context.Background())
	})
	return ta
}

func (ta *testApp) product(t *testing.T, priceFen int64, codes ...string) *domain.Product {
	t.Helper()
	name := "Steam 50"
	p, err := ta.ledger.CreateProduct(t.Context(), domain.ProductInput{Name: &name, PriceFen: &priceFen}, "test")
	if err != nil {
		t.Fatal(err)
	}
	if len(codes) > 0 {
		if _, err := ta.shop.ImportCards(t.Context(), p.ID, codes, "test"); err != nil {
			t.Fatal(err)
		}
	}
	return p
}

func (ta *testApp) post(t *testing.T, path string, header http.Header, body []byte) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, ta.srv.URL+path, bytes.NewReader(body))
	for k, vs := range header {
		req.Header[k] = vs
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, string(b)
}

func TestHealth(t *testing.T) {
	t.Parallel()
	ta := newTestApp(t, dbtest.SQLite, nil)
	for _, path := range []string{"/healthz", "/readyz"} {
		res, err := http.Get(ta.srv.URL + path)
		if err != nil || res.StatusCode != 200 {
			t.Fatalf("%s: %v %v", path, res, err)
		}
		res.Body.Close()
	}
}

// TestWebhookSandbox drives the sandbox webhook over HTTP: a good
// notification delivers, ten concurrent copies of it deliver once, and
// every bad one is refused and changes nothing.
func TestWebhookSandbox(t *testing.T) {
	t.Parallel()
	for _, k := range []dbtest.Kind{dbtest.SQLite, dbtest.Postgres, dbtest.MySQL} {
		t.Run(string(k), func(t *testing.T) {
			t.Parallel()
			ta := newTestApp(t, k, nil)
			p := ta.product(t, 1250, "CODE-A", "CODE-B")
			co, err := ta.shop.PlaceOrder(t.Context(), domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: "b@example.com", Provider: "sandbox"}, "", "127.0.0.1")
			if err != nil {
				t.Fatal(err)
			}
			o := co.Order
			if co.Payment.URL != "http://kami.test/sandbox/pay/"+o.OrderNo {
				t.Fatalf("pay URL %q", co.Payment.URL)
			}
			good := sandbox.PaymentNotification(o.OrderNo, "SBX-1", o.AmountFen, time.Now())
			header, body := sandbox.Signed("test-secret", good)

			refused := func(name string, h http.Header, b []byte, wantStatus int) {
				t.Helper()
				status, _ := ta.post(t, "/webhooks/sandbox", h, b)
				if status != wantStatus {
					t.Errorf("%s: status %d, want %d", name, status, wantStatus)
				}
				if got, _ := ta.ledger.Order(t.Context(), o.OrderNo); got.Status != domain.OrderPending {
					t.Fatalf("%s changed the order to %s", name, got.Status)
				}
			}
			forged, _ := sandbox.Signed("not-the-secret", good)
			refused("forged signature", forged, body, 400)
			refused("tampered body", header, bytes.Replace(body, []byte("12.50"), []byte("0.01"), 1), 400)
			wrongAmount := sandbox.PaymentNotification(o.OrderNo, "SBX-2", 1, time.Now())
			h, b := sandbox.Signed("test-secret", wrongAmount)
			refused("wrong amount", h, b, 400)
			refused("wrong amount, delivered again", h, b, 200) // recorded as refused: acknowledged, nothing changes
			unknown := sandbox.PaymentNotification("26112900000000000000", "SBX-3", 1250, time.Now())
			h, b = sandbox.Signed("test-secret", unknown)
			refused("unknown order", h, b, 500)
			refused("malformed", sandbox.SignedBody("test-secret", []byte("{not json")), []byte("{not json"), 400)
			big := bytes.Repeat([]byte("x"), maxWebhookBody+1)
			refused("oversized", sandbox.SignedBody("test-secret", big), big, 413)
			if status, _ := ta.post(t, "/webhooks/paypal", header, body); status != 404 {
				t.Errorf("unknown provider: %d", status)
			}

			// Ten copies at once: one delivery, every copy acknowledged.
			var wg sync.WaitGroup
			statuses := make([]int, 10)
			for i := range statuses {
				wg.Add(1)
				go func() {
					defer wg.Done()
					statuses[i], _ = ta.post(t, "/webhooks/sandbox", header, body)
				}()
			}
			wg.Wait()
			for i, st := range statuses {
				if st != 200 {
					t.Errorf("copy %d: status %d", i, st)
				}
			}
			got, _ := ta.ledger.Order(t.Context(), o.OrderNo)
			codes, err := ta.ledger.DeliveredCodes(t.Context(), got)
			if got.Status != domain.OrderPaid || err != nil || len(codes) != 1 {
				t.Fatalf("after ten copies: %s %v %v", got.Status, codes, err)
			}
			sells, _ := ta.db.NewSelect().Table("stock_flow").Where("order_no = ?", o.OrderNo).Where("change_type = ?", domain.FlowSell).Count(t.Context())
			if sells != 1 {
				t.Fatalf("%d sell entries, want 1", sells)
			}
			vs, _ := ta.ledger.Audit(t.Context())
			if len(vs) != 0 {
				t.Fatalf("audit: %v", vs)
			}
		})
	}
}

// TestPlaceOrderBadInputNotEchoed: an oversized provider or method name is
// refused as BAD_INPUT without being repeated back.
func TestPlaceOrderBadInputNotEchoed(t *testing.T) {
	t.Parallel()
	ta := newTestApp(t, dbtest.SQLite, nil)
	p := ta.product(t, 100, "E-1")
	long := strings.Repeat("x", 10_000)
	for _, tc := range []struct{ provider, method string }{{long, ""}, {"sandbox", long}} {
		_, err := ta.shop.PlaceOrder(t.Context(), domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: "c", Provider: tc.provider}, tc.method, "")
		if domain.ErrorCode(err) != domain.EBADINPUT || strings.Contains(err.Error(), long) {
			t.Errorf("provider %d bytes, method %d bytes: %v", len(tc.provider), len(tc.method), err)
		}
	}
}

// Profiles are off by default and served on loopback only.
func TestPprofOnLoopbackOnly(t *testing.T) {
	t.Parallel()
	if c, err := loadConfig(env{}.get); err != nil || c.PprofAddr != "" {
		t.Fatalf("default KAMI_PPROF_ADDR %q, %v; want off", c.PprofAddr, err)
	}
	for _, bad := range []string{"0.0.0.0:6060", ":6060", "10.0.0.5:6060", "example.com:6060", "6060"} {
		if _, err := loadConfig(env{"KAMI_PPROF_ADDR": bad}.get); err == nil || !strings.Contains(err.Error(), "KAMI_PPROF_ADDR") {
			t.Errorf("KAMI_PPROF_ADDR=%s: %v; want refused", bad, err)
		}
	}
	for _, good := range []string{"127.0.0.1:6060", "[::1]:6060", "localhost:0"} {
		if c, err := loadConfig(env{"KAMI_PPROF_ADDR": good}.get); err != nil || c.PprofAddr != good {
			t.Errorf("KAMI_PPROF_ADDR=%s: %v", good, err)
		}
	}
	stop, err := servePprof("127.0.0.1:0", slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	stop()
}

// TestStartWarnsOfARedisThatEvicts: a kami started on a Redis that drops
// keys when full (a maxmemory and an evicting policy) warns once, naming
// the server and its policy; on one that does not, it says nothing; of one
// that refuses CONFIG (as managed ones may), it says at info level that it
// could not tell.
func TestStartWarnsOfARedisThatEvicts(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		policy      string
		refuse      bool   // CONFIG refused to kami's user
		level, says string // the one line expected; "" none
	}{
		{"volatile-lru", false, "WARN", "Redis evicts keys"},
		{"noeviction", false, "", ""},
		{"allkeys-lru", true, "INFO", "could not read Redis's maxmemory-policy"},
	} {
		p := redistest.StartPrivate(t)
		rdb := redis.NewClient(&redis.Options{Addr: p.Addr})
		for _, kv := range [][2]string{{"maxmemory", "64mb"}, {"maxmemory-policy", c.policy}} {
			if err := rdb.ConfigSet(t.Context(), kv[0], kv[1]).Err(); err != nil {
				t.Fatal(err)
			}
		}
		if c.refuse {
			if err := rdb.Do(t.Context(), "ACL", "SETUSER", "default", "-config").Err(); err != nil {
				t.Fatal(err)
			}
		}
		rdb.Close()
		var logs domaintest.LogBuffer
		newTestAppLogging(t, dbtest.SQLite, env{"KAMI_REDIS_URL": p.URL}, nil, &logs)
		var lines []string
		for _, line := range strings.Split(logs.String(), "\n") {
			if strings.Contains(line, "Redis evicts keys") || strings.Contains(line, "maxmemory-policy") {
				lines = append(lines, line)
			}
		}
		switch {
		case c.says == "" && len(lines) > 0:
			t.Errorf("%s: logged %q", c.policy, lines)
		case c.says != "" && (len(lines) != 1 || !strings.Contains(lines[0], `"level":"`+c.level+`"`) || !strings.Contains(lines[0], c.says) ||
			!strings.Contains(lines[0], p.Addr) || (!c.refuse && !strings.Contains(lines[0], `"maxmemory_policy":"`+c.policy+`"`))):
			t.Errorf("%s (CONFIG refused %v): logged %q, want one %s line naming %s", c.policy, c.refuse, lines, c.level, p.Addr)
		}
	}
}
