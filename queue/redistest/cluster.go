package redistest

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// Cluster is a Redis Cluster of the test's own: three masters, each with one
// replica, started from the machine's redis-server on free ports, nothing
// kept on disk, killed when the test ends. A node can be killed (SIGKILL)
// to make its replica take over, as in a real failover.
type Cluster struct {
	t testing.TB
	// Nodes are the six servers: Nodes[i] (i < 3) a master, Nodes[i+3] its
	// replica, as started; after a failover the roles may have changed.
	Nodes []*Private
	// URL is the node list as KAMI_REDIS_URL takes it: host:port,host:port,…
	URL string
}

// ClusterNodeTimeout is the cluster's cluster-node-timeout: how long a
// master may be unreachable before its replica takes over. Short, so a
// failover test waits seconds, not the default 15 s; longer than the
// 3 s stall of a test (DEBUG SLEEP) that must not make a failover.
const ClusterNodeTimeout = 4 * time.Second

// StartCluster starts a 3-master, 3-replica Redis Cluster for the test and
// waits until every node reports cluster_state:ok and every master has its
// replica in sync. It skips the test when the machine has no redis-server,
// unless KAMI_TEST_REQUIRE_SERVICES=1.
func StartCluster(t testing.TB) *Cluster {
	t.Helper()
	needServer(t)
	c := &Cluster{t: t}
	var addrs []string
	for range 6 {
		n := startPrivate(t, true, "--cluster-enabled", "yes",
			"--cluster-node-timeout", strconv.FormatInt(ClusterNodeTimeout.Milliseconds(), 10),
			// A replica takes over however long ago it last heard its
			// master: in a test the master was killed a moment ago.
			"--cluster-replica-validity-factor", "0",
			// A replica's first sync starts at once, not after the 5 s
			// redis-server waits for more replicas to share it.
			"--repl-diskless-sync-delay", "0",
			// DEBUG SLEEP stalls a node, as a busy or swapping master does.
			"--enable-debug-command", "local")
		c.Nodes = append(c.Nodes, n)
		addrs = append(addrs, n.Addr)
	}
	c.URL = strings.Join(addrs, ",")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute) // a start on a busy machine
	defer cancel()
	if err := c.create(ctx); err != nil {
		t.Fatalf("redistest: cannot create the Redis Cluster: %v", err)
	}
	c.WaitOK()
	return c
}

