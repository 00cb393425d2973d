package webhook_test

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
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
