package webhook_test

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"kami/domain/webhook"
)

// TestGuardRefusesPrivateTargets: loopback, private, link-local,
// unspecified addresses and kami's own URL are refused at creation; with
// AllowPrivate the private ones pass but kami itself still does not.
func TestGuardRefusesPrivateTargets(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	g := webhook.Guard{Self: "https://shop.example.com"}
	for _, u := range []string{
		"http://127.0.0.1:8080/hook", "http://localhost/hook", "http://[::1]/hook", "http://10.1.2.3/", "http://192.168.0.1/",
		"http://172.16.0.1/", "http://169.254.169.254/latest/meta-data", "http://0.0.0.0/", "http://[fe80::1]/",
		"http://100.64.0.1/", "http://[::ffff:127.0.0.1]/", "https://shop.example.com/hook", "https://SHOP.example.com:443/x",
		"ftp://example.com/", "/relative", "http://user:pw@example.com/",
	} {
		if err := g.CheckURL(ctx, u); !errors.Is(err, webhook.ErrRefused) {
			t.Errorf("CheckURL(%s) = %v, want refused", u, err)
		}
	}
	if err := g.CheckURL(ctx, "http://93.184.215.14/hook"); err != nil {
		t.Errorf("a public address refused: %v", err)
	}
	open := webhook.Guard{Self: "https://shop.example.com", AllowPrivate: true}
	if err := open.CheckURL(ctx, "http://127.0.0.1:8080/hook"); err != nil {
		t.Errorf("allowed private address refused: %v", err)
	}
	if err := open.CheckURL(ctx, "https://shop.example.com/hook"); !errors.Is(err, webhook.ErrRefused) {
		t.Errorf("kami itself allowed: %v", err)
	}
}

// TestGuardAtDialTime: the client checks the address it connects to, so a
// receiver on 127.0.0.1 is not reached, whatever the URL said when it was
// created (DNS rebinding); with AllowPrivate it is.
func TestGuardAtDialTime(t *testing.T) {
	t.Parallel()
	hits := make(chan struct{}, 2)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { hits <- struct{}{} }))
	defer srv.Close()
	// A name that resolves to the loopback: the dial is where it is caught.
	_, port, _ := net.SplitHostPort(srv.Listener.Addr().String())
	url := "http://localhost:" + port + "/"

	_, err := webhook.Guard{}.Client(5*time.Second).Post(url, "application/json", nil)
	if !errors.Is(err, webhook.ErrRefused) {
		t.Fatalf("dial to loopback: %v, want refused", err)
	}
	if len(hits) != 0 {
		t.Fatal("the receiver was reached")
	}
	resp, err := webhook.Guard{AllowPrivate: true}.Client(5*time.Second).Post(url, "application/json", nil)
	if err != nil {
		t.Fatalf("with AllowPrivate: %v", err)
	}
	resp.Body.Close()
	if len(hits) != 1 {
		t.Fatal("the receiver was not reached")
	}
}

