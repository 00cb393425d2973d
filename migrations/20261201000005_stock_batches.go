package migrations

import (
	"context"
	"fmt"

	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect"
)

// Supplier batches, withdrawn cards, format rules and low-stock alerts:
//
//   - card_batch: every import is a batch (who, when, supplier note,
//     counts); a batch is ACTIVE or RECALLED.
//   - card_stock.batch_id: every card belongs to its batch. Cards imported
//     before batches existed get one LEGACY batch per product, so the column
//     is NOT NULL from the start and the audit can hold every card to it.
//   - card_stock.status may be WITHDRAWN (a recalled batch's card off sale);
//     stock_flow.change_type gains 6 (withdrawn from sale) and 7 (withdrawn
//     when the order holding it closed).
//   - products: the code format rule (pattern, length range) and the
//     low-stock threshold with its alerted flag.
func init() {
	Migrations.MustRegister(step(stockBatchesUp), step(stockBatchesDown))
}

const productColumnsUp = `
ALTER TABLE products ADD COLUMN code_pattern VARCHAR(512) NOT NULL DEFAULT '';
ALTER TABLE products ADD COLUMN code_min_len INTEGER NOT NULL DEFAULT 0 CHECK (code_min_len >= 0);
ALTER TABLE products ADD COLUMN code_max_len INTEGER NOT NULL DEFAULT 0 CHECK (code_max_len >= 0);
ALTER TABLE products ADD COLUMN low_stock_threshold INTEGER NOT NULL DEFAULT 0 CHECK (low_stock_threshold >= 0);
ALTER TABLE products ADD COLUMN low_stock_alerted {{BOOL}} NOT NULL DEFAULT FALSE;
`

const productColumnsDown = `
ALTER TABLE products DROP COLUMN low_stock_alerted;
ALTER TABLE products DROP COLUMN low_stock_threshold;
ALTER TABLE products DROP COLUMN code_max_len;
ALTER TABLE products DROP COLUMN code_min_len;
ALTER TABLE products DROP COLUMN code_pattern;
`

const cardBatchUp = `
CREATE TABLE card_batch (
	id {{ID}},
	product_id BIGINT NOT NULL,
	source VARCHAR(16) NOT NULL CHECK (source IN ('LEGACY','LIST','FILE')),
	status VARCHAR(16) NOT NULL CHECK (status IN ('ACTIVE','RECALLED')),
	supplier_note VARCHAR(255) NOT NULL,
	filename VARCHAR(255) NOT NULL,
	actor VARCHAR(64) NOT NULL,
	imported INTEGER NOT NULL CHECK (imported >= 0),
	refused INTEGER NOT NULL CHECK (refused >= 0),
	duplicates INTEGER NOT NULL CHECK (duplicates >= 0),
	recall_reason VARCHAR(255) NOT NULL,
	recalled_by VARCHAR(64) NOT NULL,
	recalled_at {{TS}} NULL,
	created_at {{TS}} NOT NULL,
	updated_at {{TS}} NOT NULL,
	CHECK (status <> 'RECALLED' OR recalled_at IS NOT NULL),
	FOREIGN KEY (product_id) REFERENCES products (id)
) {{TABLE}};
CREATE INDEX card_batch_product ON card_batch (product_id, id);

INSERT INTO card_batch (product_id, source, status, supplier_note, filename, actor, imported, refused, duplicates,
	recall_reason, recalled_by, recalled_at, created_at, updated_at)
SELECT product_id, 'LEGACY', 'ACTIVE', 'cards imported before batches existed', '', 'system', COUNT(*), 0, 0,
	'', '', NULL, MIN(created_at), MIN(created_at)
FROM card_stock GROUP BY product_id ORDER BY product_id;
`

// legacyBatchOf is the LEGACY batch of a card_stock row c.
const legacyBatchOf = `(SELECT b.id FROM card_batch b WHERE b.product_id = c.product_id AND b.source = 'LEGACY')`

const (
	cardStatusesOld = `'UNSOLD','LOCKED','SOLD','RECYCLED'`
	cardStatusesNew = `'UNSOLD','LOCKED','SOLD','RECYCLED','WITHDRAWN'`
	flowTypesOld    = `1, 2, 3, 4, 5`
	flowTypesNew    = `1, 2, 3, 4, 5, 6, 7`
)

