// Package domain is kami's ledger: products, cards, orders, refunds and the
// stock journal, and the services that move them through their state
// machines. Every other part of kami (GraphQL resolvers, webhooks, queue
// workers, commands) calls these services; none writes a status itself.
package domain

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"math/big"
	"strings"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect"

	"kami/domain/group"
)

// LatePaymentPolicy says what happens to a payment for a CLOSED order.
type LatePaymentPolicy string

const (
	LateRefund  LatePaymentPolicy = "refund"  // always refund (the article's rule; default)
	LateDeliver LatePaymentPolicy = "deliver" // deliver if the order's own cards are still free
)

// Config holds the ledger's rules. Zero values take the defaults.
type Config struct {
	OrderTTL             time.Duration     // how long a PENDING order holds its cards; default 15m
	MaxQuantity          int               // cap on one order's quantity unless the product sets one; default 100
	LatePayment          LatePaymentPolicy // default LateRefund
	RefundBackoff        []time.Duration   // waits between refund attempts; default 1m,5m,30m,30m,30m
	MaxPendingPerContact int               // PENDING orders one contact may hold; 0: no cap
	MaxPendingPerAddress int               // PENDING orders one client address may hold; 0: no cap
	MaxLockedPerContact  int               // cards one contact may hold locked in PENDING orders; 0: no cap
	MaxLockedPerAddress  int               // cards one client address may hold locked in PENDING orders; 0: no cap
	// Mail: a paid order whose contact is an email address gets its codes
	// mailed (SMTP is configured; see mail.go). MailBackoff is the wait
	// before each retry of a mail not delivered; empty: DefaultMailBackoff.
	Mail        bool
	MailBackoff []time.Duration
}

// maxProductMaxPerOrder is the largest quantity a product may allow in
// one order.
const maxProductMaxPerOrder = 10_000

// DefaultRefundBackoff is KAMI_REFUND_BACKOFF's default.
var DefaultRefundBackoff = []time.Duration{time.Minute, 5 * time.Minute, 30 * time.Minute, 30 * time.Minute, 30 * time.Minute}

func (c Config) withDefaults() Config {
	if c.OrderTTL <= 0 {
		c.OrderTTL = 15 * time.Minute
	}
	if c.MaxQuantity <= 0 {
		c.MaxQuantity = 100
	}
	if c.LatePayment == "" {
		c.LatePayment = LateRefund
	}
	if c.RefundBackoff == nil {
		c.RefundBackoff = DefaultRefundBackoff
	}
	return c
}

// Alert is an event that needs a person: an inconsistency in the ledger, an
// amount that does not match, a refund that gave up.
type Alert struct {
	Kind    string // "inconsistency", "amount_mismatch", "refund_failed", ...
	Subject string // the order or refund number
	Message string
}

// Alerter receives alerts. It must not block the caller for long.
type Alerter interface {
	Alert(ctx context.Context, a Alert)
}

// LogAlerter logs alerts at error level; the default Alerter.
type LogAlerter struct{ Logger *slog.Logger }

func (l LogAlerter) Alert(ctx context.Context, a Alert) {
	lg := l.Logger
	if lg == nil {
		lg = slog.Default()
	}
	lg.ErrorContext(ctx, "alert", "kind", a.Kind, "subject", a.Subject, "message", a.Message)
}

// Ledger applies the state machines to the database.
type Ledger struct {
	db     *bun.DB
	sealer *Sealer
	cfg    Config
	alerts Alerter
	// Now is this process's clock; tests set it. It must return times the
	// database keeps exactly (see now()). It stamps what only this process
	// does; whether an order is due is judged by the database's clock.
	Now func() time.Time
	// DBClock stands for the database's clock in tests (a settable clock
	// shared by every ledger of the test); nil in production: the
	// database is asked (see DBNow).
	DBClock func() time.Time

	// clockOffset is the database's clock minus Now, in nanoseconds, as
	// SyncClock last measured it (see DBTime).
	clockOffset atomic.Int64

	placer *group.Batcher[PlaceOrderInput, *PlacedOrder] // group commit of PlaceOrder
	payer  *group.Batcher[Payment, *PaymentResult]       // group commit of RecordPayment
	places groupCounters
	pays   groupCounters
}

