package domain_test

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
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
	binds map[string][]any  // substring → the values sent beside that statement (binds.go), if any
}

func (q *queryLog) BeforeQuery(ctx context.Context, _ *bun.QueryEvent) context.Context { return ctx }

func (q *queryLog) AfterQuery(ctx context.Context, ev *bun.QueryEvent) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for _, m := range q.match {
		if strings.Contains(ev.Query, m) {
			q.got[m] = ev.Query
			if q.binds == nil {
				q.binds = map[string][]any{}
			}
			q.binds[m] = domain.BindsOfForTest(ctx)
		}
	}
}

// TestPartialIndexesServeTheirScans: the scans of PENDING orders (the cap
// per address, the sweeper's pages) read pending_order's indexes, which
// hold only PENDING orders, so that no index of orders names status and
// closing or paying an order rewrites it in place; and where the database
// has partial indexes (PostgreSQL, SQLite), the events not yet fanned out
// are looked up by an index that holds only those. A partial index serves
// only a query whose WHERE says what the index's says: each scan can be
// planned on its index (PostgreSQL is told to use an index scan where it
// can; for a test's few rows it would rather read the table).
func TestPartialIndexesServeTheirScans(t *testing.T) {
	t.Parallel()
	for _, k := range []dbtest.Kind{dbtest.SQLite, dbtest.Postgres} {
		t.Run(string(k), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			log := &queryLog{got: map[string]string{}, match: []string{
				`"client_addr" IN`,                    // the cap per address
				"ORDER BY expires_at, order_no",       // the sweeper's pages
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
				`"client_addr" IN`:                    "pending_order_addr",
				"ORDER BY expires_at, order_no":       "pending_order_due",
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
		if err := execEach(ctx, tx, "SET LOCAL enable_seqscan = off", "SET LOCAL enable_bitmapscan = off"); err != nil {
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

// TestBatchLocksFindOrdersByNumber: a payment batch and a close batch lock
// their orders by number. Their lock query once also said "status =
// PENDING", which the partial indexes on PENDING orders match; with the
// statistics of a quiet moment (few PENDING orders) PostgreSQL then read
// the whole partial index, whose entries for orders paid or closed since
// stay until a vacuum, and the heap behind each: 20,000 rows read for a
// batch of 26 under the bench's load. The plan is run (EXPLAIN ANALYZE, in
// a transaction rolled back) after that history, with autovacuum off so
// no vacuum tidies it away, and no step may read more than a few rows per
// order of the batch.
func TestBatchLocksFindOrdersByNumber(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	log := &queryLog{got: map[string]string{}, match: []string{"status = 'PAID'", "status = 'CLOSED'", `UPDATE "card_stock"`, "AS db_now"}}
	db := dbtest.Open(t, dbtest.Postgres)
	if _, err := db.ExecContext(ctx, "ALTER TABLE orders SET (autovacuum_enabled = false)"); err != nil {
		t.Fatal(err)
	}
	b := setup(t, db.WithQueryHook(log), domain.Config{})
	const batch = 40
	p := b.product(t, 100, 1000)
	place := func(n int) (orders []*domain.Order, nos []string) {
		for i := range n {
			placed, err := b.ledger.PlaceOrder(ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1,
				Contact: fmt.Sprintf("buyer%d@example.com", i), Provider: "sandbox", ClientAddr: "10.1.1.1"})
			if err != nil {
				t.Fatal(i, err)
			}
			orders, nos = append(orders, placed.Order), append(nos, placed.Order.OrderNo)
		}
		return orders, nos
	}
	// A history: many orders placed and closed, statistics taken when
	// none was PENDING, then as many again.
	for round := range 2 {
		_, nos := place(400)
		if _, err := b.ledger.CloseOrders(ctx, nos, domain.CloseCancel); err != nil {
			t.Fatal(err)
		}
		if round == 0 {
			if _, err := db.ExecContext(ctx, "ANALYZE orders"); err != nil {
				t.Fatal(err)
			}
		}
	}
	// The batches measured: 40 paid together (as many notifications
	// arriving at once share a transaction), 40 closed.
	orders, _ := place(batch)
	var wg sync.WaitGroup
	for i, o := range orders {
		wg.Go(func() { b.pay(t, o, fmt.Sprintf("T%d", i), fmt.Sprintf("N%d", i)) })
	}
	wg.Wait()
	_, nos := place(batch)
	slices.Sort(nos)
	if pending, _, err := b.ledger.PendingOfForTest(ctx, nos); err != nil || len(pending) != batch {
		t.Fatalf("the pre-close check read %d of %d PENDING orders: %v", len(pending), batch, err)
	}
	if _, err := b.ledger.CloseOrders(ctx, nos, domain.CloseCancel); err != nil {
		t.Fatal(err)
	}
	for _, m := range log.match {
		q := log.got[m]
		if q == "" {
			t.Fatalf("no statement with %q was run", m)
		}
		if worst, plan := mostRowsRead(t, db, q, log.binds[m], true); worst > 2*batch {
			t.Errorf("a step reads %d rows for a batch of at most %d orders: %s\nof %s", worst, batch, plan, q)
		}
	}
}

// TestCloseLeavesPendingByNumber: a close batch deletes its orders' rows of
// pending_order one probe of the key each, however many PENDING orders the
// table holds and whatever its statistics say. A restart that finds a
// backlog finds pending_order grown from a few rows (when it was last
// analyzed) to tens of thousands; asked "order_no IN (…)", PostgreSQL
// believed the table small and read all of it for each batch of 500 (13
// ms of a batch's 33 in the bench's drain). The plan is the planner's own
// choice here (the table is large enough that it has one to make).
func TestCloseLeavesPendingByNumber(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const batch, backlog = 100, 20000
	log := &queryLog{got: map[string]string{}, match: []string{"RECYCLED"}}
	db := unanalyzed(t, "pending_order")
	b := setup(t, db.WithQueryHook(log), domain.Config{MaxPendingPerAddress: batch})
	p := b.product(t, 100, batch)
	var nos []string
	for i := range batch {
		placed, err := b.ledger.PlaceOrder(ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1,
			Contact: fmt.Sprintf("buyer%d@example.com", i), Provider: "sandbox", ClientAddr: "10.1.1.1"})
		if err != nil {
			t.Fatal(i, err)
		}
		nos = append(nos, placed.Order.OrderNo)
		if i == 4 { // the statistics of a quiet moment
			if _, err := db.ExecContext(ctx, "ANALYZE pending_order"); err != nil {
				t.Fatal(err)
			}
		}
	}
	// The backlog: rows of orders this test never closes (pending_order
	// names no order by a foreign key), taken away before the audit.
	if _, err := db.ExecContext(ctx, `INSERT INTO pending_order (order_no, product_id, quantity, contact, client_addr, expires_at)
		SELECT 'backlog-' || g, ?, 1, 'backlog@example.com', '10.9.9.9', CURRENT_TIMESTAMP FROM generate_series(1, ?) AS g`, p.ID, backlog); err != nil {
		t.Fatal(err)
	}
	if _, err := b.ledger.CloseOrders(ctx, nos, domain.CloseCancel); err != nil {
		t.Fatal(err)
	}
	q := log.got["RECYCLED"]
	if q == "" || !strings.Contains(q, "pending_order") {
		t.Fatalf("the close's writes were not one statement with the delete from pending_order: %s", q)
	}
	if worst, plan := mostRowsRead(t, db, q, log.binds["RECYCLED"], false); worst > 2*batch {
		t.Errorf("a step reads %d rows for a batch of %d orders: %s\nof %s", worst, batch, plan, q)
	}
	var left int
	if err := db.NewSelect().TableExpr("pending_order").Where("order_no IN (?)", bun.List(nos)).ColumnExpr("count(*)").Scan(ctx, &left); err != nil || left != 0 {
		t.Fatalf("%d rows of the closed orders left in pending_order: %v", left, err)
	}
	if _, err := db.ExecContext(ctx, "DELETE FROM pending_order WHERE order_no LIKE 'backlog-%'"); err != nil {
		t.Fatal(err)
	}
}

// TestCloseFindsEachRowOnce: on PostgreSQL a close finds each of its
// orders and cards by one probe of its order number and moves it at the
// place its lock read (ctid), with no second look-up by id. Each probe is
// a descent of an index, a tenth of a close's work in the database, and
// the close used to look each order up twice (lock, then UPDATE by id)
// and each card three times (read, lock, UPDATE by id). The counts are
// the transaction's own index statistics, read before it commits.
func TestCloseFindsEachRowOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const orders, perOrder = 30, 2
	db := dbtest.Open(t, dbtest.Postgres)
	b := setup(t, db, domain.Config{})
	p := b.product(t, 100, orders*perOrder)
	var nos []string
	for range orders {
		nos = append(nos, b.order(t, p, perOrder).Order.OrderNo)
	}
	// Analyzed (as an autovacuum may do at any moment), tables of a few
	// dozen rows are cheaper read whole than probed: the planner reads
	// them so, and a close probes no index at all. A busy shop's tables
	// are not so small; the test has the planner probe as it would there.
	if _, err := db.ExecContext(ctx, "ANALYZE orders, card_stock"); err != nil {
		t.Fatal(err)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	if _, err := tx.ExecContext(ctx, "SET LOCAL enable_seqscan = off"); err != nil {
		t.Fatal(err)
	}
	// The session's counts not yet reported hold its earlier
	// transactions' too (PostgreSQL reports them only between
	// transactions): the close's are the difference.
	probes := func() map[string]int {
		var scans []struct {
			Index string `bun:"relname"`
			Scans int    `bun:"scans"`
		}
		if err := tx.NewRaw(`SELECT i.relname, pg_stat_get_xact_numscans(i.oid) AS scans FROM pg_index x
			JOIN pg_class i ON i.oid = x.indexrelid WHERE x.indrelid IN ('orders'::regclass, 'card_stock'::regclass)`).Scan(ctx, &scans); err != nil {
			t.Fatal(err)
		}
		m := map[string]int{}
		for _, s := range scans {
			m[s.Index] = s.Scans
		}
		return m
	}
	before := probes()
	// Six batches on the one connection: PostgreSQL plans a prepared
	// statement (binds.go) for its values five times, then may keep a
	// plan for any values.
	for i := 0; i < orders; i += orders / 6 {
		rs, err := b.ledger.CloseInTxForTest(ctx, tx, nos[i:i+orders/6], domain.CloseCancel)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range rs {
			if r.Outcome != domain.Closed || r.Released != perOrder {
				t.Fatalf("close of %s: %+v", r.OrderNo, r)
			}
		}
	}
	got := map[string]int{}
	for index, n := range probes() {
		if n > before[index] {
			got[index] = n - before[index]
		}
	}
	want := map[string]int{"orders_order_no": orders, "card_stock_by_order": orders}
	if !maps.Equal(got, want) {
		t.Errorf("index probes of a close of %d orders of %d cards each: %v, want %v", orders, perOrder, got, want)
	}
	// Each of the close's three statements (close the orders, lock and
	// read their cards, write the rest) has one text for every batch,
	// prepared once on this connection and run six times.
	var prepared []struct {
		Statement string `bun:"statement"`
		Runs      int    `bun:"runs"`
	}
	if err := tx.NewRaw(`SELECT statement, generic_plans + custom_plans AS runs FROM pg_prepared_statements`).Scan(ctx, &prepared); err != nil {
		t.Fatal(err)
	}
	if len(prepared) != 3 {
		t.Errorf("%d statements prepared, want 3: %+v", len(prepared), prepared)
	}
	for _, p := range prepared {
		if p.Runs != 6 {
			t.Errorf("prepared statement run %d times, want 6: %.200s", p.Runs, p.Statement)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	b.mustAudit(t)
}

// TestPlaceTakesCardsOffSaleByKey: the place deletes its cards' rows of
// card_for_sale one probe of the key each, whatever the statistics say.
// An import analyzes card_for_sale; a backlog of closes that recycles
// thousands of cards into it does not, and with the statistics of a
// moment it held a few rows, asked "card_id IN (…64 ids…)" PostgreSQL
// read every row of the table for each place batch. The plan is the
// planner's own choice here (the table is large enough that it has one
// to make).
func TestPlaceTakesCardsOffSaleByKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const batch, backlog = 64, 20000
	db := unanalyzed(t, "card_for_sale")
	b := setup(t, db, domain.Config{})
	p := b.product(t, 100, 5) // the import analyzes card_for_sale: 5 rows
	// The backlog: cards recycled since (card_for_sale names no card by a
	// foreign key).
	const first = 1_000_000
	if _, err := db.ExecContext(ctx, `INSERT INTO card_for_sale (product_id, card_id)
		SELECT ?, ? + g FROM generate_series(1, ?) AS g`, p.ID, first, backlog); err != nil {
		t.Fatal(err)
	}
	ids := make([]int64, batch)
	for i := range ids {
		ids[i] = first + 1 + int64(i)*(backlog/batch)
	}
	q := domain.TakeOffSaleForTest(db, p.ID, ids)
	if worst, plan := mostRowsRead(t, db, q, nil, false); worst > 2*batch {
		t.Errorf("a step reads %d rows to take %d cards off sale: %s\nof %s", worst, batch, plan, q)
	}
	var left int
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	if _, err := tx.ExecContext(ctx, q); err != nil {
		t.Fatal(err)
	}
	if err := tx.NewSelect().TableExpr("card_for_sale").ColumnExpr("count(*)").Scan(ctx, &left); err != nil || left != 5+backlog-batch {
		t.Fatalf("%d rows of card_for_sale left of %d, %d taken off sale: %v", left, 5+backlog, batch, err)
	}
}

// TestFanOutReadsNoDeliveryBacklog: a fan-out's new deliveries are known
// without reading the deliveries of other events, however many PENDING
// ones a receiver that is down has left and whatever the statistics say.
// Read back by "event_id IN (…) AND status = PENDING", with statistics
// of a moment every delivery was DELIVERED, PostgreSQL read every PENDING
// delivery for each page of events.
func TestFanOutReadsNoDeliveryBacklog(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const page, backlog = 100, 20000
	log := &queryLog{got: map[string]string{}, match: []string{`FROM "webhook_delivery"`}}
	db := unanalyzed(t, "webhook_delivery")
	exec := func(q string) {
		t.Helper()
		if _, err := db.ExecContext(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	b := setup(t, db.WithQueryHook(log), domain.Config{})
	h := b.hooks(domain.WebhookConfig{})
	e, _ := b.endpoint(t, h, "http://127.0.0.1:1/hook", false, domain.EventOrderPaid)
	// The statistics of a quiet moment, then a receiver that went down.
	pastDeliveries(t, db, e.ID, 5, domain.DeliveryDelivered)
	exec("ANALYZE webhook_delivery")
	pastDeliveries(t, db, e.ID, backlog, domain.DeliveryPending)
	exec(fmt.Sprintf(`INSERT INTO events (type, subject, occurred_at, payload, fanned_out)
		SELECT '%s', 'order:new', CURRENT_TIMESTAMP, '{}', FALSE FROM generate_series(1, %d)`, domain.EventOrderPaid, page))
	ds, taken, err := h.FanOut(ctx, page)
	if err != nil || taken != page || len(ds) != page {
		t.Fatalf("FanOut took %d events, made %d deliveries, want %d each: %v", taken, len(ds), page, err)
	}
	if q := log.got[`FROM "webhook_delivery"`]; q != "" {
		if worst, plan := mostRowsRead(t, db, q, log.binds[`FROM "webhook_delivery"`], false); worst > 2*page {
			t.Errorf("a step reads %d rows for a page of %d events: %s\nof %s", worst, page, plan, q)
		}
	}
	ids := make([]int64, len(ds))
	for i, d := range ds {
		ids[i] = d.ID
	}
	var made int
	if err := db.NewSelect().TableExpr("webhook_delivery AS d").Join("JOIN events AS e ON e.id = d.event_id").
		Where("d.id IN (?)", bun.List(ids)).Where("d.status = ?", domain.DeliveryPending).Where("e.subject = 'order:new'").
		ColumnExpr("count(DISTINCT d.id)").Scan(ctx, &made); err != nil || made != page {
		t.Fatalf("%d of the %d deliveries returned are the new events' PENDING ones: %v", made, page, err)
	}
}

// TestDeliveryEndpointsByKey: the delivery workers look their claimed
// deliveries up one probe of the key each, however many deliveries the
// table holds and whatever its statistics say. A claim that walks a
// lane's backlog names 500; asked "id IN (…500…)" with the statistics of
// a moment the table held a few, PostgreSQL read every delivery.
func TestDeliveryEndpointsByKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const claim, backlog = 500, 20000
	log := &queryLog{got: map[string]string{}, match: []string{"webhook_delivery"}}
	db := unanalyzed(t, "webhook_delivery")
	b := setup(t, db.WithQueryHook(log), domain.Config{})
	h := b.hooks(domain.WebhookConfig{})
	e, _ := b.endpoint(t, h, "http://127.0.0.1:1/hook", false, domain.EventOrderPaid)
	pastDeliveries(t, db, e.ID, 5, domain.DeliveryPending)
	if _, err := db.ExecContext(ctx, "ANALYZE webhook_delivery"); err != nil { // the statistics of a quiet moment
		t.Fatal(err)
	}
	pastDeliveries(t, db, e.ID, backlog, domain.DeliveryPending)
	var ids []int64
	if err := db.NewSelect().TableExpr("webhook_delivery").Column("id").OrderExpr("id DESC").Limit(claim).Scan(ctx, &ids); err != nil {
		t.Fatal(err)
	}
	log.got = map[string]string{}
	got, err := h.DeliveryEndpoints(ctx, append(ids, -1))
	if err != nil || len(got) != claim {
		t.Fatalf("%d of %d deliveries found: %v", len(got), claim, err)
	}
	for _, id := range ids {
		if got[id] != e.ID {
			t.Fatalf("delivery %d: endpoint %d, want %d", id, got[id], e.ID)
		}
	}
	q := log.got["webhook_delivery"]
	if worst, plan := mostRowsRead(t, db, q, log.binds["webhook_delivery"], false); worst > 2*claim {
		t.Errorf("a step reads %d rows for a claim of %d deliveries: %s\nof %s", worst, claim, plan, q)
	}
}

// unanalyzed opens a PostgreSQL database whose tables are autovacuumed
// (and analyzed) only by the test: their statistics stay those of the
// moment it analyzes them.
func unanalyzed(t *testing.T, tables ...string) *bun.DB {
	t.Helper()
	db := dbtest.Open(t, dbtest.Postgres)
	for _, table := range tables {
		if _, err := db.ExecContext(context.Background(), "ALTER TABLE "+table+" SET (autovacuum_enabled = false)"); err != nil {
			t.Fatal(err)
		}
	}
	return db
}

// pastDeliveries inserts n events fanned out before, each with its
// delivery to endpoint in status.
func pastDeliveries(t *testing.T, db *bun.DB, endpoint int64, n int, status domain.DeliveryStatus) {
	t.Helper()
	if _, err := db.ExecContext(context.Background(), `WITH e AS (INSERT INTO events (type, subject, occurred_at, payload, fanned_out)
		SELECT ?, 'order:old', CURRENT_TIMESTAMP, '{}', TRUE FROM generate_series(1, ?) RETURNING id)
		INSERT INTO webhook_delivery (event_id, endpoint_id, status, attempts, next_attempt_at, last_status, last_latency_ms,
			last_error, response_snippet, created_at, updated_at)
		SELECT id, ?, ?, 0, CURRENT_TIMESTAMP, 0, 0, '', '', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP FROM e`,
		domain.EventOrderPaid, n, endpoint, status); err != nil {
		t.Fatal(err)
	}
}

// mostRowsRead runs q (with binds, the values sent beside it, if any)
// under EXPLAIN ANALYZE in a transaction it rolls back
// (emptied of recorded notifications first; with forceIndexes, sequential
// scans off) and returns the most rows any step of the plan read
// (returned over all its loops, plus removed by a filter or an index
// recheck), and where.
func mostRowsRead(t *testing.T, db *bun.DB, q string, binds []any, forceIndexes bool) (int, string) {
	t.Helper()
	ctx := context.Background()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	// A payment's statement records its notification again: the rows
	// recorded go first (in this transaction only). A test's tables are
	// small enough to be read whole; a shop's are not, so the planner is
	// told to use an index wherever it can, as it would on a shop's.
	stmts := []string{"DELETE FROM payment_notification"}
	if forceIndexes {
		stmts = append(stmts, "SET LOCAL enable_seqscan = off")
	}
	if err := execEach(ctx, tx, stmts...); err != nil {
		t.Fatal(err)
	}
	var raw string
	if err := tx.QueryRowContext(domain.WithBindsForTest(ctx, binds), "EXPLAIN (ANALYZE, FORMAT JSON) "+q).Scan(&raw); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
	var plans []struct {
		Plan planNode `json:"Plan"`
	}
	if err := json.Unmarshal([]byte(raw), &plans); err != nil || len(plans) == 0 {
		t.Fatalf("EXPLAIN's JSON: %v", err)
	}
	worst, where := 0, ""
	var walk func(n planNode)
	walk = func(n planNode) {
		if rows := int(n.ActualRows*n.ActualLoops) + int(n.RemovedByFilter+n.RemovedByRecheck); rows > worst {
			worst, where = rows, strings.TrimSpace(n.NodeType+" "+n.IndexName+" on "+n.RelationName)
		}
		for _, c := range n.Plans {
			walk(c)
		}
	}
	walk(plans[0].Plan)
	return worst, where + ", in the plan\n" + raw
}

type planNode struct {
	NodeType         string     `json:"Node Type"`
	IndexName        string     `json:"Index Name"`
	RelationName     string     `json:"Relation Name"`
	ActualRows       float64    `json:"Actual Rows"`
	ActualLoops      float64    `json:"Actual Loops"`
	RemovedByFilter  float64    `json:"Rows Removed by Filter"`
	RemovedByRecheck float64    `json:"Rows Removed by Index Recheck"`
	Plans            []planNode `json:"Plans"`
}

// TestSweeperPagesOnUnanalyzedSQLite: kami never runs ANALYZE on SQLite,
// and without statistics SQLite took an equality on the first column of
// (status, created_at) for the better index and sorted every PENDING order
// for each page of 500 the sweeper reads (found by review: 146 ms a page
// against 2 ms with 50,000 PENDING orders). Each page, the first and the
// next ones, with and without a due bound, is read on pending_order's
// index of due times in its order.
func TestSweeperPagesOnUnanalyzedSQLite(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, b, log, first := sweeperPages(t, dbtest.SQLite)
	for _, page := range []struct {
		after domain.PendingOrder
		due   time.Time
	}{{}, {due: b.clock.Now().Add(time.Hour)}, {after: first}, {after: first, due: b.clock.Now().Add(time.Hour)}} {
		log.got = map[string]string{}
		if _, err := b.ledger.PendingOrders(ctx, page.after, page.due, 500); err != nil {
			t.Fatal(err)
		}
		q := log.got["ORDER BY expires_at, order_no"]
		if plan := explain(t, db, q); !strings.Contains(plan, "pending_order_due") || strings.Contains(plan, "TEMP B-TREE") {
			t.Errorf("%s\nis not read on pending_order_due in its order:\n%s", q, plan)
		}
	}
}

// sweeperPages makes three PENDING orders on a database of kind k that
// logs the sweeper's page statements, and reads the first page of one.
func sweeperPages(t *testing.T, k dbtest.Kind) (*bun.DB, *bundle, *queryLog, domain.PendingOrder) {
	t.Helper()
	log := &queryLog{got: map[string]string{}, match: []string{"ORDER BY expires_at, order_no"}}
	db := dbtest.Open(t, k)
	b := setup(t, db.WithQueryHook(log), domain.Config{})
	p := b.product(t, 100, 3)
	for range 3 {
		b.order(t, p, 1)
	}
	first, err := b.ledger.PendingOrders(context.Background(), domain.PendingOrder{}, time.Time{}, 1)
	if err != nil || len(first) != 1 {
		t.Fatal(first, err)
	}
	return db, b, log, first[0]
}

// TestSweeperNextPageSeeks: a sweeper page after the first starts where
// the last one ended, by an index seek on expires_at, instead of walking
// the PENDING orders before it (which made a sweep of a large backlog
// quadratic).
func TestSweeperNextPageSeeks(t *testing.T) {
	t.Parallel()
	for _, k := range []dbtest.Kind{dbtest.SQLite, dbtest.Postgres} {
		t.Run(string(k), func(t *testing.T) {
			t.Parallel()
			db, b, log, first := sweeperPages(t, k)
			next, err := b.ledger.PendingOrders(context.Background(), first, time.Time{}, 500)
			if err != nil || len(next) != 2 {
				t.Fatalf("the next page has %d of the 2 other orders: %v", len(next), err)
			}
			q := log.got["ORDER BY expires_at, order_no"]
			seek := "Index Cond: (expires_at >="
			if k == dbtest.SQLite {
				seek = "pending_order_due (expires_at>"
			}
			if plan := explain(t, db, q); !strings.Contains(plan, seek) {
				t.Errorf("%s\ndoes not seek (%q):\n%s", q, seek, plan)
			}
		})
	}
}

// execEach runs each statement on its own, as kami's own code does: on
// PostgreSQL a read is one statement per call (the extended protocol, see
// domain.OpenDB).
func execEach(ctx context.Context, tx bun.Tx, stmts ...string) error {
	for _, s := range stmts {
		if _, err := tx.ExecContext(ctx, s); err != nil {
			return fmt.Errorf("%s: %w", s, err)
		}
	}
	return nil
}

// TestPendingWalkReadsEachPageOnTheIndex: the sweeper's and the
// reconciliation's walk through the PENDING orders reads each page on
// pending_order's index of due times, even when the table's statistics
// are of a quiet moment and a backlog (Redis down, a restart) has grown it
// since: read so, PostgreSQL read and sorted every PENDING order for each
// page of 500, a walk of n orders reading n²/500 rows. The plan is the
// planner's own (the table is large enough that it has one to make).
func TestPendingWalkReadsEachPageOnTheIndex(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const page, backlog = 500, 20000
	log := &queryLog{got: map[string]string{}, match: []string{"ORDER BY expires_at, order_no"}}
	db := unanalyzed(t, "pending_order")
	b := setup(t, db.WithQueryHook(log), domain.Config{})
	p := b.product(t, 100, 0)
	pending := func(from, n int) {
		t.Helper()
		if _, err := db.ExecContext(ctx, `INSERT INTO pending_order (order_no, product_id, quantity, contact, client_addr, expires_at)
			SELECT 'walk-' || lpad(g::text, 6, '0'), ?, 1, 'walk@example.com', '10.8.8.8', TIMESTAMPTZ '2026-11-29 12:00:00+00' + g * INTERVAL '1 second'
			FROM generate_series(?, ?) AS g`, p.ID, from, from+n-1); err != nil {
			t.Fatal(err)
		}
	}
	pending(1, 5)
	if _, err := db.ExecContext(ctx, "ANALYZE pending_order"); err != nil { // a quiet moment
		t.Fatal(err)
	}
	pending(6, backlog-5)
	t.Cleanup(func() { db.ExecContext(context.Background(), "DELETE FROM pending_order WHERE order_no LIKE 'walk-%'") })

	// Each page after the first is planned as the walk reads it: its
	// statement, run again at once under EXPLAIN, before the next page.
	var walked []string
	checked := 0
	if err := b.ledger.PendingPages(ctx, time.Time{}, page, func(ps []domain.PendingOrder) (bool, error) {
		if len(walked) > 0 {
			q := log.got["ORDER BY expires_at, order_no"]
			if worst, plan := mostRowsRead(t, db, q, log.binds["ORDER BY expires_at, order_no"], false); worst > 2*page {
				t.Errorf("page %d: a step reads %d rows for a page of %d: %s\nof %s", len(walked)/page+1, worst, page, plan, q)
			}
			checked++
		}
		for _, o := range ps {
			walked = append(walked, o.OrderNo)
		}
		return len(walked) < 3*page, nil
	}); err != nil {
		t.Fatal(err)
	}
	if len(walked) != 3*page || !slices.IsSorted(walked) || walked[0] != "walk-000001" || checked != 2 {
		t.Fatalf("walked %d orders (first %v; %d pages' plans checked), not the first three pages in due order", len(walked), walked[:min(1, len(walked))], checked)
	}
}
