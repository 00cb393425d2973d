package chaos

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/redis/go-redis/v9"
	"github.com/rs/zerolog"

	"kami/domain"
	"kami/providers/alipay/alipayemu"
	"kami/providers/wechat/wechatemu"
)

// Settings every kami process of a campaign runs with. Short times, so that
// orders fall due, sweeps run and leases expire within a campaign.
const (
	orderTTL   = 8 * time.Second
	sweepEvery = 5 * time.Second
	queueLease = 5 * time.Second
	// checkRetry is how soon an order whose pre-close check had no clear
	// answer is checked again: on the sweep's scale, like the default 1m
	// beside the default 1m sweep.
	checkRetry = sweepEvery
	// refundBackoff is short, so that a gateway refusing refunds for a
	// few seconds drives some refunds to FAILED.
	refundBackoff   = "300ms,700ms,1500ms"
	providerTimeout = time.Second
	adminToken      = "chaos-admin-token-0123456789abcdef0123456789abcdef"
	sandboxSecret   = "chaos-sandbox-secret-0123456789abcdef"
	// never is a cron spec that does not fire during a campaign: the
	// campaign runs the reconciliations itself, once, after the heal.
	never = "0 0 0 1 1 *"
)

// env is everything one campaign runs against.
type env struct {
	t      *testing.T
	dir    string // logs and data dirs; kept when the campaign fails
	dbName string
	admin  *sql.DB // to the PostgreSQL server, for CREATE/DROP DATABASE
	db     *sql.DB // straight to the campaign's database (not through a proxy)
	dbURL  string  // straight, for `kami audit`
	prefix string  // Redis key prefix

	redisCmd  *exec.Cmd
	redisAddr string
	rdb       *redis.Client // straight to Redis (FLUSHALL, counters)

	toxi    *toxiproxy.ApiServer
	alipay  *alipayemu.Server
	wechat  *wechatemu.Server
	wechatK map[string]string // the KAMI_WECHAT_* settings
	alipayK map[string]string // the KAMI_ALIPAY_* settings
	alerts  *alertBook
	procs   []*proc

	deathsMu      sync.Mutex
	deaths        []string     // processes that exited by themselves
	startFailures atomic.Int64 // starts that failed (and were tried again)
}

// newEnv starts the services of one campaign; everything stops when the
// test ends.
func newEnv(t *testing.T, seed int64, nProcs int, skew time.Duration) *env {
	t.Helper()
	dir, err := os.MkdirTemp("", fmt.Sprintf("kami-chaos-%d-", seed))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() || *keepFlag {
			t.Logf("the processes' logs are kept in %s", dir)
			return
		}
		os.RemoveAll(dir)
	})
	e := &env{t: t, dir: dir, prefix: "kami:"}
	e.startPostgres(seed)
	e.startRedis()
	e.toxi = toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())
	e.startEmulators()
	e.alerts = newAlertBook(t)

	pgUp, _ := url.Parse(pgServerURL())
	for i := range nProcs {
		p := &proc{env: e, idx: i, dir: filepath.Join(dir, fmt.Sprintf("p%d", i))}
		p.pg = e.proxy(fmt.Sprintf("pg%d", i), pgUp.Host)
		p.redis = e.proxy(fmt.Sprintf("redis%d", i), e.redisAddr)
		if i == nProcs-1 {
			p.skew = skew
		}
		p.addr = freeAddr(t)
		e.procs = append(e.procs, p)
	}
	t.Cleanup(e.stopAll)
	// Migrate once before the processes start, so that they do not all
	// race to migrate a fresh database.
	if out, err := e.kami("migrate"); err != nil {
		t.Fatalf("kami migrate: %v\n%s", err, out)
	}
	for _, p := range e.procs {
		if err := p.start(); err != nil {
			t.Fatal(err)
		}
	}
	return e
}

// pgServerURL is the PostgreSQL server campaigns create their databases on.
func pgServerURL() string { return os.Getenv("KAMI_TEST_POSTGRES_URL") }

