package domain

import (
	"context"
	"fmt"

	"github.com/uptrace/bun"
)

// Violation is one broken ledger invariant.
type Violation struct {
	Rule    string // which invariant
	Subject string // the order, card, refund or product it concerns
	Detail  string
}

func (v Violation) String() string { return fmt.Sprintf("%s %s: %s", v.Rule, v.Subject, v.Detail) }

// Audit checks the ledger's invariants and lists every violation; an empty
// list means the books are straight. It reads only, and every check reads
// one consistent snapshot (snapshotTx), so it may run at any time, also on
// live traffic: a transaction that commits while it runs is either wholly
// in what it reads or not at all.
//
//   - locked_without_pending: no card is LOCKED unless a PENDING order holds it;
//   - pending_card_count: a PENDING order holds exactly quantity LOCKED cards;
//   - pending_row: an order is PENDING exactly when pending_order has its
//     row, and the row says what the order does;
//   - card_for_sale: a card is for sale (UNSOLD or RECYCLED) exactly when
//     card_for_sale has its row, under its own product;
//   - delivered_card_count: a delivered order has exactly quantity SOLD
//     cards, and an order never delivered has none;
//   - sold_without_delivery: every SOLD card belongs to a delivered order
//     (so no card is sold to two orders, and none is sold without payment);
//   - refund_per_payment: at most one refund per payment (order, trade, cause);
//   - refunding_without_refund: a REFUNDING or REFUNDED order has a refund;
//   - refunded_without_success: a REFUNDED order has a SUCCEEDED refund;
//   - stock_flow: per product, the stock journal adds up to the card counts
//     (withdrawals included);
//   - card_batch: every card belongs to a batch of its own product, and a
//     batch's imported count is the number of its cards;
//   - withdrawn_card: a WITHDRAWN card's batch was recalled, and a recalled
//     batch has no card on sale (UNSOLD or RECYCLED).
func (l *Ledger) Audit(ctx context.Context) ([]Violation, error) {
	var out []Violation
	err := snapshotTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
		out = nil
		for _, check := range []func(context.Context, bun.IDB) ([]Violation, error){
			auditLockedCards, auditPendingOrders, auditPendingRows, auditCardsForSale, auditDeliveredOrders, auditSoldCards, auditRefunds, auditStockFlow,
			auditBatches, auditWithdrawn,
		} {
			vs, err := check(ctx, tx)
			if err != nil {
				return err
			}
			out = append(out, vs...)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// auditLimit bounds how many violations one rule lists.
const auditLimit = 1000

func auditLockedCards(ctx context.Context, db bun.IDB) ([]Violation, error) {
	var rows []struct {
		ID      int64  `bun:"id"`
		OrderNo string `bun:"order_no"`
		Status  string `bun:"order_status"`
	}
	err := db.NewSelect().TableExpr("card_stock AS c").
		Join("LEFT JOIN orders AS o ON o.order_no = c.order_no").
		ColumnExpr("c.id, c.order_no, COALESCE(o.status, '') AS order_status").
		Where("c.status = ?", CardLocked).
		Where("(o.id IS NULL OR o.status <> ?)", OrderPending).
		Limit(auditLimit).Scan(ctx, &rows)
	var vs []Violation
	for _, r := range rows {
		vs = append(vs, Violation{"locked_without_pending", fmt.Sprintf("card %d", r.ID),
			fmt.Sprintf("LOCKED for order %q which is %q", r.OrderNo, r.Status)})
	}
	return vs, err
}

func auditCardsForSale(ctx context.Context, db bun.IDB) ([]Violation, error) {
	missing, stale, err := cardsForSaleAstray(ctx, db, auditLimit)
	var vs []Violation
	for _, id := range missing {
		vs = append(vs, Violation{"card_for_sale", fmt.Sprintf("card %d", id), "for sale without its row in card_for_sale"})
	}
	for _, r := range stale {
		vs = append(vs, Violation{"card_for_sale", fmt.Sprintf("card %d", r.CardID),
			fmt.Sprintf("a row in card_for_sale under product %d for a card that is not for sale (or not that product's)", r.ProductID)})
	}
	return vs, err
}

type orderCardCount struct {
	OrderNo  string `bun:"order_no"`
	Quantity int    `bun:"quantity"`
	N        int    `bun:"n"`
}

// countCards counts, per order matching where, its cards in cardStatus,
// keeping the orders whose count is not want(order).
func countCards(ctx context.Context, db bun.IDB, cardStatus CardStatus, where func(*bun.SelectQuery) *bun.SelectQuery) ([]orderCardCount, error) {
	var rows []orderCardCount
	q := db.NewSelect().TableExpr("orders AS o").
		Join("LEFT JOIN card_stock AS c ON c.order_no = o.order_no AND c.status = ?", cardStatus).
		ColumnExpr("o.order_no, o.quantity, COUNT(c.id) AS n").
		GroupExpr("o.order_no, o.quantity")
	err := where(q).Scan(ctx, &rows)
	return rows, err
}

func auditPendingOrders(ctx context.Context, db bun.IDB) ([]Violation, error) {
	rows, err := countCards(ctx, db, CardLocked, func(q *bun.SelectQuery) *bun.SelectQuery {
		return q.Where("o.status = ?", OrderPending).Having("COUNT(c.id) <> o.quantity").Limit(auditLimit)
	})
	var vs []Violation
	for _, r := range rows {
		vs = append(vs, Violation{"pending_card_count", "order " + r.OrderNo,
			fmt.Sprintf("PENDING with %d LOCKED cards, want %d", r.N, r.Quantity)})
	}
	return vs, err
}

func auditPendingRows(ctx context.Context, db bun.IDB) ([]Violation, error) {
	var missing []string
	if err := db.NewSelect().TableExpr("orders AS o").
		Join("LEFT JOIN pending_order AS p ON p.order_no = o.order_no").ColumnExpr("o.order_no").
		Where("o.status = ?", OrderPending).
		Where("(p.order_no IS NULL OR p.product_id <> o.product_id OR p.quantity <> o.quantity OR p.contact <> o.contact "+
			"OR p.client_addr <> o.client_addr OR p.expires_at <> o.expires_at)").
		Limit(auditLimit).Scan(ctx, &missing); err != nil {
		return nil, err
	}
	var stale []struct {
		OrderNo string `bun:"order_no"`
		Status  string `bun:"order_status"`
	}
	err := db.NewSelect().TableExpr("pending_order AS p").
		Join("LEFT JOIN orders AS o ON o.order_no = p.order_no").
		ColumnExpr("p.order_no, COALESCE(o.status, '') AS order_status").
		Where("o.id IS NULL OR o.status <> ?", OrderPending).
		Limit(auditLimit).Scan(ctx, &stale)
	var vs []Violation
	for _, no := range missing {
		vs = append(vs, Violation{"pending_row", "order " + no, "PENDING without its row in pending_order, or with one that says otherwise"})
	}
	for _, r := range stale {
		vs = append(vs, Violation{"pending_row", "order " + r.OrderNo, fmt.Sprintf("a row in pending_order for an order that is %q", r.Status)})
	}
	return vs, err
}

func auditDeliveredOrders(ctx context.Context, db bun.IDB) ([]Violation, error) {
	delivered, err := countCards(ctx, db, CardSold, func(q *bun.SelectQuery) *bun.SelectQuery {
		return q.Where("o.delivered_at IS NOT NULL").Having("COUNT(c.id) <> o.quantity").Limit(auditLimit)
	})
	if err != nil {
		return nil, err
	}
	undelivered, err := countCards(ctx, db, CardSold, func(q *bun.SelectQuery) *bun.SelectQuery {
		return q.Where("o.delivered_at IS NULL").Having("COUNT(c.id) > 0").Limit(auditLimit)
	})
	var vs []Violation
	for _, r := range delivered {
		vs = append(vs, Violation{"delivered_card_count", "order " + r.OrderNo,
			fmt.Sprintf("delivered with %d SOLD cards, want %d", r.N, r.Quantity)})
	}
	for _, r := range undelivered {
		vs = append(vs, Violation{"delivered_card_count", "order " + r.OrderNo,
			fmt.Sprintf("never delivered but has %d SOLD cards", r.N)})
	}
	var paid []string
	if err == nil {
		err = db.NewSelect().Table("orders").Column("order_no").
			Where("status = ?", OrderPaid).Where("delivered_at IS NULL").Limit(auditLimit).Scan(ctx, &paid)
	}
	for _, no := range paid {
		vs = append(vs, Violation{"delivered_card_count", "order " + no, "PAID but never delivered"})
	}
	return vs, err
}

func auditSoldCards(ctx context.Context, db bun.IDB) ([]Violation, error) {
	var rows []struct {
		ID      int64  `bun:"id"`
		OrderNo string `bun:"order_no"`
	}
	err := db.NewSelect().TableExpr("card_stock AS c").
		Join("LEFT JOIN orders AS o ON o.order_no = c.order_no").
		ColumnExpr("c.id, c.order_no").
		Where("c.status = ?", CardSold).
		Where("(o.id IS NULL OR o.delivered_at IS NULL OR o.product_id <> c.product_id)").
		Limit(auditLimit).Scan(ctx, &rows)
	var vs []Violation
	for _, r := range rows {
		vs = append(vs, Violation{"sold_without_delivery", fmt.Sprintf("card %d", r.ID),
			fmt.Sprintf("SOLD to %q, which is not a delivered order of its product", r.OrderNo)})
	}
	return vs, err
}

func auditRefunds(ctx context.Context, db bun.IDB) ([]Violation, error) {
	var vs []Violation
	var dup []struct {
		OrderNo string `bun:"order_no"`
		TradeNo string `bun:"trade_no"`
		Cause   string `bun:"cause"`
		N       int    `bun:"n"`
	}
	if err := db.NewSelect().Table("refund_order").Column("order_no", "trade_no", "cause").ColumnExpr("COUNT(*) AS n").
		Group("order_no", "trade_no", "cause").Having("COUNT(*) > 1").Limit(auditLimit).Scan(ctx, &dup); err != nil {
		return nil, err
	}
	for _, d := range dup {
		vs = append(vs, Violation{"refund_per_payment", "order " + d.OrderNo,
			fmt.Sprintf("%d %s refunds for trade %s", d.N, d.Cause, d.TradeNo)})
	}
	var missing []string
	if err := db.NewSelect().TableExpr("orders AS o").Column("o.order_no").
		Where("o.status IN (?)", bun.List([]OrderStatus{OrderRefunding, OrderRefunded})).
		Where("NOT EXISTS (SELECT 1 FROM refund_order AS r WHERE r.order_no = o.order_no AND r.cause <> ?)", CauseDuplicatePayment).
		Limit(auditLimit).Scan(ctx, &missing); err != nil {
		return nil, err
	}
	for _, no := range missing {
		vs = append(vs, Violation{"refunding_without_refund", "order " + no, "REFUNDING or REFUNDED without a refund row"})
	}
	var unconfirmed []string
	if err := db.NewSelect().TableExpr("orders AS o").Column("o.order_no").
		Where("o.status = ?", OrderRefunded).
		Where("NOT EXISTS (SELECT 1 FROM refund_order AS r WHERE r.order_no = o.order_no AND r.status = ? AND r.cause <> ?)", RefundSucceeded, CauseDuplicatePayment).
		Limit(auditLimit).Scan(ctx, &unconfirmed); err != nil {
		return nil, err
	}
	for _, no := range unconfirmed {
		vs = append(vs, Violation{"refunded_without_success", "order " + no, "REFUNDED without a SUCCEEDED refund"})
	}
	return vs, nil
}

func auditStockFlow(ctx context.Context, db bun.IDB) ([]Violation, error) {
	var flows []struct {
		ProductID  int64    `bun:"product_id"`
		ChangeType FlowType `bun:"change_type"`
		Total      int64    `bun:"total"`
	}
	if err := db.NewSelect().Table("stock_flow").Column("product_id", "change_type").ColumnExpr("SUM(quantity) AS total").
		Group("product_id", "change_type").Scan(ctx, &flows); err != nil {
		return nil, err
	}
	cards, err := stockCounts(ctx, db)
	if err != nil {
		return nil, err
	}
	type tally struct {
		imported, locked, sold, returned, withdrawn, withdrawnLocked int64 // the journal
		lockable, lockedNow, soldNow, withdrawnNow                   int64 // the cards
	}
	by := map[int64]*tally{}
	get := func(id int64) *tally {
		if by[id] == nil {
			by[id] = &tally{}
		}
		return by[id]
	}
	for _, f := range flows {
		t := get(f.ProductID)
		switch f.ChangeType {
		case FlowImport:
			t.imported += f.Total
		case FlowLock:
			t.locked += f.Total
		case FlowSell:
			t.sold += f.Total
		case FlowReturn:
			t.returned += f.Total
		case FlowWithdraw:
			t.withdrawn += f.Total
		case FlowWithdrawLocked:
			t.withdrawnLocked += f.Total
		}
	}
	for id, c := range cards {
		t := get(id)
		t.lockable, t.lockedNow, t.soldNow, t.withdrawnNow = int64(c.Lockable), int64(c.Locked), int64(c.Sold), int64(c.Withdrawn)
	}
	var vs []Violation
	for id, t := range by {
		subject := fmt.Sprintf("product %d", id)
		if want := t.imported - t.locked + t.returned - t.withdrawn; t.lockable != want {
			vs = append(vs, Violation{"stock_flow", subject, fmt.Sprintf("%d lockable cards, journal says %d", t.lockable, want)})
		}
		if want := t.locked - t.sold - t.returned - t.withdrawnLocked; t.lockedNow != want {
			vs = append(vs, Violation{"stock_flow", subject, fmt.Sprintf("%d LOCKED cards, journal says %d", t.lockedNow, want)})
		}
		if t.soldNow != t.sold {
			vs = append(vs, Violation{"stock_flow", subject, fmt.Sprintf("%d SOLD cards, journal says %d", t.soldNow, t.sold)})
		}
		if want := t.withdrawn + t.withdrawnLocked; t.withdrawnNow != want {
			vs = append(vs, Violation{"stock_flow", subject, fmt.Sprintf("%d WITHDRAWN cards, journal says %d", t.withdrawnNow, want)})
		}
	}
	return vs, nil
}

func auditBatches(ctx context.Context, db bun.IDB) ([]Violation, error) {
	var vs []Violation
	var strays []struct {
		ID      int64 `bun:"id"`
		BatchID int64 `bun:"batch_id"`
	}
	if err := db.NewSelect().TableExpr("card_stock AS c").ColumnExpr("c.id, c.batch_id").
		Where("NOT EXISTS (SELECT 1 FROM card_batch AS b WHERE b.id = c.batch_id AND b.product_id = c.product_id)").
		Limit(auditLimit).Scan(ctx, &strays); err != nil {
		return nil, err
	}
	for _, r := range strays {
		vs = append(vs, Violation{"card_batch", fmt.Sprintf("card %d", r.ID),
			fmt.Sprintf("batch %d does not exist or is another product's", r.BatchID)})
	}
	var counts []struct {
		ID       int64 `bun:"id"`
		Imported int   `bun:"imported"`
		N        int   `bun:"n"`
	}
	if err := db.NewSelect().TableExpr("card_batch AS b").
		Join("LEFT JOIN card_stock AS c ON c.batch_id = b.id").
		ColumnExpr("b.id, b.imported, COUNT(c.id) AS n").GroupExpr("b.id, b.imported").
		Having("COUNT(c.id) <> b.imported").Limit(auditLimit).Scan(ctx, &counts); err != nil {
		return nil, err
	}
	for _, r := range counts {
		vs = append(vs, Violation{"card_batch", fmt.Sprintf("batch %d", r.ID),
			fmt.Sprintf("imported %d cards but has %d", r.Imported, r.N)})
	}
	return vs, nil
}

func auditWithdrawn(ctx context.Context, db bun.IDB) ([]Violation, error) {
	var rows []struct {
		ID      int64      `bun:"id"`
		Status  CardStatus `bun:"status"`
		BatchID int64      `bun:"batch_id"`
	}
	err := db.NewSelect().TableExpr("card_stock AS c").Join("JOIN card_batch AS b ON b.id = c.batch_id").
		ColumnExpr("c.id, c.status, c.batch_id").
		Where("(c.status = ? AND b.status <> ?) OR (c.status IN (?) AND b.status = ?)",
			CardWithdrawn, BatchRecalled, bun.List(CardWithdraw.From), BatchRecalled).
		Limit(auditLimit).Scan(ctx, &rows)
	var vs []Violation
	for _, r := range rows {
		detail := fmt.Sprintf("WITHDRAWN but batch %d was never recalled", r.BatchID)
		if r.Status != CardWithdrawn {
			detail = fmt.Sprintf("%s (on sale) but batch %d was recalled", r.Status, r.BatchID)
		}
		vs = append(vs, Violation{"withdrawn_card", fmt.Sprintf("card %d", r.ID), detail})
	}
	return vs, err
}
