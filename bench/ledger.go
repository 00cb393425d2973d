package main

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/providers/sandbox"
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

// closesPending reports whether an order of the product is still
// PENDING: the poll while kami closes, made to cost the database next to
// nothing, for its CPU is charged to kami's closes. It follows one order,
// the PENDING one that falls due last (*last), by its number; only once
// that one is decided does it look for another. Counting the product's
// orders by status at every poll read every row version of them, the
// closed ones too: nearly a tenth of PostgreSQL's time in a 40,000-order
// drain.
func closesPending(ctx context.Context, db *bun.DB, productID int64, last *string) (bool, error) {
	if *last != "" {
		var status string
		if err := db.NewSelect().Table("orders").Column("status").Where("order_no = ?", *last).Scan(ctx, &status); err != nil {
			return true, err
		}
		if status == string(domain.OrderPending) {
			return true, nil
		}
	}
	var nos []string
	if err := db.NewSelect().Table("orders").Column("order_no").Where("product_id = ?", productID).
		Where("status = ?", domain.OrderPending).OrderExpr("expires_at DESC").Limit(1).Scan(ctx, &nos); err != nil {
		return true, err
	}
	*last = ""
	if len(nos) > 0 {
		*last = nos[0]
	}
	return *last != "", nil
}

// waitForCloses polls the database until no order of the product is
// PENDING (or ctx ends), then measures the closes from the rows:
// closes/s over first expiry → last close, and closed_at − expires_at.
func waitForCloses(ctx context.Context, db *bun.DB, productID int64, unpaid int, placeEnd time.Time) (*CloseReport, error) {
	rep := &CloseReport{Unpaid: unpaid}
	following := "" // the order closesPending follows
	for {
		pending, err := closesPending(ctx, db, productID, &following)
		if err != nil && ctx.Err() == nil {
			return nil, err
		}
		if err == nil && !pending {
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
	if counts, err := statusCounts(qctx, db, productID); err == nil {
		rep.Statuses = counts
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

// settle is what the direct phase does with its orders after placing
// them, as the end-to-end phase's orders are settled: the payShare chosen
// by shouldPay are paid at once, the rest closed as they fall due. nil:
// the orders are only placed.
type settle struct {
	payShare float64
}

// describe names what the direct phase runs.
func (s *settle) describe() string {
	if s == nil {
		return "place only (-direct-place-only): Ledger.PlaceOrder, no payments, no closes"
	}
	return fmt.Sprintf("place + pay %.0f%% + close the rest at the TTL, through the ledger", 100*s.payShare)
}

// runDirect runs Ledger.PlaceOrder n times from conc goroutines on a new
// product with n fresh cards: the ledger's own transaction without HTTP,
// GraphQL, the Redis stock gate, close scheduling and events. With st,
// each worker then pays its order when shouldPay says so, as the
// end-to-end phase does, through Ledger.RecordPayment (the batched path a
// sandbox webhook ends in), and a closer closes the unpaid ones through
// Ledger.CloseOrders as they fall due (after the ledger's TTL), while
// placing goes on and until all are closed. Orders/s is over the placing
// (its payments included), as end to end.
func runDirect(ctx context.Context, ledger *domain.Ledger, runID string, n, conc int, probe cpuProbe, st *settle, sampled bool) (*DirectReport, CPUUse, error) {
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
	var cl *closer
	if st != nil {
		// Due is judged by the database's clock (see closer.closeDue).
		if err := ledger.SyncClock(ctx); err != nil {
			return nil, CPUUse{}, err
		}
		cl = startCloser(ctx, ledger, n)
	}
	var next atomic.Int64
	var mu sync.Mutex
	var all, doneAt, paid []time.Duration
	errs, payErrs := map[string]int{}, map[string]int{}
	paySent := 0
	var wg sync.WaitGroup
	groups0 := ledgerGroups(ledger)
	cpu0 := probe.take()
	// sampled: a measured run (the direct phase, a round's direct chunk)
	// is sampled as the place phase and the end-to-end chunks are, so the
	// sampler's queries cost the database the same on both sides of the
	// ratio. The placing that only sets up later phases is not.
	var waits *waitSampler
	if sampled {
		waits = sampleWaits(ctx, ledger.DB(), waitEvery)
	}
	start := time.Now()
	for w := 0; w < conc; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			mine := make([]time.Duration, 0, n/conc+1)
			var myDone, myPaid []time.Duration
			myErrs, myPayErrs := map[string]int{}, map[string]int{}
			mySent := 0
			for ctx.Err() == nil {
				i := int(next.Add(1)) - 1
				if i >= n {
					break
				}
				t0 := time.Now()
				po, err := ledger.PlaceOrder(ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1,
					Contact: fmt.Sprintf("direct-%s-%d@bench.test", runID, i), Provider: sandbox.Name, ClientAddr: "127.0.0.1"})
				d := time.Since(t0)
				if err != nil {
					myErrs[domain.ErrorCode(err)]++
					continue
				}
				mine = append(mine, d)
				myDone = append(myDone, time.Since(start))
				if st == nil {
					continue
				}
				o := po.Order
				if shouldPay(i, st.payShare) {
					mySent++
					t0 = time.Now()
					err := payDirect(ctx, ledger, o)
					d = time.Since(t0)
					if err == nil {
						myPaid = append(myPaid, d)
						continue
					}
					myPayErrs[domain.ErrorCode(err)]++
				}
				// Unpaid: its close was scheduled when it was placed.
				cl.add(o.OrderNo, o.ExpiresAt)
			}
			mu.Lock()
			all = append(all, mine...)
			doneAt = append(doneAt, myDone...)
			paid = append(paid, myPaid...)
			paySent += mySent
			for k, v := range myErrs {
				errs[k] += v
			}
			for k, v := range myPayErrs {
				payErrs[k] += v
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	wall := time.Since(start)
	placeEnd := time.Now()
	cpu := cpuUse(cpu0, probe.take())
	rep := &DirectReport{Runs: st.describe(), PlaceOnly: st == nil, OK: len(all), Errors: errs, WallSeconds: wall.Seconds(),
		OrdersPerSec: rate(len(all), wall), Latency: summarize(all), ByTenth: byTenth(doneAt, wall),
		Waits: waits.Stop(start, wall), Groups: groupsSince(groups0, ledgerGroups(ledger))}
	if st == nil {
		return rep, cpu, nil
	}
	rep.Pay = &PayReport{Sent: paySent, OK: len(paid), Errors: payErrs, PaymentsPerSec: rate(len(paid), wall), Latency: summarize(paid)}
	cl.finish()
	rep.CloseBatches, rep.CloseSkipped, rep.CloseErrors = cl.batches, cl.skipped, cl.errs
	cr, err := waitForCloses(ctx, ledger.DB(), p.ID, len(all)-len(paid), placeEnd)
	if err != nil {
		return rep, cpu, fmt.Errorf("measuring the direct closes: %w", err)
	}
	rep.Close = cr
	return rep, cpu, nil
}

// ledgerGroups is the ledger's group-commit counters, as the server
// exports them on /metrics.
func ledgerGroups(l *domain.Ledger) map[string]GroupReport {
	out := map[string]GroupReport{}
	for kind, g := range map[string]domain.GroupStats{"place": l.PlaceStats(), "pay": l.PayStats()} {
		out[kind] = GroupReport{Batches: g.Batches, Calls: g.Calls, Split: g.Split}
	}
	return out
}

// payDirect records a sandbox payment of o as the webhook would, with the
// notification the end-to-end phase sends for it: the same provider,
// trade number, amount, notification id and body.
func payDirect(ctx context.Context, ledger *domain.Ledger, o *domain.Order) error {
	n := sandbox.PaymentNotification(o.OrderNo, "BT"+o.OrderNo, o.AmountFen, time.Now())
	body, err := json.Marshal(n)
	if err != nil {
		return err
	}
	paidAt, err := time.Parse(time.RFC3339, n.PaidAt)
	if err != nil {
		return err
	}
	res, err := ledger.RecordPayment(ctx, domain.Payment{Provider: sandbox.Name, NotifyID: sandbox.NotifyID(body),
		OrderNo: o.OrderNo, TradeNo: n.TradeNo, AmountFen: o.AmountFen, PaidAt: paidAt, Raw: string(body)})
	if err != nil {
		return err
	}
	if res.Outcome != domain.PaymentDelivered {
		return domain.Errorf(string(res.Outcome), "payment of %s: %s", o.OrderNo, res.Outcome)
	}
	return nil
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
