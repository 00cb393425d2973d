package main

import (
	"context"
	"slices"
	"testing"

	"github.com/uptrace/bun"

	"kami/domain/dbtest"
)

// TestCloseFloorWritesACloseRows: each index set's floor writes, for each
// order, the rows a close writes (the order CLOSED, its card RECYCLED, a
// journal row, an event) on tables with exactly that set's indexes, and
// reports how many of the updates were HOT.
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
		return count(`SELECT count(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid
			WHERE c.relnamespace = current_schema()::regnamespace AND c.relname IN (?) AND (`+cond+`)`, bun.List(tables))
	}
	var kamiTables, floorNames []string
	for _, tb := range floorTables {
		kamiTables, floorNames = append(kamiTables, tb[0]), append(floorNames, tb[1])
	}
	namesStatus := `EXISTS (SELECT 1 FROM pg_attribute a WHERE a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) AND a.attname = 'status')
		OR coalesce(pg_get_expr(i.indpred, i.indrelid) LIKE '%status%', false)`
	// A variant's index set, counted on kami's tables: each table keeps
	// its primary key, and its other indexes unless the variant keeps only
	// primary keys, or leaves status out of that table's indexes and the
	// index names status.
	want := map[string]int{}
	for _, v := range floorVariants {
		for _, tb := range kamiTables {
			cond := "true"
			switch {
			case v.primaryOnly:
				cond = "i.indisprimary"
			case slices.Contains(v.statusFree, tb):
				cond = "i.indisprimary OR NOT (" + namesStatus + ")"
			}
			want[v.name] += indexesOf([]string{tb}, cond)
		}
	}
	for i := 1; i < len(floorVariants); i++ {
		if want[floorVariants[i].name] >= want[floorVariants[0].name] {
			t.Fatalf("%s keeps as many indexes as kami's: %v", floorVariants[i].name, want)
		}
	}
	for i, v := range floorVariants {
		var fv FloorVariant
		if err := floorRun(ctx, db, cpuProbe{}, v, n, 2, &fv); err != nil {
			t.Fatalf("%s: %v", v.name, err)
		}
		if fv.Indexes != want[v.name] || indexesOf(floorNames, "true") != want[v.name] {
			t.Errorf("%s: %d indexes reported, %d on the floor's tables, want %d", v.name, fv.Indexes, indexesOf(floorNames, "true"), want[v.name])
		}
		for _, tb := range floorTables {
			kept := indexesOf([]string{tb[0]}, namesStatus) > 0 && !v.primaryOnly && !slices.Contains(v.statusFree, tb[0])
			if got := indexesOf([]string{tb[1]}, namesStatus); kept != (got > 0) {
				t.Errorf("%s: %d indexes of %s name status", v.name, got, tb[1])
			}
		}
		if got := count(`SELECT count(*) FROM floor_orders WHERE status = 'CLOSED' AND closed_at IS NOT NULL`); got != n {
			t.Errorf("%s: %d orders closed, want %d", v.name, got, n)
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
		if len(v.statusFree) > 0 && fv.HOTShare == 0 {
			t.Errorf("%s: no HOT update with status in no index and room on the pages", v.name)
		}
		if i == 0 && fv.HOTShare != 0 {
			t.Errorf("%s: HOT share %.2f although status is indexed", v.name, fv.HOTShare)
		}
	}
	if err := floorDrop(ctx, db); err != nil {
		t.Fatal(err)
	}
	if got := count(`SELECT count(*) FROM pg_class WHERE relnamespace = current_schema()::regnamespace AND relname LIKE 'floor%'`); got != 0 {
		t.Errorf("%d floor tables or indexes left", got)
	}
}
