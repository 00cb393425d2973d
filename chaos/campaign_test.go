package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"kami/domain"
	"kami/providers"
)

var (
	seedFlag     = flag.Int64("chaos.seed", 0, "run one campaign with this seed (0: the default set)")
	seedsFlag    = flag.Int("chaos.seeds", 0, "run this many campaigns: the fixed seed, then random ones")
	durationFlag = flag.Duration("chaos.duration", 25*time.Second, "the faulty phase of each campaign")
	buyersFlag   = flag.Int("chaos.buyers", 3, "buyers placing orders at once")
	procsFlag    = flag.Int("chaos.procs", 3, "kami processes (2 or 3)")
	keepFlag     = flag.Bool("chaos.keep", false, "keep the processes' logs also when the campaign passes")
	skewFlag     = flag.String("chaos.skew", "", "the last process's clock offset, like 3s or 0s (default: drawn from the seed)")
	raceFlag     = flag.Bool("chaos.race", false, "build kami with -race; a data race a process reports is a violation")
)

// fixedSeed is the seed every default run includes.
const fixedSeed = 20261201

// kamiBin is the kami binary TestMain built, "" when the campaign is
// skipped.
var kamiBin string

// skipReason is why the campaign does not run here, "" when it does.
var skipReason string

func TestMain(m *testing.M) {
	flag.Parse()
	required := os.Getenv("KAMI_TEST_REQUIRE_SERVICES") == "1"
	_, redisErr := exec.LookPath("redis-server")
	switch {
	case pgServerURL() == "" && !required:
		skipReason = "the fault campaign needs PostgreSQL (KAMI_TEST_POSTGRES_URL) and redis-server on PATH; KAMI_TEST_POSTGRES_URL is unset, so it is skipped"
	case pgServerURL() == "":
		skipReason = "FAIL: KAMI_TEST_REQUIRE_SERVICES=1 but KAMI_TEST_POSTGRES_URL is unset"
	case redisErr != nil && !required:
		skipReason = "the fault campaign needs redis-server on PATH: " + redisErr.Error()
	case redisErr != nil:
		skipReason = "FAIL: KAMI_TEST_REQUIRE_SERVICES=1 but redis-server is not on PATH: " + redisErr.Error()
	}
	code := 0
	if skipReason == "" {
		dir, err := os.MkdirTemp("", "kami-chaos-bin-")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		kamiBin = filepath.Join(dir, "kami")
		args := []string{"build", "-o", kamiBin}
		if *raceFlag {
			args = append(args, "-race")
		}
		build := exec.Command("go", append(args, ".")...)
		build.Dir = ".." // the repository root: package main
		build.Stdout, build.Stderr = os.Stderr, os.Stderr
		if err := build.Run(); err != nil {
			fmt.Fprintln(os.Stderr, "chaos: go build of kami failed:", err)
			os.RemoveAll(dir)
			os.Exit(2)
		}
		code = m.Run()
		os.RemoveAll(dir)
	} else {
		code = m.Run()
	}
	os.Exit(code)
}

// TestCampaign runs the fault campaigns the flags ask for (see doc.go).
func TestCampaign(t *testing.T) {
	if skipReason != "" {
		if strings.HasPrefix(skipReason, "FAIL: ") {
			t.Fatal(strings.TrimPrefix(skipReason, "FAIL: "))
		}
		t.Skip(skipReason)
	}
	seeds := []int64{fixedSeed, rand.Int64N(1 << 40)}
	switch {
	case *seedFlag != 0:
		seeds = []int64{*seedFlag}
	case *seedsFlag > 0:
		seeds = []int64{fixedSeed}
		for len(seeds) < *seedsFlag {
			seeds = append(seeds, rand.Int64N(1<<40))
		}
	}
	var summary []string
	for _, seed := range seeds {
		ok := t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
			c := newCampaign(t, seed, *durationFlag)
			c.run()
			summary = append(summary, c.figures.line(seed))
		})
		if !ok {
			summary = append(summary, fmt.Sprintf("seed=%d FAILED: %s", seed, replay(seed)))
		}
	}
	t.Logf("campaigns:\n  %s", strings.Join(summary, "\n  "))
}

