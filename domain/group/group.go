// Package group gathers calls that arrive while earlier ones are being
// served into batches, and serves each batch at once: group commit. The
// ledger places orders and records payments this way, one transaction per
// batch; the Redis layer sends commands this way, one round trip per batch.
package group

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"runtime"
	"slices"
	"sync"
	"time"
)

// Batcher is group commit: calls that arrive while earlier batches are
// being served are queued and served together by whichever caller leads
// next. Under load one batch carries many calls, so the fixed cost of
// serving one (a transaction's statements and commit, a Redis round trip)
// is paid once for all of them; an idle caller pays nothing, since a lone
// call leads at once and is served alone.
//
// There are no goroutines of its own. A caller that finds fewer than
// MaxLeaders batches running leads: it takes up to MaxBatch queued calls
// from the front and runs them. When it is done it hands the lead on
// together with the next batch, which it takes out of the queue for the
// call at its front; with the queue empty it gives the lead up. A call
// that is handed the lead is in the batch it is handed, so every lead ends
// in a run, no call is left behind, and no leader serves forever.
type Batcher[In, Out any] struct {
	MaxLeaders int // batches served at once; at least 1
	MaxBatch   int // calls in one batch; 0: no limit
	// Timeout bounds one batch's work; 0: DefaultTimeout.
	Timeout time.Duration
	// Yield has a call that finds no batch running yield the processor
	// once before it takes its batch, so that the goroutines already
	// runnable (the callers one answer woke together, which each send a
	// call next) queue theirs first and share its round trip instead of
	// following in a second one. A lone call waits for nothing: with
	// nothing else runnable the yield returns at once.
	Yield bool
	// MaxQueued bounds the calls waiting for a batch: a call that finds
	// that many waiting is refused at once with ErrFull rather than queued
	// behind work that cannot finish in time (a stalled database). 0: no
	// bound.
	MaxQueued int
	// Run answers every call of one batch: out[i] and errs[i] belong to
	// ins[i]. It runs under a context that outlives the leader's request,
	// bounded by Timeout. A call it leaves without an answer (out and errs
	// shorter than ins, or a nil out[i] with a nil errs[i]) is answered
	// with ErrNoAnswer: no caller is ever told "done" with nothing.
	Run func(ctx context.Context, ins []In) (out []Out, errs []error)

	mu      sync.Mutex
	queue   []*batchCall[In, Out]
	leaders int
}

type batchCall[In, Out any] struct {
	ctx context.Context
	in  In
	out Out
	err error
	// wake brings the call its batch to lead, or nil once out and err are
	// set. A call is sent at most one batch, while it waits in the queue;
	// that batch holds it, and is run by it, so it reads the batch before
	// its answer is sent: one slot is all the channel needs.
	wake chan []*batchCall[In, Out]
	// taken is set (under Batcher.mu) when a batch takes the call out of
	// the queue; from then on the call is answered by that batch only.
	taken bool
}

// ErrFull refuses a call that finds MaxQueued calls waiting.
var ErrFull = errors.New("group: too many calls are waiting")

// ErrNoAnswer answers a call that its batch's Run left without an answer:
// a bug in Run, which the caller must treat as a failure (its outcome is
// unknown, so it holds nothing it can rely on).
var ErrNoAnswer = errors.New("group: the batch left this call without an answer")

// DefaultTimeout bounds one batch's work. A batch runs for callers other
// than its leader, so it must not stop when the leader's request does.
const DefaultTimeout = 30 * time.Second

