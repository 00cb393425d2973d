package main

import (
	"context"
	"fmt"
	"math"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
)

// Interleaved pairs. The place phase and the direct phase run one after
// the other, so their ratio also measures whatever the machine did between
// them: on a shared host whose speed drifts (steal time), one build's
// ratio ranged from 0.44 to 0.66 over one afternoon. -pairs more rounds
// each run an end-to-end chunk and a direct chunk back to back, on
// products of their own, the first round end to end first, the next direct
// first, and so on. Two rounds in turn make a couple: should the chunk
// that runs second be slowed (or sped up) by some factor, the first round
// of a couple reads the ratio times it and the second divided by it, so
// the couple's geometric mean cancels it. The ratio judged against the
// target is the median of the couples' means and the main phases' ratio:
// one slow moment moves the median by one place, not by its own size. A
// round that fails (a call failed, or the run's end cut it) leaves its
// couple out of the median and the target unmet: a failure is most
// likely in a stalled moment, the one a median must not lose silently.
//
// A direct chunk has as many orders as the end-to-end chunk would place in
// the same time at the main phases' rates, so both last about as long and
// spend the same share of their time before their first order falls due
// (placing with nothing closing yet is faster); the report shows each
// chunk's seconds. Each chunk starts once the previous one's orders have
// all closed. Chunks that would last less than minChunkTTLs TTLs are not
// run: the first TTL of a chunk places with nothing closing, and in a
// shorter chunk that share (a fifth at five TTLs) would weigh too much.

// PairReport is one round of interleaved chunks.
type PairReport struct {
	First          string  `json:"first"` // "end to end" or "direct"
	EndToEndOrders int     `json:"end_to_end_orders"`
	EndToEnd       float64 `json:"end_to_end_orders_per_sec"`
	DirectOrders   int     `json:"direct_orders"`
	Direct         float64 `json:"direct_orders_per_sec"`
	Ratio          float64 `json:"ratio,omitempty"`
	Error          string  `json:"error,omitempty"`
}

// pairRun is what the rounds need of the run.
type pairRun struct {
	runID string
	// scale is the direct chunk's orders per end-to-end order: the main
	// direct rate over the main end-to-end rate.
	scale float64
	// loadGCPercent is the garbage collector target the place phase ran
	// its load at, before the direct phase set the server's; the
	// end-to-end chunks run at it (see atGCPercent). 0: the collector
	// is left as it is.
	loadGCPercent int
	chunks        pairChunks
}

// pairChunks runs the chunks of a round: liveChunks, or a test's stand-in.
type pairChunks interface {
	// endToEnd places n orders over HTTP and returns the orders placed
	// per second; direct runs n orders through the ledger and returns
	// the same. Each returns once its orders have all closed.
	endToEnd(ctx context.Context, id string, n int) (float64, error)
	direct(ctx context.Context, id string, n int) (float64, error)
}

// liveChunks are the run's chunks: the started (or -url) server, the
// database and the direct phase's ledger.
type liveChunks struct {
	o      *options
	c      *client
	db     *bun.DB
	ledger *domain.Ledger // the direct phase's ledger (its TTL: -ttl, or the server's with -url)
	probe  cpuProbe
}

// directChunk is how many orders a direct chunk places against an
// end-to-end chunk of n: as many as take it as long, within 1× to 4× n.
func directChunk(n int, scale float64) int {
	return int(float64(n) * min(4, max(1, scale)))
}

