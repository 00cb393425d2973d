package domain

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect"
)

// writeQuery is one write of a transaction: an INSERT or an UPDATE built
// by bun (apply's guarded UPDATE, a model's INSERT).
type writeQuery interface {
	bun.Query
	Exec(ctx context.Context, dest ...any) (sql.Result, error)
}

// writeAll runs writes of one transaction that need nothing from one
// another's results, in the order given, and returns the rows each one
// changed. It is how a group-committed batch writes its orders, cards,
// journal, notifications and events.
//
// On PostgreSQL they are sent as one statement, each write a
// data-modifying WITH part and the statement's one row their counts, so
// the batch pays one round trip for its writes instead of one each: a
// round trip is what a batch's transaction mostly waits for on a busy
// machine, and the next batch waits for this one. The parts are run in the
// order given (each is read by the outer SELECT in that order, and
// PostgreSQL runs a WITH part when it is first read), so rows are locked in
// the order the separate statements locked them. They all see the
// statement's snapshot, which is why the writes must not read what
// another one writes; and one failing part fails the statement, and with
// it the transaction, as it would have failed alone. Elsewhere
// (MySQL/MariaDB have no data-modifying WITH; SQLite runs in this process)
// they run one after the other.
func writeAll(ctx context.Context, tx bun.IDB, qs ...writeQuery) ([]int64, error) {
	counts := make([]int64, len(qs))
	if len(qs) == 0 {
		return counts, nil
	}
	if len(qs) == 1 || dialectName(tx) != dialect.PG {
		for i, q := range qs {
			res, err := q.Exec(ctx)
			if err != nil {
				return nil, err
			}
			if counts[i], err = res.RowsAffected(); err != nil {
				return nil, err
			}
		}
		return counts, nil
	}
	sel := tx.NewSelect()
	dest := make([]any, len(qs))
	for i, q := range qs {
		switch q := q.(type) {
		case *bun.UpdateQuery:
			q.Returning("1")
		case *bun.InsertQuery:
			q.Returning("1") // beside any RETURNING of its own: a row each
		case *bun.RawQuery:
			// An INSERT … SELECT from arrays (flowInsert, eventsInsert),
			// written with its RETURNING 1.
		default:
			return nil, fmt.Errorf("writeAll: %T is not an INSERT or UPDATE", q)
		}
		name := fmt.Sprintf("w%d", i)
		sel = sel.With(name, q).ColumnExpr("(SELECT count(*) FROM ?)", bun.Ident(name))
		dest[i] = &counts[i]
	}
	if err := sel.Scan(ctx, dest...); err != nil {
		return nil, err
	}
	return counts, nil
}
