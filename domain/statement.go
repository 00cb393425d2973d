package domain

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/uptrace/bun"

	"kami/domain/money"
	"kami/providers"
)

// Statement reconciliation: kami against the gateways' own books. Each day
// the gateway publishes its statement of the day before (every trade paid,
// every refund made); StatementReconciler compares each line with the
// ledger and settles what differs by the rules that already exist, through
// the paths every payment and refund takes:
//
//   - paid at the gateway, order PENDING: delivered (Shop.RecordPayment);
//   - paid at the gateway, order CLOSED: the late-payment policy
//     (RecordPayment refunds it, or delivers it under KAMI_LATE_PAYMENT=deliver);
//   - a second trade for an order paid with another: refunded (RecordPayment);
//   - a refund the gateway made that kami still has as PROCESSING or FAILED:
//     confirmed (Ledger.RefundSucceeded);
//   - paid for no order of kami's, an amount that differs, a refund at the
//     gateway kami never made, a refund kami saw succeed or a payment kami
//     recorded that the statement of its day lacks (and the gateway, asked
//     again, does not confirm): alerted, for a person.
//
// The orders CLOSED since the last statement (today's, whose statement
// comes tomorrow) are asked about one by one (QueryPayment), and a payment
// found is settled the same way.
//
// A run settles nothing twice: what it settled the next run finds in order;
// a difference that still needs a person is recorded again by the next run,
// marked ALREADY_REPORTED, and alerted only the first time.

// RunSource says what a statement run compared the ledger with.
type RunSource string

const (
	SourceStatement RunSource = "STATEMENT" // the gateway's statement of one day
	SourceQuery     RunSource = "QUERY"     // the recent closed orders, asked one by one
)

// RunStatus is how a statement run ended.
type RunStatus string

const (
	RunDone     RunStatus = "DONE"
	RunNotReady RunStatus = "NOT_READY" // the gateway has not published the statement yet
	RunFailed   RunStatus = "FAILED"    // no usable statement, or the ledger could not be read
)

// DifferenceKind names what a run found.
type DifferenceKind string

const (
	DiffPaidPending          DifferenceKind = "PAID_PENDING"           // paid at the gateway, order PENDING
	DiffPaidClosed           DifferenceKind = "PAID_CLOSED"            // paid at the gateway, order CLOSED
	DiffPaidTwice            DifferenceKind = "PAID_TWICE"             // a second trade for an order paid with another
	DiffPaidUnknownOrder     DifferenceKind = "PAID_UNKNOWN_ORDER"     // paid for no order kami placed with this provider
	DiffAmountMismatch       DifferenceKind = "AMOUNT_MISMATCH"        // the trade's amount is not the order's
	DiffRefundUnknown        DifferenceKind = "REFUND_UNKNOWN"         // a refund at the gateway kami never made
	DiffRefundAmountMismatch DifferenceKind = "REFUND_AMOUNT_MISMATCH" // a refund of another amount than kami's
	DiffRefundUnconfirmed    DifferenceKind = "REFUND_UNCONFIRMED"     // refunded at the gateway, not SUCCEEDED in kami
	DiffRefundMissing        DifferenceKind = "REFUND_MISSING"         // SUCCEEDED in kami, not at the gateway
	DiffPaymentMissing       DifferenceKind = "PAYMENT_MISSING"        // paid in kami, not at the gateway
)

// DifferenceKinds lists every kind; the schema's CHECK repeats it.
var DifferenceKinds = []DifferenceKind{DiffPaidPending, DiffPaidClosed, DiffPaidTwice, DiffPaidUnknownOrder, DiffAmountMismatch,
	DiffRefundUnknown, DiffRefundAmountMismatch, DiffRefundUnconfirmed, DiffRefundMissing, DiffPaymentMissing}

// SettleAction is what kami did about a difference, or about what the
// gateway said when an order was synced.
type SettleAction string

const (
	ActDelivered       SettleAction = "DELIVERED"        // the payment delivered the order
	ActLateRefund      SettleAction = "LATE_REFUND"      // the late payment is being refunded
	ActLateDelivered   SettleAction = "LATE_DELIVERED"   // the late payment delivered (KAMI_LATE_PAYMENT=deliver)
	ActDuplicateRefund SettleAction = "DUPLICATE_REFUND" // the second payment is being refunded
	ActRefundConfirmed SettleAction = "REFUND_CONFIRMED" // the refund is recorded SUCCEEDED
	ActAlerted         SettleAction = "ALERTED"          // a person was alerted
	ActAlreadyReported SettleAction = "ALREADY_REPORTED" // alerted by an earlier run; not again
	ActFailed          SettleAction = "FAILED"           // settling failed; the next run tries again
	ActNone            SettleAction = "NONE"             // nothing to do (already in order)
)

// settled reports whether a changed the ledger.
func (a SettleAction) settled() bool {
	switch a {
	case ActDelivered, ActLateRefund, ActLateDelivered, ActDuplicateRefund, ActRefundConfirmed:
		return true
	}
	return false
}

