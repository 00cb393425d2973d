package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/coder/websocket"
)

// A small Chrome DevTools Protocol client for the browser tests: launch a
// headless Chromium, open a page, evaluate script in it, hear its events,
// take a screenshot. Only the few calls the tests make.

// chromiumFlags keep a test's Chromium to itself: no first-run work, no
// background traffic, no QUIC, a fresh profile.
var chromiumFlags = []string{"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
	"--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-default-apps",
	"--disable-extensions", "--mute-audio", "--no-default-browser-check", "--window-size=1400,900",
	// Chromium's own services that call home even so (network time,
	// updates, sign-in, autofill, optimization hints, safe browsing).
	"--disable-client-side-phishing-detection", "--disable-domain-reliability", "--no-pings",
	"--safebrowsing-disable-auto-update", "--allow-browser-signin=false", "--disable-field-trial-config",
	"--disable-features=NetworkTimeServiceQuerying,OptimizationHints,OptimizationHintsFetching,AutofillServerCommunication," +
		"CertificateTransparencyComponentUpdater,MediaRouter,Translate,SafeBrowsing,InterestFeedContentSuggestions,PrivacySandboxSettings4"}

// browser is one Chromium process and its DevTools connection.
type browser struct {
	cmd  *exec.Cmd
	conn *websocket.Conn

	mu      sync.Mutex
	nextID  int64
	pending map[int64]chan cdpMessage
	onEvent func(method, sessionID string, params json.RawMessage)
	readErr error
}

type cdpMessage struct {
	ID        int64           `json:"id,omitempty"`
	Method    string          `json:"method,omitempty"`
	Params    json.RawMessage `json:"params,omitempty"`
	SessionID string          `json:"sessionId,omitempty"`
	Result    json.RawMessage `json:"result,omitempty"`
	Error     *struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	} `json:"error,omitempty"`
}

// chromiumPath finds Chromium (KAMI_TEST_CHROMIUM, or chromium on PATH).
func chromiumPath(t *testing.T) string {
	t.Helper()
	names := []string{"chromium", "chromium-browser"}
	if p := os.Getenv("KAMI_TEST_CHROMIUM"); p != "" {
		names = []string{p}
	}
	for _, name := range names {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	missingTool(t, "chromium", "install it (Debian: apt-get install chromium) or set KAMI_TEST_CHROMIUM")
	return ""
}

// launchChromium starts Chromium with flags added to chromiumFlags and
// connects to it. It is stopped when the test ends. onEvent hears every
// event, on the connection's reader: it must not block.
func launchChromium(t *testing.T, onEvent func(method, sessionID string, params json.RawMessage), flags ...string) *browser {
	t.Helper()
	profile := t.TempDir()
	args := append(append(append([]string{}, chromiumFlags...), "--user-data-dir="+profile, "--remote-debugging-port=0"), flags...)
	args = append(args, "about:blank")
	cmd := exec.Command(chromiumPath(t), args...)
	// Its own process group, so that its helpers (renderer, GPU, crash
	// handler) end with it, before the profile folder is removed.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start chromium: %v", err)
	}
	var b *browser
	t.Cleanup(func() {
		exited := make(chan struct{})
		go func() { cmd.Wait(); close(exited) }()
		if b != nil { // ask first: Chromium then ends its helpers itself
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			b.call(ctx, "", "Browser.close", map[string]any{}, nil)
			cancel()
		}
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
		}
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-exited
	})
	// Chromium says where DevTools listens on stderr: "DevTools listening on ws://…".
	wsURL := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			if _, u, ok := strings.Cut(sc.Text(), "DevTools listening on "); ok {
				wsURL <- strings.TrimSpace(u)
			}
		}
		close(wsURL)
	}()
	var u string
	select {
	case got, ok := <-wsURL:
		if !ok {
			t.Fatalf("chromium exited before DevTools listened (profile %s)", filepath.Base(profile))
		}
		u = got
	case <-time.After(60 * time.Second):
		t.Fatal("chromium did not start DevTools within a minute")
	}
	conn, _, err := websocket.Dial(t.Context(), u, nil)
	if err != nil {
		t.Fatalf("devtools %s: %v", u, err)
	}
	conn.SetReadLimit(64 << 20) // screenshots
	b = &browser{cmd: cmd, conn: conn, pending: map[int64]chan cdpMessage{}, onEvent: onEvent}
	go b.read()
	return b
}

