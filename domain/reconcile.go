package domain

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/uptrace/bun"
)

// ReconcileRun is one row of reconcile_run: what a reconciliation found and
// repaired.
type ReconcileRun struct {
	bun.BaseModel `bun:"table:reconcile_run"`

	ID               int64     `bun:"id,pk,autoincrement"`
	StartedAt        time.Time `bun:"started_at"`
	FinishedAt       time.Time `bun:"finished_at"`
	ClosedStragglers int       `bun:"closed_stragglers"`
	StaleRefunds     int       `bun:"stale_refunds"`
	Rescheduled      int       `bun:"rescheduled"`
	CountersRepaired int       `bun:"counters_repaired"`
	Violations       int       `bun:"violations"`
	Summary          string    `bun:"summary"`
	Error            string    `bun:"error"`
}

// ScheduleRebuilder re-schedules what Redis lost (queue.Workers.Sweep).
type ScheduleRebuilder interface {
	Rebuild(ctx context.Context) (rescheduled int, err error)
}

// StockRepairer sets a product's stock counter from the database
// (queue.StockGate.Repair).
type StockRepairer interface {
	Repair(ctx context.Context, productID int64) (int, error)
}

// Locker hands out a lock that only one process holds at a time (Redis
// SET NX with an expiry). ok is false when another process holds it.
type Locker interface {
	TryLock(ctx context.Context, name string, ttl time.Duration) (unlock func(), ok bool, err error)
}

// ErrReconcileRunning is returned when another process is reconciling:
// CONFLICT, to be tried again once it is done.
var ErrReconcileRunning error = Errorf(ECONFLICT, "another kami process is reconciling; try again when it is done")

// Reconciler is the nightly safety net behind the queues: it closes every
// PENDING order overdue by more than StragglerAge through the one close
// path, reports refunds PROCESSING for more than StaleRefundAge,
// re-schedules what Redis lost, repairs the stock counters and audits the
// ledger. It records each run in reconcile_run.
type Reconciler struct {
	Shop      *Shop
	Schedules ScheduleRebuilder // nil: skipped
	Stock     StockRepairer     // nil: skipped
	Lock      Locker            // nil: no cross-process lock
	Alerts    Alerter

	StragglerAge   time.Duration // default 30m
	StaleRefundAge time.Duration // default 24h
	// OnRun hears each finished run (metrics).
	OnRun func(ReconcileRun)
	// Log gets each run's one summary line, whoever started it (the
	// nightly schedule, an admin's runReconciliation); nil: no line (`kami
	// reconcile` prints its summary on stdout instead).
	Log *slog.Logger
}

// Run reconciles once. It returns ErrReconcileRunning when another process
// holds the lock, and otherwise the run as recorded (its Error field says
// what part failed, if any: the other parts still ran).
func (r *Reconciler) Run(ctx context.Context) (*ReconcileRun, error) {
	return r.runLogged(ctx, "")
}

// runLogged is run with its outcome logged: the one place a run's summary
// line is written, for every way a run starts.
func (r *Reconciler) runLogged(ctx context.Context, actor string) (*ReconcileRun, error) {
	run, err := r.run(ctx)
	if r.Log == nil {
		return run, err
	}
	var by []any
	if actor != "" {
		by = []any{"by", actor}
	}
	switch {
	case errors.Is(err, ErrReconcileRunning):
		r.Log.InfoContext(ctx, "reconcile skipped: another process is running it", by...)
	case err != nil:
		r.Log.ErrorContext(ctx, "reconcile failed", append(by, "err", err)...)
	case run.Error != "":
		r.Log.ErrorContext(ctx, "reconcile: "+run.Summary, append(by, "errors", run.Error)...)
	default:
		r.Log.InfoContext(ctx, "reconcile: "+run.Summary, by...)
	}
	return run, err
}