// StatementRun is one row of statement_run.
type StatementRun struct {
	bun.BaseModel `bun:"table:statement_run"`

	ID         int64     `bun:"id,pk,autoincrement"`
	Provider   string    `bun:"provider"`
	BillDate   string    `bun:"bill_date"` // the statement's day, 2006-01-02, in the gateway's zone
	Source     RunSource `bun:"source"`
	Status     RunStatus `bun:"status"`
	StartedAt  time.Time `bun:"started_at"`
	FinishedAt time.Time `bun:"finished_at"`
	// Trades and Refunds count the statement's lines (for a QUERY run:
	// the orders asked about); TradeFen and RefundFen are its totals.
	Trades    int   `bun:"trades"`
	Refunds   int   `bun:"refunds"`
	TradeFen  int64 `bun:"trade_fen"`
	RefundFen int64 `bun:"refund_fen"`
	// Matched counts what agreed with the ledger, Differences what did
	// not; of those, Settled were put right and NeedsPerson need a person.
	Matched     int    `bun:"matched"`
	Differences int    `bun:"differences"`
	Settled     int    `bun:"settled"`
	NeedsPerson int    `bun:"needs_person"`
	Error       string `bun:"error"`
}

// StatementDifference is one row of statement_difference.
type StatementDifference struct {
	bun.BaseModel `bun:"table:statement_difference"`

	ID       int64          `bun:"id,pk,autoincrement"`
	RunID    int64          `bun:"run_id"`
	Provider string         `bun:"provider"`
	BillDate string         `bun:"bill_date"`
	Kind     DifferenceKind `bun:"kind"`
	// Subject is what the difference is about (the trade, the refund or
	// the order number): with Provider and Kind it recognises the same
	// difference in a later run.
	Subject  string `bun:"subject"`
	OrderNo  string `bun:"order_no"`
	TradeNo  string `bun:"trade_no"`
	RefundNo string `bun:"refund_no"`
	// GatewayFen and KamiFen are the amounts each side has; 0 when that
	// side has none.
	GatewayFen  int64        `bun:"gateway_fen"`
	KamiFen     int64        `bun:"kami_fen"`
	Action      SettleAction `bun:"action"`
	NeedsPerson bool         `bun:"needs_person"`
	Detail      string       `bun:"detail"`
	CreatedAt   time.Time    `bun:"created_at"`
}

// StatementReconciler runs the statement reconciliation. Each public
// method takes the "statements" lock, so one process runs it at a time.
type StatementReconciler struct {
	Shop   *Shop
	Lock   Locker // nil: no cross-process lock
	Alerts Alerter

	// CatchUpDays is how many days back a scheduled run looks for
	// statements not reconciled yet (the gateway was down, the statement
	// was late); default 7.
	CatchUpDays int
	// MaxQueries bounds the gateway calls of one run: the recent closed
	// orders asked about, and the missing lines asked about again, each;
	// default 2000.
	MaxQueries int
	// Parallel is how many gateway calls run at once; default 8.
	Parallel int
	// StatementTimeout bounds downloading one statement; default 2m. Each
	// query is bounded by Shop.ProviderTimeout.
	StatementTimeout time.Duration
	// ManualOnly names providers whose statements only an admin's request
	// reconciles, not the schedule: the sandbox, whose books do not outlive
	// its process (a statement after a restart would miss every earlier
	// payment). Their recent closed orders are still asked about.
	ManualOnly []string
	// OnRun hears each recorded run with its differences (metrics).
	OnRun func(StatementRun, []StatementDifference)
}

func (r *StatementReconciler) catchUpDays() int { return defaultInt(r.CatchUpDays, 7) }
func (r *StatementReconciler) maxQueries() int  { return defaultInt(r.MaxQueries, 2000) }
func (r *StatementReconciler) parallel() int    { return defaultInt(r.Parallel, 8) }

func defaultInt(v, def int) int {
	if v <= 0 {
		return def
	}
	return v
}

func (r *StatementReconciler) statementTimeout() time.Duration {
	if r.StatementTimeout > 0 {
		return r.StatementTimeout
	}
	return 2 * time.Minute
}

// lock takes the statements lock: ErrReconcileRunning when another
// process holds it.
func (r *StatementReconciler) lock(ctx context.Context) (func(), error) {
	if r.Lock == nil {
		return func() {}, nil
	}
	unlock, ok, err := r.Lock.TryLock(ctx, "statements", time.Hour)
	if err != nil {
		return nil, fmt.Errorf("statements lock: %w", err)
	}
	if !ok {
		return nil, ErrReconcileRunning
	}
	return unlock, nil
}

// Run is the scheduled reconciliation: for each enabled provider that
// publishes statements, every day of the last CatchUpDays not reconciled
// yet (yesterday, on a normal day), then, for every provider, the orders
// closed since its last reconciled statement, asked about one by one. It
// returns the runs it recorded. actor names who asked, for the audit log
// ("" for the schedule). CONFLICT (ErrReconcileRunning) when another
// process is reconciling.
func (r *StatementReconciler) Run(ctx context.Context, actor string) ([]StatementRun, error) {
	return r.RunNow(ctx, actor, "", providers.Day{})
}

