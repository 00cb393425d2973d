package queue_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"kami/queue"
	"kami/queue/redistest"
)

func TestKeysShareSlotsAndPrefixes(t *testing.T) {
	t.Parallel()
	tag := func(k string) string { return k[strings.Index(k, "{"):strings.Index(k, "}")] }
	a, b := queue.NewKeys("shopa:"), queue.NewKeys("shopb:")
	if tag(a.CloseQueue()) != tag(a.CloseLease()) || tag(a.RefundQueue()) != tag(a.RefundLease()) {
		t.Errorf("a queue and its lease set must share a hash tag: %s %s", a.CloseQueue(), a.CloseLease())
	}
	if tag(a.Stock(7)) != tag(a.StockRebuildLock(7)) || tag(a.Stock(7)) != tag(a.StockRebuildPending(7)) ||
		tag(a.Stock(7)) != tag(a.StockOps(7)) {
		t.Errorf("a stock counter's take and give-back script keys must share a hash tag: %s %s %s",
			a.StockRebuildLock(7), a.StockRebuildPending(7), a.StockOps(7))
	}
	if a.CloseQueue() != "shopa:{delay:close:order}" || a.Stock(7) != "shopa:stock:product:{7}" {
		t.Errorf("key names: %s %s", a.CloseQueue(), a.Stock(7))
	}
	if a.CloseQueue() == b.CloseQueue() || a.Stock(1) == b.Stock(1) || a.OrderChannel("1") == b.OrderChannel("1") {
		t.Error("two prefixes share a key")
	}
	if queue.NewKeys("").Prefix() != "kami:" || queue.NewKeys("x{y}:").Prefix() != "xy:" {
		t.Error("prefix defaults and brace stripping")
	}
}

