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
// A close of an unpaid order writes six rows: the order becomes CLOSED,
// its row of pending_order is deleted, its card becomes RECYCLED and goes
// back on sale (a row of card_for_sale inserted), and a stock journal row
// and an event are inserted. The phase copies the six tables (columns,
// defaults, checks, storage options such as fillfactor 50 on the orders
// and the cards, and the indexes of the variant) into scratch tables of
// the bench's database, fills them with -close-floor PENDING orders, their
// rows of pending_order and their LOCKED cards (which have no row of
// card_for_sale), and writes exactly those rows per order from as many
// sessions as the machine has cores, 500 orders to a transaction, each
// order once: no look-up by order number, no row lock before the update,
// no pre-close check, no kami. Four schemas:
//
//   - kami's: every index the migrations gave the tables, and their
//     storage options: status is in no index of orders or cards
//     (fillfactor 50 on both), so the order's and the card's updates can
//     stay on their pages (HOT updates, which write no index entry);
//     which orders are PENDING is pending_order's rows, which cards are
//     for sale card_for_sale's;
//   - kami's before 20261201000018: no card_for_sale, the cards' indexes
//     that named status back (and not the two it added), default
//     fillfactor on cards, so that the card's update writes an entry in
//     each of their indexes;
//   - kami's before 2026-12-02 (before 20261201000017 as well): no
//     pending_order either, the orders' indexes that named status back
//     (and not the one it added), default fillfactor on orders, so that
//     the order's update writes an entry in each of theirs too;
//   - primary keys only, with kami's tables and storage options: the
//     least a close could cost.
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
var floorTables = [][2]string{{"orders", "floor_orders"}, {"card_stock", "floor_cards"}, {"card_for_sale", "floor_for_sale"},
	{"stock_flow", "floor_flow"}, {"events", "floor_events"}, {"pending_order", "floor_pending"}}

// floorMigration is what a migration changed, which a variant from before
// it undoes on the scratch copies: the table it added, and on the table
// it changed (on), the indexes it added, the ones it dropped
// (PostgreSQL's: name and what follows "ON table") and the storage option
// it set.
type floorMigration struct {
	version, table, on string
	added              []string
	dropped            [][2]string
	option             string
}

// floorMigrations are the migrations a variant undoes, oldest first.
var floorMigrations = []floorMigration{{
	version: "20261201000017",
	table:   "pending_order",
	on:      "orders",
	added:   []string{"orders_contact_created"},
	dropped: [][2]string{
		{"orders_status_created", "(status, created_at)"},
		{"orders_contact_status", "(contact, status)"},
		{"orders_pending_expires", "(expires_at, id) WHERE status = 'PENDING'"},
		{"orders_pending_addr", "(client_addr) WHERE status = 'PENDING'"},
	},
	option: "fillfactor",
}, {
	version: "20261201000018",
	table:   "card_for_sale",
	on:      "card_stock",
	added:   []string{"card_stock_by_order", "card_stock_by_batch"},
	dropped: [][2]string{
		{"card_stock_lockable", "(product_id, status, id)"},
		{"card_stock_order", "(order_no, status)"},
		{"card_stock_batch", "(batch_id, status, id)"},
	},
	option: "fillfactor",
}}

type floorVariant struct {
	name string
	// before is the first of floorMigrations the variant undoes, with
	// every later one; empty: none.
	before      string
	primaryOnly bool
}

// undone are the migrations the variant undoes.
func (v floorVariant) undone() []floorMigration {
	var ms []floorMigration
	for _, m := range floorMigrations {
		if v.before != "" && m.version >= v.before {
			ms = append(ms, m)
		}
	}
	return ms
}

// has reports whether the variant has a copy of kami's table.
func (v floorVariant) has(table string) bool {
	return !slices.ContainsFunc(v.undone(), func(m floorMigration) bool { return m.table == table })
}

// keeps reports whether the variant keeps the index name of kami's table.
func (v floorVariant) keeps(table, name string, primary bool) bool {
	switch {
	case primary:
		return true
	case v.primaryOnly:
		return false
	}
	return !slices.ContainsFunc(v.undone(), func(m floorMigration) bool { return m.on == table && slices.Contains(m.added, name) })
}

