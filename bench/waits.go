package main

import (
	"context"
	"fmt"
	"math"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/uptrace/bun"
)

// WaitsReport says, for each tenth of a phase (place, direct), how busy the
// machine was and what the database sessions of kami's database were
// doing, sampled every 100 ms: a tenth whose orders/s falls off then shows
// whether the machine was busy (CPU) or the database waited (on a row lock,
// on the WAL's fsync behind a checkpoint, on I/O). PostgreSQL only.
type WaitsReport struct {
	// Sessions is, per tenth, the average number of kami's database
	// sessions in each state: "running" (active, not waiting), "idle in
	// transaction" (waiting for kami), or the wait event of an active one
	// ("IO:WALSync", "LWLock:WALWrite", "Lock:transactionid", ...).
	Sessions []map[string]float64 `json:"sessions_by_tenth"`
	// Busy is the share of the machine's CPU in use, per tenth.
	Busy []float64 `json:"machine_busy_by_tenth"`
	// Checkpoints is how many checkpoints the server started, per tenth
	// (any database's: DROP DATABASE forces one).
	Checkpoints []int `json:"checkpoints_by_tenth"`
}

type waitSample struct {
	at          time.Time
	states      map[string]int
	busy, total int64
	checkpoints int64
}

// waitSampler samples until stopped.
type waitSampler struct {
	stop    context.CancelFunc
	done    chan struct{}
	mu      sync.Mutex
	samples []waitSample
}

// waitEvery is how often the place and direct phases, and the rounds'
// chunks, sample waits.
const waitEvery = 100 * time.Millisecond

// sampleWaits starts sampling kami's database db every interval; nil when
// db is not PostgreSQL.
func sampleWaits(ctx context.Context, db *bun.DB, every time.Duration) *waitSampler {
	if db == nil || db.Dialect().Name().String() != "pg" {
		return nil
	}
	ctx, stop := context.WithCancel(ctx)
	s := &waitSampler{stop: stop, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			if smp, err := takeWaitSample(ctx, db); err == nil {
				s.mu.Lock()
				s.samples = append(s.samples, smp)
				s.mu.Unlock()
			}
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
	return s
}

func takeWaitSample(ctx context.Context, db *bun.DB) (waitSample, error) {
	smp := waitSample{at: time.Now(), states: map[string]int{}}
	smp.busy, smp.total = machineCPU()
	var rows []struct {
		State string `bun:"state"`
		Wait  string `bun:"wait"`
	}
	if err := db.NewRaw(`SELECT coalesce(state, '') AS state, coalesce(wait_event_type || ':' || wait_event, '') AS wait
		FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() AND state <> 'idle'`).Scan(ctx, &rows); err != nil {
		return smp, err
	}
	for _, r := range rows {
		switch {
		case r.State == "active" && r.Wait == "":
			smp.states["running"]++
		case r.State == "active":
			smp.states[r.Wait]++
		default: // idle in transaction: the session waits for kami
			smp.states[r.State]++
		}
	}
	err := db.NewRaw("SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter").Scan(ctx, &smp.checkpoints)
	return smp, err
}

// Stop ends the sampling and reports the samples of [start, start+wall)
// by tenth.
func (s *waitSampler) Stop(start time.Time, wall time.Duration) *WaitsReport {
	if s == nil {
		return nil
	}
	s.stop()
	<-s.done
	if wall <= 0 {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	rep := &WaitsReport{Sessions: make([]map[string]float64, 10), Busy: make([]float64, 10), Checkpoints: make([]int, 10)}
	n := make([]int, 10)
	first := make([]*waitSample, 10)
	last := make([]*waitSample, 10)
	var prev *waitSample
	for i := range s.samples {
		smp := &s.samples[i]
		off := smp.at.Sub(start)
		if off < 0 || off >= wall {
			prev = smp
			continue
		}
		k := min(int(int64(off)*10/int64(wall)), 9)
		if rep.Sessions[k] == nil {
			rep.Sessions[k] = map[string]float64{}
		}
		for st, c := range smp.states {
			rep.Sessions[k][st] += float64(c)
		}
		n[k]++
		if first[k] == nil {
			first[k] = prev
			if first[k] == nil {
				first[k] = smp
			}
		}
		last[k] = smp
		prev = smp
	}
	for k := range 10 {
		for st := range rep.Sessions[k] {
			rep.Sessions[k][st] = math.Round(rep.Sessions[k][st]/float64(n[k])*10) / 10
		}
		if first[k] != nil && last[k].total > first[k].total {
			rep.Busy[k] = math.Round(float64(last[k].busy-first[k].busy)/float64(last[k].total-first[k].total)*100) / 100
			rep.Checkpoints[k] = int(last[k].checkpoints - first[k].checkpoints)
		}
	}
	return rep
}

// fmtTenth is one tenth's sessions, the most common state first:
// "run 1.2 WALSync .8" (wait events without their type).
func fmtTenth(states map[string]float64) string {
	type kv struct {
		k string
		v float64
	}
	var kvs []kv
	for k, v := range states {
		if v >= 0.1 {
			kvs = append(kvs, kv{k, v})
		}
	}
	sort.Slice(kvs, func(i, j int) bool { return kvs[i].v > kvs[j].v || kvs[i].v == kvs[j].v && kvs[i].k < kvs[j].k })
	if len(kvs) > 3 {
		kvs = kvs[:3]
	}
	parts := make([]string, 0, len(kvs))
	for _, e := range kvs {
		name := e.k
		switch {
		case name == "running":
			name = "run"
		case name == "idle in transaction":
			name = "idle-in-tx"
		default:
			if i := strings.IndexByte(name, ':'); i >= 0 {
				name = name[i+1:]
			}
		}
		parts = append(parts, fmt.Sprintf("%s %.1f", name, e.v))
	}
	if len(parts) == 0 {
		return "-"
	}
	return strings.Join(parts, " ")
}
