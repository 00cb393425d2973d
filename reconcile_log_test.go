package main

import (
	"strings"
	"testing"

	"kami/domain/dbtest"
	"kami/domain/domaintest"
)

// TestRunReconciliationLogsItsSummary: an admin's runReconciliation writes
// the same one summary line to the log as the nightly run, naming who ran
// it. Before, only the nightly run (app.reconcile) logged it.
func TestRunReconciliationLogsItsSummary(t *testing.T) {
	t.Parallel()
	var logs domaintest.LogBuffer
	ta := newTestAppLogging(t, dbtest.SQLite, nil, nil, &logs)
	summaries := func() []string {
		var out []string
		for _, line := range strings.Split(logs.String(), "\n") {
			if strings.Contains(line, `"msg":"reconcile: closed `) {
				out = append(out, line)
			}
		}
		return out
	}
	var got struct {
		RunReconciliation struct{ Summary string }
	}
	ta.adminGraphQL(t, `mutation { runReconciliation { summary } }`, nil, &got)
	lines := summaries()
	if len(lines) != 1 || !strings.Contains(lines[0], got.RunReconciliation.Summary) || !strings.Contains(lines[0], `"by":`) {
		t.Fatalf("runReconciliation (summary %q) logged %q, want its one summary line with who ran it", got.RunReconciliation.Summary, lines)
	}
	// The nightly run goes through the same line.
	if _, err := ta.reconcile(t.Context()); err != nil {
		t.Fatal(err)
	}
	if lines := summaries(); len(lines) != 2 || strings.Contains(lines[1], `"by":`) {
		t.Fatalf("after the nightly run the log holds %q, want a second summary line, with no admin named", lines)
	}
}