func (r *Reconciler) run(ctx context.Context) (*ReconcileRun, error) {
	l := r.Shop.Ledger
	if r.Lock != nil {
		unlock, ok, err := r.Lock.TryLock(ctx, "reconcile", time.Hour)
		if err != nil {
			return nil, fmt.Errorf("reconcile lock: %w", err)
		}
		if !ok {
			return nil, ErrReconcileRunning
		}
		defer unlock()
	}
	stragglerAge, staleAge := r.StragglerAge, r.StaleRefundAge
	if stragglerAge <= 0 {
		stragglerAge = 30 * time.Minute
	}
	if staleAge <= 0 {
		staleAge = 24 * time.Hour
	}
	run := &ReconcileRun{StartedAt: l.now()}
	var errs []string
	fail := func(part string, err error) { errs = append(errs, part+": "+err.Error()) }

	// PENDING orders the sweeper cannot see (placed by an older version
	// during an upgrade), before the stragglers are looked for.
	added, removed, err := l.RepairPendingRows(ctx)
	if err != nil {
		fail("pending rows", err)
	}
	if added+removed > 0 {
		r.alert(ctx, Alert{Kind: "pending_rows", Subject: "reconcile",
			Message: fmt.Sprintf("pending_order disagreed with the orders: added %d rows, removed %d", added, removed)})
	}

	// Cards the pick cannot see, or rows it skips (an older version
	// during an upgrade).
	added, removed, err = l.RepairCardsForSale(ctx)
	if err != nil {
		fail("cards for sale", err)
	}
	if added+removed > 0 {
		r.alert(ctx, Alert{Kind: "cards_for_sale", Subject: "reconcile",
			Message: fmt.Sprintf("card_for_sale disagreed with the cards: added %d rows, removed %d", added, removed)})
	}

	// Stragglers: overdue PENDING orders the queue never closed.
	cutoff := run.StartedAt.Add(-stragglerAge)
	err = l.PendingPages(ctx, cutoff, 500, func(page []PendingOrder) (bool, error) {
		nos := make([]string, len(page))
		for i, o := range page {
			nos[i] = o.OrderNo
		}
		rs, err := r.Shop.CloseOrders(ctx, nos, CloseTimeout)
		if err != nil {
			return false, err
		}
		for _, res := range rs {
			if res.Outcome == Closed {
				run.ClosedStragglers++
			}
		}
		return true, nil
	})
	if err == nil {
		// The walk stops quietly when ctx ends; the stragglers after its
		// last page are left, and the run says so.
		err = ctx.Err()
	}
	if err != nil {
		fail("stragglers", err)
	}
	if run.ClosedStragglers > 0 {
		r.alert(ctx, Alert{Kind: "stragglers", Subject: "reconcile",
			Message: fmt.Sprintf("closed %d orders overdue by more than %s that the close queue missed", run.ClosedStragglers, stragglerAge)})
	}

	// Refunds stuck PROCESSING: a person must look.
	stale, err := l.StaleRefunds(ctx, run.StartedAt.Add(-staleAge), 1000)
	if err != nil {
		fail("stale refunds", err)
	}
	run.StaleRefunds = len(stale)
	if len(stale) > 0 {
		nos := make([]string, 0, min(len(stale), 20))
		for _, s := range stale[:min(len(stale), 20)] {
			nos = append(nos, s.RefundNo)
		}
		r.alert(ctx, Alert{Kind: "stale_refunds", Subject: "reconcile",
			Message: fmt.Sprintf("%d refunds PROCESSING for more than %s: %s", len(stale), staleAge, strings.Join(nos, ", "))})
	}

	if r.Schedules != nil {
		if run.Rescheduled, err = r.Schedules.Rebuild(ctx); err != nil {
			fail("reschedule", err)
		}
	}
	if r.Stock != nil {
		ps, err := l.Products(ctx, false)
		if err != nil {
			fail("stock counters", err)
		}
		// One product that cannot be repaired (its Redis node down, say)
		// does not leave every later product's counter unrepaired.
		var failed []string
		var lastErr error
		for _, p := range ps {
			if _, err := r.Stock.Repair(ctx, p.ID); err != nil {
				failed, lastErr = append(failed, strconv.FormatInt(p.ID, 10)), err
				continue
			}
			run.CountersRepaired++
		}
		if len(failed) > 0 {
			fail("stock counters", fmt.Errorf("products %s: %w", strings.Join(failed, ", "), lastErr))
		}
	}

	vs, err := l.Audit(ctx)
	if err != nil {
		fail("audit", err)
	}
	run.Violations = len(vs)
	for i, v := range vs {
		if i == 20 {
			r.alert(ctx, Alert{Kind: "inconsistency", Subject: "ledger", Message: fmt.Sprintf("and %d more violations", len(vs)-20)})
			break
		}
		r.alert(ctx, Alert{Kind: "inconsistency", Subject: v.Subject, Message: v.Rule + ": " + v.Detail})
	}

	run.FinishedAt = l.now()
	run.Error = truncate(strings.Join(errs, "; "), 512)
	run.Summary = fmt.Sprintf("closed %d stragglers, %d stale refunds, %d tasks rescheduled, %d stock counters repaired, %d ledger violations",
		run.ClosedStragglers, run.StaleRefunds, run.Rescheduled, run.CountersRepaired, run.Violations)
	if _, err := l.db.NewInsert().Model(run).Exec(context.WithoutCancel(ctx)); err != nil {
		return run, fmt.Errorf("recording the reconciliation: %w", err)
	}
	if r.OnRun != nil {
		r.OnRun(*run)
	}
	return run, nil
}

// RunFor runs the reconciliation now for actor (an admin) and notes it in
// the audit log. Errors as Run.
func (r *Reconciler) RunFor(ctx context.Context, actor string) (*ReconcileRun, error) {
	run, err := r.runLogged(ctx, actor)
	if err != nil {
		return run, err
	}
	l := r.Shop.Ledger
	return run, audit(ctx, l.db, l.now(), actor, "reconcile.run", fmt.Sprint(run.ID), run.Summary)
}

func (r *Reconciler) alert(ctx context.Context, a Alert) {
	if r.Alerts != nil {
		r.Alerts.Alert(ctx, a)
	}
}

// ReconcileRuns lists the newest reconciliation runs, for admins.
func (l *Ledger) ReconcileRuns(ctx context.Context, limit int) ([]ReconcileRun, error) {
	var runs []ReconcileRun
	err := l.db.NewSelect().Model(&runs).OrderExpr("started_at DESC, id DESC").Limit(int64(limit)).Scan(ctx)
	return runs, err
}

// RefundFailureRate is the share of finished refunds that ended FAILED, or
// nil when none has finished yet.
func (l *Ledger) RefundFailureRate(ctx context.Context) (*float64, error) {
	var rows []struct {
		Status RefundStatus `bun:"status"`
		N      int64        `bun:"n"`
	}
	if err := l.db.NewSelect().Table("refund_order").Column("status").ColumnExpr("COUNT(*) AS n").
		Where("status IN (?)", bun.List([]RefundStatus{RefundSucceeded, RefundFailed})).Group("status").Scan(ctx, &rows); err != nil {
		return nil, err
	}
	var failed, all int64
	for _, r := range rows {
		all += r.N
		if r.Status == RefundFailed {
			failed = r.N
		}
	}
	if all == 0 {
		return nil, nil
	}
	rate := float64(failed) / float64(all)
	return &rate, nil
}
