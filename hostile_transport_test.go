package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/99designs/gqlgen/graphql/introspection"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/providers/sandbox"
)

// The hostile-traffic transport attacks, against a whole server.

// TestSlowBodyIsCut: a POST announcing 100 KB and sending 10 bytes was
// held open indefinitely. The body now has BodyReadTimeout to arrive; the
// server then answers 408 and closes the connection, on /graphql and on
// the webhooks alike. The test waits for that answer; it does not time it.
func TestSlowBodyIsCut(t *testing.T) {
	t.Parallel()
	ta := newTestAppWith(t, dbtest.SQLite, nil, func(c *Config) { c.BodyReadTimeout = 200 * time.Millisecond })
	for _, path := range []string{"/graphql", "/webhooks/sandbox"} {
		conn, err := net.Dial("tcp", strings.TrimPrefix(ta.srv.URL, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: kami.test\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{\"query\":", path)
		conn.SetReadDeadline(time.Now().Add(time.Minute)) // a guard against hanging, not a measure
		res, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Fatalf("%s: no answer to a slow body: %v", path, err)
		}
		io.Copy(io.Discard, res.Body)
		if res.StatusCode != http.StatusRequestTimeout {
			t.Errorf("%s: status %d, want 408", path, res.StatusCode)
		}
		if _, err := conn.Read(make([]byte, 1)); err == nil {
			t.Errorf("%s: the connection stayed open", path)
		}
	}
	// A body that arrives in time is served, and the deadline does not
	// reach past it: the connection serves the next request.
	r := ta.graphql(t, `{ products { id } }`, nil)
	if r.Status != 200 || len(r.Errors) > 0 {
		t.Fatalf("a normal request: %d %+v", r.Status, r.Errors)
	}
}

// TestMetricsToken: /metrics showed sales figures to anyone. With
// KAMI_METRICS_TOKEN it asks for the bearer token.
func TestMetricsToken(t *testing.T) {
	t.Parallel()
	const token = "metrics-token-0123456789abcdef-0123"
	ta := newTestApp(t, dbtest.SQLite, env{"KAMI_METRICS_TOKEN": token})
	for _, tc := range []struct {
		auth string
		want int
	}{{"", 401}, {"Bearer wrong", 401}, {"Bearer " + testAdminToken, 401}, {"Bearer " + token, 200}} {
		req, _ := http.NewRequest(http.MethodGet, ta.srv.URL+"/metrics", nil)
		if tc.auth != "" {
			req.Header.Set("Authorization", tc.auth)
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(res.Body)
		res.Body.Close()
		if res.StatusCode != tc.want || (tc.want == 401 && strings.Contains(string(body), "kami_")) {
			t.Errorf("Authorization %q: %d, want %d", tc.auth, res.StatusCode, tc.want)
		}
	}
	// Without the setting /metrics stays open, as before.
	open := newTestApp(t, dbtest.SQLite, nil)
	if res, err := http.Get(open.srv.URL + "/metrics"); err != nil || res.StatusCode != 200 {
		t.Fatalf("/metrics without a token set: %v %v", res, err)
	}
}

// TestTokensTooShortStopTheStart: an admin or metrics token under 32
// characters stops the start with a message naming the setting; the
// generated admin token is long enough.
func TestTokensTooShortStopTheStart(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"KAMI_ADMIN_TOKEN", "KAMI_METRICS_TOKEN"} {
		if _, err := loadConfig(env{name: "admin-token"}.get); err == nil || !strings.Contains(err.Error(), name) {
			t.Errorf("%s of 11 characters: %v", name, err)
		}
	}
	for name, value := range map[string]string{
		"KAMI_TRUSTED_PROXIES": "10.0.0.0/8, nginx", "KAMI_TRUSTED_PROXY_HEADER": "X-Client-IP",
		"KAMI_SANDBOX_GIVES_CODES_AWAY": "maybe", "KAMI_GRAPHQL_INTROSPECTION": "sometimes",
		"KAMI_MAX_LOCKED_PER_CONTACT": "-5", "KAMI_MAX_WEBSOCKETS_PER_ADDRESS": "x",
	} {
		if _, err := loadConfig(env{name: value}.get); err == nil || !strings.Contains(err.Error(), name) {
			t.Errorf("%s=%q: %v", name, value, err)
		}
	}
	c, err := loadConfig(env{"KAMI_DATA_DIR": t.TempDir()}.get)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.ensureSecrets(); err != nil || len(c.AdminToken) < 32 {
		t.Fatalf("generated admin token of %d characters: %v", len(c.AdminToken), err)
	}
}

// TestSQLiteFilesPrivate: the SQLite files were created 0644; they hold
// the buyers' contacts. They are 0600, and a file an older start left
// readable is tightened.
func TestSQLiteFilesPrivate(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	loose := filepath.Join(dir, "kami.db")
	if err := os.WriteFile(loose, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	e := env{"KAMI_DATA_DIR": dir}
	if err := run(t.Context(), []string{"migrate"}, e.get, io.Discard, io.Discard); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"kami.db", "kami.db-wal", "kami.db-shm"} {
		info, err := os.Stat(filepath.Join(dir, f))
		if os.IsNotExist(err) {
			continue
		}
		if err != nil || info.Mode().Perm()&0o077 != 0 {
			t.Errorf("%s: %v %v, want 0600", f, info.Mode(), err)
		}
	}
	fresh := t.TempDir()
	if err := run(t.Context(), []string{"migrate"}, env{"KAMI_DATA_DIR": fresh}.get, io.Discard, io.Discard); err != nil {
		t.Fatal(err)
	}
	if info, err := os.Stat(filepath.Join(fresh, "kami.db")); err != nil || info.Mode().Perm() != 0o600 {
		t.Errorf("a new database file: %v %v, want 0600", info.Mode(), err)
	}
}

// TestOperationLabelsBounded: client-chosen operation names became
// Prometheus labels, 500 names 500 series. Unknown names are "other".
func TestOperationLabelsBounded(t *testing.T) {
	t.Parallel()
	ta := newTestApp(t, dbtest.SQLite, nil)
	for i := range 500 {
		ta.graphql(t, fmt.Sprintf(`query Scrape%d { products { id } }`, i), nil)
	}
	ta.graphql(t, `query Products { products { id } }`, nil)
	res, err := http.Get(ta.srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	body, _ := io.ReadAll(res.Body)
	var series []string
	for _, line := range strings.Split(string(body), "\n") {
		if strings.HasPrefix(line, "kami_graphql_requests_total{") {
			series = append(series, line)
		}
	}
	if len(series) != 2 || !strings.Contains(string(body), `operation="other"} 500`) {
		t.Fatalf("GraphQL series after 500 made-up names: %q", series)
	}
}

// TestWrongAmountAlertedOnce: a signed notification with a wrong amount
// answered 500, so the gateway sent it again and each delivery alerted.
// It is refused once (400) and alerted once; its redeliveries are
// acknowledged, and the order is never delivered.
func TestWrongAmountAlertedOnce(t *testing.T) {
	t.Parallel()
	ta := newTestApp(t, dbtest.SQLite, nil)
	p := ta.product(t, 1250, "W-1")
	co, err := ta.shop.PlaceOrder(t.Context(), domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: "w@example.com", Provider: "sandbox"}, "", "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	h, b := sandbox.Signed("test-secret", sandbox.PaymentNotification(co.Order.OrderNo, "SBX-W", 1, time.Now()))
	var statuses []int
	for range 4 {
		status, _ := ta.post(t, "/webhooks/sandbox", h, b)
		statuses = append(statuses, status)
	}
	if fmt.Sprint(statuses) != "[400 200 200 200]" {
		t.Errorf("statuses %v, want [400 200 200 200]", statuses)
	}
	if n := counterValue(t, ta.metrics.alerts.WithLabelValues("amount_mismatch")); n != 1 {
		t.Errorf("%v amount_mismatch alerts, want 1", n)
	}
	if o, _ := ta.ledger.Order(t.Context(), co.Order.OrderNo); o.Status != domain.OrderPending {
		t.Errorf("order %s, want PENDING", o.Status)
	}
}

// slowUpload is a file import sent by hand over its own connection, with a
// chunked body, so that the test decides when each piece of it leaves.
type slowUpload struct {
	t    *testing.T
	conn net.Conn
}

func startUpload(t *testing.T, ta *testApp, productID int64) *slowUpload {
	t.Helper()
	conn, err := net.Dial("tcp", strings.TrimPrefix(ta.srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	const boundary = "kami-slow-upload"
	fmt.Fprintf(conn, "POST /graphql HTTP/1.1\r\nHost: kami.test\r\nAuthorization: Bearer %s\r\n"+
		"Content-Type: multipart/form-data; boundary=%s\r\nTransfer-Encoding: chunked\r\n\r\n", testAdminToken, boundary)
	u := &slowUpload{t: t, conn: conn}
	u.send(fmt.Sprintf("--%s\r\nContent-Disposition: form-data; name=\"operations\"\r\n\r\n"+
		`{"query":"mutation($in: ImportFileInput!) { importCardFile(input: $in) { imported } }","variables":{"in":{"productId":"%d","file":null}}}`+
		"\r\n--%s\r\nContent-Disposition: form-data; name=\"map\"\r\n\r\n"+`{"0":["variables.in.file"]}`+
		"\r\n--%s\r\nContent-Disposition: form-data; name=\"0\"; filename=\"codes.txt\"\r\n\r\n", boundary, productID, boundary, boundary))
	return u
}

// send sends s as one chunk.
func (u *slowUpload) send(s string) {
	u.t.Helper()
	if _, err := fmt.Fprintf(u.conn, "%x\r\n%s\r\n", len(s), s); err != nil {
		u.t.Fatalf("upload: %v", err)
	}
}

// finish ends the file and the body.
func (u *slowUpload) finish() {
	u.send("\r\n--kami-slow-upload--\r\n")
	io.WriteString(u.conn, "0\r\n\r\n")
}

// answer waits for the server's answer.
func (u *slowUpload) answer() (int, string) {
	u.t.Helper()
	u.conn.SetReadDeadline(time.Now().Add(2 * time.Minute)) // a guard against hanging, not a measure
	res, err := http.ReadResponse(bufio.NewReader(u.conn), nil)
	if err != nil {
		u.t.Fatalf("no answer to the upload: %v", err)
	}
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	return res.StatusCode, string(b)
}

// TestUploadDeadlineRolls: a file import is read while it is imported, so
// its body cannot have one fixed deadline; bodyDeadline moves it on with
// every read that brings data. An upload that keeps sending, for longer in
// all than BodyReadTimeout but never pausing that long, is imported whole;
// one that stops sending is cut off once BodyReadTimeout has passed
// without data, answered, and imports nothing. The test paces the steady
// upload far inside the deadline and waits for answers; it times nothing.
func TestUploadDeadlineRolls(t *testing.T) {
	t.Parallel()
	const d = 2 * time.Second
	ta := newTestAppWith(t, dbtest.SQLite, nil, func(c *Config) { c.BodyReadTimeout = d })

	steady := ta.product(t, 100)
	u := startUpload(t, ta, steady.ID)
	lines := 0
	for start := time.Now(); time.Since(start) < 2*d; lines++ {
		u.send(fmt.Sprintf("STEADY-%05d\n", lines))
		time.Sleep(d / 40) // pacing, far below the deadline
	}
	u.finish()
	if status, body := u.answer(); status != 200 || !strings.Contains(body, fmt.Sprintf(`"imported":%d`, lines)) {
		t.Fatalf("a steady upload of %d lines over twice the body deadline: %d %s", lines, status, body)
	}

	stalled := ta.product(t, 100)
	u = startUpload(t, ta, stalled.ID)
	u.send("STALLED-1\nSTALLED-2\n")
	status, body := u.answer() // the upload never goes on
	if status != http.StatusRequestTimeout {
		t.Errorf("a stalled upload: %d %s, want 408 as for any slow body", status, body)
	}
	counts, err := ta.ledger.StockCounts(t.Context(), stalled.ID)
	if err != nil {
		t.Fatal(err)
	}
	if c := counts[stalled.ID]; c.Lockable != 0 {
		t.Fatalf("a stalled upload imported %d cards", c.Lockable)
	}
	t.Logf("steady upload: %d lines; stalled upload: %d %s", lines, status, body)
}

// TestSlowBodyCannotDodgeTheDeadline: two ways around the body deadline,
// each open to anyone on any route (the webhook here). The deadline moved
// on with every read of any multipart body; and a request with an Upgrade
// header got no deadline at all, since a WebSocket must not inherit one,
// yet the server reads up to 256 KB of a body its handler left unread
// before it answers. Either way a byte every few seconds held a
// connection for days. Only an admin's file upload keeps reading now, and
// only a request without a body goes without a deadline. The test keeps
// sending, far faster than the deadline, until it is answered; it times
// nothing.
func TestSlowBodyCannotDodgeTheDeadline(t *testing.T) {
	t.Parallel()
	const d = time.Second
	ta := newTestAppWith(t, dbtest.SQLite, nil, func(c *Config) { c.BodyReadTimeout = d })
	for _, c := range []struct{ path, headers string }{
		{"/webhooks/sandbox", "Content-Type: multipart/form-data; boundary=x\r\n"},
		{"/graphql", "Content-Type: multipart/form-data; boundary=x\r\n"},
		{"/webhooks/sandbox", "Content-Type: application/json\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"},
		{"/graphql", "Content-Type: application/json\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"},
	} {
		conn, err := net.Dial("tcp", strings.TrimPrefix(ta.srv.URL, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: kami.test\r\n%sContent-Length: 60000\r\n\r\n", c.path, c.headers)
		answered := make(chan struct{})
		go func() {
			defer close(answered)
			conn.SetReadDeadline(time.Now().Add(2 * time.Minute)) // a guard against hanging, not a measure
			if res, err := http.ReadResponse(bufio.NewReader(conn), nil); err == nil {
				res.Body.Close()
			}
		}()
		// A byte at a time, twenty times faster than the deadline, for up
		// to sixty deadlines: only a deadline that keeps moving, or none,
		// lasts.
		cut := false
		for start := time.Now(); !cut && time.Since(start) < 60*d; {
			select {
			case <-answered:
				cut = true
			case <-time.After(d / 20):
				if _, err := conn.Write([]byte("a")); err != nil {
					cut = true
				}
			}
		}
		if !cut {
			t.Errorf("%s with %q: a body sent a byte at a time held the connection for sixty body deadlines", c.path, c.headers)
		}
	}
}

// TestSlowReaderIsCut: a response waited for its client without end. A
// client that asked for a large answer (the introspection, 100 KB) and
// never read it held the handler's goroutine and the answer's bytes for as
// long as it kept the connection: 200 such connections held 200
// goroutines for minutes. Every write of a response now has WriteTimeout
// to reach the client; a client that takes far longer is cut off. The test
// reads at a trickle and waits for the end; it times nothing.
func TestSlowReaderIsCut(t *testing.T) {
	t.Parallel()
	const d = time.Second
	ta := newTestAppWith(t, dbtest.SQLite, nil, func(c *Config) { c.WriteTimeout = d })
	body, _ := json.Marshal(map[string]any{"query": introspection.Query})
	full := ta.graphql(t, introspection.Query, nil)
	if full.Status != 200 || len(full.Data) < 50_000 {
		t.Fatalf("the introspection: %d, %d bytes", full.Status, len(full.Data))
	}
	// The same server with small socket buffers on both sides, as on a
	// slow network: on the loopback the kernel would take the whole answer
	// at once, and the client's trickle would only drain the kernel.
	small := httptest.NewUnstartedServer(ta.handler)
	small.Config.ConnState = func(c net.Conn, st http.ConnState) {
		if st == http.StateNew {
			c.(*net.TCPConn).SetWriteBuffer(4096)
		}
	}
	small.Start()
	defer small.Close()
	conn, err := net.Dial("tcp", strings.TrimPrefix(small.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.(*net.TCPConn).SetReadBuffer(1024)
	fmt.Fprintf(conn, "POST /graphql HTTP/1.1\r\nHost: kami.test\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	// 256 bytes every d/20 (5 KB per d): the answer would take twenty
	// deadlines to read; its end comes first. A guard against hanging of
	// sixty deadlines, not a measure.
	got, buf := 0, make([]byte, 256)
	var readErr error
	for start := time.Now(); readErr == nil && got < len(full.Data) && time.Since(start) < 60*d; {
		time.Sleep(d / 20)
		conn.SetReadDeadline(time.Now().Add(time.Minute))
		var n int
		n, readErr = conn.Read(buf)
		got += n
	}
	if readErr == nil || got >= len(full.Data) {
		t.Fatalf("a client reading 5 KB per write deadline got %d bytes of a %d-byte answer (%v), want it cut off", got, len(full.Data), readErr)
	}
	t.Logf("a slow reader got %d bytes of a %d-byte answer, then %v", got, len(full.Data), readErr)
}
