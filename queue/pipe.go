package queue

import (
	"context"
	"sync"

	"github.com/redis/go-redis/v9"

	"kami/domain/group"
)

// sharedPipe sends the commands that callers issue while an earlier round
// trip is in flight together, as one pipeline: under load, the buyers of
// one group-committed batch of orders schedule their closes (and take
// their stock) at the same moment, and one write and one read serve them
// all instead of one each, which is most of what a Redis call costs kami.
// A lone caller sends at once, so an idle shop waits for nothing; a caller
// that finds no round trip in flight first yields the processor once
// (Batcher.Yield), so that the callers woken with it (the buyers of one
// batch of orders, the payers of one batch of payments) join its round
// trip rather than following in a second: 0.33 round trips an order
// became 0.28 in BenchmarkStorefrontCPU.
//
// Each command keeps its own reply and error, and Redis runs them one
// after the other as if they had come alone; a pipeline is not a
// transaction. The gathering is group.Batcher's, with one batch in flight.
//
// There is one per Redis client (pipeFor), so the gate's takes and the
// close queue's schedules ride in the same round trips.
type sharedPipe struct {
	rdb   redis.UniversalClient
	batch group.Batcher[func(redis.Pipeliner), struct{}]
}

// pipes holds each Redis client's sharedPipe, for the life of the process
// (which makes one client, tests a few dozen).
var pipes sync.Map // redis.UniversalClient → *sharedPipe

// pipeFor returns rdb's sharedPipe.
func pipeFor(rdb redis.UniversalClient) *sharedPipe {
	if p, ok := pipes.Load(rdb); ok {
		return p.(*sharedPipe)
	}
	p, _ := pipes.LoadOrStore(rdb, newSharedPipe(rdb))
	return p.(*sharedPipe)
}

func newSharedPipe(rdb redis.UniversalClient) *sharedPipe {
	p := &sharedPipe{rdb: rdb}
	p.batch = group.Batcher[func(redis.Pipeliner), struct{}]{MaxLeaders: 1, Yield: true,
		Run: func(ctx context.Context, adds []func(redis.Pipeliner)) ([]struct{}, []error) {
			pl := rdb.Pipeline()
			for _, add := range adds {
				add(pl)
			}
			_, _ = pl.Exec(ctx) // each command holds its own error
			return make([]struct{}, len(adds)), make([]error, len(adds))
		}}
	return p
}

// send runs the command that queue adds to a pipeline and returns it with
// its reply. A caller whose context ended while it waited for the round
// trip gets its command back unsent, with the context's error.
func send[C redis.Cmder](ctx context.Context, p *sharedPipe, queue func(redis.Pipeliner) C) C {
	var cmd C
	if _, err := p.batch.Do(ctx, func(pl redis.Pipeliner) { cmd = queue(pl) }); err != nil {
		cmd = queue(p.rdb.Pipeline()) // built, never sent
		cmd.SetErr(err)
	}
	return cmd
}
