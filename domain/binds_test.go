package domain_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/migrations"
)

// openPGMigrated is openPG with the schema migrated, for a ledger.
func openPGMigrated(t *testing.T, extra map[string]string) *bun.DB {
	t.Helper()
	db := openPG(t, extra)
	if _, err := migrations.Migrate(context.Background(), db); err != nil {
		t.Fatal(err)
	}
	return db
}

// closeBatches places n orders of two cards each and closes them in
// batches of three (a close's statements with binds, binds.go), each
// expected closed with its cards released.
func closeBatches(t *testing.T, b *bundle, n int) {
	t.Helper()
	ctx := context.Background()
	p := b.product(t, 100, 2*n)
	var nos []string
	for i := range n {
		placed, err := b.ledger.PlaceOrder(ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 2,
			Contact: fmt.Sprintf("buyer%d@example.com", i), Provider: "sandbox", ClientAddr: "10.1.1.1"})
		if err != nil {
			t.Fatal(i, err)
		}
		nos = append(nos, placed.Order.OrderNo)
	}
	for i := 0; i < n; i += 3 {
		rs, err := b.ledger.CloseOrders(ctx, nos[i:min(i+3, n)], domain.CloseCancel)
		if err != nil {
			t.Fatalf("close of batch %d: %v", i/3, err)
		}
		for _, r := range rs {
			if r.Outcome != domain.Closed || r.Released != 2 {
				t.Fatalf("close of %s: %+v", r.OrderNo, r)
			}
		}
	}
}

// TestPGCloseInEveryExecMode: a close runs whatever the URL says of how
// pgx sends statements: a mode named (exec or simple_protocol behind a
// pooler that keeps no prepared statements), or pgx's caches turned off,
// with the database's own clock (CURRENT_TIMESTAMP in the text) and a
// clock read in this process (a bind).
func TestPGCloseInEveryExecMode(t *testing.T) {
	t.Parallel()
	for _, extra := range []map[string]string{
		nil,
		{"default_query_exec_mode": "exec"},
		{"default_query_exec_mode": "simple_protocol"},
		{"default_query_exec_mode": "describe_exec"},
		{"default_query_exec_mode": "cache_describe"},
		{"default_query_exec_mode": "cache_statement"},
		{"statement_cache_capacity": "0"},
	} {
		for _, dbClock := range []bool{false, true} {
			t.Run(fmt.Sprintf("%v/dbclock=%v", extra, dbClock), func(t *testing.T) {
				t.Parallel()
				b := setup(t, openPGMigrated(t, extra), domain.Config{MaxPendingPerAddress: 100})
				if !dbClock {
					b.ledger.DBClock = nil
				}
				closeBatches(t, b, 7)
			})
		}
	}
}

// TestPGCloseAfterAMigration: a migration (or a newer process of a
// rolling upgrade) alters the tables under a connection's prepared close
// statements (binds.go) between two closes: the next close still closes.
// A column added changes nothing a statement returns; a returned
// column's type changed makes PostgreSQL refuse the prepared statement
// ("cached plan must not change result type"): the statement is
// prepared anew, and a transaction it aborted runs again.
func TestPGCloseAfterAMigration(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := openPGMigrated(t, nil)
	db.SetMaxOpenConns(1) // the statements prepared are the next close's
	b := setup(t, db, domain.Config{MaxPendingPerAddress: 100})
	closeBatches(t, b, 3)
	// The pre-close check's read, outside a transaction, prepared too.
	if _, _, err := b.ledger.PendingOfForTest(ctx, []string{"none"}); err != nil {
		t.Fatal(err)
	}
	for _, ddl := range []string{
		"ALTER TABLE orders ADD COLUMN note text",
		"ALTER TABLE card_stock ADD COLUMN note text",
		"ALTER TABLE orders ALTER COLUMN provider TYPE varchar(77)",
		"ALTER TABLE card_stock ALTER COLUMN order_no TYPE varchar(77)",
	} {
		if _, err := db.ExecContext(ctx, ddl); err != nil {
			t.Fatal(err)
		}
		if _, _, err := b.ledger.PendingOfForTest(ctx, []string{"none"}); err != nil {
			t.Fatalf("after %s, the pre-close check: %v", ddl, err)
		}
		closeBatches(t, b, 3)
	}
}