// create assigns the slots to the three masters (in three equal ranges),
// joins the nodes and makes each of the last three the replica of one
// master, as redis-cli --cluster create does.
func (c *Cluster) create(ctx context.Context) error {
	ids := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		cl := n.client()
		defer cl.Close()
		id, err := cl.ClusterMyID(ctx).Result()
		if err != nil {
			return err
		}
		ids[i] = id
		if i < 3 {
			lo, hi := i*16384/3, (i+1)*16384/3-1
			if err := cl.ClusterAddSlotsRange(ctx, lo, hi).Err(); err != nil {
				return fmt.Errorf("ADDSLOTSRANGE on %s: %w", n.Addr, err)
			}
			// Distinct epochs, so the masters need not settle a
			// collision before the cluster is ok.
			if err := cl.Do(ctx, "CLUSTER", "SET-CONFIG-EPOCH", i+1).Err(); err != nil {
				return fmt.Errorf("SET-CONFIG-EPOCH on %s: %w", n.Addr, err)
			}
		}
	}
	// Every node meets the first; a replica meets its master too, so it
	// knows it at once rather than through the gossip.
	for i, n := range c.Nodes[1:] {
		cl := n.client()
		defer cl.Close()
		peers := []int{0}
		if i+1 >= 3 {
			peers = append(peers, i+1-3)
		}
		for _, p := range peers {
			host, port, _ := net.SplitHostPort(c.Nodes[p].Addr)
			if err := cl.Do(ctx, "CLUSTER", "MEET", host, port, c.Nodes[p].busPort).Err(); err != nil {
				return fmt.Errorf("MEET %s: %w", c.Nodes[p].Addr, err)
			}
		}
	}
	for i, n := range c.Nodes[3:] {
		cl := n.client()
		defer cl.Close()
		// The replica must know its master before it can follow it: wait
		// for the gossip of the MEETs to reach it.
		for {
			err := cl.ClusterReplicate(ctx, ids[i]).Err()
			if err == nil {
				break
			}
			if ctx.Err() != nil {
				return fmt.Errorf("REPLICATE %s on %s: %w", ids[i], n.Addr, err)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	return nil
}

// WaitOK waits until every running node reports cluster_state:ok and knows
// every slot's master as one that is running, and every running master has
// a replica in sync: the state after a start, and after a failover has
// finished.
func (c *Cluster) WaitOK() {
	c.t.Helper()
	start := time.Now()
	deadline := start.Add(2 * time.Minute) // a failover on a busy machine
	nudged := start
	for {
		why := c.notOK()
		if why == "" {
			return
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("redistest: the Redis Cluster is not ok: %s", why)
		}
		// On a starved machine the election can miss its window again and
		// again (the masters' votes arrive late). What the tests look at
		// is kami after a failover, not Redis's election: past a few node
		// timeouts, tell the dead master's replica to take over.
		if time.Since(nudged) > 5*ClusterNodeTimeout {
			c.takeOverDeadMasters()
			nudged = time.Now()
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// takeOverDeadMasters sends CLUSTER FAILOVER TAKEOVER to every running
// replica whose master is not running.
func (c *Cluster) takeOverDeadMasters() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	running := c.running()
	for _, n := range c.Nodes {
		if !running[n.Addr] {
			continue
		}
		cl := n.client()
		repl, err := cl.Info(ctx, "replication").Result()
		if err == nil && strings.Contains(repl, "role:slave") {
			host, port := field(repl, "master_host"), field(repl, "master_port")
			if !running[net.JoinHostPort(host, port)] {
				c.t.Logf("redistest: %s's master %s:%s is down and no failover happened: CLUSTER FAILOVER TAKEOVER", n.Addr, host, port)
				_ = cl.Do(ctx, "CLUSTER", "FAILOVER", "TAKEOVER").Err()
			}
		}
		cl.Close()
	}
}

// running is the addresses of the nodes that are running.
func (c *Cluster) running() map[string]bool {
	running := map[string]bool{}
	for _, n := range c.Nodes {
		if n.Running() {
			running[n.Addr] = true
		}
	}
	return running
}

// field is the value of name in an INFO answer ("" when absent).
func field(info, name string) string {
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), name+":"); ok {
			return v
		}
	}
	return ""
}

// notOK says why the cluster is not ok yet ("" when it is).
func (c *Cluster) notOK() string {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	running := c.running()
	allRunning := len(running) == len(c.Nodes)
	synced := 0
	for _, n := range c.Nodes {
		if !running[n.Addr] {
			continue
		}
		cl := n.client()
		defer cl.Close()
		info, err := cl.ClusterInfo(ctx).Result()
		if err != nil {
			return fmt.Sprintf("%s: CLUSTER INFO: %v", n.Addr, err)
		}
		if !strings.Contains(info, "cluster_state:ok") {
			return n.Addr + " reports a cluster state other than ok"
		}
		slots, err := masters(ctx, cl)
		if err != nil {
			return fmt.Sprintf("%s: CLUSTER SHARDS: %v", n.Addr, err)
		}
		covered := 0
		for _, s := range slots {
			if !running[s.master] {
				return fmt.Sprintf("%s names a master that is not running for slots %d-%d", n.Addr, s.start, s.end)
			}
			covered += int(s.end - s.start + 1)
		}
		if covered != 16384 {
			return fmt.Sprintf("%s knows masters for %d of 16384 slots", n.Addr, covered)
		}
		repl, err := cl.Info(ctx, "replication").Result()
		if err != nil {
			return fmt.Sprintf("%s: INFO replication: %v", n.Addr, err)
		}
		if strings.Contains(repl, "role:slave") {
			if !strings.Contains(repl, "master_link_status:up") {
				return n.Addr + ": a replica not in sync with its master yet"
			}
			synced++
		}
	}
	if allRunning && synced < 3 {
		return fmt.Sprintf("%d of 3 replicas in sync", synced)
	}
	return ""
}

// MasterOf is the node that is the master of key's slot now, as the
// running nodes see it.
func (c *Cluster) MasterOf(key string) *Private {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, n := range c.Nodes {
		if !n.Running() {
			continue
		}
		cl := n.client()
		defer cl.Close()
		slot, err := cl.ClusterKeySlot(ctx, key).Result()
		if err != nil {
			continue
		}
		slots, err := masters(ctx, cl)
		if err != nil {
			continue
		}
		for _, s := range slots {
			if s.start <= slot && slot <= s.end {
				for _, m := range c.Nodes {
					if m.Addr == s.master {
						return m
					}
				}
			}
		}
	}
	c.t.Fatalf("redistest: no running node knows the master of %q", key)
	return nil
}

// NewClient opens a cluster client to the nodes, with a test client's
// patience (see Server.NewClient), closed when the test ends.
func (c *Cluster) NewClient(t testing.TB) *redis.ClusterClient {
	t.Helper()
	var addrs []string
	for _, n := range c.Nodes {
		addrs = append(addrs, n.Addr)
	}
	cl := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs, DialTimeout: 10 * time.Second,
		ReadTimeout: -1, WriteTimeout: -1, MaxRetries: -1, PoolTimeout: 5 * time.Minute})
	t.Cleanup(func() { cl.Close() })
	return cl
}

// Server is the cluster as a Server of kind RealCluster.
func (c *Cluster) Server(t testing.TB) *Server {
	return &Server{Kind: RealCluster, URL: c.URL, Cluster: c, Client: c.NewClient(t)}
}

// slotMaster is a range of slots and the address of its master.
type slotMaster struct {
	start, end int64
	master     string
}

// masters is the slot ranges and their masters, as the node cl speaks to
// sees them: a master it holds failed has no range.
func masters(ctx context.Context, cl *redis.Client) ([]slotMaster, error) {
	shards, err := cl.ClusterShards(ctx).Result()
	if err != nil {
		return nil, err
	}
	var out []slotMaster
	for _, sh := range shards {
		for _, n := range sh.Nodes {
			if n.Role != "master" || n.Health != "online" {
				continue
			}
			for _, r := range sh.Slots {
				out = append(out, slotMaster{start: r.Start, end: r.End, master: net.JoinHostPort(n.IP, strconv.FormatInt(n.Port, 10))})
			}
		}
	}
	return out, nil
}
