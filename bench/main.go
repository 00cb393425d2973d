// Command bench drives a running kami over HTTP like real storefronts and
// reports what kami can do end to end:
//
//	go run ./bench                       # build kami, start it on a fresh PostgreSQL database and real Redis
//	go run ./bench -orders 50000 -concurrency 128 -pay-share 0.3 -json out.json
//	go run ./bench -profile /tmp/prof         # also CPU and allocation profiles (see -profile)
//	go run ./bench -url http://127.0.0.1:8080 -admin-token T -sandbox-secret S -db postgres://… -pid 1234
//
// One run has these phases.
//
//  0. Baseline: when pgbench is installed and the tool makes the database,
//     pgbench -N with 16 clients runs for -pgbench on a scratch database
//     of the same PostgreSQL first; kami's figures are printed as ratios
//     to its tps.
//
//  1. Place: -concurrency workers send -orders createOrder mutations, each
//     on an HTTP/1.1 keep-alive connection of its own (GraphQL, distinct
//     contacts, quantity 1, provider sandbox; -load-client, see wire.go). For the -pay-share of the orders, spread evenly, the worker
//     then posts a signed sandbox payment notification to /webhooks/sandbox
//     at once, as the gateway would. Reported: orders placed per second
//     (successful createOrder over the phase's wall time, payments
//     included, as a shop sees them), createOrder latency, errors by
//     extensions.code, payments per second and their latency.
//
//  2. Close: the unpaid orders expire after KAMI_ORDER_TTL (-ttl, short)
//     and kami's close workers close them. The tool counts orders by status
//     in the database until none is PENDING, then reports closes per second
//     (closed orders over the time from the first expiry to the last close)
//     and due-to-closed latency (closed_at − expires_at per order).
//
//  3. Direct: the same database, opened in this process with domain.OpenDB
//     and a pool as large as the server's and with the server's garbage
//     collector target (its go_gc_gogc_percent), runs the same transactions
//     through the ledger at the same concurrency on a new product: each
//     worker places an order (Ledger.PlaceOrder: insert the order, lock a
//     card with SKIP LOCKED, write the stock journal) and, for the same
//     orders of the -pay-share as in phase 1, records its sandbox payment
//     right after (Ledger.RecordPayment, where a webhook ends); the unpaid
//     ones expire after -ttl and a closer in the tool closes them as they
//     fall due, as kami's close workers do (Ledger.CloseOrders, up to 500
//     a batch, earliest first, every 50ms), while placing goes on and until
//     all are closed. Orders and payments are grouped as the server groups
//     them (calls arriving together share one transaction). Missing:
//     HTTP, GraphQL, the Redis stock gate, close scheduling and events,
//     and the pre-close check; the ratio end-to-end / direct orders/s
//     (orders placed over the placing's wall time in both) is what kami's
//     layers leave of the ledger. -direct-place-only runs PlaceOrder alone
//     (no payments, no closes), the figure of earlier runs.
//
//     The TTL is one second by default so that both phases are measured
//     as a shop runs, with closes going on beside the placing, for almost
//     all of their time: until the first order falls due a phase places
//     with nothing closing, which is faster, and the slower phase (end to
//     end) spends a smaller share of its time that way. With a TTL of 5s,
//     in a default run of 20,000 orders, the direct phase (8s) placed
//     without closes for over half its time and the end-to-end phase
//     (15s) for a third, a handicap of the end to end that its costs do
//     not explain.
//
//     Then -pairs rounds (an even number) of an end-to-end chunk and a
//     direct chunk, run back to back and alternating which goes first
//     (pairs.go): the ratio judged against the 0.60 target is the median
//     of the main phases' ratio and the geometric mean of each couple of
//     rounds (1 and 2, 3 and 4), since the machine's speed drifts between
//     phases.
//
//  4. Subscriptions: -subscriptions orders are placed directly with a TTL
//     of an hour, and as many orderStatusChanged subscriptions (20 to a
//     WebSocket) opened on them; reported: the server's VmRSS per 1,000.
//
//  5. Drain: the server is stopped (SIGTERM), -drain orders are placed
//     directly with a TTL of one second and their closes scheduled in
//     Redis as the server schedules them, and once all are due the server
//     is started again. Reported: closes/s from /readyz to the last close
//     (the pre-close check asks the sandbox about each order), the close
//     queue's Redis memory per 10,000 pending orders, the server's memory.
//
//  6. Close floor (-close-floor closes per schema, when the tool makes
//     the database; see floor.go): with kami stopped, the rows a close
//     writes (order CLOSED, its pending_order row deleted, card RECYCLED
//     and its card_for_sale row inserted, a journal row, an event), 500
//     orders to a transaction, on scratch copies of the six tables with
//     kami's indexes and storage options, with kami's before
//     20261201000018 (status in the cards' indexes, no card_for_sale),
//     with kami's before 2026-12-02 (status in the orders' indexes too,
//     no pending_order either), and with primary keys only; then kami's
//     own close transaction (Ledger.CloseOrders) on as many orders placed
//     directly. Reported: closes/s, HOT updates and PostgreSQL's CPU per
//     close for each, and the drain against them.
//
//  7. Check: the server's peak memory (VmHWM from /proc, and the largest
//     VmRSS sampled during the run), its CPU use while placing, a clean
//     exit on SIGTERM, and Ledger.Audit over the whole database: a load
//     test that corrupts the ledger says so, and exits 1.
//
// By default the tool builds kami from the repo (go build), creates a fresh
// PostgreSQL database on -pg (dropped at the end unless -keep), gives the
// server a unique KAMI_REDIS_PREFIX on -redis (its keys are deleted at the
// end unless -keep), generates the admin token and sandbox secret, turns
// the per-contact and per-address caps off (they would refuse a load
// test), and stops the server with SIGTERM at the end. It only talks to
// loopback addresses, and -timeout bounds the run after the build.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/queue"
)

