package queue

import (
	"context"
	"sync"

	"github.com/redis/go-redis/v9"
)

// sharedPipe sends the commands that callers issue while an earlier round
// trip is in flight together, as one pipeline: under load, the buyers of
// one group-committed batch of orders schedule their closes (and take
// their stock) at the same moment, and one write and one read serve them
// all instead of one each, which is most of what a Redis call costs kami.
// A lone caller sends at once, so an idle shop waits for nothing.
//
// Each command keeps its own reply and error, and Redis runs them one
// after the other as if they had come alone; a pipeline is not a
// transaction. There are no goroutines of its own: the caller that finds
// nothing in flight sends; when it is done it hands the lead, with
// everything queued meanwhile, to the oldest queued caller.
//
// There is one per Redis client (pipeFor), so the gate's takes and the
// close queue's schedules ride in the same round trips.
type sharedPipe struct {
	rdb redis.UniversalClient

	mu      sync.Mutex
	queued  []*pipeCall
	sending bool
}

type pipeCall struct {
	queue func(redis.Pipeliner) // adds the caller's command
	done  chan struct{}         // closed once the command has its reply
	lead  chan []*pipeCall      // the batch this caller is to send
}

// pipes holds each Redis client's sharedPipe, for the life of the process
// (which makes one client, tests a few dozen).
var pipes sync.Map // redis.UniversalClient → *sharedPipe

// pipeFor returns rdb's sharedPipe.
func pipeFor(rdb redis.UniversalClient) *sharedPipe {
	p, _ := pipes.LoadOrStore(rdb, &sharedPipe{rdb: rdb})
	return p.(*sharedPipe)
}

// send runs the command that queue adds to a pipeline and returns it with
// its reply. The pipeline runs under ctx without its cancellation: it
// carries other callers' commands too (the client's timeouts bound it).
func send[C redis.Cmder](ctx context.Context, p *sharedPipe, queue func(redis.Pipeliner) C) C {
	var cmd C
	c := &pipeCall{queue: func(pl redis.Pipeliner) { cmd = queue(pl) }, done: make(chan struct{}), lead: make(chan []*pipeCall, 1)}
	var batch []*pipeCall
	p.mu.Lock()
	p.queued = append(p.queued, c)
	if !p.sending {
		p.sending = true
		batch, p.queued = p.queued, nil
	}
	p.mu.Unlock()
	for {
		if batch != nil {
			p.run(context.WithoutCancel(ctx), batch)
			p.handOn()
			batch = nil
		}
		select {
		case <-c.done:
			return cmd
		case batch = <-c.lead:
		}
	}
}

// run sends batch as one pipeline; each command holds its own error.
func (p *sharedPipe) run(ctx context.Context, batch []*pipeCall) {
	pl := p.rdb.Pipeline()
	for _, c := range batch {
		c.queue(pl)
	}
	_, _ = pl.Exec(ctx)
	for _, c := range batch {
		close(c.done)
	}
}

// handOn gives what was queued meanwhile to the oldest queued caller to
// send, or ends the sending when nothing was.
func (p *sharedPipe) handOn() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.queued) == 0 {
		p.sending = false
		return
	}
	next := p.queued
	p.queued = nil
	next[0].lead <- next // buffered; a caller is handed at most one batch
}