// groupCounters count one kind of shared transaction.
type groupCounters struct{ batches, calls, split atomic.Int64 }

func (c *groupCounters) stats() GroupStats {
	return GroupStats{Batches: c.batches.Load(), Calls: c.calls.Load(), Split: c.split.Load()}
}

// GroupStats count the shared transactions of one kind (see group.Batcher).
type GroupStats struct {
	Batches int64 // shared transactions tried
	Calls   int64 // calls they carried: Calls/Batches is the mean batch size
	// Split is how many shared transactions failed and were redone call by
	// call. A few are expected (a notification seen before, an order closed
	// meanwhile); a steady stream means the shared statement itself fails.
	Split int64
}

// PlaceStats counts the shared transactions of PlaceOrder.
func (l *Ledger) PlaceStats() GroupStats { return l.places.stats() }

// PayStats counts the shared transactions of RecordPayment's usual case.
func (l *Ledger) PayStats() GroupStats { return l.pays.stats() }

// NewLedger returns a Ledger over db (already migrated).
func NewLedger(db *bun.DB, sealer *Sealer, cfg Config, alerts Alerter) *Ledger {
	if alerts == nil {
		alerts = LogAlerter{}
	}
	l := &Ledger{db: db, sealer: sealer, cfg: cfg.withDefaults(), alerts: alerts, Now: time.Now}
	l.placer = &group.Batcher[PlaceOrderInput, *PlacedOrder]{MaxLeaders: groupLeaders, MaxBatch: maxGroup, MaxQueued: maxQueued, Run: l.placeBatch}
	// Payments are not bounded: each is money already taken, and a burst
	// of them (a gateway redelivering its backlog) is work the shop must
	// do, not a crowd it may turn away. A webhook whose request ends still
	// leaves the queue.
	l.payer = &group.Batcher[Payment, *PaymentResult]{MaxLeaders: groupLeaders, MaxBatch: maxGroup, Run: l.recordPayments}
	return l
}

// maxQueued bounds the placements waiting for a shared transaction:
// sixteen batches, a fraction of a second of work while the database
// keeps up (see groupLeaders). When it stalls, a call beyond that is
// refused at once (UNAVAILABLE, try again) instead of waiting behind work
// that cannot finish; a caller that gives up meanwhile leaves the queue.
const maxQueued = 16 * maxGroup

// groupErr turns a call the batcher refused into the error a client is
// shown.
func groupErr(err error) error {
	if errors.Is(err, group.ErrFull) {
		return Errorf(EUNAVAILABLE, "the shop is busy this moment; try again")
	}
	return err
}

// maxGroup bounds the calls one shared transaction carries: enough for a
// crowd of storefronts, small enough that it holds its locks for
// milliseconds.
const maxGroup = 64

// groupLeaders is how many shared transactions of one kind run at once:
// one. While it runs, the next batch gathers behind it, so the busier the
// shop the bigger the batch, and the database parses, plans and commits a
// handful of statements per batch instead of per order. More leaders make
// smaller batches and more transactions. Measured end to end with
// go run ./bench on the 2-core machine: 1 leader 2,740 orders/s, 2 leaders
// 2,112, 5 leaders (a quarter of the pool) 1,309.
const groupLeaders = 1

// DB returns the ledger's database, for read-only helpers and tests.
func (l *Ledger) DB() *bun.DB { return l.db }

// Config returns the rules in force.
func (l *Ledger) Config() Config { return l.cfg }

// Sealer returns the ledger's secret keeper.
func (l *Ledger) Sealer() *Sealer { return l.sealer }

// now is the clock in UTC, to the microsecond: every database kami supports
// keeps microseconds, so a time written is the time read back.
func (l *Ledger) now() time.Time { return l.Now().UTC().Truncate(time.Microsecond) }