// restored are the definitions (name and what follows "ON table") of the
// indexes of kami's table that the variant puts back.
func (v floorVariant) restored(table string) [][2]string {
	var ds [][2]string
	for _, m := range v.undone() {
		if m.on == table {
			ds = append(ds, m.dropped...)
		}
	}
	return ds
}

// with is the storage clause of the scratch copy of kami's table, whose
// storage options (pg_class.reloptions, which CREATE TABLE … LIKE does
// not copy) are opts: kami's, without those the undone migrations set.
func (v floorVariant) with(table string, opts [][2]string) string {
	set := map[string]string{}
	for _, o := range opts {
		set[o[0]] = o[1]
	}
	for _, m := range v.undone() {
		if m.on == table {
			delete(set, m.option)
		}
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

// The schemas measured: kami's, kami's before the card_for_sale table
// (the gain of that change), before the pending_order table as well (the
// gain of both), and no index but the primary keys.
var floorVariants = []floorVariant{
	{name: "kami's indexes"},
	{name: "kami's before 20261201000018", before: "20261201000018"},
	{name: "kami's before 2026-12-02", before: "20261201000017"},
	{name: "primary keys only", primaryOnly: true},
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
	if d, _, err := runDirect(ctx, ledger, runID+"-floor", n, 64, cpuProbe{}, nil, false); err != nil {
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
			Def     string `bun:"def"`
			Primary bool   `bun:"primary"`
		}
		if err := db.NewRaw(`SELECT pg_get_indexdef(i.indexrelid) AS def, i.indisprimary AS primary
			FROM pg_index i WHERE i.indrelid = ?::regclass ORDER BY i.indexrelid`, t[0]).Scan(ctx, &idx); err != nil {
			return err
		}
		var defs []string
		for _, ix := range idx {
			m := indexDef.FindStringSubmatchIndex(ix.Def)
			if m == nil {
				return fmt.Errorf("unexpected index definition %q", ix.Def)
			}
			if v.keeps(t[0], ix.Def[m[4]:m[5]], ix.Primary) {
				defs = append(defs, ix.Def[:m[4]]+"floor_"+ix.Def[m[4]:m[5]]+" ON "+t[1]+ix.Def[m[7]:])
			}
		}
		for _, d := range v.restored(t[0]) {
			defs = append(defs, "CREATE INDEX floor_"+d[0]+" ON "+t[1]+" "+d[1])
		}
		for _, def := range defs {
			if _, err := db.ExecContext(ctx, def); err != nil {
				return fmt.Errorf("%s: %w", def, err)
			}
			out.Indexes++
		}
	}
	// n PENDING orders, their rows of pending_order, and a LOCKED card
	// each (not for sale: no row of card_for_sale), as a drain finds them.
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
	if v.has("pending_order") {
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
		h, u, err := floorClose(ctx, db, lo+1, hi, v.has("pending_order"), v.has("card_for_sale"))
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
// variant has the table), its card RECYCLED and its row of card_for_sale
// inserted (when forSale, the variant has that table), a journal row and
// an event (with a payload of the size kami writes), in kami's order.
// It returns how many of the transaction's order and card updates were
// HOT, and how many there were (the transaction's own statistics, read
// before its COMMIT).
func floorClose(ctx context.Context, db *bun.DB, a, b int, pending, forSale bool) (hot, upd int64, err error) {
	qs := []string{`UPDATE floor_orders SET status = 'CLOSED', updated_at = now(), closed_at = now() WHERE id BETWEEN ? AND ? AND status = 'PENDING'`}
	if pending {
		// The order numbers are zero-padded to one length: their range is
		// the orders a to b.
		qs = append(qs, `DELETE FROM floor_pending WHERE order_no BETWEEN ('2612' || lpad(?::bigint::text, 16, '0')) AND ('2612' || lpad(?::bigint::text, 16, '0'))`)
	}
	qs = append(qs, `UPDATE floor_cards SET status = 'RECYCLED', updated_at = now() WHERE id BETWEEN ? AND ? AND status = 'LOCKED'`)
	if forSale {
		// Card g is order g's.
		qs = append(qs, `INSERT INTO floor_for_sale (product_id, card_id) SELECT 1, g FROM generate_series(?::bigint, ?::bigint) g`)
	}
	qs = append(qs,
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
