package domain_test

import (
	"context"
	"fmt"
	"net/url"
	"testing"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/migrations"
)

// openPGMigrated is openPG with the schema migrated, for a ledger.
func openPGMigrated(t *testing.T, extra map[string]string) *bun.DB {
	t.Helper()
	u, err := url.Parse(dbtest.URL(t, dbtest.Postgres))
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	for k, v := range extra {
		q.Set(k, v)
	}
	u.RawQuery = q.Encode()
	db, err := domain.OpenDB(context.Background(), u.String(), t.TempDir(), domain.DBOptions{MaxOpenConns: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
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
