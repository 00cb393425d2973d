package playground_test

import (
	"bytes"
	"compress/gzip"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"

	"kami/graph/playground"
)

func get(t *testing.T, srv *httptest.Server, path string, header ...string) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, srv.URL+path, nil)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	// The transport must not decompress for us: the test reads what was sent.
	resp, err := (&http.Transport{DisableCompression: true}).RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp, body
}

// TestPageLoadsOnlyFromKami: the page names no other host, each file it
// loads is served (compressed when asked), and its config is the example
// walk-through for this endpoint.
func TestPageLoadsOnlyFromKami(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(playground.Handler("/graphql"))
	t.Cleanup(srv.Close)

	resp, page := get(t, srv, "/")
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/html") {
		t.Fatalf("page: %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	if csp := resp.Header.Get("Content-Security-Policy"); !strings.Contains(csp, "default-src 'self'") || strings.Contains(csp, "http") {
		t.Errorf("CSP %q", csp)
	}
	refs := regexp.MustCompile(`(?:src|href)="([^"]+)"`).FindAllStringSubmatch(string(page), -1)
	if len(refs) != 6 { // favicon, stylesheet, React, ReactDOM, GraphiQL, the page's script
		t.Errorf("page loads %d files: %v", len(refs), refs)
	}
	for _, ref := range refs {
		u := strings.ReplaceAll(ref[1], "&amp;", "&")
		if !strings.HasPrefix(u, "/") || strings.HasPrefix(u, "//") {
			t.Errorf("the page loads %q from elsewhere", u)
			continue
		}
		resp, body := get(t, srv, u, "Accept-Encoding", "gzip")
		if resp.StatusCode != 200 || len(body) == 0 {
			t.Errorf("%s: %d", u, resp.StatusCode)
			continue
		}
		if strings.Contains(u, "?v=") && !strings.Contains(resp.Header.Get("Cache-Control"), "immutable") {
			t.Errorf("%s: Cache-Control %q", u, resp.Header.Get("Cache-Control"))
		}
		if resp.Header.Get("Content-Encoding") == "gzip" {
			zr, err := gzip.NewReader(bytes.NewReader(body))
			if err != nil {
				t.Fatalf("%s: %v", u, err)
			}
			body, _ = io.ReadAll(zr)
		}
		if strings.Contains(u, ".css") && bytes.Contains(body, []byte("@import")) {
			t.Errorf("%s imports another stylesheet", u)
		}
		if strings.Contains(u, ".css") && regexp.MustCompile(`url\(["']?(https?:)?//`).Match(body) {
			t.Errorf("%s loads a font or image from elsewhere", u)
		}
	}
	m := regexp.MustCompile(`(?s)<script type="application/json" id="kami-playground">(.*?)</script>`).FindSubmatch(page)
	if m == nil {
		t.Fatal("no playground config in the page")
	}
	var cfg struct{ Endpoint, Example, ExampleVariables, OrderQuery string }
	if err := json.Unmarshal(m[1], &cfg); err != nil {
		t.Fatalf("config %s: %v", m[1], err)
	}
	for _, op := range []string{"mutation CreateProduct", "mutation ImportCards", "mutation CreateOrder", "query Order", "subscription FollowOrder", "data/admin_token"} {
		if !strings.Contains(cfg.Example, op) {
			t.Errorf("the example does not have %q", op)
		}
	}
	if cfg.Endpoint != "/graphql" || !json.Valid([]byte(cfg.ExampleVariables)) || !strings.Contains(cfg.OrderQuery, "order(") {
		t.Errorf("config %+v", cfg)
	}
}

func TestFaviconAndLicenses(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(playground.Handler("/graphql"))
	t.Cleanup(srv.Close)
	resp, body := get(t, srv, "/favicon.ico")
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "image/x-icon" || !bytes.HasPrefix(body, []byte{0, 0, 1, 0}) {
		t.Errorf("favicon: %d %s % x", resp.StatusCode, resp.Header.Get("Content-Type"), body[:min(len(body), 4)])
	}
	for _, name := range []string{"LICENSE.graphiql", "LICENSE.react", "LICENSE.react-dom"} {
		resp, body := get(t, srv, playground.Prefix+name)
		if resp.StatusCode != 200 || !bytes.Contains(body, []byte("MIT License")) {
			t.Errorf("%s: %d %.40s", name, resp.StatusCode, body)
		}
	}
	if resp, _ := get(t, srv, playground.Prefix+"nothing.js"); resp.StatusCode != 404 {
		t.Errorf("unknown file: %d", resp.StatusCode)
	}
}
