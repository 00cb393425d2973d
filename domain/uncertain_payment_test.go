package domain_test

import (
	"fmt"
	"slices"
	"testing"

	"github.com/uptrace/bun"

	"kami/domain"
)

// TestUncertainCommitPaysOnce: when the answer to a payment batch's COMMIT
// is lost (the server applied it, or it never got it), every payment of
// the batch is still answered without an error (delivered, or seen
// before), each order is PAID once with its amount, its cards SOLD once,
// one notification row, one journal sell row, one order.paid event and
// one mail each; no refund, no alert, the audit clean; and the mail a
// redone payment found written (answered as seen before, so nobody
// schedules it) is open for the mail sweeper. The gateway's redelivery of
// the same notifications afterwards changes nothing.
func TestUncertainCommitPaysOnce(t *testing.T) {
	t.Parallel()
	eachWithLostCommits(t, func(t *testing.T, db *bun.DB, lost *lostCommits) {
		b := setup(t, db, domain.Config{Mail: true})
		p := b.product(t, 100, 40)
		for n, c := range []struct {
			name         string
			applied, cut bool
		}{
			{"applied, answer lost", true, false},
			{"applied, connection cut after", true, true},
			{"rolled back, answer lost", false, false},
			{"connection cut before COMMIT", false, true},
		} {
			orders, ps := b.payable(t, p, fmt.Sprint(n), 1, 2, 1, 3)
			before := b.ledger.PayStats()
			lost.applied, lost.cut = c.applied, c.cut
			lost.armed.Store(1)
			res, errs := b.ledger.RecordPaymentsForTest(b.ctx, ps)
			if lost.armed.Load() != 0 {
				t.Fatalf("%s: the commit fault did not fire", c.name)
			}
			if st := b.ledger.PayStats(); st.Batches != before.Batches+1 || st.Calls != before.Calls+int64(len(ps)) || st.Split != before.Split+1 {
				t.Fatalf("%s: pay stats %+v (before %+v): want the %d payments in one shared transaction, redone call by call", c.name, st, before, len(ps))
			}
			b.answeredAndPaidOnce(t, c.name, orders, ps, res, errs)

			// The gateway redelivers (it was answered with an error, or
			// never heard the answer): together, then one by one.
			snap := b.ledgerSnapshot(t)
			res, errs = b.ledger.RecordPaymentsForTest(b.ctx, ps)
			for i := range ps {
				if errs[i] != nil || res[i] == nil || res[i].Outcome != domain.PaymentDuplicate || res[i].Mail != nil || res[i].Refund != nil {
					t.Fatalf("%s: redelivered payment %d: %+v, %v; want seen before", c.name, i, res[i], errs[i])
				}
			}
			for i, pay := range ps {
				r, err := b.ledger.RecordPayment(b.ctx, pay)
				if err != nil || r.Outcome != domain.PaymentDuplicate || r.Mail != nil || r.Refund != nil {
					t.Fatalf("%s: payment %d redelivered alone: %+v, %v; want seen before", c.name, i, r, err)
				}
			}
			if again := b.ledgerSnapshot(t); !slices.Equal(again, snap) {
				t.Fatalf("%s: the redeliveries changed the ledger:\nbefore %v\nafter  %v", c.name, snap, again)
			}
			b.paidOnce(t, c.name, orders, ps)
		}
		if ks := b.alerts.kinds(); len(ks) != 0 {
			t.Fatalf("alerts %v, want none", ks)
		}
	})
}

// payable places one PENDING order of each quantity qtys of p, with
// contacts of its own (tag tells a call's apart), and the payment of each
// as its gateway would notify it.
func (b *bundle) payable(t *testing.T, p *domain.Product, tag string, qtys ...int) ([]*domain.Order, []domain.Payment) {
	t.Helper()
	var (
		orders []*domain.Order
		ps     []domain.Payment
	)
	for i, qty := range qtys {
		placed, err := b.ledger.PlaceOrder(b.ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: qty,
			Contact: fmt.Sprintf("pay%s-%d@example.com", tag, i), Provider: "sandbox"})
		if err != nil {
			t.Fatalf("PlaceOrder: %v", err)
		}
		o := placed.Order
		orders = append(orders, o)
		ps = append(ps, domain.Payment{Provider: o.Provider, NotifyID: "N-" + o.OrderNo, OrderNo: o.OrderNo,
			TradeNo: "T-" + o.OrderNo, AmountFen: o.AmountFen, PaidAt: b.clock.Now(), Raw: "{}"})
	}
	return orders, ps
}