func (e *env) startPostgres(seed int64) {
	t := e.t
	admin, err := sql.Open("pgx", pgServerURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := admin.PingContext(ctx); err != nil {
		t.Fatalf("PostgreSQL at KAMI_TEST_POSTGRES_URL does not answer: %v", err)
	}
	e.admin = admin
	e.dbName = fmt.Sprintf("kami_chaos_%d_%s", seed, randomHex(3))
	if _, err := admin.Exec("CREATE DATABASE " + e.dbName); err != nil {
		t.Fatalf("create the campaign's database: %v", err)
	}
	t.Cleanup(func() {
		if _, err := admin.Exec("DROP DATABASE IF EXISTS " + e.dbName + " WITH (FORCE)"); err != nil {
			t.Logf("drop %s: %v", e.dbName, err)
		}
	})
	u, _ := url.Parse(pgServerURL())
	u.Path = "/" + e.dbName
	e.dbURL = u.String()
	if e.db, err = sql.Open("pgx", e.dbURL); err != nil {
		t.Fatal(err)
	}
	e.db.SetMaxOpenConns(4)
	t.Cleanup(func() { e.db.Close() })
}

// startRedis runs a redis-server of the campaign's own, without
// persistence, as a child process.
func (e *env) startRedis() {
	t := e.t
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Fatalf("redis-server is not on PATH: %v", err)
	}
	addr := freeAddr(t)
	_, port, _ := net.SplitHostPort(addr)
	cmd := exec.Command(bin, "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no")
	cmd.Dir = e.dir
	log, err := os.Create(filepath.Join(e.dir, "redis.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = log, log
	dieWithUs(cmd)
	if err := cmd.Start(); err != nil {
		t.Fatalf("start redis-server: %v", err)
	}
	e.redisCmd, e.redisAddr = cmd, addr
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		log.Close()
	})
	e.rdb = redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
	t.Cleanup(func() { e.rdb.Close() })
	if !waitFor(10*time.Second, func() bool { return e.rdb.Ping(context.Background()).Err() == nil }) {
		t.Fatal("redis-server did not answer within 10s")
	}
}

func (e *env) startEmulators() {
	t := e.t
	ali, err := alipayemu.New(alipayemu.Options{Hold: 3 * time.Second, Slow: 300 * time.Millisecond, EarlyStatements: true})
	if err != nil {
		t.Fatal(err)
	}
	aliSrv := httptest.NewServer(ali)
	t.Cleanup(aliSrv.Close)
	e.alipay = ali
	e.alipayK = map[string]string{"KAMI_ALIPAY_APP_ID": ali.AppID(), "KAMI_ALIPAY_PRIVATE_KEY": ali.AppPrivateKeyPEM(),
		"KAMI_ALIPAY_PUBLIC_KEY": ali.PublicKeyPEM(), "KAMI_ALIPAY_GATEWAY": aliSrv.URL}

	merchant, err := wechatemu.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	const serial = "5157F09EFDC096DE15EBE81A47057A72"
	wx, err := wechatemu.New(wechatemu.Options{MerchantSerialNo: serial, MerchantPublicKey: &merchant.PublicKey,
		SlowDelay: 300 * time.Millisecond, HoldMax: 3 * time.Second, EarlyStatements: true,
		// Refunds answer PROCESSING first, as WeChat Pay's do; a query
		// finds them SUCCESS.
		RefundProcessing: true})
	if err != nil {
		t.Fatal(err)
	}
	wxSrv := httptest.NewServer(wx)
	t.Cleanup(wxSrv.Close)
	e.wechat = wx
	key, err := wechatemu.PrivateKeyPEM(merchant)
	if err != nil {
		t.Fatal(err)
	}
	e.wechatK = map[string]string{"KAMI_WECHAT_APP_ID": wx.AppID(), "KAMI_WECHAT_MCH_ID": wx.MchID(), "KAMI_WECHAT_SERIAL_NO": serial,
		"KAMI_WECHAT_PRIVATE_KEY": key, "KAMI_WECHAT_API_V3_KEY": wx.APIv3Key(),
		"KAMI_WECHAT_PLATFORM_PUBLIC_KEY": wx.PlatformPublicKeyPEM(), "KAMI_WECHAT_PLATFORM_PUBLIC_KEY_ID": wx.PlatformPublicKeyID(),
		"KAMI_WECHAT_API_BASE": wxSrv.URL}
}

