package domain

import (
	"context"

	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect"
)

// CardForSale is a card on sale (UNSOLD or RECYCLED) in card_for_sale:
// which cards are for sale is these rows, not an index of card_stock that
// names status (migration 20261201000018). Whoever moves a card onto sale
// inserts its row in the same transaction (an import, the close that
// recycles it); whoever moves it off sale deletes the row first, holding
// it (the pick, a late payment taking its recycled cards back, a recall),
// so of two transactions after the same card one deletes the row and the
// other finds it gone.
type CardForSale struct {
	bun.BaseModel `bun:"table:card_for_sale"`
	ProductID     int64 `bun:"product_id,pk"`
	CardID        int64 `bun:"card_id,pk"`
}

// forSaleIsLockable is the condition, on card_for_sale AS f, that the
// row's card really is for sale. kami never leaves a row for a card that
// is not, but a process of a version from before the table (a rolling
// upgrade) does, and a pick that took such a row would fail to lock its
// card and run again, for ever, on the same row.
//
// A scalar subquery, run for each row the scan finds: PostgreSQL makes an
// EXISTS a join, and joined it chose to read the cards in id order from
// the first one ever imported (a merge join), or every row of the
// product before the LIMIT (a hash or sorted plan).
const forSaleIsLockable = "(SELECT c.status FROM card_stock AS c WHERE c.id = f.card_id) IN (?)"

// pickCards picks up to n cards of product to take off sale in this
// transaction: their rows of card_for_sale are locked, skipping those
// another transaction holds (so concurrent buyers take different cards
// instead of queueing on one). The caller deletes the rows of the cards
// it uses (takeOffSale) with its other writes, and leaves the others (an
// order of the batch wanted more than were left) as they are, locked
// until it commits: deleted and inserted again, they would be rows that a
// transaction waiting for them (a recall taking its batch off sale) does
// not see on PostgreSQL, its snapshot taken before they came back
// (TestRecallWhilePickedCardsLeftOver). SQLite has one writer and no row
// locks.
//
// No ORDER BY on PostgreSQL: any card for sale will do, and asked for an
// order without statistics that say how many rows the product has (a new
// table, or one not analyzed since it grew), PostgreSQL read all of them,
// probed each one's card and sorted, to return the first n: the whole
// place slowed threefold in the bench (20,000 cards for sale). Without
// it the scan stops at the n-th card found; an import analyzes the table
// (importTx), so that the scan is one of the key, not a bitmap of every
// row of the product. On MariaDB the order keeps the read on the key's
// range (see takeOffSale); its range scan stops at the n-th row anyway.
func pickCards(ctx context.Context, tx bun.Tx, productID int64, n int) (ids []int64, err error) {
	q := `SELECT f.card_id FROM card_for_sale AS f WHERE f.product_id = ? AND ` + forSaleIsLockable
	switch dialectName(tx) {
	case dialect.PG:
		q += ` LIMIT ? FOR UPDATE OF f SKIP LOCKED`
	case dialect.MySQL:
		q += ` ORDER BY f.card_id LIMIT ? FOR UPDATE SKIP LOCKED`
	default:
		q += ` LIMIT ?`
	}
	err = tx.NewRaw(q, productID, bun.List(CardLock.From), n).Scan(ctx, &ids)
	return ids, err
}

