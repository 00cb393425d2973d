package queue_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
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

// scriptStats is how many scripts (EVALSHA) the node has run, and the
// microseconds it spent running them (INFO commandstats).
func scriptStats(t testing.TB, node *redistest.Private) (calls, usec int) {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: node.Addr, MaxRetries: -1})
	defer c.Close()
	info, err := c.Info(context.Background(), "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	_, rest, found := strings.Cut(info, "cmdstat_evalsha:")
	if !found {
		return 0, 0
	}
	line, _, _ := strings.Cut(rest, "\r\n")
	for field := range strings.SplitSeq(line, ",") {
		name, value, _ := strings.Cut(field, "=")
		switch name {
		case "calls":
			calls, err = strconv.Atoi(value)
		case "usec":
			usec, err = strconv.Atoi(value)
		}
		if err != nil {
			t.Fatalf("commandstats %q: %v", line, err)
		}
	}
	return calls, usec
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
		if !ok {
			t.Fatalf("after %s the counter is missing", what)
		}
		if want := e.lockable(t, p.ID); n != want {
			t.Fatalf("after %s the counter says %d, the database has %d free cards", what, n, want)
		}
	}
	takeCalls := 0
	for episode := range 3 {
		before, _ := scriptStats(t, master)
		wait := stall(t, master)
		placed, err := e.placeViaShop(t, p, fmt.Sprintf("stalled%d@example.com", episode))
		wait()
		if err != nil {
			t.Fatalf("episode %d: %v", episode, err)
		}
		// The order's take is the only script its master runs here: more
		// than one call is the client's resend.
		after, _ := scriptStats(t, master)
		takeCalls += after - before
		check(fmt.Sprintf("a take during stall %d", episode+1))
		wait = stall(t, master)
		rs, err := e.shop.CloseOrders(e.ctx, []string{placed.Order.OrderNo}, domain.CloseCancel)
		wait()
		if err != nil || rs[0].Outcome != domain.Closed {
			t.Fatalf("episode %d: cancel: %+v %v", episode, rs, err)
		}
		check(fmt.Sprintf("a give-back during stall %d", episode+1))
	}
	// Without a resend this test would prove nothing. Not every stall
	// makes one (a resend that needs a new connection waits in its
	// handshake, and is never sent), so one in the three is asked for.
	if takeCalls <= 3 {
		t.Fatalf("the three takes ran %d times on their stalled master: none was resent", takeCalls)
	}
	t.Logf("the three takes ran %d times on their stalled master", takeCalls)
}

// One node of a cluster given as the single address (host:port, or a
// redis:// URL) is used as the cluster: keys of every slot are served,
// none answers MOVED. A database other than 0 is refused with a message,
// since a cluster has no other.
func TestOneClusterNodeAddressUsesTheCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a Redis Cluster")
	}
	c := redistest.StartCluster(t)
	ctx := context.Background()
	for _, url := range []string{c.Nodes[1].Addr, "redis://" + c.Nodes[1].Addr + "/0"} {
		rdb, closeRedis, err := queue.Connect(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := rdb.(*redis.ClusterClient); !ok {
			t.Errorf("%s: a %T, want a cluster client", url, rdb)
		}
		for i := range 50 { // the three masters' slots
			if err := rdb.Set(ctx, fmt.Sprint("key", i), i, 0).Err(); err != nil {
				t.Fatalf("%s: SET key%d: %v", url, i, err)
			}
		}
		closeRedis()
	}
	_, _, err := queue.Connect(ctx, "redis://"+c.Nodes[1].Addr+"/3")
	if err == nil || !strings.Contains(err.Error(), "database 0") {
		t.Fatalf("a cluster node with database 3: %v, want a refusal naming database 0", err)
	}
}

// clusterEvents is an Events of its own process (its own kami client) on
// the cluster, reading statuses from db. It never polls or resyncs on a
// timer: what a subscriber hears comes from an event or from the catch-up
// after its subscription came back.
func clusterEvents(t *testing.T, c *redistest.Cluster, db *fakeLedger) *queue.Events {
	t.Helper()
	rdb, closeRedis, err := queue.Connect(context.Background(), c.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { closeRedis() })
	ev := queue.NewEvents(rdb, queue.NewKeys("kami-cluster-events:"), quietLogger())
	ev.Statuses, ev.PollInterval, ev.ResyncInterval = db.Statuses, time.Hour, time.Hour
	closeAtEnd(t, ev)
	return ev
}

// Subscribers in one process hear every order paid in another while the
// cluster fails over: first the master of other slots dies (the
// publisher's events sent to it fail and are sent again), then the master
// holding the subscription itself (it subscribes again and reads the
// orders from the database). No subscription ends, and each hears PAID.
func TestSubscriptionsHearEveryStatusThroughAFailover(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a Redis Cluster")
	}
	c := redistest.StartCluster(t)
	db := &fakeLedger{statuses: map[string]domain.OrderStatus{}}
	pub, sub := clusterEvents(t, c, db), clusterEvents(t, c, db)
	subMaster := c.MasterOf(queue.NewKeys("kami-cluster-events:").OrderChannelPattern())
	var other *redistest.Private
	for _, n := range c.Nodes[:3] {
		if n != subMaster {
			other = n
			break
		}
	}
	for phase, victim := range []*redistest.Private{other, subMaster} {
		var chans []<-chan domain.OrderStatus
		var nos []string
		// Many: go-redis sends a failed PUBLISH again to random nodes,
		// so only some of them fail on every try.
		for i := range 300 {
			no := fmt.Sprintf("P%dO%03d", phase, i)
			db.set(no, domain.OrderPending)
			ch, stop := sub.Subscribe(t.Context(), no)
			t.Cleanup(stop)
			chans, nos = append(chans, ch), append(nos, no)
		}
		eventually(t, 0, "the subscription confirmed", sub.SubscriptionUp)
		victim.Stop()
		for _, no := range nos { // paid while the cluster fails over
			db.set(no, domain.OrderPaid)
			pub.OrderChanged(t.Context(), no, domain.OrderPaid)
		}
		c.WaitOK()
		for _, ch := range chans {
			waitFor(t, ch, domain.OrderPaid)
		}
	}
}