// DBNow reads the database's clock. Every process shares that one clock,
// so whether an order is due, and when a new one expires, is judged the
// same way by all of them, however far a process's own clock is off.
func (l *Ledger) DBNow(ctx context.Context) (time.Time, error) { return l.dbNow(ctx, l.db) }

// dbNow reads the database's clock on db (a transaction's: PostgreSQL
// then gives the time the transaction began), in UTC to the microsecond.
// SQLite runs inside this process on this machine, whose system clock is
// the database's clock; it is read directly, not through Now.
func (l *Ledger) dbNow(ctx context.Context, db bun.IDB) (time.Time, error) {
	clock := l.clockSQL(db)
	if clock == "" {
		return l.localDBNow(), nil
	}
	var t time.Time
	if err := db.QueryRowContext(ctx, "SELECT "+clock).Scan(&t); err != nil {
		return time.Time{}, fmt.Errorf("read the database's clock: %w", err)
	}
	return t.UTC().Truncate(time.Microsecond), nil
}

// clockSQL is the database's clock as dbNow reads it, an SQL expression
// another query of the transaction can read it with; "" where it is read
// in this process (SQLite, or a test's DBClock): see localDBNow.
func (l *Ledger) clockSQL(db bun.IDB) string {
	if l.DBClock != nil {
		return ""
	}
	switch dialectName(db) {
	case dialect.PG:
		return "CURRENT_TIMESTAMP"
	case dialect.MySQL:
		return "UTC_TIMESTAMP(6)"
	}
	return ""
}

// localDBNow is the database's clock where clockSQL has no expression.
func (l *Ledger) localDBNow() time.Time {
	if l.DBClock != nil {
		return l.DBClock().UTC().Truncate(time.Microsecond)
	}
	return time.Now().UTC().Truncate(time.Microsecond)
}

// clockSamples is how many times SyncClock reads the database's clock.
const clockSamples = 3

// SyncClock measures how far the database's clock is from Now, for
// DBTime. The close workers call it at start and at every lease recovery.
// It reads the database's clock clockSamples times and keeps the read
// with the shortest round trip, and it takes that read to have been made
// at the round trip's end: DBTime is then never ahead of the database's
// clock, only behind it by at most that round trip. Taken at the middle
// (as before), a round trip stretched on the way out (this process
// descheduled on a busy machine between reading its clock and sending)
// put DBTime ahead by half of it until the next sync, and the queues
// claimed orders before the database held them due: each one a NOT_DUE
// close, rescheduled, and counted against the close success rate.
func (l *Ledger) SyncClock(ctx context.Context) error {
	best := time.Duration(-1)
	var offset time.Duration
	for range clockSamples {
		before := l.Now()
		db, err := l.DBNow(ctx)
		after := l.Now()
		if err != nil {
			return err
		}
		if rtt := after.Sub(before); best < 0 || rtt < best {
			best, offset = rtt, db.Sub(after)
		}
	}
	l.clockOffset.Store(int64(offset))
	return nil
}

// DBTime is the database's clock as this process knows it without asking:
// Now corrected by the offset SyncClock last measured (behind by at most
// a round trip, never ahead, give or take the drift since). The queues
// judge due times and leases by it, so a process with a fast clock
// neither claims early nor takes over another's lease.
func (l *Ledger) DBTime() time.Time {
	return l.now().Add(time.Duration(l.clockOffset.Load())).Truncate(time.Microsecond)
}

// newOrderNo returns a 20-digit order number: the UTC time to the second,
// then 8 random digits. Sortable by time, unguessable within a second, and
// short enough for every gateway's out_trade_no.
func newOrderNo(now time.Time) string {
	n, _ := rand.Int(rand.Reader, big.NewInt(100_000_000))
	return fmt.Sprintf("%s%08d", now.UTC().Format("060102150405"), n.Int64())
}

// --- products -------------------------------------------------------------

// ProductInput creates or updates a product. Nil fields of an update stay.
type ProductInput struct {
	Name        *string
	Description *string
	PriceFen    *int64
	Active      *bool
	MaxPerOrder *int
	// The code format rule: a pattern ("" removes it) and a length range
	// (0: no bound). See CodeRule.
	CodePattern *string
	CodeMinLen  *int
	CodeMaxLen  *int
	// LowStockThreshold alerts when sellable cards fall to it; 0: never.
	LowStockThreshold *int
}

