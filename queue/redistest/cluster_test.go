package redistest_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"kami/queue/redistest"
)

// The test cluster serves keys of every slot through a cluster client, and
// after its master of a key is killed, a replica takes over the key's slot
// and the cluster is ok again with the key still there.
func TestClusterServesAndFailsOver(t *testing.T) {
	if testing.Short() {
		t.Skip("starts six redis-servers")
	}
	start := time.Now()
	c := redistest.StartCluster(t)
	t.Logf("the cluster was ok %s after its start", time.Since(start))
	rdb := c.NewClient(t)
	ctx := context.Background()
	for i := range 100 {
		if err := rdb.Set(ctx, fmt.Sprint("k", i), i, 0).Err(); err != nil {
			t.Fatal(err)
		}
	}
	// Wait for k7 to reach the replica: a failover loses what the
	// replica has not got yet. WAIT counts the writes of its own
	// connection.
	m := c.MasterOf("k7")
	conn := redis.NewClient(&redis.Options{Addr: m.Addr}).Conn()
	defer conn.Close()
	if err := conn.Set(ctx, "k7", 7, 0).Err(); err != nil {
		t.Fatal(err)
	}
	if n, err := conn.Do(ctx, "WAIT", 1, 0).Int(); err != nil || n != 1 {
		t.Fatalf("WAIT: %d %v", n, err)
	}
	m.Stop()
	killed := time.Now()
	c.WaitOK()
	t.Logf("the cluster was ok again %s after its master of k7 was killed", time.Since(killed))
	if n := c.MasterOf("k7"); n == m {
		t.Fatalf("the killed node %s is still the master of k7", m.Addr)
	}
	rdb.ReloadState(ctx)
	var v int
	for deadline := time.Now().Add(time.Minute); ; {
		var err error
		if v, err = rdb.Get(ctx, "k7").Int(); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("GET k7 after the failover: %v", err)
		}
	}
	if v != 7 {
		t.Fatalf("k7 = %d after the failover, want 7", v)
	}
}