// RunNow is Run for one provider (provider not empty) or, with day, the
// reconciliation of that day's statement only, whether or not it was
// reconciled before (a second run settles nothing twice). NOT_FOUND for a
// provider not enabled, BAD_INPUT for a day not yet begun or a provider
// that publishes no statement, CONFLICT when another process is
// reconciling.
func (r *StatementReconciler) RunNow(ctx context.Context, actor, provider string, day providers.Day) ([]StatementRun, error) {
	l := r.Shop.Ledger
	names := r.Shop.Providers.Names()
	if provider != "" {
		p, ok := r.Shop.Providers.Get(provider)
		if !ok {
			return nil, Errorf(ENOTFOUND, "provider %q is not enabled; enabled: %v", truncate(provider, 16), names)
		}
		if _, ok := p.(providers.StatementSource); !ok && !day.IsZero() {
			return nil, Errorf(EBADINPUT, "%s publishes no statement", provider)
		}
		names = []string{provider}
	}
	now := l.now()
	today := providers.DayOf(now)
	if today.Before(day) {
		return nil, Errorf(EBADINPUT, "the statement of a day that has not begun cannot be had")
	}
	unlock, err := r.lock(ctx)
	if err != nil {
		return nil, err
	}
	defer unlock()
	var runs []StatementRun
	for _, name := range names {
		p, _ := r.Shop.Providers.Get(name)
		src, hasStatements := p.(providers.StatementSource)
		if provider == "" && day.IsZero() && slices.Contains(r.ManualOnly, name) {
			hasStatements = false
		}
		if !day.IsZero() {
			if hasStatements {
				runs = append(runs, *r.reconcileDay(ctx, src, day))
			}
			continue
		}
		since := now.Add(-24 * time.Hour)
		if hasStatements {
			oldest := today.AddDays(-r.catchUpDays())
			for d := oldest; d.Before(today); d = d.AddDays(1) {
				done, err := r.reconciled(ctx, name, d)
				if err != nil {
					return runs, err
				}
				if done {
					continue
				}
				run := r.reconcileDay(ctx, src, d)
				runs = append(runs, *run)
				if run.Status != RunDone && d == oldest {
					r.alert(ctx, Alert{Kind: "statement_missing", Subject: name + " " + d.String(),
						Message: fmt.Sprintf("the %s statement of %s could not be reconciled in %d days: %s", name, d, r.catchUpDays(), run.Error)})
				}
			}
			// Today is in no statement yet; yesterday neither, if its
			// statement is not reconciled. An order closed just before
			// midnight may be paid just after (the close races the
			// buyer): the window starts an hour early.
			since = today.Start().Add(-time.Hour)
			if done, err := r.reconciled(ctx, name, today.AddDays(-1)); err == nil && !done {
				since = today.AddDays(-1).Start().Add(-time.Hour)
			}
		}
		runs = append(runs, *r.checkRecent(ctx, p, since))
	}
	if actor != "" {
		target := firstOf(provider, "all") + " " + firstOf(day.String(), "scheduled")
		if err := audit(ctx, l.db, l.now(), actor, "statements.run", target, fmt.Sprintf("%d runs", len(runs))); err != nil {
			return runs, err
		}
	}
	return runs, nil
}

// Reconcile is RunNow for one provider's statement of one day.
func (r *StatementReconciler) Reconcile(ctx context.Context, actor, provider string, day providers.Day) (*StatementRun, error) {
	if day.IsZero() || provider == "" {
		return nil, Errorf(EBADINPUT, "which provider, and which day?")
	}
	runs, err := r.RunNow(ctx, actor, provider, day)
	if err != nil {
		return nil, err
	}
	return &runs[0], nil
}

// CheckRecent asks provider about every order CLOSED since since, and
// settles a payment found. Errors as RunNow.
func (r *StatementReconciler) CheckRecent(ctx context.Context, actor, provider string, since time.Time) (*StatementRun, error) {
	p, ok := r.Shop.Providers.Get(provider)
	if !ok {
		return nil, Errorf(ENOTFOUND, "provider %q is not enabled; enabled: %v", truncate(provider, 16), r.Shop.Providers.Names())
	}
	unlock, err := r.lock(ctx)
	if err != nil {
		return nil, err
	}
	defer unlock()
	run := r.checkRecent(ctx, p, since)
	if actor != "" {
		l := r.Shop.Ledger
		return run, audit(ctx, l.db, l.now(), actor, "statements.check_recent", provider, fmt.Sprintf("run %d: %s", run.ID, run.Status))
	}
	return run, nil
}

// reconciled reports whether provider's statement of day was reconciled.
func (r *StatementReconciler) reconciled(ctx context.Context, provider string, day providers.Day) (bool, error) {
	return r.Shop.Ledger.db.NewSelect().Model((*StatementRun)(nil)).Where("provider = ?", provider).
		Where("bill_date = ?", day.String()).Where("source = ?", SourceStatement).Where("status = ?", RunDone).Exists(ctx)
}

// dayRun is one run in the making: the run, its differences, and what
// part of it failed. The queries of each note their results concurrently.
type dayRun struct {
	r        *StatementReconciler
	provider providers.Provider
	run      *StatementRun

	mu       sync.Mutex // guards what follows and run's counts
	diffs    []StatementDifference
	failures []string
}

func (d *dayRun) fail(part string, err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.failures = append(d.failures, part+": "+err.Error())
}

// failLedger notes that the ledger could not be read; the database's own
// words go to the log, not to the run admins read.
func (d *dayRun) failLedger(ctx context.Context, part string, err error) {
	d.r.Shop.log().ErrorContext(ctx, "statement run: reading the ledger failed", "provider", d.run.Provider, "part", part, "err", err)
	d.fail(part, errors.New("the database could not be read (see the log)"))
}

func (d *dayRun) matched() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.run.Matched++
}

