package domain

import (
	"context"
	"strings"
	"time"

	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect"
)

// column is one extra column a transition writes besides status.
type column struct {
	expr string // "paid_at = ?"
	args []any
}

func col(expr string, args ...any) column { return column{expr, args} }

// apply is the only code that writes a status: it runs transition t as
//
//	UPDATE <t.Table> SET status = <t.To>, updated_at = now, <cols>
//	WHERE <key> AND status IN (<t.From>)
//
// and returns the rows affected. Zero means someone else moved the row
// first: the caller skips, it never forces.
func apply(ctx context.Context, db bun.IDB, t Transition, now time.Time, key func(*bun.UpdateQuery) *bun.UpdateQuery, cols ...column) (int64, error) {
	res, err := transition(db, t, now, key, cols).Exec(ctx)
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

// applyReturning is apply that also reads the given columns of the rows
// it moved, as they are after the move, into dest (a pointer to a slice
// of the table's model): UPDATE … RETURNING, on PostgreSQL and SQLite
// (MySQL and MariaDB have no UPDATE … RETURNING).
func applyReturning(ctx context.Context, db bun.IDB, t Transition, now time.Time, key func(*bun.UpdateQuery) *bun.UpdateQuery, returning []string, dest any, cols ...column) error {
	_, err := transition(db, t, now, key, cols).Returning(strings.Join(returning, ", ")).Exec(ctx, dest)
	return err
}

// transition is apply's UPDATE, built and not run: writeAll sends it with
// the other writes of a batch.
func transition(db bun.IDB, t Transition, now time.Time, key func(*bun.UpdateQuery) *bun.UpdateQuery, cols []column) *bun.UpdateQuery {
	return transitionAt(db, t, now, key, cols)
}

// transitionAt is transition at now, a time or an SQL expression such as
// the database's clock (bun.Safe("CURRENT_TIMESTAMP")).
func transitionAt(db bun.IDB, t Transition, now any, key func(*bun.UpdateQuery) *bun.UpdateQuery, cols []column) *bun.UpdateQuery {
	q := db.NewUpdate().Table(t.Table).
		Set("status = ?", t.To).
		Set("updated_at = ?", now)
	for _, c := range cols {
		q = q.Set(c.expr, c.args...)
	}
	return key(q).Where("status IN (?)", bun.List(t.From))
}

func whereOrderNo(no string) func(*bun.UpdateQuery) *bun.UpdateQuery {
	return func(q *bun.UpdateQuery) *bun.UpdateQuery { return q.Where("order_no = ?", no) }
}

func whereOrderNos(nos []string) func(*bun.UpdateQuery) *bun.UpdateQuery {
	return func(q *bun.UpdateQuery) *bun.UpdateQuery { return q.Where("order_no IN (?)", bun.List(nos)) }
}

// whereOrderNosInLockOrder is whereOrderNos for an UPDATE that moves
// several PENDING orders (a close batch, a payment batch). On PostgreSQL
// the rows come from a sub-select that locks the PENDING ones first, in
// order_no order: an UPDATE takes its row locks in the order its plan
// walks the rows (a bitmap scan: heap order; the status index: expires_at,
// id), and a close and a payment batch that lock two orders in opposite
// orders deadlock (retried, but a second lost and a batch rolled back).
// MySQL/MariaDB lock with SELECT … ORDER BY order_no FOR UPDATE first;
// SQLite has one writer.
func whereOrderNosInLockOrder(db bun.IDB, nos []string) func(*bun.UpdateQuery) *bun.UpdateQuery {
	if dialectName(db) != dialect.PG {
		return whereOrderNos(nos)
	}
	return func(q *bun.UpdateQuery) *bun.UpdateQuery {
		return whereOrderNos(nos)(q).Where("id IN (SELECT id FROM orders WHERE order_no IN (?) AND status = ? ORDER BY order_no FOR UPDATE)",
			bun.List(nos), OrderPending)
	}
}

func whereIDs(ids []int64) func(*bun.UpdateQuery) *bun.UpdateQuery {
	return func(q *bun.UpdateQuery) *bun.UpdateQuery { return q.Where("id IN (?)", bun.List(ids)) }
}

func whereRefundNo(no string) func(*bun.UpdateQuery) *bun.UpdateQuery {
	return func(q *bun.UpdateQuery) *bun.UpdateQuery { return q.Where("refund_no = ?", no) }
}
