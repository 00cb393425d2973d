package redistest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// Private is a redis-server of the test's own, on a free port, which the
// test may stop and start again: a Redis that goes away and comes back, as
// in a restart or a failover. The shared Redis must never be restarted.
type Private struct {
	t    testing.TB
	Addr string // host:port
	URL  string // redis://host:port/0
	cmd  *exec.Cmd
	// exited is closed once cmd has exited.
	exited chan struct{}
	// started: the server ran once; it keeps its ports from then on.
	started bool
	// args are added to redis-server's command line (a cluster node's).
	args []string
	// busPort is a cluster node's cluster bus port ("" for a plain server).
	busPort string
}

// StartPrivate starts a redis-server for the test (nothing kept on disk),
// stopped when the test ends. It skips the test when the machine has no
// redis-server, unless KAMI_TEST_REQUIRE_SERVICES=1.
func StartPrivate(t testing.TB) *Private {
	t.Helper()
	needServer(t)
	return startPrivate(t, false)
}

// startPrivate starts a server with args added to its command line; a
// cluster node gets a free cluster bus port too.
func startPrivate(t testing.TB, clusterNode bool, args ...string) *Private {
	t.Helper()
	p := &Private{t: t, args: args}
	p.pickPorts(clusterNode)
	p.Start()
	t.Cleanup(p.Stop)
	return p
}

// pickPorts gives the server ports nobody listens on now.
func (p *Private) pickPorts(clusterNode bool) {
	p.Addr = freeAddr(p.t)
	p.URL = "redis://" + p.Addr + "/0"
	if clusterNode {
		_, p.busPort, _ = net.SplitHostPort(freeAddr(p.t))
	}
}

// needServer skips the test when the machine has no redis-server, unless
// KAMI_TEST_REQUIRE_SERVICES=1, which makes it a failure.
func needServer(t testing.TB) {
	t.Helper()
	if _, err := exec.LookPath("redis-server"); err != nil {
		if os.Getenv("KAMI_TEST_REQUIRE_SERVICES") == "1" {
			t.Fatalf("redis-server is required (KAMI_TEST_REQUIRE_SERVICES=1) but not installed: %v", err)
		}
		t.Skipf("redis-server is not installed: %v", err)
	}
}

// freeAddr is a 127.0.0.1 address with a port nobody listens on now. Another
// process may take it before the server binds it: Start makes sure the
// server answering is its own.
func freeAddr(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// Start starts the server on its port and waits until it answers, as
// itself: the server answering on the port must be the process started
// (INFO server's process_id), not another test's that took the port
// between freeAddr and the bind. When the port (or the bus port) was
// taken, the server exits; at its first start it is started again on other
// ports, a few times. A restart keeps its ports, which the test holds.
func (p *Private) Start() {
	p.t.Helper()
	if p.cmd != nil {
		p.t.Fatal("redistest: the private Redis is already running")
	}
	for attempt := 1; ; attempt++ {
		err := p.start()
		if err == nil {
			p.started = true
			return
		}
		if p.started || attempt == 5 {
			p.t.Fatalf("the private redis-server on %s: %v", p.Addr, err)
		}
		p.pickPorts(p.busPort != "")
	}
}

// start runs redis-server once and waits until it answers as itself; it
// reports why not (it exited: its port was taken).
func (p *Private) start() error {
	_, port, _ := net.SplitHostPort(p.Addr)
	args := append([]string{"--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--protected-mode", "no", "--dir", p.t.TempDir()}, p.args...)
	if p.busPort != "" {
		args = append(args, "--cluster-port", p.busPort)
	}
	cmd := exec.Command("redis-server", args...)
	dieWithTest(cmd)
	if err := cmd.Start(); err != nil {
		p.t.Fatalf("redis-server: %v", err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	p.cmd, p.exited = cmd, exited
	want := "process_id:" + strconv.Itoa(cmd.Process.Pid) + "\r\n"
	c := p.client()
	defer c.Close()
	deadline := time.Now().Add(2 * time.Minute) // a start on a busy machine
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		info, err := c.Info(ctx, "server").Result()
		cancel()
		if err == nil && strings.Contains(info, want) {
			return nil
		}
		if err == nil {
			err = errors.New("another server answers on its port")
		}
		select {
		case <-exited:
			p.cmd, p.exited = nil, nil
			return fmt.Errorf("redis-server exited (%v); last answer on its port: %w", cmd.ProcessState, err)
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("does not answer as itself: %w", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Stop kills the server, as a crash would, and waits for it to be gone.
func (p *Private) Stop() {
	if p.cmd == nil {
		return
	}
	p.cmd.Process.Kill()
	<-p.exited
	p.cmd, p.exited = nil, nil
}

// Clients is how many client connections the server has, besides the one
// asking (CLIENT LIST).
func (p *Private) Clients() int {
	p.t.Helper()
	c := p.client()
	defer c.Close()
	list, err := c.ClientList(context.Background()).Result()
	if err != nil {
		p.t.Fatalf("CLIENT LIST: %v", err)
	}
	return strings.Count(strings.TrimSpace(list), "\n")
}

// String names the server in test output.
func (p *Private) String() string { return fmt.Sprintf("private redis-server %s", p.Addr) }

// Running reports whether the server was started and not stopped since.
func (p *Private) Running() bool { return p.cmd != nil }

// client is a plain client to this one server, for the test's own
// commands; the caller closes it.
func (p *Private) client() *redis.Client {
	return redis.NewClient(&redis.Options{Addr: p.Addr, MaxRetries: -1, DialTimeout: time.Second})
}
