package queue_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/queue"
	"kami/queue/redistest"
)

// clusterEnv is an env on a Redis Cluster of the test's own and PostgreSQL,
// talking to the cluster through kami's own client (queue.Connect: its
// timeouts, its retries), as a kami process does.
func clusterEnv(t *testing.T) (*env, *redistest.Cluster) {
	t.Helper()
	if testing.Short() {
		t.Skip("starts a Redis Cluster")
	}
	c := redistest.StartCluster(t)
	rs := c.Server(t)
	rdb, closeRedis, err := queue.Connect(context.Background(), c.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { closeRedis() })
	rs.Client = rdb
	return newEnv(t, dbtest.Open(t, dbtest.Postgres), rs, domain.Config{}), c
}

// lockable is the product's cards the database would still lock.
func (e *env) lockable(t testing.TB, productID int64) int {
	t.Helper()
	cs, err := e.ledger.StockCounts(e.ctx, productID)
	if err != nil {
		t.Fatal(err)
	}
	return cs[productID].Lockable
}

// stall blocks the node for 3 s (DEBUG SLEEP, longer than the 2 s read
// timeout of queue.Connect), and returns once it no longer answers, with
// a func that waits until it answers again.
func stall(t *testing.T, node *redistest.Private) (wait func()) {
	t.Helper()
	admin := redis.NewClient(&redis.Options{Addr: node.Addr, ReadTimeout: -1})
	done := make(chan error, 1)
	go func() { done <- admin.Do(context.Background(), "DEBUG", "SLEEP", 3).Err() }()
	probe := redis.NewClient(&redis.Options{Addr: node.Addr, ReadTimeout: 50 * time.Millisecond, MaxRetries: -1})
	defer probe.Close()
	eventually(t, 0, "the node stalls", func() bool { return probe.Ping(context.Background()).Err() != nil })
	return func() {
		if err := <-done; err != nil {
			t.Fatalf("DEBUG SLEEP: %v", err)
		}
		admin.Close()
	}
}

// The master holding a product's stock counter stalls for longer than
// kami's read timeout while an order is placed, and again while an order
// is cancelled, three times: the cluster client sends the take or the
// give-back again, and both copies run once the master answers, yet the
// counter still equals the database's free cards.
func TestStockCounterHoldsWhenItsMasterStalls(t *testing.T) {
	e, c := clusterEnv(t)
	p := e.product(t, 50)
	if _, err := e.placeViaShop(t, p, "first@example.com"); err != nil { // builds the counter
		t.Fatal(err)
	}
	master := c.MasterOf(e.keys.Stock(p.ID))
	check := func(what string) {
		t.Helper()
		n, ok, err := e.gate.Counter(e.ctx, p.ID)
		if err != nil {
			t.Fatal(err)
		}
		if want := e.lockable(t, p.ID); ok && n != want {
			t.Fatalf("after %s the counter says %d, the database has %d free cards", what, n, want)
		}
	}
	for episode := range 3 {
		wait := stall(t, master)
		placed, err := e.placeViaShop(t, p, fmt.Sprintf("stalled%d@example.com", episode))
		wait()
		if err != nil {
			t.Fatalf("episode %d: %v", episode, err)
		}
		check(fmt.Sprintf("a take during stall %d", episode+1))
		wait = stall(t, master)
		rs, err := e.shop.CloseOrders(e.ctx, []string{placed.Order.OrderNo}, domain.CloseCancel)
		wait()
		if err != nil || rs[0].Outcome != domain.Closed {
			t.Fatalf("episode %d: cancel: %+v %v", episode, rs, err)
		}
		check(fmt.Sprintf("a give-back during stall %d", episode+1))
	}
}
