package migrations

import (
	"context"

	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect"
)

// Which orders are PENDING moves out of the orders' indexes into a table of
// its own, pending_order: a row inserted with the order and deleted, in the
// same transaction, when the order is paid or closed. It holds what the
// sweeper pages by (expires_at) and what the caps count (contact,
// client_addr, quantity).
//
// Why: an UPDATE that changes an indexed column writes a new row version
// with an entry in every index of the table; one that changes no indexed
// column, with room on the page, is rewritten in place (PostgreSQL's HOT
// update) and touches no index. status was in four of the orders' indexes
// (two partial ones whose condition names it count too), so every close
// and payment wrote an entry in each of the nine. Now no index of orders
// names status, closed_at, paid_at, trade_no or delivered_at, and a close
// or payment rewrites the order in place. fillfactor 50 keeps the room:
// the orders placed together share pages and are closed together, in one
// transaction, while their old versions are still visible to it.
//
// The admin list by status now reads orders newest first and filters (the
// PENDING ones, the newest, come first; a rare status reads further); by
// contact it has (contact, created_at), which also serves its order.
//
// The backfill runs under a lock that stops every use of orders until the
// step commits (PostgreSQL; SQLite has one writer), so no order placed
// meanwhile is missed. It is taken whole at the start: a weaker lock
// there, raised by the DROP INDEX later, deadlocks with a placement that
// has read orders and then writes to it. A process of an older version
// that places an order after this ran writes no row for it, and one that
// pays or closes an order leaves its row: the nightly reconciliation
// repairs both (Ledger.RepairPendingRows), a close of such an order
// removes its row, and the audit names both (pending_row).
func init() {
	Migrations.MustRegister(step(func(ctx context.Context, db bun.IDB) error {
		if err := onPG(ctx, db, "LOCK TABLE orders IN ACCESS EXCLUSIVE MODE"); err != nil {
			return err
		}
		if err := execAll(ctx, db, pendingOrderUp); err != nil {
			return err
		}
		if err := dropIndexes(ctx, db, ordersStatusIndexes(db)); err != nil {
			return err
		}
		return onPG(ctx, db, "ALTER TABLE orders SET (fillfactor = 50)")
	}), step(func(ctx context.Context, db bun.IDB) error {
		down := pendingOrderDownPartial
		if db.Dialect().Name() == dialect.MySQL {
			down = pendingOrderDownFull
		}
		if err := execAll(ctx, db, down); err != nil {
			return err
		}
		if err := onPG(ctx, db, "ALTER TABLE orders RESET (fillfactor)"); err != nil {
			return err
		}
		if err := dropIndex(ctx, db, "orders", "orders_contact_created"); err != nil {
			return err
		}
		return execAll(ctx, db, `DROP TABLE pending_order;`)
	}))
}

const pendingOrderUp = `
CREATE TABLE pending_order (
	order_no VARCHAR(32) NOT NULL PRIMARY KEY,
	product_id BIGINT NOT NULL,
	quantity INTEGER NOT NULL CHECK (quantity > 0),
	contact VARCHAR(128) NOT NULL,
	client_addr VARCHAR(64) NOT NULL,
	expires_at {{TS}} NOT NULL
) {{TABLE}};
INSERT INTO pending_order (order_no, product_id, quantity, contact, client_addr, expires_at)
	SELECT order_no, product_id, quantity, contact, client_addr, expires_at FROM orders WHERE status = 'PENDING';
CREATE INDEX pending_order_due ON pending_order (expires_at, order_no);
CREATE INDEX pending_order_contact ON pending_order (contact);
CREATE INDEX pending_order_addr ON pending_order (client_addr);
CREATE INDEX orders_contact_created ON orders (contact, created_at);
`

// ordersStatusIndexes are the orders' indexes that name status, as
// migration 20261201000014 left them: partial ones where the database has
// them, full ones on MySQL/MariaDB.
func ordersStatusIndexes(db bun.IDB) [][2]string {
	ixs := [][2]string{{"orders", "orders_status_created"}, {"orders", "orders_contact_status"}}
	if db.Dialect().Name() == dialect.MySQL {
		return append(ixs, [2]string{"orders", "orders_status_expires_id"}, [2]string{"orders", "orders_addr_status"})
	}
	return append(ixs, [2]string{"orders", "orders_pending_expires"}, [2]string{"orders", "orders_pending_addr"})
}

const pendingOrderDownPartial = `
CREATE INDEX orders_status_created ON orders (status, created_at);
CREATE INDEX orders_contact_status ON orders (contact, status);
CREATE INDEX orders_pending_expires ON orders (expires_at, id) WHERE status = 'PENDING';
CREATE INDEX orders_pending_addr ON orders (client_addr) WHERE status = 'PENDING';
`

const pendingOrderDownFull = `
CREATE INDEX orders_status_created ON orders (status, created_at);
CREATE INDEX orders_contact_status ON orders (contact, status);
CREATE INDEX orders_status_expires_id ON orders (status, expires_at, id);
CREATE INDEX orders_addr_status ON orders (client_addr, status);
`