// proxy starts a Toxiproxy proxy to upstream on a free port.
func (e *env) proxy(name, upstream string) *toxiproxy.Proxy {
	p := toxiproxy.NewProxy(e.toxi, name, "127.0.0.1:0", upstream)
	if err := e.toxi.Collection.Add(p, true); err != nil {
		e.t.Fatalf("toxiproxy %s: %v", name, err)
	}
	e.t.Cleanup(p.Stop)
	return p
}

// kami runs a kami command (migrate, audit) straight against the
// campaign's database and Redis and returns its output.
func (e *env) kami(args ...string) (string, error) {
	cmd := exec.Command(kamiBin, args...)
	cmd.Env = append(baseEnv(), "KAMI_DATABASE_URL="+e.dbURL, "KAMI_REDIS_URL=redis://"+e.redisAddr+"/0",
		"KAMI_DATA_DIR="+filepath.Join(e.dir, "cli"), "KAMI_ADMIN_TOKEN="+adminToken, "KAMI_CARD_KEY="+cardKey,
		"KAMI_SANDBOX_SECRET="+sandboxSecret, "KAMI_LOG_LEVEL=warn")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	dieWithUs(cmd)
	err := cmd.Run()
	return out.String(), err
}

// cardKey seals the campaign's codes; any valid key will do.
var cardKey = domain.NewCardKey()

// baseEnv is the part of the test's environment a kami process needs (no
// KAMI_* setting of the developer's leaks in).
func baseEnv() []string {
	var out []string
	for _, k := range []string{"PATH", "HOME", "TMPDIR", "LANG"} {
		if v, ok := os.LookupEnv(k); ok {
			out = append(out, k+"="+v)
		}
	}
	return out
}

// proc is one kami process of the campaign, with its two proxies.
type proc struct {
	env       *env
	idx       int
	dir       string
	addr      string // 127.0.0.1:port, the same across restarts
	pg, redis *toxiproxy.Proxy
	skew      time.Duration

	// expectExit is set before the campaign kills or stops the process:
	// any other exit is a death of its own (a panic), which is recorded.
	expectExit atomic.Bool
	// starting: the process has not served yet. kami exits when it cannot
	// reach its database or Redis at start; a supervisor starts it again,
	// and so does startRetrying.
	starting atomic.Bool

	mu      sync.Mutex
	cmd     *exec.Cmd
	log     *os.File
	exited  chan struct{}
	starts  int
	stopped bool // stopAll ran
}

func (p *proc) name() string { return fmt.Sprintf("p%d", p.idx) }

func (p *proc) url() string { return "http://" + p.addr }

func (p *proc) environ() []string {
	e := p.env
	pgURL, _ := url.Parse(e.dbURL)
	pgURL.Host = p.pg.Listen
	vars := map[string]string{
		"KAMI_ADDR": p.addr, "KAMI_DATA_DIR": p.dir,
		// WeChat Pay wants an https notify_url; the campaign delivers the
		// notifications itself, so the name need not resolve.
		"KAMI_PUBLIC_URL":   fmt.Sprintf("https://%s.chaos.test", p.name()),
		"KAMI_DATABASE_URL": pgURL.String(), "KAMI_DB_MAX_CONNS": "8",
		"KAMI_REDIS_URL": "redis://" + p.redis.Listen + "/0", "KAMI_REDIS_PREFIX": e.prefix,
		"KAMI_ADMIN_TOKEN": adminToken, "KAMI_CARD_KEY": cardKey, "KAMI_SANDBOX_SECRET": sandboxSecret,
		"KAMI_SANDBOX_GIVES_CODES_AWAY": "1",
		"KAMI_ORDER_TTL":                orderTTL.String(), "KAMI_REFUND_BACKOFF": refundBackoff,
		"KAMI_PROVIDER_TIMEOUT": providerTimeout.String(),
		"KAMI_SWEEP_EVERY":      sweepEvery.String(), "KAMI_QUEUE_LEASE": queueLease.String(),
		"KAMI_CLOSE_CHECK_RETRY": checkRetry.String(),
		"KAMI_RECONCILE_CRON":    never, "KAMI_STATEMENT_CRON": never,
		"KAMI_ALERT_WEBHOOK": e.alerts.url, "KAMI_LOG_FORMAT": "json",
		// Every buyer comes from 127.0.0.1: no caps per address.
		"KAMI_MAX_PENDING_PER_ADDRESS": "0", "KAMI_MAX_LOCKED_PER_ADDRESS": "0",
	}
	if p.skew != 0 {
		vars["KAMI_FAULT_CLOCK_SKEW"] = p.skew.String()
	}
	for k, v := range e.alipayK {
		vars[k] = v
	}
	for k, v := range e.wechatK {
		vars[k] = v
	}
	out := baseEnv()
	for k, v := range vars {
		out = append(out, k+"="+v)
	}
	return out
}

