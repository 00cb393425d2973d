package main

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/uptrace/bun"

	"kami/domain"
)

// Interleaved pairs. The place phase and the direct phase run one after
// the other, so their ratio also measures whatever the machine did between
// them: on a shared host whose speed drifts (steal time), one build's
// ratio ranged from 0.44 to 0.66 over one afternoon. -pairs more rounds
// each run an end-to-end chunk and a direct chunk back to back, on
// products of their own, the first round end to end first, the next direct
// first, and so on, so that a drift across a round counts against each side
// as often. The ratio judged against the target is the median of the
// rounds' ratios and the main phases' one: one slow moment moves the median
// by one place, not by its own size.
//
// A direct chunk has as many orders as the end-to-end chunk would place in
// the same time at the main phases' rates, so both last about as long and
// spend the same share of their time before their first order falls due
// (placing with nothing closing yet is faster). Each chunk starts once the
// previous one's orders have all closed.

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

// pairRun is what a round needs of the run.
type pairRun struct {
	o      *options
	c      *client
	db     *bun.DB
	direct *domain.Ledger // the direct phase's ledger (TTL -ttl)
	probe  cpuProbe
	runID  string
	// scale is the direct chunk's orders per end-to-end order: the main
	// direct rate over the main end-to-end rate.
	scale float64
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
			func() (err error) { round.EndToEnd, err = pr.endToEnd(ctx, id, n); return err },
			func() (err error) { round.Direct, err = pr.directOnly(ctx, id, round.DirectOrders); return err },
		}
		round.First = "end to end"
		if r%2 == 1 {
			steps[0], steps[1] = steps[1], steps[0]
			round.First = "direct"
		}
		progress("pair %d of %d: %d orders end to end and %d direct, %s first", r+1, rounds, n, round.DirectOrders, round.First)
		for _, step := range steps {
			if err := step(); err != nil {
				round.Error = err.Error()
				break
			}
		}
		if round.Error == "" && round.Direct > 0 {
			round.Ratio = round.EndToEnd / round.Direct
		}
		out = append(out, round)
	}
	return out
}

// endToEnd places n orders over HTTP on a product of their own, as the
// place phase does, waits for the unpaid ones to close, and returns the
// orders placed per second.
func (pr pairRun) endToEnd(ctx context.Context, id string, n int) (float64, error) {
	productID, err := pr.c.setupProduct(ctx, "bench-"+id, n)
	if err != nil {
		return 0, fmt.Errorf("setup: %w", err)
	}
	lr := runLoad(ctx, pr.o.storefronts(pr.c, productID, id), n, pr.o.concurrency, pr.o.payShare)
	if failed := sum(lr.placeErrors) + sum(lr.payErrors); failed > 0 {
		return 0, fmt.Errorf("end to end: %d calls failed (place %s, pay %s)", failed, fmtCounts(lr.placeErrors), fmtCounts(lr.payErrors))
	}
	pid, _ := strconv.ParseInt(productID, 10, 64)
	if _, err := waitForCloses(ctx, pr.db, pid, len(lr.placed)-len(lr.paid), lr.start.Add(lr.wall)); err != nil {
		return 0, fmt.Errorf("waiting for closes: %w", err)
	}
	return rate(len(lr.placed), lr.wall), nil
}

// directOnly runs n orders through the ledger, as the direct phase does
// (it returns once its orders have all closed).
func (pr pairRun) directOnly(ctx context.Context, id string, n int) (float64, error) {
	d, _, err := runDirect(ctx, pr.direct, id, n, pr.o.concurrency, pr.probe, &settle{payShare: pr.o.payShare})
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

// medianRatio is the median of the main ratio and the rounds' ratios
// (rounds that failed left out), and how many it is the median of.
func medianRatio(main float64, pairs []PairReport) (float64, int) {
	rs := []float64{}
	if main > 0 {
		rs = append(rs, main)
	}
	for _, p := range pairs {
		if p.Ratio > 0 {
			rs = append(rs, p.Ratio)
		}
	}
	if len(rs) == 0 {
		return 0, 0
	}
	slices.Sort(rs)
	if len(rs)%2 == 1 {
		return rs[len(rs)/2], len(rs)
	}
	return (rs[len(rs)/2-1] + rs[len(rs)/2]) / 2, len(rs)
}

// fmtRatios lists the ratios of the main phases and of each round.
func fmtRatios(main float64, pairs []PairReport) string {
	parts := []string{fmt.Sprintf("%.2f", main)}
	for _, p := range pairs {
		if p.Error != "" {
			parts = append(parts, "failed")
		} else {
			parts = append(parts, fmt.Sprintf("%.2f", p.Ratio))
		}
	}
	return strings.Join(parts, ", ")
}