// MaxLowStockThreshold bounds a product's low-stock threshold, and with it
// the index entries a low-stock check reads.
const MaxLowStockThreshold = 100_000

func (in ProductInput) validate(create bool) error {
	if create && (in.Name == nil || in.PriceFen == nil) {
		return Errorf(EBADINPUT, "a product needs a name and a price")
	}
	if in.Name != nil && (strings.TrimSpace(*in.Name) == "" || utf8.RuneCountInString(*in.Name) > 200) {
		return Errorf(EBADINPUT, "name must be 1 to 200 characters")
	}
	if in.Description != nil && len(*in.Description) > 10_000 {
		return Errorf(EBADINPUT, "description is longer than 10000 bytes")
	}
	if in.PriceFen != nil && (*in.PriceFen <= 0 || *in.PriceFen > 100_000_000_00) {
		return Errorf(EBADINPUT, "price must be above 0.00 and at most 100000000.00")
	}
	if in.MaxPerOrder != nil && (*in.MaxPerOrder < 0 || *in.MaxPerOrder > maxProductMaxPerOrder) {
		return Errorf(EBADINPUT, "maxPerOrder must be 0 (the shop default) to %d", maxProductMaxPerOrder)
	}
	if in.LowStockThreshold != nil && (*in.LowStockThreshold < 0 || *in.LowStockThreshold > MaxLowStockThreshold) {
		return Errorf(EBADINPUT, "lowStockThreshold must be 0 (no alert) to %d", MaxLowStockThreshold)
	}
	return nil
}

// apply sets the fields in gives on p, then checks p's code rule as a
// whole (a new minimum against the maximum it keeps, say).
func (in ProductInput) apply(p *Product) error {
	if in.Name != nil {
		p.Name = strings.TrimSpace(*in.Name)
	}
	if in.Description != nil {
		p.Description = *in.Description
	}
	if in.PriceFen != nil {
		p.PriceFen = *in.PriceFen
	}
	if in.Active != nil {
		p.Active = *in.Active
	}
	if in.MaxPerOrder != nil {
		p.MaxPerOrder = *in.MaxPerOrder
	}
	if in.CodePattern != nil {
		p.CodeRule.Pattern = *in.CodePattern
	}
	if in.CodeMinLen != nil {
		p.CodeRule.MinLen = *in.CodeMinLen
	}
	if in.CodeMaxLen != nil {
		p.CodeRule.MaxLen = *in.CodeMaxLen
	}
	if in.LowStockThreshold != nil {
		p.LowStockThreshold = *in.LowStockThreshold
	}
	return p.CodeRule.Validate()
}

// CreateProduct adds a product. BAD_INPUT for a missing name or price.
func (l *Ledger) CreateProduct(ctx context.Context, in ProductInput, actor string) (*Product, error) {
	if err := in.validate(true); err != nil {
		return nil, err
	}
	now := l.now()
	p := &Product{Active: true, CreatedAt: now, UpdatedAt: now}
	if err := in.apply(p); err != nil {
		return nil, err
	}
	// A new product has no cards: it is below its threshold, but its
	// stock did not fall there. The alert is armed by the first import.
	p.LowStockAlerted = p.LowStockThreshold > 0
	err := inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
		p.ID = 0
		if _, err := tx.NewInsert().Model(p).Exec(ctx); err != nil {
			return err
		}
		return audit(ctx, tx, now, actor, "product.create", fmt.Sprint(p.ID), p.Name)
	})
	if err != nil {
		return nil, err
	}
	return p, nil
}

