package queue_test

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"

	"kami/queue"
	"kami/queue/redistest"
)

// configure sets a server's maxmemory and maxmemory-policy.
func configure(t *testing.T, addr, maxmemory, policy string) {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr})
	defer c.Close()
	ctx := context.Background()
	if err := c.ConfigSet(ctx, "maxmemory", maxmemory).Err(); err != nil {
		t.Fatal(err)
	}
	if err := c.ConfigSet(ctx, "maxmemory-policy", policy).Err(); err != nil {
		t.Fatal(err)
	}
}

// connected is kami's client of the Redis at url, closed when the test
// ends.
func connected(t *testing.T, url string) redis.UniversalClient {
	t.Helper()
	rdb, closeRedis, err := queue.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { closeRedis() })
	return rdb
}

// TestEvictionsNameTheServersThatDropKeys: a server with a maxmemory and
// an evicting policy is reported, with both; one that never evicts (no
// maxmemory, or noeviction) is not.
func TestEvictionsNameTheServersThatDropKeys(t *testing.T) {
	t.Parallel()
	p := redistest.StartPrivate(t)
	rdb := connected(t, p.URL)
	for _, c := range []struct {
		maxmemory, policy string
		evicts            bool
	}{
		{"100mb", "volatile-lru", true},
		{"100mb", "allkeys-lfu", true},
		{"100mb", "noeviction", false},
		{"0", "allkeys-lru", false}, // no limit: never full
	} {
		configure(t, p.Addr, c.maxmemory, c.policy)
		got, err := queue.Evictions(context.Background(), rdb)
		if err != nil {
			t.Fatalf("%s %s: %v", c.maxmemory, c.policy, err)
		}
		switch {
		case !c.evicts && len(got) != 0:
			t.Errorf("maxmemory %s, %s: reported %+v", c.maxmemory, c.policy, got)
		case c.evicts && (len(got) != 1 || got[0] != queue.Eviction{Addr: p.Addr, Policy: c.policy, MaxMemory: 100 << 20}):
			t.Errorf("maxmemory %s, %s: reported %+v, want that server", c.maxmemory, c.policy, got)
		}
	}
}

// TestEvictionsReadEveryMasterOfACluster: of a cluster's three masters,
// the one set to evict is reported, by its own address.
func TestEvictionsReadEveryMasterOfACluster(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a Redis Cluster")
	}
	t.Parallel()
	c := redistest.StartCluster(t)
	rdb := connected(t, c.URL)
	evicting := c.MasterOf("{any}")
	configure(t, evicting.Addr, "100mb", "volatile-ttl")
	got, err := queue.Evictions(context.Background(), rdb)
	if err != nil {
		t.Fatal(err)
	}
	want := queue.Eviction{Addr: evicting.Addr, Policy: "volatile-ttl", MaxMemory: 100 << 20}
	if len(got) != 1 || got[0] != want {
		t.Fatalf("reported %+v, want only %+v", got, want)
	}
}

// TestEvictionsOfAServerThatRefusesConfig: a Redis that does not answer
// CONFIG GET (as a managed Redis may not) is an error, not a server that
// evicts nothing.
func TestEvictionsOfAServerThatRefusesConfig(t *testing.T) {
	t.Parallel()
	rs := redistest.Open(t, redistest.Mini) // miniredis knows no CONFIG
	rdb := redis.NewClient(&redis.Options{Addr: rs.Mini.Addr()})
	defer rdb.Close()
	if got, err := queue.Evictions(context.Background(), rdb); err == nil {
		t.Fatalf("no error from a server without CONFIG GET; reported %+v", got)
	}
}
