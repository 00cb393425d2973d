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
// pending_order deleted where the schema has the table, its card
// RECYCLED, a journal row, an event) on tables with exactly that schema's
// indexes and storage options, and reports how many of the updates were
// HOT: some in kami's (the orders'), none before 2026-12-02.
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
	indexesOf := func(tables []string, cond string) int {
		return count(`SELECT count(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid JOIN pg_class x ON x.oid = i.indexrelid
			WHERE c.relnamespace = current_schema()::regnamespace AND c.relname IN (?) AND (`+cond+`)`, bun.List(tables))
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
	if ff := fillfactorOf("orders"); ff != "50" {
		t.Fatalf("kami's orders: fillfactor %q, want 50 (migration 20261201000017)", ff)
	}
	var floorNames []string
	for _, tb := range floorTables {
		floorNames = append(floorNames, tb[1])
	}
	namesStatus := `EXISTS (SELECT 1 FROM pg_attribute a WHERE a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) AND a.attname = 'status')
		OR coalesce(pg_get_expr(i.indpred, i.indrelid) LIKE '%status%', false)`
	if got := indexesOf([]string{"orders"}, namesStatus); got != 0 {
		t.Fatalf("%d of kami's orders indexes name status", got)
	}
	if got := indexesOf([]string{"orders"}, "x.relname = '"+floorBefore.added+"'"); got != 1 {
		t.Fatalf("kami's orders have %d indexes %s", got, floorBefore.added)
	}
	// A variant's index set, counted on kami's tables: each table the
	// variant has keeps its primary key, and its other indexes unless the
	// variant keeps only primary keys, or leaves status out of that
	// table's indexes and the index names status; before 2026-12-02, the
	// orders without the index the migration added, with the ones it
	// dropped.
	want, wantOrders := map[string]int{}, map[string]int{}
	for _, v := range floorVariants {
		for _, tb := range floorTables {
			if !v.has(tb[0]) {
				continue
			}
			cond := "true"
			switch {
			case v.primaryOnly:
				cond = "i.indisprimary"
			case slices.Contains(v.statusFree, tb[0]):
				cond = "i.indisprimary OR NOT (" + namesStatus + ")"
			case v.before && tb[0] == "orders":
				cond = "x.relname <> '" + floorBefore.added + "'"
			}
			got := indexesOf([]string{tb[0]}, cond)
			if v.before && tb[0] == "orders" {
				got += len(floorBefore.dropped)
			}
			want[v.name] += got
			if tb[0] == "orders" {
				wantOrders[v.name] = got
			}
		}
	}
	kami := floorVariants[0].name
	for _, v := range floorVariants[1:] {
		switch {
		case v.before && wantOrders[v.name] <= wantOrders[kami]:
			t.Fatalf("%s: %d indexes of orders, kami's %d", v.name, wantOrders[v.name], wantOrders[kami])
		case !v.before && want[v.name] >= want[kami]:
			t.Fatalf("%s keeps as many indexes as kami's: %v", v.name, want)
		}
	}
	for i, v := range floorVariants {
		var fv FloorVariant
		if err := floorRun(ctx, db, cpuProbe{}, v, n, 2, &fv); err != nil {
			t.Fatalf("%s: %v", v.name, err)
		}
		if fv.Indexes != want[v.name] || indexesOf(floorNames, "true") != want[v.name] || indexesOf([]string{"floor_orders"}, "true") != wantOrders[v.name] {
			t.Errorf("%s: %d indexes reported, %d on the floor's tables (%d on its orders), want %d (%d)",
				v.name, fv.Indexes, indexesOf(floorNames, "true"), indexesOf([]string{"floor_orders"}, "true"), want[v.name], wantOrders[v.name])
		}
		for _, tb := range floorTables {
			if !v.has(tb[0]) {
				if got := count(`SELECT count(*) FROM pg_class WHERE relnamespace = current_schema()::regnamespace AND relname = ?`, tb[1]); got != 0 {
					t.Errorf("%s: has %s", v.name, tb[1])
				}
				continue
			}
			kept := indexesOf([]string{tb[0]}, namesStatus) > 0 && !v.primaryOnly && !slices.Contains(v.statusFree, tb[0]) ||
				v.before && tb[0] == "orders"
			if got := indexesOf([]string{tb[1]}, namesStatus); kept != (got > 0) {
				t.Errorf("%s: %d indexes of %s name status", v.name, got, tb[1])
			}
			// kami's storage options, but for the variant's own.
			ff := fillfactorOf(tb[0])
			switch {
			case slices.Contains(v.statusFree, tb[0]):
				ff = "50"
			case v.before && tb[0] == "orders":
				ff = ""
			}
			if got := fillfactorOf(tb[1]); got != ff {
				t.Errorf("%s: %s has fillfactor %q, want %q", v.name, tb[1], got, ff)
			}
		}
		if got := count(`SELECT count(*) FROM floor_orders WHERE status = 'CLOSED' AND closed_at IS NOT NULL`); got != n {
			t.Errorf("%s: %d orders closed, want %d", v.name, got, n)
		}
		if v.has(floorBefore.table) {
			if got := count(`SELECT count(*) FROM floor_pending`); got != 0 {
				t.Errorf("%s: %d rows of pending_order left, want 0", v.name, got)
			}
		}
		if got := count(`SELECT count(*) FROM floor_cards WHERE status = 'RECYCLED'`); got != n {
			t.Errorf("%s: %d cards recycled, want %d", v.name, got, n)
		}
		if got := count(`SELECT count(DISTINCT order_no) FROM floor_flow WHERE change_type = 3`); got != n {
			t.Errorf("%s: journal rows for %d orders, want %d", v.name, got, n)
		}
		if got := count(`SELECT count(DISTINCT subject) FROM floor_events WHERE type = 'order.closed' AND payload::json->>'status' = 'CLOSED'`); got != n {
			t.Errorf("%s: events for %d orders, want %d", v.name, got, n)
		}
		if fv.ClosesPerSec <= 0 || fv.HOTShare < 0 || fv.HOTShare > 1 {
			t.Errorf("%s: %.0f closes/s, HOT share %.2f", v.name, fv.ClosesPerSec, fv.HOTShare)
		}
		// Status is in no index of kami's orders and they have room on
		// their pages: an order's update is HOT, but before 2026-12-02.
		if !v.before && fv.HOTShare == 0 {
			t.Errorf("%s: no HOT update with status in no index of orders and room on their pages", v.name)
		}
		if v.before && fv.HOTShare != 0 {
			t.Errorf("%s: HOT share %.2f although status is indexed", v.name, fv.HOTShare)
		}
		if i == 0 && fv.HOTShare > 0.5 {
			t.Errorf("%s: HOT share %.2f although status is in the cards' indexes", v.name, fv.HOTShare)
		}
	}
	if err := floorDrop(ctx, db); err != nil {
		t.Fatal(err)
	}
	if got := count(`SELECT count(*) FROM pg_class WHERE relnamespace = current_schema()::regnamespace AND relname LIKE 'floor%'`); got != 0 {
		t.Errorf("%d floor tables or indexes left", got)
	}
}
