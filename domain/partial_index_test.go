package domain_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect"

	"kami/domain"
	"kami/domain/dbtest"
)

// queryLog keeps the statements that contain any of its substrings.
type queryLog struct {
	mu    sync.Mutex
	match []string
	got   map[string]string // substring → the last statement containing it
}

func (q *queryLog) BeforeQuery(ctx context.Context, _ *bun.QueryEvent) context.Context { return ctx }

func (q *queryLog) AfterQuery(_ context.Context, ev *bun.QueryEvent) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for _, m := range q.match {
		if strings.Contains(ev.Query, m) {
			q.got[m] = ev.Query
		}
	}
}

// TestPartialIndexesServeTheirScans: where the database has partial
// indexes (PostgreSQL, SQLite), the indexes that only PENDING orders and
// the events not yet fanned out are looked up by hold only those rows
// (and the pruner's only the fanned-out events), so that closing or
// paying an order and fanning out its event write fewer index entries.
// A partial index serves only a query whose WHERE says what the index's
// says: each scan that relies on one can be planned on it (PostgreSQL is
// told to use an index scan where it can; for a test's few rows it would
// rather read the table).
func TestPartialIndexesServeTheirScans(t *testing.T) {
	t.Parallel()
	for _, k := range []dbtest.Kind{dbtest.SQLite, dbtest.Postgres} {
		t.Run(string(k), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			log := &queryLog{got: map[string]string{}, match: []string{
				`"client_addr" IN`,                    // the cap per address
				"ORDER BY expires_at, id",             // the sweeper's pages
				"WHERE (fanned_out = FALSE) ORDER BY", // the dispatcher's
			}}
			db := dbtest.Open(t, k)
			b := setup(t, db.WithQueryHook(log), domain.Config{MaxPendingPerAddress: 1000})
			p := b.product(t, 100, 60)
			var closing []string
			for i := range 60 {
				placed, err := b.ledger.PlaceOrder(ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1,
					Contact: "buyer@example.com", Provider: "sandbox", ClientAddr: fmt.Sprintf("10.0.%d.1", i)})
				if err != nil {
					t.Fatal(i, err)
				}
				if i%2 == 0 {
					closing = append(closing, placed.Order.OrderNo)
				}
			}
			if _, err := b.ledger.CloseOrders(ctx, closing, domain.CloseCancel); err != nil {
				t.Fatal(err)
			}
			wh := &domain.Webhooks{Ledger: b.ledger}
			if _, _, err := wh.FanOut(ctx, 50); err != nil {
				t.Fatal(err)
			}
			if _, err := b.ledger.PendingOrders(ctx, domain.PendingOrder{}, b.clock.Now(), 10); err != nil {
				t.Fatal(err)
			}
			if _, err := db.ExecContext(ctx, "ANALYZE"); err != nil {
				t.Fatal(err)
			}
			for m, index := range map[string]string{
				`"client_addr" IN`:                    "orders_pending_addr",
				"ORDER BY expires_at, id":             "orders_pending_expires",
				"WHERE (fanned_out = FALSE) ORDER BY": "events_unfanned",
			} {
				q := log.got[m]
				if q == "" {
					t.Errorf("no statement with %q was run", m)
					continue
				}
				if plan := explain(t, db, q); !strings.Contains(plan, index) {
					t.Errorf("%s\nis not planned on %s:\n%s", q, index, plan)
				}
			}
		})
	}
}

// explain returns the plan of q as text; on PostgreSQL by an index scan
// wherever one can serve.
func explain(t *testing.T, db *bun.DB, q string) string {
	t.Helper()
	ctx := context.Background()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	prefix := "EXPLAIN QUERY PLAN "
	if db.Dialect().Name() == dialect.PG {
		prefix = "EXPLAIN "
		if _, err := tx.ExecContext(ctx, "SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off"); err != nil {
			t.Fatal(err)
		}
	}
	rows, err := tx.QueryContext(ctx, prefix+q)
	if err != nil {
		t.Fatalf("%s: %v", q, err)
	}
	defer rows.Close()
	cols, _ := rows.Columns()
	var lines []string
	for rows.Next() {
		vals := make([]any, len(cols))
		ptrs := make([]any, len(cols))
		for i := range vals {
			ptrs[i] = &vals[i]
		}
		if err := rows.Scan(ptrs...); err != nil {
			t.Fatal(err)
		}
		for _, v := range vals {
			switch v := v.(type) {
			case string:
				lines = append(lines, v)
			case []byte:
				lines = append(lines, string(v))
			}
		}
	}
	return strings.Join(lines, "\n")
}

// TestSweeperPagesOnUnanalyzedSQLite: kami never runs ANALYZE on SQLite,
// and without statistics SQLite takes an equality on the first column of
// (status, created_at) for the better index and sorts every PENDING order
// for each page of 500 the sweeper reads (found by review: 146 ms a page
// against 2 ms with 50,000 PENDING orders). Each page, the first and the
// next ones, with and without a due bound, is read on the partial index in
// its order.
func TestSweeperPagesOnUnanalyzedSQLite(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	log := &queryLog{got: map[string]string{}, match: []string{"ORDER BY expires_at, id"}}
	db := dbtest.Open(t, dbtest.SQLite)
	b := setup(t, db.WithQueryHook(log), domain.Config{})
	p := b.product(t, 100, 3)
	for range 3 {
		b.order(t, p, 1)
	}
	first, err := b.ledger.PendingOrders(ctx, domain.PendingOrder{}, time.Time{}, 1)
	if err != nil || len(first) != 1 {
		t.Fatal(first, err)
	}
	for _, page := range []struct {
		after domain.PendingOrder
		due   time.Time
	}{{}, {due: b.clock.Now().Add(time.Hour)}, {after: first[0]}, {after: first[0], due: b.clock.Now().Add(time.Hour)}} {
		log.got = map[string]string{}
		if _, err := b.ledger.PendingOrders(ctx, page.after, page.due, 500); err != nil {
			t.Fatal(err)
		}
		q := log.got["ORDER BY expires_at, id"]
		if plan := explain(t, db, q); !strings.Contains(plan, "orders_pending_expires") || strings.Contains(plan, "TEMP B-TREE") {
			t.Errorf("%s\nis not read on orders_pending_expires in its order:\n%s", q, plan)
		}
	}
}
