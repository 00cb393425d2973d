package domain_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/domain/domaintest"
)

// pendingRows reads pending_order whole, by order number.
func pendingRows(t testing.TB, db bun.IDB) map[string]domain.PendingOrder {
	t.Helper()
	var rows []domain.PendingOrder
	if err := db.NewSelect().Model(&rows).Scan(context.Background()); err != nil {
		t.Fatal(err)
	}
	out := map[string]domain.PendingOrder{}
	for _, r := range rows {
		out[r.OrderNo] = r
	}
	return out
}

// rowOf is the row pending_order holds for o while it is PENDING.
func rowOf(o *domain.Order) domain.PendingOrder {
	return domain.PendingOrder{OrderNo: o.OrderNo, ProductID: o.ProductID, Quantity: o.Quantity,
		Contact: o.Contact, ClientAddr: o.ClientAddr, ExpiresAt: o.ExpiresAt}
}

// TestPendingRowsFollowTheOrders: an order has its row in pending_order
// from the transaction that places it to the one that pays or closes it,
// and the row says what the order does; the sweeper's pages and the audit
// read them.
func TestPendingRowsFollowTheOrders(t *testing.T) {
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 10)
		var placed []*domain.Order
		for _, qty := range []int{1, 2, 1, 3} {
			placed = append(placed, b.order(t, p, qty).Order)
		}
		rows := pendingRows(t, db)
		if len(rows) != len(placed) {
			t.Fatalf("%d rows for %d PENDING orders", len(rows), len(placed))
		}
		for _, o := range placed {
			r, want := rows[o.OrderNo], rowOf(o)
			if r.OrderNo != want.OrderNo || r.ProductID != want.ProductID || r.Quantity != want.Quantity || r.Contact != want.Contact ||
				r.ClientAddr != want.ClientAddr || !r.ExpiresAt.Equal(want.ExpiresAt) {
				t.Errorf("row %+v for order %+v", r, o)
			}
		}
		b.pay(t, placed[0], "T-1", "N-1")
		if rs, err := b.ledger.CloseOrders(b.ctx, []string{placed[1].OrderNo}, domain.CloseCancel); err != nil || rs[0].Outcome != domain.Closed {
			t.Fatal(rs, err)
		}
		rows = pendingRows(t, db)
		var left []string
		for no := range rows {
			left = append(left, no)
		}
		slices.Sort(left)
		want := []string{placed[2].OrderNo, placed[3].OrderNo}
		slices.Sort(want)
		if !slices.Equal(left, want) {
			t.Errorf("rows left for %v, want the two still PENDING %v", left, want)
		}
		page, err := b.ledger.PendingOrders(b.ctx, domain.PendingOrder{}, time.Time{}, 10)
		if err != nil || len(page) != 2 {
			t.Fatalf("the sweeper's page: %v, %v", page, err)
		}
		b.mustAudit(t)
	})
}

// TestRepairPendingRows: a PENDING order without its row (placed by a
// process of a version from before pending_order) and a row for an order
// no longer PENDING (paid by one) are each named by the audit, and the
// reconciliation's repair gives the first its row, so the sweeper sees it,
// and removes the second.
func TestRepairPendingRows(t *testing.T) {
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 10)
		orphan, paid := b.order(t, p, 2).Order, b.order(t, p, 1).Order
		b.pay(t, paid, "T-1", "N-1")
		ctx := b.ctx
		if _, err := db.NewDelete().Model((*domain.PendingOrder)(nil)).Where("order_no = ?", orphan.OrderNo).Exec(ctx); err != nil {
			t.Fatal(err)
		}
		stale := rowOf(paid)
		if _, err := db.NewInsert().Model(&stale).Exec(ctx); err != nil {
			t.Fatal(err)
		}
		vs, err := b.ledger.Audit(ctx)
		if err != nil {
			t.Fatal(err)
		}
		named := map[string]bool{}
		for _, v := range vs {
			if v.Rule == "pending_row" {
				named[v.Subject] = true
			}
		}
		if !named["order "+orphan.OrderNo] || !named["order "+paid.OrderNo] || len(vs) != 2 {
			t.Errorf("audit: %v; want pending_row for %s and %s", vs, orphan.OrderNo, paid.OrderNo)
		}

		added, removed, err := b.ledger.RepairPendingRows(ctx)
		if err != nil || added != 1 || removed != 1 {
			t.Fatalf("repair: added %d, removed %d, %v; want 1 and 1", added, removed, err)
		}
		b.mustAudit(t)
		page, err := b.ledger.PendingOrders(ctx, domain.PendingOrder{}, time.Time{}, 10)
		if err != nil || len(page) != 1 || page[0].OrderNo != orphan.OrderNo || page[0].Quantity != 2 {
			t.Fatalf("the sweeper's page after the repair: %+v, %v", page, err)
		}
		if added, removed, err := b.ledger.RepairPendingRows(ctx); err != nil || added+removed != 0 {
			t.Errorf("a second repair: added %d, removed %d, %v", added, removed, err)
		}
	})
}

// columnsWritten are, by table, the columns a payment or a close writes
// (a card's lock, at placement, writes order_no and locked_at too).
var columnsWritten = map[string][]string{
	"orders":     {"status", "updated_at", "closed_at", "trade_no", "paid_fen", "paid_at", "delivered_at"},
	"card_stock": {"status", "updated_at", "sold_at"},
}

