package queue

import (
	"context"
	"errors"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// pipelineGate holds the test's first pipeline until released and counts
// the commands of each of the test's pipelines.
type pipelineGate struct {
	mu      sync.Mutex
	sizes   []int
	release chan struct{}
}

func (*pipelineGate) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (*pipelineGate) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }
func (g *pipelineGate) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if cmds[0].Name() != "incr" { // the client's own, setting up a connection
			return next(ctx, cmds)
		}
		g.mu.Lock()
		g.sizes = append(g.sizes, len(cmds))
		first := len(g.sizes) == 1
		g.mu.Unlock()
		if first {
			<-g.release
		}
		return next(ctx, cmds)
	}
}

// TestSharedPipe: what callers send while a round trip is in flight goes
// in the next one, together; each caller gets its own reply.
func TestSharedPipe(t *testing.T) {
	t.Parallel()
	m := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { rdb.Close() })
	gate := &pipelineGate{release: make(chan struct{})}
	rdb.AddHook(gate)
	p := newSharedPipe(rdb)
	ctx := context.Background()
	incr := func() int64 {
		return send(ctx, p, func(pl redis.Pipeliner) *redis.IntCmd { return pl.Incr(ctx, "n") }).Val()
	}

	const callers = 10
	replies := make(chan int64, callers+1)
	go func() { replies <- incr() }() // held in flight by the gate
	waitUntil(&gate.mu, func() bool { return len(gate.sizes) == 1 })
	for range callers {
		go func() { replies <- incr() }()
	}
	for p.batch.Queued() != callers {
		time.Sleep(time.Millisecond)
	}
	close(gate.release)
	var got []int
	for range callers + 1 {
		got = append(got, int(<-replies))
	}
	sort.Ints(got)
	for i, v := range got {
		if v != i+1 {
			t.Fatalf("replies %v, want 1 to %d once each", got, callers+1)
		}
	}
	if len(gate.sizes) != 2 || gate.sizes[0] != 1 || gate.sizes[1] != callers {
		t.Errorf("pipelines of %v commands, want [1 %d]", gate.sizes, callers)
	}
	// A caller whose context has ended is not sent; a lone caller is sent
	// at once.
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if err := send(cancelled, p, func(pl redis.Pipeliner) *redis.IntCmd { return pl.Incr(ctx, "n") }).Err(); !errors.Is(err, context.Canceled) {
		t.Errorf("ended call: %v, want context.Canceled", err)
	}
	if n := incr(); n != callers+2 {
		t.Errorf("lone call: %d, want %d (the ended call did not run)", n, callers+2)
	}
}

// TestSharedPipeRedisDown: every caller hears the failure.
func TestSharedPipeRedisDown(t *testing.T) {
	t.Parallel()
	addr := refusingAddr(t)
	rdb := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: noRetries, DialTimeout: time.Second})
	t.Cleanup(func() { rdb.Close() })
	p := newSharedPipe(rdb)
	ctx := context.Background()
	var wg sync.WaitGroup
	for range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := send(ctx, p, func(pl redis.Pipeliner) *redis.IntCmd { return pl.Incr(ctx, "n") }).Err(); err == nil {
				t.Error("a call to a Redis that is down succeeded")
			}
		}()
	}
	wg.Wait()
}

// waitUntil polls cond under mu until it holds.
func waitUntil(mu *sync.Mutex, cond func() bool) {
	for {
		mu.Lock()
		ok := cond()
		mu.Unlock()
		if ok {
			return
		}
		time.Sleep(time.Millisecond)
	}
}
