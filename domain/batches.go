package domain

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/uptrace/bun"
)

// BatchSource says how a batch came in.
type BatchSource string

const (
	BatchLegacy   BatchSource = "LEGACY" // cards imported before batches existed (one per product)
	BatchFromList BatchSource = "LIST"   // the importCards list
	BatchFromFile BatchSource = "FILE"   // a file upload
)

// Batch is one import: the cards a supplier delivered together. Every card
// belongs to exactly one batch; a bad batch is recalled as a whole.
type Batch struct {
	bun.BaseModel `bun:"table:card_batch"`

	ID           int64       `bun:"id,pk,autoincrement"`
	ProductID    int64       `bun:"product_id"`
	Source       BatchSource `bun:"source"`
	Status       BatchStatus `bun:"status"`
	SupplierNote string      `bun:"supplier_note"`
	Filename     string      `bun:"filename"`
	Actor        string      `bun:"actor"` // who imported it
	Imported     int         `bun:"imported"`
	Refused      int         `bun:"refused"`    // lines refused for their form
	Duplicates   int         `bun:"duplicates"` // lines refused as duplicates
	RecallReason string      `bun:"recall_reason"`
	RecalledBy   string      `bun:"recalled_by"`
	RecalledAt   time.Time   `bun:"recalled_at,nullzero"`
	CreatedAt    time.Time   `bun:"created_at"`
	UpdatedAt    time.Time   `bun:"updated_at"`
}

// BatchPage is one page of batches, newest first.
type BatchPage struct {
	Batches []Batch
	HasNext bool
}

// ListBatches pages through batches by id descending (newest first),
// after the batch afterID (0: from the newest); productID filters when
// non-zero, served by the (product_id, id) index. BAD_INPUT for a bad page
// size.
func (l *Ledger) ListBatches(ctx context.Context, productID, afterID int64, limit int) (*BatchPage, error) {
	limit, err := clampLimit(limit)
	if err != nil {
		return nil, err
	}
	var bs []Batch
	q := l.db.NewSelect().Model(&bs)
	if productID != 0 {
		q = q.Where("product_id = ?", productID)
	}
	hasNext, err := idPage(ctx, q, &bs, afterID, limit)
	if err != nil {
		return nil, err
	}
	return &BatchPage{Batches: bs, HasNext: hasNext}, nil
}

// Batch returns one batch. NOT_FOUND.
func (l *Ledger) Batch(ctx context.Context, id int64) (*Batch, error) {
	return batchIn(ctx, l.db, id)
}

func batchIn(ctx context.Context, db bun.IDB, id int64) (*Batch, error) {
	var b Batch
	if err := db.NewSelect().Model(&b).Where("id = ?", id).Scan(ctx); err != nil {
		return nil, notFound(err, "batch %d not found", id)
	}
	return &b, nil
}

// BatchesByID returns the batches with the given ids in one query.
func (l *Ledger) BatchesByID(ctx context.Context, ids []int64) (map[int64]*Batch, error) {
	out := make(map[int64]*Batch, len(ids))
	if len(ids) == 0 {
		return out, nil
	}
	var bs []Batch
	if err := l.db.NewSelect().Model(&bs).Where("id IN (?)", bun.List(ids)).Scan(ctx); err != nil {
		return nil, err
	}
	for i := range bs {
		out[bs[i].ID] = &bs[i]
	}
	return out, nil
}

// BatchStock is how many of a batch's cards are in each status now.
type BatchStock map[CardStatus]int

// BatchStocks counts the cards of the given batches by status, in one
// query over the (batch_id, status, id) index.
func (l *Ledger) BatchStocks(ctx context.Context, ids []int64) (map[int64]BatchStock, error) {
	out := make(map[int64]BatchStock, len(ids))
	for _, id := range ids {
		out[id] = BatchStock{}
	}
	if len(ids) == 0 {
		return out, nil
	}
	var rows []struct {
		BatchID int64      `bun:"batch_id"`
		Status  CardStatus `bun:"status"`
		N       int        `bun:"n"`
	}
	if err := l.db.NewSelect().Table("card_stock").Column("batch_id", "status").ColumnExpr("COUNT(*) AS n").
		Where("batch_id IN (?)", bun.List(ids)).Group("batch_id", "status").Scan(ctx, &rows); err != nil {
		return nil, err
	}
	for _, r := range rows {
		out[r.BatchID][r.Status] = r.N
	}
	return out, nil
}

