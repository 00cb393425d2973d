package migrations

import (
	"context"

	"github.com/uptrace/bun"
)

// Which cards are for sale moves out of the cards' indexes into a table of
// its own, card_for_sale: a row (product_id, card_id) for each UNSOLD or
// RECYCLED card, inserted when the card goes on sale (its import, the
// close that recycles it) and deleted, in the same transaction, when it
// leaves sale (the pick that locks it to an order, a late payment taking
// its recycled cards back, a recall). The pick reads and deletes these
// rows, skipping those another transaction holds.
//
// Why: as for the orders (20261201000017), a close rewrote each of its
// cards (LOCKED to RECYCLED) with an entry in every one of card_stock's
// five indexes, because three of them named status. Now no index of
// card_stock names status: the order's index is (order_no), the batch's
// (batch_id, id), and the product's cards are found by their (product_id,
// code_hash) key; a close rewrites its cards in place (a HOT update on
// PostgreSQL, where fillfactor 50 keeps the room; on MariaDB no secondary
// index is touched) and inserts their rows of card_for_sale.
//
// The backfill runs under a lock that stops every use of card_stock until
// the step commits (PostgreSQL; SQLite has one writer), taken whole at the
// start (see 20261201000017). A process of an older version that imports,
// recycles or locks cards after this ran leaves card_for_sale behind: the
// nightly reconciliation repairs it (Ledger.RepairCardsForSale) and the
// audit names it (card_for_sale).
func init() {
	Migrations.MustRegister(step(func(ctx context.Context, db bun.IDB) error {
		if err := onPG(ctx, db, "LOCK TABLE card_stock IN ACCESS EXCLUSIVE MODE"); err != nil {
			return err
		}
		// The new indexes come first: on MariaDB the batch's foreign key
		// needs an index on batch_id at every moment.
		if err := execAll(ctx, db, cardForSaleUp); err != nil {
			return err
		}
		if err := dropIndexes(ctx, db, cardStatusIndexes); err != nil {
			return err
		}
		return onPG(ctx, db, "ALTER TABLE card_stock SET (fillfactor = 50)")
	}), step(func(ctx context.Context, db bun.IDB) error {
		if err := execAll(ctx, db, cardForSaleDown); err != nil {
			return err
		}
		if err := onPG(ctx, db, "ALTER TABLE card_stock RESET (fillfactor)"); err != nil {
			return err
		}
		if err := dropIndexes(ctx, db, [][2]string{{"card_stock", "card_stock_by_order"}, {"card_stock", "card_stock_by_batch"}}); err != nil {
			return err
		}
		return execAll(ctx, db, `DROP TABLE card_for_sale;`)
	}))
}

const cardForSaleUp = `
CREATE TABLE card_for_sale (
	product_id BIGINT NOT NULL,
	card_id BIGINT NOT NULL,
	PRIMARY KEY (product_id, card_id)
) {{TABLE}};
INSERT INTO card_for_sale (product_id, card_id)
	SELECT product_id, id FROM card_stock WHERE status IN ('UNSOLD', 'RECYCLED');
CREATE INDEX card_stock_by_order ON card_stock (order_no);
CREATE INDEX card_stock_by_batch ON card_stock (batch_id, id);
`

// cardStatusIndexes are the cards' indexes that name status, as
// migrations 20261129000001 and 20261201000005 made them.
var cardStatusIndexes = [][2]string{
	{"card_stock", "card_stock_lockable"},
	{"card_stock", "card_stock_order"},
	{"card_stock", "card_stock_batch"},
}

const cardForSaleDown = `
CREATE INDEX card_stock_lockable ON card_stock (product_id, status, id);
CREATE INDEX card_stock_order ON card_stock (order_no, status);
CREATE INDEX card_stock_batch ON card_stock (batch_id, status, id);
`
