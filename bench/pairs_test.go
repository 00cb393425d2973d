package main

import (
	"context"
	"fmt"
	"math"
	"runtime/debug"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestJudgedRatio(t *testing.T) {
	near := func(a, b float64) bool { return math.Abs(a-b) < 1e-9 }
	// Couples (0.64, 0.56) and (0.70, 0.50): geometric means 0.5987 and
	// 0.5916; with the main 0.58 the median is 0.5916.
	pairs := []PairReport{{Ratio: 0.64}, {Ratio: 0.56}, {Ratio: 0.70}, {Ratio: 0.50}}
	if m, n, f := judgedRatio(0.58, pairs); !near(m, math.Sqrt(0.70*0.50)) || n != 3 || f != 0 {
		t.Errorf("judgedRatio = %v of %d, %d failed; want %v of 3", m, n, f, math.Sqrt(0.70*0.50))
	}
	// A failed round leaves its couple out and is counted.
	pairs[3] = PairReport{Error: "direct: 3 calls failed"}
	if m, n, f := judgedRatio(0.58, pairs); !near(m, (0.58+math.Sqrt(0.64*0.56))/2) || n != 2 || f != 1 {
		t.Errorf("with a failed round: %v of %d, %d failed", m, n, f)
	}
	// A last round without its partner is left out.
	if m, n, f := judgedRatio(0.58, pairs[:3]); !near(m, (0.58+math.Sqrt(0.64*0.56))/2) || n != 2 || f != 0 {
		t.Errorf("an odd round: %v of %d, %d failed", m, n, f)
	}
	// A chunk second slower by a factor cancels in its couple.
	if m, _, _ := judgedRatio(0, []PairReport{{Ratio: 0.6 / 0.9}, {Ratio: 0.6 * 0.9}}); !near(m, 0.6) {
		t.Errorf("a couple whose second chunks ran 10%% slower: %v, want 0.6", m)
	}
	if m, n, f := judgedRatio(0, nil); m != 0 || n != 0 || f != 0 {
		t.Errorf("no ratio: %v of %d", m, n)
	}
	if m, n, _ := judgedRatio(0.5, nil); m != 0.5 || n != 1 {
		t.Errorf("the main ratio alone: %v of %d", m, n)
	}
}

func TestDirectChunkLastsAsLong(t *testing.T) {
	for _, c := range []struct {
		n     int
		scale float64
		want  int
	}{{10000, 1.7, 17000}, {10000, 0.5, 10000}, {10000, 9, 40000}, {3, 1.5, 4}} {
		if got := directChunk(c.n, c.scale); got != c.want {
			t.Errorf("directChunk(%d, %v) = %d, want %d", c.n, c.scale, got, c.want)
		}
	}
}

func TestReportJudgesTheMedian(t *testing.T) {
	r := &Report{Direct: &DirectReport{Runs: (&settle{payShare: 0.5}).describe(), OK: 100, WallSeconds: 1, OrdersPerSec: 100},
		Place: PlaceReport{OrdersPerSec: 57}, Ratio: 0.57,
		Pairs: []PairReport{
			{First: "end to end", EndToEndOrders: 10000, EndToEnd: 1250, DirectOrders: 16000, Direct: 2000, Ratio: 0.625},
			{First: "direct", EndToEndOrders: 10000, EndToEnd: 1300, DirectOrders: 16000, Direct: 2000, Ratio: 0.65},
		}}
	r.RatioMedian, r.RatioOf, r.RatioFailed = judgedRatio(r.Ratio, r.Pairs)
	reportHas(t, r,
		"pair 1        end to end first: end to end 10000 orders 1250/s (8.0s), direct 16000 orders 2000/s (8.0s): 0.62",
		"pair 2        direct first: end to end 10000 orders 1300/s (7.7s), direct 16000 orders 2000/s (8.0s): 0.65",
		// (0.57 + √(0.625 × 0.65)) / 2 = 0.604
		"judged        0.60, the median of 2: main 0.57, couple 0.64 (rounds 0.62, 0.65)",
		"ratio 0.60 ≥ 0.60: met (the same transactions, median of 2)",
	)

	// A failed round: the target is not met, whatever the median.
	r.Ratio = 0.7
	r.Pairs[1] = PairReport{First: "direct", EndToEndOrders: 10000, DirectOrders: 16000, Error: "direct: 3 calls failed"}
	r.RatioMedian, r.RatioOf, r.RatioFailed = judgedRatio(r.Ratio, r.Pairs)
	reportHas(t, r,
		"pair 2        direct first: FAILED: direct: 3 calls failed",
		"main 0.70, couple no mean (rounds 0.62, failed); 1 round FAILED",
		"ratio 0.70 ≥ 0.60: NOT met (the same transactions, median of 1; 1 round FAILED)",
	)

	r.Ratio = 0.55
	r.Pairs = nil
	r.RatioMedian, r.RatioOf, r.RatioFailed = judgedRatio(r.Ratio, nil)
	if out := reportHas(t, r, "ratio 0.55 ≥ 0.60: NOT met (the same transactions)"); strings.Contains(out, "median") {
		t.Errorf("without pairs the main ratio is judged alone:\n%s", out)
	}
}

// fakeChunks stands in for the server and the ledger: it records each
// chunk run, in order, with the garbage collector target it ran at.
type fakeChunks struct {
	ran []string // "end to end <id> <n> GOGC <p>" or "direct …"
}

// gcPercentNow is this process's garbage collector target.
func gcPercentNow() int {
	p := debug.SetGCPercent(100)
	debug.SetGCPercent(p)
	return p
}

func (f *fakeChunks) endToEnd(_ context.Context, id string, n int) (float64, error) {
	f.ran = append(f.ran, fmt.Sprintf("end to end %s %d GOGC %d", id, n, gcPercentNow()))
	return 600, nil
}

func (f *fakeChunks) direct(_ context.Context, id string, n int) (float64, error) {
	f.ran = append(f.ran, fmt.Sprintf("direct %s %d GOGC %d", id, n, gcPercentNow()))
	return 1000, nil
}

func TestPairsAlternateAndRunTheLoadAtThePlacePhasesGCTarget(t *testing.T) {
	// The direct phase left the server's target set (400); the place
	// phase ran its load at the process's own (100).
	before := debug.SetGCPercent(400)
	t.Cleanup(func() { debug.SetGCPercent(before) })
	f := &fakeChunks{}
	pairs := runPairs(context.Background(), pairRun{runID: "r", scale: 1.5, loadGCPercent: 100, chunks: f}, 3, 10)
	want := []string{
		"end to end r-pair1 10 GOGC 100", "direct r-pair1 15 GOGC 400",
		"direct r-pair2 15 GOGC 400", "end to end r-pair2 10 GOGC 100",
		"end to end r-pair3 10 GOGC 100", "direct r-pair3 15 GOGC 400",
	}
	if !slices.Equal(f.ran, want) {
		t.Errorf("chunks ran\n%s\nwant\n%s", strings.Join(f.ran, "\n"), strings.Join(want, "\n"))
	}
	if p := gcPercentNow(); p != 400 {
		t.Errorf("after the pairs the target is %d, want the server's 400 back for the later phases", p)
	}
	for i, p := range pairs {
		if p.Ratio != 0.6 || p.Error != "" {
			t.Errorf("pair %d: %+v", i+1, p)
		}
	}
}

// A chunk left to the bench lasts about autoChunkTTLs TTLs at the place
// phase's rate, or half of -orders when that is more; one asked for is
// kept. On a fast machine half of -orders placed in under minChunkTTLs
// TTLs, and the rounds were skipped.
func TestPairChunkOrders(t *testing.T) {
	for _, c := range []struct {
		name         string
		asked, n     int
		rate         float64
		ttl          time.Duration
		want         int
		lastsAtLeast time.Duration
	}{
		{"fast machine: sized by the rate", 0, 20_000, 2_100, time.Second, 16_800, minChunkTTLs * time.Second},
		{"slow machine: half of -orders", 0, 20_000, 900, time.Second, 10_000, minChunkTTLs * time.Second},
		{"a longer TTL", 0, 20_000, 1_000, 3 * time.Second, 24_000, minChunkTTLs * 3 * time.Second},
		{"asked for", 3_000, 20_000, 2_100, time.Second, 3_000, 0},
		// At most twice the main phase: a 60 s TTL would size chunks of
		// 8 minutes each, and the rounds would outlast -timeout; they are
		// skipped instead (the chunk lasts under 5 TTLs).
		{"a long TTL: capped by the main phase", 0, 20_000, 4_000, time.Minute, 40_000, 0},
		{"capped", 0, 2_000_000, 1e9, time.Second, maxPairOrders, 0},
		{"no overflow", 0, 20_000, math.MaxFloat64, time.Hour, 40_000, 0},
		{"no rate", 0, 1, 0, time.Second, 1, 0},
	} {
		got := pairChunkOrders(c.asked, c.n, c.rate, c.ttl)
		if got != c.want {
			t.Errorf("%s: %d orders, want %d", c.name, got, c.want)
		}
		if lasts := time.Duration(float64(got) / c.rate * float64(time.Second)); c.lastsAtLeast > 0 && lasts < c.lastsAtLeast {
			t.Errorf("%s: the chunk lasts %s, under the %s the rounds need", c.name, lasts, c.lastsAtLeast)
		}
	}
}