// replay is the command that runs seed's campaign again, with the flags
// that shape it.
func replay(seed int64) string {
	cmd := fmt.Sprintf("go test ./chaos/ -run Campaign -v -chaos.seed=%d -chaos.duration=%s", seed, *durationFlag)
	flag.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "chaos.skew", "chaos.procs", "chaos.buyers", "chaos.race":
			cmd += fmt.Sprintf(" -%s=%s", f.Name, f.Value)
		}
	})
	return cmd
}

// campaign is one run of one seed.
type campaign struct {
	t     *testing.T
	seed  int64
	dur   time.Duration
	env   *env
	sched []event
	skew  time.Duration
	start time.Time

	products []product

	ctx    context.Context // ends when the campaign gives up on its buyers
	cancel context.CancelFunc
	// placing stops new orders at the end of the faulty phase.
	placing atomic.Bool

	mu         sync.Mutex
	orders     map[string]*order // by order number
	sandbox    []*sandboxPayment
	violations []violation
	notes      []string

	buyers   sync.WaitGroup // order goroutines
	notifies sync.WaitGroup // notification deliveries in flight
	sbSeq    atomic.Int64

	figures figures
}

type product struct {
	id       string
	priceFen int64
	maxQty   int
	weight   int
}

// order is an order as its buyer knows it.
type order struct {
	no, token, provider string
	productID           string
	qty                 int
	amountFen           int64
	expiresAt           time.Time // as createOrder told the buyer
	fate                string

	mu           sync.Mutex
	cancelSent   bool      // the buyer asked to cancel
	closedSeen   time.Time // when the campaign first saw it CLOSED
	refundAsked  bool
	paidAttempts int
	acked        bool // a notification of its payment was acknowledged
	// closedByRetry: retryBadMethod saw the order closed by the retry
	closedByRetry bool
}

// sandboxPayment is the sandbox's book, kept by the campaign: the sandbox
// gateway lives inside each kami process and forgets on restart, so the
// campaign signs the sandbox's payment notifications itself and keeps the
// record.
type sandboxPayment struct {
	orderNo, tradeNo string
	fen              int64
	acked            atomic.Bool
}

func newCampaign(t *testing.T, seed int64, dur time.Duration) *campaign {
	r := rand.New(rand.NewPCG(uint64(seed), 1))
	c := &campaign{t: t, seed: seed, dur: dur, orders: map[string]*order{}}
	// One process runs with a clock 1 to 4 s off, fast more often than slow.
	c.skew = time.Duration(1+r.IntN(4)) * time.Second
	if r.IntN(10) < 2 {
		c.skew = -c.skew
	}
	if *skewFlag != "" {
		d, err := time.ParseDuration(*skewFlag)
		if err != nil {
			t.Fatalf("-chaos.skew: %v", err)
		}
		c.skew = d
	}
	c.sched = schedule(seed, dur, *procsFlag)
	c.figures.faults = map[string]int{}
	c.figures.createErrors = map[string]int{}
	c.figures.createErrorText = map[string]string{}
	c.figures.fates = map[string]int{}
	return c
}

