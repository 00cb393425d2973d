package main

import (
	"context"
	"fmt"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// PgbenchReport is the baseline: what PostgreSQL itself does on this
// machine in the same run, `pgbench -N` (TPC-B without the contended
// updates of branches and tellers: an INSERT and three UPDATEs per
// transaction, about what placing an order writes) with 16 clients on a
// scratch database.
type PgbenchReport struct {
	Command string  `json:"command"`
	TPS     float64 `json:"tps"`
	Error   string  `json:"error,omitempty"`
}

var pgbenchTPS = regexp.MustCompile(`(?m)^tps = ([0-9.]+)`)

// runPgbench initializes a scratch database on the PostgreSQL server of
// adminURL and runs pgbench -N on it for d; nil when pgbench is not
// installed.
func runPgbench(ctx context.Context, adminURL string, d time.Duration) *PgbenchReport {
	bin, err := exec.LookPath("pgbench")
	if err != nil {
		return nil
	}
	rep := &PgbenchReport{}
	dbURL, _, drop, err := freshPostgres(ctx, adminURL)
	if err != nil {
		rep.Error = err.Error()
		return rep
	}
	defer func() {
		if err := drop(); err != nil {
			progress("%v", err)
		}
	}()
	if out, err := exec.CommandContext(ctx, bin, "-i", "-q", "-s", "1", dbURL).CombinedOutput(); err != nil {
		rep.Error = fmt.Sprintf("pgbench -i: %v: %s", err, truncate(string(out), 300))
		return rep
	}
	args := []string{"-N", "-c", "16", "-j", "2", "-T", strconv.Itoa(max(1, int(d.Seconds()))), dbURL}
	rep.Command = "pgbench " + strings.Join(args[:len(args)-1], " ") + " <scratch database>"
	out, err := exec.CommandContext(ctx, bin, args...).CombinedOutput()
	if err != nil {
		rep.Error = fmt.Sprintf("pgbench: %v: %s", err, truncate(string(out), 300))
		return rep
	}
	m := pgbenchTPS.FindSubmatch(out)
	if m == nil {
		rep.Error = "no tps in pgbench's output: " + truncate(string(out), 300)
		return rep
	}
	rep.TPS, _ = strconv.ParseFloat(string(m[1]), 64)
	return rep
}
