// Package domaintest holds the few fixtures tests all over kami share: a
// settable clock, a fixed card key, waiting for a condition instead of
// sleeping, and a log destination to read. Database fixtures are in dbtest.
package domaintest

import (
	"bytes"
	"sync"
	"testing"
	"time"

	"kami/domain"
)

// Clock is a settable clock for domain.Ledger.Now, safe for concurrent use.
type Clock struct {
	mu sync.Mutex
	t  time.Time
}

// NewClock returns a clock standing at t.
func NewClock(t time.Time) *Clock { return &Clock{t: t} }

// Now is the clock's time.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

// Advance moves the clock on by d.
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// CardKey is the fixed KAMI_CARD_KEY of tests; never use it elsewhere.
const CardKey = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"

// Key is CardKey as bytes, for domain.NewSealer.
func Key() []byte {
	k, err := domain.ParseCardKey(CardKey)
	if err != nil {
		panic(err)
	}
	return k
}

// Eventually polls cond until it holds, failing the test with what if it
// does not within the given time, or within MinPatience if that is longer:
// the deadline only says when to give up on something that will not happen,
// and on a busy machine (-race, other jobs beside) what takes a second
// alone can take twenty. A test that passes never waits for it.
func Eventually(t testing.TB, within time.Duration, what string, cond func() bool) {
	t.Helper()
	within = max(within, MinPatience)
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not within %s: %s", within, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// LogBuffer is a log destination that goroutines may write to while the
// test reads it.
type LogBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *LogBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// String is everything written so far.
func (b *LogBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// MinPatience is the shortest deadline Eventually gives a condition.
const MinPatience = 2 * time.Minute