// runPairs runs rounds of interleaved chunks of n end-to-end orders.
func runPairs(ctx context.Context, pr pairRun, rounds, n int) []PairReport {
	var out []PairReport
	for r := 0; r < rounds && ctx.Err() == nil; r++ {
		round := PairReport{EndToEndOrders: n, DirectOrders: directChunk(n, pr.scale)}
		id := pr.runID + "-pair" + strconv.Itoa(r+1)
		steps := []func() error{
			func() (err error) {
				atGCPercent(pr.loadGCPercent, func() { round.EndToEnd, err = pr.chunks.endToEnd(ctx, id, n) })
				return err
			},
			func() (err error) { round.Direct, err = pr.chunks.direct(ctx, id, round.DirectOrders); return err },
		}
		round.First = roundFirst(r)
		if round.First == "direct" {
			steps[0], steps[1] = steps[1], steps[0]
		}
		progress("pair %d of %d: %d orders end to end and %d direct, %s first", r+1, rounds, n, round.DirectOrders, round.First)
		for _, step := range steps {
			if err := step(); err != nil {
				round.Error = err.Error()
				break
			}
		}
		// A round the run's end cut (-timeout, or interrupted) measured
		// part of a chunk, or nothing, without a call failing: it fails,
		// as one whose chunk placed nothing does, so that every round the
		// report lists with a ratio is one the median counts.
		switch {
		case round.Error != "":
		case ctx.Err() != nil:
			round.Error = "cut by the run's end: " + ctx.Err().Error()
		case round.EndToEnd <= 0 || round.Direct <= 0:
			round.Error = "a chunk placed no order"
		default:
			round.Ratio = round.EndToEnd / round.Direct
		}
		out = append(out, round)
	}
	// Rounds the run's end left unstarted are failed rounds too: judged on
	// the couples that happened to finish, a run cut between two rounds
	// would otherwise meet the target on fewer measurements than it asked
	// for, and say nothing of the rest.
	for r := len(out); r < rounds; r++ {
		out = append(out, PairReport{First: roundFirst(r), Error: "not run: the run ended first (" + context.Cause(ctx).Error() + ")"})
	}
	return out
}

// roundFirst is which chunk of round r (from 0) runs first: they take
// turns, end to end in the first round.
func roundFirst(r int) string {
	if r%2 == 1 {
		return "direct"
	}
	return "end to end"
}

// endToEnd places n orders over HTTP on a product of their own, as the
// place phase does, waits for the unpaid ones to close, and returns the
// orders placed per second.
func (lc liveChunks) endToEnd(ctx context.Context, id string, n int) (float64, error) {
	productID, err := lc.c.setupProduct(ctx, "bench-"+id, n)
	if err != nil {
		return 0, fmt.Errorf("setup: %w", err)
	}
	// Sampled as the direct chunks are, though nobody reads it: the
	// sampler's queries cost the database the same on both sides.
	waits := sampleWaits(ctx, lc.db, waitEvery)
	lr := runLoad(ctx, lc.o.storefronts(lc.c, productID, id), n, lc.o.concurrency, lc.o.payShare)
	waits.Stop(lr.start, lr.wall)
	// Failed or not, the chunk ends once its orders have closed: the
	// server's closes of a failed chunk would otherwise run beside the
	// next chunk (a direct one, in the next round) and slow it.
	pid, _ := strconv.ParseInt(productID, 10, 64)
	_, waitErr := waitForCloses(ctx, lc.db, pid, len(lr.placed)-len(lr.paid), lr.start.Add(lr.wall))
	if failed := sum(lr.placeErrors) + sum(lr.payErrors); failed > 0 {
		return 0, fmt.Errorf("end to end: %d calls failed (place %s, pay %s)", failed, fmtCounts(lr.placeErrors), fmtCounts(lr.payErrors))
	}
	if waitErr != nil {
		return 0, fmt.Errorf("waiting for closes: %w", waitErr)
	}
	return rate(len(lr.placed), lr.wall), nil
}

// direct runs n orders through the ledger, as the direct phase does (it
// returns once its orders have all closed).
func (lc liveChunks) direct(ctx context.Context, id string, n int) (float64, error) {
	d, _, err := runDirect(ctx, lc.ledger, id, n, lc.o.concurrency, lc.probe, &settle{payShare: lc.o.payShare}, true)
	if err != nil {
		return 0, fmt.Errorf("direct: %w", err)
	}
	failed := sum(d.Errors)
	if d.Pay != nil {
		failed += sum(d.Pay.Errors)
	}
	if failed > 0 {
		return 0, fmt.Errorf("direct: %d calls failed", failed)
	}
	return d.OrdersPerSec, nil
}

