package main

import (
	"context"
	"runtime/debug"
	runtimemetrics "runtime/metrics"
	"time"
)

// The garbage collector's target. Almost all kami allocates lives for one
// request and its live heap is small (tens of MiB), so a collection finds
// little to keep: letting the heap grow to five times what is live before
// collecting, instead of Go's two, took about a seventh of kami's CPU per
// order off in the bench (GOGC 100 against 400, alternating runs: 369 and
// 435 µs per order against 312 and 307; peak 58 against about 95 MiB).
// A fixed 400 would also multiply a large live heap (many open
// subscriptions) by five, so the target shrinks as the live heap grows:
// the heap grown beyond what is live stays under gcHeadroom, and never
// below what GOGC=100 allows. GOGC or GOMEMLIMIT set in the environment
// leave the runtime alone.
const (
	gcMaxPercent = 400
	gcHeadroom   = 128 << 20 // bytes
)

// gcPercentFor is the target for a live heap of live bytes: 400 up to
// 32 MiB live, then what keeps the growth at gcHeadroom, 100 from 128 MiB.
func gcPercentFor(live uint64) int {
	if live == 0 {
		return gcMaxPercent
	}
	p := int(uint64(gcHeadroom) * 100 / live)
	return max(100, min(gcMaxPercent, p/25*25)) // in steps of 25
}

// tuneGC keeps the collector's target at gcPercentFor(the live heap),
// checked every second, until ctx ends; it does nothing when GOGC or
// GOMEMLIMIT is set.
func tuneGC(ctx context.Context, getenv func(string) string) {
	if getenv("GOGC") != "" || getenv("GOMEMLIMIT") != "" {
		return
	}
	sample := []runtimemetrics.Sample{{Name: "/gc/heap/live:bytes"}}
	live := func() uint64 {
		runtimemetrics.Read(sample)
		if sample[0].Value.Kind() != runtimemetrics.KindUint64 {
			return 0
		}
		return sample[0].Value.Uint64()
	}
	percent := gcPercentFor(live())
	debug.SetGCPercent(percent)
	go func() {
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			if p := gcPercentFor(live()); p != percent {
				percent = p
				debug.SetGCPercent(p)
			}
		}
	}()
}
