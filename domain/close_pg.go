package domain

import (
	"context"
	"sort"
	"strings"
	"time"

	"github.com/uptrace/bun"
)

// The close on PostgreSQL. A batch of up to 500 orders is the close
// worker's unit, and a restart may find a backlog of tens of thousands.
// Its transaction waits for the database five times (BEGIN, close the
// orders, read their cards and batches, write the rest, COMMIT) instead
// of nine, and the pre-close check reads the orders and the clock in one.

// clockAt is the database's clock as a value the close statements can
// write: the transaction's CURRENT_TIMESTAMP, or the time itself where it
// is read in this process (a test's DBClock).
func (l *Ledger) clockAt(db bun.IDB) any {
	if clock := l.clockSQL(db); clock != "" {
		return bun.Safe(clock)
	}
	return l.localDBNow()
}

// pendingOfPG reads the PENDING orders among nos for the pre-close check,
// with one probe of the order_no index each (see lockedCardsPG), and the
// database's clock when withClock (zero when no order was read). The
// status is tested on the rows found, outside the probe: inside, the
// planner may read an index of PENDING orders instead (see
// transitionLocked).
func (l *Ledger) pendingOfPG(ctx context.Context, nos []string, withClock bool) ([]Order, time.Time, error) {
	b := &binds{}
	var clock any = bun.Safe("NULL::timestamptz")
	if withClock {
		clock = b.value(l.clockAt(l.db))
	}
	var rs []pendingRow
	if err := l.db.NewRaw(`SELECT o.order_no, o.product_id, o.provider, o.status, o.expires_at, `+timeParam(l.db)+` AS db_now
		FROM unnest(?::text[]) AS u(no)
		CROSS JOIN LATERAL (SELECT order_no, product_id, provider, status, expires_at FROM orders
			WHERE order_no = u.no OFFSET 0) AS o
		WHERE o.status = ?`,
		clock, b.array(nos), OrderPending).Scan(withBinds(ctx, b), &rs); err != nil {
		return nil, time.Time{}, err
	}
	orders, now := pendingRows(rs)
	return orders, now, nil
}

// closeOrderRowsPG is closeOrderRows on PostgreSQL, in one statement: the
// orders among nos are locked in order_no order (the order every payment
// batch locks in, so that a close and a payment never deadlock:
// transitionLocked), those PENDING and due by the transaction's
// clock (and by dueBy, if not zero) closed, and read back as they now
// are. now is that clock, as written into closed_at (zero when nothing
// closed). The others (usually none) are read afterwards.
func (l *Ledger) closeOrderRowsPG(ctx context.Context, tx bun.Tx, nos []string, reason CloseReason, dueBy time.Time) (closed, others []Order, now time.Time, err error) {
	b := &binds{}
	clock := b.value(l.clockAt(tx))
	due := func(q *bun.UpdateQuery) *bun.UpdateQuery {
		switch {
		case reason != CloseTimeout:
			return q
		case dueBy.IsZero():
			return q.Where("expires_at <= ?", clock)
		}
		return q.Where("expires_at <= LEAST(?, ?::timestamptz)", clock, b.value(dueBy))
	}
	if _, err := transitionLocked(tx, b, OrderClose, clock, byOrderNos(nos), due, []column{col("closed_at = ?", clock)}).
		Returning(strings.Join(closedColumns, ", ")).Exec(withBinds(ctx, b), &closed); err != nil {
		return nil, nil, time.Time{}, err
	}
	if len(closed) > 0 {
		now = closed[0].ClosedAt.UTC()
	}
	others, err = notClosed(ctx, tx, nos, closed)
	return closed, others, now, err
}

// lockedCardsPG is lockedCardsAndBatches in one statement, which also
// locks the cards (in order_no order, then id order, as the orders were
// locked) and reads their places (ctid), so that writeClose moves each by
// its place (byPlaces), with no second look-up. The cards are
// found by one probe of the order_no index per order: asked as
// "order_no IN (…500 numbers…)", PostgreSQL weighs 500 index probes
// against one pass over card_stock and, while the table holds some tens
// of thousands of cards, picks the pass, which compares every card with
// the list: 14 ms against 2 ms a batch of 500, and it grows with the
// table. OFFSET 0 keeps the lateral subquery a subquery, so it runs once
// per order, on the index. Their batches are share-locked once each, in
// id order (MATERIALIZED: read whole, once, before the join).
func lockedCardsPG(ctx context.Context, tx bun.Tx, orderNos []string) ([]lockedCard, error) {
	b := &binds{}
	var cards []lockedCard
	err := tx.NewRaw(`WITH c AS MATERIALIZED (
			SELECT c.ctid, c.id, c.product_id, c.order_no, c.batch_id FROM unnest(?::text[]) AS u(no)
			CROSS JOIN LATERAL (SELECT ctid, id, product_id, order_no, batch_id FROM card_stock WHERE order_no = u.no AND status = ?
				ORDER BY id OFFSET 0 FOR NO KEY UPDATE) AS c),
		b AS MATERIALIZED (SELECT id, status FROM card_batch WHERE id IN (SELECT batch_id FROM c) ORDER BY id FOR SHARE)
		SELECT c.ctid, c.id, c.product_id, c.order_no, c.batch_id, b.status AS batch_status FROM c JOIN b ON b.id = c.batch_id`,
		b.array(orderNos), CardLocked).Scan(withBinds(ctx, b), &cards)
	return cards, err
}

// pendingRow is a row of the pre-close check's read: an order and the
// database's clock.
type pendingRow struct {
	OrderNo   string      `bun:"order_no"`
	ProductID int64       `bun:"product_id"`
	Provider  string      `bun:"provider"`
	Status    OrderStatus `bun:"status"`
	ExpiresAt time.Time   `bun:"expires_at"`
	DBNow     time.Time   `bun:"db_now,nullzero"`
}

// pendingRows turns the read into orders, in order_no order, and the
// clock (zero if no row).
func pendingRows(rs []pendingRow) ([]Order, time.Time) {
	out := make([]Order, len(rs))
	var now time.Time
	for i, r := range rs {
		out[i] = Order{OrderNo: r.OrderNo, ProductID: r.ProductID, Provider: r.Provider, Status: r.Status, ExpiresAt: r.ExpiresAt}
		now = r.DBNow
	}
	sort.Slice(out, func(i, j int) bool { return out[i].OrderNo < out[j].OrderNo })
	if !now.IsZero() {
		now = now.UTC().Truncate(time.Microsecond)
	}
	return out, now
}