// run is the whole campaign: set up, the faulty phase, the heal, the
// sweep and the reconciliation, the checks.
func (c *campaign) run() {
	t := c.t
	t.Logf("seed %d: %s of faults, %d processes (p%d's clock %+v), %d buyers, %d scheduled faults",
		c.seed, c.dur, *procsFlag, *procsFlag-1, c.skew, *buyersFlag, len(c.sched))
	if testing.Verbose() {
		for _, ev := range c.sched {
			t.Logf("  schedule %s", ev)
		}
	}
	c.env = newEnv(t, c.seed, *procsFlag, c.skew)
	c.setupProducts()
	var cancel context.CancelFunc
	c.ctx, cancel = context.WithTimeout(context.Background(), c.dur+orderTTL+3*time.Minute)
	defer cancel()
	c.cancel = cancel

	stopWatch := c.watchCloses()
	c.start = time.Now()
	c.placing.Store(true)
	faultsDone := make(chan struct{})
	go func() { defer close(faultsDone); c.runFaults() }()
	var buyers sync.WaitGroup
	for b := range *buyersFlag {
		buyers.Add(1)
		go func() { defer buyers.Done(); c.buyer(b) }()
	}
	// The nightly audit, once, under live traffic: what it reports is a
	// false alarm unless the quiet audit at the end agrees.
	time.Sleep(c.dur / 2)
	if out, err := c.env.kami("audit"); err != nil {
		c.note("the audit under live traffic (half-way) reported: %s", strings.ReplaceAll(strings.TrimSpace(out), "\n", "; "))
	}
	time.Sleep(time.Until(c.start.Add(c.dur)))
	c.placing.Store(false)
	buyers.Wait()
	<-faultsDone
	healed := time.Now()
	c.heal()
	t.Logf("healed at %s; %d orders placed; waiting for the buyers and the gateways' notifications", healed.Sub(c.start).Round(time.Second), len(c.orders))

	c.buyers.Wait()
	c.notifies.Wait()
	deaths := c.env.exitedBySelf()
	for _, d := range deaths {
		c.violation("a process died: %s", d)
	}
	c.heal() // start again any process that died since

	// One sweep (or pre-close recheck, the same interval) after the last
	// order fell due and after the heal, plus a lease and a lease recovery
	// for a claim that a killed process held, and 5 s for a busy machine.
	due := healed
	c.mu.Lock()
	for _, o := range c.orders {
		if o.expiresAt.After(due) {
			due = o.expiresAt
		}
	}
	c.mu.Unlock()
	grace := max(sweepEvery, checkRetry) + queueLease + 5*time.Second + 5*time.Second
	// A gateway that kept failing until the heal is not asked again for
	// its circuit breaker's cooldown: its due orders may wait that long
	// (and a recheck) after the heal.
	breaker := healed.Add(domain.DefaultBreakerCooldown + checkRetry + 5*time.Second)
	time.Sleep(time.Until(due.Add(grace)))
	time.Sleep(time.Until(breaker))
	c.checkNothingPending(grace)
	c.checkCounters(context.Background(), "after one sweep")
	c.checkAcknowledged()
	stopWatch()

	c.reconcile()
	c.settle()
	c.env.readLogs()
	c.checkEarly()
	c.check()
	for _, d := range c.env.exitedBySelf()[len(deaths):] {
		c.violation("a process died: %s", d)
	}
	for _, r := range c.env.races() {
		c.violation("a data race: %s", r)
	}
	c.figures.alerts = c.env.alerts.kinds()
	c.report()
}

// violation is a broken promise; the report groups them by group (their
// format, unless set).
type violation struct{ format, msg, group string }

// violation records a broken promise.
func (c *campaign) violation(format string, args ...any) {
	c.mu.Lock()
	c.violations = append(c.violations, violation{format: format, msg: fmt.Sprintf(format, args...), group: format})
	c.mu.Unlock()
}

// note records something worth saying that breaks no promise.
func (c *campaign) note(format string, args ...any) {
	c.mu.Lock()
	c.notes = append(c.notes, fmt.Sprintf(format, args...))
	c.mu.Unlock()
}

// pick returns a live process, chosen with r (nil: any), or nil if none
// runs.
func (c *campaign) pick(r *rand.Rand) *proc {
	live := c.env.live()
	if len(live) == 0 {
		return nil
	}
	if r == nil {
		return live[rand.IntN(len(live))]
	}
	return live[r.IntN(len(live))]
}