// start starts the process and waits until it serves.
func (p *proc) start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopped {
		return nil
	}
	if p.cmd != nil {
		select {
		case <-p.exited: // it died by itself: start it again
			p.log.Close()
			p.cmd = nil
		default:
			return nil
		}
	}
	if err := os.MkdirAll(p.dir, 0o700); err != nil {
		return err
	}
	p.starts++
	log, err := os.OpenFile(filepath.Join(p.env.dir, p.name()+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	fmt.Fprintf(log, "{\"msg\":\"chaos: start %d\"}\n", p.starts)
	cmd := exec.Command(kamiBin)
	cmd.Env = p.environ()
	cmd.Stdout = io.Discard
	cmd.Stderr = log
	dieWithUs(cmd)
	if err := cmd.Start(); err != nil {
		log.Close()
		return fmt.Errorf("start %s: %w", p.name(), err)
	}
	exited := make(chan struct{})
	p.expectExit.Store(false)
	p.starting.Store(true)
	go func() {
		err := cmd.Wait()
		if !p.expectExit.Load() && !p.starting.Load() {
			p.env.died(fmt.Sprintf("%s (start %d) exited by itself: %v; see %s", p.name(), p.starts, err, log.Name()))
		}
		close(exited)
	}()
	p.cmd, p.log, p.exited = cmd, log, exited
	// It serves once /healthz answers; under faults the start (migration
	// check, Redis ping) may take a while.
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-exited:
			p.cmd = nil
			log.Close()
			return fmt.Errorf("%s exited while starting (see %s)", p.name(), log.Name())
		default:
		}
		if res, err := quick.Get(p.url() + "/healthz"); err == nil {
			res.Body.Close()
			if res.StatusCode == 200 {
				p.starting.Store(false)
				return nil
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("%s did not serve within 60s", p.name())
}

// startRetrying starts the process as a supervisor would: again after a
// second while it exits at start (its database or Redis unreachable), for
// up to within.
func (p *proc) startRetrying(within time.Duration) error {
	deadline := time.Now().Add(within)
	for {
		err := p.start()
		if err == nil || time.Now().After(deadline) {
			return err
		}
		p.env.startFailures.Add(1)
		time.Sleep(time.Second)
	}
}

// kill is kill -9.
func (p *proc) kill() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return false
	}
	p.expectExit.Store(true)
	p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.exited
	p.log.Close()
	p.cmd = nil
	return true
}

// alive reports whether the process runs (it may have died by itself).
func (p *proc) alive() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return false
	}
	select {
	case <-p.exited:
		return false
	default:
		return true
	}
}

// stop stops the process gracefully (SIGTERM), then for good.
func (p *proc) stop() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.stopped = true
	if p.cmd == nil {
		return
	}
	p.expectExit.Store(true)
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(30 * time.Second):
		p.cmd.Process.Signal(syscall.SIGKILL)
		<-p.exited
	}
	p.log.Close()
	p.cmd = nil
}

func (e *env) stopAll() {
	var wg sync.WaitGroup
	for _, p := range e.procs {
		wg.Add(1)
		go func() { defer wg.Done(); p.stop() }()
	}
	wg.Wait()
}

// live returns the processes running now.
func (e *env) live() []*proc {
	var out []*proc
	for _, p := range e.procs {
		if p.alive() {
			out = append(out, p)
		}
	}
	return out
}

// died records a process that exited without the campaign asking.
func (e *env) died(what string) {
	e.deathsMu.Lock()
	e.deaths = append(e.deaths, what)
	e.deathsMu.Unlock()
}