type options struct {
	url, adminToken, sandboxSecret string
	pid                            int
	kamiBin, repo                  string
	db, pg, redis                  string
	ttl                            time.Duration
	orders, concurrency            int
	directOrders                   int
	pairs, pairOrders              int
	payShare                       float64
	dbMaxConns                     int
	noDirect, directPlaceOnly      bool
	keep                           bool
	jsonFile                       string
	timeout                        time.Duration
	profileDir                     string
	profileFor                     time.Duration
	pgbenchFor                     time.Duration
	subscriptions, drain           int
	closeFloor                     int
	loadClient                     string
}

// storefronts makes the place phase's workers, on the client -load-client
// names (see wire.go).
func (o *options) storefronts(c *client, productID, runID string) func() (storefront, error) {
	if o.loadClient == loadNetHTTP {
		return func() (storefront, error) {
			return &httpStorefront{c: c, vars: map[string]any{}, productID: productID, runID: runID}, nil
		}
	}
	body := newOrderBody(productID, runID)
	return func() (storefront, error) { return newWireClient(c.base, c.secret, body) }
}

const (
	loadWire    = "wire"
	loadNetHTTP = "net/http"
)

func parseFlags(args []string) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.StringVar(&o.url, "url", "", "an already running kami (http://127.0.0.1:PORT); empty: build and start one")
	fs.StringVar(&o.adminToken, "admin-token", "", "with -url: its KAMI_ADMIN_TOKEN")
	fs.StringVar(&o.sandboxSecret, "sandbox-secret", "", "with -url: its KAMI_SANDBOX_SECRET")
	fs.IntVar(&o.pid, "pid", 0, "with -url: the server's process id, for its memory and CPU")
	fs.StringVar(&o.kamiBin, "kami-bin", "", "a kami binary to run instead of building one")
	fs.StringVar(&o.repo, "repo", ".", "the kami repo to build from")
	fs.StringVar(&o.db, "db", "", "the database URL (KAMI_DATABASE_URL); empty: a fresh PostgreSQL database on -pg")
	fs.StringVar(&o.pg, "pg", "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable", "PostgreSQL server on which to create the fresh database")
	fs.StringVar(&o.redis, "redis", "redis://127.0.0.1:6379/0", "KAMI_REDIS_URL for the server started")
	fs.DurationVar(&o.ttl, "ttl", time.Second, "KAMI_ORDER_TTL for the server started, and of the direct phase's orders (see phase 3); with -url the direct side's orders get the TTL the server gave the place phase's")
	fs.IntVar(&o.orders, "orders", 20000, "orders to place over HTTP")
	fs.IntVar(&o.concurrency, "concurrency", 64, "concurrent storefront workers (and direct callers)")
	fs.IntVar(&o.directOrders, "direct-orders", 0, "orders for the direct phase; 0: as many as -orders")
	fs.IntVar(&o.pairs, "pairs", 4, "rounds of interleaved end-to-end and direct chunks after the direct phase, an even number (see pairs.go); the ratio judged against the 0.60 target is the median of the main phases' ratio and each couple of rounds' geometric mean; 0, or chunks expected to last under 5 TTLs: the main phases' ratio alone; not run with -no-direct or -direct-place-only")
	fs.IntVar(&o.pairOrders, "pair-orders", 0, "end-to-end orders in each round's chunk; 0: enough to last about 8 TTLs at the place phase's rate, from half of -orders to twice -orders (see pairChunkOrders)")
	fs.Float64Var(&o.payShare, "pay-share", 0.5, "share of orders paid through the sandbox webhook, 0 to 1")
	fs.IntVar(&o.dbMaxConns, "db-max-conns", 20, "KAMI_DB_MAX_CONNS of the server, and the direct phase's pool")
	fs.BoolVar(&o.noDirect, "no-direct", false, "skip the direct phase")
	fs.BoolVar(&o.directPlaceOnly, "direct-place-only", false, "the direct phase only places its orders (no payments, no closes), as before the phase ran the end-to-end transactions")
	fs.BoolVar(&o.keep, "keep", false, "keep the database, the Redis keys and the temp folder")
	fs.StringVar(&o.jsonFile, "json", "", "also write the report as JSON to this file")
	fs.StringVar(&o.profileDir, "profile", "", "write the started server's CPU profiles of the place, close and drain phases, its allocations during the place phase and its heap with the subscriptions open, to this folder (the server serves them on a loopback KAMI_PPROF_ADDR)")
	fs.DurationVar(&o.profileFor, "profile-for", 8*time.Second, "with -profile: how long each CPU profile runs, from the start of its phase")
	fs.DurationVar(&o.pgbenchFor, "pgbench", 10*time.Second, "run pgbench -N (16 clients) this long on a scratch database of -pg first, as the baseline (when pgbench is installed and the tool makes the database); 0: skip")
	fs.IntVar(&o.subscriptions, "subscriptions", 1000, "orderStatusChanged subscriptions to open on pending orders after the direct phase, for the server's memory per 1,000; 0: skip")
	fs.IntVar(&o.drain, "drain", 20000, "orders that fall due while the started server is stopped; it is then restarted and its drain of the backlog measured; 0: skip")
	fs.IntVar(&o.closeFloor, "close-floor", 100000, "closes per schema for the close floor (the close's own row writes on scratch copies of kami's tables, see floor.go), when the tool makes the database; 0: skip")
	fs.StringVar(&o.loadClient, "load-client", loadWire, "the place phase's HTTP client: wire (one keep-alive connection per worker, HTTP/1.1 written directly: the load costs the shared cores less) or net/http (Go's client, as before)")
	fs.DurationVar(&o.timeout, "timeout", 15*time.Minute, "bound on the run after the build (the -pairs rounds alone took 2 minutes of a run at 1,000 orders/s end to end)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	switch {
	case o.orders < 1 || o.orders > 2_000_000:
		return nil, fmt.Errorf("-orders: want 1 to 2000000")
	case o.concurrency < 1 || o.concurrency > 4096:
		return nil, fmt.Errorf("-concurrency: want 1 to 4096")
	case o.payShare < 0 || o.payShare > 1:
		return nil, fmt.Errorf("-pay-share: want 0 to 1")
	case o.timeout <= 0 || o.timeout > 2*time.Hour:
		return nil, fmt.Errorf("-timeout: want up to 2h")
	case o.ttl < time.Second:
		return nil, fmt.Errorf("-ttl: kami takes at least 1s")
	case o.dbMaxConns < 1:
		return nil, fmt.Errorf("-db-max-conns: want at least 1")
	case o.subscriptions < 0 || o.subscriptions > 100_000:
		return nil, fmt.Errorf("-subscriptions: want 0 to 100000")
	case o.drain < 0 || o.drain > 2_000_000:
		return nil, fmt.Errorf("-drain: want 0 to 2000000")
	case o.closeFloor < 0 || o.closeFloor > 2_000_000:
		return nil, fmt.Errorf("-close-floor: want 0 to 2000000")
	case o.directOrders < 0 || o.directOrders > 2_000_000:
		return nil, fmt.Errorf("-direct-orders: want 0 to 2000000")
	case o.pairs < 0 || o.pairs > 20 || o.pairs%2 == 1:
		return nil, fmt.Errorf("-pairs: want an even number from 0 to 20")
	case o.pairOrders < 0 || o.pairOrders > maxPairOrders:
		return nil, fmt.Errorf("-pair-orders: want 0 to %d", maxPairOrders)
	case o.loadClient != loadWire && o.loadClient != loadNetHTTP:
		return nil, fmt.Errorf("-load-client: want %s or %s", loadWire, loadNetHTTP)
	}
	if o.profileDir != "" && o.url != "" {
		return nil, fmt.Errorf("-profile: only for a server the tool starts (not with -url)")
	}
	if o.directOrders == 0 {
		o.directOrders = o.orders
	}
	if o.url != "" {
		if o.adminToken == "" || (o.sandboxSecret == "" && o.payShare > 0) {
			return nil, fmt.Errorf("-url needs -admin-token, and -sandbox-secret when -pay-share is above 0")
		}
		if err := checkLoopbackURL("-url", o.url); err != nil {
			return nil, err
		}
		o.url = strings.TrimRight(o.url, "/")
	}
	if err := checkLoopbackURL("-db", o.db); err != nil {
		return nil, err
	}
	if o.url == "" && o.db == "" {
		if err := checkLoopbackURL("-pg", o.pg); err != nil {
			return nil, err
		}
	}
	if err := checkLoopbackRedis(o.redis); err != nil {
		return nil, err
	}
	return o, nil
}

