package queue

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"github.com/robfig/cron/v3"
)

// jobs is the start and stop every worker shares: robfig cron jobs (with
// recover and skip-if-still-running) and background loops, a work context
// cancelled only when stop gives up waiting, and a stopped signal that
// ends the loops after their batch.
type jobs struct {
	cron    *cron.Cron
	ctx     context.Context // work context: cancelled only when stop gives up waiting
	cancel  context.CancelFunc
	stopped chan struct{} // closed when stop begins: loops end after their batch
	wg      sync.WaitGroup
	started bool
}

// newJobs returns jobs whose work context exists before Start, for a
// worker whose drain may be called directly (tests, a one-off run); begin
// replaces it with one made from Start's context.
func newJobs() jobs {
	ctx, cancel := context.WithCancel(context.Background())
	return jobs{ctx: ctx, cancel: cancel, stopped: make(chan struct{})}
}

// cronJob is one job: a cron spec with seconds and what to run.
type cronJob struct {
	spec string
	fn   func()
}

// begin makes the work context from ctx (not cancelled with it).
func (j *jobs) begin(ctx context.Context, what string) error {
	if j.started {
		return errors.New(what + " already started")
	}
	j.started = true
	if j.cancel != nil {
		j.cancel()
	}
	j.stopped = make(chan struct{})
	j.ctx, j.cancel = context.WithCancel(context.WithoutCancel(ctx))
	return nil
}

// startQueueJobs starts the jobs of a worker over one delay queue: its
// drain every second, lease recovery every cfg.RecoverEvery, its sweeper
// every cfg.SweepEvery and once now, in the background.
func (j *jobs) startQueueJobs(ctx context.Context, what string, log *slog.Logger, cfg Config, drain, recoverLeases, sweep func()) error {
	if err := j.begin(ctx, what); err != nil {
		return err
	}
	return j.run(log, what, []cronJob{
		{"* * * * * *", drain},
		{every(cfg.RecoverEvery), recoverLeases},
		{every(cfg.SweepEvery), sweep},
	}, sweep)
}

// run starts the cron jobs and each background loop in its own goroutine.
func (j *jobs) run(log *slog.Logger, what string, specs []cronJob, background ...func()) error {
	lg := cronLogger{log}
	j.cron = cron.New(cron.WithSeconds(), cron.WithLogger(lg),
		cron.WithChain(cron.Recover(lg), cron.SkipIfStillRunning(lg)))
	for _, s := range specs {
		if _, err := j.cron.AddFunc(s.spec, s.fn); err != nil {
			return fmt.Errorf("%s schedule %q: %w", what, s.spec, err)
		}
	}
	j.cron.Start()
	for _, fn := range background {
		j.wg.Add(1)
		go func() { defer j.wg.Done(); fn() }()
	}
	return nil
}

// stop stops scheduling jobs and waits for the running ones, the loops and
// the work the worker counts in wg to finish their batch. If ctx ends
// first, the work in flight is cancelled and ctx's error is returned. A
// worker never started is stopped too if it has its work context
// (newJobs): what a direct call of its drain started is waited for.
func (j *jobs) stop(ctx context.Context) error {
	if j.stopped == nil {
		return nil // never started, and nothing runs without Start
	}
	select {
	case <-j.stopped:
	default:
		close(j.stopped)
	}
	done := make(chan struct{})
	go func() {
		if j.cron != nil {
			<-j.cron.Stop().Done()
		}
		j.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		j.cancel()
		return nil
	case <-ctx.Done():
		j.cancel()
		<-done
		return ctx.Err()
	}
}

// stopping reports whether stop has begun.
func (j *jobs) stopping() bool {
	select {
	case <-j.stopped:
		return true
	default:
		return j.ctx.Err() != nil
	}
}

// eachClaimed runs fn for every claimed member, at most parallel at once,
// and returns when all are done: the claim's lease covers them together.
func eachClaimed(members []string, parallel int, fn func(member string)) {
	var wg sync.WaitGroup
	sem := make(chan struct{}, max(parallel, 1))
	for _, m := range members {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			fn(m)
		}()
	}
	wg.Wait()
}
