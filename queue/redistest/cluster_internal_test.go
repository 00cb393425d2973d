package redistest

import (
	"net"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestWaitOKSaysWhatEveryNodeSees: when the cluster is not ok in time, the
// error names, for every running node, its cluster state, epoch and role,
// and every node it knows with the flags it holds for it (a dead master
// flagged fail), so a failure on a starved machine says why. Before, it
// named only the first node not ok.
func TestWaitOKSaysWhatEveryNodeSees(t *testing.T) {
	c, dead, replica := clusterPair(t)
	// A master and its replica die: nobody serves their slots again.
	dead.Stop()
	replica.Stop()
	// Wait until every running node holds the master failed: its flags
	// are what the error is to show.
	for deadline := time.Now().Add(time.Minute); ; {
		failed := 0
		views := c.survey()
		for _, v := range views {
			for _, l := range v.nodes {
				if l.addr == dead.Addr && l.is("fail") {
					failed++
				}
			}
		}
		if failed == len(views) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the running nodes do not all hold %s failed:\n%s", dead.Addr, c.describe(views))
		}
		time.Sleep(50 * time.Millisecond)
	}
	err := c.waitOK(0)
	if err == nil {
		t.Fatal("the cluster is ok without the slots of a dead master and its replica")
	}
	msg := err.Error()
	t.Log(msg)
	for _, n := range c.Nodes {
		if !n.Running() {
			if !strings.Contains(msg, n.Addr+": not running") {
				t.Errorf("the error does not say %s is not running", n.Addr)
			}
			continue
		}
		_, after, found := strings.Cut(msg, "\n"+n.Addr+": cluster_state:fail cluster_current_epoch:")
		if !found {
			t.Errorf("the error does not give %s's cluster state and epoch", n.Addr)
			continue
		}
		line, rest, _ := strings.Cut(after, "\n")
		if !strings.Contains(line, "role:") {
			t.Errorf("the error does not give %s's role: %s", n.Addr, line)
		}
		seen, _, _ := strings.Cut(rest, "\n127.0.0.1:") // the lines of the nodes n knows
		_, of, found := strings.Cut(seen, "sees "+dead.Addr+" ")
		if f := strings.Fields(of); !found || len(f) < 2 || !slices.Contains(strings.Split(f[1], ","), "fail") {
			t.Errorf("the error does not say %s holds %s failed", n.Addr, dead.Addr)
		}
	}
}

// TestWaitOKFinishesAFailoverRedisDoesNotMake: the dead master's replica
// never runs an election (cluster-replica-no-failover, as when its votes
// keep arriving late on a starved machine); WaitOK has it take over, and
// returns with the replica the master of the dead master's slots.
func TestWaitOKFinishesAFailoverRedisDoesNotMake(t *testing.T) {
	c, dead, replica := clusterPair(t)
	if _, err := command(replica, "CONFIG", "SET", "cluster-replica-no-failover", "yes"); err != nil {
		t.Fatal(err)
	}
	dead.Stop()
	c.WaitOK()
	if m := c.MasterOf("k"); m != replica {
		t.Fatalf("the master of k is %s, want the dead master's replica %s", m.Addr, replica.Addr)
	}
}

// clusterPair starts a cluster and gives the master of k and its replica.
func clusterPair(t *testing.T) (c *Cluster, master, replica *Private) {
	t.Helper()
	if testing.Short() {
		t.Skip("starts six redis-servers")
	}
	c = StartCluster(t)
	master = c.MasterOf("k")
	for _, v := range c.survey() {
		if field(v.repl, "role") == "slave" && net.JoinHostPort(field(v.repl, "master_host"), field(v.repl, "master_port")) == master.Addr {
			return c, master, v.n
		}
	}
	t.Fatalf("no replica of %s", master.Addr)
	return nil, nil, nil
}

// TestWaitOKMeetsANodeTheOthersDoNotKnow: the master's replica knows every
// node, but no other node knows it (its handshakes timed out on a starved
// machine; here they forget it), so they ignore its election and its
// TAKEOVER, and no one tells them of it. Its master dies; WaitOK has the
// others meet it, and returns with it the master of the dead master's
// slots. Before, the cluster stayed failed for good after the TAKEOVER,
// as it did in CI.
func TestWaitOKMeetsANodeTheOthersDoNotKnow(t *testing.T) {
	c, dead, replica := clusterPair(t)
	me, _ := view(replica).myself()
	for _, n := range c.Nodes {
		if n != replica {
			if _, err := command(n, "CLUSTER", "FORGET", me.id); err != nil {
				t.Fatalf("CLUSTER FORGET on %s: %v", n.Addr, err)
			}
		}
	}
	dead.Stop()
	c.WaitOK()
	if m := c.MasterOf("k"); m != replica {
		t.Fatalf("the master of k is %s, want the dead master's replica %s", m.Addr, replica.Addr)
	}
}
