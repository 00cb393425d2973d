package main

import (
	"context"
	"strings"
	"testing"
)

// cutChunks ends the run's context while its first end-to-end chunk waits
// for its closes (-timeout): that chunk returns its rate without an error,
// as waitForCloses does when ctx ends, and the direct chunk after it
// places nothing and finds nothing to report, as runDirect does then.
type cutChunks struct{ cancel context.CancelFunc }

func (c cutChunks) endToEnd(context.Context, string, int) (float64, error) {
	c.cancel()
	return 600, nil
}

func (c cutChunks) direct(ctx context.Context, _ string, _ int) (float64, error) {
	if ctx.Err() != nil {
		return 0, nil
	}
	return 1000, nil
}

// TestPairCutByTheDeadlineFails: a round the run's deadline cut is a
// failed round, said so in the report, not a ratio of 0 listed beside the
// others and silently left out of the median.
func TestPairCutByTheDeadlineFails(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pairs := runPairs(ctx, pairRun{runID: "r", scale: 1.5, chunks: cutChunks{cancel}}, 4, 10)
	if len(pairs) != 4 {
		t.Fatalf("%d rounds reported of the 4 asked for: %+v", len(pairs), pairs)
	}
	if p := pairs[0]; p.Error == "" || p.Ratio != 0 {
		t.Errorf("the cut round: %+v, want an error and no ratio", p)
	}
	// The three the deadline left unstarted are failed rounds, not rounds
	// that were never asked for.
	for i, p := range pairs[1:] {
		if !strings.HasPrefix(p.Error, "not run: ") || p.Ratio != 0 || p.First != roundFirst(i+1) {
			t.Errorf("unstarted round %d: %+v, want it failed as not run", i+2, p)
		}
	}
	if _, _, failed := judgedRatio(0.65, pairs); failed != 4 {
		t.Errorf("judgedRatio counts %d failed rounds, want 4", failed)
	}
	if got, want := fmtJudged(0.55, pairs), "main 0.55, couple no mean (rounds failed, failed), couple no mean (rounds failed, failed)"; got != want {
		t.Errorf("fmtJudged = %q, want %q", got, want)
	}
}
