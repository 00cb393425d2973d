package queue

import (
	"context"
	"net"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"kami/domain/domaintest"
	"kami/queue/redistest"
)

// TestClusterClientFindsTheNewMasterAfterAFailure: the master holding a key
// is killed and its replica takes over; the first command that fails on the
// dead master makes kami's cluster client look at the layout again, so
// the key is served by the new master without waiting for the periodic
// reload (turned off here: an hour). Before, go-redis looked again only on
// a MOVED, which a dead master cannot answer, or after a minute.
func TestClusterClientFindsTheNewMasterAfterAFailure(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a Redis Cluster")
	}
	defer func(d time.Duration) { clusterReloadEvery = d }(clusterReloadEvery)
	clusterReloadEvery = time.Hour
	c := redistest.StartCluster(t)
	rdb, closeRedis, err := Connect(context.Background(), c.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer closeRedis()
	ctx := context.Background()
	const key = "{failover}"
	if err := rdb.Set(ctx, key, 1, 0).Err(); err != nil {
		t.Fatal(err)
	}
	old := c.MasterOf(key)
	old.Stop()
	c.WaitOK()
	fresh := c.MasterOf(key)
	failures := 0
	domaintest.Eventually(t, 0, "the key served by its new master", func() bool {
		if err := rdb.Get(ctx, key).Err(); err != nil && err != redis.Nil {
			failures++
			return false
		}
		return true
	})
	m, err := rdb.(*redis.ClusterClient).MasterForKey(ctx, key)
	if err != nil || m.Options().Addr != fresh.Addr {
		t.Fatalf("the client's master of the key: %v %v, want %s", m, err, fresh.Addr)
	}
	t.Logf("%d commands failed after the cluster was ok again", failures)
}

// TestDialTimeoutIsALayoutChange: a dial that times out (a master whose
// packets are dropped: the connect never completes) makes the cluster
// client reload the layout at once, as a refused connection does; the
// caller's own deadline does not. Before, the dial timeout matched
// context.DeadlineExceeded and was taken for the caller giving up.
func TestDialTimeoutIsALayoutChange(t *testing.T) {
	t.Parallel()
	// The connect never completes: it waits for the dial's own deadline.
	d := &net.Dialer{Timeout: 50 * time.Millisecond, ControlContext: func(ctx context.Context, _, _ string, _ syscall.RawConn) error {
		<-ctx.Done()
		return ctx.Err()
	}}
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379", MaxRetries: -1,
		Dialer: func(ctx context.Context, network, addr string) (net.Conn, error) {
			return d.DialContext(ctx, network, addr)
		}})
	defer c.Close()
	ctx := context.Background()
	err := c.Ping(ctx).Err()
	if err == nil {
		t.Fatal("a dial that never connects succeeded")
	}
	if !layoutMayHaveChanged(ctx, err) {
		t.Errorf("dial timeout %v: not taken as a layout change", err)
	}
	gone, cancel := context.WithCancel(ctx)
	cancel()
	if layoutMayHaveChanged(gone, err) {
		t.Errorf("dial timeout %v of a caller who gave up: taken as a layout change", err)
	}
	if layoutMayHaveChanged(gone, context.DeadlineExceeded) || layoutMayHaveChanged(ctx, context.Canceled) {
		t.Error("the caller giving up taken as a layout change")
	}
}

// TestInProcessRedisExpiresKeys: a key with a TTL in the in-process Redis
// of `go run .` (KAMI_REDIS_URL unset) is gone once its time has passed.
// miniredis expires keys only when told that time passed: before, a key
// whose TTL nothing touched again (a product's operations set once it
// stopped selling, a lock, a kept-aside give-back) stayed for the life of
// the process.
func TestInProcessRedisExpiresKeys(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb, closeRedis, err := Connect(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	defer closeRedis()
	keys := NewKeys("t:")
	g := newStockGate(rdb, keys, countsOf(map[int64]int{7: 10}))
	if _, err := g.rebuild(ctx, 7, false); err != nil {
		t.Fatal(err)
	}
	if r, err := g.take(ctx, 7, 1, "order-1"); err != nil || r != 1 {
		t.Fatalf("take: %d %v", r, err)
	}
	// The operations set, as if its minute were nearly over.
	if err := rdb.PExpire(ctx, keys.StockOps(7), time.Millisecond).Err(); err != nil {
		t.Fatal(err)
	}
	domaintest.Eventually(t, 0, "the operations set expired", func() bool {
		n, err := rdb.Exists(ctx, keys.StockOps(7)).Result()
		return err == nil && n == 0
	})
}

// TestAFailedDialIsNotRetried: a command kami sends to a Redis it cannot
// reach dials once and fails, on a single server and on a cluster, whether
// the connection is refused or its packets are dropped (the dial waits out
// its DialTimeout). go-redis dials five times by default, 100 ms apart:
// against a server whose packets are dropped that held each caller for five
// dial timeouts (about ten seconds) before the stock gate could answer
// UNAVAILABLE.
func TestAFailedDialIsNotRetried(t *testing.T) {
	t.Parallel()
	gone := refusingAddr(t)
	var dials atomic.Int64
	refused := func(ctx context.Context, network, addr string) (net.Conn, error) {
		dials.Add(1)
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}
	dropped := func(ctx context.Context, network, addr string) (net.Conn, error) {
		dials.Add(1)
		<-ctx.Done() // no answer ever comes: the attempt's own deadline ends it
		return nil, &net.OpError{Op: "dial", Net: network, Err: ctx.Err()}
	}
	seeded := clusterOptions(withTimeouts(&redis.Options{Addr: gone}))
	seeded.Dialer = refused
	clients := map[string]func() redis.UniversalClient{
		"single server": func() redis.UniversalClient {
			return redis.NewClient(withTimeouts(&redis.Options{Addr: gone, Dialer: refused}))
		},
		"single server, packets dropped": func() redis.UniversalClient {
			return redis.NewClient(withTimeouts(&redis.Options{Addr: gone, Dialer: dropped, DialTimeout: 50 * time.Millisecond}))
		},
		"cluster": func() redis.UniversalClient {
			return newClusterClient(&redis.ClusterOptions{Addrs: []string{gone}, Dialer: refused})
		},
		"cluster, packets dropped": func() redis.UniversalClient {
			return newClusterClient(&redis.ClusterOptions{Addrs: []string{gone}, Dialer: dropped, DialTimeout: 50 * time.Millisecond})
		},
		"cluster seeded by one server's options": func() redis.UniversalClient { return newClusterClient(seeded) },
	}
	for name, open := range clients {
		dials.Store(0)
		c := open()
		err := c.Ping(context.Background()).Err()
		c.Close()
		if err == nil {
			t.Fatalf("%s: a ping to %s, where nothing listens, succeeded", name, gone)
		}
		if n := dials.Load(); n != 1 {
			t.Errorf("%s: %d dials for one command, want 1 (%v)", name, n, err)
		}
	}
}

// refusingAddr is an address on this machine where nothing listens, so
// every dial to it is refused at once.
func refusingAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}
