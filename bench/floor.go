package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
)

// The close floor: what the rows a close writes cost PostgreSQL by
// themselves, on this machine, in the same run as the drain and pgbench.
// A close of an unpaid order writes five rows: the order becomes CLOSED,
// its card RECYCLED, a stock journal row and an event are inserted, and
// its row of pending_order is deleted. The phase copies the five tables
// (columns, defaults, checks, storage options such as the orders'
// fillfactor 50, and the indexes of the variant) into scratch tables of
// the bench's database, fills them with -close-floor PENDING orders, their
// rows of pending_order and their LOCKED cards, and writes exactly those
// rows per order from as many sessions as the machine has cores, 500
// orders to a transaction, each order once: no look-up by order number, no
// row lock before the update, no pre-close check, no kami. Four schemas:
//
//   - kami's: every index the migrations gave the tables, and their
//     storage options: status is in no index of orders (fillfactor 50),
//     so the order's update can stay on its page (a HOT update, which
//     writes no index entry), and which orders are PENDING is
//     pending_order's rows;
//   - kami's before 2026-12-02 (migration 20261201000017): no
//     pending_order, the orders' indexes that named status back (and not
//     the one it added), default fillfactor on orders, so that the
//     order's update writes an entry in most of its indexes;
//   - status in no index of cards too: the cards' indexes that name
//     neither status nor, in their condition, status, with fillfactor 50
//     on cards, so that the card's update can be HOT too;
//   - primary keys only, fillfactor 50 on orders and cards: the least
//     a close could cost.
//
// kami's drain over its floor is what kami's close path (the look-ups,
// locks, pre-close check, fan-out and the process itself on the same
// cores) leaves of the writes; the floors against each other are what
// the indexes cost.

// FloorReport is the close floor of one run.
type FloorReport struct {
	Closes   int            `json:"closes"`
	Sessions int            `json:"sessions"`
	Variants []FloorVariant `json:"variants"`
	// Ledger is kami's own close transaction (Ledger.CloseOrders) on as
	// many orders placed directly, from the same sessions, 500 a batch:
	// the floor's writes plus kami's look-ups, row locks, card read and
	// events, without the pre-close check, Redis or the server.
	Ledger *FloorVariant `json:"ledger,omitempty"`
}

// FloorVariant is one schema's floor.
type FloorVariant struct {
	Name         string  `json:"name"`
	Indexes      int     `json:"indexes"` // on the scratch tables, primary keys included
	ClosesPerSec float64 `json:"closes_per_sec"`
	// HOTShare is the share of the orders' and cards' updates that were
	// HOT (wrote no index entry), by the transactions' own statistics.
	HOTShare float64 `json:"hot_share"`
	// CPU is the machine's while the closes ran; PostgresPerClose and
	// BenchPerClose are µs of CPU per close of the database's sessions and
	// of this process (kami's ledger, for Ledger).
	CPU              CPUUse  `json:"cpu"`
	PostgresPerClose float64 `json:"postgres_us_per_close"`
	BenchPerClose    float64 `json:"bench_us_per_close"`
	Error            string  `json:"error,omitempty"`
}

// floorTables are the tables a close writes, and the scratch copy of each.
var floorTables = [][2]string{{"orders", "floor_orders"}, {"card_stock", "floor_cards"}, {"stock_flow", "floor_flow"},
	{"events", "floor_events"}, {"pending_order", "floor_pending"}}

// floorBefore is what migration 20261201000017 changed, which the variant
// before it undoes on the scratch copies: the table it added, the orders'
// index it added, the orders' indexes it dropped (PostgreSQL's: name and
// what follows "ON orders"), and the orders' storage option it set.
var floorBefore = struct {
	table, added string
	dropped      [][2]string
	option       string
}{
	table: "pending_order",
	added: "orders_contact_created",
	dropped: [][2]string{
		{"orders_status_created", "(status, created_at)"},
		{"orders_contact_status", "(contact, status)"},
		{"orders_pending_expires", "(expires_at, id) WHERE status = 'PENDING'"},
		{"orders_pending_addr", "(client_addr) WHERE status = 'PENDING'"},
	},
	option: "fillfactor",
}