// The two CHECKs this migration changes. oldClause finds the constraint
// to replace however the database printed it back.
func cardStatusCheck(up bool) checkSpec {
	s := checkSpec{table: "card_stock", column: "status", columnType: "VARCHAR(16) NOT NULL", name: "card_stock_status_check"}
	if up {
		s.oldClause, s.newExpr = "RECYCLED", "status IN ("+cardStatusesNew+")"
	} else {
		s.oldClause, s.newExpr = "WITHDRAWN", "status IN ("+cardStatusesOld+")"
	}
	return s
}

func flowTypeCheck(up bool) checkSpec {
	s := checkSpec{table: "stock_flow", column: "change_type", columnType: "SMALLINT NOT NULL", name: "stock_flow_change_type_check"}
	if up {
		s.newExpr = "change_type IN (" + flowTypesNew + ")"
	} else {
		s.newExpr = "change_type IN (" + flowTypesOld + ")"
	}
	s.oldClause = "change_type" // the table's only CHECK on it
	return s
}

// replaceChecks swaps both CHECKs, up to the new lists or down to the old.
func replaceChecks(ctx context.Context, db bun.IDB, up bool) error {
	for _, spec := range []checkSpec{cardStatusCheck(up), flowTypeCheck(up)} {
		if err := replaceCheck(ctx, db, spec); err != nil {
			return err
		}
	}
	return nil
}

// sqliteCardStock is card_stock as SQLite gets it rebuilt: the first
// migration's columns, then batch_id (where ADD COLUMN puts it on the
// other databases). Without batch_id and with the old statuses, it is
// the table the rollback rebuilds.
func sqliteCardStock(withBatch bool) string {
	statuses, batchCol, batchFK := cardStatusesOld, "", ""
	if withBatch {
		statuses = cardStatusesNew
		batchCol = "batch_id BIGINT NOT NULL,"
		batchFK = ", FOREIGN KEY (batch_id) REFERENCES card_batch (id)"
	}
	return `CREATE TABLE card_stock_new (
	id INTEGER PRIMARY KEY AUTOINCREMENT,
	product_id BIGINT NOT NULL,
	code_enc BLOB NOT NULL,
	code_hash CHAR(64) NOT NULL,
	status VARCHAR(16) NOT NULL CHECK (status IN (` + statuses + `)),
	order_no VARCHAR(32) NULL,
	locked_at TIMESTAMP NULL,
	sold_at TIMESTAMP NULL,
	created_at TIMESTAMP NOT NULL,
	updated_at TIMESTAMP NOT NULL,
	` + batchCol + `
	CHECK (status NOT IN ('LOCKED','SOLD') OR order_no IS NOT NULL),
	FOREIGN KEY (product_id) REFERENCES products (id)` + batchFK + `
)`
}

const cardStockColumns = `id, product_id, code_enc, code_hash, status, order_no, locked_at, sold_at, created_at, updated_at`

func sqliteStockFlow(types string) string {
	return `CREATE TABLE stock_flow_new (
	id INTEGER PRIMARY KEY AUTOINCREMENT,
	product_id BIGINT NOT NULL,
	order_no VARCHAR(32) NULL,
	change_type SMALLINT NOT NULL CHECK (change_type IN (` + types + `)),
	quantity INTEGER NOT NULL CHECK (quantity > 0),
	created_at TIMESTAMP NOT NULL,
	FOREIGN KEY (product_id) REFERENCES products (id)
)`
}

const stockFlowColumns = `id, product_id, order_no, change_type, quantity, created_at`

