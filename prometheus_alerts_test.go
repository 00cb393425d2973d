package main

import (
	"os/exec"
	"testing"
)

// TestPrometheusAlertRules checks prometheus-alerts.yml with promtool and
// runs its unit tests, prometheus-alerts.test.yml: each rule's expression
// evaluated over series shaped as kami exports them (the order mails
// waiting on an unreachable SMTP server across the backoff's longest
// step, among others).
func TestPrometheusAlertRules(t *testing.T) {
	t.Parallel()
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		missingTool(t, "promtool", "install Prometheus's tools (Debian: apt-get install prometheus)")
	}
	for _, args := range [][]string{
		{"check", "rules", "prometheus-alerts.yml"},
		{"test", "rules", "prometheus-alerts.test.yml"},
	} {
		if out, err := exec.Command(promtool, args...).CombinedOutput(); err != nil {
			t.Errorf("promtool %v: %v\n%s", args, err, out)
		}
	}
}