// exitedBySelf lists the processes that died without the campaign killing
// them.
func (e *env) exitedBySelf() []string {
	e.deathsMu.Lock()
	defer e.deathsMu.Unlock()
	return append([]string(nil), e.deaths...)
}

// alertBook receives the processes' alerts (KAMI_ALERT_WEBHOOK, the generic
// JSON form) and also reads them from their logs, since a post may be lost
// with its process.
type alertBook struct {
	url string
	mu  sync.Mutex
	got map[string][]string // subject → kinds
}

func newAlertBook(t *testing.T) *alertBook {
	a := &alertBook{got: map[string][]string{}}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body struct{ Kind, Subject string }
		if err := json.NewDecoder(r.Body).Decode(&body); err == nil {
			a.add(body.Kind, body.Subject)
		}
	}))
	t.Cleanup(srv.Close)
	a.url = srv.URL
	return a
}

func (a *alertBook) add(kind, subject string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.got[subject] = append(a.got[subject], kind)
}

// has reports whether an alert of kind was raised about any of subjects.
func (a *alertBook) has(kind string, subjects ...string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, s := range subjects {
		for _, k := range a.got[s] {
			if k == kind {
				return true
			}
		}
	}
	return false
}

// kinds counts the alerts by kind.
func (a *alertBook) kinds() map[string]int {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := map[string]int{}
	for _, ks := range a.got {
		for _, k := range ks {
			out[k]++
		}
	}
	return out
}

// eachLogLine calls fn with every line of the processes' logs that
// contains marker.
func (e *env) eachLogLine(marker string, fn func(p *proc, line []byte)) {
	for _, p := range e.procs {
		f, err := os.Open(filepath.Join(e.dir, p.name()+".log"))
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			if bytes.Contains(sc.Bytes(), []byte(marker)) {
				fn(p, sc.Bytes())
			}
		}
		f.Close()
	}
}

// readLogs adds the alerts the processes logged ("alert: …" lines with the
// alert and subject fields), for those whose post was lost.
func (e *env) readLogs() {
	logged := &alertBook{got: map[string][]string{}}
	e.eachLogLine(`"alert"`, func(_ *proc, b []byte) {
		var line struct {
			Msg     string `json:"msg"`
			Alert   string `json:"alert"`
			Subject string `json:"subject"`
		}
		if json.Unmarshal(b, &line) == nil && line.Alert != "" && strings.HasPrefix(line.Msg, "alert: ") {
			logged.add(line.Alert, line.Subject)
		}
	})
	// An alert logged but not posted counts once.
	for subject, kinds := range logged.got {
		for _, k := range kinds {
			if !e.alerts.has(k, subject) {
				e.alerts.add(k, subject)
			}
		}
	}
}

// closers reads which process logged "order closed" for each order.
func (e *env) closers() map[string]string {
	out := map[string]string{}
	e.eachLogLine(`"msg":"order closed"`, func(p *proc, b []byte) {
		var line struct {
			Order string `json:"order"`
		}
		if json.Unmarshal(b, &line) == nil && line.Order != "" {
			out[line.Order] = p.name()
		}
	})
	return out
}

// races lists the processes whose log has a data race report (kami built
// with -chaos.race), with the report's first lines.
func (e *env) races() []string {
	var out []string
	for _, p := range e.procs {
		b, err := os.ReadFile(filepath.Join(e.dir, p.name()+".log"))
		if err != nil {
			continue
		}
		if i := bytes.Index(b, []byte("WARNING: DATA RACE")); i >= 0 {
			end := min(len(b), i+1500)
			out = append(out, fmt.Sprintf("%s (%d reports):\n%s", p.name(), bytes.Count(b, []byte("WARNING: DATA RACE")), b[i:end]))
		}
	}
	return out
}

// quick is the client for health checks; client is the campaign's client
// for everything else (a fault may hold a request for seconds).
var (
	quick  = &http.Client{Timeout: 2 * time.Second}
	client = &http.Client{Timeout: 15 * time.Second}
)

func freeAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// waitFor polls cond until it holds or within has passed.
func waitFor(within time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(within)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(100 * time.Millisecond)
	}
}
