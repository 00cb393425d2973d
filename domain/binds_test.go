package domain_test

import (
	"context"
	"fmt"
	"reflect"
	"slices"
	"testing"
	"time"

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

// oneConnLedger is a ledger over a fresh PostgreSQL schema through one
// connection: the statements it prepared are the next close's.
func oneConnLedger(t *testing.T) (*bun.DB, *bundle) {
	t.Helper()
	db := openPGMigrated(t, nil)
	db.SetMaxOpenConns(1)
	return db, setup(t, db, domain.Config{MaxPendingPerAddress: 100})
}

// closeBatches places n orders of two cards each and closes them in
// batches of three (a close's statements with binds, binds.go), each
// expected closed with its cards released.
func closeBatches(t *testing.T, b *bundle, n int) {
	t.Helper()
	ctx := context.Background()
	p := b.product(t, 100, 2*n)
	var nos []string
	for range n {
		nos = append(nos, b.order(t, p, 2).Order.OrderNo)
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
	db, b := oneConnLedger(t)
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

// TestPGBindsWriteAsLiterals: a close's events and journal entries
// written with binds are stored as written with their values in the
// text: payloads (JSON with unicode, quotes, backslashes, braces) byte for
// byte, text that looks like NULL or an array, an empty order number as
// NULL, journal types as smallint, times of another zone as the same instant.
func TestPGBindsWriteAsLiterals(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := openPGMigrated(t, nil)
	p := setup(t, db, domain.Config{}).product(t, 100, 0)
	now := time.Date(2026, 12, 2, 14, 3, 4, 123456789, time.FixedZone("CST", 8*3600))
	odd := []string{`{"contact":"o'brien\\\"卡密\" 😀","note":"\u0000-free, {a,b} NULL"}`, "NULL", "", `{}`, `"quoted"`, `back\slash`, "a,b", "{x,y}", "  spaced  "}
	var evs []domain.Event
	var flows []domain.StockFlow
	for i, s := range odd {
		evs = append(evs, domain.Event{Type: "order.closed", Subject: s, Payload: s})
		flows = append(flows, domain.StockFlow{ProductID: p.ID, OrderNo: "", ChangeType: domain.FlowType(i%7 + 1), Quantity: i + 1})
	}
	type stored struct {
		Type, Subject, Payload string
		OccurredAt             time.Time
	}
	type flow struct {
		ProductID  int64
		OrderNo    *string
		ChangeType int
		Quantity   int
		CreatedAt  time.Time
	}
	var got [2][]stored
	var gotFlows [2][]flow
	for i, bound := range []bool{false, true} {
		if err := domain.WriteEventsAndFlowsForTest(ctx, db, now, slices.Clone(evs), slices.Clone(flows), bound); err != nil {
			t.Fatalf("bound %v: %v", bound, err)
		}
		if err := db.NewRaw("SELECT type, subject, payload, occurred_at FROM events ORDER BY id OFFSET ?", i*len(odd)).Scan(ctx, &got[i]); err != nil {
			t.Fatal(err)
		}
		if err := db.NewRaw("SELECT product_id, order_no, change_type, quantity, created_at FROM stock_flow ORDER BY id OFFSET ?", i*len(odd)).Scan(ctx, &gotFlows[i]); err != nil {
			t.Fatal(err)
		}
	}
	if !reflect.DeepEqual(got[0], got[1]) || len(got[1]) != len(odd) {
		t.Fatalf("events in the text:\n%+v\nwith binds:\n%+v", got[0], got[1])
	}
	for i, e := range got[1] {
		if e.Payload != odd[i] || !e.OccurredAt.Equal(now.Truncate(time.Microsecond)) {
			t.Errorf("event %d stored %+v, written %q at %v", i, e, odd[i], now)
		}
	}
	if !reflect.DeepEqual(gotFlows[0], gotFlows[1]) || len(gotFlows[1]) != len(odd) {
		t.Fatalf("journal in the text:\n%+v\nwith binds:\n%+v", gotFlows[0], gotFlows[1])
	}
	if gotFlows[1][0].OrderNo != nil {
		t.Errorf("an empty order number stored as %q, want NULL", *gotFlows[1][0].OrderNo)
	}
}

// TestPGCloseBehindAPooler: behind a pooler in transaction mode
// (PgBouncer) without a mode in the URL, a statement pgx prepared on one
// server connection is missing on the next transaction's (DEALLOCATE ALL
// stands for that here): the close and the pre-close check run all the
// same, and the pool's statements with binds go unprepared from then on.
func TestPGCloseBehindAPooler(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, b := oneConnLedger(t)
	for i := range 3 {
		closeBatches(t, b, 3)
		if _, _, err := b.ledger.PendingOfForTest(ctx, []string{"none"}); err != nil {
			t.Fatalf("round %d, the pre-close check: %v", i, err)
		}
		if _, err := db.ExecContext(ctx, "DEALLOCATE ALL"); err != nil {
			t.Fatal(err)
		}
	}
	var prepared int
	if err := db.NewRaw("SELECT count(*) FROM pg_prepared_statements").Scan(ctx, &prepared); err != nil {
		t.Fatal(err)
	}
	if prepared != 0 {
		t.Errorf("%d statements prepared after the server lost them, want none", prepared)
	}
}