// differ notes a difference; needs-person ones are marked ALERTED (or
// ALREADY_REPORTED) when the run is recorded.
func (d *dayRun) differ(diff StatementDifference) {
	d.mu.Lock()
	defer d.mu.Unlock()
	diff.Provider, diff.BillDate = d.run.Provider, d.run.BillDate
	diff.Detail = truncate(diff.Detail, 512)
	if diff.Subject == "" {
		diff.Subject = firstOf(diff.RefundNo, diff.TradeNo, diff.OrderNo)
	}
	if diff.Action == ActFailed {
		diff.NeedsPerson = true
	}
	d.diffs = append(d.diffs, diff)
}

func firstOf(s ...string) string {
	for _, v := range s {
		if v != "" {
			return v
		}
	}
	return ""
}

// reconcileDay compares the statement of day with the ledger, settles what
// it can and records the run.
func (r *StatementReconciler) reconcileDay(ctx context.Context, src providers.StatementSource, day providers.Day) *StatementRun {
	l := r.Shop.Ledger
	d := &dayRun{r: r, provider: src, run: &StatementRun{Provider: src.Name(), BillDate: day.String(), Source: SourceStatement, StartedAt: l.now()}}
	sctx, cancel := context.WithTimeout(ctx, r.statementTimeout())
	st, err := src.Statement(sctx, day)
	cancel()
	switch {
	case providers.NotReady(err):
		d.run.Status, d.run.Error = RunNotReady, errorDetail(err)
		return r.record(ctx, d)
	case err != nil:
		d.run.Status, d.run.Error = RunFailed, errorDetail(err)
		r.alert(ctx, Alert{Kind: "statement_failed", Subject: src.Name() + " " + day.String(),
			Message: "the statement could not be read: " + errorDetail(err)})
		return r.record(ctx, d)
	}
	d.run.Trades, d.run.Refunds, d.run.TradeFen, d.run.RefundFen = len(st.Trades), len(st.Refunds), st.TradeFen(), st.RefundFen()
	d.trades(ctx, st)
	d.refunds(ctx, st)
	d.missingRefunds(ctx, st, day)
	d.missingPayments(ctx, st, day)
	d.run.Status = RunDone
	if len(d.failures) > 0 {
		d.run.Status = RunFailed
	}
	return r.record(ctx, d)
}

// trades settles every paid trade of the statement against its order.
func (d *dayRun) trades(ctx context.Context, st *providers.Statement) {
	name := d.provider.Name()
	var nos []string
	for _, t := range st.Trades {
		nos = append(nos, t.OrderNo)
	}
	orders, err := ordersByNoChunked(ctx, d.r.Shop.Ledger, nos)
	if err != nil {
		d.failLedger(ctx, "orders", err)
		return
	}
	refunds, err := refundsWhere(ctx, d.r.Shop.Ledger.db, "order_no", nos)
	if err != nil {
		d.failLedger(ctx, "refunds", err)
		return
	}
	refunded := map[string]*Refund{} // by order and trade: a second payment already being refunded
	for i := range refunds {
		refunded[refunds[i].OrderNo+"\x00"+refunds[i].TradeNo] = &refunds[i]
	}
	raw := fmt.Sprintf("%s statement of %s", name, st.Day)
	for _, t := range st.Trades {
		if t.Status != providers.TradePaid {
			continue
		}
		o := orders[t.OrderNo]
		diff := StatementDifference{Subject: t.TradeNo, OrderNo: t.OrderNo, TradeNo: t.TradeNo, GatewayFen: t.AmountFen}
		switch {
		case o == nil || o.Provider != name:
			diff.Kind, diff.Detail = DiffPaidUnknownOrder, fmt.Sprintf("%s was paid at %s for no order placed with %s", money.Format(t.AmountFen), name, name)
			diff.NeedsPerson = true
		case o.TradeNo == t.TradeNo && o.PaidFen == t.AmountFen:
			d.matched()
			continue
		case o.TradeNo == t.TradeNo:
			diff.Kind, diff.KamiFen, diff.NeedsPerson = DiffAmountMismatch, o.PaidFen, true
			diff.Detail = fmt.Sprintf("kami recorded %s paid, the statement says %s", money.Format(o.PaidFen), money.Format(t.AmountFen))
		case refunded[o.OrderNo+"\x00"+t.TradeNo] != nil:
			if rf := refunded[o.OrderNo+"\x00"+t.TradeNo]; rf.PaidFen != t.AmountFen {
				diff.Kind, diff.KamiFen, diff.NeedsPerson = DiffAmountMismatch, rf.PaidFen, true
				diff.Detail = fmt.Sprintf("refund %s owes back %s paid, the statement says %s", rf.RefundNo, money.Format(rf.PaidFen), money.Format(t.AmountFen))
				break
			}
			d.matched()
			continue
		case t.AmountFen != o.AmountFen:
			diff.Kind, diff.KamiFen, diff.NeedsPerson = DiffAmountMismatch, o.AmountFen, true
			diff.Detail = fmt.Sprintf("the order is of %s, the statement says %s was paid", money.Format(o.AmountFen), money.Format(t.AmountFen))
		default:
			diff.Kind = DiffPaidClosed
			switch {
			case o.TradeNo != "":
				diff.Kind = DiffPaidTwice
			case o.Status == OrderPending:
				diff.Kind = DiffPaidPending
			}
			diff.KamiFen = o.AmountFen
			diff.Action, diff.Detail = d.r.Shop.applyGatewayPayment(ctx, Payment{Provider: name, NotifyID: "statement:" + t.TradeNo,
				OrderNo: t.OrderNo, TradeNo: t.TradeNo, AmountFen: t.AmountFen, PaidAt: t.PaidAt, Raw: raw})
			diff.Detail = fmt.Sprintf("order was %s: %s", o.Status, diff.Detail)
		}
		d.differ(diff)
	}
}