// answeredAndPaidOnce checks a batch's answers to ps, the payments of
// orders: each without an error, delivered or seen before, with its order
// PAID and no refund; then paidOnce, and that each order's mail is open
// for the mail sweeper (a payment answered as seen before schedules none).
func (b *bundle) answeredAndPaidOnce(t *testing.T, name string, orders []*domain.Order, ps []domain.Payment, res []*domain.PaymentResult, errs []error) {
	t.Helper()
	for i, o := range orders {
		if errs[i] != nil || res[i] == nil {
			t.Fatalf("%s: payment %d: %+v, %v; want an answer the gateway can take", name, i, res[i], errs[i])
		}
		if res[i].Outcome != domain.PaymentDelivered && res[i].Outcome != domain.PaymentDuplicate {
			t.Fatalf("%s: payment %d: %s; want delivered or seen before", name, i, res[i].Outcome)
		}
		if got := res[i].Order; got == nil || got.OrderNo != o.OrderNo || got.Status != domain.OrderPaid {
			t.Fatalf("%s: payment %d answered with order %+v, want %s PAID", name, i, got, o.OrderNo)
		}
		if res[i].Refund != nil {
			t.Fatalf("%s: payment %d created refund %+v", name, i, res[i].Refund)
		}
	}
	b.paidOnce(t, name, orders, ps)
	open := b.openMails(t)
	for _, o := range orders {
		if !open[o.OrderNo] {
			t.Fatalf("%s: the mail of order %s is not open for the mail sweeper", name, o.OrderNo)
		}
	}
}

// TestUncertainPaymentCommitStillUnderWay: when the answer to a payment
// batch's COMMIT is lost while the server has yet to apply it, the
// payments redone one by one wait for the batch's transaction (on the
// notification's unique key, and the orders' rows) instead of delivering
// a second time beside it: each is answered (seen before, once the late
// COMMIT lands), each order paid once. The COMMIT reaches the server only
// once a redone payment is seen waiting on it, or the batch has answered
// (which, had nothing waited, would have paid twice). PostgreSQL and
// MariaDB: SQLite's one connection is the batch's until its COMMIT is
// done.
func TestUncertainPaymentCommitStillUnderWay(t *testing.T) {
	t.Parallel()
	eachWithHeldCommit(t, "", func(t *testing.T, waited waitedFunc, db *bun.DB, lost *lostCommits) {
		b := setup(t, db, domain.Config{Mail: true})
		p := b.product(t, 100, 10)
		orders, ps := b.payable(t, p, "late", 1, 2, 1)
		type answer struct {
			res  []*domain.PaymentResult
			errs []error
		}
		id, answers := startHeld(t, lost, func() answer {
			res, errs := b.ledger.RecordPaymentsForTest(b.ctx, ps)
			return answer{res, errs}
		})
		var a *answer
		waitFor(t, "a redone payment waiting on the batch, or the batch answered", func() bool {
			select {
			case got := <-answers:
				a = &got
				return true
			default:
			}
			w, err := waited(b.ctx, db, id)
			if err != nil {
				t.Fatal(err)
			}
			return w
		})
		lost.release()
		if a == nil {
			got := receive(t, "the batch's answer", answers)
			a = &got
		}
		receive(t, "the late COMMIT", lost.committed)
		b.answeredAndPaidOnce(t, "late COMMIT", orders, ps, a.res, a.errs)
	})
}

