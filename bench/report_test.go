package main

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"time"
)

func TestPercentile(t *testing.T) {
	ds := make([]time.Duration, 100)
	for i := range ds {
		ds[i] = time.Duration(i+1) * time.Millisecond // 1..100ms
	}
	for _, c := range []struct {
		q    float64
		want time.Duration
	}{
		{0, 1 * time.Millisecond}, {0.01, 1 * time.Millisecond}, {0.5, 50 * time.Millisecond},
		{0.99, 99 * time.Millisecond}, {0.991, 100 * time.Millisecond}, {1, 100 * time.Millisecond},
	} {
		if got := percentile(ds, c.q); got != c.want {
			t.Errorf("percentile(1..100ms, %v) = %v, want %v", c.q, got, c.want)
		}
	}
	if got := percentile(nil, 0.5); got != 0 {
		t.Errorf("percentile(nil) = %v", got)
	}
	if got := percentile([]time.Duration{7}, 0.99); got != 7 {
		t.Errorf("percentile of one = %v", got)
	}
}

func TestSummarize(t *testing.T) {
	ds := []time.Duration{4 * time.Millisecond, 1 * time.Millisecond, 3 * time.Millisecond, 2 * time.Millisecond}
	l := summarize(ds)
	if l.Count != 4 || l.P50Ms != 2 || l.P99Ms != 4 || l.MaxMs != 4 || l.MeanMs != 2.5 {
		t.Errorf("summarize = %+v", l)
	}
	if (summarize(nil) != Latency{}) {
		t.Error("summarize(nil) is not zero")
	}
}

func TestShouldPay(t *testing.T) {
	for _, share := range []float64{0, 0.1, 0.25, 0.5, 0.75, 1} {
		n := 0
		for i := 0; i < 1000; i++ {
			if shouldPay(i, share) {
				n++
			}
		}
		if want := int(1000 * share); n != want {
			t.Errorf("share %v: %d of 1000 pay, want %d", share, n, want)
		}
	}
	// Evenly spread: with half, every other order pays.
	for i := 0; i < 10; i++ {
		if shouldPay(i, 0.5) != (i%2 == 1) {
			t.Errorf("shouldPay(%d, 0.5) = %v", i, shouldPay(i, 0.5))
		}
	}
}

func TestRate(t *testing.T) {
	if got := rate(3000, 2*time.Second); got != 1500 {
		t.Errorf("rate = %v", got)
	}
	if got := rate(10, 0); got != 0 {
		t.Errorf("rate over 0s = %v", got)
	}
}