// refunds settles every refund of the statement against kami's.
func (d *dayRun) refunds(ctx context.Context, st *providers.Statement) {
	var nos []string
	for _, sr := range st.Refunds {
		nos = append(nos, sr.RefundNo)
	}
	rs, err := refundsWhere(ctx, d.r.Shop.Ledger.db, "refund_no", nos)
	if err != nil {
		d.failLedger(ctx, "refunds", err)
		return
	}
	byNo := map[string]*Refund{}
	for i := range rs {
		byNo[rs[i].RefundNo] = &rs[i]
	}
	for _, sr := range st.Refunds {
		kr := byNo[sr.RefundNo]
		diff := StatementDifference{OrderNo: sr.OrderNo, TradeNo: sr.TradeNo, RefundNo: sr.RefundNo, GatewayFen: sr.AmountFen}
		switch {
		case kr == nil || kr.Provider != d.provider.Name():
			diff.Kind, diff.NeedsPerson = DiffRefundUnknown, true
			diff.Subject = firstOf(sr.RefundNo, "trade "+sr.TradeNo)
			diff.Detail = fmt.Sprintf("%s was refunded (%s) at the gateway under a refund number kami never made", money.Format(sr.AmountFen), sr.Status)
		case kr.AmountFen != sr.AmountFen:
			diff.Kind, diff.KamiFen, diff.NeedsPerson = DiffRefundAmountMismatch, kr.AmountFen, true
			diff.Detail = fmt.Sprintf("kami refunds %s, the statement says %s", money.Format(kr.AmountFen), money.Format(sr.AmountFen))
		case sr.Status == providers.RefundSucceeded && kr.Status != RefundSucceeded:
			diff.Kind, diff.KamiFen = DiffRefundUnconfirmed, kr.AmountFen
			diff.Action, diff.Detail = d.r.Shop.confirmRefund(ctx, kr.RefundNo, "")
			diff.Detail = fmt.Sprintf("kami had it %s: %s", kr.Status, diff.Detail)
		default:
			d.matched()
			continue
		}
		d.differ(diff)
	}
}

// missingRefunds looks for the refunds kami saw succeed on day that the
// statement lacks. kami learns of a refund after the gateway made it, so
// one made just before midnight may be in the day before's statement: each
// is asked about again, and only what the gateway does not confirm is a
// difference.
func (d *dayRun) missingRefunds(ctx context.Context, st *providers.Statement, day providers.Day) {
	listed := map[string]bool{}
	for _, sr := range st.Refunds {
		listed[sr.RefundNo] = true
	}
	var rs []Refund
	if err := d.r.Shop.Ledger.db.NewSelect().Model(&rs).Where("status = ?", RefundSucceeded).
		Where("finished_at >= ?", day.Start().UTC()).Where("finished_at < ?", day.End().UTC()).
		Where("provider = ?", d.provider.Name()).OrderExpr("finished_at, id").Scan(ctx); err != nil {
		d.failLedger(ctx, "refunds succeeded", err)
		return
	}
	rs = slices.DeleteFunc(rs, func(r Refund) bool { return listed[r.RefundNo] })
	d.each(ctx, "refunds succeeded", len(rs), func(ctx context.Context, i int) {
		r := rs[i]
		res, err := d.provider.QueryRefund(ctx, providers.RefundRequest{RefundNo: r.RefundNo, OrderNo: r.OrderNo, TradeNo: r.TradeNo,
			RefundFen: r.AmountFen, TotalFen: r.PaidFen})
		if err == nil && res.State == providers.RefundSucceeded && (res.RefundFen == 0 || res.RefundFen == r.AmountFen) {
			d.matched()
			return
		}
		said := "the gateway says " + string(res.State)
		if err != nil {
			said = "the gateway could not be asked: " + errorDetail(err)
		}
		d.differ(StatementDifference{Kind: DiffRefundMissing, OrderNo: r.OrderNo, TradeNo: r.TradeNo, RefundNo: r.RefundNo,
			KamiFen: r.AmountFen, NeedsPerson: true,
			Detail: fmt.Sprintf("kami recorded this refund SUCCEEDED; the statement lacks it and %s", said)})
	})
}

