package domain_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/domain/domaintest"
	"kami/providers"
	"kami/providers/fault"
	"kami/providers/sandbox"
)

// statementBundle is a ledger at real time (the emulators keep their books
// at real time), a shop with one gateway, and the reconciler.
type statementBundle struct {
	*bundle
	gw    *gateway
	shop  *domain.Shop
	rec   *domain.StatementReconciler
	clock *domaintest.Clock
	p     *domain.Product
	n     int
}

func newStatementBundle(t *testing.T, db *bun.DB, gw *gateway, cfg domain.Config) *statementBundle {
	t.Helper()
	b := setup(t, db, cfg)
	sb := &statementBundle{bundle: b, gw: gw, clock: domaintest.NewClock(time.Now().UTC().Truncate(time.Microsecond))}
	b.ledger.Now, b.ledger.DBClock = sb.clock.Now, sb.clock.Now
	sb.shop = b.shopFor(gw)
	sb.rec = &domain.StatementReconciler{Shop: sb.shop, Alerts: b.alerts}
	sb.p = b.product(t, 1250, 30)
	return sb
}

// place places an order with the gateway (its trade created there).
func (sb *statementBundle) place(t *testing.T) *domain.Order {
	t.Helper()
	sb.n++
	co, err := sb.shop.PlaceOrder(sb.ctx, domain.PlaceOrderInput{ProductID: sb.p.ID, Quantity: 1,
		Contact: fmt.Sprintf("buyer%d@example.com", sb.n), Provider: sb.gw.name}, "", "203.0.113.9")
	if err != nil {
		t.Fatalf("PlaceOrder: %v", err)
	}
	return co.Order
}

// deliver hands a notification to the shop, as the webhook does.
func (sb *statementBundle) deliver(t *testing.T, n note) {
	t.Helper()
	if _, err := sb.shop.HandleNotification(sb.ctx, sb.gw.name, n.header, n.body); err != nil {
		t.Fatalf("notification: %v", err)
	}
}

func (sb *statementBundle) order(t *testing.T, orderNo string) *domain.Order {
	t.Helper()
	o, err := sb.ledger.Order(sb.ctx, orderNo)
	if err != nil {
		t.Fatal(err)
	}
	return o
}

func (sb *statementBundle) refundsOf(t *testing.T, orderNo string) []domain.Refund {
	t.Helper()
	var rs []domain.Refund
	if err := sb.db.NewSelect().Model(&rs).Where("order_no = ?", orderNo).Order("id").Scan(sb.ctx); err != nil {
		t.Fatal(err)
	}
	return rs
}

// reconcile reconciles the statement of each day and returns the runs and
// all their differences.
func (sb *statementBundle) reconcile(t *testing.T, days []providers.Day) ([]domain.StatementRun, []domain.StatementDifference) {
	t.Helper()
	var runs []domain.StatementRun
	var diffs []domain.StatementDifference
	for _, d := range days {
		run, err := sb.rec.Reconcile(sb.ctx, "admin", sb.gw.name, d)
		if err != nil {
			t.Fatalf("Reconcile(%s): %v", d, err)
		}
		if run.Status != domain.RunDone || run.Error != "" {
			t.Fatalf("run of %s: %+v", d, run)
		}
		runs = append(runs, *run)
		page, err := sb.ledger.ListStatementDifferences(sb.ctx, domain.DifferenceFilter{RunID: run.ID}, domain.Keyset{}, domain.MaxPageSize)
		if err != nil {
			t.Fatal(err)
		}
		diffs = append(diffs, page.Differences...)
		// Each difference not reported before is one event, written with the run.
		want := 0
		for _, d := range page.Differences {
			if d.Action != domain.ActAlreadyReported {
				want++
			}
		}
		var got int
		for _, ev := range outboxEvents(t, sb.bundle, domain.EventReconciliationDifference) {
			if strings.Contains(ev.Payload, fmt.Sprintf(`"runId":"%d"`, run.ID)) {
				got++
				if strings.Contains(ev.Payload, `"id":"0"`) {
					t.Fatalf("an event names no difference: %s", ev.Payload)
				}
			}
		}
		if got != want {
			t.Fatalf("run %d: %d reconciliation.difference events, want %d", run.ID, got, want)
		}
	}
	return runs, diffs
}

