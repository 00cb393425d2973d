package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"kami/domain/dbtest"
	"kami/providers/sandbox"
)

// playgroundJS drives the GraphiQL page: its editors are CodeMirror 5
// instances, reachable from their elements.
const playgroundJS = `
window.kamiTest = {
  editor(selector) { return document.querySelector(selector).CodeMirror; },
  query() { return this.editor('.graphiql-query-editor .CodeMirror'); },
  variables() { return document.querySelectorAll('.graphiql-editor-tool .CodeMirror')[0].CodeMirror; },
  headers() { return document.querySelectorAll('.graphiql-editor-tool .CodeMirror')[1].CodeMirror; },
  response() { return this.editor('.graphiql-response .CodeMirror'); },
  // select puts the cursor inside the named operation: Ctrl-Enter then
  // runs that one.
  select(operation) {
    const q = this.query();
    const line = q.getValue().split('\n').findIndex((l) => new RegExp('^(query|mutation|subscription) ' + operation + '\\b').test(l));
    if (line < 0) throw new Error('no operation ' + operation + ' in the editor');
    this.response().setValue('');
    q.focus();
    q.setCursor({ line: line + 1, ch: 2 });
  },
};
true
`

// TestPlaygroundInBrowser opens the playground in headless Chromium with
// every outside address unreachable, runs the example document's
// operations from the page (the subscription over the page's WebSocket),
// pays the order meanwhile, and sees the code delivered in the page. No
// request goes anywhere but kami. The screenshot's path is logged.
func TestPlaygroundInBrowser(t *testing.T) {
	t.Parallel()
	chromiumPath(t) // skip (or fail in CI) before starting anything
	ta := newTestApp(t, dbtest.SQLite, nil)
	origin := ta.srv.URL // http://127.0.0.1:port

	// Anything not on the loopback goes to this proxy, which counts it
	// and hangs up; names other than 127.0.0.1 do not resolve at all.
	proxy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { proxy.Close() })
	var proxiedMu sync.Mutex
	var proxied []string // the first line of each request that reached it
	go func() {
		for {
			c, err := proxy.Accept()
			if err != nil {
				return
			}
			c.SetReadDeadline(time.Now().Add(5 * time.Second))
			line, _ := bufio.NewReader(c).ReadString('\n')
			c.Close()
			proxiedMu.Lock()
			proxied = append(proxied, strings.TrimSpace(line))
			proxiedMu.Unlock()
		}
	}()

	var mu sync.Mutex
	var requests, problems []string
	onEvent := func(method, _ string, params json.RawMessage) {
		var p struct {
			Request struct{ URL string } `json:"request"`
			URL     string               `json:"url"`
			Entry   struct {
				Level, Text, URL string
			} `json:"entry"`
			Type             string `json:"type"`
			ExceptionDetails struct {
				Text      string `json:"text"`
				Exception struct {
					Description string `json:"description"`
				} `json:"exception"`
			} `json:"exceptionDetails"`
		}
		json.Unmarshal(params, &p)
		mu.Lock()
		defer mu.Unlock()
		switch method {
		case "Network.requestWillBeSent":
			requests = append(requests, p.Request.URL)
		case "Network.webSocketCreated":
			requests = append(requests, p.URL)
		case "Log.entryAdded":
			if p.Entry.Level == "error" {
				problems = append(problems, "log: "+p.Entry.Text+" "+p.Entry.URL)
			}
		case "Runtime.exceptionThrown":
			problems = append(problems, "exception: "+p.ExceptionDetails.Text+" "+p.ExceptionDetails.Exception.Description)
		}
	}
	b := launchChromium(t, onEvent,
		"--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
		"--proxy-server=http://"+proxy.Addr().String())
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	pg, err := b.newPage(ctx)
	if err != nil {
		t.Fatal(err)
	}
	saveScreenshot := func(what string) {
		shot, err := pg.screenshot(context.WithoutCancel(ctx))
		if err != nil {
			t.Logf("no screenshot: %v", err)
			return
		}
		f, err := os.CreateTemp("", "kami-playground-*.png")
		if err != nil {
			t.Fatal(err)
		}
		f.Write(shot)
		f.Close()
		t.Logf("screenshot of the playground %s: %s", what, f.Name())
	}
	t.Cleanup(func() {
		if t.Failed() {
			saveScreenshot("when the test failed")
		}
	})
	if err := pg.navigate(ctx, origin+"/"); err != nil {
		t.Fatal(err)
	}
	waitIn := func(what, expression string, out any) {
		t.Helper()
		var last string
		waitFor(t, time.Minute, what, func() bool {
			var v json.RawMessage
			if err := pg.eval(ctx, expression, &v); err != nil {
				last = err.Error()
				return false
			}
			last = string(v)
			if len(v) == 0 || string(v) == "null" || string(v) == "false" || string(v) == `""` {
				return false
			}
			if out != nil {
				if err := json.Unmarshal(v, out); err != nil {
					last = err.Error()
					return false
				}
			}
			return true
		}, func() string { return last })
	}
	waitIn("GraphiQL renders its editors", `document.querySelectorAll('.graphiql-container .CodeMirror').length >= 4`, nil)
	if err := pg.eval(ctx, playgroundJS, nil); err != nil {
		t.Fatal(err)
	}
	var example string
	if err := pg.eval(ctx, `kamiTest.query().getValue()`, &example); err != nil || !strings.Contains(example, "data/admin_token") {
		t.Fatalf("the editor does not open on the walk-through: %q %v", example, err)
	}

	// run runs one of the example's operations from the page and waits for
	// the response pane to show data (or the wanted payload).
	run := func(operation, until string, out any) {
		t.Helper()
		if err := pg.eval(ctx, fmt.Sprintf(`kamiTest.select(%q)`, operation), nil); err != nil {
			t.Fatal(err)
		}
		if err := pg.ctrlEnter(ctx); err != nil {
			t.Fatal(err)
		}
		var text string
		waitIn(operation+" answers", fmt.Sprintf(`(() => { const v = kamiTest.response().getValue(); return v.includes(%q) ? v : ""; })()`, until), &text)
		var resp struct {
			Data   json.RawMessage
			Errors []struct{ Message string }
		}
		if err := json.Unmarshal([]byte(text), &resp); err != nil || len(resp.Errors) > 0 {
			t.Fatalf("%s: %s", operation, text)
		}
		if out != nil {
			if err := json.Unmarshal(resp.Data, out); err != nil {
				t.Fatalf("%s: %s: %v", operation, text, err)
			}
		}
	}
	setEditor := func(editor string, v any) {
		t.Helper()
		raw, _ := json.Marshal(v)
		if err := pg.eval(ctx, fmt.Sprintf(`kamiTest.%s().setValue(%q)`, editor, raw), nil); err != nil {
			t.Fatal(err)
		}
	}

	// The walk-through, as the comment at its top says to do it.
	setEditor("headers", map[string]string{"Authorization": "Bearer " + testAdminToken})
	var created struct{ CreateProduct struct{ ID string } }
	run("CreateProduct", `"createProduct"`, &created)
	setEditor("variables", map[string]string{"productId": created.CreateProduct.ID})
	var imported struct{ ImportCards struct{ Imported int } }
	run("ImportCards", `"importCards"`, &imported)
	if imported.ImportCards.Imported != 2 {
		t.Fatalf("imported %+v", imported)
	}
	setEditor("headers", map[string]string{}) // the buyer has no token
	var placed struct {
		CreateOrder struct {
			Order       struct{ OrderNo, Status string }
			AccessToken string
			Payment     struct {
				URL    string
				QRCode *string
			}
		}
	}
	run("CreateOrder", `"createOrder"`, &placed)
	co := placed.CreateOrder
	if co.Order.Status != "PENDING" || co.AccessToken == "" || co.Payment.QRCode != nil || !strings.Contains(co.Payment.URL, "/sandbox/pay/"+co.Order.OrderNo) {
		t.Fatalf("createOrder %+v", co)
	}
	setEditor("variables", map[string]string{"productId": created.CreateProduct.ID, "orderNo": co.Order.OrderNo, "accessToken": co.AccessToken})
	run("Order", `"PENDING"`, nil)

	// The subscription runs over the page's WebSocket: it shows PENDING,
	// then PAID with the code once the sandbox notification lands.
	run("FollowOrder", `"PENDING"`, nil)
	o, err := ta.ledger.Order(ctx, co.Order.OrderNo)
	if err != nil {
		t.Fatal(err)
	}
	h, body := sandbox.Signed("test-secret", sandbox.PaymentNotification(o.OrderNo, "SB-PLAYGROUND", o.AmountFen, time.Now()))
	if status, resp := ta.post(t, "/webhooks/sandbox", h, body); status != 200 {
		t.Fatalf("payment: %d %s", status, resp)
	}
	var followed struct {
		OrderStatusChanged struct {
			Status string
			Cards  []string
		}
	}
	waitIn("the subscription shows the order PAID", `(() => { const v = kamiTest.response().getValue(); return v.includes('"PAID"') ? v : ""; })()`, nil)
	var text string
	if err := pg.eval(ctx, `kamiTest.response().getValue()`, &text); err != nil {
		t.Fatal(err)
	}
	var resp struct{ Data json.RawMessage }
	if json.Unmarshal([]byte(text), &resp) != nil || json.Unmarshal(resp.Data, &followed) != nil ||
		len(followed.OrderStatusChanged.Cards) != 1 || !strings.HasPrefix(followed.OrderStatusChanged.Cards[0], "STEAM-50-") {
		t.Fatalf("subscription result %s", text)
	}

	saveScreenshot("after the walk-through")

	mu.Lock()
	defer mu.Unlock()
	wsOrigin := "ws" + strings.TrimPrefix(origin, "http")
	sawSocket := false
	for _, u := range requests {
		switch {
		case strings.HasPrefix(u, origin+"/"), strings.HasPrefix(u, "data:"), u == "about:blank":
		case strings.HasPrefix(u, wsOrigin+"/graphql"):
			sawSocket = true
		default:
			t.Errorf("the page asked for %s, which is not kami", u)
		}
	}
	if !sawSocket {
		t.Errorf("the subscription did not use the page's WebSocket; requests: %v", requests)
	}
	proxiedMu.Lock()
	defer proxiedMu.Unlock()
	for _, r := range proxied {
		if host := proxiedHost(r); chromiumServices[host] {
			// Chromium's own updater and sign-in call home whatever the
			// flags; no page asked for them (the page's requests are all
			// checked above) and none got anywhere.
			t.Logf("Chromium itself tried %s (refused)", host)
			continue
		}
		t.Errorf("a request tried to leave the machine: %q", r)
	}
	for _, p := range problems {
		t.Errorf("page problem: %s", p)
	}
}

// waitFor waits until cond holds, polling; past within it fails with what
// and the last thing cond saw.
func waitFor(t *testing.T, within time.Duration, what string, cond func() bool, last func() string) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not within %s: %s (last seen: %.500s)", within, what, last())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// chromiumServices are the hosts Chromium calls for itself (component
// updates, sign-in) even with background networking off.
var chromiumServices = map[string]bool{
	"update.googleapis.com": true, "accounts.google.com": true, "clients2.google.com": true,
	"content-autofill.googleapis.com": true, "optimizationguide-pa.googleapis.com": true,
}

// proxiedHost is the host a proxy request line names: "CONNECT host:443
// HTTP/1.1" or "GET http://host/path HTTP/1.1".
func proxiedHost(line string) string {
	fields := strings.Fields(line)
	if len(fields) < 2 {
		return ""
	}
	target := strings.TrimPrefix(strings.TrimPrefix(fields[1], "http://"), "https://")
	host, _, _ := strings.Cut(target, "/")
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	return host
}