// --- GraphQL ---------------------------------------------------------------

type gqlErr struct {
	Message    string `json:"message"`
	Extensions struct {
		Code string `json:"code"`
	} `json:"extensions"`
}

// gql runs one GraphQL operation on p. code is "" on success, the error's
// extensions.code, or TRANSPORT when no answer came.
func (c *campaign) gql(p *proc, admin bool, query string, vars map[string]any, out any) (code string, err error) {
	body, _ := json.Marshal(map[string]any{"query": query, "variables": vars})
	req, _ := http.NewRequestWithContext(context.Background(), "POST", p.url()+"/graphql", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if admin {
		req.Header.Set("Authorization", "Bearer "+adminToken)
	}
	res, err := client.Do(req)
	if err != nil {
		return "TRANSPORT", err
	}
	defer res.Body.Close()
	raw, err := io.ReadAll(res.Body)
	if err != nil {
		return "TRANSPORT", err
	}
	var env struct {
		Data   json.RawMessage `json:"data"`
		Errors []gqlErr        `json:"errors"`
	}
	if err := json.Unmarshal(raw, &env); err != nil {
		return fmt.Sprintf("HTTP_%d", res.StatusCode), fmt.Errorf("%s: %.200s", res.Status, raw)
	}
	if len(env.Errors) > 0 {
		code := env.Errors[0].Extensions.Code
		if code == "" {
			code = "UNKNOWN"
		}
		return code, fmt.Errorf("%s: %s", code, env.Errors[0].Message)
	}
	if out != nil {
		if err := json.Unmarshal(env.Data, out); err != nil {
			return "DECODE", err
		}
	}
	return "", nil
}

// admin runs an admin operation on any live process, trying others while
// the answer is a transport error or UNAVAILABLE/INTERNAL, for up to
// within.
func (c *campaign) admin(within time.Duration, query string, vars map[string]any, out any) error {
	deadline := time.Now().Add(within)
	for {
		p := c.pick(nil)
		var code string
		var err error
		if p == nil {
			code, err = "TRANSPORT", fmt.Errorf("no process runs")
		} else {
			code, err = c.gql(p, true, query, vars, out)
		}
		switch code {
		case "":
			return nil
		case "TRANSPORT", "UNAVAILABLE", "INTERNAL", "CONFLICT":
			if time.Now().After(deadline) {
				return err
			}
			time.Sleep(500 * time.Millisecond)
		default:
			return err
		}
	}
}

// setupProducts creates the campaign's products and imports their codes:
// a plentiful one, a scarce one that sells out (so its cards go round and
// its counter matters) and one sold by the handful.
func (c *campaign) setupProducts() {
	specs := []struct {
		name  string
		price string
		cards int
		max   int
		w     int
	}{{"plenty", "10.00", 1500, 2, 5}, {"scarce", "25.50", 25, 2, 3}, {"bundle", "3.33", 600, 3, 2}}
	for _, s := range specs {
		var created struct {
			CreateProduct struct {
				ID string `json:"id"`
			} `json:"createProduct"`
		}
		if err := c.admin(30*time.Second, `mutation($n: String!, $p: Money!, $m: Int) { createProduct(input: {name: $n, price: $p, maxPerOrder: $m}) { id } }`,
			map[string]any{"n": s.name, "p": s.price, "m": s.max}, &created); err != nil {
			c.t.Fatalf("create product %s: %v", s.name, err)
		}
		codes := make([]string, s.cards)
		for i := range codes {
			codes[i] = fmt.Sprintf("CHAOS-%s-%d-%05d-%s", strings.ToUpper(s.name), c.seed, i, randomHex(4))
		}
		var imported struct {
			ImportCards struct{ Imported int } `json:"importCards"`
		}
		if err := c.admin(30*time.Second, `mutation($id: ID!, $codes: [String!]!) { importCards(productId: $id, codes: $codes) { imported } }`,
			map[string]any{"id": created.CreateProduct.ID, "codes": codes}, &imported); err != nil || imported.ImportCards.Imported != s.cards {
			c.t.Fatalf("import %s: %v (%d imported)", s.name, err, imported.ImportCards.Imported)
		}
		fen, _ := parseFen(s.price)
		c.products = append(c.products, product{id: created.CreateProduct.ID, priceFen: fen, maxQty: s.max, weight: s.w})
	}
}

func parseFen(s string) (int64, error) {
	var y, f int64
	if _, err := fmt.Sscanf(s, "%d.%02d", &y, &f); err != nil {
		return 0, err
	}
	return y*100 + f, nil
}

// --- notifications ----------------------------------------------------------

// notify delivers a gateway's notification as the gateway does: to any
// live process, again and again until one acknowledges it (the gateways
// retry for a day; the campaign until it gives up on its buyers).
func (c *campaign) notify(provider string, h http.Header, body []byte, acked func()) {
	c.notifies.Add(1)
	go func() {
		defer c.notifies.Done()
		backoff := 200 * time.Millisecond
		for attempt := 0; ; attempt++ {
			if p := c.pick(nil); p != nil && c.post(p, provider, h, body) {
				c.figures.notifications.Add(1)
				if acked != nil {
					acked()
				}
				return
			}
			c.figures.notifyRetries.Add(1)
			select {
			case <-c.ctx.Done():
				c.violation("a %s notification was never acknowledged (the gateway retried %d times)", provider, attempt+1)
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, 2*time.Second)
		}
	}()
}

// post sends a notification to p; true when p acknowledged it.
func (c *campaign) post(p *proc, provider string, h http.Header, body []byte) bool {
	req, _ := http.NewRequest("POST", p.url()+"/webhooks/"+provider, bytes.NewReader(body))
	for k, vs := range h {
		req.Header[k] = vs
	}
	res, err := client.Do(req)
	if err != nil {
		return false
	}
	defer res.Body.Close()
	answer, _ := io.ReadAll(io.LimitReader(res.Body, 1<<10))
	switch provider {
	case "alipay":
		return res.StatusCode == 200 && string(answer) == "success"
	default:
		return res.StatusCode/100 == 2
	}
}

// --- the heal, the sweep and the reconciliation ------------------------------

// heal ends every fault: toxics removed, gateway faults cleared, stopped
// processes started again.
func (c *campaign) heal() {
	for _, p := range c.env.procs {
		p.pg.Toxics.ResetToxics(context.Background())
		p.redis.Toxics.ResetToxics(context.Background())
	}
	for _, op := range gatewayOps {
		c.env.alipay.InjectFault(op, "", 0)
		c.env.wechat.InjectFault(op, "", 0)
	}
	for _, p := range c.env.procs {
		if err := p.startRetrying(60 * time.Second); err != nil {
			c.violation("%s does not start again after the heal: %v", p.name(), err)
		}
	}
}

// reconcile runs the nightly reconciliation once, then the statement
// reconciliation of today's statements (the emulators publish them early)
// and the query of recently closed orders.
func (c *campaign) reconcile() {
	var run struct {
		RunReconciliation struct {
			ClosedStragglers, Rescheduled, CountersRepaired, Violations int
			Summary                                                     string
			Error                                                       *string
		} `json:"runReconciliation"`
	}
	if err := c.admin(60*time.Second, `mutation { runReconciliation { closedStragglers rescheduled countersRepaired violations summary error } }`, nil, &run); err != nil {
		c.violation("runReconciliation: %v", err)
	} else {
		r := run.RunReconciliation
		c.figures.reconcile = r.Summary
		if r.Error != nil && *r.Error != "" {
			c.violation("runReconciliation reported an error: %s", *r.Error)
		}
	}
	today := providers.DayOf(time.Now()).String()
	type diffRun struct {
		Provider        string
		Source          string
		Status          string
		Trades, Refunds int
		DifferenceCount int
		Settled         int
		NeedsPerson     int
		Error           *string
	}
	var runs []diffRun
	for _, prov := range []string{"alipay", "wechat"} {
		var out struct {
			ReconcileStatements []diffRun `json:"reconcileStatements"`
		}
		if err := c.admin(60*time.Second, `mutation($p: String, $d: String) { reconcileStatements(provider: $p, date: $d) { provider source status trades refunds differenceCount settled needsPerson error } }`,
			map[string]any{"p": prov, "d": today}, &out); err != nil {
			c.violation("reconcileStatements(%s, %s): %v", prov, today, err)
		}
		runs = append(runs, out.ReconcileStatements...)
	}
	var out struct {
		ReconcileStatements []diffRun `json:"reconcileStatements"`
	}
	if err := c.admin(60*time.Second, `mutation { reconcileStatements { provider source status trades refunds differenceCount settled needsPerson error } }`, nil, &out); err != nil {
		c.violation("reconcileStatements: %v", err)
	}
	runs = append(runs, out.ReconcileStatements...)
	for _, r := range runs {
		if r.DifferenceCount == 0 && r.Error == nil {
			continue
		}
		line := fmt.Sprintf("%s %s %s: %d differences, %d settled, %d need a person", r.Provider, r.Source, r.Status, r.DifferenceCount, r.Settled, r.NeedsPerson)
		if r.Error != nil && *r.Error != "" {
			line += "; error: " + *r.Error
		}
		c.figures.statements = append(c.figures.statements, line)
	}
}

// settle waits (up to a minute) until no refund is still being attempted:
// the refunds the reconciliation started must be done before the checks.
func (c *campaign) settle() {
	ok := waitFor(60*time.Second, func() bool {
		var n int
		err := c.env.db.QueryRow(`SELECT COUNT(*) FROM refund_order WHERE status = 'PROCESSING'`).Scan(&n)
		return err == nil && n == 0
	})
	if !ok {
		rows, _ := c.env.db.Query(`SELECT refund_no, order_no, retry_count, last_error FROM refund_order WHERE status = 'PROCESSING'`)
		if rows != nil {
			for rows.Next() {
				var no, ord, last string
				var n int
				rows.Scan(&no, &ord, &n, &last)
				c.violation("refund %s of order %s still PROCESSING a minute after the reconciliation (%d attempts, last error %q)", no, ord, n, last)
			}
			rows.Close()
		}
	}
}

// --- figures ------------------------------------------------------------------

type figures struct {
	orders, createTries      atomic.Int64
	notifications            atomic.Int64
	notifyRetries            atomic.Int64
	adminRefunds             atomic.Int64
	faults                   map[string]int    // by kind
	createErrors             map[string]int    // createOrder errors by code
	createErrorText          map[string]string // the first message of each code
	fates                    map[string]int
	trades, tradesFen        int64 // paid trades at the gateways (and the sandbox), and their money
	gwRefunds, gwRefundsFen  int64
	delivered, refunded      int64 // paid trades delivered, refunded in full
	failedAlerted            int64
	leftToStatements         int64 // paid trades kami had not acted on before the reconciliation
	closedSeen, closedEarly  int64
	counters                 int
	violations               int
	alerts                   map[string]int
	reconcile                string
	statements               []string
	figuresMu                sync.Mutex
	deliveredCodes, buyersOK int
}

func (f *figures) count(m map[string]int, k string) {
	f.figuresMu.Lock()
	m[k]++
	f.figuresMu.Unlock()
}

func (f *figures) line(seed int64) string {
	return fmt.Sprintf("seed=%d: %d orders, %d paid trades (%d fen), %d delivered, %d refunded, %d failed+alerted, %d gateway refunds (%d fen), %d faults, %d violations",
		seed, f.orders.Load(), f.trades, f.tradesFen, f.delivered, f.refunded, f.failedAlerted, f.gwRefunds, f.gwRefundsFen, sum(f.faults), f.violations)
}

func sum(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

func sorted(m map[string]int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var parts []string
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s=%d", k, m[k]))
	}
	return strings.Join(parts, " ")
}

// verb matches a fmt verb, to print a violation's format as its kind.
var verb = regexp.MustCompile(`%[-+# 0-9.]*[a-zA-Z]`)

// report prints the figures and the violations; a violation fails the
// campaign with the command that replays its seed.
func (c *campaign) report() {
	f := &c.figures
	c.mu.Lock()
	defer c.mu.Unlock()
	f.violations = len(c.violations)
	var b strings.Builder
	fmt.Fprintf(&b, "seed %d, %s of faults, p%d's clock %+v\n", c.seed, c.dur, *procsFlag-1, c.skew)
	fmt.Fprintf(&b, "  faults injected: %d (%s)\n", sum(f.faults), sorted(f.faults))
	fmt.Fprintf(&b, "  orders: %d placed of %d tries; fates %s; createOrder errors %s\n", f.orders.Load(), f.createTries.Load(), sorted(f.fates), sorted(f.createErrors))
	fmt.Fprintf(&b, "  process starts that failed (database or Redis unreachable) and were tried again: %d\n", c.env.startFailures.Load())
	fmt.Fprintf(&b, "  notifications: %d acknowledged, %d refused or lost and sent again\n", f.notifications.Load(), f.notifyRetries.Load())
	fmt.Fprintf(&b, "  paid trades: %d, %d fen checked; delivered %d, refunded in full %d, refund FAILED and alerted %d\n", f.trades, f.tradesFen, f.delivered, f.refunded, f.failedAlerted)
	fmt.Fprintf(&b, "  paid trades left to the reconciliation (notification never delivered, not found by the close): %d\n", f.leftToStatements)
	fmt.Fprintf(&b, "  gateway refunds: %d, %d fen; admin refunds asked %d\n", f.gwRefunds, f.gwRefundsFen, f.adminRefunds.Load())
	fmt.Fprintf(&b, "  codes seen by buyers: %d in %d paid orders; closes watched %d (early %d); stock counters compared %d\n", f.deliveredCodes, f.buyersOK, f.closedSeen, f.closedEarly, f.counters)
	fmt.Fprintf(&b, "  alerts: %s\n", sorted(f.alerts))
	fmt.Fprintf(&b, "  reconciliation: %s\n", f.reconcile)
	for _, s := range f.statements {
		fmt.Fprintf(&b, "  statements: %s\n", s)
	}
	for code, msg := range f.createErrorText {
		fmt.Fprintf(&b, "  createOrder %s, first seen: %s\n", code, msg)
	}
	for _, n := range c.notes {
		fmt.Fprintf(&b, "  note: %s\n", n)
	}
	fmt.Fprintf(&b, "  violations: %d\n", len(c.violations))
	var groups []string
	byGroup := map[string][]string{}
	for _, v := range c.violations {
		if byGroup[v.group] == nil {
			groups = append(groups, v.group)
		}
		byGroup[v.group] = append(byGroup[v.group], v.msg)
	}
	for _, g := range groups {
		vs := byGroup[g]
		fmt.Fprintf(&b, "    %d × %s\n", len(vs), verb.ReplaceAllString(g, "…"))
		for i, m := range vs {
			if i == 5 {
				fmt.Fprintf(&b, "      … and %d more\n", len(vs)-5)
				break
			}
			fmt.Fprintf(&b, "      - %s\n", m)
		}
	}
	c.t.Log(b.String())
	if len(c.violations) > 0 {
		c.t.Errorf("%d violations; replay with: %s", len(c.violations), replay(c.seed))
	}
}