// takeOffSale deletes the rows of card_for_sale of ids, cards of product.
//
// On PostgreSQL each row is found by one probe of the key and deleted by
// its place (deleteProbedPG): card_for_sale's statistics may be of a
// moment it held a few rows (an import analyzes it; a backlog of closes
// that recycles thousands of cards does not), and asked "card_id IN
// (…64 ids…)" the planner then read every row of the table for each
// place batch.
//
// On MySQL/MariaDB the DELETE is ordered by the key and limited to as many
// rows as it names: so planned, MariaDB reads just those rows on the key.
// Left to choose, for a few rows of a small table it reads the whole
// table, or the key's range past the last row named, and InnoDB makes a
// DELETE wait for every row it reads: cards another transaction has
// picked and not yet committed, of any product
// (TestUncertainCommitLookupLocksOnlyItsCards).
func takeOffSale(db bun.IDB, productID int64, ids []int64) writeQuery {
	switch dialectName(db) {
	case dialect.PG:
		return deleteProbedPG(db, nil, "card_for_sale", "bigint[]", ids, "product_id = ? AND card_id = u.v", productID)
	case dialect.MySQL:
		return db.NewRaw("DELETE FROM card_for_sale WHERE product_id = ? AND card_id IN (?) ORDER BY card_id LIMIT ?",
			productID, bun.List(ids), len(ids))
	}
	return db.NewDelete().Model((*CardForSale)(nil)).Where("product_id = ?", productID).Where("card_id IN (?)", bun.List(ids))
}

// putOnSale inserts the rows of card_for_sale of cards going on sale. A
// row already there (left by a process of an older version) is kept.
// With binds (PostgreSQL), the rows go as two arrays, RETURNING 1 a row
// inserted, as writeAll counts.
func putOnSale(db bun.IDB, b *binds, rows []CardForSale) writeQuery {
	if b == nil {
		return db.NewInsert().Model(&rows).Ignore()
	}
	products, cards := make([]int64, len(rows)), make([]int64, len(rows))
	for i, r := range rows {
		products[i], cards[i] = r.ProductID, r.CardID
	}
	return db.NewRaw(`INSERT INTO card_for_sale (product_id, card_id) SELECT * FROM unnest(?::bigint[], ?::bigint[])
		ON CONFLICT DO NOTHING RETURNING 1`, b.array(products), b.array(cards))
}

// lockForSale locks the rows of card_for_sale of ids, cards of product,
// waiting for any that another transaction holds, and returns the card ids of
// those still there. Ordered by the key and limited to the rows named, as
// takeOffSale's DELETE on MariaDB, so that it reads only those.
func lockForSale(ctx context.Context, tx bun.Tx, productID int64, ids []int64) ([]int64, error) {
	var have []int64
	err := forUpdate(tx.NewSelect().Model((*CardForSale)(nil)).Column("card_id").
		Where("product_id = ?", productID).Where("card_id IN (?)", bun.List(ids)).
		OrderExpr("card_id").Limit(int64(len(ids)))).Scan(ctx, &have)
	return have, err
}

// sellableCounts counts the cards for sale of the given products (all
// products when ids is empty): their rows of card_for_sale, read from its
// key alone.
func sellableCounts(ctx context.Context, db bun.IDB, ids ...int64) (map[int64]int, error) {
	var rows []struct {
		ProductID int64 `bun:"product_id"`
		N         int   `bun:"n"`
	}
	q := db.NewSelect().Model((*CardForSale)(nil)).Column("product_id").ColumnExpr("COUNT(*) AS n").Group("product_id")
	if len(ids) > 0 {
		q = q.Where("product_id IN (?)", bun.List(ids))
	}
	if err := q.Scan(ctx, &rows); err != nil {
		return nil, err
	}
	out := make(map[int64]int, max(len(ids), len(rows)))
	for _, id := range ids {
		out[id] = 0
	}
	for _, r := range rows {
		out[r.ProductID] = r.N
	}
	return out, nil
}

