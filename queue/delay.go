package queue

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// MaxClaim caps one claim (the script unpacks the members onto Lua's stack).
const MaxClaim = 2000

// DelayQueue is a Redis ZSET of members scored by due time (unix ms) with a
// lease set beside it. A claim moves due members into the lease set in one
// atomic call; the worker acks them once their effect is committed in the
// database; a member whose worker never acks (crash, kill -9) is put back by
// Recover once its lease expires.
type DelayQueue struct {
	rdb   redis.UniversalClient
	queue string
	lease string
	// pipe carries Schedule's ZADDs, with whatever else goes to rdb at the
	// time: the orders of one batch are scheduled in one round trip.
	pipe *sharedPipe
}

// NewDelayQueue returns the queue at key queue with its lease set at lease;
// both must share a hash tag (see Keys).
func NewDelayQueue(rdb redis.UniversalClient, queue, lease string) *DelayQueue {
	return &DelayQueue{rdb: rdb, queue: queue, lease: lease, pipe: pipeFor(rdb)}
}

// CloseQueue is the order-close queue under keys.
func CloseQueue(rdb redis.UniversalClient, keys Keys) *DelayQueue {
	return NewDelayQueue(rdb, keys.CloseQueue(), keys.CloseLease())
}

// RefundQueue is the refund-retry queue under keys.
func RefundQueue(rdb redis.UniversalClient, keys Keys) *DelayQueue {
	return NewDelayQueue(rdb, keys.RefundQueue(), keys.RefundLease())
}

// Key is the queue's ZSET key.
func (q *DelayQueue) Key() string { return q.queue }

// LeaseKey is the lease set's key.
func (q *DelayQueue) LeaseKey() string { return q.lease }

func ms(t time.Time) int64 { return t.UnixMilli() }

// dueMS is the score of a member due at t: the first whole millisecond at
// or after t. Claims compare it with the current millisecond rounded down,
// so a member is never claimed before its time (the ledger would find the
// order not due yet and it would go round again).
func dueMS(t time.Time) int64 {
	return (t.UnixNano() + int64(time.Millisecond) - 1) / int64(time.Millisecond)
}

func fromMS(v float64) time.Time { return time.UnixMilli(int64(v)).UTC() }

// Schedule puts member on the queue, due at due. Scheduling again moves
// its due time; it never makes a second task.
func (q *DelayQueue) Schedule(ctx context.Context, member string, due time.Time) error {
	return send(ctx, q.pipe, func(p redis.Pipeliner) *redis.IntCmd {
		return p.ZAdd(ctx, q.queue, redis.Z{Score: float64(dueMS(due)), Member: member})
	}).Err()
}

// Item is a member and its due time.
type Item struct {
	Member string
	Due    time.Time
}

// ScheduleIfAbsent adds the items that are neither queued nor leased, in
// one call per 1000 items, and reports how many were added.
func (q *DelayQueue) ScheduleIfAbsent(ctx context.Context, items []Item) (int, error) {
	added := 0
	for start := 0; start < len(items); start += 1000 {
		part := items[start:min(start+1000, len(items))]
		args := make([]any, 0, 2*len(part))
		for _, it := range part {
			args = append(args, dueMS(it.Due), it.Member)
		}
		n, err := scheduleIfAbsentScript.Run(ctx, q.rdb, []string{q.queue, q.lease}, args...).Int()
		if err != nil {
			return added, err
		}
		added += n
	}
	return added, nil
}

// Cancel removes member from the queue and from the lease set. It rides
// the shared pipeline, so the cancels of a batch of payments share one
// round trip. The two removals are not one atomic step: a lease that
// expires between them puts the member back on the queue, due at once,
// and its worker then finds nothing to do. That is the price of not
// waiting for a round trip of its own.
func (q *DelayQueue) Cancel(ctx context.Context, member string) error {
	var fromLease *redis.IntCmd
	fromQueue := send(ctx, q.pipe, func(p redis.Pipeliner) *redis.IntCmd {
		fromLease = p.ZRem(ctx, q.lease, member)
		return p.ZRem(ctx, q.queue, member)
	})
	if err := fromQueue.Err(); err != nil {
		return err
	}
	return fromLease.Err()
}

// Claimed is what one claim took: its members, held until Until, and the
// time each was due (Due[i] is Members[i]'s, as it was queued).
type Claimed struct {
	Members []string
	Due     []time.Time
	Until   time.Time
}