func (b *browser) read() {
	for {
		_, data, err := b.conn.Read(context.Background())
		if err != nil {
			b.mu.Lock()
			b.readErr = err
			for id, ch := range b.pending {
				close(ch)
				delete(b.pending, id)
			}
			b.mu.Unlock()
			return
		}
		var m cdpMessage
		if json.Unmarshal(data, &m) != nil {
			continue
		}
		if m.ID == 0 {
			if b.onEvent != nil {
				b.onEvent(m.Method, m.SessionID, m.Params)
			}
			continue
		}
		b.mu.Lock()
		ch := b.pending[m.ID]
		delete(b.pending, m.ID)
		b.mu.Unlock()
		if ch != nil {
			ch <- m
		}
	}
}

// call sends one command (to the page of sessionID, or to the browser
// when it is "") and decodes its result into out (may be nil).
func (b *browser) call(ctx context.Context, sessionID, method string, params, out any) error {
	raw, err := json.Marshal(params)
	if err != nil {
		return err
	}
	ch := make(chan cdpMessage, 1)
	b.mu.Lock()
	if b.readErr != nil {
		b.mu.Unlock()
		return b.readErr
	}
	b.nextID++
	id := b.nextID
	b.pending[id] = ch
	b.mu.Unlock()
	msg, _ := json.Marshal(cdpMessage{ID: id, Method: method, Params: raw, SessionID: sessionID})
	if err := b.conn.Write(ctx, websocket.MessageText, msg); err != nil {
		return err
	}
	select {
	case m, ok := <-ch:
		if !ok {
			return errors.New("devtools connection closed")
		}
		if m.Error != nil {
			return fmt.Errorf("%s: %s", method, m.Error.Message)
		}
		if out != nil {
			return json.Unmarshal(m.Result, out)
		}
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// page is one tab, attached in flat mode.
type page struct {
	b         *browser
	sessionID string
}

// newPage opens a blank tab and enables the domains whose events the tests
// read (Page, Network, Runtime, Log).
func (b *browser) newPage(ctx context.Context) (*page, error) {
	var target struct{ TargetID string }
	if err := b.call(ctx, "", "Target.createTarget", map[string]any{"url": "about:blank"}, &target); err != nil {
		return nil, err
	}
	var att struct{ SessionID string }
	if err := b.call(ctx, "", "Target.attachToTarget", map[string]any{"targetId": target.TargetID, "flatten": true}, &att); err != nil {
		return nil, err
	}
	p := &page{b: b, sessionID: att.SessionID}
	for _, domain := range []string{"Page", "Network", "Runtime", "Log"} {
		if err := b.call(ctx, p.sessionID, domain+".enable", map[string]any{}, nil); err != nil {
			return nil, err
		}
	}
	return p, nil
}

func (p *page) navigate(ctx context.Context, url string) error {
	var res struct{ ErrorText string }
	if err := p.b.call(ctx, p.sessionID, "Page.navigate", map[string]any{"url": url}, &res); err != nil {
		return err
	}
	if res.ErrorText != "" {
		return errors.New(res.ErrorText)
	}
	return nil
}

// eval runs expression in the page (awaiting a promise) and decodes its
// value into out (may be nil).
func (p *page) eval(ctx context.Context, expression string, out any) error {
	var res struct {
		Result struct {
			Value json.RawMessage `json:"value"`
		} `json:"result"`
		ExceptionDetails *struct {
			Text      string `json:"text"`
			Exception struct {
				Description string `json:"description"`
			} `json:"exception"`
		} `json:"exceptionDetails"`
	}
	if err := p.b.call(ctx, p.sessionID, "Runtime.evaluate", map[string]any{
		"expression": expression, "returnByValue": true, "awaitPromise": true}, &res); err != nil {
		return err
	}
	if d := res.ExceptionDetails; d != nil {
		return fmt.Errorf("script error: %s %s", d.Text, d.Exception.Description)
	}
	if out != nil && len(res.Result.Value) > 0 {
		return json.Unmarshal(res.Result.Value, out)
	}
	return nil
}

// screenshot returns the page as PNG.
func (p *page) screenshot(ctx context.Context) ([]byte, error) {
	var res struct{ Data []byte } // base64 in JSON: []byte decodes it
	err := p.b.call(ctx, p.sessionID, "Page.captureScreenshot", map[string]any{"format": "png"}, &res)
	return res.Data, err
}

// ctrlEnter presses Ctrl-Enter in the focused element, as a person would.
func (p *page) ctrlEnter(ctx context.Context) error {
	for _, typ := range []string{"rawKeyDown", "keyUp"} {
		if err := p.b.call(ctx, p.sessionID, "Input.dispatchKeyEvent", map[string]any{"type": typ, "modifiers": 2,
			"key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 13, "nativeVirtualKeyCode": 13}, nil); err != nil {
			return err
		}
	}
	return nil
}