// TestGuardAddressClasses: every address class that does not lead to a
// public receiver is refused, at creation and at dial time, in every
// spelling: IPv4-mapped, IPv4-compatible, NAT64 and 6to4 addresses are
// judged by the IPv4 address they carry too. AllowPrivate lifts the
// private and loopback classes, never the special-purpose ones nor a
// cloud host's instance metadata service (it would hand an endpoint the
// machine's credentials).
func TestGuardAddressClasses(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, c := range []struct {
		host    string
		private bool // allowed with AllowPrivate
	}{
		{"127.0.0.1", true}, {"127.1.2.3", true}, {"[::1]", true},
		{"10.1.2.3", true}, {"172.16.0.1", true}, {"192.168.0.1", true},
		{"169.254.1.1", true}, {"[fe80::1]", true}, {"[fe80::1%25lo]", true},
		// Cloud instance metadata services, never: not even with AllowPrivate.
		{"169.254.169.254", false}, {"169.254.170.2", false}, {"169.254.170.23", false}, {"169.254.0.23", false},
		{"100.100.100.200", false}, {"168.63.129.16", false}, {"[fd00:ec2::254]", false}, {"[fd00:ec2::23]", false},
		{"[::ffff:169.254.169.254]", false}, {"[64:ff9b::169.254.169.254]", false}, {"[2002:a9fe:a9fe::1]", false},
		{"[fd00::1]", true}, {"[fc00::1]", true}, {"100.64.0.1", true}, {"[fec0::1]", true},
		{"[::ffff:127.0.0.1]", true}, {"[::ffff:10.0.0.1]", true}, {"[::ffff:0.0.0.0]", false}, {"[::ffff:198.18.0.1]", false},
		{"[::7f00:1]", false}, {"[::127.0.0.1]", false}, {"[::a00:1]", false}, {"[::5db8:d70e]", false},
		{"[64:ff9b::7f00:1]", true}, {"[64:ff9b::10.0.0.1]", true}, {"[64:ff9b::192.0.2.1]", false},
		{"[64:ff9b::255.255.255.255]", false}, {"[64:ff9b:1::1]", true}, {"[64:ff9b:1::a00:1]", true},
		{"[2002:7f00:1::1]", true}, {"[2002:a9fe:101::1]", true}, {"[2002:c000:201::1]", false},
		{"[2001::1]", false}, {"[2001:0:4136:e378:8000:63bf:3fff:fdd2]", false}, {"[2001:2::1]", false},
		{"198.18.0.1", false}, {"198.19.255.255", false}, {"192.0.0.8", false}, {"192.0.0.170", false},
		{"240.0.0.1", false}, {"255.255.255.255", false}, {"192.88.99.1", false},
		{"192.0.2.1", false}, {"198.51.100.1", false}, {"203.0.113.1", false}, {"[2001:db8::1]", false}, {"[3fff::1]", false},
		{"224.0.0.1", false}, {"239.255.255.250", false}, {"[ff02::1]", false}, {"[ff05::1]", false},
		{"0.0.0.0", false}, {"0.1.2.3", false}, {"[::]", false}, {"[100::1]", false}, {"[4000::1]", false},
	} {
		u := "http://" + c.host + "/hook"
		if err := (webhook.Guard{}).CheckURL(ctx, u); !errors.Is(err, webhook.ErrRefused) {
			t.Errorf("CheckURL(%s) = %v, want refused", u, err)
		}
		if _, err := (webhook.Guard{}).Client(5*time.Second).Post(u, "application/json", nil); !errors.Is(err, webhook.ErrRefused) {
			t.Errorf("dial %s: %v, want refused", u, err)
		}
		open := webhook.Guard{AllowPrivate: true}
		err := open.CheckURL(ctx, u)
		if c.private && err != nil {
			t.Errorf("with AllowPrivate CheckURL(%s) = %v, want allowed", u, err)
		}
		if !c.private {
			if !errors.Is(err, webhook.ErrRefused) {
				t.Errorf("with AllowPrivate CheckURL(%s) = %v, want refused", u, err)
			}
			if _, err := open.Client(5*time.Second).Post(u, "application/json", nil); !errors.Is(err, webhook.ErrRefused) {
				t.Errorf("with AllowPrivate dial %s: %v, want refused", u, err)
			}
		}
	}
	for _, host := range []string{
		"93.184.215.14", "[2606:2800:21f:cb07:6820:80da:af6b:8b2c]", "[::ffff:93.184.215.14]",
		"[64:ff9b::93.184.215.14]", "[2002:5db8:d70e::1]", "1.1.1.1",
	} {
		if err := (webhook.Guard{}).CheckURL(ctx, "https://"+host+"/hook"); err != nil {
			t.Errorf("public %s refused: %v", host, err)
		}
	}
}

