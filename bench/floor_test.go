package main

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/uptrace/bun"

	"kami/domain/dbtest"
)

// TestCloseFloorWritesACloseRows: each schema's floor writes, for each
// order, the rows a close writes (the order CLOSED, its row of
// pending_order deleted where the schema has the table, its card RECYCLED
// and its row of card_for_sale inserted where the schema has that table,
// a journal row, an event) on tables with exactly that schema's indexes
// and storage options, and reports how many of the updates were HOT: all
// in kami's (the orders' and the cards'), the orders' before
// 20261201000018, none before 2026-12-02.
func TestCloseFloorWritesACloseRows(t *testing.T) {
	t.Parallel()
	db := dbtest.Open(t, dbtest.Postgres)
	ctx := context.Background()
	const n = 1234 // three batches, the last one short, over two sessions
	count := func(q string, args ...any) int {
		t.Helper()
		var got int
		if err := db.NewRaw(q, args...).Scan(ctx, &got); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		return got
	}
	indexesOf := func(tables []string, cond string, args ...any) int {
		return count(`SELECT count(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid JOIN pg_class x ON x.oid = i.indexrelid
			WHERE c.relnamespace = current_schema()::regnamespace AND c.relname IN (?) AND (`+cond+`)`, append([]any{bun.List(tables)}, args...)...)
	}
	fillfactorOf := func(table string) string {
		t.Helper()
		var ff []string
		if err := db.NewRaw(`SELECT option_value FROM pg_class c, pg_options_to_table(c.reloptions)
			WHERE c.oid = ?::regclass AND option_name = 'fillfactor'`, table).Scan(ctx, &ff); err != nil {
			t.Fatal(err)
		}
		return strings.Join(ff, ",")
	}
	tableExists := func(name string) bool {
		return count(`SELECT count(*) FROM pg_class WHERE relnamespace = current_schema()::regnamespace AND relname = ?`, name) > 0
	}
	var floorNames []string
	for _, tb := range floorTables {
		floorNames = append(floorNames, tb[1])
	}
	namesStatus := `EXISTS (SELECT 1 FROM pg_attribute a WHERE a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) AND a.attname = 'status')
		OR coalesce(pg_get_expr(i.indpred, i.indrelid) LIKE '%status%', false)`
	// kami's schema, as the migrations left it.
	for _, m := range floorMigrations {
		if !tableExists(m.table) {
			t.Fatalf("kami has no %s (migration %s)", m.table, m.version)
		}
		if ff := fillfactorOf(m.on); ff != "50" {
			t.Fatalf("kami's %s: fillfactor %q, want 50 (migration %s)", m.on, ff, m.version)
		}
		if got := indexesOf([]string{m.on}, namesStatus); got != 0 {
			t.Fatalf("%d of kami's %s indexes name status (migration %s)", got, m.on, m.version)
		}
		if got := indexesOf([]string{m.on}, "x.relname IN (?)", bun.List(m.added)); got != len(m.added) {
			t.Fatalf("kami's %s have %d of the indexes %v (migration %s)", m.on, got, m.added, m.version)
		}
	}
	// A variant's index set, counted on kami's tables: each table the
	// variant has keeps its primary key, and its other indexes unless the
	// variant keeps only primary keys or the index was added by a
	// migration the variant undoes; with the indexes those migrations
	// dropped.
	want, wantOn := map[string]int{}, map[string]map[string]int{}
	for _, v := range floorVariants {
		wantOn[v.name] = map[string]int{}
		for _, tb := range floorTables {
			if !v.has(tb[0]) {
				continue
			}
			cond, args := "true", []any{}
			var added []string
			for _, m := range v.undone() {
				if m.on == tb[0] {
					added = append(added, m.added...)
				}
			}
			switch {
			case v.primaryOnly:
				cond = "i.indisprimary"
			case len(added) > 0:
				cond = "x.relname NOT IN (?)"
				args = append(args, bun.List(added))
			}
			got := indexesOf([]string{tb[0]}, cond, args...) + len(v.restored(tb[0]))
			want[v.name] += got
			wantOn[v.name][tb[0]] = got
		}
	}
	// What each schema is: the tables it lacks, how many of the orders'
	// and the cards' indexes name status, their fillfactors, and the share
	// of their updates that are HOT (orders and cards are updated alike).
	type schema struct {
		lacks                    []string
		ordersStatus, cardStatus int
		ordersFF, cardsFF        string
		hotMin, hotMax           float64
	}
	schemas := map[string]schema{
		"kami's indexes":               {ordersFF: "50", cardsFF: "50", hotMin: 0.9, hotMax: 1},
		"kami's before 20261201000018": {lacks: []string{"card_for_sale"}, cardStatus: 3, ordersFF: "50", hotMin: 0.4, hotMax: 0.5},
		"kami's before 2026-12-02":     {lacks: []string{"card_for_sale", "pending_order"}, ordersStatus: 4, cardStatus: 3},
		"primary keys only":            {ordersFF: "50", cardsFF: "50", hotMin: 0.9, hotMax: 1},
	}
	var names []string
	for _, v := range floorVariants {
		names = append(names, v.name)
	}
	if !slices.Equal(names, []string{"kami's indexes", "kami's before 20261201000018", "kami's before 2026-12-02", "primary keys only"}) {
		t.Fatalf("variants %q", names)
	}
	// The cards have more indexes before 20261201000018, the orders more
	// before 2026-12-02.
	if on := func(i int, table string) int { return wantOn[names[i]][table] }; on(1, "card_stock") <= on(0, "card_stock") ||
		on(1, "orders") != on(0, "orders") || on(2, "orders") <= on(1, "orders") || want[names[3]] >= want[names[0]] {
		t.Fatalf("indexes per schema: %v", wantOn)
	}
	for _, v := range floorVariants {
		sc := schemas[v.name]
		var fv FloorVariant
		if err := floorRun(ctx, db, cpuProbe{}, v, n, 2, &fv); err != nil {
			t.Fatalf("%s: %v", v.name, err)
		}
		t.Logf("%s: %d indexes, HOT share %.2f", v.name, fv.Indexes, fv.HOTShare)
		if fv.Indexes != want[v.name] || indexesOf(floorNames, "true") != want[v.name] {
			t.Errorf("%s: %d indexes reported, %d on the floor's tables, want %d", v.name, fv.Indexes, indexesOf(floorNames, "true"), want[v.name])
		}
		for _, tb := range floorTables {
			if got, wantIt := tableExists(tb[1]), !slices.Contains(sc.lacks, tb[0]); got != wantIt || v.has(tb[0]) != wantIt {
				t.Errorf("%s: has %s: %v, want %v", v.name, tb[1], got, wantIt)
			}
			if tableExists(tb[1]) {
				if got := indexesOf([]string{tb[1]}, "true"); got != wantOn[v.name][tb[0]] {
					t.Errorf("%s: %d indexes on %s, want %d", v.name, got, tb[1], wantOn[v.name][tb[0]])
				}
			}
		}
		if got := indexesOf([]string{"floor_orders"}, namesStatus); got != sc.ordersStatus {
			t.Errorf("%s: %d indexes of floor_orders name status, want %d", v.name, got, sc.ordersStatus)
		}
		if got := indexesOf([]string{"floor_cards"}, namesStatus); got != sc.cardStatus {
			t.Errorf("%s: %d indexes of floor_cards name status, want %d", v.name, got, sc.cardStatus)
		}
		if got := fillfactorOf("floor_orders"); got != sc.ordersFF {
			t.Errorf("%s: floor_orders has fillfactor %q, want %q", v.name, got, sc.ordersFF)
		}
		if got := fillfactorOf("floor_cards"); got != sc.cardsFF {
			t.Errorf("%s: floor_cards has fillfactor %q, want %q", v.name, got, sc.cardsFF)
		}
		if got := count(`SELECT count(*) FROM floor_orders WHERE status = 'CLOSED' AND closed_at IS NOT NULL`); got != n {
			t.Errorf("%s: %d orders closed, want %d", v.name, got, n)
		}
		if v.has("pending_order") {
			if got := count(`SELECT count(*) FROM floor_pending`); got != 0 {
				t.Errorf("%s: %d rows of pending_order left, want 0", v.name, got)
			}
		}
		if got := count(`SELECT count(*) FROM floor_cards WHERE status = 'RECYCLED'`); got != n {
			t.Errorf("%s: %d cards recycled, want %d", v.name, got, n)
		}
		if v.has("card_for_sale") {
			if got := count(`SELECT count(*) FROM floor_for_sale f JOIN floor_cards c ON c.id = f.card_id AND c.product_id = f.product_id
				WHERE c.status = 'RECYCLED'`); got != n || count(`SELECT count(*) FROM floor_for_sale`) != n {
				t.Errorf("%s: %d recycled cards back on sale, want %d", v.name, got, n)
			}
		}
		if got := count(`SELECT count(DISTINCT order_no) FROM floor_flow WHERE change_type = 3`); got != n {
			t.Errorf("%s: journal rows for %d orders, want %d", v.name, got, n)
		}
		if got := count(`SELECT count(DISTINCT subject) FROM floor_events WHERE type = 'order.closed' AND payload::json->>'status' = 'CLOSED'`); got != n {
			t.Errorf("%s: events for %d orders, want %d", v.name, got, n)
		}
		if fv.ClosesPerSec <= 0 || fv.HOTShare < sc.hotMin || fv.HOTShare > sc.hotMax {
			t.Errorf("%s: %.0f closes/s, HOT share %.2f, want %.2f to %.2f", v.name, fv.ClosesPerSec, fv.HOTShare, sc.hotMin, sc.hotMax)
		}
	}
	if err := floorDrop(ctx, db); err != nil {
		t.Fatal(err)
	}
	if got := count(`SELECT count(*) FROM pg_class WHERE relnamespace = current_schema()::regnamespace AND relname LIKE 'floor%'`); got != 0 {
		t.Errorf("%d floor tables or indexes left", got)
	}
}
