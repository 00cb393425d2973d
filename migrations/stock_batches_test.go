package migrations_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/uptrace/bun"
	"github.com/uptrace/bun/migrate"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/migrations"
)

// upTo returns the registered migrations named at most last.
func upTo(last string) *migrate.Migrations {
	ms := migrate.NewMigrations()
	for _, m := range migrations.Migrations.Sorted() {
		if m.Name <= last {
			ms.Add(m)
		}
	}
	return ms
}

// migrateTo applies the registered migrations named at most last.
func migrateTo(t *testing.T, db *bun.DB, last string) {
	t.Helper()
	ctx := context.Background()
	before := migrate.NewMigrator(db, upTo(last))
	if err := before.Init(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := before.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestStockBatchesMigrationKeepsData applies the schema as it was before
// batches, fills it the way a running shop would (cards in every status,
// orders, the journal, ids with a gap at the top), then applies the batch
// migration, rolls it back and applies it again, on every database. Every
// row survives each step with its id; ids are never handed out twice;
// the indexes and CHECKs hold after each step; every old card lands in
// its product's LEGACY batch.
func TestStockBatchesMigrationKeepsData(t *testing.T) {
	t.Parallel()
	for _, k := range []dbtest.Kind{dbtest.SQLite, dbtest.Postgres, dbtest.MySQL} {
		t.Run(string(k), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db, err := domain.OpenDB(ctx, dbtest.URL(t, k), t.TempDir(), domain.DBOptions{MaxOpenConns: 4})
			if err != nil {
				t.Fatal(err)
			}
			defer db.Close()
			migrateTo(t, db, "20261129000003_list_indexes")
			seed := seedOldShop(t, db)

			if _, err := migrations.Migrate(ctx, db); err != nil {
				t.Fatalf("migrate: %v", err)
			}
			checkMigrated(t, db, &seed)

			// Roll back the group the batch migration came in, and check
			// the old schema is back with every row.
			m := migrate.NewMigrator(db, migrations.Migrations)
			if _, err := m.Rollback(ctx); err != nil {
				t.Fatalf("rollback: %v", err)
			}
			checkCards(t, db, &seed, false)
			if err := insertCard(db, seed.productA, "after-rollback", "WITHDRAWN", "", false); err == nil {
				t.Fatal("the old schema accepted a WITHDRAWN card")
			}

			if _, err := migrations.Migrate(ctx, db); err != nil {
				t.Fatalf("migrate again: %v", err)
			}
			checkMigrated(t, db, &seed)

			// A withdrawn card has no place in the old schema: the rollback
			// refuses and leaves everything as it was.
			if _, err := db.ExecContext(ctx, `UPDATE card_stock SET status = 'WITHDRAWN' WHERE id = ?`, seed.unsold); err != nil {
				t.Fatal(err)
			}
			if _, err := m.Rollback(ctx); err == nil || !strings.Contains(err.Error(), "WITHDRAWN") {
				t.Fatalf("rollback with a withdrawn card: %v, want a refusal", err)
			}
			var n int
			if err := db.NewSelect().Table("card_batch").ColumnExpr("COUNT(*)").Scan(ctx, &n); err != nil || n != 2 {
				t.Fatalf("after the refused rollback: %d batches, %v", n, err)
			}
		})
	}
}

type oldShop struct {
	productA, productB int64
	cards              map[int64]string // id → status
	unsold             int64
	maxID              int64 // the highest card id ever handed out (one was deleted)
	flows              int
}

func seedOldShop(t *testing.T, db *bun.DB) oldShop {
	t.Helper()
	ctx := context.Background()
	now := time.Date(2026, 11, 30, 10, 0, 0, 0, time.UTC)
	s := oldShop{cards: map[int64]string{}}
	for i, dst := range []*int64{&s.productA, &s.productB} {
		if _, err := db.ExecContext(ctx, `INSERT INTO products (name, description, price_fen, active, max_per_order, created_at, updated_at)
			VALUES (?, '', 100, ?, 0, ?, ?)`, fmt.Sprintf("p%d", i), true, now, now); err != nil {
			t.Fatal(err)
		}
		if err := db.NewSelect().Table("products").ColumnExpr("MAX(id)").Scan(ctx, dst); err != nil {
			t.Fatal(err)
		}
	}
	for i, st := range []string{"UNSOLD", "LOCKED", "SOLD", "RECYCLED", "UNSOLD", "UNSOLD"} {
		product := s.productA
		if i >= 4 {
			product = s.productB
		}
		order := ""
		if st != "UNSOLD" {
			order = fmt.Sprintf("O%d", i)
		}
		if err := insertCard(db, product, fmt.Sprintf("code-%d", i), st, order, false); err != nil {
			t.Fatal(err)
		}
		var id int64
		if err := db.NewSelect().Table("card_stock").ColumnExpr("MAX(id)").Scan(ctx, &id); err != nil {
			t.Fatal(err)
		}
		s.cards[id] = st
		if st == "UNSOLD" && s.unsold == 0 {
			s.unsold = id
		}
		s.maxID = id
	}
	// The newest card is deleted: its id must still never come back.
	if _, err := db.ExecContext(ctx, `DELETE FROM card_stock WHERE id = ?`, s.maxID); err != nil {
		t.Fatal(err)
	}
	delete(s.cards, s.maxID)
	for i, ty := range []int{5, 1, 2, 3} {
		if _, err := db.ExecContext(ctx, `INSERT INTO stock_flow (product_id, order_no, change_type, quantity, created_at)
			VALUES (?, ?, ?, 1, ?)`, s.productA, fmt.Sprintf("O%d", i), ty, now); err != nil {
			t.Fatal(err)
		}
		s.flows++
	}
	return s
}

// insertCard inserts one card row as raw SQL (the domain model has
// columns the old schema lacks); withBatch puts it in its product's first
// batch. orderNo "" is NULL.
func insertCard(db bun.IDB, productID int64, hash, status, orderNo string, withBatch bool) error {
	var order any
	if orderNo != "" {
		order = orderNo
	}
	at := time.Date(2026, 11, 30, 10, 0, 0, 0, time.UTC)
	cols, vals, args := "", "", []any{productID, []byte{0}, fmt.Sprintf("%064s", hash), status, order, at, at}
	if withBatch {
		cols, vals = ", batch_id", ", (SELECT MIN(id) FROM card_batch WHERE product_id = ?)"
		args = append(args, productID)
	}
	_, err := db.ExecContext(context.Background(), `INSERT INTO card_stock (product_id, code_enc, code_hash, status, order_no, created_at, updated_at`+cols+`)
		VALUES (?, ?, ?, ?, ?, ?, ?`+vals+`)`, args...)
	return err
}

func checkCards(t *testing.T, db *bun.DB, s *oldShop, withBatch bool) {
	t.Helper()
	ctx := context.Background()
	var rows []struct {
		ID      int64  `bun:"id"`
		Status  string `bun:"status"`
		OrderNo string `bun:"order_no"`
	}
	if err := db.NewSelect().Table("card_stock").Column("id", "status").ColumnExpr("COALESCE(order_no, '') AS order_no").
		Order("id").Scan(ctx, &rows); err != nil {
		t.Fatal(err)
	}
	if len(rows) != len(s.cards) {
		t.Fatalf("%d cards, want %d", len(rows), len(s.cards))
	}
	for _, r := range rows {
		if s.cards[r.ID] != r.Status {
			t.Errorf("card %d is %q, want %q", r.ID, r.Status, s.cards[r.ID])
		}
	}
	var flows int
	if err := db.NewSelect().Table("stock_flow").ColumnExpr("COUNT(*)").Scan(ctx, &flows); err != nil || flows != s.flows {
		t.Fatalf("%d journal entries (%v), want %d", flows, err, s.flows)
	}
	// The unique index on (product_id, code_hash) is still there.
	if err := insertCard(db, s.productA, "code-0", "UNSOLD", "", withBatch); err == nil {
		t.Error("a duplicate code_hash was accepted: the unique index is gone")
	}
	// A new card never gets an id handed out before, the deleted one's
	// included.
	if err := insertCard(db, s.productA, fmt.Sprintf("new-%d", time.Now().UnixNano()), "UNSOLD", "", withBatch); err != nil {
		t.Fatal(err)
	}
	var newest int64
	if err := db.NewSelect().Table("card_stock").ColumnExpr("MAX(id)").Scan(ctx, &newest); err != nil {
		t.Fatal(err)
	}
	if newest <= s.maxID {
		t.Errorf("a new card got id %d, which is not above %d, the highest ever handed out", newest, s.maxID)
	}
	if _, err := db.ExecContext(ctx, `DELETE FROM card_stock WHERE id = ?`, newest); err != nil {
		t.Fatal(err)
	}
	s.maxID = newest
}

func checkMigrated(t *testing.T, db *bun.DB, s *oldShop) {
	t.Helper()
	ctx := context.Background()
	checkCards(t, db, s, true)
	var batches []struct {
		ID        int64  `bun:"id"`
		ProductID int64  `bun:"product_id"`
		Source    string `bun:"source"`
		Imported  int    `bun:"imported"`
	}
	if err := db.NewSelect().Table("card_batch").Column("id", "product_id", "source", "imported").Order("id").Scan(ctx, &batches); err != nil {
		t.Fatal(err)
	}
	if len(batches) != 2 || batches[0].Source != "LEGACY" || batches[0].ProductID != s.productA || batches[0].Imported != 4 ||
		batches[1].ProductID != s.productB || batches[1].Imported != 1 {
		t.Fatalf("legacy batches %+v, want one per product (4 and 1 cards)", batches)
	}
	// card_for_sale (20261201000018) holds exactly the cards for sale.
	var forSale, onSale []string
	if err := db.NewSelect().Table("card_for_sale").ColumnExpr("CONCAT(product_id, '/', card_id)").
		OrderExpr("product_id, card_id").Scan(ctx, &forSale); err != nil {
		t.Fatal(err)
	}
	if err := db.NewSelect().Table("card_stock").ColumnExpr("CONCAT(product_id, '/', id)").Where("status IN ('UNSOLD', 'RECYCLED')").
		OrderExpr("product_id, id").Scan(ctx, &onSale); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(forSale, onSale) || len(onSale) != 3 {
		t.Fatalf("card_for_sale %v, cards for sale %v", forSale, onSale)
	}
	var orphans int
	if err := db.NewSelect().TableExpr("card_stock AS c").ColumnExpr("COUNT(*)").
		Where("NOT EXISTS (SELECT 1 FROM card_batch b WHERE b.id = c.batch_id AND b.product_id = c.product_id)").
		Scan(ctx, &orphans); err != nil || orphans != 0 {
		t.Fatalf("%d cards outside their product's batch (%v)", orphans, err)
	}
	// The new CHECKs: WITHDRAWN and the withdrawal journal types are
	// accepted, anything else still refused.
	if err := insertCard(db, s.productA, "withdrawn-probe", "WITHDRAWN", "", true); err != nil {
		t.Fatalf("WITHDRAWN refused: %v", err)
	}
	if _, err := db.ExecContext(ctx, `DELETE FROM card_stock WHERE code_hash = ?`, fmt.Sprintf("%064s", "withdrawn-probe")); err != nil {
		t.Fatal(err)
	}
	if err := insertCard(db, s.productA, "bogus-probe", "BOGUS", "", true); err == nil {
		t.Error("status BOGUS accepted")
	}
	if err := insertCard(db, s.productA, "sold-probe", "SOLD", "", true); err == nil {
		t.Error("a SOLD card without an order accepted: the table CHECK is gone")
	}
	if _, err := db.ExecContext(ctx, `INSERT INTO stock_flow (product_id, change_type, quantity, created_at) VALUES (?, 8, 1, '2026-11-30 10:00:00')`, s.productA); err == nil {
		t.Error("journal type 8 accepted")
	}
	// A card must belong to a batch that exists.
	at := time.Date(2026, 11, 30, 10, 0, 0, 0, time.UTC)
	if _, err := db.ExecContext(ctx, `INSERT INTO card_stock (product_id, code_enc, code_hash, status, created_at, updated_at, batch_id)
		VALUES (?, ?, ?, 'UNSOLD', ?, ?, 999999)`, s.productA, []byte{0}, fmt.Sprintf("%064s", "no-batch"), at, at); err == nil {
		t.Error("a card of a batch that does not exist accepted")
	}
}
