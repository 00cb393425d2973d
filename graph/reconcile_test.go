package graph_test

import (
	"context"
	"testing"
	"time"

	"kami/domain"
	"kami/graph"
	"kami/providers"
)

// reconcilers gives the API both reconciliations, over the sandbox.
func reconcilers(lock domain.Locker) func(*graph.Config) {
	return func(c *graph.Config) {
		c.Reconciler = &domain.Reconciler{Shop: c.Shop, Lock: lock}
		c.Statements = &domain.StatementReconciler{Shop: c.Shop, Lock: lock}
	}
}

// heldLock is a lock another process holds.
type heldLock struct{}

func (heldLock) TryLock(context.Context, string, time.Duration) (func(), bool, error) {
	return nil, false, nil
}

// TestReconcileFieldsAreAdminOnly: every new query and mutation refuses
// anyone without the admin token, with the standard error, and does
// nothing.
func TestReconcileFieldsAreAdminOnly(t *testing.T) {
	t.Parallel()
	b := setup(t, options{mod: reconcilers(nil)})
	p := b.product(t, "5.00", 1)
	o := b.order(t, p, 1, "buyer@example.com")
	if _, _, err := b.sandbox.Pay(o.Order.OrderNo, 500); err != nil {
		t.Fatal(err)
	}
	queries := map[string]string{
		"statementRuns":        `{ statementRuns { edges { node { id } } } }`,
		"statementDifferences": `{ statementDifferences(needsPerson: true) { edges { node { id } } } }`,
		"syncOrder":            `mutation { syncOrder(orderNo: "` + o.Order.OrderNo + `") { trade { action } } }`,
		"runReconciliation":    `mutation { runReconciliation { id } }`,
		"reconcileStatements":  `mutation { reconcileStatements { id } }`,
	}
	for name, q := range queries {
		for _, who := range []as{anon, "Bearer not-the-token"} {
			r := b.do(t, who, q, nil)
			r.wantCode(t, domain.EUNAUTH)
			if string(r.Data) != "null" && r.Data != nil {
				t.Errorf("%s as %q: data %s", name, who, r.Data)
			}
		}
	}
	if st := orderStatus(t, b, o.Order.OrderNo); st != domain.OrderPending {
		t.Fatalf("a refused syncOrder moved the order to %s", st)
	}
	page, err := b.ledger.ListStatementRuns(b.ctx, "", domain.Keyset{}, 10)
	if err != nil || len(page.Runs) != 0 {
		t.Fatalf("a refused reconciliation ran: %+v, %v", page, err)
	}
}

func orderStatus(t *testing.T, b *bundle, orderNo string) domain.OrderStatus {
	t.Helper()
	o, err := b.ledger.Order(b.ctx, orderNo)
	if err != nil {
		t.Fatal(err)
	}
	return o.Status
}

const syncOrder = `mutation($no: String!) { syncOrder(orderNo: $no) {
	order { orderNo status cards }
	trade { answered status tradeNo amount paidAt action detail }
	refunds { refund { refundNo status } answered status amount action detail } } }`

type syncAnswer struct {
	SyncOrder struct {
		Order struct {
			OrderNo, Status string
			Cards           []string
		}
		Trade struct {
			Answered                bool
			Status, TradeNo, Amount *string
			PaidAt                  *string
			Action, Detail          string
		}
		Refunds []struct {
			Refund         struct{ RefundNo, Status string }
			Answered       bool
			Status, Amount *string
			Action, Detail string
		}
	}
}

