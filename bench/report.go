package main

import (
	"fmt"
	"io"
	"math"
	"slices"
	"sort"
	"strings"
	"time"
)

// Latency summarises a set of request durations, in milliseconds.
type Latency struct {
	Count  int     `json:"count"`
	P50Ms  float64 `json:"p50_ms"`
	P99Ms  float64 `json:"p99_ms"`
	MaxMs  float64 `json:"max_ms"`
	MeanMs float64 `json:"mean_ms"`
}

// percentile is the nearest-rank percentile (q in [0, 1]) of sorted: the
// smallest value at least q of the values are at or below. 0 for none.
func percentile(sorted []time.Duration, q float64) time.Duration {
	n := len(sorted)
	if n == 0 {
		return 0
	}
	rank := int(math.Ceil(q * float64(n)))
	rank = max(1, min(rank, n))
	return sorted[rank-1]
}

// summarize sorts ds in place and returns its summary.
func summarize(ds []time.Duration) Latency {
	if len(ds) == 0 {
		return Latency{}
	}
	slices.Sort(ds)
	var sum time.Duration
	for _, d := range ds {
		sum += d
	}
	return Latency{
		Count:  len(ds),
		P50Ms:  ms(percentile(ds, 0.50)),
		P99Ms:  ms(percentile(ds, 0.99)),
		MaxMs:  ms(ds[len(ds)-1]),
		MeanMs: ms(sum / time.Duration(len(ds))),
	}
}

// byTenth splits wall into ten equal slices and returns the rate of the
// events at doneAt (offsets from the start) in each: a falling series is a
// system that slows as its tables grow.
func byTenth(doneAt []time.Duration, wall time.Duration) []float64 {
	if wall <= 0 {
		return nil
	}
	counts := make([]int, 10)
	for _, t := range doneAt {
		i := int(int64(t) * 10 / int64(wall))
		counts[max(0, min(i, 9))]++
	}
	out := make([]float64, 10)
	for i, n := range counts {
		out[i] = math.Round(rate(n, wall/10))
	}
	return out
}

func fmtSeries(xs []float64) string {
	parts := make([]string, len(xs))
	for i, x := range xs {
		parts[i] = fmt.Sprintf("%.0f", x)
	}
	return strings.Join(parts, " ")
}

func ms(d time.Duration) float64 { return math.Round(float64(d)/float64(time.Microsecond)) / 1000 }

// rate is n per second over d; 0 when d is not positive.
func rate(n int, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(n) / d.Seconds()
}

// Report is everything one run measured; -json writes it as is.
type Report struct {
	Started     time.Time `json:"started"`
	Database    string    `json:"database"` // dialect and database name, never a password
	Redis       string    `json:"redis"`
	Server      string    `json:"server"` // "started by bench" or the -url given
	CPUs        int       `json:"cpus"`
	Orders      int       `json:"orders"`
	Concurrency int       `json:"concurrency"`
	PayShare    float64   `json:"pay_share"`
	TTL         string    `json:"ttl"`
	DBMaxConns  int       `json:"db_max_conns"`
	LoadClient  string    `json:"load_client"` // the place phase's HTTP client: wire or net/http

	Place  PlaceReport   `json:"place"`
	Pay    PayReport     `json:"pay"`
	Close  *CloseReport  `json:"close,omitempty"`
	Direct *DirectReport `json:"direct,omitempty"`
	Ratio  float64       `json:"ratio_end_to_end_over_direct,omitempty"`
	// Pairs are the interleaved rounds after the direct phase; RatioMedian
	// is the ratio judged against the target (judgedRatio): the median of
	// RatioOf values, Ratio and the couples of rounds' geometric means;
	// RatioFailed rounds failed, and then the target is not met.
	Pairs       []PairReport  `json:"pairs,omitempty"`
	RatioMedian float64       `json:"ratio_median,omitempty"`
	RatioFailed int           `json:"ratio_failed_rounds,omitempty"`
	RatioOf     int           `json:"ratio_median_of,omitempty"`
	Process     ProcessReport `json:"process"`
	Stats       *StatsReport  `json:"stats,omitempty"`
	Audit       *AuditReport  `json:"audit,omitempty"`
	// The baseline and the measures of memory and of the drain after a
	// restart.
	Pgbench       *PgbenchReport       `json:"pgbench,omitempty"`
	Subscriptions *SubscriptionsReport `json:"subscriptions,omitempty"`
	Drain         *DrainReport         `json:"drain,omitempty"`
	Floor         *FloorReport         `json:"close_floor,omitempty"`
	Notes         []string             `json:"notes,omitempty"`
}