// missingPayments looks for the payments kami recorded on day (the
// gateway's own time of payment) that the statement lacks; each is asked
// about again before it is a difference.
func (d *dayRun) missingPayments(ctx context.Context, st *providers.Statement, day providers.Day) {
	listed := map[string]bool{}
	for _, t := range st.Trades {
		listed[t.TradeNo] = true
	}
	var os []Order
	// An order is paid within its lifetime (at most a day) of being
	// placed: the created_at bound lets the (created_at, id) index serve
	// the scan.
	if err := d.r.Shop.Ledger.db.NewSelect().Model(&os).Column("order_no", "provider", "status", "trade_no", "paid_fen", "paid_at").
		Where("created_at >= ?", day.Start().Add(-48*time.Hour).UTC()).Where("created_at < ?", day.End().UTC()).
		Where("provider = ?", d.provider.Name()).Where("trade_no IS NOT NULL").
		Where("paid_at >= ?", day.Start().UTC()).Where("paid_at < ?", day.End().UTC()).
		OrderExpr("created_at, id").Scan(ctx); err != nil {
		d.failLedger(ctx, "orders paid", err)
		return
	}
	os = slices.DeleteFunc(os, func(o Order) bool { return listed[o.TradeNo] })
	d.each(ctx, "orders paid", len(os), func(ctx context.Context, i int) {
		o := os[i]
		ts, err := d.provider.QueryPayment(ctx, o.OrderNo)
		if err == nil && ts.Status == providers.TradePaid && ts.TradeNo == o.TradeNo {
			d.matched()
			return
		}
		said := "the gateway says " + string(ts.Status)
		if err != nil {
			said = "the gateway could not be asked: " + errorDetail(err)
		}
		d.differ(StatementDifference{Kind: DiffPaymentMissing, Subject: o.TradeNo, OrderNo: o.OrderNo, TradeNo: o.TradeNo,
			KamiFen: o.PaidFen, NeedsPerson: true,
			Detail: fmt.Sprintf("kami recorded this payment (the order is %s); the statement lacks it and %s", o.Status, said)})
	})
}

// each calls fn for i in [0, n) with at most Parallel at once, each with a
// query timeout, up to MaxQueries; the rest are a failure of part (the
// next run asks again).
func (d *dayRun) each(ctx context.Context, part string, n int, fn func(ctx context.Context, i int)) {
	limit := min(n, d.r.maxQueries())
	if n > limit {
		d.fail(part, fmt.Errorf("%d not asked about (over %d in one run)", n-limit, limit))
	}
	var wg sync.WaitGroup
	sem := make(chan struct{}, d.r.parallel())
	for i := 0; i < limit; i++ {
		if ctx.Err() != nil {
			d.fail("queries", ctx.Err())
			break
		}
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			qctx, cancel := context.WithTimeout(ctx, d.r.Shop.providerTimeout())
			defer cancel()
			fn(qctx, i)
		}()
	}
	wg.Wait()
}

// checkRecent asks p about the orders it was to be paid for that closed
// since since and were never paid: their trades are in no statement yet.
func (r *StatementReconciler) checkRecent(ctx context.Context, p providers.Provider, since time.Time) *StatementRun {
	l := r.Shop.Ledger
	now := l.now()
	d := &dayRun{r: r, provider: p, run: &StatementRun{Provider: p.Name(), BillDate: providers.DayOf(now).String(), Source: SourceQuery, StartedAt: now}}
	var os []Order
	// An order closes within a day of being placed: the created_at bound
	// lets the (created_at, id) index serve the scan, in its order.
	if err := l.db.NewSelect().Model(&os).Where("status = ?", OrderClosed).Where("provider = ?", p.Name()).
		Where("created_at >= ?", since.Add(-24*time.Hour).UTC()).Where("closed_at >= ?", since.UTC()).
		OrderExpr("created_at, id").Limit(int64(r.maxQueries() + 1)).Scan(ctx); err != nil {
		d.failLedger(ctx, "orders closed", err)
	}
	if len(os) > r.maxQueries() {
		os = os[:r.maxQueries()]
		d.fail("orders closed", fmt.Errorf("only the first %d were asked about", r.maxQueries()))
	}
	d.run.Trades = len(os)
	var unanswered atomic.Int64
	d.each(ctx, "orders closed", len(os), func(ctx context.Context, i int) {
		o := os[i]
		ts, err := p.QueryPayment(ctx, o.OrderNo)
		if err != nil {
			unanswered.Add(1)
			return
		}
		if ts.Status != providers.TradePaid {
			d.matched()
			return
		}
		diff := StatementDifference{Kind: DiffPaidClosed, Subject: ts.TradeNo, OrderNo: o.OrderNo, TradeNo: ts.TradeNo,
			GatewayFen: ts.AmountFen, KamiFen: o.AmountFen}
		if ts.AmountFen != o.AmountFen {
			diff.Kind, diff.NeedsPerson = DiffAmountMismatch, true
			diff.Detail = fmt.Sprintf("the order is of %s, the gateway says %s was paid", money.Format(o.AmountFen), money.Format(ts.AmountFen))
		} else {
			diff.Action, diff.Detail = r.Shop.applyGatewayPayment(ctx, Payment{Provider: p.Name(), NotifyID: "query:" + ts.TradeNo,
				OrderNo: o.OrderNo, TradeNo: ts.TradeNo, AmountFen: ts.AmountFen, PaidAt: ts.PaidAt, Raw: "trade query after close"})
			diff.Detail = "paid at the gateway after all: " + diff.Detail
		}
		d.differ(diff)
	})
	if n := unanswered.Load(); n > 0 {
		d.fail("queries", fmt.Errorf("%d of %d went unanswered; the next run asks again", n, len(os)))
	}
	d.run.Status = RunDone
	if len(d.failures) > 0 {
		d.run.Status = RunFailed
	}
	return r.record(ctx, d)
}