// Do queues in and returns its answer.
//
// A call whose context ends while it waits in the queue leaves the queue
// and returns the context's error: it is never run. A call already taken
// into a batch waits for that batch's answer whatever its context says
// (the batch is bounded by Timeout), so that what the batch did for it is
// never done behind its back: the caller learns of it and can undo it.
// A call that finds MaxQueued calls waiting gets ErrFull at once.
func (b *Batcher[In, Out]) Do(ctx context.Context, in In) (Out, error) {
	c := &batchCall[In, Out]{ctx: ctx, in: in, wake: make(chan []*batchCall[In, Out], 1)}
	var batch []*batchCall[In, Out]
	b.mu.Lock()
	if b.MaxQueued > 0 && len(b.queue) >= b.MaxQueued {
		b.mu.Unlock()
		var zero Out
		return zero, ErrFull
	}
	b.queue = append(b.queue, c)
	lead := b.leaders < max(b.MaxLeaders, 1)
	if lead {
		b.leaders++
		if !b.Yield {
			batch = b.take()
		}
	}
	b.mu.Unlock()
	if lead && b.Yield {
		// The lead is this call's: no other batch can start until it
		// ends, and the queue's calls (this one among them, unless
		// another leader's batch took it) wait for it.
		runtime.Gosched()
		b.mu.Lock()
		batch = b.take()
		b.mu.Unlock()
	}
	ended := ctx.Done()
	for {
		if batch != nil {
			b.runBatch(ctx, batch)
			b.passLead()
			batch = nil
		}
		select {
		case batch = <-c.wake:
			if batch == nil {
				return c.out, c.err
			}
		case <-ended:
			if b.withdraw(c) {
				var zero Out
				return zero, ctx.Err()
			}
			ended = nil // in a batch already: its answer (or the lead) comes
		}
	}
}

// withdraw takes c out of the queue if no batch has taken it yet.
func (b *Batcher[In, Out]) withdraw(c *batchCall[In, Out]) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if c.taken {
		return false
	}
	if i := slices.Index(b.queue, c); i >= 0 {
		b.queue = slices.Delete(b.queue, i, i+1)
		return true
	}
	return false
}

// Queued is how many calls wait for a batch.
func (b *Batcher[In, Out]) Queued() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.queue)
}

// take removes the next batch from the front of the queue; b.mu is held.
func (b *Batcher[In, Out]) take() []*batchCall[In, Out] {
	n := len(b.queue)
	if b.MaxBatch > 0 {
		n = min(n, b.MaxBatch)
	}
	batch := make([]*batchCall[In, Out], n)
	copy(batch, b.queue)
	for _, c := range batch {
		c.taken = true
	}
	clear(b.queue[:n]) // let answered calls be collected
	b.queue = b.queue[n:]
	return batch
}

// passLead hands the lead, with the next batch, to the oldest queued call,
// or gives it up when nobody waits.
func (b *Batcher[In, Out]) passLead() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.queue) == 0 {
		b.leaders--
		return
	}
	next := b.take()
	next[0].wake <- next // buffered, and each call is handed at most one batch
}

// runBatch answers every call of batch.
func (b *Batcher[In, Out]) runBatch(ctx context.Context, batch []*batchCall[In, Out]) {
	var live []*batchCall[In, Out]
	for _, c := range batch {
		if err := c.ctx.Err(); err != nil {
			c.err = err
			c.wake <- nil
			continue
		}
		live = append(live, c)
	}
	if len(live) == 0 {
		return
	}
	ins := make([]In, len(live))
	for i, c := range live {
		ins[i] = c.in
	}
	timeout := b.Timeout
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	runCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
	defer cancel()
	answered := 0 // live[:answered] have their answer
	defer func() {
		// A panic in Run is a bug; it must not leave the batch's callers
		// waiting forever or the lead lost.
		if r := recover(); r != nil {
			for _, c := range live[answered:] {
				c.err = fmt.Errorf("internal error: %v", r)
				c.wake <- nil
			}
		}
	}()
	out, errs := b.Run(runCtx, ins)
	for i, c := range live {
		if i < len(out) {
			c.out = out[i]
		}
		if i < len(errs) {
			c.err = errs[i]
		}
		if c.err == nil && (i >= len(out) || isNil(c.out)) {
			c.err = ErrNoAnswer
		}
		c.wake <- nil
		answered++
	}
}

// isNil reports whether v is a nil pointer, interface, map, slice, channel
// or function: for such an Out, a nil answer without an error is no answer.
func isNil[T any](v T) bool {
	rv := reflect.ValueOf(&v).Elem()
	switch rv.Kind() {
	case reflect.Pointer, reflect.Interface, reflect.Map, reflect.Slice, reflect.Chan, reflect.Func:
		return rv.IsNil()
	}
	return false
}