type floorVariant struct {
	name string
	// statusFree are the tables (kami's names) whose indexes that name
	// status are left out, with fillfactor 50, so that an update that
	// changes no indexed column can stay on its page.
	statusFree  []string
	primaryOnly bool
	// before is kami's schema before migration 20261201000017
	// (floorBefore): no pending_order, status in the orders' indexes.
	before bool
}

// has reports whether the variant has a copy of kami's table.
func (v floorVariant) has(table string) bool {
	return !v.before || table != floorBefore.table
}

// keeps reports whether the variant keeps the index name of kami's table.
func (v floorVariant) keeps(table, name string, primary, namesStatus bool) bool {
	switch {
	case primary:
		return true
	case v.primaryOnly:
		return false
	case v.before && table == "orders" && name == floorBefore.added:
		return false
	}
	return !namesStatus || !slices.Contains(v.statusFree, table)
}

// with is the storage clause of the scratch copy of kami's table, whose
// storage options (pg_class.reloptions, which CREATE TABLE … LIKE does
// not copy) are opts: kami's, but fillfactor 50 on a statusFree table,
// and before migration 20261201000017 the orders' without the option it
// set.
func (v floorVariant) with(table string, opts [][2]string) string {
	set := map[string]string{}
	for _, o := range opts {
		set[o[0]] = o[1]
	}
	if v.before && table == "orders" {
		delete(set, floorBefore.option)
	}
	if slices.Contains(v.statusFree, table) {
		set["fillfactor"] = "50"
	}
	if len(set) == 0 {
		return ""
	}
	var kv []string
	for _, k := range slices.Sorted(maps.Keys(set)) {
		kv = append(kv, k+" = '"+strings.ReplaceAll(set[k], "'", "''")+"'")
	}
	return " WITH (" + strings.Join(kv, ", ") + ")"
}

// The schemas measured: kami's, kami's before the pending_order table
// (the gain of that change), the cards' status moved out of their indexes
// as well (what the same change for the cards would bring at most), and
// no index but the primary keys.
var floorVariants = []floorVariant{
	{name: "kami's indexes"},
	{name: "kami's before 2026-12-02", before: true},
	{name: "status in no index of cards too", statusFree: []string{"card_stock"}},
	{name: "primary keys only", primaryOnly: true, statusFree: []string{"orders", "card_stock"}},
}

// floorBatch is a close batch's size in kami (Shop.CloseOrders).
const floorBatch = 500

// runFloor measures the floor of each of floorVariants with n closes,
// from sessions sessions, then kami's close transaction.
func runFloor(ctx context.Context, db *bun.DB, probe cpuProbe, runID string, n, sessions int) *FloorReport {
	rep := &FloorReport{Closes: n, Sessions: sessions}
	for _, v := range floorVariants {
		fv := FloorVariant{Name: v.name}
		if err := floorRun(ctx, db, probe, v, n, sessions, &fv); err != nil {
			fv.Error = err.Error()
		}
		rep.Variants = append(rep.Variants, fv)
	}
	if err := floorDrop(context.WithoutCancel(ctx), db); err != nil {
		progress("close floor: dropping its tables: %v", err)
	}
	rep.Ledger = &FloorVariant{Name: "kami's close (Ledger.CloseOrders)"}
	if err := ledgerClose(ctx, db, probe, runID, n, sessions, rep.Ledger); err != nil {
		rep.Ledger.Error = err.Error()
	}
	return rep
}

