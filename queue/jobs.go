package queue

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"github.com/robfig/cron/v3"
)

// jobs is the start and stop every background worker shares: cron jobs
// (recovered, skipped while the last run still runs), goroutines beside
// them, and the work context, cancelled only when Stop gives up waiting.
type jobs struct {
	cron    *cron.Cron
	ctx     context.Context
	cancel  context.CancelFunc
	stopped chan struct{} // closed when Stop begins: loops end after their batch
	wg      sync.WaitGroup
	started bool
}

func newJobs() jobs {
	ctx, cancel := context.WithCancel(context.Background())
	return jobs{ctx: ctx, cancel: cancel, stopped: make(chan struct{})}
}

// job is one cron entry.
type job struct {
	spec string
	fn   func()
}

// start schedules the cron jobs and runs each of loops in a goroutine.
func (j *jobs) start(name string, log *slog.Logger, cronJobs []job, loops ...func()) error {
	if j.started {
		return errors.New(name + " already started")
	}
	j.started = true
	lg := cronLogger{log}
	j.cron = cron.New(cron.WithSeconds(), cron.WithLogger(lg), cron.WithChain(cron.Recover(lg), cron.SkipIfStillRunning(lg)))
	for _, c := range cronJobs {
		if _, err := j.cron.AddFunc(c.spec, c.fn); err != nil {
			return fmt.Errorf("%s schedule %q: %w", name, c.spec, err)
		}
	}
	j.cron.Start()
	for _, loop := range loops {
		j.wg.Add(1)
		go func() { defer j.wg.Done(); loop() }()
	}
	return nil
}

// stop stops scheduling jobs and waits for the running ones to finish
// their batch. If ctx ends first, the work in flight is cancelled (its
// leases bring it back) and ctx's error is returned.
func (j *jobs) stop(ctx context.Context) error {
	if !j.started {
		return nil
	}
	select {
	case <-j.stopped:
	default:
		close(j.stopped)
	}
	done := make(chan struct{})
	go func() {
		<-j.cron.Stop().Done()
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

func (j *jobs) stopping() bool {
	select {
	case <-j.stopped:
		return true
	default:
		return j.ctx.Err() != nil
	}
}
