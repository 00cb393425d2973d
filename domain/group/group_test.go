package group

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestAnswersEveryCall: many callers at once each get their own
// answer, batches form while the leaders are busy, and no more than
// maxLeaders batches ever run at once.
func TestAnswersEveryCall(t *testing.T) {
	t.Parallel()
	for round := 0; round < 20; round++ {
		var running, maxRunning, batches, biggest atomic.Int64
		b := &Batcher[int, int]{MaxLeaders: 3, MaxBatch: 16, Run: func(ctx context.Context, ins []int) ([]int, []error) {
			n := running.Add(1)
			defer running.Add(-1)
			for {
				m := maxRunning.Load()
				if n <= m || maxRunning.CompareAndSwap(m, n) {
					break
				}
			}
			batches.Add(1)
			for {
				m := biggest.Load()
				if int64(len(ins)) <= m || biggest.CompareAndSwap(m, int64(len(ins))) {
					break
				}
			}
			time.Sleep(200 * time.Microsecond) // a transaction's worth of waiting
			out, errs := make([]int, len(ins)), make([]error, len(ins))
			for i, in := range ins {
				if in%7 == 0 {
					errs[i] = errors.New("refused")
					continue
				}
				out[i] = in * 2
			}
			return out, errs
		}}
		const calls = 500
		var wg sync.WaitGroup
		for i := 1; i <= calls; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				got, err := b.Do(context.Background(), i)
				if i%7 == 0 {
					if err == nil {
						t.Errorf("call %d: no error", i)
					}
					return
				}
				if err != nil || got != i*2 {
					t.Errorf("call %d: got %d, %v; want %d", i, got, err, i*2)
				}
			}()
		}
		wg.Wait()
		if maxRunning.Load() > 3 {
			t.Fatalf("%d batches ran at once; at most 3 may", maxRunning.Load())
		}
		if biggest.Load() > 16 {
			t.Fatalf("a batch of %d; at most 16", biggest.Load())
		}
		if batches.Load() >= calls {
			t.Fatalf("%d batches for %d calls: nothing was grouped", batches.Load(), calls)
		}
		b.mu.Lock()
		if len(b.queue) != 0 || b.leaders != 0 {
			t.Fatalf("after the last answer: %d queued, %d leaders; want none", len(b.queue), b.leaders)
		}
		b.mu.Unlock()
	}
}

