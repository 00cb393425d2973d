package main

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"kami/domain/dbtest"
)

// auditScript runs graphql-http's own audit (the reference
// implementation's auditServer) against the URL in argv and prints its
// results as JSON.
const auditScript = `
const { auditServer } = require('graphql-http');
auditServer({ url: process.argv[2] }).then(
  (results) => console.log(JSON.stringify(results.map((r) => ({ id: r.id, name: r.name, status: r.status, reason: r.reason || '' })))),
  (err) => { console.error(err); process.exit(1); },
);
`

// TestGraphQLOverHTTPAudit runs the GraphQL-over-HTTP audit suite on the
// whole server's /graphql: every MUST and every SHOULD passes.
func TestGraphQLOverHTTPAudit(t *testing.T) {
	t.Parallel()
	node, modules := nodeModules(t, "graphql-http")
	ta := newTestApp(t, dbtest.SQLite, nil)

	script := filepath.Join(t.TempDir(), "audit.js")
	if err := os.WriteFile(script, []byte(auditScript), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(t.Context(), node, script, ta.srv.URL+"/graphql")
	cmd.Env = append(os.Environ(), "NODE_PATH="+modules)
	cmd.Stderr = &strings.Builder{}
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("audit: %v\n%s", err, cmd.Stderr)
	}
	var results []struct{ ID, Name, Status, Reason string }
	if err := json.Unmarshal(out, &results); err != nil {
		t.Fatalf("audit output %q: %v", out, err)
	}
	passed := map[string]int{}
	total := map[string]int{}
	for _, r := range results {
		level := strings.Fields(r.Name)[0] // MUST, SHOULD or MAY
		total[level]++
		if r.Status == "ok" {
			passed[level]++
			continue
		}
		if level == "MAY" {
			t.Logf("%s (%s): %s", r.Name, r.Status, r.Reason)
			continue
		}
		t.Errorf("%s %s (%s): %s", r.ID, r.Name, r.Status, r.Reason)
	}
	if total["MUST"] == 0 || total["SHOULD"] == 0 {
		t.Fatalf("the audit ran no MUST or SHOULD checks: %s", out)
	}
	t.Logf("graphql-http audit: MUST %d/%d, SHOULD %d/%d, MAY %d/%d",
		passed["MUST"], total["MUST"], passed["SHOULD"], total["SHOULD"], passed["MAY"], total["MAY"])
}
