package queue_test

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
)

// seedPending writes, with bulk INSERTs and not through PlaceOrder, a
// product with n+free cards (one batch) and n PENDING orders of one card
// each, order i expiring at due(i): exactly what n PlaceOrder calls would
// leave, journal included, so the audit stays clean. It returns the product id and the
// order numbers.
func seedPending(ctx context.Context, db *bun.DB, sealer *domain.Sealer, n, free int, due func(i int) time.Time) (int64, []string, error) {
	now := time.Now().UTC().Truncate(time.Microsecond)
	p := &domain.Product{Name: "Seeded", PriceFen: 100, Active: true, CreatedAt: now, UpdatedAt: now}
	if _, err := db.NewInsert().Model(p).Exec(ctx); err != nil {
		return 0, nil, err
	}
	nos := make([]string, n)
	hash := strings.Repeat("0", 64)
	const chunk = 1000
	err := db.RunInTx(ctx, nil, func(ctx context.Context, tx bun.Tx) error {
		batch := &domain.Batch{ProductID: p.ID, Source: domain.BatchFromList, Status: domain.BatchActive, Actor: "seed",
			Imported: n + free, CreatedAt: now, UpdatedAt: now}
		if _, err := tx.NewInsert().Model(batch).Exec(ctx); err != nil {
			return err
		}
		for start := 0; start < n+free; start += chunk {
			end := min(start+chunk, n+free)
			cards := make([]domain.Card, 0, end-start)
			var orders []domain.Order
			var flows []domain.StockFlow
			for i := start; i < end; i++ {
				code := fmt.Sprintf("SEED-%d-%07d", p.ID, i)
				c := domain.Card{ProductID: p.ID, BatchID: batch.ID, CodeEnc: sealer.Seal(p.ID, code), CodeHash: sealer.CodeHash(p.ID, code),
					Status: domain.CardUnsold, CreatedAt: now, UpdatedAt: now}
				if i < n {
					no := fmt.Sprintf("S%05d%014d", p.ID%100000, i)
					nos[i] = no
					exp := due(i).UTC().Truncate(time.Microsecond)
					c.Status, c.OrderNo, c.LockedAt = domain.CardLocked, no, now
					orders = append(orders, domain.Order{OrderNo: no, ProductID: p.ID, Quantity: 1, UnitPriceFen: 100, AmountFen: 100,
						Contact: "seed@example.com", ClientAddr: "127.0.0.1", Provider: "sandbox", Status: domain.OrderPending,
						AccessTokenHash: hash, ExpiresAt: exp, CreatedAt: now, UpdatedAt: now})
					flows = append(flows, domain.StockFlow{ProductID: p.ID, OrderNo: no, ChangeType: domain.FlowLock, Quantity: 1, CreatedAt: now})
				}
				cards = append(cards, c)
			}
			if _, err := tx.NewInsert().Model(&cards).Exec(ctx); err != nil {
				return err
			}
			if len(orders) > 0 {
				if _, err := tx.NewInsert().Model(&orders).Exec(ctx); err != nil {
					return err
				}
				if _, err := tx.NewInsert().Model(&flows).Exec(ctx); err != nil {
					return err
				}
				pending := make([]domain.PendingOrder, len(orders))
				for i, o := range orders {
					pending[i] = domain.PendingOrder{OrderNo: o.OrderNo, ProductID: o.ProductID, Quantity: o.Quantity,
						Contact: o.Contact, ClientAddr: o.ClientAddr, ExpiresAt: o.ExpiresAt}
				}
				if _, err := tx.NewInsert().Model(&pending).Exec(ctx); err != nil {
					return err
				}
			}
		}
		// The free cards on sale, as an import puts them.
		if _, err := tx.ExecContext(ctx, "INSERT INTO card_for_sale (product_id, card_id) SELECT product_id, id FROM card_stock WHERE product_id = ? AND status = ?",
			p.ID, domain.CardUnsold); err != nil {
			return err
		}
		imp := domain.StockFlow{ProductID: p.ID, ChangeType: domain.FlowImport, Quantity: n + free, CreatedAt: now}
		_, err := tx.NewInsert().Model(&imp).Exec(ctx)
		return err
	})
	return p.ID, nos, err
}
