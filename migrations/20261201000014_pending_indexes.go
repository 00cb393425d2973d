package migrations

import (
	"context"

	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect"
)

// Indexes that only ever serve one state hold only the rows in it, where
// the database has partial indexes (PostgreSQL, SQLite). A status change
// rewrites a row and, status being indexed, adds an entry to every index
// of its table whose condition the new row meets: an order closed or paid
// no longer goes into the two indexes only PENDING orders are looked up
// by (the sweeper's pages by expires_at, the cap per client address), and
// an event fanned out no longer goes into the dispatcher's queue index,
// nor a new one into the pruner's. The close of a backlog writes each of
// its orders and events once, so this is a part of its cost.
//
// MySQL/MariaDB have no partial indexes and keep the full ones.
func init() {
	Migrations.MustRegister(step(func(ctx context.Context, db bun.IDB) error {
		if db.Dialect().Name() == dialect.MySQL {
			return nil
		}
		if err := execAll(ctx, db, pendingIndexesUp); err != nil {
			return err
		}
		return dropIndexes(ctx, db, fullIndexes)
	}), step(func(ctx context.Context, db bun.IDB) error {
		if db.Dialect().Name() == dialect.MySQL {
			return nil
		}
		if err := execAll(ctx, db, pendingIndexesDown); err != nil {
			return err
		}
		return dropIndexes(ctx, db, partialIndexes)
	}))
}

// pendingIndexesUp replaces each index of fullIndexes by the one of
// partialIndexes at the same position. A query uses a partial index only
// when its WHERE says what the index's does, as written: status =
// 'PENDING', fanned_out = FALSE or TRUE, as bun writes them.
const pendingIndexesUp = `
CREATE INDEX orders_pending_expires ON orders (expires_at, id) WHERE status = 'PENDING';
CREATE INDEX orders_pending_addr ON orders (client_addr) WHERE status = 'PENDING';
CREATE INDEX events_unfanned ON events (id) WHERE fanned_out = FALSE;
CREATE INDEX events_fanned ON events (occurred_at) WHERE fanned_out = TRUE;
`

const pendingIndexesDown = `
CREATE INDEX orders_status_expires_id ON orders (status, expires_at, id);
CREATE INDEX orders_addr_status ON orders (client_addr, status);
CREATE INDEX events_fan_out ON events (fanned_out, id);
CREATE INDEX events_prune ON events (fanned_out, occurred_at);
`

var (
	fullIndexes = [][2]string{{"orders", "orders_status_expires_id"}, {"orders", "orders_addr_status"},
		{"events", "events_fan_out"}, {"events", "events_prune"}}
	partialIndexes = [][2]string{{"orders", "orders_pending_expires"}, {"orders", "orders_pending_addr"},
		{"events", "events_unfanned"}, {"events", "events_fanned"}}
)
