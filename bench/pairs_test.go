package main

import (
	"bytes"
	"context"
	"fmt"
	"runtime/debug"
	"slices"
	"strings"
	"testing"
)

func TestMedianRatio(t *testing.T) {
	pairs := []PairReport{{Ratio: 0.61}, {Error: "setup: refused"}, {Ratio: 0.52}, {Ratio: 0.66}}
	// 0.52 0.58 0.61 0.66: the failed round is left out, and an even count
	// takes the mean of the middle two.
	if m, n := medianRatio(0.58, pairs); m != (0.58+0.61)/2 || n != 4 {
		t.Errorf("medianRatio = %v of %d, want %v of 4", m, n, (0.58+0.61)/2)
	}
	if m, n := medianRatio(0.58, pairs[:1]); m != (0.58+0.61)/2 || n != 2 {
		t.Errorf("two ratios: %v of %d", m, n)
	}
	if m, n := medianRatio(0.58, append(pairs, PairReport{Ratio: 0.40})); m != 0.58 || n != 5 {
		t.Errorf("five ratios: %v of %d, want the middle one, 0.58", m, n)
	}
	if m, n := medianRatio(0, nil); m != 0 || n != 0 {
		t.Errorf("no ratio: %v of %d", m, n)
	}
	if m, n := medianRatio(0.5, nil); m != 0.5 || n != 1 {
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
		Place: PlaceReport{OrdersPerSec: 55}, Ratio: 0.55,
		Pairs: []PairReport{
			{First: "end to end", EndToEndOrders: 10000, EndToEnd: 1300, DirectOrders: 17000, Direct: 2000, Ratio: 0.65},
			{First: "direct", Error: "direct: 3 calls failed"},
			{First: "end to end", EndToEndOrders: 10000, EndToEnd: 1240, DirectOrders: 17000, Direct: 2000, Ratio: 0.62},
		}}
	r.RatioMedian, r.RatioOf = medianRatio(r.Ratio, r.Pairs)
	var buf bytes.Buffer
	r.Write(&buf)
	out := buf.String()
	for _, want := range []string{
		"pair 1        end to end first: end to end 10000 orders 1300/s, direct 17000 orders 2000/s: 0.65",
		"pair 2        direct first: FAILED: direct: 3 calls failed",
		"median        0.62 of 3 ratios (0.55, 0.65, failed, 0.62)",
		"ratio 0.62 ≥ 0.60: met (the same transactions, median of 3)",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}
	r.Pairs, r.RatioMedian, r.RatioOf = nil, 0, 0
	r.RatioMedian, r.RatioOf = medianRatio(r.Ratio, nil)
	buf.Reset()
	r.Write(&buf)
	if out := buf.String(); !strings.Contains(out, "ratio 0.55 ≥ 0.60: NOT met (the same transactions)") || strings.Contains(out, "median") {
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