func main() {
	o, err := parseFlags(os.Args[1:])
	if err != nil {
		if err != flag.ErrHelp {
			fmt.Fprintln(os.Stderr, "bench:", err)
		}
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	code := run(ctx, o)
	stop()
	os.Exit(code)
}

func progress(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "bench: "+format+"\n", args...)
}

// run does one bench run and returns the exit code: 0 when every phase ran
// and the ledger is clean, 1 otherwise. Missing a target is a result, not a
// failure.
func run(ctx context.Context, o *options) (code int) {
	var cleanups []func()
	defer func() {
		for i := len(cleanups) - 1; i >= 0; i-- {
			cleanups[i]()
		}
	}()
	fail := func(format string, args ...any) int {
		fmt.Fprintf(os.Stderr, "bench: "+format+"\n", args...)
		return 1
	}
	runID := time.Now().UTC().Format("150405") + randomHex(2)
	rep := &Report{Started: time.Now().UTC(), CPUs: runtime.NumCPU(), Orders: o.orders, Concurrency: o.concurrency,
		PayShare: o.payShare, TTL: o.ttl.String(), DBMaxConns: o.dbMaxConns, LoadClient: o.loadClient}

	// The database.
	dbURL := o.db
	if dbURL == "" && o.url == "" {
		u, name, drop, err := freshPostgres(ctx, o.pg)
		if err != nil {
			return fail("%v", err)
		}
		dbURL = u
		if o.keep {
			rep.Notes = append(rep.Notes, "kept database "+name)
		} else {
			cleanups = append(cleanups, func() {
				if err := drop(); err != nil {
					progress("%v", err)
				}
			})
		}
	}
	if dbURL != "" && o.db == "" && o.pgbenchFor > 0 {
		progress("running pgbench -N for %s as the baseline", o.pgbenchFor)
		rep.Pgbench = runPgbench(ctx, o.pg, o.pgbenchFor)
	}
	rep.Database = "none given (-db): closes, direct and audit skipped"
	if dbURL != "" {
		rep.Database = describeDB(dbURL)
	}

	// The server.
	var prof *profiler   // with -profile
	var pprofBase string // the started server's pprof listener, for its heap
	var restart func(context.Context) (*serverProc, error)
	var prefix string
	base, adminToken, secret, pid := o.url, o.adminToken, o.sandboxSecret, o.pid
	var srv *serverProc
	if o.url == "" {
		tmp, err := os.MkdirTemp("", "kami-bench-")
		if err != nil {
			return fail("%v", err)
		}
		if o.keep {
			rep.Notes = append(rep.Notes, "kept "+tmp)
		} else {
			cleanups = append(cleanups, func() { os.RemoveAll(tmp) })
		}
		bin := o.kamiBin
		if bin == "" {
			repo, err := findRepoRoot(o.repo)
			if err != nil {
				return fail("%v", err)
			}
			progress("building kami from %s", repo)
			if bin, err = buildKami(ctx, repo, tmp); err != nil {
				return fail("%v", err)
			}
		}
		addr, err := freeLoopbackAddr()
		if err != nil {
			return fail("%v", err)
		}
		base = "http://" + addr
		adminToken, secret = randomHex(24), randomHex(24)
		prefix = "kami-bench-" + runID + ":"
		env := []string{
			"KAMI_ADDR=" + addr,
			"KAMI_PUBLIC_URL=" + base,
			"KAMI_DATA_DIR=" + filepath.Join(tmp, "data"),
			"KAMI_DATABASE_URL=" + dbURL,
			"KAMI_DB_MAX_CONNS=" + strconv.Itoa(o.dbMaxConns),
			"KAMI_REDIS_URL=" + o.redis,
			"KAMI_REDIS_PREFIX=" + prefix,
			"KAMI_ORDER_TTL=" + o.ttl.String(),
			"KAMI_ADMIN_TOKEN=" + adminToken,
			"KAMI_SANDBOX_SECRET=" + secret,
			"KAMI_MAX_PENDING_PER_CONTACT=0",
			"KAMI_MAX_PENDING_PER_ADDRESS=0",
			"KAMI_MAX_LOCKED_PER_CONTACT=0", // one address places every order
			"KAMI_MAX_LOCKED_PER_ADDRESS=0",
			"KAMI_MAX_WEBSOCKETS_PER_ADDRESS=0", // -subscriptions opens many from one address
			"KAMI_LOG_LEVEL=warn",
		}
		// The pprof listener (loopback) is always on: the subscriptions'
		// memory is read from the Go heap after a collection it runs.
		paddr, err := freeLoopbackAddr()
		if err != nil {
			return fail("%v", err)
		}
		env = append(env, "KAMI_PPROF_ADDR="+paddr)
		pprofBase = "http://" + paddr
		if o.profileDir != "" {
			if err := os.MkdirAll(o.profileDir, 0o755); err != nil {
				return fail("-profile: %v", err)
			}
			prof = newProfiler(paddr, o.profileDir)
			rep.Notes = append(rep.Notes, fmt.Sprintf("profiles in %s: go tool pprof -top -nodecount=15 %s %s", o.profileDir, bin,
				filepath.Join(o.profileDir, "cpu-place.pprof")))
		}
		progress("starting kami on %s", addr)
		if srv, err = startKami(ctx, bin, env, base); err != nil {
			return fail("%v", err)
		}
		pid = srv.pid()
		restart = func(ctx context.Context) (*serverProc, error) { return startKami(ctx, bin, env, base) }
		rep.Server = fmt.Sprintf("started by bench (pid %d, %s)", pid, base)
		cleanups = append(cleanups, func() { srv.stop(40 * time.Second) }) // no-op once stopped
		if !o.keep {
			cleanups = append(cleanups, func() {
				if err := dropRedisPrefix(o.redis, prefix); err != nil {
					progress("deleting the Redis keys under %s: %v", prefix, err)
				}
			})
		}
		rep.Redis = fmt.Sprintf("%s, prefix %s", describeDB(o.redis), prefix)
	} else {
		rep.Server = o.url
		rep.Redis = "the server's own"
	}

	runCtx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	c := newClient(base, adminToken, secret, o.concurrency)

	var db *bun.DB
	if dbURL != "" {
		var err error
		if db, err = domain.OpenDB(runCtx, dbURL, os.TempDir(), domain.DBOptions{MaxOpenConns: o.dbMaxConns}); err != nil {
			return fail("opening the database: %v", err)
		}
		cleanups = append(cleanups, func() { db.Close() })
		if d := describeServer(runCtx, db); d != "" {
			rep.Database += " (" + d + ")"
		}
	}

	// Setup through the API.
	progress("creating the product and importing %d cards", o.orders)
	productName := "bench-" + runID
	productID, err := c.setupProduct(runCtx, productName, o.orders)
	if err != nil {
		return fail("setup: %v", err)
	}

	// Place.
	var rss *rssSampler
	if pid > 0 {
		rss = sampleRSS(pid, 100*time.Millisecond)
	}
	probe := cpuProbe{serverPID: pid, dbName: dbNameOf(dbURL)}
	cpu0 := probe.take()
	var placeCPU, benchCPU func() error
	if prof != nil {
		benchCPU = prof.selfCPU("cpu-place-bench.pprof")
		if err := prof.fetch(runCtx, "allocs", "allocs-before.pprof"); err != nil {
			rep.Notes = append(rep.Notes, "profile: "+err.Error())
		}
		placeCPU = prof.cpu(runCtx, o.profileFor, "cpu-place.pprof")
	}
	progress("placing %d orders at concurrency %d, paying %.0f%%", o.orders, o.concurrency, 100*o.payShare)
	waits := sampleWaits(runCtx, db, waitEvery)
	groups0 := c.groupCounters(runCtx)
	lr := runLoad(runCtx, o.storefronts(c, productID, runID), o.orders, o.concurrency, o.payShare)
	placeEnd := time.Now()
	placeWaits := waits.Stop(lr.start, lr.wall)
	if prof != nil {
		if err := prof.fetch(runCtx, "allocs", "allocs-after.pprof"); err != nil {
			rep.Notes = append(rep.Notes, "profile: "+err.Error())
		}
		if err := placeCPU(); err != nil {
			rep.Notes = append(rep.Notes, "profile: "+err.Error())
		}
		if err := benchCPU(); err != nil {
			rep.Notes = append(rep.Notes, "profile: "+err.Error())
		}
	}
	rep.Process.PlaceCPU = cpuUse(cpu0, probe.take())
	wall := lr.wall
	rep.Place = PlaceReport{OK: len(lr.placed), Errors: lr.placeErrors, WallSeconds: wall.Seconds(),
		OrdersPerSec: rate(len(lr.placed), wall), Latency: summarize(lr.placed),
		RequestsPerSec: rate(len(lr.placed)+sum(lr.placeErrors)+lr.paySent, wall), ByTenth: byTenth(lr.doneAt, wall), Waits: placeWaits,
		Groups: groupsSince(groups0, c.groupCounters(runCtx))}
	rep.Pay = PayReport{Sent: lr.paySent, OK: len(lr.paid), Errors: lr.payErrors,
		PaymentsPerSec: rate(len(lr.paid), wall), Latency: summarize(lr.paid)}
	if lr.firstError != "" {
		rep.Notes = append(rep.Notes, "first error: "+lr.firstError)
	}
	progress("placed %d orders/s", int(rep.Place.OrdersPerSec))

	// Close.
	pidProduct, _ := strconv.ParseInt(productID, 10, 64)
	if db != nil && runCtx.Err() == nil {
		progress("waiting for the %d unpaid orders to close", len(lr.placed)-len(lr.paid))
		var closeCPU func() error
		if prof != nil {
			closeCPU = prof.cpu(runCtx, o.profileFor, "cpu-close.pprof")
		}
		cr, err := waitForCloses(runCtx, db, pidProduct, len(lr.placed)-len(lr.paid), placeEnd)
		if closeCPU != nil {
			if err := closeCPU(); err != nil {
				rep.Notes = append(rep.Notes, "profile: "+err.Error())
			}
		}
		if err != nil {
			rep.Notes = append(rep.Notes, "measuring closes: "+err.Error())
		} else {
			rep.Close = cr
		}
	}
	if runCtx.Err() == nil {
		rep.Stats = c.stats(runCtx)
	}
	if rss != nil {
		rep.Process.PID = pid
		rep.Process.MaxRSSMiB = float64(rss.Stop()) / 1024
		if kib, err := procStatusKiB(pid, "VmHWM"); err == nil {
			rep.Process.PeakMemoryMiB = float64(kib) / 1024
		}
	}

	// Direct. The audit's and the subscriptions' ledger places orders that
	// stay PENDING for an hour; the direct phase's expire after -ttl.
	var ledger *domain.Ledger
	if db != nil {
		if ledger, err = directLedger(db, time.Hour); err != nil {
			return fail("%v", err)
		}
	}
	if ledger != nil && !o.noDirect && runCtx.Err() == nil {
		dl, st := ledger, &settle{payShare: o.payShare}
		ttl := o.ttl
		if o.directPlaceOnly {
			st = nil
		} else {
			ttl = directTTL(runCtx, o, db, pidProduct, rep)
			if dl, err = directLedger(db, ttl); err != nil {
				return fail("%v", err)
			}
		}
		// The ledger runs in this process: with the server's garbage
		// collector target, so that both sides collect alike. It stays
		// so for the later phases' ledger work (the drain's orders, the
		// close floor's close transaction), but the pairs' end-to-end
		// chunks run their load at the target the place phase ran it at.
		gcPercent, loadGCPercent := 0, 0
		if os.Getenv("GOGC") == "" {
			if gcPercent = c.gcPercent(runCtx); gcPercent > 0 {
				loadGCPercent = debug.SetGCPercent(gcPercent)
			}
		}
		progress("direct through the ledger, %d orders: %s", o.directOrders, st.describe())
		d, cpu, err := runDirect(runCtx, dl, runID, o.directOrders, o.concurrency, probe, st, true)
		rep.Process.DirectCPU = cpu
		if err != nil {
			rep.Notes = append(rep.Notes, "direct phase: "+err.Error())
		}
		if d != nil {
			d.GCPercent = gcPercent
			rep.Direct = d
			if d.OrdersPerSec > 0 {
				rep.Ratio = rep.Place.OrdersPerSec / d.OrdersPerSec
			}
		}
		pairOrders := pairChunkOrders(o.pairOrders, o.orders, rep.Place.OrdersPerSec, ttl)
		chunkLasts := time.Duration(float64(pairOrders) / max(1, rep.Place.OrdersPerSec) * float64(time.Second))
		if rep.Ratio > 0 && !o.directPlaceOnly && o.pairs > 0 && chunkLasts < minChunkTTLs*ttl {
			rep.Notes = append(rep.Notes, fmt.Sprintf("pairs not run: an end-to-end chunk of %d orders would last about %s, under %d TTLs of %s (shorten -ttl, or raise -pair-orders and -timeout)",
				pairOrders, chunkLasts.Round(100*time.Millisecond), minChunkTTLs, ttl))
		} else if rep.Ratio > 0 && !o.directPlaceOnly && o.pairs > 0 && runCtx.Err() == nil {
			rep.Pairs = runPairs(runCtx, pairRun{runID: runID, scale: d.OrdersPerSec / rep.Place.OrdersPerSec, loadGCPercent: loadGCPercent,
				chunks: liveChunks{o: o, c: c, db: db, ledger: dl, probe: probe}}, o.pairs, pairOrders)
		}
	}
	rep.RatioMedian, rep.RatioOf, rep.RatioFailed = judgedRatio(rep.Ratio, rep.Pairs)

	// Subscriptions: on orders of their own, pending for an hour.
	if srv != nil && ledger != nil && o.subscriptions > 0 && runCtx.Err() == nil {
		progress("opening %d subscriptions", o.subscriptions)
		sr, err := measureSubscriptions(runCtx, ledger, base, adminToken, runID+"-subs", o.subscriptions, o.concurrency, pid, pprofBase, prof)
		if err != nil {
			rep.Notes = append(rep.Notes, "subscriptions: "+err.Error())
		}
		rep.Subscriptions = sr
	}

	// Drain: stop, let a backlog fall due, restart.
	ok := true
	if srv != nil && db != nil && o.drain > 0 && runCtx.Err() == nil {
		progress("stopping kami; %d orders fall due while it is down", o.drain)
		rep.Process.Exit = srv.stop(40 * time.Second)
		ok = ok && strings.HasPrefix(rep.Process.Exit, "clean")
		rdb, err := redisClient(o.redis)
		if err != nil {
			return fail("%v", err)
		}
		dr, restarted, err := runDrain(runCtx, db, rdb, queue.NewKeys(prefix), runID, o.drain, o.concurrency, restart, probe, prof, o.profileFor)
		rdb.Close()
		if restarted != nil {
			srv = restarted
		}
		if err != nil {
			rep.Notes = append(rep.Notes, "drain: "+err.Error())
		}
		rep.Drain = dr
	}

	// Check.
	if srv != nil {
		progress("stopping kami")
		exit := srv.stop(40 * time.Second)
		ok = ok && strings.HasPrefix(exit, "clean")
		if rep.Process.Exit != "" {
			exit = rep.Process.Exit + "; after the restart: " + exit
		}
		rep.Process.Exit = exit
		rep.Process.LogWarnings, rep.Process.LogErrors = srv.log.Counts()
		if rep.Process.LogWarnings+rep.Process.LogErrors > 0 {
			rep.Process.LogTail = srv.log.Tail()
		}
	}
	// The close floor: with kami stopped, on scratch tables.
	if db != nil && o.db == "" && o.closeFloor > 0 && runCtx.Err() == nil {
		progress("close floor: %d closes for each of %d schemas", o.closeFloor, len(floorVariants))
		rep.Floor = runFloor(runCtx, db, cpuProbe{dbName: dbNameOf(dbURL)}, runID, o.closeFloor, runtime.NumCPU())
	}
	if ledger != nil {
		actx, acancel := context.WithTimeout(ctx, 2*time.Minute)
		rep.Audit = runAudit(actx, ledger)
		acancel()
		ok = ok && rep.Audit.Clean
	}
	if runCtx.Err() != nil && ctx.Err() == nil {
		rep.Notes = append(rep.Notes, fmt.Sprintf("the run hit -timeout %s; later phases are partial or missing", o.timeout))
		ok = false
	}
	if ctx.Err() != nil {
		rep.Notes = append(rep.Notes, "interrupted")
		ok = false
	}

	rep.Write(os.Stdout)
	if o.jsonFile != "" {
		b, _ := json.MarshalIndent(rep, "", "  ")
		if err := os.WriteFile(o.jsonFile, append(b, '\n'), 0o644); err != nil {
			progress("writing %s: %v", o.jsonFile, err)
			ok = false
		}
	}
	if !ok {
		return 1
	}
	return 0
}