// days lists the days of the given times, each once, in order: a test that
// runs across midnight (Beijing) reconciles both days.
func days(ts ...time.Time) []providers.Day {
	var out []providers.Day
	for _, t := range ts {
		if d := providers.DayOf(t); !slices.Contains(out, d) {
			out = append(out, d)
		}
	}
	slices.SortFunc(out, func(a, b providers.Day) int { return a.Start().Compare(b.Start()) })
	return out
}

type wantDiff struct {
	kind   domain.DifferenceKind
	action domain.SettleAction
}

// TestStatementReconciliation plants every kind of difference at each
// gateway emulator, on every database, and reconciles the day's statement
// (downloaded through the real gopay client): each is found and settled by
// the rules that already exist, or alerted; a second run settles nothing
// and alerts nothing new.
func TestStatementReconciliation(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		for _, gw := range gateways(t) {
			t.Run(gw.name, func(t *testing.T) { statementScenario(t, db, gw) })
		}
	})
}

func statementScenario(t *testing.T, db *bun.DB, gw *gateway) {
	sb := newStatementBundle(t, db, gw, domain.Config{OrderTTL: time.Minute})
	ctx := sb.ctx
	start := time.Now()

	// In order: paid and delivered as usual.
	fine := sb.place(t)
	sb.deliver(t, gw.pay(t, fine.OrderNo, fine.AmountFen))
	// Paid, the notification dropped, the order still PENDING.
	pending := sb.place(t)
	gw.pay(t, pending.OrderNo, pending.AmountFen)
	// Paid, the notification dropped, and the order closed on time.
	closed := sb.place(t)
	gw.pay(t, closed.OrderNo, closed.AmountFen)
	// The gateway took another amount than the order's.
	mismatch := sb.place(t)
	gw.pay(t, mismatch.OrderNo, mismatch.AmountFen-50)
	// Paid for an order kami never placed.
	stranger := fmt.Sprintf("STRANGER%d", time.Now().UnixNano()%1e9)
	gw.pay(t, stranger, 700)
	// kami recorded a payment the gateway never took.
	phantom := sb.place(t)
	sb.deliver(t, gw.phantom(t, phantom.OrderNo, phantom.AmountFen))
	// A refund made at the gateway that kami never made.
	foreign := sb.place(t)
	sb.deliver(t, gw.pay(t, foreign.OrderNo, foreign.AmountFen))
	foreignTrade := sb.order(t, foreign.OrderNo).TradeNo
	foreignRefund := fmt.Sprintf("RX%d", time.Now().UnixNano()%1e12)
	if _, err := gw.provider.Refund(ctx, providers.RefundRequest{RefundNo: foreignRefund, OrderNo: foreign.OrderNo, TradeNo: foreignTrade,
		RefundFen: 300, TotalFen: foreign.AmountFen}); err != nil {
		t.Fatal(err)
	}
	// A refund kami has SUCCEEDED that the gateway never made.
	forged := sb.place(t)
	sb.deliver(t, gw.pay(t, forged.OrderNo, forged.AmountFen))
	forgedRefund, err := sb.shop.RequestRefund(ctx, forged.OrderNo, "buyer asked", "admin")
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := sb.ledger.RefundSucceeded(ctx, forgedRefund.RefundNo, ""); err != nil {
		t.Fatal(err)
	}
	// A refund the gateway made whose answer was lost: kami still has it
	// PROCESSING, to be asked about before the next attempt.
	lost := sb.place(t)
	sb.deliver(t, gw.pay(t, lost.OrderNo, lost.AmountFen))
	lostRefund, err := sb.shop.RequestRefund(ctx, lost.OrderNo, "buyer asked", "admin")
	if err != nil {
		t.Fatal(err)
	}
	gw.fault(fault.OpRefund, fault.TimeoutAfterEffect, 1)
	if r, err := sb.shop.ProcessRefund(ctx, lostRefund.RefundNo); err != nil || r.Status != domain.RefundProcessing || r.RetryCount != 1 {
		t.Fatalf("the refund whose answer was lost: %+v, %v", r, err)
	}
	// The close runs without asking the gateway (as when that question
	// failed): the paid order closes.
	sb.clock.Advance(2 * time.Minute)
	if rs, err := sb.shop.CloseOrders(ctx, []string{closed.OrderNo}, domain.CloseTimeout); err != nil || rs[0].Outcome != domain.Closed {
		t.Fatalf("close: %+v, %v", rs, err)
	}
	refundsBefore := len(sb.refundsOf(t, closed.OrderNo))

	ds := days(start, time.Now(), sb.clock.Now())
	runs, diffs := sb.reconcile(t, ds)
	want := map[string]wantDiff{
		pending.OrderNo:      {domain.DiffPaidPending, domain.ActDelivered},
		closed.OrderNo:       {domain.DiffPaidClosed, domain.ActLateRefund},
		mismatch.OrderNo:     {domain.DiffAmountMismatch, domain.ActAlerted},
		stranger:             {domain.DiffPaidUnknownOrder, domain.ActAlerted},
		phantom.OrderNo:      {domain.DiffPaymentMissing, domain.ActAlerted},
		foreign.OrderNo:      {domain.DiffRefundUnknown, domain.ActAlerted},
		forgedRefund.OrderNo: {domain.DiffRefundMissing, domain.ActAlerted},
		lostRefund.OrderNo:   {domain.DiffRefundUnconfirmed, domain.ActRefundConfirmed},
	}
	got := map[string]wantDiff{}
	for _, d := range diffs {
		if _, dup := got[d.OrderNo]; dup {
			t.Errorf("two differences for order %s", d.OrderNo)
		}
		got[d.OrderNo] = wantDiff{d.Kind, d.Action}
		if d.NeedsPerson != (d.Action == domain.ActAlerted) {
			t.Errorf("difference %s %s: needs a person %v", d.Kind, d.OrderNo, d.NeedsPerson)
		}
	}
	for no, w := range want {
		if got[no] != w {
			t.Errorf("order %s: difference %+v, want %+v", no, got[no], w)
		}
	}
	if len(diffs) != len(want) {
		t.Errorf("%d differences, want %d: %+v", len(diffs), len(want), diffs)
	}
	for _, d := range diffs {
		switch d.Kind {
		case domain.DiffAmountMismatch:
			if d.GatewayFen != mismatch.AmountFen-50 || d.KamiFen != mismatch.AmountFen {
				t.Errorf("amount mismatch recorded as %d at the gateway, %d in kami", d.GatewayFen, d.KamiFen)
			}
		case domain.DiffRefundUnknown:
			if d.RefundNo != foreignRefund || d.GatewayFen != 300 {
				t.Errorf("unknown refund recorded as %s of %d", d.RefundNo, d.GatewayFen)
			}
		}
	}
	settled, needsPerson := 0, 0
	for _, r := range runs {
		settled += r.Settled
		needsPerson += r.NeedsPerson
	}
	if settled != 3 || needsPerson != 5 {
		t.Errorf("runs settled %d and need a person for %d, want 3 and 5: %+v", settled, needsPerson, runs)
	}

	// Settled by the paths every payment takes.
	if o := sb.order(t, pending.OrderNo); o.Status != domain.OrderPaid || o.TradeNo == "" || sb.cardStatuses(t, o.OrderNo)[domain.CardSold] != 1 {
		t.Errorf("the pending order ended %s with cards %v", o.Status, sb.cardStatuses(t, o.OrderNo))
	}
	if o := sb.order(t, closed.OrderNo); o.Status != domain.OrderRefunding {
		t.Errorf("the closed order ended %s, want REFUNDING", o.Status)
	}
	if rs := sb.refundsOf(t, closed.OrderNo); len(rs) != refundsBefore+1 || rs[len(rs)-1].Cause != domain.CauseLatePayment || rs[len(rs)-1].Status != domain.RefundProcessing {
		t.Errorf("the closed order's refunds: %+v", rs)
	}
	if o := sb.order(t, mismatch.OrderNo); o.Status != domain.OrderPending {
		t.Errorf("the order paid with another amount ended %s, want it left alone (PENDING)", o.Status)
	}
	if o := sb.order(t, lost.OrderNo); o.Status != domain.OrderRefunded {
		t.Errorf("the order whose refund answer was lost ended %s, want REFUNDED", o.Status)
	}
	if n := sb.alerts.count("statement_difference"); n != 5 {
		t.Errorf("%d statement_difference alerts, want 5", n)
	}
	sb.mustAudit(t)

	// A second run over the same statements settles nothing and alerts
	// nothing new; what needs a person is recorded again, marked so.
	var statuses []domain.OrderStatus
	for _, no := range []string{pending.OrderNo, closed.OrderNo, mismatch.OrderNo, lost.OrderNo, forged.OrderNo, phantom.OrderNo} {
		statuses = append(statuses, sb.order(t, no).Status)
	}
	var refundsCount int
	sb.db.NewSelect().Model((*domain.Refund)(nil)).ColumnExpr("COUNT(*)").Scan(ctx, &refundsCount)
	runs, diffs = sb.reconcile(t, ds)
	for _, r := range runs {
		if r.Settled != 0 {
			t.Errorf("second run settled %d: %+v", r.Settled, r)
		}
	}
	if len(diffs) != 5 {
		t.Errorf("second run: %d differences, want the 5 that need a person: %+v", len(diffs), diffs)
	}
	for _, d := range diffs {
		if !d.NeedsPerson || d.Action != domain.ActAlreadyReported {
			t.Errorf("second run: difference %s %s %s", d.Kind, d.OrderNo, d.Action)
		}
	}
	if n := sb.alerts.count("statement_difference"); n != 5 {
		t.Errorf("%d statement_difference alerts after the second run, want still 5", n)
	}
	for i, no := range []string{pending.OrderNo, closed.OrderNo, mismatch.OrderNo, lost.OrderNo, forged.OrderNo, phantom.OrderNo} {
		if st := sb.order(t, no).Status; st != statuses[i] {
			t.Errorf("order %s moved from %s to %s on the second run", no, statuses[i], st)
		}
	}
	var refundsAfter int
	sb.db.NewSelect().Model((*domain.Refund)(nil)).ColumnExpr("COUNT(*)").Scan(ctx, &refundsAfter)
	if refundsAfter != refundsCount {
		t.Errorf("the second run made %d refunds", refundsAfter-refundsCount)
	}
	sb.mustAudit(t)
}

