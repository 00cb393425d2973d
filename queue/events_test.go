package queue_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"kami/domain"
	"kami/queue"
	"kami/queue/redistest"
)

// fakeLedger stands for the database the subscribers catch up from.
type fakeLedger struct {
	mu       sync.Mutex
	statuses map[string]domain.OrderStatus
	reads    int
}

func (f *fakeLedger) set(no string, s domain.OrderStatus) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.statuses[no] = s
}

func (f *fakeLedger) readCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.reads
}

func (f *fakeLedger) Statuses(_ context.Context, nos []string) (map[string]domain.OrderStatus, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reads++
	out := map[string]domain.OrderStatus{}
	for _, no := range nos {
		if s, ok := f.statuses[no]; ok {
			out[no] = s
		}
	}
	return out, nil
}

func privateEvents(t *testing.T, r *redistest.Private, db *fakeLedger, poll time.Duration) (*queue.Events, redis.UniversalClient) {
	t.Helper()
	rdb, closeRedis, err := queue.Connect(t.Context(), r.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { closeRedis() })
	ev := queue.NewEvents(rdb, queue.NewKeys("kami-events-test:"), quietLogger())
	ev.Statuses, ev.PollInterval, ev.ResyncInterval = db.Statuses, poll, time.Hour
	closeAtEnd(t, ev)
	return ev, rdb
}

// closeAtEnd closes ev when the test ends, with a bound for a hang.
func closeAtEnd(t testing.TB, ev *queue.Events) {
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		ev.Close(ctx)
	})
}

// silentRedis accepts connections and never answers on them: a Redis that
// hangs (a black-holed master, a stalled node), closed when the test ends.
func silentRedis(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			go io.Copy(io.Discard, c)
		}
	}()
	return ln.Addr().String()
}

// TestEventsCloseHonoursItsDeadline: 3,000 events wait to be published to
// a Redis that never answers; Close returns once its context ends, and the
// events it leaves are counted as dropped. Before, Close waited until the
// buffer was empty: a shutdown hung as long as Redis did.
func TestEventsCloseHonoursItsDeadline(t *testing.T) {
	t.Parallel()
	rdb := redis.NewClient(&redis.Options{Addr: silentRedis(t), ReadTimeout: -1, WriteTimeout: -1, MaxRetries: -1})
	t.Cleanup(func() { rdb.Close() })
	ev := queue.NewEvents(rdb, queue.NewKeys("kami-events-test:"), quietLogger())
	for i := range 3000 {
		ev.OrderChanged(t.Context(), fmt.Sprintf("O%04d", i), domain.OrderPaid)
	}
	ctx, cancel := context.WithCancel(context.Background())
	closed := make(chan struct{})
	go func() { ev.Close(ctx); close(closed) }()
	cancel() // the shutdown's deadline has come
	select {
	case <-closed:
	case <-time.After(30 * time.Second): // a bound for a hang, never a speed
		t.Fatal("Close did not return after its context ended")
	}
	if n := ev.Dropped(); n != 3000 {
		t.Fatalf("dropped %d events, want the 3000 never published", n)
	}
}

// waitFor reads ch until it yields want.
func waitFor(t *testing.T, ch <-chan domain.OrderStatus, want domain.OrderStatus) {
	t.Helper()
	timeout := time.After(30 * time.Second)
	for {
		select {
		case s, ok := <-ch:
			if !ok {
				t.Fatalf("the subscription ended before %s", want)
			}
			if s == want {
				return
			}
		case <-timeout:
			t.Fatalf("no %s", want)
		}
	}
}

// TestEventsShareOneRedisConnection: 300 subscriptions (the count one
// WebSocket opened in the attack) use as many Redis clients as one does,
// and each still hears its own order.
func TestEventsShareOneRedisConnection(t *testing.T) {
	t.Parallel()
	r := redistest.StartPrivate(t)
	db := &fakeLedger{statuses: map[string]domain.OrderStatus{}}
	ev, _ := privateEvents(t, r, db, time.Hour)
	subscribe := func(from, to int) {
		var subs []<-chan domain.OrderStatus
		for i := from; i < to; i++ {
			ch, stop := ev.Subscribe(t.Context(), fmt.Sprintf("O%03d", i))
			t.Cleanup(stop)
			subs = append(subs, ch)
		}
		eventually(t, 10*time.Second, "the shared subscription is up", ev.SubscriptionUp)
		for i := from; i < to; i++ {
			ev.OrderChanged(t.Context(), fmt.Sprintf("O%03d", i), domain.OrderPaid)
		}
		for _, ch := range subs {
			waitFor(t, ch, domain.OrderPaid)
		}
	}
	subscribe(0, 1)
	one := r.Clients()
	subscribe(1, 300)
	if many := r.Clients(); many > one {
		t.Fatalf("Redis clients: %d with one subscription, %d with 300", one, many)
	}
	t.Logf("Redis clients: %d with one subscription and with 300", one)
}