// BatchOrderPage is one page of the orders a batch's cards went to.
type BatchOrderPage struct {
	Orders  []Order
	HasNext bool
}

// BatchOrders pages, newest first by order id, through the orders that
// received codes from the batch (its SOLD cards: PAID, REFUNDING, REFUNDED
// orders, the ones to refund or replace after a recall) or hold some now
// (its LOCKED cards: PENDING orders, which either close, the card then
// withdrawn if the batch was recalled, or are paid and receive it).
// BAD_INPUT for a bad page size.
func (l *Ledger) BatchOrders(ctx context.Context, batchID, afterID int64, limit int) (*BatchOrderPage, error) {
	limit, err := clampLimit(limit)
	if err != nil {
		return nil, err
	}
	var os []Order
	q := l.db.NewSelect().Model(&os).
		Where("order_no IN (SELECT order_no FROM card_stock WHERE batch_id = ? AND status IN (?))",
			batchID, bun.List([]CardStatus{CardLocked, CardSold}))
	hasNext, err := idPage(ctx, q, &os, afterID, limit)
	if err != nil {
		return nil, err
	}
	return &BatchOrderPage{Orders: os, HasNext: hasNext}, nil
}

// Recall is what recalling a batch did.
type Recall struct {
	Batch *Batch
	// Withdrawn is how many cards left sale now (UNSOLD and RECYCLED).
	Withdrawn int
	// Locked is how many are held by unpaid orders: each is withdrawn
	// when its order closes, or delivered if the order is paid first.
	Locked int
	// Sold is how many were delivered already: BatchOrders lists their
	// orders, to refund (refundOrder) or replace.
	Sold int
}

// RecallBatch takes a bad batch off sale: the batch ACTIVE → RECALLED,
// its lockable cards UNSOLD/RECYCLED → WITHDRAWN now (stock journal type
// 6), and from then on the close path withdraws its LOCKED cards instead
// of recycling them (type 7). SOLD cards stay SOLD: their codes were
// shown, their orders are listed by BatchOrders. NOT_FOUND, CONFLICT
// (recalled before: nothing changes), BAD_INPUT (no reason, or over 255
// bytes).
//
// A recall racing a close of an order holding one of its cards: the
// close share-locks the batch rows of the cards it releases (closeOrders)
// and the recall's update of the batch row waits for it, or the other way
// round; either way the card ends WITHDRAWN, never back on sale.
func (l *Ledger) RecallBatch(ctx context.Context, batchID int64, reason, actor string) (*Recall, error) {
	reason = strings.TrimSpace(reason)
	if reason == "" || len(reason) > 255 {
		return nil, Errorf(EBADINPUT, "a recall needs a reason of 1 to 255 bytes (what the supplier said)")
	}
	var rec *Recall
	err := inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
		now := l.now()
		b, err := batchIn(ctx, tx, batchID)
		if err != nil {
			return err
		}
		n, err := apply(ctx, tx, BatchRecall, now, whereID(batchID),
			col("recall_reason = ?", reason), col("recalled_by = ?", actorOr(actor)), col("recalled_at = ?", now))
		if err != nil {
			return err
		}
		if n != 1 {
			return Errorf(ECONFLICT, "batch %d was recalled at %s already", batchID, b.RecalledAt.Format(time.RFC3339))
		}
		// Off sale first, as a pick takes a card (see CardForSale): a pick
		// holding one of the batch's rows is waited for, and its card is
		// LOCKED by then, withdrawn when its order closes.
		var onSale []int64
		if err := tx.NewSelect().Table("card_stock").Column("id").Where("batch_id = ?", batchID).
			Where("status IN (?)", bun.List(CardWithdraw.From)).Scan(ctx, &onSale); err != nil {
			return err
		}
		if len(onSale) > 0 {
			if _, err := takeOffSale(tx, b.ProductID, onSale).Exec(ctx); err != nil {
				return err
			}
		}
		withdrawn, err := apply(ctx, tx, CardWithdraw, now, whereBatch(batchID))
		if err != nil {
			return err
		}
		if withdrawn > 0 {
			if err := writeFlow(ctx, tx, now, StockFlow{ProductID: b.ProductID, ChangeType: FlowWithdraw, Quantity: int(withdrawn)}); err != nil {
				return err
			}
		}
		if err := audit(ctx, tx, now, actor, "batch.recall", fmt.Sprint(batchID),
			fmt.Sprintf("withdrawn=%d reason=%s", withdrawn, reason)); err != nil {
			return err
		}
		if b, err = batchIn(ctx, tx, batchID); err != nil {
			return err
		}
		counts, err := batchStatusCounts(ctx, tx, batchID)
		if err != nil {
			return err
		}
		rec = &Recall{Batch: b, Withdrawn: int(withdrawn), Locked: counts[CardLocked], Sold: counts[CardSold]}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return rec, nil
}

