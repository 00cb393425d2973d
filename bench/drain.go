package main

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/uptrace/bun"

	"kami/domain"
	"kami/queue"
)

// DrainReport is the backlog a restarted server finds: -drain orders
// fell due while kami was down, their closes waiting in Redis as kami
// scheduled them, and the time the restarted server takes to close them
// all (with the pre-close check, which asks the sandbox about each order).
type DrainReport struct {
	Orders       int     `json:"orders"`
	StartSeconds float64 `json:"start_seconds"` // process start to /readyz
	// WindowSeconds runs from /readyz to the last close.
	WindowSeconds float64      `json:"window_seconds"`
	ClosesPerSec  float64      `json:"closes_per_sec"`
	Close         *CloseReport `json:"close"`
	// RedisBytesPer10k is the close queue's memory (MEMORY USAGE) per
	// 10,000 pending orders scheduled on it.
	RedisBytesPer10k float64 `json:"redis_bytes_per_10k_pending"`
	// The restarted server's memory when ready and at its peak while it
	// drained.
	RSSReadyMiB float64 `json:"rss_ready_mib"`
	PeakMiB     float64 `json:"peak_mib"`
	CPU         CPUUse  `json:"cpu"`
}

// runDrain places n orders directly with a TTL of one second while the
// server is stopped, schedules their closes as the server would have,
// waits until all are due, starts the server and measures the drain.
// It returns the restarted server.
func runDrain(ctx context.Context, db *bun.DB, rdb redis.UniversalClient, keys queue.Keys, runID string, n, conc int,
	start func(context.Context) (*serverProc, error), probe cpuProbe, prof *profiler, profileFor time.Duration) (*DrainReport, *serverProc, error) {
	ledger, err := directLedger(db, time.Second)
	if err != nil {
		return nil, nil, err
	}
	name := "bench-direct-" + runID + "-drain"
	if d, _, err := runDirect(ctx, ledger, runID+"-drain", n, conc, cpuProbe{}, nil, false); err != nil {
		return nil, nil, err
	} else if d.OK != n {
		return nil, nil, fmt.Errorf("placed %d of %d backlog orders: %v", d.OK, n, d.Errors)
	}
	var due []struct {
		OrderNo   string    `bun:"order_no"`
		ExpiresAt time.Time `bun:"expires_at"`
	}
	var productID int64
	if err := db.NewSelect().Table("products").Column("id").Where("name = ?", name).Scan(ctx, &productID); err != nil {
		return nil, nil, err
	}
	if err := db.NewSelect().Table("orders").Column("order_no", "expires_at").Where("product_id = ?", productID).
		Where("status = ?", domain.OrderPending).Scan(ctx, &due); err != nil {
		return nil, nil, err
	}
	items := make([]queue.Item, len(due))
	last := time.Time{}
	for i, o := range due {
		items[i] = queue.Item{Member: o.OrderNo, Due: o.ExpiresAt}
		if o.ExpiresAt.After(last) {
			last = o.ExpiresAt
		}
	}
	q := queue.CloseQueue(rdb, keys)
	memBefore, _ := rdb.MemoryUsage(ctx, q.Key()).Result()
	if _, err := q.ScheduleIfAbsent(ctx, items); err != nil {
		return nil, nil, err
	}
	memAfter, _ := rdb.MemoryUsage(ctx, q.Key()).Result()
	rep := &DrainReport{Orders: len(due), RedisBytesPer10k: float64(memAfter-memBefore) / float64(max(1, len(due))) * 10000}
	select { // every order due before the server starts
	case <-time.After(time.Until(last) + time.Second):
	case <-ctx.Done():
		return nil, nil, ctx.Err()
	}
	t0 := time.Now()
	srv, err := start(ctx)
	if err != nil {
		return nil, nil, err
	}
	ready := time.Now()
	rep.StartSeconds = ready.Sub(t0).Seconds()
	probe.serverPID = srv.pid()
	if kib, err := procStatusKiB(srv.pid(), "VmRSS"); err == nil {
		rep.RSSReadyMiB = float64(kib) / 1024
	}
	cpu0 := probe.take()
	var drainCPU func() error
	if prof != nil {
		drainCPU = prof.cpu(ctx, profileFor, "cpu-drain.pprof")
	}
	cr, err := waitForCloses(ctx, db, productID, len(due), ready)
	if drainCPU != nil {
		if perr := drainCPU(); perr != nil && err == nil {
			err = perr
		}
	}
	if err != nil {
		return nil, srv, err
	}
	rep.CPU = cpuUse(cpu0, probe.take())
	rep.Close = cr
	if !cr.lastClose.IsZero() {
		window := cr.lastClose.Sub(ready)
		rep.WindowSeconds = window.Seconds()
		rep.ClosesPerSec = rate(cr.Closed, window)
	}
	if kib, err := procStatusKiB(srv.pid(), "VmHWM"); err == nil {
		rep.PeakMiB = float64(kib) / 1024
	}
	return rep, srv, nil
}
