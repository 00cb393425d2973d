package main

import (
	"runtime/debug"
	"testing"
)

// kami serves with defaultGCPercent unless GOGC is set, and then leaves
// the runtime's reading of GOGC in force.
func TestTuneGC(t *testing.T) {
	before := debug.SetGCPercent(100)
	defer debug.SetGCPercent(before)
	env := func(gogc string) func(string) string {
		return func(k string) string {
			if k == "GOGC" {
				return gogc
			}
			return ""
		}
	}
	if got := tuneGC(env("")); got != defaultGCPercent || debug.SetGCPercent(defaultGCPercent) != defaultGCPercent {
		t.Fatalf("without GOGC: tuneGC says %d; want %d in force", got, defaultGCPercent)
	}
	debug.SetGCPercent(150) // as the runtime would have set GOGC=150 at start
	if got := tuneGC(env("150")); got != 150 || debug.SetGCPercent(150) != 150 {
		t.Fatalf("with GOGC=150: tuneGC says %d; want 150 left in force", got)
	}
}