// record writes the run and its differences in one transaction, alerts
// each difference that needs a person and was not reported before, and
// tells OnRun.
func (r *StatementReconciler) record(ctx context.Context, d *dayRun) *StatementRun {
	l := r.Shop.Ledger
	ctx = context.WithoutCancel(ctx)
	run := d.run
	run.FinishedAt = l.now()
	if len(d.failures) > 0 {
		parts := d.failures
		if run.Error != "" {
			parts = append([]string{run.Error}, parts...)
		}
		run.Error = truncate(strings.Join(parts, "; "), 512)
	}
	slices.SortStableFunc(d.diffs, func(a, b StatementDifference) int { return strings.Compare(string(a.Kind), string(b.Kind)) })
	before, err := r.reportedBefore(ctx, run.Provider, d.diffs)
	if err != nil {
		r.Shop.log().ErrorContext(ctx, "statement run: reading earlier differences failed; alerting all", "err", err)
	}
	var alerts []Alert
	run.Differences = len(d.diffs)
	for i := range d.diffs {
		diff := &d.diffs[i]
		diff.CreatedAt = run.FinishedAt
		if diff.Action.settled() {
			run.Settled++
		}
		if !diff.NeedsPerson {
			continue
		}
		run.NeedsPerson++
		if diff.Action == ActFailed {
			// Failing to settle is news each time.
		} else if before[string(diff.Kind)+"\x00"+diff.Subject] {
			diff.Action = ActAlreadyReported
			continue
		} else {
			diff.Action = ActAlerted
		}
		alerts = append(alerts, Alert{Kind: "statement_difference", Subject: diff.Subject,
			Message: fmt.Sprintf("%s %s of %s: %s (order %s): %s", run.Provider, strings.ToLower(string(run.Source)), run.BillDate,
				diff.Kind, diff.OrderNo, diff.Detail)})
	}
	for i := range d.diffs {
		if d.diffs[i].Action == "" {
			d.diffs[i].Action = ActNone
		}
	}
	err = inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
		run.ID = 0
		if _, err := tx.NewInsert().Model(run).Exec(ctx); err != nil {
			return err
		}
		for start := 0; start < len(d.diffs); start += 500 {
			part := d.diffs[start:min(start+500, len(d.diffs))]
			for i := range part {
				part[i].ID, part[i].RunID = 0, run.ID
			}
			if _, err := tx.NewInsert().Model(&part).Exec(ctx); err != nil {
				return err
			}
		}
		return recordEvents(ctx, tx, run.FinishedAt, differenceEvents(d.diffs)...)
	})
	if err != nil {
		// What was settled is in the ledger; only this report is lost.
		r.Shop.log().ErrorContext(ctx, "statement run could not be recorded", "provider", run.Provider, "day", run.BillDate, "err", err)
		run.Error = truncate(strings.TrimPrefix(run.Error+"; recording the run failed (see the log)", "; "), 512)
	}
	for _, a := range alerts {
		r.alert(ctx, a)
	}
	r.Shop.log().InfoContext(ctx, "statement run", "provider", run.Provider, "day", run.BillDate, "source", run.Source,
		"status", run.Status, "trades", run.Trades, "refunds", run.Refunds, "matched", run.Matched,
		"differences", run.Differences, "settled", run.Settled, "needs_person", run.NeedsPerson, "error", run.Error)
	if r.OnRun != nil {
		r.OnRun(*run, d.diffs)
	}
	return run
}

// reportedBefore returns the differences of diffs that an earlier run
// recorded, by kind and subject.
func (r *StatementReconciler) reportedBefore(ctx context.Context, provider string, diffs []StatementDifference) (map[string]bool, error) {
	var subjects []string
	for _, d := range diffs {
		if d.NeedsPerson {
			subjects = append(subjects, d.Subject)
		}
	}
	out := map[string]bool{}
	for start := 0; start < len(subjects); start += 500 {
		var rows []struct {
			Kind    string `bun:"kind"`
			Subject string `bun:"subject"`
		}
		if err := r.Shop.Ledger.db.NewSelect().Model((*StatementDifference)(nil)).Column("kind", "subject").
			Where("provider = ?", provider).Where("subject IN (?)", bun.List(subjects[start:min(start+500, len(subjects))])).
			Scan(ctx, &rows); err != nil {
			return out, err
		}
		for _, row := range rows {
			out[row.Kind+"\x00"+row.Subject] = true
		}
	}
	return out, nil
}

func (r *StatementReconciler) alert(ctx context.Context, a Alert) {
	if r.Alerts != nil {
		r.Alerts.Alert(ctx, a)
	}
}

// ordersByNoChunked is OrdersByNo for any number of numbers.
func ordersByNoChunked(ctx context.Context, l *Ledger, nos []string) (map[string]*Order, error) {
	out := map[string]*Order{}
	nos = uniqueSorted(nos)
	for start := 0; start < len(nos); start += 500 {
		part, err := l.OrdersByNo(ctx, nos[start:min(start+500, len(nos))])
		if err != nil {
			return nil, err
		}
		for k, v := range part {
			out[k] = v
		}
	}
	return out, nil
}

// refundsWhere reads the refunds whose column is one of values.
func refundsWhere(ctx context.Context, db bun.IDB, column string, values []string) ([]Refund, error) {
	values = uniqueSorted(values)
	var out []Refund
	for start := 0; start < len(values); start += 500 {
		var part []Refund
		if err := db.NewSelect().Model(&part).Where("? IN (?)", bun.Ident(column), bun.List(values[start:min(start+500, len(values))])).
			Scan(ctx); err != nil {
			return nil, err
		}
		out = append(out, part...)
	}
	return out, nil
}

