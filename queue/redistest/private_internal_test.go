package redistest

import (
	"context"
	"strconv"
	"strings"
	"testing"
)

// TestPrivateStartsItsOwnServer: the port a private server was given is
// taken by another server before it binds it (another test's, between
// freeAddr and the bind); Start does not take that server for its own,
// and starts its own on another port. Before, Start pinged the port and
// the test went on against the other test's server.
func TestPrivateStartsItsOwnServer(t *testing.T) {
	needServer(t)
	other := StartPrivate(t)
	p := &Private{t: t, Addr: other.Addr, URL: other.URL}
	p.Start()
	t.Cleanup(p.Stop)
	if p.Addr == other.Addr {
		t.Fatalf("started on %s, the port another server holds", p.Addr)
	}
	c := p.client()
	defer c.Close()
	info, err := c.Info(context.Background(), "server").Result()
	if err != nil {
		t.Fatal(err)
	}
	if want := "process_id:" + strconv.Itoa(p.cmd.Process.Pid) + "\r\n"; !strings.Contains(info, want) {
		t.Fatalf("the server on %s is not the one started (%s)", p.Addr, want)
	}
}