// TestStatementNotReady: a statement the gateway has not published yet is
// a NOT_READY run, not an empty statement: nothing is flagged or alerted,
// and the scheduled run tries the day again.
func TestStatementNotReady(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		gw := alipayGatewayWith(t, false)
		sb := newStatementBundle(t, db, gw, domain.Config{})
		o := sb.place(t)
		sb.deliver(t, gw.pay(t, o.OrderNo, o.AmountFen))
		run, err := sb.rec.Reconcile(sb.ctx, "", gw.name, providers.DayOf(time.Now()))
		if err != nil {
			t.Fatal(err)
		}
		if run.Status != domain.RunNotReady || run.Differences != 0 || run.Matched != 0 || len(sb.alerts.kinds()) != 0 {
			t.Fatalf("run before the statement is out: %+v, alerts %v", run, sb.alerts.kinds())
		}
	})
}

// TestStatementGatewayFails: a statement that cannot be had is a FAILED run
// with an alert, never an empty statement against which kami's payments
// would all look missing.
func TestStatementGatewayFails(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		gw := alipayGateway(t)
		sb := newStatementBundle(t, db, gw, domain.Config{})
		o := sb.place(t)
		sb.deliver(t, gw.pay(t, o.OrderNo, o.AmountFen))
		gw.fault(fault.OpStatement, fault.Server5xx, 1)
		run, err := sb.rec.Reconcile(sb.ctx, "", gw.name, providers.DayOf(time.Now()))
		if err != nil {
			t.Fatal(err)
		}
		if run.Status != domain.RunFailed || run.Differences != 0 || run.Error == "" || strings.Contains(run.Error, "SELECT") {
			t.Fatalf("run under a failing gateway: %+v", run)
		}
		if sb.alerts.count("statement_failed") != 1 {
			t.Fatalf("alerts %v", sb.alerts.kinds())
		}
		if _, err := sb.rec.Reconcile(sb.ctx, "", gw.name, providers.DayOf(time.Now()).AddDays(1)); domain.ErrorCode(err) != domain.EBADINPUT {
			t.Fatalf("a day not begun: %v", err)
		}
	})
}