// TestEventsSurviveARedisRestart: while Redis is away the subscribers
// catch up from the database every PollInterval; once it is back the
// shared subscription is made again, they catch up at once, and events
// flow on it again.
func TestEventsSurviveARedisRestart(t *testing.T) {
	t.Parallel()
	r := redistest.StartPrivate(t)
	db := &fakeLedger{statuses: map[string]domain.OrderStatus{"A": domain.OrderPending, "B": domain.OrderPending, "C": domain.OrderPending}}
	ev, _ := privateEvents(t, r, db, 50*time.Millisecond)
	a, stopA := ev.Subscribe(t.Context(), "A")
	defer stopA()
	eventually(t, 10*time.Second, "the shared subscription is up", ev.SubscriptionUp)
	first := ev.Resubscribed()

	r.Stop()
	eventually(t, 30*time.Second, "the subscription noticed Redis is gone", func() bool { return !ev.SubscriptionUp() })
	db.set("A", domain.OrderPaid) // its event was lost with Redis
	waitFor(t, a, domain.OrderPaid)

	r.Start()
	eventually(t, 30*time.Second, "the shared subscription is made again", func() bool {
		return ev.SubscriptionUp() && ev.Resubscribed() > first
	})
	b, stopB := ev.Subscribe(t.Context(), "B")
	defer stopB()
	ev.OrderChanged(t.Context(), "B", domain.OrderClosed) // through Redis: the database still says PENDING
	waitFor(t, b, domain.OrderClosed)
}

// TestEventsCatchUpOnReconnect: a change made while Redis was away reaches
// its subscriber when the subscription comes back, even with no polling in
// between.
func TestEventsCatchUpOnReconnect(t *testing.T) {
	t.Parallel()
	r := redistest.StartPrivate(t)
	db := &fakeLedger{statuses: map[string]domain.OrderStatus{"A": domain.OrderPending}}
	ev, _ := privateEvents(t, r, db, time.Hour)
	a, stop := ev.Subscribe(t.Context(), "A")
	defer stop()
	eventually(t, 10*time.Second, "the shared subscription is up", ev.SubscriptionUp)
	first := ev.Resubscribed()
	reads := db.readCount()
	r.Stop()
	eventually(t, 30*time.Second, "the subscription noticed Redis is gone", func() bool { return !ev.SubscriptionUp() })
	// Going down, the subscribers caught up once; the change comes after.
	eventually(t, 10*time.Second, "the catch-up as Redis went", func() bool { return db.readCount() > reads })
	db.set("A", domain.OrderPaid)
	r.Start()
	eventually(t, 30*time.Second, "the shared subscription is made again", func() bool { return ev.Resubscribed() > first })
	waitFor(t, a, domain.OrderPaid)
}

// TestEventsSubscriberEndsOnlyWithItsContext: a closed channel means the
// subscriber left, never that the stream broke.
func TestEventsSubscriberEndsOnlyWithItsContext(t *testing.T) {
	t.Parallel()
	r := redistest.StartPrivate(t)
	db := &fakeLedger{statuses: map[string]domain.OrderStatus{}}
	ev, _ := privateEvents(t, r, db, time.Hour)
	ctx, cancel := context.WithCancel(t.Context())
	ch, _ := ev.Subscribe(ctx, "A")
	eventually(t, 10*time.Second, "the shared subscription is up", ev.SubscriptionUp)
	r.Stop()
	eventually(t, 30*time.Second, "the subscription noticed Redis is gone", func() bool { return !ev.SubscriptionUp() })
	select {
	case _, ok := <-ch:
		if !ok {
			t.Fatal("the channel closed when Redis went away")
		}
	default:
	}
	cancel()
	for range ch { // closed once the context ended
	}
}
