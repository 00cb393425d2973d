package migrations

import (
	"context"

	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect"
)

// Indexes for the scans that had none: the sweeper pages PENDING orders by
// (expires_at, id), admins list orders and refunds newest first without
// other filters. (Cards listed by status alone, across products, go without:
// an index there would cost every card state change for a rare admin view.) The (status, expires_at) index is replaced by
// (status, expires_at, id), which serves everything it served.
func init() {
	Migrations.MustRegister(step(func(ctx context.Context, db bun.IDB) error {
		if err := execAll(ctx, db, listIndexesUp); err != nil {
			return err
		}
		return dropIndex(ctx, db, "orders", "orders_status_expires")
	}), step(func(ctx context.Context, db bun.IDB) error {
		if err := execAll(ctx, db, `CREATE INDEX orders_status_expires ON orders (status, expires_at);`); err != nil {
			return err
		}
		return dropIndexes(ctx, db, [][2]string{{"orders", "orders_status_expires_id"}, {"orders", "orders_created"},
			{"refund_order", "refund_order_created"}})
	}))
}

const listIndexesUp = `
CREATE INDEX orders_status_expires_id ON orders (status, expires_at, id);
CREATE INDEX orders_created ON orders (created_at, id);
CREATE INDEX refund_order_created ON refund_order (created_at, id);
`

// dropIndexes drops each (table, index) of ixs with dropIndex.
func dropIndexes(ctx context.Context, db bun.IDB, ixs [][2]string) error {
	for _, ix := range ixs {
		if err := dropIndex(ctx, db, ix[0], ix[1]); err != nil {
			return err
		}
	}
	return nil
}

// dropIndex drops an index; MySQL names its table, the others do not.
func dropIndex(ctx context.Context, db bun.IDB, table, index string) error {
	q := "DROP INDEX " + index
	if db.Dialect().Name() == dialect.MySQL {
		q += " ON " + table
	}
	_, err := db.ExecContext(ctx, q)
	return err
}

// onPG runs a statement only on PostgreSQL: a table lock or a storage
// option the other databases do not have.
func onPG(ctx context.Context, db bun.IDB, query string) error {
	if db.Dialect().Name() != dialect.PG {
		return nil
	}
	_, err := db.ExecContext(ctx, query)
	return err
}
