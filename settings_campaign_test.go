package main

import (
	"strings"
	"testing"
	"time"

	"kami/domain/dbtest"
	"kami/domain/domaintest"
)

// TestCampaignSettings: the settings the fault campaign (chaos/) runs kami
// with: the sweep interval, the queue lease, the pre-close recheck and the
// test-only clock skew,
// with their defaults, and a bad value refused naming the setting.
func TestCampaignSettings(t *testing.T) {
	t.Parallel()
	c, err := loadConfig(env{}.get)
	if err != nil {
		t.Fatal(err)
	}
	if c.Workers.SweepEvery != time.Minute || c.Workers.Lease != 30*time.Second || c.ClockSkew != 0 || c.CloseCheckRetry != time.Minute {
		t.Fatalf("defaults: sweep %s, lease %s, skew %s, check retry %s", c.Workers.SweepEvery, c.Workers.Lease, c.ClockSkew, c.CloseCheckRetry)
	}
	c, err = loadConfig(env{"KAMI_SWEEP_EVERY": "5s", "KAMI_QUEUE_LEASE": "7s", "KAMI_FAULT_CLOCK_SKEW": "-3s", "KAMI_CLOSE_CHECK_RETRY": "4s"}.get)
	if err != nil {
		t.Fatal(err)
	}
	if c.Workers.SweepEvery != 5*time.Second || c.Workers.Lease != 7*time.Second || c.ClockSkew != -3*time.Second || c.CloseCheckRetry != 4*time.Second {
		t.Fatalf("sweep %s, lease %s, skew %s, check retry %s", c.Workers.SweepEvery, c.Workers.Lease, c.ClockSkew, c.CloseCheckRetry)
	}
	for name, value := range map[string]string{"KAMI_SWEEP_EVERY": "0s", "KAMI_QUEUE_LEASE": "forever", "KAMI_FAULT_CLOCK_SKEW": "2h", "KAMI_CLOSE_CHECK_RETRY": "1ms"} {
		if _, err := loadConfig(env{name: value}.get); err == nil || !strings.Contains(err.Error(), name) {
			t.Errorf("%s=%q: error %v does not name it", name, value, err)
		}
	}

	// The skew moves the ledger's clock, which the workers judge due times
	// by.
	c, err = loadConfig(env{"KAMI_FAULT_CLOCK_SKEW": "1h", "KAMI_DATA_DIR": t.TempDir()}.get)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.ensureSecrets(); err != nil {
		t.Fatal(err)
	}
	l, err := newLedger(c, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Until(l.Now()); d < 59*time.Minute || d > 61*time.Minute {
		t.Fatalf("the ledger's clock is %s off, want 1h", d)
	}
}

// TestClockSkewWarnedAtStart: a process started with KAMI_FAULT_CLOCK_SKEW
// (test-only, the fault campaign's) says so at error level, naming the
// setting; one started without it says nothing of it. Before, a shop that
// set it by mistake ran with a skewed clock and no word in its log.
func TestClockSkewWarnedAtStart(t *testing.T) {
	t.Parallel()
	for _, skew := range []string{"", "3s"} {
		var logs domaintest.LogBuffer
		newTestAppLogging(t, dbtest.SQLite, env{"KAMI_FAULT_CLOCK_SKEW": skew}, nil, &logs)
		var warned []string
		for _, line := range strings.Split(logs.String(), "\n") {
			if strings.Contains(line, "KAMI_FAULT_CLOCK_SKEW") {
				warned = append(warned, line)
			}
		}
		switch {
		case skew == "" && len(warned) > 0:
			t.Errorf("no skew set, yet the start logged %q", warned)
		case skew != "" && (len(warned) != 1 || !strings.Contains(warned[0], `"level":"ERROR"`) ||
			!strings.Contains(warned[0], "fault campaign") || !strings.Contains(warned[0], `"setting":"KAMI_FAULT_CLOCK_SKEW"`)):
			t.Errorf("KAMI_FAULT_CLOCK_SKEW=%s: start logged %q, want one ERROR line naming the setting and the fault campaign", skew, warned)
		}
	}
}