// PlaceReport is the createOrder phase.
type PlaceReport struct {
	OK           int            `json:"ok"`
	Errors       map[string]int `json:"errors,omitempty"` // by extensions.code, HTTP_<status> or TRANSPORT
	WallSeconds  float64        `json:"wall_seconds"`
	OrdersPerSec float64        `json:"orders_per_sec"`
	Latency      Latency        `json:"latency"`
	// RequestsPerSec counts createOrder and webhook requests together.
	RequestsPerSec float64 `json:"requests_per_sec"`
	// ByTenth is orders/s in each tenth of the phase's wall time.
	ByTenth []float64 `json:"orders_per_sec_by_tenth,omitempty"`
	// Waits is what the machine and the database did in each tenth.
	Waits *WaitsReport `json:"waits,omitempty"`
	// Groups is the ledger's group commit during the phase, by kind.
	Groups map[string]GroupReport `json:"groups,omitempty"`
}

// GroupReport is one kind of the ledger's shared transactions (group
// commit) over a phase: fewer calls per transaction means more
// transactions, and more of the database's per-statement work, per order.
type GroupReport struct {
	Batches int64 `json:"batches"`
	Calls   int64 `json:"calls"`
	Split   int64 `json:"split,omitempty"`
}

// fmtGroups prints "place 812 tx, 24.6 a tx; pay ...".
func fmtGroups(gs map[string]GroupReport) string {
	kinds := make([]string, 0, len(gs))
	for k := range gs {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	parts := make([]string, 0, len(kinds))
	for _, k := range kinds {
		g := gs[k]
		mean := 0.0
		if g.Batches > 0 {
			mean = float64(g.Calls) / float64(g.Batches)
		}
		part := fmt.Sprintf("%s %d calls in %d transactions (%.1f a transaction)", k, g.Calls, g.Batches, mean)
		if g.Split > 0 {
			part += fmt.Sprintf(", %d split", g.Split)
		}
		parts = append(parts, part)
	}
	return strings.Join(parts, "; ")
}

// PayReport is the sandbox webhook calls made during the place phase.
type PayReport struct {
	Sent           int            `json:"sent"`
	OK             int            `json:"ok"` // 200 answers
	Errors         map[string]int `json:"errors,omitempty"`
	PaymentsPerSec float64        `json:"payments_per_sec"`
	Latency        Latency        `json:"latency"`
}

// CloseReport is the expiry of the unpaid orders.
type CloseReport struct {
	Unpaid        int            `json:"unpaid"`
	Closed        int            `json:"closed"`
	Complete      bool           `json:"complete"`     // no order was PENDING at the end
	DuringPlace   int            `json:"during_place"` // closes made while orders were still being placed
	WindowSeconds float64        `json:"window_seconds"`
	ClosesPerSec  float64        `json:"closes_per_sec"`
	DueToClosed   Latency        `json:"due_to_closed"`
	Statuses      map[string]int `json:"statuses"`
	lastClose     time.Time      // closed_at of the last close
}

// DirectReport is the ledger in-process, no server in the way: the
// end-to-end phase's transactions (place, pay a share, close the rest at
// the TTL), or with -direct-place-only Ledger.PlaceOrder alone.
type DirectReport struct {
	Runs         string         `json:"runs"` // what the phase ran
	PlaceOnly    bool           `json:"place_only"`
	OK           int            `json:"ok"`
	Errors       map[string]int `json:"errors,omitempty"`
	WallSeconds  float64        `json:"wall_seconds"` // of the placing, payments included
	OrdersPerSec float64        `json:"orders_per_sec"`
	Latency      Latency        `json:"latency"`
	ByTenth      []float64      `json:"orders_per_sec_by_tenth,omitempty"`
	// Waits is what the machine and the database did in each tenth,
	// sampled as in the place phase.
	Waits *WaitsReport `json:"waits,omitempty"`
	// Unless PlaceOnly: the payments (Ledger.RecordPayment) and the closes
	// (Ledger.CloseOrders, measured from the rows as the close phase is).
	Pay          *PayReport             `json:"pay,omitempty"`
	Close        *CloseReport           `json:"close,omitempty"`
	CloseBatches int                    `json:"close_batches,omitempty"` // CloseOrders calls committed
	CloseSkipped int                    `json:"close_skipped,omitempty"` // closed by another (the server's sweeper) first
	CloseErrors  map[string]int         `json:"close_errors,omitempty"`
	Groups       map[string]GroupReport `json:"groups,omitempty"`
	// GCPercent is the garbage collector target the phase ran with: the
	// server's (its go_gc_gogc_percent); 0 when GOGC was set for both or
	// the server's was unknown.
	GCPercent int `json:"gc_percent,omitempty"`
}

// ProcessReport is the server process seen from /proc, and the machine.
type ProcessReport struct {
	PID           int     `json:"pid,omitempty"`
	PeakMemoryMiB float64 `json:"peak_memory_mib,omitempty"` // VmHWM at the end
	MaxRSSMiB     float64 `json:"max_rss_mib,omitempty"`     // largest sampled VmRSS
	// CPU use during the place phase and the direct phase.
	PlaceCPU    CPUUse   `json:"place_cpu"`
	DirectCPU   CPUUse   `json:"direct_cpu"`
	Exit        string   `json:"exit,omitempty"`
	LogWarnings int      `json:"log_warnings,omitempty"`
	LogErrors   int      `json:"log_errors,omitempty"`
	LogTail     []string `json:"log_tail,omitempty"`
}

// StatsReport is kami's own stats query at the end.
type StatsReport struct {
	CloseSuccessRate *float64 `json:"closeSuccessRate"` // as the stats query names it
	Queues           []struct {
		Name                 string  `json:"name"`
		Backlog              int     `json:"backlog"`
		OldestOverdueSeconds float64 `json:"oldestOverdueSeconds"`
	} `json:"queues"`
}

// AuditReport is Ledger.Audit at the end.
type AuditReport struct {
	Clean      bool     `json:"clean"`
	Violations []string `json:"violations,omitempty"`
	Error      string   `json:"error,omitempty"`
}

// The speed targets kami holds itself to: orders per second end to end, and
// end to end as a share of the ledger alone.
const (
	targetOrdersPerSec = 1500
	targetRatio        = 0.60
	// A restarted server drains a backlog of due orders at this many
	// closes a second, and at this multiple of pgbench -N's tps.
	targetDrain        = 20000
	targetDrainPgbench = 5
)

// Write prints the report for people.
func (r *Report) Write(w io.Writer) {
	p := func(format string, args ...any) { fmt.Fprintf(w, format+"\n", args...) }
	lat := func(l Latency) string {
		return fmt.Sprintf("p50 %s  p99 %s  max %s  mean %s", fmtMs(l.P50Ms), fmtMs(l.P99Ms), fmtMs(l.MaxMs), fmtMs(l.MeanMs))
	}
	p("kami bench, %s", r.Started.Format(time.RFC3339))
	p("  server        %s", r.Server)
	p("  database      %s", r.Database)
	p("  redis         %s", r.Redis)
	p("  load          %d orders, concurrency %d, pay share %.2f, TTL %s, DB pool %d, %d CPUs, %s client",
		r.Orders, r.Concurrency, r.PayShare, r.TTL, r.DBMaxConns, r.CPUs, r.LoadClient)
	p("")
	p("place  createOrder over HTTP + GraphQL")
	p("  orders placed %d in %.2fs: %.0f orders/s", r.Place.OK, r.Place.WallSeconds, r.Place.OrdersPerSec)
	p("  latency       %s", lat(r.Place.Latency))
	p("  errors        %s", fmtCounts(r.Place.Errors))
	p("  all requests  %.0f/s (createOrder + webhook)", r.Place.RequestsPerSec)
	if len(r.Place.ByTenth) > 0 {
		p("  by tenth      %s orders/s", fmtSeries(r.Place.ByTenth))
	}
	printWaits(p, r.Place.Waits, "the database's (kami's)")
	if len(r.Place.Groups) > 0 {
		p("  group commit  %s", fmtGroups(r.Place.Groups))
	}
	// pays and closes print a phase's payments and closes.
	pays := func(pr PayReport, ok string) {
		if pr.Sent == 0 {
			p("  none sent")
			return
		}
		p("  paid          %d of %d %s: %.0f payments/s", pr.OK, pr.Sent, ok, pr.PaymentsPerSec)
		p("  latency       %s", lat(pr.Latency))
		p("  errors        %s", fmtCounts(pr.Errors))
	}
	closeState := func(c *CloseReport) string {
		if !c.Complete {
			return "INCOMPLETE: orders still PENDING at the deadline"
		}
		return "all closed"
	}
	closes := func(c *CloseReport) {
		p("  closed        %d of %d unpaid, first expiry to last close %.2fs: %.0f closes/s", c.Closed, c.Unpaid, c.WindowSeconds, c.ClosesPerSec)
		p("                (orders fall due as fast as they were placed: closes/s cannot pass that; due→closed is the lag)")
		p("  due→closed    %s", lat(c.DueToClosed))
		p("  overlap       %d of the closes ran while orders were still being placed", c.DuringPlace)
		p("  statuses      %s", fmtCounts(c.Statuses))
	}
	p("pay    signed sandbox notification, POST /webhooks/sandbox, right after createOrder")
	pays(r.Pay, "answered 200")
	if c := r.Close; c != nil {
		p("close  unpaid orders expire after the TTL (%s)", closeState(c))
		closes(c)
	}
	if d := r.Direct; d != nil {
		p("direct %s", d.Runs)
		p("       in-process on the same database (no HTTP, GraphQL, Redis gate, scheduling, events)")
		if d.GCPercent > 0 {
			p("       with the server's garbage collector target, GOGC %d (from its /metrics)", d.GCPercent)
		}
		p("  orders placed %d in %.2fs: %.0f orders/s", d.OK, d.WallSeconds, d.OrdersPerSec)
		p("  latency       %s", lat(d.Latency))
		p("  errors        %s", fmtCounts(d.Errors))
		if len(d.ByTenth) > 0 {
			p("  by tenth      %s orders/s", fmtSeries(d.ByTenth))
		}
		printWaits(p, d.Waits, "the database's (the ledger's)")
		if len(d.Groups) > 0 {
			p("  group commit  %s", fmtGroups(d.Groups))
		}
		if d.Pay != nil {
			p("  pay           Ledger.RecordPayment (the batched path of a sandbox webhook), right after PlaceOrder")
			pays(*d.Pay, "delivered")
		}
		if c := d.Close; c != nil {
			p("  close         Ledger.CloseOrders as they fall due, up to %d a batch (%s): %d batches, %d closed by another first, errors %s",
				closeBatch, closeState(c), d.CloseBatches, d.CloseSkipped, fmtCounts(d.CloseErrors))
			closes(c)
		}
		p("  end-to-end / direct  %.2f (%s)", r.Ratio, d.ratioOf())
		for i, pr := range r.Pairs {
			if pr.Error != "" {
				p("  pair %d        %s first: FAILED: %s", i+1, pr.First, pr.Error)
				continue
			}
			p("  pair %d        %s first: end to end %d orders %.0f/s (%.1fs), direct %d orders %.0f/s (%.1fs): %.2f",
				i+1, pr.First, pr.EndToEndOrders, pr.EndToEnd, float64(pr.EndToEndOrders)/pr.EndToEnd,
				pr.DirectOrders, pr.Direct, float64(pr.DirectOrders)/pr.Direct, pr.Ratio)
		}
		if len(r.Pairs) > 0 {
			p("  judged        %.2f, the median of %d: %s%s",
				r.RatioMedian, r.RatioOf, fmtJudged(r.Ratio, r.Pairs), failedRounds(r.RatioFailed))
		}
	}
	pr := r.Process
	p("server")
	if pr.PeakMemoryMiB > 0 || pr.MaxRSSMiB > 0 {
		p("  peak memory   %.1f MiB VmHWM (largest sampled VmRSS %.1f MiB)", pr.PeakMemoryMiB, pr.MaxRSSMiB)
	} else {
		p("  peak memory   unknown (give -pid with -url)")
	}
	cpu := func(u CPUUse) string {
		return fmt.Sprintf("kami %.2f, postgres %.2f (+%.2f rest of PostgreSQL), redis %.2f, bench %.2f, other %.2f cores; machine %.0f%% busy",
			u.Server, u.PostgresDB, u.PostgresOther, u.Redis, u.Bench, u.Other, 100*u.MachineBusy)
	}
	if pr.PlaceCPU.MachineBusy > 0 {
		p("  CPU, place    %s", cpu(pr.PlaceCPU))
	}
	if r.Direct != nil && pr.DirectCPU.MachineBusy > 0 {
		p("  CPU, direct   %s", cpu(pr.DirectCPU))
	}
	if pr.Exit != "" {
		p("  exit          %s", pr.Exit)
	}
	if pr.LogWarnings+pr.LogErrors > 0 {
		p("  log           %d warnings, %d errors; last lines:", pr.LogWarnings, pr.LogErrors)
		for _, l := range pr.LogTail {
			p("    %s", l)
		}
	}
	if s := r.Stats; s != nil {
		rate := "n/a"
		if s.CloseSuccessRate != nil {
			rate = fmt.Sprintf("%.4f", *s.CloseSuccessRate)
		}
		var qs []string
		for _, q := range s.Queues {
			qs = append(qs, fmt.Sprintf("%s backlog %d overdue %.1fs", q.Name, q.Backlog, q.OldestOverdueSeconds))
		}
		if len(qs) == 0 {
			qs = []string{"no queues listed"}
		}
		p("  stats         closeSuccessRate %s; %s", rate, strings.Join(qs, "; "))
	}
	if a := r.Audit; a != nil {
		switch {
		case a.Error != "":
			p("ledger audit    FAILED TO RUN: %s", a.Error)
		case a.Clean:
			p("ledger audit    clean")
		default:
			p("ledger audit    %d VIOLATIONS", len(a.Violations))
			for _, v := range a.Violations {
				p("    %s", v)
			}
		}
	}
	if r.Direct != nil {
		judged, of := r.Ratio, r.Direct.ratioOf()
		if len(r.Pairs) > 0 {
			judged, of = r.RatioMedian, fmt.Sprintf("%s, median of %d%s", of, r.RatioOf, failedRounds(r.RatioFailed))
		}
		p("targets         %.0f orders/s ≥ %d: %s; ratio %.2f ≥ %.2f: %s (%s)",
			r.Place.OrdersPerSec, targetOrdersPerSec, metOrNot(r.Place.OrdersPerSec >= targetOrdersPerSec),
			judged, targetRatio, metOrNot(judged >= targetRatio && r.RatioFailed == 0), of)
	}
	if b := r.Pgbench; b != nil {
		if b.Error != "" {
			p("baseline        pgbench failed: %s", b.Error)
		} else {
			p("baseline        %s: %.0f tps (same run, before kami's phases)", b.Command, b.TPS)
			p("  as ratios     place %.2f× pgbench tps; direct %s", r.Place.OrdersPerSec/b.TPS, ratioOf(r.Direct != nil, func() float64 { return r.Direct.OrdersPerSec / b.TPS }))
		}
	}
	if s := r.Subscriptions; s != nil {
		p("subscriptions   %d open on %d WebSockets: VmRSS %.1f → %.1f MiB, %.2f MiB per 1,000", s.Open, s.Connections, s.RSSBeforeMiB, s.RSSOpenMiB, s.MiBPerThousand)
		if s.HeapOpenMiB > 0 {
			p("                Go heap and stacks after a collection %.1f → %.1f MiB, %.2f MiB per 1,000", s.HeapBeforeMiB, s.HeapOpenMiB, s.HeapMiBPerThousand)
		}
	}
	if d := r.Drain; d != nil {
		p("drain  %d orders fell due while kami was stopped; restarted (ready in %.2fs)", d.Orders, d.StartSeconds)
		if d.Close != nil {
			p("  closed        %d of %d, ready → last close %.2fs: %.0f closes/s (pre-close check on)", d.Close.Closed, d.Orders, d.WindowSeconds, d.ClosesPerSec)
		}
		p("  memory        Redis close queue %.0f bytes per 10,000 pending; kami VmRSS %.1f MiB at ready, peak %.1f MiB while draining", d.RedisBytesPer10k, d.RSSReadyMiB, d.PeakMiB)
		if d.CPU.MachineBusy > 0 {
			p("  CPU, drain    %s", cpu(d.CPU))
		}
		line := fmt.Sprintf("targets         drain %.0f closes/s ≥ %d: %s", d.ClosesPerSec, targetDrain, metOrNot(d.ClosesPerSec >= targetDrain))
		if b := r.Pgbench; b != nil && b.TPS > 0 {
			line += fmt.Sprintf("; %.2f× pgbench ≥ %d×: %s", d.ClosesPerSec/b.TPS, targetDrainPgbench, metOrNot(d.ClosesPerSec/b.TPS >= targetDrainPgbench))
		}
		p("%s", line)
	}
	if f := r.Floor; f != nil {
		p("close floor  a close's own rows (order CLOSED, its pending_order row deleted, card RECYCLED and its card_for_sale row inserted,")
		p("             a journal row, an event)")
		p("             on scratch copies of kami's tables, %d orders to a transaction, %d sessions, %d closes per schema;", floorBatch, f.Sessions, f.Closes)
		p("             no look-up, lock, check or kami")
		for _, v := range f.Variants {
			if v.Error != "" {
				p("  %-34s failed: %s", v.Name, v.Error)
				continue
			}
			line := fmt.Sprintf("  %-34s %2d indexes %7.0f closes/s", v.Name, v.Indexes, v.ClosesPerSec)
			if b := r.Pgbench; b != nil && b.TPS > 0 {
				line += fmt.Sprintf(" = %5.2f× pgbench", v.ClosesPerSec/b.TPS)
			}
			p("%s; HOT updates %.0f%%; PostgreSQL %.0f µs a close", line, 100*v.HOTShare, v.PostgresPerClose)
		}
		floor := 0.0
		if len(f.Variants) > 0 {
			floor = f.Variants[0].ClosesPerSec
		}
		if l := f.Ledger; l != nil {
			if l.Error != "" {
				p("  %-34s failed: %s", l.Name, l.Error)
			} else if floor > 0 {
				p("  %-34s           %7.0f closes/s = %.2f of the floor of kami's indexes; PostgreSQL %.0f µs, kami's ledger %.0f µs a close", l.Name, l.ClosesPerSec, l.ClosesPerSec/floor, l.PostgresPerClose, l.BenchPerClose)
				p("                                     (its look-ups, row locks, card read and events; no pre-close check, Redis or server)")
			}
		}
		if d := r.Drain; d != nil && floor > 0 {
			p("  kami's drain (the server, above)             %7.0f closes/s = %.2f of the floor of kami's indexes; PostgreSQL %.0f µs, kami %.0f µs a close",
				d.ClosesPerSec, d.ClosesPerSec/floor, d.CPU.PostgresDB*d.WindowSeconds/float64(max(1, d.Orders))*1e6, d.CPU.Server*d.WindowSeconds/float64(max(1, d.Orders))*1e6)
		}
	}
	for _, n := range r.Notes {
		p("note: %s", n)
	}
}

// ratioOf says what the end-to-end / direct ratio compares.
func (d *DirectReport) ratioOf() string {
	if d.PlaceOnly {
		return "direct placed only: not the same transactions"
	}
	return "the same transactions"
}

func ratioOf(ok bool, f func() float64) string {
	if !ok {
		return "n/a"
	}
	return fmt.Sprintf("%.2f×", f())
}

// failedRounds says how many interleaved rounds failed, if any.
func failedRounds(n int) string {
	switch n {
	case 0:
		return ""
	case 1:
		return "; 1 round FAILED"
	}
	return fmt.Sprintf("; %d rounds FAILED", n)
}

func metOrNot(ok bool) string {
	if ok {
		return "met"
	}
	return "NOT met"
}

func fmtMs(v float64) string {
	switch {
	case v >= 1000:
		return fmt.Sprintf("%.2fs", v/1000)
	case v >= 10:
		return fmt.Sprintf("%.1fms", v)
	default:
		return fmt.Sprintf("%.2fms", v)
	}
}

// fmtCounts prints a count map largest first ("none" when empty).
func fmtCounts(m map[string]int) string {
	if len(m) == 0 {
		return "none"
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		if m[keys[i]] != m[keys[j]] {
			return m[keys[i]] > m[keys[j]]
		}
		return keys[i] < keys[j]
	})
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s %d", k, m[k])
	}
	return strings.Join(parts, ", ")
}

// printWaits prints what the machine and the database sessions of whose
// (kami's, the ledger's) did in each tenth of a phase; nothing without w.
func printWaits(p func(string, ...any), w *WaitsReport, whose string) {
	if w == nil {
		return
	}
	busy := make([]float64, len(w.Busy))
	for i, b := range w.Busy {
		busy[i] = 100 * b
	}
	p("                %s %% of the machine's CPU busy", fmtSeries(busy))
	p("  database      %s sessions by tenth (average number running, and waiting on the most common events)", whose)
	for i, st := range w.Sessions {
		ckpt := ""
		if w.Checkpoints[i] > 0 {
			ckpt = fmt.Sprintf("  (%d checkpoint started)", w.Checkpoints[i])
		}
		p("    %2d  %s%s", i+1, fmtTenth(st), ckpt)
	}
}
