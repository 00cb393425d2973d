package domain

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/uptrace/bun"
)

// Low-stock alerts. A product with a threshold raises one low_stock alert
// when its sellable cards (UNSOLD + RECYCLED) fall to the threshold, and
// another only after stock rose above it again (an import, cards recycled
// by a close) and fell once more. The products row keeps whether the alert
// was raised (low_stock_alerted); a conditional update flips it, so of two
// processes or two orders that see the same crossing exactly one alerts.
//
// Counting is cheap and bounded: "more than the threshold left?" reads at
// most threshold+1 entries of the (product_id, status, id) index, inside
// the very statement that flips the flag, so the count and the flip are
// one step. It runs only where stock can cross: after an order is placed
// (when the product has a threshold and has not alerted: a product with
// no threshold, or already low, costs nothing), after a recall or an
// UpdateProduct (falls), after an import or a close that recycled cards
// (rises).

// LowStock is a product whose sellable stock fell to its threshold.
type LowStock struct {
	ProductID int64
	Name      string
	Sellable  int // cards left to sell when the crossing was seen
	Threshold int
}

// lowStockCrossed is the one place a low-stock crossing goes: the alert
// (the stock.low event was written with the flag's flip).
func (l *Ledger) lowStockCrossed(ctx context.Context, ls LowStock) {
	l.alerts.Alert(ctx, Alert{Kind: "low_stock", Subject: fmt.Sprintf("product %d", ls.ProductID),
		Message: fmt.Sprintf("%s: %d sellable cards left, at or below the threshold of %d; import more", ls.Name, ls.Sellable, ls.Threshold)})
}

// sellableAtMost is the SQL for "the product has at most threshold
// sellable cards", reading at most limit entries (threshold+1) of
// card_for_sale's key.
const sellableAtMost = `(SELECT COUNT(*) FROM (SELECT 1 FROM card_for_sale
	WHERE product_id = ? LIMIT ?) AS s) <= low_stock_threshold`

// CheckStockFell raises the low-stock alert of each given product whose
// sellable stock is now at or below its threshold and that has not
// alerted since it was last above it. products are the rows as the caller
// read them; those without a threshold, or already alerted, are skipped
// without a query.
func (l *Ledger) CheckStockFell(ctx context.Context, products ...*Product) error {
	for _, p := range products {
		if p == nil || p.LowStockThreshold <= 0 || p.LowStockAlerted {
			continue
		}
		var crossed *LowStock
		err := inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
			crossed = nil
			res, err := tx.NewUpdate().Table("products").Set("low_stock_alerted = ?", true).
				Where("id = ?", p.ID).Where("low_stock_threshold > 0").Where("low_stock_alerted = ?", false).
				Where(sellableAtMost, p.ID, p.LowStockThreshold+1).Exec(ctx)
			if err != nil {
				return err
			}
			if n, err := res.RowsAffected(); err != nil || n == 0 {
				return err
			}
			var cur Product
			if err := tx.NewSelect().Model(&cur).Where("id = ?", p.ID).Scan(ctx); err != nil {
				return err
			}
			counts, err := sellableCounts(ctx, tx, p.ID)
			if err != nil {
				return err
			}
			crossed = &LowStock{ProductID: p.ID, Name: cur.Name, Sellable: counts[p.ID], Threshold: cur.LowStockThreshold}
			return recordEvents(ctx, tx, l.now(), stockLowEvent(*crossed))
		})
		if err != nil {
			return err
		}
		if crossed != nil {
			l.lowStockCrossed(ctx, *crossed)
		}
	}
	return nil
}

// CheckStockRose re-arms the low-stock alert of each given product whose
// sellable stock is above its threshold again.
func (l *Ledger) CheckStockRose(ctx context.Context, ids ...int64) error {
	for _, id := range ids {
		var threshold int
		err := l.db.NewSelect().Table("products").Column("low_stock_threshold").Where("id = ?", id).
			Where("low_stock_alerted = ?", true).Scan(ctx, &threshold)
		if errors.Is(err, sql.ErrNoRows) {
			continue // not alerted: nothing to re-arm
		}
		if err != nil {
			return err
		}
		if _, err := l.db.NewUpdate().Table("products").Set("low_stock_alerted = ?", false).
			Where("id = ?", id).Where("low_stock_alerted = ?", true).
			Where("NOT ("+sellableAtMost+")", id, threshold+1).Exec(ctx); err != nil {
			return err
		}
	}
	return nil
}

// checkStock re-evaluates a product's flag both ways (its threshold was
// just set or changed).
func (l *Ledger) checkStock(ctx context.Context, id int64) error {
	if err := l.CheckStockRose(ctx, id); err != nil {
		return err
	}
	p, err := l.Product(ctx, id)
	if err != nil {
		return err
	}
	return l.CheckStockFell(ctx, p)
}

// stockFell and stockRose run the checks after the Shop's own flows; a
// failed check is logged, never the flow's failure.
func (s *Shop) stockFell(ctx context.Context, productIDs ...int64) {
	ps, err := s.Ledger.ProductsByID(ctx, productIDs)
	if err == nil {
		for _, p := range ps {
			if err = s.Ledger.CheckStockFell(ctx, p); err != nil {
				break
			}
		}
	}
	if err != nil {
		s.log().WarnContext(ctx, "low-stock check failed", "products", productIDs, "err", err)
	}
}

func (s *Shop) stockRose(ctx context.Context, productIDs ...int64) {
	if err := s.Ledger.CheckStockRose(ctx, productIDs...); err != nil {
		s.log().WarnContext(ctx, "low-stock re-arm failed", "products", productIDs, "err", err)
	}
}
