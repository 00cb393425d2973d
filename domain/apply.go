package domain

import (
	"context"
	"slices"
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

// rowsNamed names the rows a batch moves: by order number (orders, or the
// cards sold to them) or by id. values are sorted: on PostgreSQL the rows
// are locked in their order (see transitionLocked).
type rowsNamed struct {
	column string // order_no or id
	array  string // the PostgreSQL array type of the values
	values any    // []string or []int64, sorted
	where  func(*bun.UpdateQuery) *bun.UpdateQuery
}

func byOrderNos(nos []string) rowsNamed {
	return rowsNamed{column: "order_no", array: "text[]", values: slices.Sorted(slices.Values(nos)), where: whereOrderNos(nos)}
}

func byIDs(ids []int64) rowsNamed {
	return rowsNamed{column: "id", array: "bigint[]", values: slices.Sorted(slices.Values(ids)), where: whereIDs(ids)}
}

// byPlaces names rows this transaction has already locked, by their
// places (ctid) as the lock read them, on PostgreSQL only: the UPDATE
// fetches each at its place, with no look-up and no second lock. A row's
// place changes only when the row is updated, which a lock held prevents.
// The places go as text, cast to tid[].
func byPlaces(ctids []string) rowsNamed {
	return rowsNamed{column: "ctid", array: "text[]", values: ctids}
}

// lockedCardRows names cards read and locked by this transaction's close
// (lockedCardsPG, lockedCardsAndBatches): by place where they were read
// with it (PostgreSQL), else by id.
func lockedCardRows(cards []lockedCard) rowsNamed {
	ids, places := make([]int64, len(cards)), make([]string, 0, len(cards))
	for i, c := range cards {
		ids[i] = c.ID
		if c.Place != "" {
			places = append(places, c.Place)
		}
	}
	if len(places) == len(cards) {
		return byPlaces(places)
	}
	return byIDs(ids)
}

// transitionLocked is transition for the rows of a batch (a payment
// batch's orders and cards, a close batch's orders and cards), with more
// conditions in extra (nil for none). On PostgreSQL the rows are locked
// first, in the order of their names: an UPDATE takes its row locks in
// the order its plan walks the rows (a bitmap scan: heap order; an index
// on expires_at: that order), and a close and a payment batch that lock
// two orders in opposite orders deadlock (retried, but a second lost and
// a batch rolled back). On MySQL/MariaDB the UPDATE reads the rows on
// their name's index (nameIndexMySQL), in that order, as the close's
// SELECT … ORDER BY order_no FOR UPDATE does; SQLite has one writer.
//
// On PostgreSQL the rows are also found by name only, one index probe
// each, locked in the probe, and then updated at the place the lock read
// (ctid = ANY(ARRAY(…))): a fetch at a known place, with no second
// look-up by id (TestCloseFindsEachRowOnce). Their status is tested on
// the rows so fetched, never by reading the table for it. While the
// tables had indexes of statuses (before migrations 20261201000017 and
// 20261201000018), a "status = LOCKED" or PENDING the planner could read
// through an index made it read one of those instead, which the
// statistics said held a handful of such rows. It holds the live ones, a
// few hundred in a busy shop, and an entry for every row that left the
// status since the last vacuum, each a visit to the table: 20,000 rows
// read for a payment batch of 26 under the bench's load. An array of
// places leaves the planner one way to read the rows: a TID scan. OFFSET
// 0 keeps the lateral probe a subquery no condition is pushed into (see
// lockedCardsPG). The lock is the one the UPDATE takes anyway (FOR NO
// KEY UPDATE), taken earlier. A row changed by a transaction that
// committed while this one waited for it is locked as that transaction
// left it, at its new place, which the statement's snapshot (taken
// before that commit) does not see: the UPDATE skips it, whatever its
// status. Every change of a row these batches move takes it out of the
// statuses they move it from (an order leaves PENDING, a card LOCKED:
// only transitions update orders and cards, and none moves a row from
// PENDING or LOCKED to itself, TestBatchMovesLeaveTheirStatuses), so a
// row skipped so is one the status test would have skipped
// (TestBatchesTestTheStatusAsLocked). A write that touched a PENDING
// order or a LOCKED card and left its status would make the batches
// skip it: the payment batch would fall back to one payment at a time,
// a close would report the order NOT_DUE (a buyer's cancel, CONFLICT).
//
// The lock is taken inside the probe, one name at a time in the array's
// order (then by id among a name's rows): PostgreSQL locks a subquery's
// rows in the subquery itself, never above a sort outside it ("ORDER BY
// r.name … FOR UPDATE OF r" sorted rows already locked in the array's
// order). So the names are sorted here (rowsNamed); a payment batch's
// come in the order its payments arrived.
func transitionLocked(db bun.IDB, b *binds, t Transition, now any, rows rowsNamed, extra func(*bun.UpdateQuery) *bun.UpdateQuery, cols []column) *bun.UpdateQuery {
	if extra == nil {
		extra = func(q *bun.UpdateQuery) *bun.UpdateQuery { return q }
	}
	switch dialectName(db) {
	case dialect.MySQL:
		return transitionAt(db, t, now, func(q *bun.UpdateQuery) *bun.UpdateQuery {
			if index, ok := nameIndexMySQL[[2]string{t.Table, rows.column}]; ok {
				q = q.ForceIndex(index)
			}
			return extra(rows.where(q))
		}, cols)
	case dialect.PG:
		if rows.column == "ctid" {
			// Already locked by this transaction (byPlaces).
			return transitionAt(db, t, b.value(now), func(q *bun.UpdateQuery) *bun.UpdateQuery {
				return extra(q.Where("ctid = ANY(?::"+rows.array+"::tid[])", b.array(rows.values)))
			}, cols)
		}
	default:
		return transitionAt(db, t, now, func(q *bun.UpdateQuery) *bun.UpdateQuery { return extra(rows.where(q)) }, cols)
	}
	places, args := probedPlaces(b, t.Table, rows.array, rows.values, "? = u.v", true, bun.Ident(rows.column))
	q := db.NewUpdate().Table(t.Table).
		Where(places, args...).
		Set("status = ?", t.To).
		Set("updated_at = ?", b.value(now))
	for _, c := range cols {
		q = q.Set(c.expr, c.args...)
	}
	return extra(q.Where("status IN (?)", bun.List(t.From)))
}

// nameIndexMySQL is the index MariaDB must read a batch's rows by, table
// and name: InnoDB locks the rows an UPDATE reads in the order it reads
// them, and left to choose, for a batch that is a large share of a
// small table or where few rows have the status asked, MariaDB reads the
// whole table (id order) or an index of statuses (expiry or creation
// order). A payment batch so locked its orders in another order than a
// close's SELECT … ORDER BY order_no FOR UPDATE, and the two deadlocked.
// An IN list read on its name's index is read in that name's order.
var nameIndexMySQL = map[[2]string]string{
	{tableOrders, "order_no"}: "orders_order_no",
	{tableCards, "order_no"}:  "card_stock_by_order",
	{tableOrders, "id"}:       "PRIMARY",
	{tableCards, "id"}:        "PRIMARY",
}

func whereIDs(ids []int64) func(*bun.UpdateQuery) *bun.UpdateQuery {
	return func(q *bun.UpdateQuery) *bun.UpdateQuery { return q.Where("id IN (?)", bun.List(ids)) }
}

func whereRefundNo(no string) func(*bun.UpdateQuery) *bun.UpdateQuery {
	return func(q *bun.UpdateQuery) *bun.UpdateQuery { return q.Where("refund_no = ?", no) }
}