func batchStatusCounts(ctx context.Context, db bun.IDB, batchID int64) (BatchStock, error) {
	var rows []struct {
		Status CardStatus `bun:"status"`
		N      int        `bun:"n"`
	}
	if err := db.NewSelect().Table("card_stock").Column("status").ColumnExpr("COUNT(*) AS n").
		Where("batch_id = ?", batchID).Group("status").Scan(ctx, &rows); err != nil {
		return nil, err
	}
	out := BatchStock{}
	for _, r := range rows {
		out[r.Status] = r.N
	}
	return out, nil
}

func whereID(id int64) func(*bun.UpdateQuery) *bun.UpdateQuery {
	return func(q *bun.UpdateQuery) *bun.UpdateQuery { return q.Where("id = ?", id) }
}

func whereBatch(batchID int64) func(*bun.UpdateQuery) *bun.UpdateQuery {
	return func(q *bun.UpdateQuery) *bun.UpdateQuery { return q.Where("batch_id = ?", batchID) }
}

// RecallBatch recalls a batch through the ledger, then takes its withdrawn
// cards from the stock gate and checks the product's low-stock threshold.
// The gate is told what it can be told: at most what its counter holds
// (takeUpTo); a counter left too high only lets a buyer reach the database,
// which refuses a card it does not have.
func (s *Shop) RecallBatch(ctx context.Context, batchID int64, reason, actor string) (*Recall, error) {
	rec, err := s.Ledger.RecallBatch(ctx, batchID, reason, actor)
	if err != nil {
		return nil, err
	}
	ctx = context.WithoutCancel(ctx)
	if s.Gate != nil && rec.Withdrawn > 0 {
		if err := takeUpTo(ctx, s.Gate, rec.Batch.ProductID, rec.Withdrawn); err != nil {
			s.log().WarnContext(ctx, "stock gate not told of withdrawn cards; reconciliation repairs it", "product", rec.Batch.ProductID, "err", err)
		}
	}
	s.stockFell(ctx, rec.Batch.ProductID)
	return rec, nil
}

// takeUpTo takes as much of n as the gate's counter holds, through the
// gate's own all-or-nothing Take: n, else half of it, and so on, in at
// most log2(n)+1 calls. It never takes more than the counter holds: a
// counter below the truth (takes of orders in flight, given back if they
// fail) must not be driven lower.
func takeUpTo(ctx context.Context, g StockGate, productID int64, n int) error {
	for step := n; step > 0 && n > 0; {
		ok, err := g.Take(ctx, productID, min(step, n))
		if err != nil {
			return err
		}
		if ok {
			n -= min(step, n)
			continue
		}
		step /= 2
	}
	return nil
}
