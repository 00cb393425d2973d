package main

import (
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
)

// statusCounts counts a product's orders by status, from the database.
func statusCounts(ctx context.Context, db *bun.DB, productID int64) (map[string]int, error) {
	var rows []struct {
		Status string `bun:"status"`
		N      int    `bun:"n"`
	}
	err := db.NewSelect().Table("orders").Column("status").ColumnExpr("COUNT(*) AS n").
		Where("product_id = ?", productID).Group("status").Scan(ctx, &rows)
	out := map[string]int{}
	for _, r := range rows {
		out[r.Status] = r.N
	}
	return out, err
}

// waitForCloses polls the database until no order of the product is
// PENDING (or ctx ends), then measures the closes from the rows:
// closes/s over first expiry → last close, and closed_at − expires_at.
func waitForCloses(ctx context.Context, db *bun.DB, productID int64, unpaid int, placeEnd time.Time) (*CloseReport, error) {
	rep := &CloseReport{Unpaid: unpaid}
	for {
		counts, err := statusCounts(ctx, db, productID)
		if err != nil && ctx.Err() == nil {
			return nil, err
		}
		rep.Statuses = counts
		if err == nil && counts[string(domain.OrderPending)] == 0 {
			rep.Complete = true
			break
		}
		if ctx.Err() != nil {
			break
		}
		select {
		case <-ctx.Done():
		case <-time.After(200 * time.Millisecond):
		}
	}
	// The measurement reads after the deadline too, with a little time of
	// its own, so a partial result is still reported.
	qctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	if !rep.Complete {
		if counts, err := statusCounts(qctx, db, productID); err == nil {
			rep.Statuses = counts
		}
	}
	var rows []struct {
		ExpiresAt time.Time `bun:"expires_at"`
		ClosedAt  time.Time `bun:"closed_at"`
	}
	if err := db.NewSelect().Table("orders").Column("expires_at", "closed_at").
		Where("product_id = ?", productID).Where("status = ?", domain.OrderClosed).
		Scan(qctx, &rows); err != nil {
		return nil, err
	}
	rep.Closed = len(rows)
	if len(rows) == 0 {
		return rep, nil
	}
	first, last := rows[0].ExpiresAt, rows[0].ClosedAt
	lat := make([]time.Duration, len(rows))
	for i, r := range rows {
		if r.ExpiresAt.Before(first) {
			first = r.ExpiresAt
		}
		if r.ClosedAt.After(last) {
			last = r.ClosedAt
		}
		lat[i] = r.ClosedAt.Sub(r.ExpiresAt)
		if r.ClosedAt.Before(placeEnd) {
			rep.DuringPlace++
		}
	}
	rep.lastClose = last
	window := last.Sub(first)
	rep.WindowSeconds = window.Seconds()
	rep.ClosesPerSec = rate(len(rows), window)
	rep.DueToClosed = summarize(lat)
	return rep, nil
}

// describeServer names the database server and the settings that move
// its throughput most; "" when it cannot tell.
func describeServer(ctx context.Context, db *bun.DB) string {
	var version string
	switch db.Dialect().Name().String() {
	case "pg":
		var sc, sb string
		if db.QueryRowContext(ctx, "SHOW server_version").Scan(&version) != nil {
			return ""
		}
		_ = db.QueryRowContext(ctx, "SHOW synchronous_commit").Scan(&sc)
		_ = db.QueryRowContext(ctx, "SHOW shared_buffers").Scan(&sb)
		return fmt.Sprintf("PostgreSQL %s, synchronous_commit=%s, shared_buffers=%s", version, sc, sb)
	case "mysql":
		if db.QueryRowContext(ctx, "SELECT VERSION()").Scan(&version) != nil {
			return ""
		}
		return "MySQL " + version
	case "sqlite":
		return "SQLite"
	}
	return ""
}

// quietLogger drops the ledger's logs (alerts would be counted by audit).
func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// directLedger is a Ledger over the bench's own pool with a random card
// key, the pending caps off and orders that expire after ttl.
func directLedger(db *bun.DB, ttl time.Duration) (*domain.Ledger, error) {
	key := make([]byte, 32)
	if _, err := rand.Read(key); err != nil {
		return nil, err
	}
	sealer, err := domain.NewSealer(key)
	if err != nil {
		return nil, err
	}
	return domain.NewLedger(db, sealer, domain.Config{OrderTTL: ttl}, domain.LogAlerter{Logger: quietLogger()}), nil
}

// runDirect runs Ledger.PlaceOrder n times from conc goroutines on a new
// product with n fresh cards: the ledger's own transaction without HTTP,
// GraphQL, the Redis stock gate, close scheduling and events.
func runDirect(ctx context.Context, ledger *domain.Ledger, runID string, n, conc int, probe cpuProbe) (*DirectReport, CPUUse, error) {
	name := "bench-direct-" + runID
	price := int64(100)
	p, err := ledger.CreateProduct(ctx, domain.ProductInput{Name: &name, PriceFen: &price}, "bench")
	if err != nil {
		return nil, CPUUse{}, err
	}
	for start := 0; start < n; start += domain.MaxCodesPerCall {
		codes := make([]string, 0, domain.MaxCodesPerCall)
		for i := start; i < min(start+domain.MaxCodesPerCall, n); i++ {
			codes = append(codes, fmt.Sprintf("%s-%07d", name, i))
		}
		if _, err := ledger.ImportCards(ctx, p.ID, codes, "bench"); err != nil {
			return nil, CPUUse{}, err
		}
	}
	var next atomic.Int64
	var mu sync.Mutex
	var all, doneAt []time.Duration
	errs := map[string]int{}
	var wg sync.WaitGroup
	cpu0 := probe.take()
	start := time.Now()
	for w := 0; w < conc; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			mine := make([]time.Duration, 0, n/conc+1)
			var myDone []time.Duration
			myErrs := map[string]int{}
			for ctx.Err() == nil {
				i := int(next.Add(1)) - 1
				if i >= n {
					break
				}
				t0 := time.Now()
				_, err := ledger.PlaceOrder(ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1,
					Contact: fmt.Sprintf("direct-%s-%d@bench.test", runID, i), Provider: "sandbox", ClientAddr: "127.0.0.1"})
				d := time.Since(t0)
				if err != nil {
					myErrs[domain.ErrorCode(err)]++
					continue
				}
				mine = append(mine, d)
				myDone = append(myDone, time.Since(start))
			}
			mu.Lock()
			all = append(all, mine...)
			doneAt = append(doneAt, myDone...)
			for k, v := range myErrs {
				errs[k] += v
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	wall := time.Since(start)
	cpu := cpuUse(cpu0, probe.take())
	return &DirectReport{OK: len(all), Errors: errs, WallSeconds: wall.Seconds(),
		OrdersPerSec: rate(len(all), wall), Latency: summarize(all), ByTenth: byTenth(doneAt, wall)}, cpu, nil
}

// runAudit checks the whole ledger's invariants.
func runAudit(ctx context.Context, ledger *domain.Ledger) *AuditReport {
	vs, err := ledger.Audit(ctx)
	if err != nil {
		return &AuditReport{Error: err.Error()}
	}
	rep := &AuditReport{Clean: len(vs) == 0}
	for _, v := range vs {
		rep.Violations = append(rep.Violations, v.String())
	}
	return rep
}