// TestSyncOrderMutation: the admin's "I paid" button delivers a payment
// whose notification was lost, with the gateway's answer in the reply;
// pressed again it does nothing more.
func TestSyncOrderMutation(t *testing.T) {
	t.Parallel()
	b := setup(t, options{mod: reconcilers(nil)})
	p := b.product(t, "5.00", 2)
	o := b.order(t, p, 1, "buyer@example.com")
	if _, _, err := b.sandbox.Pay(o.Order.OrderNo, 500); err != nil { // the notification is lost
		t.Fatal(err)
	}
	var got syncAnswer
	b.do(t, admin, syncOrder, map[string]any{"no": o.Order.OrderNo}).decode(t, &got)
	s := got.SyncOrder
	if s.Order.Status != "PAID" || len(s.Order.Cards) != 1 || !s.Trade.Answered || deref(s.Trade.Status) != "PAID" ||
		deref(s.Trade.Amount) != "5.00" || s.Trade.TradeNo == nil || s.Trade.PaidAt == nil || s.Trade.Action != "DELIVERED" || s.Trade.Detail == "" {
		t.Fatalf("sync: %+v", s)
	}
	b.do(t, admin, syncOrder, map[string]any{"no": o.Order.OrderNo}).decode(t, &got)
	if got.SyncOrder.Trade.Action != "NONE" || got.SyncOrder.Order.Status != "PAID" {
		t.Fatalf("sync again: %+v", got.SyncOrder)
	}

	// A refund the gateway reports done is confirmed.
	var refund struct{ RefundOrder struct{ RefundNo string } }
	b.do(t, admin, `mutation($no: String!) { refundOrder(orderNo: $no) { refundNo } }`, map[string]any{"no": o.Order.OrderNo}).decode(t, &refund)
	r, err := b.ledger.Refund(b.ctx, refund.RefundOrder.RefundNo)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.sandbox.Refund(b.ctx, providers.RefundRequest{RefundNo: r.RefundNo, OrderNo: r.OrderNo, TradeNo: r.TradeNo,
		RefundFen: r.AmountFen, TotalFen: r.PaidFen}); err != nil {
		t.Fatal(err)
	}
	b.do(t, admin, syncOrder, map[string]any{"no": o.Order.OrderNo}).decode(t, &got)
	if rs := got.SyncOrder.Refunds; len(rs) != 1 || rs[0].Action != "REFUND_CONFIRMED" || rs[0].Refund.Status != "SUCCEEDED" ||
		deref(rs[0].Status) != "SUCCEEDED" || deref(rs[0].Amount) != "5.00" || got.SyncOrder.Order.Status != "REFUNDED" {
		t.Fatalf("sync of a refund the gateway made: %+v", got.SyncOrder)
	}

	b.do(t, admin, syncOrder, map[string]any{"no": "26120100000000000000"}).wantCode(t, domain.ENOTFOUND)
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// TestReconcileStatementsMutation: reconciling the sandbox's statement of
// today through the API settles the payment kami missed, reports the
// refund it never made, and lists both with what was done.
func TestReconcileStatementsMutation(t *testing.T) {
	t.Parallel()
	b := setup(t, options{mod: reconcilers(nil)})
	p := b.product(t, "5.00", 3)
	missed := b.order(t, p, 1, "a@example.com")
	if _, _, err := b.sandbox.Pay(missed.Order.OrderNo, 500); err != nil { // the notification is lost
		t.Fatal(err)
	}
	paid := b.order(t, p, 1, "b@example.com")
	h, body, err := b.sandbox.Pay(paid.Order.OrderNo, 500)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.shop.HandleNotification(b.ctx, "sandbox", h, body); err != nil {
		t.Fatal(err)
	}
	o, _ := b.ledger.Order(b.ctx, paid.Order.OrderNo)
	if _, err := b.sandbox.Refund(b.ctx, providers.RefundRequest{RefundNo: "RX1", OrderNo: o.OrderNo, TradeNo: o.TradeNo,
		RefundFen: 100, TotalFen: 500}); err != nil {
		t.Fatal(err)
	}

	today := providers.DayOf(time.Now()).String()
	var runs struct {
		ReconcileStatements []struct {
			ID, Provider, Date, Source, Status, TradeAmount, RefundAmount   string
			Trades, Refunds, Matched, DifferenceCount, Settled, NeedsPerson int
			Error                                                           *string
		}
	}
	b.do(t, admin, `mutation($d: String) { reconcileStatements(provider: "sandbox", date: $d) {
		id provider date source status trades refunds tradeAmount refundAmount matched differenceCount settled needsPerson error } }`,
		map[string]any{"d": today}).decode(t, &runs)
	if len(runs.ReconcileStatements) != 1 {
		t.Fatalf("runs %+v", runs)
	}
	run := runs.ReconcileStatements[0]
	if run.Provider != "sandbox" || run.Date != today || run.Source != "STATEMENT" || run.Status != "DONE" || run.Trades != 2 ||
		run.Refunds != 1 || run.TradeAmount != "10.00" || run.RefundAmount != "1.00" || run.Matched != 1 || run.DifferenceCount != 2 ||
		run.Settled != 1 || run.NeedsPerson != 1 || run.Error != nil {
		t.Fatalf("run %+v", run)
	}
	if st := orderStatus(t, b, missed.Order.OrderNo); st != domain.OrderPaid {
		t.Fatalf("the missed payment left its order %s", st)
	}

	type diff struct {
		RunID, Kind, Action, Detail, Date string
		OrderNo, TradeNo, RefundNo        *string
		GatewayAmount, KamiAmount         *string
		NeedsPerson                       bool
		Order                             *struct{ OrderNo, Status string }
	}
	var diffs struct {
		StatementDifferences struct {
			Edges []struct {
				Cursor string
				Node   diff
			}
			PageInfo struct {
				HasNextPage bool
				EndCursor   *string
			}
		}
	}
	const list = `query($run: ID, $person: Boolean, $first: Int, $after: String) {
		statementDifferences(runId: $run, needsPerson: $person, first: $first, after: $after) {
		edges { cursor node { runId kind action detail date orderNo tradeNo refundNo gatewayAmount kamiAmount needsPerson order { orderNo status } } }
		pageInfo { hasNextPage endCursor } } }`
	b.do(t, admin, list, map[string]any{"run": run.ID}).decode(t, &diffs)
	byKind := map[string]diff{}
	for _, e := range diffs.StatementDifferences.Edges {
		byKind[e.Node.Kind] = e.Node
	}
	if d := byKind["PAID_PENDING"]; d.Action != "DELIVERED" || d.NeedsPerson || deref(d.OrderNo) != missed.Order.OrderNo ||
		d.Order == nil || d.Order.Status != "PAID" || deref(d.GatewayAmount) != "5.00" || d.RunID != run.ID || d.Date != today {
		t.Errorf("the missed payment: %+v", d)
	}
	if d := byKind["REFUND_UNKNOWN"]; d.Action != "ALERTED" || !d.NeedsPerson || deref(d.RefundNo) != "RX1" || deref(d.GatewayAmount) != "1.00" ||
		d.KamiAmount != nil || d.Detail == "" {
		t.Errorf("the refund kami never made: %+v", d)
	}
	if len(byKind) != 2 {
		t.Errorf("differences %+v", diffs)
	}

	// One page at a time, and only those that need a person.
	b.do(t, admin, list, map[string]any{"run": run.ID, "first": 1}).decode(t, &diffs)
	if len(diffs.StatementDifferences.Edges) != 1 || !diffs.StatementDifferences.PageInfo.HasNextPage {
		t.Fatalf("first page %+v", diffs)
	}
	first := diffs.StatementDifferences.Edges[0].Node.Kind
	b.do(t, admin, list, map[string]any{"run": run.ID, "first": 1, "after": *diffs.StatementDifferences.PageInfo.EndCursor}).decode(t, &diffs)
	if len(diffs.StatementDifferences.Edges) != 1 || diffs.StatementDifferences.PageInfo.HasNextPage || diffs.StatementDifferences.Edges[0].Node.Kind == first {
		t.Fatalf("second page %+v", diffs)
	}
	b.do(t, admin, list, map[string]any{"person": true}).decode(t, &diffs)
	if len(diffs.StatementDifferences.Edges) != 1 || diffs.StatementDifferences.Edges[0].Node.Kind != "REFUND_UNKNOWN" {
		t.Fatalf("needs a person: %+v", diffs)
	}

	var listed struct {
		StatementRuns struct {
			Edges []struct{ Node struct{ ID, Status string } }
		}
	}
	b.do(t, admin, `{ statementRuns(provider: "sandbox") { edges { node { id status } } } }`, nil).decode(t, &listed)
	if len(listed.StatementRuns.Edges) != 1 || listed.StatementRuns.Edges[0].Node.ID != run.ID {
		t.Fatalf("runs listed %+v", listed)
	}

	// Again: nothing settled twice.
	b.do(t, admin, `mutation($d: String) { reconcileStatements(provider: "sandbox", date: $d) { settled needsPerson differenceCount } }`,
		map[string]any{"d": today}).decode(t, &runs)
	if again := runs.ReconcileStatements[0]; again.Settled != 0 || again.DifferenceCount != 1 || again.NeedsPerson != 1 {
		t.Fatalf("second run %+v", again)
	}

	b.do(t, admin, `mutation { reconcileStatements(provider: "sandbox", date: "yesterday") { id } }`, nil).wantCode(t, domain.EBADINPUT)
	b.do(t, admin, `mutation { reconcileStatements(provider: "paypal", date: "2026-12-01") { id } }`, nil).wantCode(t, domain.ENOTFOUND)
	b.do(t, admin, `{ statementDifferences(after: "bm90IGEgY3Vyc29y") { edges { cursor } } }`, nil).wantCode(t, domain.EBADINPUT)
}

// TestRunReconciliationMutation: the nightly reconciliation runs now in
// the server and answers its run; CONFLICT while another process holds its
// lock, UNAVAILABLE where the server has none.
func TestRunReconciliationMutation(t *testing.T) {
	t.Parallel()
	b := setup(t, options{mod: reconcilers(nil)})
	var got struct {
		RunReconciliation struct {
			ID, Summary, StartedAt, FinishedAt string
			Violations                         int
			Error                              *string
		}
	}
	b.do(t, admin, `mutation { runReconciliation { id summary startedAt finishedAt violations error } }`, nil).decode(t, &got)
	if got.RunReconciliation.ID == "" || got.RunReconciliation.Summary == "" || got.RunReconciliation.Error != nil || got.RunReconciliation.Violations != 0 {
		t.Fatalf("run %+v", got)
	}
	runs, err := b.ledger.ReconcileRuns(b.ctx, 10)
	if err != nil || len(runs) != 1 {
		t.Fatalf("runs recorded: %+v, %v", runs, err)
	}
	var audited int
	if err := b.db.NewSelect().Model((*domain.AuditEntry)(nil)).ColumnExpr("COUNT(*)").Where("action = ?", "reconcile.run").Scan(b.ctx, &audited); err != nil || audited != 1 {
		t.Fatalf("%d audit entries, %v", audited, err)
	}

	held := setup(t, options{mod: reconcilers(heldLock{})})
	held.do(t, admin, `mutation { runReconciliation { id } }`, nil).wantCode(t, domain.ECONFLICT)
	held.do(t, admin, `mutation { reconcileStatements { id } }`, nil).wantCode(t, domain.ECONFLICT)

	none := setup(t, options{})
	none.do(t, admin, `mutation { runReconciliation { id } }`, nil).wantCode(t, domain.EUNAVAILABLE)
	none.do(t, admin, `mutation { reconcileStatements { id } }`, nil).wantCode(t, domain.EUNAVAILABLE)
}