func TestLoopback(t *testing.T) {
	for _, ok := range []string{"postgres://postgres@127.0.0.1:5432/x", "redis://localhost:6379/0", "http://[::1]:8080", "sqlite:/tmp/x.db", ""} {
		if err := checkLoopbackURL("-x", ok); err != nil {
			t.Errorf("%q refused: %v", ok, err)
		}
	}
	for _, bad := range []string{"postgres://db.example.com/x", "http://10.0.0.1:8080", "redis://0.0.0.0:6379", "postgres:///x"} {
		if err := checkLoopbackURL("-x", bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
	if err := checkLoopbackRedis("127.0.0.1:7000,127.0.0.1:7001"); err != nil {
		t.Error(err)
	}
	if err := checkLoopbackRedis("127.0.0.1:7000,10.1.1.1:7001"); err == nil {
		t.Error("a remote cluster node was accepted")
	}
}

func TestDescribeDBHidesPassword(t *testing.T) {
	got := describeDB("postgres://u:secret@127.0.0.1:5432/db?sslmode=disable")
	if strings.Contains(got, "secret") || !strings.Contains(got, "/db") {
		t.Errorf("describeDB = %q", got)
	}
}

func TestReportWrite(t *testing.T) {
	rate := 0.9995
	r := &Report{
		Started: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC), Database: "postgres://postgres@127.0.0.1:5432/kami_bench_x",
		Redis: "redis://127.0.0.1:6379/0", Server: "started by bench", CPUs: 2, Orders: 20000, Concurrency: 64,
		PayShare: 0.5, TTL: "5s", DBMaxConns: 20,
		Place: PlaceReport{OK: 19990, Errors: map[string]int{"SOLD_OUT": 7, "TRANSPORT": 3}, WallSeconds: 10,
			OrdersPerSec: 1999, Latency: Latency{Count: 19990, P50Ms: 25.5, P99Ms: 80.25, MaxMs: 1200, MeanMs: 30}},
		Pay:   PayReport{Sent: 9995, OK: 9995, PaymentsPerSec: 999.5, Latency: Latency{P50Ms: 5, P99Ms: 20}},
		Close: &CloseReport{Unpaid: 9995, Closed: 9995, Complete: true, WindowSeconds: 5, ClosesPerSec: 1999, Statuses: map[string]int{"PAID": 9995, "CLOSED": 9995}},
		Direct: &DirectReport{Runs: (&settle{payShare: 0.5}).describe(), OK: 20000, WallSeconds: 8, OrdersPerSec: 2500,
			Pay:          &PayReport{Sent: 10000, OK: 9998, Errors: map[string]int{"DUPLICATE": 2}, PaymentsPerSec: 1249.75},
			Close:        &CloseReport{Unpaid: 10002, Closed: 10002, Complete: true, DuringPlace: 4000, WindowSeconds: 8, ClosesPerSec: 1250.25, Statuses: map[string]int{"PAID": 9998, "CLOSED": 10002}},
			CloseBatches: 160, CloseSkipped: 3},
		Ratio: 0.7996,
		Process: ProcessReport{PeakMemoryMiB: 80.5, MaxRSSMiB: 79.25, PlaceCPU: CPUUse{Server: 1.1, Bench: 0.4, PostgresDB: 0.45, PostgresOther: 0.01, Other: 0.02, MachineBusy: 0.97},
			Exit: "clean: SIGTERM → exit 0 in 120ms"},
		Stats:         &StatsReport{CloseSuccessRate: &rate},
		Audit:         &AuditReport{Clean: true},
		Pgbench:       &PgbenchReport{Command: "pgbench -N -c 16 -j 2 -T 10 <scratch database>", TPS: 1000},
		Subscriptions: &SubscriptionsReport{Open: 1000, Connections: 50, RSSBeforeMiB: 60, RSSOpenMiB: 72.5, MiBPerThousand: 12.5},
		Drain: &DrainReport{Orders: 20000, StartSeconds: 0.5, WindowSeconds: 2, ClosesPerSec: 10000,
			Close: &CloseReport{Closed: 20000}, RedisBytesPer10k: 800000},
	}
	reportHas(t, r,
		"orders placed 19990 in 10.00s: 1999 orders/s",
		"p50 25.5ms  p99 80.2ms  max 1.20s",
		"errors        SOLD_OUT 7, TRANSPORT 3",
		"paid          9995 of 9995 answered 200: 1000 payments/s",
		"closed        9995 of 9995 unpaid, first expiry to last close 5.00s: 1999 closes/s",
		"statuses      CLOSED 9995, PAID 9995",
		"direct place + pay 50% + close the rest at the TTL, through the ledger",
		"paid          9998 of 10000 delivered: 1250 payments/s",
		"errors        DUPLICATE 2",
		"close         Ledger.CloseOrders as they fall due, up to 500 a batch (all closed): 160 batches, 3 closed by another first, errors none",
		"closed        10002 of 10002 unpaid, first expiry to last close 8.00s: 1250 closes/s",
		"overlap       4000 of the closes ran while orders were still being placed",
		"statuses      CLOSED 10002, PAID 9998",
		"end-to-end / direct  0.80 (the same transactions)",
		"peak memory   80.5 MiB VmHWM",
		"closeSuccessRate 0.9995",
		"CPU, place    kami 1.10, postgres 0.45 (+0.01 rest of PostgreSQL), redis 0.00, bench 0.40, other 0.02 cores; machine 97% busy",
		"ledger audit    clean",
		"1999 orders/s ≥ 1500: met; ratio 0.80 ≥ 0.60: met (the same transactions)",
		"pgbench -N -c 16 -j 2 -T 10 <scratch database>: 1000 tps",
		"place 2.00× pgbench tps; direct 2.50×",
		"1000 open on 50 WebSockets: VmRSS 60.0 → 72.5 MiB, 12.50 MiB per 1,000",
		"closed        20000 of 20000, ready → last close 2.00s: 10000 closes/s",
		"Redis close queue 800000 bytes per 10,000 pending",
		"drain 10000 closes/s ≥ 20000: NOT met; 10.00× pgbench ≥ 5×: met",
	)

	r.Audit = &AuditReport{Violations: []string{"pending_card_count order 1: PENDING with 0 LOCKED cards, want 1"}}
	r.Close.Complete = false
	r.Ratio = 0.2
	r.Direct = &DirectReport{Runs: (*settle)(nil).describe(), PlaceOnly: true, OK: 20000, WallSeconds: 8, OrdersPerSec: 2500}
	out := reportHas(t, r, "1 VIOLATIONS", "pending_card_count order 1", "INCOMPLETE",
		"direct place only (-direct-place-only): Ledger.PlaceOrder, no payments, no closes",
		"end-to-end / direct  0.20 (direct placed only: not the same transactions)",
		"ratio 0.20 ≥ 0.60: NOT met (direct placed only: not the same transactions)")
	for _, unwanted := range []string{"Ledger.RecordPayment", "Ledger.CloseOrders"} {
		if strings.Contains(out, unwanted) {
			t.Errorf("a place-only direct phase reports %q:\n%s", unwanted, out)
		}
	}

	b, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	var back map[string]any
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if back["place"].(map[string]any)["orders_per_sec"].(float64) != 1999 {
		t.Errorf("JSON place.orders_per_sec: %s", b)
	}
}

func TestLogTailCounts(t *testing.T) {
	var l logTail
	l.max = 2
	l.Write([]byte("time=x level=WARN msg=a\ntime=x level=ERROR msg=b\n{\"level\":\"WARN\"}\npart"))
	l.Write([]byte("ial line\n"))
	w, e := l.Counts()
	if w != 2 || e != 1 {
		t.Errorf("counts %d warnings %d errors", w, e)
	}
	if tail := l.Tail(); len(tail) != 2 || tail[1] != "partial line" {
		t.Errorf("tail %q", tail)
	}
}

func TestByTenth(t *testing.T) {
	var done []time.Duration
	for i := 0; i < 100; i++ {
		done = append(done, time.Duration(i)*10*time.Millisecond) // 100 events over 1s, 10 per 100ms
	}
	got := byTenth(done, time.Second)
	for i, v := range got {
		if v != 100 {
			t.Errorf("tenth %d: %v/s, want 100 (%v)", i, v, got)
		}
	}
	if got := byTenth([]time.Duration{2 * time.Second}, time.Second); got[9] != 10 {
		t.Errorf("a late event lands in the last tenth: %v", got)
	}
	if byTenth(nil, 0) != nil {
		t.Error("zero wall time gives a series")
	}
	if s := fmtSeries([]float64{1, 2.4}); s != "1 2" {
		t.Errorf("fmtSeries = %q", s)
	}
}

// TestWaitsByTenth: samples fall into the tenth of the phase they were
// taken in; a tenth's sessions are averaged over its samples, its CPU and
// checkpoints measured from the sample before it to its last.
func TestWaitsByTenth(t *testing.T) {
	start := time.Date(2026, 12, 2, 0, 0, 0, 0, time.UTC)
	s := &waitSampler{stop: func() {}, done: make(chan struct{})}
	close(s.done)
	at := func(ms int) time.Time { return start.Add(time.Duration(ms) * time.Millisecond) }
	s.samples = []waitSample{
		{at: at(-50), busy: 0, total: 0, checkpoints: 7},
		{at: at(10), states: map[string]int{"running": 2}, busy: 40, total: 100, checkpoints: 7},
		{at: at(60), states: map[string]int{"running": 1, "IO:WALSync": 2}, busy: 90, total: 200, checkpoints: 7},
		{at: at(950), states: map[string]int{"LWLock:WALWrite": 4, "IO:WALSync": 1}, busy: 100, total: 400, checkpoints: 8},
		{at: at(1000), states: map[string]int{"running": 9}}, // after the phase
	}
	w := s.Stop(start, time.Second)
	if got := w.Sessions[0]; got["running"] != 1.5 || got["IO:WALSync"] != 1 {
		t.Errorf("first tenth: %v", got)
	}
	if w.Busy[0] != 0.45 || w.Checkpoints[0] != 0 {
		t.Errorf("first tenth: busy %v, %d checkpoints", w.Busy[0], w.Checkpoints[0])
	}
	if got := w.Sessions[9]; got["LWLock:WALWrite"] != 4 || w.Busy[9] != 0.05 || w.Checkpoints[9] != 1 {
		t.Errorf("last tenth: %v, busy %v, %d checkpoints", got, w.Busy[9], w.Checkpoints[9])
	}
	if w.Sessions[5] != nil || w.Busy[5] != 0 {
		t.Errorf("a tenth without samples: %v %v", w.Sessions[5], w.Busy[5])
	}
	if got := fmtTenth(w.Sessions[9]); got != "WALWrite 4.0 WALSync 1.0" {
		t.Errorf("fmtTenth = %q", got)
	}
	if got := fmtTenth(nil); got != "-" {
		t.Errorf("fmtTenth(nil) = %q", got)
	}
}

// reportHas prints r as people read it, fails the test for each of wants
// the text lacks, and returns the text.
func reportHas(t *testing.T, r *Report, wants ...string) string {
	t.Helper()
	var buf bytes.Buffer
	r.Write(&buf)
	out := buf.String()
	for _, want := range wants {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}
	return out
}

// Both phases of the ratio print their waits, each naming whose sessions
// they are: the sampler runs on both sides, so its queries cost the
// database the same in both.
func TestReportPrintsBothPhasesWaits(t *testing.T) {
	waits := func(state string) *WaitsReport {
		w := &WaitsReport{Sessions: make([]map[string]float64, 10), Busy: make([]float64, 10), Checkpoints: make([]int, 10)}
		w.Sessions[0] = map[string]float64{state: 2}
		w.Busy[0] = 0.5
		return w
	}
	r := &Report{Place: PlaceReport{OK: 10, Waits: waits("IO:WALSync")},
		Direct: &DirectReport{OK: 10, ByTenth: []float64{1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, Waits: waits("Lock:transactionid")}}
	reportHas(t, r, "the database's (kami's) sessions by tenth", "WALSync 2.0", "the database's (the ledger's) sessions by tenth", "transactionid 2.0")
}