// paidOnce checks that each of orders was paid once by its payment ps[i]:
// PAID with its amount and trade, its cards SOLD, one notification, one
// journal sell row, one order.paid event, one mail, no refund; and the
// audit is clean.
func (b *bundle) paidOnce(t *testing.T, name string, orders []*domain.Order, ps []domain.Payment) {
	t.Helper()
	count := func(table string, where string, args ...any) int {
		t.Helper()
		n, err := b.db.NewSelect().Table(table).Where(where, args...).Count(b.ctx)
		if err != nil {
			t.Fatalf("%s: count %s: %v", name, table, err)
		}
		return int(n)
	}
	for i, o := range orders {
		got, err := b.ledger.Order(b.ctx, o.OrderNo)
		if err != nil || got.Status != domain.OrderPaid || got.PaidFen != ps[i].AmountFen || got.TradeNo != ps[i].TradeNo || got.DeliveredAt.IsZero() {
			t.Fatalf("%s: order %s: %+v, %v; want PAID %d fen by %s", name, o.OrderNo, got, err, ps[i].AmountFen, ps[i].TradeNo)
		}
		if cards := b.cardStatuses(t, o.OrderNo); cards[domain.CardSold] != o.Quantity || len(cards) != 1 {
			t.Fatalf("%s: order %s: cards %v, want %d SOLD", name, o.OrderNo, cards, o.Quantity)
		}
		for _, c := range []struct {
			what, table, where string
			args               []any
		}{
			{"notification rows", "payment_notification", "provider = ? AND dedup_key = ?", []any{ps[i].Provider, ps[i].NotifyID}},
			{"notification rows of the order", "payment_notification", "order_no = ?", []any{o.OrderNo}},
			{"journal sell rows", "stock_flow", "order_no = ? AND change_type = ? AND quantity = ?", []any{o.OrderNo, domain.FlowSell, o.Quantity}},
			{"journal sell rows of any quantity", "stock_flow", "order_no = ? AND change_type = ?", []any{o.OrderNo, domain.FlowSell}},
			{"order.paid events", "events", "type = ? AND subject = ?", []any{domain.EventOrderPaid, o.OrderNo}},
			{"mails", "mail_sends", "order_no = ?", []any{o.OrderNo}},
		} {
			if n := count(c.table, c.where, c.args...); n != 1 {
				t.Fatalf("%s: order %s: %d %s, want 1", name, o.OrderNo, n, c.what)
			}
		}
		if n := count("refund_order", "order_no = ?", o.OrderNo); n != 0 {
			t.Fatalf("%s: order %s: %d refunds, want none", name, o.OrderNo, n)
		}
	}
	b.mustAudit(t)
	if t.Failed() {
		t.FailNow()
	}
}

// openMails is the set of orders with a mail the mail sweeper puts back
// on the queue.
func (b *bundle) openMails(t *testing.T) map[string]bool {
	t.Helper()
	ms, err := b.ledger.OpenMails(b.ctx, 10_000)
	if err != nil {
		t.Fatal(err)
	}
	var ids []int64
	for _, m := range ms {
		ids = append(ids, m.ID)
	}
	var rows []domain.MailSend
	if len(ids) > 0 {
		if err := b.db.NewSelect().Model(&rows).Where("id IN (?)", bun.List(ids)).Scan(b.ctx); err != nil {
			t.Fatal(err)
		}
	}
	open := map[string]bool{}
	for _, m := range rows {
		open[m.OrderNo] = true
	}
	return open
}

// ledgerSnapshot is what a payment may change, as rows in a stable order:
// the orders, the cards, and how many rows each table a payment writes to
// holds.
func (b *bundle) ledgerSnapshot(t *testing.T) []string {
	t.Helper()
	var orders []domain.Order
	if err := b.db.NewSelect().Model(&orders).Order("order_no").Scan(b.ctx); err != nil {
		t.Fatal(err)
	}
	var cards []domain.Card
	if err := b.db.NewSelect().Model(&cards).Column("id", "status", "order_no", "sold_at", "updated_at").Order("id").Scan(b.ctx); err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, o := range orders {
		out = append(out, fmt.Sprintf("order %s %s %s %d %s %s", o.OrderNo, o.Status, o.TradeNo, o.PaidFen, o.PaidAt, o.UpdatedAt))
	}
	for _, c := range cards {
		out = append(out, fmt.Sprintf("card %d %s %s %s %s", c.ID, c.Status, c.OrderNo, c.SoldAt, c.UpdatedAt))
	}
	for _, table := range []string{"payment_notification", "stock_flow", "events", "mail_sends", "refund_order", "audit_log"} {
		n, err := b.db.NewSelect().Table(table).Count(b.ctx)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, fmt.Sprintf("%s %d", table, n))
	}
	return out
}