func TestClaimIsAtomicUnderConcurrentClaimers(t *testing.T) {
	redistest.Each(t, func(t *testing.T, rs *redistest.Server) {
		ctx := context.Background()
		keys := queue.NewKeys(rs.Prefix(t))
		q := queue.CloseQueue(rs.Client, keys)
		now := time.UnixMilli(time.Now().UnixMilli()) // whole: the first member is due exactly now
		const n = 3000
		items := make([]queue.Item, n)
		for i := range items {
			items[i] = queue.Item{Member: fmt.Sprintf("m%05d", i), Due: now.Add(-time.Duration(i) * time.Millisecond)}
		}
		// One not due: nobody may claim it.
		if err := q.Schedule(ctx, "later", now.Add(time.Hour)); err != nil {
			t.Fatal(err)
		}
		if added, err := q.ScheduleIfAbsent(ctx, items); err != nil || added != n {
			t.Fatalf("ScheduleIfAbsent: %d, %v", added, err)
		}
		var mu sync.Mutex
		seen := map[string]int{}
		var wg sync.WaitGroup
		for range 12 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				cq := queue.CloseQueue(rs.NewClient(t), keys) // its own connection pool: another worker
				for {
					c, err := cq.Claim(ctx, now, 37, time.Minute)
					if err != nil {
						t.Error(err)
						return
					}
					if len(c.Members) == 0 {
						return
					}
					mu.Lock()
					for _, m := range c.Members {
						seen[m]++
					}
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		if len(seen) != n {
			t.Errorf("%d members claimed, want %d", len(seen), n)
		}
		for m, k := range seen {
			if k != 1 {
				t.Errorf("%s claimed %d times", m, k)
			}
		}
		st, err := q.Stats(ctx, now)
		if err != nil {
			t.Fatal(err)
		}
		if st.Backlog != 1 || st.Leased != n || st.Due != 0 || st.OldestOverdue != 0 {
			t.Errorf("stats after claiming: %+v", st)
		}
	})
}

// TestNeverClaimedEarly: a member due within a millisecond is not claimed
// before its due time, by Schedule or by ScheduleIfAbsent (the sweeper).
func TestNeverClaimedEarly(t *testing.T) {
	redistest.Each(t, func(t *testing.T, rs *redistest.Server) {
		ctx := context.Background()
		q := queue.CloseQueue(rs.Client, queue.NewKeys(rs.Prefix(t)))
		due := time.UnixMilli(time.Now().UnixMilli()).Add(700 * time.Microsecond)
		if err := q.Schedule(ctx, "a", due); err != nil {
			t.Fatal(err)
		}
		if _, err := q.ScheduleIfAbsent(ctx, []queue.Item{{Member: "b", Due: due}}); err != nil {
			t.Fatal(err)
		}
		if c, err := q.Claim(ctx, due.Add(-400*time.Microsecond), 10, time.Minute); err != nil || len(c.Members) != 0 {
			t.Fatalf("claimed %v (%v) 400µs before due", c.Members, err)
		}
		if c, err := q.Claim(ctx, due.Add(300*time.Microsecond), 10, time.Minute); err != nil || len(c.Members) != 2 {
			t.Fatalf("claimed %v (%v) once due, want a and b", c.Members, err)
		}
	})
}

func TestLeaseExpiryAckAndRecover(t *testing.T) {
	redistest.Each(t, func(t *testing.T, rs *redistest.Server) {
		ctx := context.Background()
		q := queue.CloseQueue(rs.Client, queue.NewKeys(rs.Prefix(t)))
		now := time.UnixMilli(time.Now().UnixMilli())
		for i, m := range []string{"a", "b", "c"} {
			if err := q.Schedule(ctx, m, now.Add(time.Duration(i-3)*time.Second)); err != nil {
				t.Fatal(err)
			}
		}
		st, _ := q.Stats(ctx, now)
		if st.Due != 3 || st.OldestOverdue != 3*time.Second {
			t.Errorf("stats before claim: %+v", st)
		}
		first, err := q.Claim(ctx, now, 10, 30*time.Second)
		if err != nil || strings.Join(first.Members, ",") != "a,b,c" {
			t.Fatalf("claim: %v %v", first.Members, err)
		}
		// Nothing comes back before the lease ends.
		if n, err := q.Recover(ctx, now.Add(29*time.Second)); err != nil || n != 0 {
			t.Fatalf("early recover: %d %v", n, err)
		}
		// The worker died: at the lease's end the members come back.
		later := now.Add(30 * time.Second)
		if n, err := q.Recover(ctx, later); err != nil || n != 3 {
			t.Fatalf("recover: %d %v", n, err)
		}
		second, err := q.Claim(ctx, later, 10, 30*time.Second)
		if err != nil || len(second.Members) != 3 {
			t.Fatalf("claim again: %v %v", second.Members, err)
		}
		// The first worker wakes up and acks: the second keeps its lease.
		if n, err := q.Ack(ctx, first.Until, first.Members...); err != nil || n != 0 {
			t.Fatalf("stale ack removed %d (%v)", n, err)
		}
		if n, err := q.Ack(ctx, second.Until, "a", "b"); err != nil || n != 2 {
			t.Fatalf("ack: %d %v", n, err)
		}
		// The sweeper must not add a member that is being worked on.
		added, err := q.ScheduleIfAbsent(ctx, []queue.Item{{Member: "c", Due: now}, {Member: "d", Due: now.Add(time.Minute)}})
		if err != nil || added != 1 {
			t.Fatalf("ScheduleIfAbsent: %d %v", added, err)
		}
		// ... nor move a queued member's due time.
		if added, err := q.ScheduleIfAbsent(ctx, []queue.Item{{Member: "d", Due: now}}); err != nil || added != 0 {
			t.Fatalf("ScheduleIfAbsent again: %d %v", added, err)
		}
		due, ok, err := q.NextDue(ctx)
		if err != nil || !ok || !due.Equal(now.Add(time.Minute)) {
			t.Fatalf("NextDue %v %v %v, want %v", due, ok, err, now.Add(time.Minute))
		}
		if err := q.Cancel(ctx, "c"); err != nil {
			t.Fatal(err)
		}
		if err := q.Cancel(ctx, "d"); err != nil {
			t.Fatal(err)
		}
		st, _ = q.Stats(ctx, later)
		if st.Backlog != 0 || st.Leased != 0 {
			t.Errorf("stats at the end: %+v", st)
		}
		if _, ok, _ := q.NextDue(ctx); ok {
			t.Error("NextDue on an empty queue")
		}
	})
}

// TestReleaseAndAdvance: Claim reports when each member was due; Release
// puts back, each at its own time, only what the caller's lease still
// holds (a member taken over after its lease expired stays with its new
// holder) and never delays a member queued sooner meanwhile; Advance moves
// only members on the queue, and only earlier.
func TestReleaseAndAdvance(t *testing.T) {
	redistest.Each(t, func(t *testing.T, rs *redistest.Server) {
		ctx := context.Background()
		q := queue.WebhookQueue(rs.Client, queue.NewKeys(rs.Prefix(t)))
		now := time.UnixMilli(time.Now().UnixMilli())
		for _, m := range []string{"a", "b", "c"} {
			if err := q.Schedule(ctx, m, now); err != nil {
				t.Fatal(err)
			}
		}
		first, err := q.Claim(ctx, now, 10, 30*time.Second)
		if err != nil || len(first.Members) != 3 {
			t.Fatalf("claim: %v %v", first.Members, err)
		}
		for i, due := range first.Due {
			if !due.Equal(now) {
				t.Fatalf("claimed %s due at %v, want %v (as queued)", first.Members[i], due, now)
			}
		}
		// The leases expire and another worker claims all three; a and b
		// come round again and the first worker claims them once more: it
		// holds a and b, and c is the other worker's.
		later := now.Add(30 * time.Second)
		if _, err := q.Recover(ctx, later); err != nil {
			t.Fatal(err)
		}
		if c, err := q.Claim(ctx, later, 3, 30*time.Second); err != nil || len(c.Members) != 3 {
			t.Fatalf("claim after recovery: %v %v", c.Members, err)
		}
		for _, m := range []string{"a", "b"} {
			if err := q.Schedule(ctx, m, now); err != nil {
				t.Fatal(err)
			}
		}
		first, err = q.Claim(ctx, now, 2, 10*time.Second)
		if err != nil || len(first.Members) != 2 {
			t.Fatalf("claim a and b: %v %v", first.Members, err)
		}
		// b is scheduled again, due now, while leased (a redelivery).
		if err := q.Schedule(ctx, "b", now); err != nil {
			t.Fatal(err)
		}
		park := now.Add(time.Hour)
		if n, err := q.Release(ctx, first.Until, queue.Item{Member: "a", Due: park}, queue.Item{Member: "b", Due: park.Add(time.Hour)},
			queue.Item{Member: "c", Due: park}); err != nil || n != 2 {
			t.Fatalf("released %d (%v), want a and b", n, err)
		}
		if s, err := rs.Client.ZScore(ctx, q.Key(), "a").Result(); err != nil || int64(s) != park.UnixMilli() {
			t.Fatalf("a put back due at %v (%v), want its own time %v", s, err, park.UnixMilli())
		}
		st, err := q.Stats(ctx, now)
		if err != nil || st.Backlog != 2 || st.Due != 1 || st.Leased != 1 {
			t.Fatalf("after the release: %+v %v; want a parked, b due, c leased by the other worker", st, err)
		}
		if n, err := q.Ack(ctx, first.Until, "a", "b"); err != nil || n != 0 {
			t.Fatalf("a released member is still leased: ack removed %d (%v)", n, err)
		}
		// Advance: a moves up, b (due already) and c (leased) stay.
		if n, err := q.Advance(ctx, now, "a", "b", "c", "gone"); err != nil || n != 1 {
			t.Fatalf("advanced %d (%v), want a", n, err)
		}
		st, err = q.Stats(ctx, now)
		if err != nil || st.Backlog != 2 || st.Due != 2 || st.Leased != 1 {
			t.Fatalf("after the advance: %+v %v", st, err)
		}
	})
}

func TestConnect(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb, closeFn, err := queue.Connect(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	if err := rdb.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if err := closeFn(); err != nil {
		t.Fatal(err)
	}
	_, _, err = queue.Connect(ctx, "redis://:s3cret@127.0.0.1:1/0")
	if err == nil || !strings.Contains(err.Error(), "127.0.0.1:1") || strings.Contains(err.Error(), "s3cret") {
		t.Errorf("unreachable Redis: %v", err)
	}
	if _, _, err := queue.Connect(ctx, "memcache://x"); err == nil || !strings.Contains(err.Error(), "memcache") {
		t.Errorf("unknown scheme: %v", err)
	}
	if redistest.URL() != "off" {
		if rdb, closeFn, err := queue.Connect(ctx, redistest.URL()); err == nil {
			defer closeFn()
			if err := rdb.Ping(ctx).Err(); err != nil {
				t.Error(err)
			}
		}
	}
}