// Claim moves up to n members due at now into the lease set, held for
// lease, and returns them earliest due first. Each due member goes to
// exactly one claimer.
func (q *DelayQueue) Claim(ctx context.Context, now time.Time, n int, lease time.Duration) (Claimed, error) {
	n = min(max(n, 1), MaxClaim)
	until := now.Add(lease).Truncate(time.Millisecond)
	res, err := claimScript.Run(ctx, q.rdb, []string{q.queue, q.lease}, ms(now), n, ms(until)).StringSlice()
	if err != nil && !errors.Is(err, redis.Nil) {
		return Claimed{}, err
	}
	c := Claimed{Members: make([]string, 0, len(res)/2), Due: make([]time.Time, 0, len(res)/2), Until: until}
	for i := 0; i+1 < len(res); i += 2 {
		score, err := strconv.ParseFloat(res[i+1], 64)
		if err != nil {
			// Claimed, so held: its lease brings it back.
			return Claimed{}, fmt.Errorf("claim: member %q has score %q: %w", res[i], res[i+1], err)
		}
		c.Members = append(c.Members, res[i])
		c.Due = append(c.Due, fromMS(score))
	}
	return c, nil
}

// Ack removes finished members from the lease set, if they are still held
// under c's lease, and reports how many were removed.
func (q *DelayQueue) Ack(ctx context.Context, until time.Time, members ...string) (int, error) {
	if len(members) == 0 {
		return 0, nil
	}
	return ackScript.Run(ctx, q.rdb, []string{q.lease}, scriptArgs(members, ms(until))...).Int()
}

// Release puts members claimed with the lease until back on the queue,
// each due at its Due, and ends their lease, in one step (lease-safe:
// members no longer held under that lease are left alone, and a member
// queued again meanwhile keeps an earlier due time). It reports how many
// it put back.
func (q *DelayQueue) Release(ctx context.Context, until time.Time, items ...Item) (int, error) {
	if len(items) == 0 {
		return 0, nil
	}
	args := make([]any, 0, 1+2*len(items))
	args = append(args, ms(until))
	for _, it := range items {
		args = append(args, dueMS(it.Due), it.Member)
	}
	return releaseScript.Run(ctx, q.rdb, []string{q.queue, q.lease}, args...).Int()
}

// Advance makes queued members due at due if they were due later; members
// not on the queue (claimed, acked) are left alone. It reports how many
// it moved.
func (q *DelayQueue) Advance(ctx context.Context, due time.Time, members ...string) (int, error) {
	if len(members) == 0 {
		return 0, nil
	}
	return advanceScript.Run(ctx, q.rdb, []string{q.queue}, scriptArgs(members, dueMS(due))...).Int()
}

// scriptArgs is a script's ARGV: head, then the members.
func scriptArgs(members []string, head ...any) []any {
	args := make([]any, 0, len(head)+len(members))
	args = append(args, head...)
	for _, m := range members {
		args = append(args, m)
	}
	return args
}

// Recover puts every member whose lease ended at or before now back on the
// queue and reports how many.
func (q *DelayQueue) Recover(ctx context.Context, now time.Time) (int, error) {
	total := 0
	for {
		n, err := recoverScript.Run(ctx, q.rdb, []string{q.queue, q.lease}, ms(now), 1000).Int()
		total += n
		if err != nil || n < 1000 {
			return total, err
		}
	}
}

// NextDue returns the earliest due time on the queue; ok is false when the
// queue is empty.
func (q *DelayQueue) NextDue(ctx context.Context) (due time.Time, ok bool, err error) {
	zs, err := q.rdb.ZRangeWithScores(ctx, q.queue, 0, 0).Result()
	if err != nil || len(zs) == 0 {
		return time.Time{}, false, err
	}
	return fromMS(zs[0].Score), true, nil
}

// QueueStats describes a queue for metrics.
type QueueStats struct {
	Backlog int64 // members on the queue (due or not)
	Due     int64 // members due at now
	Leased  int64 // members claimed and not yet acked
	// OldestOverdue is how long the earliest due member has waited past its
	// due time; 0 when nothing is due.
	OldestOverdue time.Duration
}

// Stats reads the queue's size and lag in one round trip.
func (q *DelayQueue) Stats(ctx context.Context, now time.Time) (QueueStats, error) {
	pipe := q.rdb.Pipeline()
	backlog := pipe.ZCard(ctx, q.queue)
	due := pipe.ZCount(ctx, q.queue, "-inf", strconv.FormatInt(ms(now), 10))
	leased := pipe.ZCard(ctx, q.lease)
	head := pipe.ZRangeWithScores(ctx, q.queue, 0, 0)
	if _, err := pipe.Exec(ctx); err != nil {
		return QueueStats{}, err
	}
	s := QueueStats{Backlog: backlog.Val(), Due: due.Val(), Leased: leased.Val()}
	if zs := head.Val(); len(zs) > 0 {
		if d := now.Sub(fromMS(zs[0].Score)); d > 0 {
			s.OldestOverdue = d
		}
	}
	return s, nil
}
