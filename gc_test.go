package main

import (
	"context"
	"runtime/debug"
	"testing"
)

// The collector's target is 400 while the live heap is small, shrinks so
// that the heap grows at most gcHeadroom beyond what is live, and is never
// below Go's 100.
func TestGCPercentFor(t *testing.T) {
	const mib = 1 << 20
	for _, c := range []struct {
		live uint64
		want int
	}{{0, 400}, {10 * mib, 400}, {32 * mib, 400}, {40 * mib, 300}, {64 * mib, 200}, {100 * mib, 125}, {128 * mib, 100}, {4096 * mib, 100}} {
		if got := gcPercentFor(c.live); got != c.want {
			t.Errorf("gcPercentFor(%d MiB) = %d, want %d", c.live/mib, got, c.want)
		}
		if got := gcPercentFor(c.live); c.live > 0 && uint64(got)*c.live/100 > max(gcHeadroom, c.live) {
			t.Errorf("gcPercentFor(%d MiB) = %d lets the heap grow by more than the headroom", c.live/mib, got)
		}
	}
}

// tuneGC sets the target unless GOGC or GOMEMLIMIT is set.
func TestTuneGCLeavesTheEnvironmentsSetting(t *testing.T) {
	before := debug.SetGCPercent(100)
	defer debug.SetGCPercent(before)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	env := func(k, v string) func(string) string {
		return func(name string) string {
			if name == k {
				return v
			}
			return ""
		}
	}
	for _, e := range []func(string) string{env("GOGC", "150"), env("GOMEMLIMIT", "1GiB")} {
		debug.SetGCPercent(150)
		tuneGC(ctx, e)
		if got := debug.SetGCPercent(150); got != 150 {
			t.Errorf("with the environment's setting, tuneGC changed the target to %d", got)
		}
	}
	debug.SetGCPercent(101) // no target tuneGC sets: a tuneGC that did nothing leaves it
	tuneGC(ctx, env("", ""))
	if got := debug.SetGCPercent(100); got < 100 || got > gcMaxPercent || got%25 != 0 {
		t.Errorf("tuneGC set %d", got)
	}
}