// UpdateProduct changes a product. NOT_FOUND, BAD_INPUT.
func (l *Ledger) UpdateProduct(ctx context.Context, id int64, in ProductInput, actor string) (*Product, error) {
	if err := in.validate(false); err != nil {
		return nil, err
	}
	var p Product
	err := inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
		if err := forUpdate(tx.NewSelect().Model(&p).Where("id = ?", id)).Scan(ctx); err != nil {
			return notFound(err, "product %d not found", id)
		}
		if err := in.apply(&p); err != nil {
			return err
		}
		p.UpdatedAt = l.now()
		if _, err := tx.NewUpdate().Model(&p).WherePK().Exec(ctx); err != nil {
			return err
		}
		return audit(ctx, tx, p.UpdatedAt, actor, "product.update", fmt.Sprint(id), p.Name)
	})
	if err != nil {
		return nil, err
	}
	if in.LowStockThreshold != nil {
		// A new threshold may put the stock above or below it right now.
		if err := l.checkStock(ctx, id); err != nil {
			return nil, err
		}
		return l.Product(ctx, id)
	}
	return &p, nil
}

// Product returns one product. NOT_FOUND.
func (l *Ledger) Product(ctx context.Context, id int64) (*Product, error) {
	var p Product
	if err := l.db.NewSelect().Model(&p).Where("id = ?", id).Scan(ctx); err != nil {
		return nil, notFound(err, "product %d not found", id)
	}
	return &p, nil
}

// Products lists products by id; activeOnly hides the ones not on sale.
func (l *Ledger) Products(ctx context.Context, activeOnly bool) ([]Product, error) {
	var ps []Product
	q := l.db.NewSelect().Model(&ps).Order("id")
	if activeOnly {
		q = q.Where("active = ?", true)
	}
	if err := q.Scan(ctx); err != nil {
		return nil, err
	}
	return ps, nil
}

// StockCount is how many cards of a product are in each status.
type StockCount struct {
	ProductID int64
	Lockable  int // UNSOLD + RECYCLED: what can be sold now
	Locked    int
	Sold      int
	Withdrawn int // taken off sale by a recall
}

// StockCounts returns the card counts of the given products (all products
// when ids is empty) by status: a read of each of their cards (status is
// in no index of card_stock), for the admin's overview, the metrics and
// the audit. SellableCounts is the cheap count of what is for sale.
func (l *Ledger) StockCounts(ctx context.Context, ids ...int64) (map[int64]StockCount, error) {
	return stockCounts(ctx, l.db, ids...)
}

// SellableCounts returns how many cards of each given product (all
// products when ids is empty) are for sale: their rows of card_for_sale,
// read from its key alone. It is what the storefront shows and what the
// stock gate's counters are rebuilt from.
func (l *Ledger) SellableCounts(ctx context.Context, ids ...int64) (map[int64]int, error) {
	return sellableCounts(ctx, l.db, ids...)
}

func stockCounts(ctx context.Context, db bun.IDB, ids ...int64) (map[int64]StockCount, error) {
	var rows []struct {
		ProductID int64      `bun:"product_id"`
		Status    CardStatus `bun:"status"`
		N         int        `bun:"n"`
	}
	q := db.NewSelect().Table("card_stock").Column("product_id", "status").ColumnExpr("COUNT(*) AS n").Group("product_id", "status")
	if len(ids) > 0 {
		q = q.Where("product_id IN (?)", bun.List(ids))
	}
	if err := q.Scan(ctx, &rows); err != nil {
		return nil, err
	}
	out := make(map[int64]StockCount, len(ids))
	for _, id := range ids {
		out[id] = StockCount{ProductID: id}
	}
	for _, r := range rows {
		c := out[r.ProductID]
		c.ProductID = r.ProductID
		switch r.Status {
		case CardUnsold, CardRecycled:
			c.Lockable += r.N
		case CardLocked:
			c.Locked += r.N
		case CardSold:
			c.Sold += r.N
		case CardWithdrawn:
			c.Withdrawn += r.N
		}
		out[r.ProductID] = c
	}
	return out, nil
}

// --- cards ----------------------------------------------------------------

// Card code limits.
const (
	MaxCodeBytes    = 512
	MaxCodesPerCall = 10_000
)

// ImportResult reports an import of a list of codes.
type ImportResult struct {
	Imported   int
	Duplicates int // already in the product (or ever were), or twice in this call
	Batch      *Batch
}

