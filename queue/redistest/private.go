package redistest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
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
	// args are added to redis-server's command line (a cluster node's).
	args []string
}

// StartPrivate starts a redis-server for the test (nothing kept on disk),
// stopped when the test ends. It skips the test when the machine has no
// redis-server, unless KAMI_TEST_REQUIRE_SERVICES=1.
func StartPrivate(t testing.TB) *Private {
	t.Helper()
	needServer(t)
	return startPrivate(t)
}

func startPrivate(t testing.TB, args ...string) *Private {
	t.Helper()
	addr := freeAddr(t)
	p := &Private{t: t, Addr: addr, URL: "redis://" + addr + "/0", args: args}
	p.Start()
	t.Cleanup(p.Stop)
	return p
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

// freeAddr is a 127.0.0.1 address with a port nobody listens on now.
func freeAddr(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// Start starts the server on its port and waits until it answers.
func (p *Private) Start() {
	p.t.Helper()
	if p.cmd != nil {
		p.t.Fatal("redistest: the private Redis is already running")
	}
	_, port, _ := net.SplitHostPort(p.Addr)
	args := append([]string{"--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--protected-mode", "no", "--dir", p.t.TempDir()}, p.args...)
	p.cmd = exec.Command("redis-server", args...)
	dieWithTest(p.cmd)
	if err := p.cmd.Start(); err != nil {
		p.t.Fatalf("redis-server: %v", err)
	}
	c := p.client()
	defer c.Close()
	deadline := time.Now().Add(2 * time.Minute) // a start on a busy machine
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := c.Ping(ctx).Err()
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("the private redis-server on %s does not answer: %v", p.Addr, err)
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
	p.cmd.Wait()
	p.cmd = nil
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