// TestRecentClosedOrdersAsked: the orders closed today, whose statement
// comes tomorrow, are asked about one by one: one paid after all takes the
// late-payment policy, one never paid is left alone, and asking again
// settles nothing more.
func TestRecentClosedOrdersAsked(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		for _, gw := range gateways(t) {
			t.Run(gw.name, func(t *testing.T) {
				sb := newStatementBundle(t, db, gw, domain.Config{OrderTTL: time.Minute})
				paid, unpaid := sb.place(t), sb.place(t)
				gw.pay(t, paid.OrderNo, paid.AmountFen) // the notification is lost
				sb.clock.Advance(2 * time.Minute)
				if _, err := sb.shop.CloseOrders(sb.ctx, []string{paid.OrderNo, unpaid.OrderNo}, domain.CloseTimeout); err != nil {
					t.Fatal(err)
				}
				since := sb.clock.Now().Add(-time.Hour)
				run, err := sb.rec.CheckRecent(sb.ctx, "admin", gw.name, since)
				if err != nil {
					t.Fatal(err)
				}
				if run.Source != domain.SourceQuery || run.Status != domain.RunDone || run.Trades != 2 || run.Matched != 1 || run.Settled != 1 {
					t.Fatalf("run %+v", run)
				}
				if o := sb.order(t, paid.OrderNo); o.Status != domain.OrderRefunding {
					t.Fatalf("the order paid after its close ended %s", o.Status)
				}
				if o := sb.order(t, unpaid.OrderNo); o.Status != domain.OrderClosed {
					t.Fatalf("the unpaid order ended %s", o.Status)
				}
				again, err := sb.rec.CheckRecent(sb.ctx, "admin", gw.name, since)
				if err != nil || again.Settled != 0 || again.Differences != 0 || again.Trades != 1 {
					t.Fatalf("asking again: %+v, %v", again, err)
				}
				if n := len(sb.refundsOf(t, paid.OrderNo)); n != 1 {
					t.Fatalf("%d refunds for the late payment", n)
				}

				// Bounded: over MaxQueries, the rest waits for the next run.
				sb.rec.MaxQueries = 1
				more := sb.place(t)
				sb.clock.Advance(2 * time.Minute)
				sb.shop.CloseOrders(sb.ctx, []string{more.OrderNo}, domain.CloseTimeout)
				bounded, err := sb.rec.CheckRecent(sb.ctx, "", gw.name, since)
				if err != nil || bounded.Trades != 1 || bounded.Status != domain.RunFailed || !strings.Contains(bounded.Error, "only the first 1") {
					t.Fatalf("bounded run: %+v, %v", bounded, err)
				}
			})
		}
	})
}

