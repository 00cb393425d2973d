package main

import (
	"bytes"
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/alicebob/miniredis/v2"
)

// TestReconcileCommandRefusesTheEmbeddedRedis: on the in-process Redis the
// command would repair a Redis nobody else sees; it says so and does
// nothing.
func TestReconcileCommandRefusesTheEmbeddedRedis(t *testing.T) {
	t.Parallel()
	// Blank (spaces only) is unset too: Connect trims it and starts the
	// in-process Redis.
	for _, unset := range []string{"", "  "} {
		var out, logs bytes.Buffer
		err := run(t.Context(), []string{"reconcile"}, env{"KAMI_DATA_DIR": t.TempDir(), "KAMI_REDIS_URL": unset}.get, &out, &logs)
		if !errors.Is(err, errReconcileNeedsRedis) {
			t.Fatalf("reconcile on the embedded Redis (KAMI_REDIS_URL %q): %v", unset, err)
		}
		for _, want := range []string{"KAMI_REDIS_URL", "every night", "KAMI_RECONCILE_CRON"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("the refusal does not mention %s: %v", want, err)
			}
		}
		if out.Len() > 0 || strings.Contains(logs.String(), "reconcile") {
			t.Errorf("KAMI_REDIS_URL %q: it ran anyway: stdout %q, log %q", unset, out.String(), logs.String())
		}
	}
}

// TestReconcileCommandSummaryOnce: `kami reconcile` on a shared Redis
// prints its summary once, not once on stdout and again in the log.
func TestReconcileCommandSummaryOnce(t *testing.T) {
	t.Parallel()
	m := miniredis.RunT(t) // stands in for the server's shared Redis
	var out, logs bytes.Buffer
	e := env{"KAMI_DATA_DIR": t.TempDir(), "KAMI_REDIS_URL": "redis://" + m.Addr()}
	if err := run(t.Context(), []string{"reconcile"}, e.get, &out, &logs); err != nil {
		t.Fatalf("reconcile: %v (log %s)", err, logs.String())
	}
	both := out.String() + logs.String()
	if n := strings.Count(both, "stragglers"); n != 1 || !strings.HasPrefix(out.String(), "reconcile: closed 0 stragglers") {
		t.Fatalf("summary printed %d times; stdout %q, log %q", n, out.String(), logs.String())
	}
}

// TestWelcome: the start tells a person where the playground is, where the
// admin token is kept, and that the sandbox is on; a generated token is
// shown on the start that made it only.
func TestWelcome(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	e := env{"KAMI_DATA_DIR": dir, "KAMI_ADDR": ":18080"}
	welcomeOf := func() (string, *Config) {
		cfg, err := loadConfig(e.get)
		if err != nil {
			t.Fatal(err)
		}
		if err := cfg.ensureSecrets(); err != nil {
			t.Fatal(err)
		}
		var w bytes.Buffer
		welcome(&w, cfg, []string{"sandbox"})
		return w.String(), cfg
	}
	first, cfg := welcomeOf()
	tokenFile := filepath.Join(dir, "admin_token")
	for _, want := range []string{"Open http://localhost:18080/ in a browser", tokenFile, "Bearer " + cfg.AdminToken,
		filepath.Join(dir, "card_key"), "sandbox payment provider is on", filepath.Join(dir, "sandbox_secret")} {
		if !strings.Contains(first, want) {
			t.Errorf("first start does not say %q:\n%s", want, first)
		}
	}
	again, _ := welcomeOf()
	if strings.Contains(again, cfg.AdminToken) || !strings.Contains(again, tokenFile) || strings.Contains(again, "card_key") {
		t.Errorf("second start:\n%s", again)
	}
	e["KAMI_ADMIN_TOKEN"] = "set-by-hand-0123456789abcdef0123456789"
	if byHand, _ := welcomeOf(); strings.Contains(byHand, "set-by-hand") || strings.Contains(byHand, tokenFile) {
		t.Errorf("with KAMI_ADMIN_TOKEN set:\n%s", byHand)
	}
}

// TestReturnLink: the pay page's way back is KAMI_RETURN_URL with the
// order number added, or kami's own order view; a bad setting is named.
func TestReturnLink(t *testing.T) {
	t.Parallel()
	c, err := loadConfig(env{"KAMI_ADDR": ":9000"}.get)
	if err != nil {
		t.Fatal(err)
	}
	if got := c.returnLink("2612010001"); got != "http://localhost:9000/?orderNo=2612010001" {
		t.Errorf("default return link %q", got)
	}
	c, err = loadConfig(env{"KAMI_RETURN_URL": "https://shop.example/orders?from=kami"}.get)
	if err != nil {
		t.Fatal(err)
	}
	if got := c.returnLink("2612010001"); got != "https://shop.example/orders?from=kami&orderNo=2612010001" {
		t.Errorf("return link %q", got)
	}
	for _, bad := range []string{"javascript:alert(1)", "/orders", "https://shop.example/#x", "ftp://shop.example/"} {
		if _, err := loadConfig(env{"KAMI_RETURN_URL": bad}.get); err == nil || !strings.Contains(err.Error(), "KAMI_RETURN_URL") {
			t.Errorf("KAMI_RETURN_URL=%q: %v", bad, err)
		}
	}
}