// ledgerClose places n orders directly with a TTL of one second, waits
// until all are due, and closes them through the ledger from sessions
// sessions, each its share of the order numbers in order, floorBatch to a
// call, as the drain's close workers would without the pre-close check.
func ledgerClose(ctx context.Context, db *bun.DB, probe cpuProbe, runID string, n, sessions int, out *FloorVariant) error {
	ledger, err := directLedger(db, time.Second)
	if err != nil {
		return err
	}
	if d, _, err := runDirect(ctx, ledger, runID+"-floor", n, 64, cpuProbe{}, nil); err != nil {
		return err
	} else if d.OK != n {
		return fmt.Errorf("placed %d of %d orders: %v", d.OK, n, d.Errors)
	}
	var due []struct {
		OrderNo   string    `bun:"order_no"`
		ExpiresAt time.Time `bun:"expires_at"`
	}
	if err := db.NewSelect().Table("orders").Column("order_no", "expires_at").
		Where("product_id = (SELECT id FROM products WHERE name = ?)", "bench-direct-"+runID+"-floor").
		Where("status = ?", domain.OrderPending).Order("order_no").Scan(ctx, &due); err != nil {
		return err
	}
	if len(due) != n {
		return fmt.Errorf("%d of %d orders pending", len(due), n)
	}
	last := time.Time{}
	for _, o := range due {
		if o.ExpiresAt.After(last) {
			last = o.ExpiresAt
		}
	}
	if err := ledger.SyncClock(ctx); err != nil {
		return err
	}
	for ledger.DBTime().Before(last.Add(100 * time.Millisecond)) { // all due by the database's clock
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	var closed atomic.Int64
	err = closeInSessions(probe, n, sessions, out, func(lo, hi int) error {
		nos := make([]string, 0, hi-lo)
		for _, o := range due[lo:hi] {
			nos = append(nos, o.OrderNo)
		}
		rs, err := ledger.CloseOrders(ctx, nos, domain.CloseTimeout)
		for _, r := range rs {
			if r.Outcome == domain.Closed {
				closed.Add(1)
			}
		}
		return err
	})
	if err == nil && closed.Load() != int64(n) {
		err = fmt.Errorf("closed %d of %d", closed.Load(), n)
	}
	return err
}

func floorDrop(ctx context.Context, db *bun.DB) error {
	names := make([]string, len(floorTables))
	for i, t := range floorTables {
		names[i] = t[1]
	}
	_, err := db.ExecContext(ctx, "DROP TABLE IF EXISTS "+strings.Join(names, ", "))
	return err
}

// indexDef matches pg_get_indexdef's "CREATE [UNIQUE] INDEX name ON
// schema.table USING".
var indexDef = regexp.MustCompile(`^CREATE (UNIQUE )?INDEX (\S+) ON (\S+) USING `)

func floorRun(ctx context.Context, db *bun.DB, probe cpuProbe, v floorVariant, n, sessions int, out *FloorVariant) error {
	if err := floorDrop(ctx, db); err != nil {
		return err
	}
	for _, t := range floorTables {
		if !v.has(t[0]) {
			continue
		}
		var opts []struct {
			Name  string `bun:"option_name"`
			Value string `bun:"option_value"`
		}
		if err := db.NewRaw(`SELECT option_name, option_value FROM pg_class c, pg_options_to_table(c.reloptions)
			WHERE c.oid = ?::regclass`, t[0]).Scan(ctx, &opts); err != nil {
			return err
		}
		kv := make([][2]string, len(opts))
		for i, o := range opts {
			kv[i] = [2]string{o.Name, o.Value}
		}
		if _, err := db.ExecContext(ctx, fmt.Sprintf("CREATE TABLE %s (LIKE %s INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING IDENTITY)%s", t[1], t[0], v.with(t[0], kv))); err != nil {
			return err
		}
		var idx []struct {
			Def         string `bun:"def"`
			Primary     bool   `bun:"primary"`
			NamesStatus bool   `bun:"names_status"`
		}
		if err := db.NewRaw(`SELECT pg_get_indexdef(i.indexrelid) AS def, i.indisprimary AS primary,
				coalesce((SELECT bool_or(a.attname = 'status') FROM pg_attribute a WHERE a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)), false)
				OR coalesce(pg_get_expr(i.indpred, i.indrelid) LIKE '%status%', false) AS names_status
			FROM pg_index i WHERE i.indrelid = ?::regclass ORDER BY i.indexrelid`, t[0]).Scan(ctx, &idx); err != nil {
			return err
		}
		var defs []string
		for _, ix := range idx {
			m := indexDef.FindStringSubmatchIndex(ix.Def)
			if m == nil {
				return fmt.Errorf("unexpected index definition %q", ix.Def)
			}
			if v.keeps(t[0], ix.Def[m[4]:m[5]], ix.Primary, ix.NamesStatus) {
				defs = append(defs, ix.Def[:m[4]]+"floor_"+ix.Def[m[4]:m[5]]+" ON "+t[1]+ix.Def[m[7]:])
			}
		}
		if v.before && t[0] == "orders" {
			for _, d := range floorBefore.dropped {
				defs = append(defs, "CREATE INDEX floor_"+d[0]+" ON "+t[1]+" "+d[1])
			}
		}
		for _, def := range defs {
			if _, err := db.ExecContext(ctx, def); err != nil {
				return fmt.Errorf("%s: %w", def, err)
			}
			out.Indexes++
		}
	}
	// n PENDING orders, their rows of pending_order, and a LOCKED card
	// each, as a drain finds them.
	fill := []string{
		fmt.Sprintf(`INSERT INTO floor_orders (id, order_no, product_id, quantity, unit_price_fen, amount_fen, contact, client_addr,
			provider, status, access_token_hash, paid_fen, expires_at, created_at, updated_at)
		SELECT g, '2612' || lpad(g::text, 16, '0'), 1, 1, 100, 100, 'buyer-' || g || '@floor.test', '127.0.0.1', 'sandbox', 'PENDING',
			md5(g::text) || md5(g::text), 0, now() - interval '1 minute', now() - interval '2 minutes', now() - interval '2 minutes'
		FROM generate_series(1, %d) g`, n),
		fmt.Sprintf(`INSERT INTO floor_cards (id, product_id, batch_id, code_enc, code_hash, status, order_no, locked_at, created_at, updated_at)
		SELECT g, 1, 1, decode(md5(g::text) || md5(g::text) || md5(g::text), 'hex'), md5(g::text) || md5((-g)::text), 'LOCKED',
			'2612' || lpad(g::text, 16, '0'), now() - interval '2 minutes', now() - interval '1 hour', now() - interval '2 minutes'
		FROM generate_series(1, %d) g`, n),
		"VACUUM ANALYZE floor_orders", "VACUUM ANALYZE floor_cards",
	}
	if v.has(floorBefore.table) {
		fill = append(fill, `INSERT INTO floor_pending (order_no, product_id, quantity, contact, client_addr, expires_at)
			SELECT order_no, product_id, quantity, contact, client_addr, expires_at FROM floor_orders`, "VACUUM ANALYZE floor_pending")
	}
	for _, q := range fill {
		if _, err := db.ExecContext(ctx, q); err != nil {
			return err
		}
	}
	var hot, upd atomic.Int64
	if err := closeInSessions(probe, n, sessions, out, func(lo, hi int) error {
		h, u, err := floorClose(ctx, db, lo+1, hi, v.has(floorBefore.table))
		hot.Add(h)
		upd.Add(u)
		return err
	}); err != nil {
		return err
	}
	if upd.Load() > 0 {
		out.HOTShare = float64(hot.Load()) / float64(upd.Load())
	}
	return nil
}

// floorClose writes the rows of each order a to b in one transaction: the
// order CLOSED, its row of pending_order deleted (when pending, the
// variant has the table), its card RECYCLED, a journal row and an event
// (with a payload of the size kami writes), in kami's order. It returns
// how many of the transaction's order and card updates were HOT, and how
// many there were (the transaction's own statistics, read before its
// COMMIT).
func floorClose(ctx context.Context, db *bun.DB, a, b int, pending bool) (hot, upd int64, err error) {
	qs := []string{`UPDATE floor_orders SET status = 'CLOSED', updated_at = now(), closed_at = now() WHERE id BETWEEN ? AND ? AND status = 'PENDING'`}
	if pending {
		// The order numbers are zero-padded to one length: their range is
		// the orders a to b.
		qs = append(qs, `DELETE FROM floor_pending WHERE order_no BETWEEN ('2612' || lpad(?::bigint::text, 16, '0')) AND ('2612' || lpad(?::bigint::text, 16, '0'))`)
	}
	qs = append(qs,
		`UPDATE floor_cards SET status = 'RECYCLED', updated_at = now() WHERE id BETWEEN ? AND ? AND status = 'LOCKED'`,
		`INSERT INTO floor_flow (product_id, order_no, change_type, quantity, created_at)
			SELECT 1, '2612' || lpad(g::text, 16, '0'), 3, 1, now() FROM generate_series(?::bigint, ?::bigint) g`,
		`INSERT INTO floor_events (type, subject, occurred_at, payload, fanned_out)
			SELECT 'order.closed', '2612' || lpad(g::text, 16, '0'), now(), json_build_object('orderNo', '2612' || lpad(g::text, 16, '0'),
				'status', 'CLOSED', 'productId', '1', 'quantity', 1, 'amount', '1.00', 'contact', 'buyer-' || g || '@floor.test',
				'provider', 'sandbox', 'expiresAt', now(), 'createdAt', now(), 'paidAt', NULL, 'closedAt', now(), 'refundedAt', NULL, 'tradeNo', NULL)::text,
				FALSE FROM generate_series(?::bigint, ?::bigint) g`)
	err = db.RunInTx(ctx, &sql.TxOptions{}, func(ctx context.Context, tx bun.Tx) error {
		for _, q := range qs {
			res, err := tx.ExecContext(ctx, q, a, b)
			if err != nil {
				return err
			}
			if got, err := res.RowsAffected(); err != nil || got != int64(b-a+1) {
				return fmt.Errorf("close floor: %d rows of %d written (%v): %.60s", got, b-a+1, err, q)
			}
		}
		return tx.NewRaw(`SELECT pg_stat_get_xact_tuples_hot_updated('floor_orders'::regclass) + pg_stat_get_xact_tuples_hot_updated('floor_cards'::regclass),
			pg_stat_get_xact_tuples_updated('floor_orders'::regclass) + pg_stat_get_xact_tuples_updated('floor_cards'::regclass)`).Scan(ctx, &hot, &upd)
	})
	return hot, upd, err
}

// closeInSessions closes the orders 0 to n-1 from sessions sessions at
// once, each its own share in order, floorBatch to a call of closeBatch
// (the orders lo to hi-1), and records in out the closes per second and
// the machine's CPU over them. It returns the first error of a session,
// which stops that session.
func closeInSessions(probe cpuProbe, n, sessions int, out *FloorVariant, closeBatch func(lo, hi int) error) error {
	per := (n + sessions - 1) / sessions
	errs := make([]error, sessions)
	var wg sync.WaitGroup
	cpu0 := probe.take()
	start := time.Now()
	for s := range sessions {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for lo := s * per; lo < min(n, (s+1)*per) && errs[s] == nil; lo += floorBatch {
				errs[s] = closeBatch(lo, min(lo+floorBatch, n, (s+1)*per))
			}
		}()
	}
	wg.Wait()
	wall := time.Since(start)
	if err := errors.Join(errs...); err != nil {
		return err
	}
	u := cpuUse(cpu0, probe.take())
	perClose := func(cores float64) float64 { return cores * wall.Seconds() / float64(n) * 1e6 }
	out.ClosesPerSec, out.CPU = rate(n, wall), u
	out.PostgresPerClose, out.BenchPerClose = perClose(u.PostgresDB), perClose(u.Bench)
	return nil
}