func stockBatchesUp(ctx context.Context, db bun.IDB) error {
	if err := execAll(ctx, db, productColumnsUp+cardBatchUp); err != nil {
		return err
	}
	switch db.Dialect().Name() {
	case dialect.SQLite:
		if err := rebuildSQLiteTable(ctx, db, "card_stock", sqliteCardStock(true),
			`INSERT INTO card_stock_new (`+cardStockColumns+`, batch_id) SELECT `+cardStockColumns+`, `+legacyBatchOf+` FROM card_stock c`); err != nil {
			return err
		}
		if err := rebuildSQLiteTable(ctx, db, "stock_flow", sqliteStockFlow(flowTypesNew),
			`INSERT INTO stock_flow_new (`+stockFlowColumns+`) SELECT `+stockFlowColumns+` FROM stock_flow`); err != nil {
			return err
		}
	case dialect.PG:
		if err := execAll(ctx, db, `
ALTER TABLE card_stock ADD COLUMN batch_id BIGINT NULL;
UPDATE card_stock c SET batch_id = `+legacyBatchOf+`;
ALTER TABLE card_stock ALTER COLUMN batch_id SET NOT NULL;
ALTER TABLE card_stock ADD CONSTRAINT card_stock_batch_fk FOREIGN KEY (batch_id) REFERENCES card_batch (id);
`); err != nil {
			return err
		}
		if err := replaceChecks(ctx, db, true); err != nil {
			return err
		}
	case dialect.MySQL:
		if err := execAll(ctx, db, `
ALTER TABLE card_stock ADD COLUMN batch_id BIGINT NULL;
UPDATE card_stock c SET batch_id = `+legacyBatchOf+`;
ALTER TABLE card_stock MODIFY batch_id BIGINT NOT NULL;
`); err != nil {
			return err
		}
		if err := replaceChecks(ctx, db, true); err != nil {
			return err
		}
	default:
		return fmt.Errorf("migrations: unsupported dialect %s", db.Dialect().Name())
	}
	// The recall withdraws a batch's lockable cards, the batch view
	// counts its cards by status and pages them by id: (batch_id, status,
	// id) serves all three. On MySQL the foreign key then uses it too.
	if err := execAll(ctx, db, `CREATE INDEX card_stock_batch ON card_stock (batch_id, status, id);`); err != nil {
		return err
	}
	if db.Dialect().Name() == dialect.MySQL {
		return execAll(ctx, db, `ALTER TABLE card_stock ADD CONSTRAINT card_stock_batch_fk FOREIGN KEY (batch_id) REFERENCES card_batch (id);`)
	}
	return nil
}

// stockBatchesDown undoes stockBatchesUp while nothing depends on what it
// added: a withdrawn card, or a journal entry of a withdrawal, has no
// place in the old schema, so the rollback refuses rather than lose it.
func stockBatchesDown(ctx context.Context, db bun.IDB) error {
	withdrawn, err := db.NewSelect().Table("card_stock").Where("status = 'WITHDRAWN'").Count(ctx)
	if err != nil {
		return err
	}
	flows, err := db.NewSelect().Table("stock_flow").Where("change_type IN (6, 7)").Count(ctx)
	if err != nil {
		return err
	}
	if withdrawn > 0 || flows > 0 {
		return fmt.Errorf("cannot roll back batches: %d cards are WITHDRAWN and %d journal entries record withdrawals; the old schema has no place for them", withdrawn, flows)
	}
	switch db.Dialect().Name() {
	case dialect.SQLite:
		// The rebuild recreates the table's indexes: this one first goes.
		if err := execAll(ctx, db, `DROP INDEX card_stock_batch;`); err != nil {
			return err
		}
		if err := rebuildSQLiteTable(ctx, db, "card_stock", sqliteCardStock(false),
			`INSERT INTO card_stock_new (`+cardStockColumns+`) SELECT `+cardStockColumns+` FROM card_stock`); err != nil {
			return err
		}
		if err := rebuildSQLiteTable(ctx, db, "stock_flow", sqliteStockFlow(flowTypesOld),
			`INSERT INTO stock_flow_new (`+stockFlowColumns+`) SELECT `+stockFlowColumns+` FROM stock_flow`); err != nil {
			return err
		}
	case dialect.PG:
		if err := execAll(ctx, db, `
ALTER TABLE card_stock DROP CONSTRAINT card_stock_batch_fk;
DROP INDEX card_stock_batch;
ALTER TABLE card_stock DROP COLUMN batch_id;
`); err != nil {
			return err
		}
		if err := replaceChecks(ctx, db, false); err != nil {
			return err
		}
	case dialect.MySQL:
		if err := execAll(ctx, db, `
ALTER TABLE card_stock DROP FOREIGN KEY card_stock_batch_fk;
DROP INDEX card_stock_batch ON card_stock;
ALTER TABLE card_stock DROP COLUMN batch_id;
`); err != nil {
			return err
		}
		if err := replaceChecks(ctx, db, false); err != nil {
			return err
		}
	}
	return execAll(ctx, db, `DROP TABLE card_batch;`+productColumnsDown)
}