// TestGuardNeverKamiItself: kami's own public URL and listen addresses
// are refused whatever the spelling (leading zeros in the port, a mapped
// address, a name that resolves to it, the default port), at creation and
// at dial time, even with AllowPrivate; another port on the same host is
// not kami.
func TestGuardNeverKamiItself(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	hits := make(chan struct{}, 16)
	kami := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { hits <- struct{}{} }))
	defer kami.Close()
	_, port, _ := net.SplitHostPort(kami.Listener.Addr().String())
	other := strconv.Itoa(func() int { p, _ := strconv.Atoi(port); return p%60000 + 1024 }())
	spellings := []string{
		"http://127.0.0.1:" + port + "/", "http://127.0.0.1:0" + port + "/", "http://127.0.0.1:000" + port + "/",
		"http://[::ffff:127.0.0.1]:" + port + "/", "http://localhost:" + port + "/", "http://LOCALHOST:" + port + "/",
		"http://[64:ff9b::127.0.0.1]:" + port + "/",
	}
	refuses := func(name string, g webhook.Guard) {
		t.Helper()
		for _, u := range spellings {
			if err := g.CheckURL(ctx, u); !errors.Is(err, webhook.ErrRefused) {
				t.Errorf("%s: CheckURL(%s) = %v, want refused", name, u, err)
			}
			if _, err := g.Client(5*time.Second).Post(u, "application/json", nil); !errors.Is(err, webhook.ErrRefused) {
				t.Errorf("%s: dial %s: %v, want refused", name, u, err)
			}
		}
		if err := g.CheckURL(ctx, "http://127.0.0.1:"+other+"/"); err != nil {
			t.Errorf("%s: another port on kami's host refused: %v", name, err)
		}
	}
	refuses("public URL", webhook.Guard{AllowPrivate: true, Self: "http://127.0.0.1:" + port})
	refuses("public URL by name", webhook.Guard{AllowPrivate: true, Self: "http://localhost:0" + port + "/"})
	refuses("listen address", webhook.Guard{AllowPrivate: true, Self: "https://shop.example.com", Listen: []string{"127.0.0.1:" + port}})
	refuses("second listen address", webhook.Guard{AllowPrivate: true, Listen: []string{"127.0.0.1:1", "localhost:" + port}})
	refuses("listen on all interfaces", webhook.Guard{AllowPrivate: true, Listen: []string{":" + port}})
	if len(hits) != 0 {
		t.Fatal("kami was reached")
	}
	// On all interfaces kami answers on every address of its host.
	all := webhook.Guard{AllowPrivate: true, Listen: []string{"[::]:" + port}}
	if err := all.CheckURL(ctx, "http://127.0.0.2:"+port+"/"); !errors.Is(err, webhook.ErrRefused) {
		t.Errorf("another loopback address of a host listening on all interfaces: %v, want refused", err)
	}

	// A public URL on the default port, reached by its address.
	pub := webhook.Guard{Self: "https://93.184.215.14/"}
	for _, u := range []string{"https://93.184.215.14:0443/", "https://[::ffff:93.184.215.14]/hook", "https://[64:ff9b::5db8:d70e]:443/", "https://93.184.215.14./"} {
		if err := pub.CheckURL(ctx, u); !errors.Is(err, webhook.ErrRefused) {
			t.Errorf("CheckURL(%s) = %v, want refused as kami itself", u, err)
		}
	}
	if err := pub.CheckURL(ctx, "http://93.184.215.14/"); err != nil {
		t.Errorf("kami's host on another port refused: %v", err)
	}
}

// TestGuardClientLimitsHeaders: a receiver answering with megabytes of
// headers gets an error, not kami's memory; ordinary headers pass.
func TestGuardClientLimitsHeaders(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n, _ := strconv.Atoi(r.URL.Query().Get("kib"))
		for i := range n {
			w.Header().Set("X-Pad-"+strconv.Itoa(i), strings.Repeat("a", 1024))
		}
	}))
	defer srv.Close()
	c := webhook.Guard{AllowPrivate: true}.Client(5 * time.Second)
	resp, err := c.Post(srv.URL+"/?kib=32", "application/json", nil)
	if err != nil {
		t.Fatalf("32 KiB of headers: %v", err)
	}
	resp.Body.Close()
	resp, err = c.Post(srv.URL+"/?kib=1024", "application/json", nil)
	if err == nil {
		resp.Body.Close()
		t.Fatal("1 MiB of response headers was read")
	}
	if !strings.Contains(err.Error(), "headers exceeded") {
		t.Fatalf("1 MiB of response headers: %v, want them refused for their size", err)
	}
}