// TestSkipsEndedCalls: a call whose context ended while it waited
// is answered with that error and never run; the others run.
func TestSkipsEndedCalls(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	var ran sync.Map
	b := &Batcher[int, int]{MaxLeaders: 1, MaxBatch: 10, Run: func(ctx context.Context, ins []int) ([]int, []error) {
		for _, in := range ins {
			ran.Store(in, true)
		}
		if ins[0] == 0 {
			<-release // the first batch holds the only lead while the others queue
		}
		return make([]int, len(ins)), make([]error, len(ins))
	}}
	first := make(chan error)
	go func() { _, err := b.Do(context.Background(), 0); first <- err }()
	waitQueued := func(n int) {
		for b.Queued() != n {
			time.Sleep(time.Millisecond)
		}
	}
	waitQueued(0)
	for {
		if _, ok := ran.Load(0); ok {
			break
		}
		time.Sleep(time.Millisecond)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ended := make(chan error)
	go func() { _, err := b.Do(ctx, 1); ended <- err }()
	live := make(chan error)
	go func() { _, err := b.Do(context.Background(), 2); live <- err }()
	waitQueued(2)
	cancel()
	close(release)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	if err := <-ended; !errors.Is(err, context.Canceled) {
		t.Fatalf("ended call: %v, want context.Canceled", err)
	}
	if err := <-live; err != nil {
		t.Fatal(err)
	}
	if _, ok := ran.Load(1); ok {
		t.Fatal("the ended call was run")
	}
	if _, ok := ran.Load(2); !ok {
		t.Fatal("the live call was not run")
	}
}

// TestSurvivesPanic: a panic in Run answers its batch with an
// error and hands the lead on; later calls still run.
func TestSurvivesPanic(t *testing.T) {
	t.Parallel()
	b := &Batcher[int, int]{MaxLeaders: 1, MaxBatch: 4, Run: func(ctx context.Context, ins []int) ([]int, []error) {
		if ins[0] < 0 {
			panic("bug")
		}
		return ins, make([]error, len(ins))
	}}
	if _, err := b.Do(context.Background(), -1); err == nil {
		t.Fatal("a panicking batch answered without an error")
	}
	if got, err := b.Do(context.Background(), 5); err != nil || got != 5 {
		t.Fatalf("after a panic: %d, %v", got, err)
	}
}

// TestSurvivesShortAnswers: a Run that answers fewer calls than it was
// given (a bug) still leaves no caller waiting: the ones it answered keep
// their answer, the rest get an error.
func TestSurvivesShortAnswers(t *testing.T) {
	t.Parallel()
	started, release := make(chan struct{}), make(chan struct{})
	b := &Batcher[int, int]{MaxLeaders: 1, Run: func(ctx context.Context, ins []int) ([]int, []error) {
		if ins[0] == 0 {
			close(started)
			<-release // hold the lead while the others queue into one batch
			return ins, make([]error, len(ins))
		}
		return ins[:1], make([]error, 1)
	}}
	first := make(chan error, 1)
	go func() { _, err := b.Do(context.Background(), 0); first <- err }()
	<-started
	type answer struct {
		in, out int
		err     error
	}
	answers := make(chan answer, 3)
	for i := 1; i <= 3; i++ {
		go func() { got, err := b.Do(context.Background(), i); answers <- answer{i, got, err} }()
	}
	for b.Queued() != 3 {
		time.Sleep(time.Millisecond)
	}
	close(release)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	ok, failed := 0, 0
	for range 3 {
		a := <-answers
		switch {
		case a.err == nil && a.out == a.in:
			ok++
		case a.err != nil:
			failed++
		default:
			t.Errorf("call %d answered %d", a.in, a.out)
		}
	}
	if ok != 1 || failed != 2 {
		t.Fatalf("%d answered, %d failed; want 1 and 2", ok, failed)
	}
}

// TestNilAnswerIsAnError: a Run that answers a call with neither a
// result nor an error (a nil pointer and a nil error) leaves that caller
// with ErrNoAnswer, never with (nil, nil); the calls it did answer keep
// their answer.
func TestNilAnswerIsAnError(t *testing.T) {
	t.Parallel()
	started, release := make(chan struct{}), make(chan struct{})
	b := &Batcher[int, *int]{MaxLeaders: 1, Run: func(ctx context.Context, ins []int) ([]*int, []error) {
		out := make([]*int, len(ins))
		if ins[0] == 0 {
			close(started)
			<-release // hold the lead while the others queue into one batch
			out[0] = &ins[0]
			return out, make([]error, len(ins))
		}
		for i := range ins {
			if ins[i]%2 == 0 {
				out[i] = &ins[i]
			}
		}
		return out, nil // no errors at all: the odd calls get nothing
	}}
	first := make(chan error, 1)
	go func() { _, err := b.Do(context.Background(), 0); first <- err }()
	<-started
	type answer struct {
		in  int
		out *int
		err error
	}
	answers := make(chan answer, 4)
	for i := 1; i <= 4; i++ {
		go func() { got, err := b.Do(context.Background(), i); answers <- answer{i, got, err} }()
	}
	for b.Queued() != 4 {
		time.Sleep(time.Millisecond)
	}
	close(release)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	for range 4 {
		a := <-answers
		if a.in%2 == 0 {
			if a.err != nil || a.out == nil || *a.out != a.in {
				t.Errorf("call %d: %v, %v; want its answer", a.in, a.out, a.err)
			}
			continue
		}
		if !errors.Is(a.err, ErrNoAnswer) || a.out != nil {
			t.Errorf("call %d: %v, %v; want ErrNoAnswer", a.in, a.out, a.err)
		}
	}
}

// holdLead starts a call that leads a batch and holds it inside Run until
// release is closed, so that the calls made meanwhile queue. Run answers
// every call with its input; ran records every input it was given.
func holdLead(t *testing.T, b *Batcher[int, int], ran *sync.Map) (release func(), first <-chan error) {
	t.Helper()
	started, hold := make(chan struct{}), make(chan struct{})
	b.Run = func(ctx context.Context, ins []int) ([]int, []error) {
		for _, in := range ins {
			ran.Store(in, true)
		}
		if ins[0] == 0 {
			close(started)
			<-hold
		}
		return ins, make([]error, len(ins))
	}
	errc := make(chan error, 1)
	go func() { _, err := b.Do(context.Background(), 0); errc <- err }()
	<-started
	return func() { close(hold) }, errc
}

// waitFor polls cond until it holds, failing the test after a generous
// deadline (it never judges by how fast anything ran).
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestDropsEndedQueuedCall: a queued call whose context ends leaves the
// queue at once, before the batch ahead of it is done, with the context's
// error; it is never run.
func TestDropsEndedQueuedCall(t *testing.T) {
	t.Parallel()
	b := &Batcher[int, int]{MaxLeaders: 1}
	var ran sync.Map
	release, first := holdLead(t, b, &ran)
	ctx, cancel := context.WithCancel(context.Background())
	ended := make(chan error, 1)
	go func() { _, err := b.Do(ctx, 1); ended <- err }()
	live := make(chan error, 1)
	go func() { _, err := b.Do(context.Background(), 2); live <- err }()
	waitFor(t, "two queued calls", func() bool { return b.Queued() == 2 })
	cancel()
	var err error
	waitFor(t, "the ended call's answer", func() bool {
		select {
		case err = <-ended:
			return true
		default:
			return false
		}
	})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("ended call: %v, want context.Canceled", err)
	}
	if q := b.Queued(); q != 1 {
		t.Fatalf("%d calls queued after the drop, want 1", q)
	}
	release()
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	if err := <-live; err != nil {
		t.Fatal(err)
	}
	if _, ok := ran.Load(1); ok {
		t.Fatal("the dropped call was run")
	}
	if _, ok := ran.Load(2); !ok {
		t.Fatal("the live call was not run")
	}
}

