package main

import (
	"runtime/pprof"
	"strings"
	"testing"
)

// TestGoMemoryOfAHeapProfile: the Go memory the subscriptions' figure
// reads is the HeapAlloc and Stack lines of the runtime's own heap profile
// in text, as /debug/pprof/heap?debug=1 writes it.
func TestGoMemoryOfAHeapProfile(t *testing.T) {
	var b strings.Builder
	if err := pprof.Lookup("heap").WriteTo(&b, 1); err != nil {
		t.Fatal(err)
	}
	got, err := goMemoryOf(b.String())
	if err != nil || got == 0 {
		t.Fatalf("%d bytes, %v", got, err)
	}
	if got, err := goMemoryOf("# HeapAlloc = 1000\n# Stack = 24 / 32768\n"); err != nil || got != 1024 {
		t.Errorf("1000 of heap and 24 of stacks read as %d, %v", got, err)
	}
	if _, err := goMemoryOf("heap profile: 0: 0 [0: 0] @ heap/1048576\n"); err == nil {
		t.Error("a text without the lines read as memory")
	}
}