// applyGatewayPayment records a payment the gateway reported (in a
// statement, or answering a query) through RecordPayment, the path every
// payment takes, and says what it did.
func (s *Shop) applyGatewayPayment(ctx context.Context, p Payment) (SettleAction, string) {
	res, err := s.RecordPayment(ctx, p)
	if err != nil {
		if ErrorCode(err) == EINTERNAL {
			s.log().ErrorContext(ctx, "recording a payment the gateway reported failed", "order", p.OrderNo, "trade", p.TradeNo, "err", err)
		}
		return ActFailed, "recording the payment failed: " + ErrorMessage(err)
	}
	switch res.Outcome {
	case PaymentDelivered:
		return ActDelivered, "the payment was recorded and the order delivered"
	case PaymentLateRefund:
		return ActLateRefund, "the late payment was recorded and is being refunded (" + res.Refund.RefundNo + ")"
	case PaymentLateDelivered:
		return ActLateDelivered, "the late payment was recorded and the order delivered with its own cards"
	case PaymentDuplicateRefunds:
		return ActDuplicateRefund, "the second payment is being refunded (" + res.Refund.RefundNo + ")"
	}
	return ActNone, "the payment was recorded already"
}

// confirmRefund records that the gateway refunded refundNo, through the
// ledger's one confirmation, and tells subscribers.
func (s *Shop) confirmRefund(ctx context.Context, refundNo, providerRefundID string) (SettleAction, string) {
	r, changed, err := s.Ledger.RefundSucceeded(ctx, refundNo, providerRefundID)
	if err != nil {
		if ErrorCode(err) == EINTERNAL {
			s.log().ErrorContext(ctx, "confirming a refund the gateway made failed", "refund", refundNo, "err", err)
		}
		return ActFailed, "confirming the refund failed: " + ErrorMessage(err)
	}
	if !changed {
		return ActNone, "the refund was confirmed already"
	}
	if o, err := s.Ledger.Order(ctx, r.OrderNo); err == nil {
		s.changed(ctx, o)
	}
	return ActRefundConfirmed, "the refund is now SUCCEEDED"
}

// --- admin lists -----------------------------------------------------------

// StatementRunPage is one page of statement runs, newest first.
type StatementRunPage struct {
	Runs    []StatementRun
	HasNext bool
}

// ListStatementRuns pages through statement runs newest first by
// (started_at, id), the statement_run_started index; provider filters when
// not empty. BAD_INPUT for a bad page size.
func (l *Ledger) ListStatementRuns(ctx context.Context, provider string, after Keyset, limit int) (*StatementRunPage, error) {
	limit, err := clampLimit(limit)
	if err != nil {
		return nil, err
	}
	var runs []StatementRun
	q := l.db.NewSelect().Model(&runs)
	if provider != "" {
		q = q.Where("provider = ?", provider)
	}
	if !after.IsZero() {
		at := after.At.UTC()
		q = q.Where("(started_at < ? OR (started_at = ? AND id < ?))", at, at, after.ID)
	}
	if err := q.OrderExpr("started_at DESC, id DESC").Limit(int64(limit + 1)).Scan(ctx); err != nil {
		return nil, err
	}
	page := &StatementRunPage{Runs: runs}
	if len(runs) > limit {
		page.Runs, page.HasNext = runs[:limit], true
	}
	return page, nil
}

// StatementRun returns one run. NOT_FOUND.
func (l *Ledger) StatementRun(ctx context.Context, id int64) (*StatementRun, error) {
	var run StatementRun
	if err := l.db.NewSelect().Model(&run).Where("id = ?", id).Scan(ctx); err != nil {
		return nil, notFound(err, "statement run %d not found", id)
	}
	return &run, nil
}

// DifferenceFilter selects statement differences. Zero fields select all.
type DifferenceFilter struct {
	RunID       int64
	NeedsPerson bool // only those that need a person
}

// DifferencePage is one page of statement differences, newest first.
type DifferencePage struct {
	Differences []StatementDifference
	HasNext     bool
}

// ListStatementDifferences pages through differences newest first by
// (created_at, id); a run's are served by the (run_id, id) index, those
// that need a person by (needs_person, created_at, id). BAD_INPUT for a
// bad page size.
func (l *Ledger) ListStatementDifferences(ctx context.Context, f DifferenceFilter, after Keyset, limit int) (*DifferencePage, error) {
	limit, err := clampLimit(limit)
	if err != nil {
		return nil, err
	}
	var ds []StatementDifference
	q := l.db.NewSelect().Model(&ds)
	if f.RunID != 0 {
		q = q.Where("run_id = ?", f.RunID)
	}
	if f.NeedsPerson {
		q = q.Where("needs_person = ?", true)
	}
	q = afterKeyset(q, after).OrderExpr("created_at DESC, id DESC").Limit(int64(limit + 1))
	if err := q.Scan(ctx); err != nil {
		return nil, err
	}
	page := &DifferencePage{Differences: ds}
	if len(ds) > limit {
		page.Differences, page.HasNext = ds[:limit], true
	}
	return page, nil
}