// TestEndedCallInRunningBatchGetsItsAnswer: a call already taken into a
// running batch is not dropped when its context ends: it gets what the
// batch did for it, so its caller can undo it.
func TestEndedCallInRunningBatchGetsItsAnswer(t *testing.T) {
	t.Parallel()
	b := &Batcher[int, int]{MaxLeaders: 1}
	var ran sync.Map
	release, first := holdLead(t, b, &ran)
	// Calls 1 and 2 queue behind call 0; the batch [1 2] is then held in
	// its Run until hold2 closes.
	inSecond, hold2 := make(chan struct{}), make(chan struct{})
	run := b.Run
	b.Run = func(ctx context.Context, ins []int) ([]int, []error) {
		if ins[0] == 1 {
			close(inSecond)
			<-hold2
		}
		return run(ctx, ins)
	}
	go func() { _, _ = b.Do(context.Background(), 1) }()
	waitFor(t, "call 1 queued", func() bool { return b.Queued() == 1 })
	ctx, cancel := context.WithCancel(context.Background())
	type answer struct {
		out int
		err error
	}
	second := make(chan answer, 1)
	go func() { out, err := b.Do(ctx, 2); second <- answer{out, err} }()
	waitFor(t, "call 2 queued", func() bool { return b.Queued() == 2 })
	release()
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	<-inSecond
	cancel()
	close(hold2)
	if a := <-second; a.err != nil || a.out != 2 {
		t.Fatalf("call 2: %d, %v; want its answer 2", a.out, a.err)
	}
}

// TestFullQueueRefusesAtOnce: with MaxQueued calls waiting, one more call
// is refused with ErrFull at once, while the batch ahead still runs; the
// queued ones are served.
func TestFullQueueRefusesAtOnce(t *testing.T) {
	t.Parallel()
	b := &Batcher[int, int]{MaxLeaders: 1, MaxQueued: 2}
	var ran sync.Map
	release, first := holdLead(t, b, &ran)
	queued := make(chan error, 2)
	for i := 1; i <= 2; i++ {
		go func() { _, err := b.Do(context.Background(), i); queued <- err }()
	}
	waitFor(t, "two queued calls", func() bool { return b.Queued() == 2 })
	over := make(chan error, 1)
	go func() { _, err := b.Do(context.Background(), 3); over <- err }()
	var err error
	waitFor(t, "the call beyond MaxQueued to be refused", func() bool {
		select {
		case err = <-over:
			return true
		default:
			return false
		}
	})
	if !errors.Is(err, ErrFull) {
		t.Fatalf("a call beyond MaxQueued: %v, want ErrFull", err)
	}
	release()
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := <-queued; err != nil {
			t.Fatal(err)
		}
	}
	if _, ok := ran.Load(3); ok {
		t.Fatal("the refused call was run")
	}
}

// TestYieldGathersTheCallsWokenTogether: calls that become runnable
// together (the callers one answer woke) share the first batch when the
// call that finds no batch running yields before taking it; without Yield
// it leads alone. On one processor, so that the woken callers run only
// when the leader yields; the scheduler may still resume the leader first
// now and then (it looks at its global queue every 61 turns), so the
// promise is held over many trials: most of them gather. Not parallel: it
// holds GOMAXPROCS at 1.
func TestYieldGathersTheCallsWokenTogether(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	const callers, trials = 10, 20
	for _, yield := range []bool{false, true} {
		gathered := 0 // trials whose first batch held more than its leader
		for range trials {
			if first := firstBatch(t, yield, callers); first > 1 {
				gathered++
			}
		}
		switch {
		case yield && gathered < trials/2:
			t.Errorf("with Yield, the first batch held more than its leader in %d of %d trials, want most", gathered, trials)
		case !yield && gathered > 0:
			t.Errorf("without Yield, the first batch held more than its leader in %d of %d trials, want none", gathered, trials)
		}
	}
}

// firstBatch wakes callers at once, each making one call, and returns the
// size of the first batch run.
func firstBatch(t *testing.T, yield bool, callers int) int {
	var mu sync.Mutex
	var sizes []int
	b := &Batcher[int, int]{MaxLeaders: 1, Yield: yield, Run: func(_ context.Context, ins []int) ([]int, []error) {
		mu.Lock()
		sizes = append(sizes, len(ins))
		mu.Unlock()
		return ins, nil
	}}
	var ready, done sync.WaitGroup
	start := make(chan struct{})
	for i := range callers {
		ready.Add(1)
		done.Add(1)
		go func() {
			defer done.Done()
			ready.Done()
			<-start
			if out, err := b.Do(context.Background(), i+1); out != i+1 || err != nil {
				t.Errorf("call %d answered %d, %v", i+1, out, err)
			}
		}()
	}
	ready.Wait()
	close(start) // every caller runnable at once
	done.Wait()
	return sizes[0]
}