// ImportCards seals codes and adds them to a product as UNSOLD, in a new
// batch, skipping the codes the product has or ever had. NOT_FOUND,
// BAD_INPUT (an empty, oversized or malformed code, one that breaks the
// product's format rule, too many codes): then nothing is imported.
// ImportFile is the same for a file, with refused lines reported instead.
func (l *Ledger) ImportCards(ctx context.Context, productID int64, codes []string, actor string) (ImportResult, error) {
	if len(codes) == 0 {
		return ImportResult{}, Errorf(EBADINPUT, "no codes given")
	}
	if len(codes) > MaxCodesPerCall {
		return ImportResult{}, Errorf(EBADINPUT, "at most %d codes per import", MaxCodesPerCall)
	}
	p, err := l.Product(ctx, productID)
	if err != nil {
		return ImportResult{}, err
	}
	rule, err := p.CodeRule.compile()
	if err != nil {
		return ImportResult{}, err
	}
	for i, raw := range codes {
		if !utf8.ValidString(raw) {
			return ImportResult{}, Errorf(EBADINPUT, "code #%d is not UTF-8", i+1)
		}
		if reason, msg := rule.check(strings.TrimSpace(raw)); reason != "" {
			return ImportResult{}, Errorf(EBADINPUT, "code #%d is refused (%s): %s", i+1, reason, msg)
		}
	}
	var res ImportResult
	err = l.importTx(ctx, productID, func(ctx context.Context, tx bun.Tx) error {
		b := &Batch{ProductID: productID, Source: BatchFromList}
		rep, err := l.importCodes(ctx, tx, b, rule, &sliceLines{codes: codes}, false, actor)
		if err != nil {
			return err
		}
		res = ImportResult{Imported: rep.Imported, Duplicates: rep.Duplicates, Batch: rep.Batch}
		return nil
	})
	if err != nil {
		return ImportResult{}, err
	}
	return res, nil
}

// --- helpers --------------------------------------------------------------

func writeFlow(ctx context.Context, tx bun.IDB, now time.Time, flows ...StockFlow) error {
	if len(flows) == 0 {
		return nil
	}
	_, err := flowInsert(tx, nil, now, flows).Exec(ctx)
	return err
}

// flowInsert is writeFlow's INSERT, built and not run (see writeAll).
func flowInsert(tx bun.IDB, b *binds, now time.Time, flows []StockFlow) writeQuery {
	for i := range flows {
		flows[i].CreatedAt = now
	}
	if (len(flows) > 1 || b != nil) && dialectName(tx) == dialect.PG {
		// A batch's entries as one array per column (see insertCards):
		// 500 rows of literals cost PostgreSQL more to plan than to insert.
		// RETURNING 1: a row per entry, as writeAll counts them.
		products, types, qtys := make([]int64, len(flows)), make([]int64, len(flows)), make([]int64, len(flows))
		orders := make([]string, len(flows))
		for i, f := range flows {
			products[i], orders[i], types[i], qtys[i] = f.ProductID, f.OrderNo, int64(f.ChangeType), int64(f.Quantity)
		}
		return tx.NewRaw(`INSERT INTO stock_flow (product_id, order_no, change_type, quantity, created_at)
			SELECT t.product_id, NULLIF(t.order_no, ''), t.change_type, t.quantity, ?
			FROM unnest(?::bigint[], ?::text[], ?::smallint[], ?::int[]) WITH ORDINALITY AS t(product_id, order_no, change_type, quantity, n) ORDER BY t.n
			RETURNING 1`,
			b.value(now), b.array(products), b.array(orders), b.array(types), b.array(qtys))
	}
	return tx.NewInsert().Model(&flows)
}

func audit(ctx context.Context, tx bun.IDB, now time.Time, actor, action, target, detail string) error {
	if actor == "" {
		actor = "system"
	}
	_, err := tx.NewInsert().Model(&AuditEntry{Actor: actor, Action: action, Target: target, Detail: detail, CreatedAt: now}).Exec(ctx)
	return err
}