// cardsForSaleAstray lists, up to limit each, the cards for sale without
// their row of card_for_sale (missing) and the rows of card_for_sale of no
// card for sale under that product (stale): what the audit's
// card_for_sale rule names and RepairCardsForSale mends. It reads every
// card.
func cardsForSaleAstray(ctx context.Context, db bun.IDB, limit int64) (missing []int64, stale []CardForSale, err error) {
	if err := db.NewSelect().TableExpr("card_stock AS c").ColumnExpr("c.id").
		Where("c.status IN (?)", bun.List(CardLock.From)).
		Where("NOT EXISTS (SELECT 1 FROM card_for_sale AS f WHERE f.product_id = c.product_id AND f.card_id = c.id)").
		OrderExpr("c.id").Limit(limit).Scan(ctx, &missing); err != nil {
		return nil, nil, err
	}
	err = db.NewSelect().Model(&stale).ModelTableExpr("card_for_sale AS f").ColumnExpr("f.product_id, f.card_id").
		Where("NOT ("+forSaleIsLockable+")", bun.List(CardLock.From)).
		WhereOr("NOT EXISTS (SELECT 1 FROM card_stock AS c WHERE c.id = f.card_id AND c.product_id = f.product_id)").
		OrderExpr("f.product_id, f.card_id").Limit(limit).Scan(ctx)
	return missing, stale, err
}

// RepairCardsForSale makes card_for_sale agree with the cards, as the
// audit's card_for_sale rule checks: a row for every card for sale that
// has none, and none for a card that is not for sale. kami itself keeps
// them in step; a process of a version from before the table (a rolling
// upgrade) does not: a card it imported or recycled is never picked, and
// a row it left for a card it locked is skipped by every pick
// (forSaleIsLockable). It reads every card, so it runs with the nightly
// reconciliation; up to repairLimit rows each way a run.
func (l *Ledger) RepairCardsForSale(ctx context.Context) (added, removed int, err error) {
	missing, stale, err := cardsForSaleAstray(ctx, l.db, repairLimit)
	if err != nil {
		return 0, 0, err
	}
	// Each change is made on the rows locked and read again, as the pick,
	// recall and late delivery take them: the row first, then the card.
	for _, r := range stale {
		gone := false
		err := inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
			gone = false
			held, err := lockForSale(ctx, tx, r.ProductID, []int64{r.CardID})
			if err != nil || len(held) == 0 {
				return err
			}
			n, err := tx.NewSelect().Table("card_stock").Where("id = ?", r.CardID).Where("product_id = ?", r.ProductID).
				Where("status IN (?)", bun.List(CardLock.From)).Count(ctx)
			if err != nil || n > 0 {
				return err
			}
			_, err = takeOffSale(tx, r.ProductID, []int64{r.CardID}).Exec(ctx)
			gone = err == nil
			return err
		})
		if err != nil {
			return added, removed, err
		}
		if gone {
			removed++
		}
	}
	for _, id := range missing {
		put := false
		err := inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
			put = false
			// Its batch first, share-locked as a close reads it: a recall
			// (which updates the batch, then takes its cards off sale)
			// either went first, and the card is withdrawn, or waits and
			// then finds the row.
			var batchIDs []int64
			if err := tx.NewSelect().Table("card_stock").Column("batch_id").Where("id = ?", id).Scan(ctx, &batchIDs); err != nil || len(batchIDs) == 0 {
				return err
			}
			var batches []Batch
			if err := shareLockIDs(tx, tableBatches, batchIDs, "id", "status").Scan(ctx, &batches); err != nil ||
				len(batches) == 0 || batches[0].Status != BatchActive {
				return err
			}
			var cards []Card
			if err := forUpdate(tx.NewSelect().Model(&cards).Column("id", "product_id").Where("id = ?", id).
				Where("batch_id = ?", batchIDs[0]).Where("status IN (?)", bun.List(CardLock.From))).Scan(ctx); err != nil || len(cards) == 0 {
				return err
			}
			res, err := putOnSale(tx, nil, []CardForSale{{ProductID: cards[0].ProductID, CardID: id}}).Exec(ctx)
			if err != nil {
				return err
			}
			n, err := res.RowsAffected()
			put = n > 0
			return err
		})
		if err != nil {
			return added, removed, err
		}
		if put {
			added++
		}
	}
	return added, removed, nil
}
