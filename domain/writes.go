package domain

import (
	"context"
	"database/sql"
	"fmt"
	"reflect"

	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect"
	"github.com/uptrace/bun/dialect/pgdialect"
	"github.com/uptrace/bun/schema"
)

// writeQuery is one write of a transaction: an INSERT, UPDATE or DELETE
// built by bun (apply's guarded UPDATE, a model's INSERT, leavePending).
type writeQuery interface {
	bun.Query
	Exec(ctx context.Context, dest ...any) (sql.Result, error)
}

// deleteProbedPG is, on PostgreSQL, a DELETE of the rows of table that
// match cond (on the table's columns and u.v, one of values, an array of
// type array; args are cond's parameters), each found by one probe of
// the index cond names and deleted by its place (ctid), RETURNING 1 for
// writeAll's count. Asked as "column IN (…list…)", the planner weighs
// the list against the rows its statistics say the table holds: those
// of a table that churns (pending_order, card_for_sale) may be of a
// moment it held a few rows, when it holds tens of thousands now, and it
// compares every row with the list. The probe is a subquery (OFFSET 0),
// run once per value, which no plan of the table can replace. The place
// and the delete see the statement's snapshot: a row is never updated,
// so a place found is the row deleted, or skipped if another transaction
// deleted it meanwhile, as the IN list's DELETE would.
func deleteProbedPG(db bun.IDB, b *binds, table, array string, values any, cond string, args ...any) *bun.RawQuery {
	places, placesArgs := probedPlaces(b, table, array, values, cond, false, args...)
	return db.NewRaw(`DELETE FROM ? WHERE `+places+` RETURNING 1`, append([]any{bun.Ident(table)}, placesArgs...)...)
}

// probedPlaces is the condition "ctid = ANY(ARRAY(…))" of the rows of
// table that match cond (on the table's columns and u.v, one of values,
// an array of type array; args are cond's parameters), each found by one
// probe of the index cond names, and its arguments: the one way kami
// names a batch's rows on PostgreSQL (deleteProbedPG, transitionLocked).
// OFFSET 0 keeps the probe a subquery, run once per value, which no plan
// of the table can replace and no outer condition is pushed into. With
// lock the probe also locks each row it finds, a value at a time in the
// array's order, then by id (see transitionLocked).
func probedPlaces(b *binds, table, array string, values any, cond string, lock bool, args ...any) (string, []any) {
	tail := "OFFSET 0"
	if lock {
		tail = "ORDER BY id OFFSET 0 FOR NO KEY UPDATE"
	}
	return `ctid = ANY(ARRAY(SELECT p.ctid FROM unnest(?::` + array + `) AS u(v)
			CROSS JOIN LATERAL (SELECT ctid FROM ? WHERE ` + cond + ` ` + tail + `) AS p))`,
		append([]any{b.array(values), bun.Ident(table)}, args...)
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
	var inserted []*insertedIDs
	for i, q := range qs {
		name := fmt.Sprintf("w%d", i)
		switch q := q.(type) {
		case *bun.UpdateQuery:
			q.Returning("1")
		case *bun.DeleteQuery:
			q.Returning("1")
		case *bun.InsertQuery:
			// Its RETURNING (a row each) gives the new rows' ids back, as
			// the INSERT alone would have (see returnIDs).
			if ids := returnIDs(tx, q, name); ids != nil {
				inserted = append(inserted, ids)
			} else {
				q.Returning("1")
			}
		case *bun.RawQuery:
			// An INSERT … SELECT from arrays (flowInsert, eventsInsert,
			// putOnSale with binds) or a DELETE of rows probed by key
			// (deleteProbedPG), written with its RETURNING 1.
		default:
			return nil, fmt.Errorf("writeAll: %T is not an INSERT, UPDATE or DELETE", q)
		}
		sel = sel.With(name, q).ColumnExpr("(SELECT count(*) FROM ?)", bun.Ident(name))
		dest[i] = &counts[i]
	}
	for _, ids := range inserted { // after the counts
		sel = sel.ColumnExpr("(SELECT array_agg(?) FROM ?)", bun.Ident(ids.pk.Name), bun.Ident(ids.part))
		dest = append(dest, pgdialect.Array(&ids.got))
	}
	if err := sel.Scan(ctx, dest...); err != nil {
		return nil, err
	}
	for _, ids := range inserted {
		if err := ids.set(); err != nil {
			return nil, err
		}
	}
	return counts, nil
}

// insertedIDs is where a WITH part's INSERT of rows with an
// autoincrement id gives their ids back.
type insertedIDs struct {
	part string // the WITH part's name
	pk   *schema.Field
	rows reflect.Value // the model's slice, or its one struct
	got  []int64       // the ids, in the order the rows were inserted
}

// returnIDs makes q, an INSERT of a model whose primary key is one
// autoincrement column, return that column, and says where writeAll puts
// it; nil (q left as it is) for any other INSERT.
//
// Run alone, bun's INSERT of a model sets the rows' ids (RETURNING on
// PostgreSQL and SQLite, LAST_INSERT_ID on MySQL/MariaDB); as a WITH part
// its RETURNING is read by writeAll's SELECT instead, so writeAll sets
// them: the part's RETURNING rows, aggregated in the order they come,
// which is the order of its VALUES, as bun's own INSERT takes them.
func returnIDs(tx bun.IDB, q *bun.InsertQuery, part string) *insertedIDs {
	m := q.GetModel()
	if m == nil {
		return nil
	}
	v := reflect.ValueOf(m.Value())
	if v.Kind() != reflect.Pointer || v.IsNil() {
		return nil
	}
	v = v.Elem()
	typ := v.Type()
	if typ.Kind() == reflect.Slice {
		typ = typ.Elem()
		if typ.Kind() == reflect.Pointer {
			typ = typ.Elem()
		}
	}
	if typ.Kind() != reflect.Struct {
		return nil
	}
	table := tx.Dialect().Tables().Get(typ)
	if len(table.PKs) != 1 || !table.PKs[0].AutoIncrement {
		return nil
	}
	q.Returning("?", bun.Ident(table.PKs[0].Name))
	return &insertedIDs{part: part, pk: table.PKs[0], rows: v}
}

// set puts the ids got into the rows, one each.
func (ids *insertedIDs) set() error {
	rows := ids.rows
	n := 1
	if rows.Kind() == reflect.Slice {
		n = rows.Len()
	}
	if len(ids.got) != n {
		return fmt.Errorf("writeAll: %d ids returned for %d rows inserted", len(ids.got), n)
	}
	for i, id := range ids.got {
		row := rows
		if rows.Kind() == reflect.Slice {
			row = reflect.Indirect(rows.Index(i))
		}
		if err := ids.pk.ScanValue(row, id); err != nil {
			return err
		}
	}
	return nil
}
