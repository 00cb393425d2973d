package redistest

import (
	"context"
	"fmt"
	"net"
	"slices"
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
// waits until it is ok (see WaitOK): every node knows every other, reports
// cluster_state:ok, and every master has its replica in sync. It skips the
// test when the machine has no redis-server, unless
// KAMI_TEST_REQUIRE_SERVICES=1.
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

// WaitOK waits until every running node knows every other, reports
// cluster_state:ok and knows every slot's master as one that is running,
// and every running master has a replica in sync: the state after a start,
// and after a failover has finished. When it is not, the test fails with what every running node
// says of the cluster.
func (c *Cluster) WaitOK() {
	c.t.Helper()
	if err := c.waitOK(2 * time.Minute); err != nil { // a failover on a busy machine
		c.t.Fatalf("redistest: %v", err)
	}
}

// failoverOverdue is how long WaitOK leaves a failover to Redis's election
// before it helps: the dead master's FAIL takes a node timeout and its
// gossip, the election half a second to a second, and a vote missed on a
// starved machine another node timeout or two.
const failoverOverdue = 3 * ClusterNodeTimeout

// waitOK is WaitOK with its patience: the error says why the cluster is
// not ok once patience has passed, with every running node's view.
func (c *Cluster) waitOK(patience time.Duration) error {
	start := time.Now()
	var helped time.Time
	helps := 0
	for {
		views := c.survey()
		why := notOK(views, c.running())
		if why == "" {
			if helps > 0 {
				c.t.Logf("redistest: the Redis Cluster was ok %s after the wait began, helped %d times", time.Since(start).Round(time.Millisecond), helps)
			}
			return nil
		}
		if time.Since(start) >= patience {
			return fmt.Errorf("the Redis Cluster is not ok %s after the wait began: %s\n%s", time.Since(start).Round(time.Millisecond), why, c.describe(views))
		}
		// On a starved machine the election can miss its window again and
		// again (the masters' votes arrive late). What the tests look at
		// is kami after a failover, not Redis's election: once it is
		// overdue, help it, again every node timeout while it is not ok.
		if time.Since(start) > failoverOverdue && time.Since(helped) > ClusterNodeTimeout {
			if helps == 0 {
				c.t.Logf("redistest: the Redis Cluster is not ok %s after the wait began (%s); helping it:\n%s", time.Since(start).Round(time.Millisecond), why, c.describe(views))
			}
			c.help(views)
			helped = time.Now()
			helps++
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// nodeView is what one running node says of the cluster.
type nodeView struct {
	n *Private
	// err: the node did not answer (the rest is what it answered before).
	err error
	// info is its CLUSTER INFO, repl its INFO replication.
	info, repl string
	// nodes is its CLUSTER NODES, one entry for every node it knows.
	nodes []nodeLine
}

// nodeLine is one line of CLUSTER NODES: how a node sees one node.
type nodeLine struct {
	id, addr string   // addr: host:port, without the bus port
	flags    []string // myself, master, slave, fail?, fail, handshake, noaddr…
	epoch    string   // its config epoch
	link     string   // connected or disconnected
	slots    []string // its slot ranges, "0-5460" or "42"
}

func (l nodeLine) is(flag string) bool { return slices.Contains(l.flags, flag) }

// survey asks every running node what it says of the cluster, each
// command with its own deadline: a starved node answers late.
func (c *Cluster) survey() []nodeView {
	var views []nodeView
	for _, n := range c.Nodes {
		if n.Running() {
			views = append(views, view(n))
		}
	}
	return views
}

// view asks n what it says of the cluster.
func view(n *Private) nodeView {
	v := nodeView{n: n}
	v.info, v.err = command(n, "CLUSTER", "INFO")
	if v.err == nil {
		var nodes string
		nodes, v.err = command(n, "CLUSTER", "NODES")
		v.nodes = parseClusterNodes(nodes)
	}
	if v.err == nil {
		v.repl, v.err = command(n, "INFO", "replication")
	}
	return v
}

// parseClusterNodes reads CLUSTER NODES: id addr flags master ping-sent
// pong-recv config-epoch link-state slot…
func parseClusterNodes(s string) []nodeLine {
	var out []nodeLine
	for _, line := range strings.Split(strings.TrimSpace(s), "\n") {
		f := strings.Fields(line)
		if len(f) < 8 {
			continue
		}
		addr, _, _ := strings.Cut(f[1], "@")
		l := nodeLine{id: f[0], addr: addr, flags: strings.Split(f[2], ","), epoch: f[6], link: f[7]}
		for _, r := range f[8:] {
			if !strings.HasPrefix(r, "[") { // [slot->-id]: a slot migrating
				l.slots = append(l.slots, r)
			}
		}
		out = append(out, l)
	}
	return out
}

// masters is the slot ranges and their masters, as v sees them: a master
// it holds failed (FAIL) has no range.
func (v nodeView) masters() []slotMaster {
	var out []slotMaster
	for _, l := range v.nodes {
		if !l.is("master") || l.is("fail") {
			continue
		}
		for _, r := range ranges(l.slots) {
			out = append(out, slotMaster{start: r[0], end: r[1], master: l.addr})
		}
	}
	return out
}

// notOK says why the cluster is not ok yet, by the running nodes' views
// ("" when it is).
func notOK(views []nodeView, running map[string]bool) string {
	for _, v := range views {
		if v.err != nil {
			return fmt.Sprintf("%s does not answer: %v", v.n.Addr, v.err)
		}
	}
	if u := unknown(views); len(u) > 0 {
		return fmt.Sprintf("%s does not know %s, a running node of the cluster", u[0].viewer.n.Addr, u[0].stranger.n.Addr)
	}
	synced := 0
	for _, v := range views {
		if field(v.info, "cluster_state") != "ok" {
			return v.n.Addr + " reports a cluster state other than ok"
		}
		covered := 0
		for _, s := range v.masters() {
			if !running[s.master] {
				return fmt.Sprintf("%s names a master that is not running for slots %d-%d", v.n.Addr, s.start, s.end)
			}
			covered += int(s.end - s.start + 1)
		}
		if covered != 16384 {
			return fmt.Sprintf("%s knows masters for %d of 16384 slots", v.n.Addr, covered)
		}
		if field(v.repl, "role") == "slave" {
			if field(v.repl, "master_link_status") != "up" {
				return v.n.Addr + ": a replica not in sync with its master yet"
			}
			synced++
		}
	}
	if len(running) == 6 && synced < 3 {
		return fmt.Sprintf("%d of 3 replicas in sync", synced)
	}
	return ""
}

// describe is what every running node says of the cluster: its state,
// epoch and role, and every node it knows, with the flags it holds for it
// (fail? a node it cannot reach, fail a node the majority of masters
// agreed is down), its epoch, link and slots.
func (c *Cluster) describe(views []nodeView) string {
	var b strings.Builder
	for _, n := range c.Nodes {
		if !n.Running() {
			fmt.Fprintf(&b, "%s: not running\n", n.Addr)
		}
	}
	for _, v := range views {
		fmt.Fprintf(&b, "%s: cluster_state:%s cluster_current_epoch:%s cluster_my_epoch:%s role:%s",
			v.n.Addr, field(v.info, "cluster_state"), field(v.info, "cluster_current_epoch"), field(v.info, "cluster_my_epoch"), field(v.repl, "role"))
		if field(v.repl, "role") == "slave" {
			fmt.Fprintf(&b, " of %s:%s link %s", field(v.repl, "master_host"), field(v.repl, "master_port"), field(v.repl, "master_link_status"))
		}
		if v.err != nil {
			fmt.Fprintf(&b, " (does not answer: %v)", v.err)
		}
		b.WriteString("\n")
		for _, l := range slices.SortedFunc(slices.Values(v.nodes), func(a, b nodeLine) int { return strings.Compare(a.addr, b.addr) }) {
			slots := strings.Join(l.slots, " ")
			if slots == "" {
				slots = "none"
			}
			fmt.Fprintf(&b, "    sees %s %s %s epoch %s link %s slots %s\n", l.addr, l.id[:min(8, len(l.id))], strings.Join(l.flags, ","), l.epoch, l.link, slots)
		}
	}
	return b.String()
}

// help finishes what Redis has not: a running node that another does not
// know (its handshake timed out on a starved machine: it knows the others,
// but they ignore what it sends, its votes asked and its claims, and no
// one tells them of it) is met by it (CLUSTER MEET); every running replica
// whose master is not running takes over (CLUSTER FAILOVER TAKEOVER), again
// each time while it is still a replica; and a running master whose slots a
// running node still credits to a node that is not running, with a config
// epoch no lower than the master's own, gets a greater epoch (CLUSTER
// BUMPEPOCH), since Redis gives a slot to a new claim only with a
// greater epoch.
func (c *Cluster) help(views []nodeView) {
	running := c.running()
	for _, u := range unknown(views) {
		host, port, _ := net.SplitHostPort(u.stranger.n.Addr)
		reply, err := command(u.viewer.n, "CLUSTER", "MEET", host, port, u.stranger.n.busPort)
		c.t.Logf("redistest: %s does not know %s: CLUSTER MEET: %s", u.viewer.n.Addr, u.stranger.n.Addr, outcome(reply, err))
	}
	for _, v := range views {
		if v.err != nil || field(v.repl, "role") != "slave" {
			continue
		}
		master := net.JoinHostPort(field(v.repl, "master_host"), field(v.repl, "master_port"))
		if running[master] {
			continue
		}
		reply, err := command(v.n, "CLUSTER", "FAILOVER", "TAKEOVER")
		c.t.Logf("redistest: %s's master %s is down and no failover happened: CLUSTER FAILOVER TAKEOVER: %s", v.n.Addr, master, outcome(reply, err))
	}
	for _, s := range staleClaims(views, running) {
		reply, err := command(s.claimant.n, "CLUSTER", "BUMPEPOCH")
		c.t.Logf("redistest: %s credits slots %s to %s, which is not running, with epoch %s; %s claims them with epoch %s: CLUSTER BUMPEPOCH on %s: %s",
			s.viewer.n.Addr, strings.Join(s.slots, " "), s.dead, s.deadEpoch, s.claimant.n.Addr, s.epoch, s.claimant.n.Addr, outcome(reply, err))
		if !strings.HasPrefix(reply, "STILL") {
			continue
		}
		// The claimant has the greatest epoch it knows of already: a
		// replica takes a greater one (a replica's own epoch is no claim),
		// which the claimant learns from its next message, so the next
		// help bumps it past the dead node's.
		for _, r := range views {
			if r.err == nil && field(r.repl, "role") == "slave" {
				reply, err := command(r.n, "CLUSTER", "BUMPEPOCH")
				c.t.Logf("redistest: CLUSTER BUMPEPOCH on the replica %s, to raise the current epoch: %s", r.n.Addr, outcome(reply, err))
				break
			}
		}
	}
}

// outcome is a command's reply, or its error.
func outcome(reply string, err error) string {
	if err != nil {
		return err.Error()
	}
	return reply
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

// command sends one command to n, with a deadline of its own; the reply
// (a string or a number) is its text.
func command(n *Private, args ...any) (string, error) {
	cl := n.client()
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	reply, err := cl.Do(ctx, args...).Result()
	if err != nil {
		return "", err
	}
	return fmt.Sprint(reply), nil
}

// staleClaim: viewer credits slots to dead, a node that is not running,
// with a config epoch (deadEpoch) no lower than the epoch with which the
// running master claimant claims them; Redis keeps the old owner then.
type staleClaim struct {
	viewer, claimant nodeView
	dead, deadEpoch  string
	slots            []string
	epoch            string
}

// staleClaims is the stale claims among the views, at most one for each
// claimant.
func staleClaims(views []nodeView, running map[string]bool) []staleClaim {
	var out []staleClaim
	claimed := map[string]bool{}
	for _, v := range views {
		for _, d := range v.nodes {
			if running[d.addr] || !d.is("master") || len(d.slots) == 0 {
				continue
			}
			for _, m := range views {
				me, ok := m.myself()
				if !ok || !me.is("master") || claimed[m.n.Addr] || !overlap(me.slots, d.slots) || epoch(me.epoch) > epoch(d.epoch) {
					continue
				}
				claimed[m.n.Addr] = true
				out = append(out, staleClaim{viewer: v, claimant: m, dead: d.addr, deadEpoch: d.epoch, slots: d.slots, epoch: me.epoch})
			}
		}
	}
	return out
}

// acquaintance: viewer does not know stranger, both running.
type acquaintance struct{ viewer, stranger nodeView }

// unknown is every pair of running nodes of which the first does not know
// the second (by its node ID, with its address, its handshake complete).
func unknown(views []nodeView) []acquaintance {
	var out []acquaintance
	for _, w := range views {
		me, ok := w.myself()
		if !ok {
			continue
		}
		for _, v := range views {
			if v.n == w.n {
				continue
			}
			known := slices.ContainsFunc(v.nodes, func(l nodeLine) bool {
				return l.id == me.id && l.addr == w.n.Addr && !l.is("handshake") && !l.is("noaddr")
			})
			if !known {
				out = append(out, acquaintance{viewer: v, stranger: w})
			}
		}
	}
	return out
}

// myself is the node's own line in its CLUSTER NODES.
func (v nodeView) myself() (nodeLine, bool) {
	for _, l := range v.nodes {
		if l.is("myself") {
			return l, true
		}
	}
	return nodeLine{}, false
}

func epoch(s string) uint64 {
	e, _ := strconv.ParseUint(s, 10, 64)
	return e
}

// overlap reports whether two lists of slot ranges share a slot.
func overlap(a, b []string) bool {
	for _, x := range ranges(a) {
		for _, y := range ranges(b) {
			if x[0] <= y[1] && y[0] <= x[1] {
				return true
			}
		}
	}
	return false
}

// ranges reads slot ranges, "0-5460" or "42", as [start, end].
func ranges(slots []string) [][2]int64 {
	var out [][2]int64
	for _, r := range slots {
		lo, hi, found := strings.Cut(r, "-")
		if !found {
			hi = lo
		}
		start, err1 := strconv.ParseInt(lo, 10, 64)
		end, err2 := strconv.ParseInt(hi, 10, 64)
		if err1 == nil && err2 == nil {
			out = append(out, [2]int64{start, end})
		}
	}
	return out
}

// MasterOf is the node that is the master of key's slot now, as the
// running nodes see it.
func (c *Cluster) MasterOf(key string) *Private {
	c.t.Helper()
	for _, n := range c.Nodes {
		if !n.Running() {
			continue
		}
		v := view(n)
		reply, err := command(n, "CLUSTER", "KEYSLOT", key)
		slot, _ := strconv.ParseInt(reply, 10, 64)
		if v.err != nil || err != nil {
			continue
		}
		for _, s := range v.masters() {
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
