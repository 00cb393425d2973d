package queue_test

import (
	"context"
	"slices"
	"strings"
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

// TestEvictionsReadEveryMasterOfACluster: each master of a cluster set to
// evict is reported, by its own address and policy; a master that refuses
// CONFIG GET is an error, returned with what the others answered.
func TestEvictionsReadEveryMasterOfACluster(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a Redis Cluster")
	}
	t.Parallel()
	c := redistest.StartCluster(t)
	rdb := connected(t, c.URL)
	// Nodes[0] to Nodes[2] are the masters.
	configure(t, c.Nodes[0].Addr, "100mb", "volatile-ttl")
	configure(t, c.Nodes[1].Addr, "50mb", "allkeys-lru")
	want := []queue.Eviction{{Addr: c.Nodes[0].Addr, Policy: "volatile-ttl", MaxMemory: 100 << 20},
		{Addr: c.Nodes[1].Addr, Policy: "allkeys-lru", MaxMemory: 50 << 20}}
	slices.SortFunc(want, func(a, b queue.Eviction) int { return strings.Compare(a.Addr, b.Addr) })
	got, err := queue.Evictions(context.Background(), rdb)
	if err != nil || !slices.Equal(got, want) {
		t.Fatalf("reported %+v (%v), want %+v", got, err, want)
	}
	refuseConfig(t, c.Nodes[2].Addr)
	got, err = queue.Evictions(context.Background(), rdb)
	if err == nil || !strings.Contains(err.Error(), c.Nodes[2].Addr) || !slices.Equal(got, want) {
		t.Fatalf("with %s refusing CONFIG: reported %+v (%v), want %+v and an error naming it", c.Nodes[2].Addr, got, err, want)
	}
}

// refuseConfig makes the server at addr refuse CONFIG to its default user,
// as a managed Redis does.
func refuseConfig(t *testing.T, addr string) {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr})
	defer c.Close()
	if err := c.Do(context.Background(), "ACL", "SETUSER", "default", "-config").Err(); err != nil {
		t.Fatal(err)
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