// TestScheduledStatementRun: the scheduled run reconciles each of the last
// days not reconciled yet, then asks about today's closed orders; run
// again, it reconciles no day twice. The sandbox, whose books are lost on
// restart, is only asked about its closed orders.
func TestScheduledStatementRun(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		gw := wechatGateway(t)
		sb := newStatementBundle(t, db, gw, domain.Config{})
		sandboxProvider, err := sandbox.New(sandbox.Config{Secret: "s", BaseURL: "http://127.0.0.1/"})
		if err != nil {
			t.Fatal(err)
		}
		sb.shop.Providers = providers.NewRegistry(gw.provider, sandboxProvider)
		sb.rec.CatchUpDays = 3
		sb.rec.ManualOnly = []string{sandbox.Name}
		runs, err := sb.rec.Run(sb.ctx, "")
		if err != nil {
			t.Fatal(err)
		}
		var kinds []string
		for _, r := range runs {
			kinds = append(kinds, fmt.Sprintf("%s %s %s %s", r.Provider, r.Source, r.BillDate, r.Status))
		}
		today := providers.DayOf(sb.clock.Now())
		want := []string{
			"sandbox QUERY " + today.String() + " DONE",
			"wechat STATEMENT " + today.AddDays(-3).String() + " DONE",
			"wechat STATEMENT " + today.AddDays(-2).String() + " DONE",
			"wechat STATEMENT " + today.AddDays(-1).String() + " DONE",
			"wechat QUERY " + today.String() + " DONE",
		}
		if !slices.Equal(kinds, want) {
			t.Fatalf("runs %v, want %v", kinds, want)
		}
		again, err := sb.rec.Run(sb.ctx, "")
		if err != nil || len(again) != 2 || again[0].Source != domain.SourceQuery || again[1].Source != domain.SourceQuery {
			t.Fatalf("second scheduled run: %+v, %v", again, err)
		}
		page, err := sb.ledger.ListStatementRuns(sb.ctx, gw.name, domain.Keyset{}, 3)
		if err != nil || len(page.Runs) != 3 || !page.HasNext || page.Runs[0].ID != again[1].ID {
			t.Fatalf("runs listed %+v, %v", page, err)
		}
		last := page.Runs[len(page.Runs)-1]
		next, err := sb.ledger.ListStatementRuns(sb.ctx, gw.name, domain.Keyset{At: last.StartedAt, ID: last.ID}, 3)
		if err != nil || len(next.Runs) != 2 || next.HasNext {
			t.Fatalf("second page %+v, %v", next, err)
		}
	})
}

// TestStatementLockHeld: a reconciliation another process runs is a
// CONFLICT, and nothing is done.
func TestStatementLockHeld(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		gw := alipayGateway(t)
		sb := newStatementBundle(t, db, gw, domain.Config{})
		sb.rec.Lock = heldLock{}
		if _, err := sb.rec.Reconcile(context.Background(), "admin", gw.name, providers.DayOf(time.Now())); domain.ErrorCode(err) != domain.ECONFLICT {
			t.Fatalf("Reconcile under a held lock: %v", err)
		}
		if _, err := sb.rec.Run(context.Background(), ""); domain.ErrorCode(err) != domain.ECONFLICT {
			t.Fatalf("Run under a held lock: %v", err)
		}
		page, err := sb.ledger.ListStatementRuns(sb.ctx, "", domain.Keyset{}, 10)
		if err != nil || len(page.Runs) != 0 {
			t.Fatalf("runs %+v, %v", page, err)
		}
	})
}

// heldLock is a lock another process holds.
type heldLock struct{}

func (heldLock) TryLock(context.Context, string, time.Duration) (func(), bool, error) {
	return nil, false, nil
}