// indexDefs reads the definitions of table's indexes (MySQL/MariaDB: the
// columns they name).
func indexDefs(t *testing.T, db *bun.DB, table string) []string {
	t.Helper()
	ctx := context.Background()
	var defs []string
	var err error
	switch db.Dialect().Name() {
	case dialect.PG:
		err = db.NewRaw("SELECT indexdef FROM pg_indexes WHERE schemaname = current_schema() AND tablename = ?", table).Scan(ctx, &defs)
	case dialect.SQLite:
		err = db.NewRaw("SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = ? AND sql IS NOT NULL", table).Scan(ctx, &defs)
	case dialect.MySQL:
		err = db.NewRaw("SELECT column_name FROM information_schema.statistics WHERE table_schema = DATABASE() AND table_name = ?", table).Scan(ctx, &defs)
	}
	if err != nil || len(defs) < 2 {
		t.Fatalf("%s's indexes: %v, %v", table, defs, err)
	}
	return defs
}

// TestNoIndexNamesWhatAPaymentOrCloseWrites: no index of orders or of
// card_stock names a column that a payment or close writes, not even in a
// partial index's condition, so PostgreSQL can rewrite the order and its
// cards in place (a HOT update) instead of adding an entry to each of
// their indexes; on PostgreSQL it does, for every payment and close.
// (Which orders are PENDING is pending_order; which cards are for sale,
// card_for_sale.)
func TestNoIndexNamesWhatAPaymentOrCloseWrites(t *testing.T) {
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		ctx := context.Background()
		for table, cols := range columnsWritten {
			for _, def := range indexDefs(t, db, table) {
				for _, c := range cols {
					if strings.Contains(strings.ToLower(def), c) {
						t.Errorf("an index of %s names %s: %s", table, c, def)
					}
				}
			}
		}
		if db.Dialect().Name() != dialect.PG {
			return
		}

		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 40)
		var nos []string
		for i := range 40 {
			o := b.order(t, p, 1).Order
			if i%2 == 0 {
				b.pay(t, o, "T-"+o.OrderNo, "N-"+o.OrderNo)
			} else {
				nos = append(nos, o.OrderNo)
			}
		}
		if _, err := b.ledger.CloseOrders(ctx, nos, domain.CloseCancel); err != nil {
			t.Fatal(err)
		}
		// A session reports its counts when it goes idle, at most a
		// second after its last report. Each card was updated twice: its
		// lock at placement (order_no is in an index: never HOT), then its
		// sale or recycling, HOT when the lock's version left room on its
		// page (most: fillfactor 50, and the lock's old version is pruned
		// when a page fills); with status in an index, none would be.
		for _, c := range []struct {
			table     string
			upd, want int64
		}{{"orders", 40, 40}, {"card_stock", 80, 20}} {
			var upd, hot int64
			domaintest.Eventually(t, time.Minute, fmt.Sprintf("the %d updates of %s counted", c.upd, c.table), func() bool {
				if _, err := db.ExecContext(ctx, "SELECT pg_stat_clear_snapshot()"); err != nil {
					t.Fatal(err)
				}
				if err := db.NewRaw("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = ?::regclass", c.table).
					Scan(ctx, &upd, &hot); err != nil {
					t.Fatal(err)
				}
				return upd >= c.upd
			})
			if hot < c.want {
				t.Errorf("%d of the %d updates of %s were HOT; want at least %d", hot, upd, c.table, c.want)
			}
		}
	})
}

// TestCloseRemovesARowLeftForAnOrderNoLongerPending: a row of
// pending_order whose order was paid by a process of an older version
// (which knows nothing of the table) is scheduled by the sweeper again and
// again; the close it schedules removes it, alone or in a batch that
// closes another order (whose row goes in the same delete).
func TestCloseRemovesARowLeftForAnOrderNoLongerPending(t *testing.T) {
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 4)
		for i, withOther := range []bool{false, true} {
			paid, other := b.order(t, p, 1).Order, b.order(t, p, 1).Order
			b.pay(t, paid, fmt.Sprint("T-", i), fmt.Sprint("N-", i))
			stale := rowOf(paid)
			if _, err := db.NewInsert().Model(&stale).Exec(b.ctx); err != nil {
				t.Fatal(err)
			}
			nos := []string{paid.OrderNo}
			if withOther {
				nos = append(nos, other.OrderNo)
			}
			rs, err := b.ledger.CloseOrders(b.ctx, nos, domain.CloseCancel)
			if err != nil || len(rs) != len(nos) || byNo(rs, paid.OrderNo).Outcome != domain.CloseSkipped {
				t.Fatalf("close of a paid order: %+v, %v", rs, err)
			}
			if withOther && byNo(rs, other.OrderNo).Outcome != domain.Closed {
				t.Fatalf("close of a PENDING order beside it: %+v", rs)
			}
			rows := pendingRows(t, db)
			if _, ok := rows[paid.OrderNo]; ok {
				t.Errorf("rows after the close: %v; %s's is still there", rows, paid.OrderNo)
			}
			if _, ok := rows[other.OrderNo]; ok == withOther {
				t.Errorf("rows after the close: %v; %s's there: %v, want %v", rows, other.OrderNo, ok, !withOther)
			}
			b.mustAudit(t)
			if !withOther {
				if _, err := b.ledger.CloseOrders(b.ctx, []string{other.OrderNo}, domain.CloseCancel); err != nil {
					t.Fatal(err)
				}
			}
		}
	})
}