// judgedRatio is the ratio judged against the target: the median of the
// main ratio and the geometric means of the couples of rounds (rounds 1
// and 2, 3 and 4, ...; a last round without its partner is left out), with
// how many values it is the median of and how many rounds failed (their
// couples left out).
func judgedRatio(main float64, pairs []PairReport) (ratio float64, of, failed int) {
	vs := []float64{}
	if main > 0 {
		vs = append(vs, main)
	}
	for _, p := range pairs {
		if p.Ratio <= 0 {
			failed++
		}
	}
	for i := 0; i+1 < len(pairs); i += 2 {
		if a, b := pairs[i].Ratio, pairs[i+1].Ratio; a > 0 && b > 0 {
			vs = append(vs, math.Sqrt(a*b))
		}
	}
	if len(vs) == 0 {
		return 0, 0, failed
	}
	slices.Sort(vs)
	if len(vs)%2 == 1 {
		return vs[len(vs)/2], len(vs), failed
	}
	return (vs[len(vs)/2-1] + vs[len(vs)/2]) / 2, len(vs), failed
}

// minChunkTTLs is how many TTLs an end-to-end chunk must be expected to
// last for the rounds to run.
const minChunkTTLs = 5

// autoChunkTTLs is how many TTLs an end-to-end chunk is sized to last when
// -pair-orders is left at 0: well over minChunkTTLs, so that on a fast
// machine (where half of -orders places in under 5 s) the rounds still run
// and most of each chunk places beside closes, as the main phases do.
const autoChunkTTLs = 8

// pairChunkOrders is the end-to-end orders of each round's chunk: asked
// (-pair-orders) when set; otherwise half of the main phase's orders, or
// as many as the place phase's rate (orders/s) places in autoChunkTTLs
// TTLs when that is more, but at most autoChunkMax times the main phase's
// orders: the rounds (four chunks each way by default) must fit the run's
// -timeout beside the main phases, so a long TTL skips them (a note says
// so) rather than running chunks of hours.
func pairChunkOrders(asked, orders int, rate float64, ttl time.Duration) int {
	if asked > 0 {
		return asked
	}
	n := max(1, orders/2)
	want := math.Ceil(rate * autoChunkTTLs * ttl.Seconds())
	want = math.Min(want, float64(min(autoChunkMax*orders, maxPairOrders)))
	return max(n, int(want))
}

// autoChunkMax bounds a chunk sized by pairChunkOrders, in main-phase
// orders.
const autoChunkMax = 2

// maxPairOrders bounds -pair-orders and the chunks sized for it.
const maxPairOrders = 2_000_000

// atGCPercent runs f with this process's garbage collector target at
// percent, then puts back the one it had. The direct phase leaves the
// server's target set, for the ledger's work in this process; an
// end-to-end chunk's load is a storefront's, and ran in the place phase
// at the target the process started with, so the chunks run at that one:
// at the server's (GOGC 400 while kami's live heap is small) the load
// would take less of the shared cores than it did in the place phase,
// and every round's end to end would run faster for it. percent 0 leaves
// the collector alone.
func atGCPercent(percent int, f func()) {
	if percent > 0 {
		defer debug.SetGCPercent(debug.SetGCPercent(percent))
	}
	f()
}

// fmtJudged lists what the judged ratio is the median of: the main ratio,
// then each couple of rounds' mean with the rounds' own ratios ("failed"
// for a failed round, whose couple has no mean; a last round without its
// partner "unpaired").
func fmtJudged(main float64, pairs []PairReport) string {
	round := func(p PairReport) string {
		if p.Ratio <= 0 {
			return "failed"
		}
		return fmt.Sprintf("%.2f", p.Ratio)
	}
	parts := []string{fmt.Sprintf("main %.2f", main)}
	for i := 0; i < len(pairs); i += 2 {
		if i+1 == len(pairs) {
			parts = append(parts, fmt.Sprintf("unpaired round %s", round(pairs[i])))
			continue
		}
		a, b := pairs[i], pairs[i+1]
		mean := "no mean"
		if a.Ratio > 0 && b.Ratio > 0 {
			mean = fmt.Sprintf("%.2f", math.Sqrt(a.Ratio*b.Ratio))
		}
		parts = append(parts, fmt.Sprintf("couple %s (rounds %s, %s)", mean, round(a), round(b)))
	}
	return strings.Join(parts, ", ")
}
