// Package domain is kami's ledger: products, cards, orders, refunds and the
// stock journal, and the services that move them through their state
// machines. Every other part of kami (GraphQL resolvers, webhooks, queue
// workers, commands) calls these services; none writes a status itself.
package domain

import (
	"context"
	"crypto/rand"
	"fmt"
	"log/slog"
	"math/big"
	"strings"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/uptrace/bun"

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
	// Now is the clock; tests set it. It must return times the database
	// keeps exactly (see now()).
	Now func() time.Time

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
	l.placer = &group.Batcher[PlaceOrderInput, *PlacedOrder]{MaxLeaders: groupLeaders, MaxBatch: maxGroup, Run: l.placeBatch}
	l.payer = &group.Batcher[Payment, *PaymentResult]{MaxLeaders: groupLeaders, MaxBatch: maxGroup, Run: l.recordPayments}
	return l
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
}

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
	return nil
}

// CreateProduct adds a product. BAD_INPUT for a missing name or price.
func (l *Ledger) CreateProduct(ctx context.Context, in ProductInput, actor string) (*Product, error) {
	if err := in.validate(true); err != nil {
		return nil, err
	}
	now := l.now()
	p := &Product{Name: strings.TrimSpace(*in.Name), PriceFen: *in.PriceFen, Active: true, CreatedAt: now, UpdatedAt: now}
	if in.Description != nil {
		p.Description = *in.Description
	}
	if in.Active != nil {
		p.Active = *in.Active
	}
	if in.MaxPerOrder != nil {
		p.MaxPerOrder = *in.MaxPerOrder
	}
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
		p.UpdatedAt = l.now()
		if _, err := tx.NewUpdate().Model(&p).WherePK().Exec(ctx); err != nil {
			return err
		}
		return audit(ctx, tx, p.UpdatedAt, actor, "product.update", fmt.Sprint(id), p.Name)
	})
	if err != nil {
		return nil, err
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
}

// StockCounts returns the card counts of the given products (all products
// when ids is empty), from the index on (product_id, status).
func (l *Ledger) StockCounts(ctx context.Context, ids ...int64) (map[int64]StockCount, error) {
	return stockCounts(ctx, l.db, ids...)
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

// ImportResult reports an import.
type ImportResult struct {
	Imported   int
	Duplicates int // already in the product, or twice in this call
}

// ImportCards seals codes and adds them to a product as UNSOLD, skipping the
// codes the product already has. NOT_FOUND, BAD_INPUT (empty or oversized
// code, too many codes): then nothing is imported.
func (l *Ledger) ImportCards(ctx context.Context, productID int64, codes []string, actor string) (ImportResult, error) {
	if len(codes) == 0 {
		return ImportResult{}, Errorf(EBADINPUT, "no codes given")
	}
	if len(codes) > MaxCodesPerCall {
		return ImportResult{}, Errorf(EBADINPUT, "at most %d codes per import", MaxCodesPerCall)
	}
	type item struct{ code, hash string }
	items := make([]item, 0, len(codes))
	seen := make(map[string]bool, len(codes))
	dups := 0
	for i, raw := range codes {
		code := strings.TrimSpace(raw)
		if code == "" {
			return ImportResult{}, Errorf(EBADINPUT, "code #%d is empty", i+1)
		}
		if len(code) > MaxCodeBytes {
			return ImportResult{}, Errorf(EBADINPUT, "code #%d is longer than %d bytes", i+1, MaxCodeBytes)
		}
		if !utf8.ValidString(code) || strings.ContainsFunc(code, func(r rune) bool { return r < 0x20 || r == 0x7f }) {
			return ImportResult{}, Errorf(EBADINPUT, "code #%d has control characters or is not UTF-8", i+1)
		}
		h := l.sealer.CodeHash(productID, code)
		if seen[h] {
			dups++
			continue
		}
		seen[h] = true
		items = append(items, item{code, h})
	}
	var res ImportResult
	err := inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
		res = ImportResult{Duplicates: dups}
		var p Product
		// Locking the product serialises imports into one product, so two
		// imports of the same code cannot both pass the duplicate check.
		if err := forUpdate(tx.NewSelect().Model(&p).Where("id = ?", productID)).Scan(ctx); err != nil {
			return notFound(err, "product %d not found", productID)
		}
		now := l.now()
		const chunk = 500
		for start := 0; start < len(items); start += chunk {
			part := items[start:min(start+chunk, len(items))]
			hashes := make([]string, len(part))
			for i, it := range part {
				hashes[i] = it.hash
			}
			var existing []string
			if err := tx.NewSelect().Table("card_stock").Column("code_hash").
				Where("product_id = ?", productID).Where("code_hash IN (?)", bun.List(hashes)).
				Scan(ctx, &existing); err != nil {
				return err
			}
			have := make(map[string]bool, len(existing))
			for _, h := range existing {
				have[h] = true
			}
			cards := make([]Card, 0, len(part))
			for _, it := range part {
				if have[it.hash] {
					res.Duplicates++
					continue
				}
				cards = append(cards, Card{ProductID: productID, CodeEnc: l.sealer.Seal(productID, it.code),
					CodeHash: it.hash, Status: CardUnsold, CreatedAt: now, UpdatedAt: now})
			}
			if len(cards) == 0 {
				continue
			}
			if _, err := tx.NewInsert().Model(&cards).Exec(ctx); err != nil {
				return err
			}
			res.Imported += len(cards)
		}
		if res.Imported > 0 {
			if err := writeFlow(ctx, tx, now, StockFlow{ProductID: productID, ChangeType: FlowImport, Quantity: res.Imported}); err != nil {
				return err
			}
		}
		return audit(ctx, tx, now, actor, "cards.import", fmt.Sprint(productID),
			fmt.Sprintf("imported=%d duplicates=%d", res.Imported, res.Duplicates))
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
	for i := range flows {
		flows[i].CreatedAt = now
	}
	_, err := tx.NewInsert().Model(&flows).Exec(ctx)
	return err
}

func audit(ctx context.Context, tx bun.IDB, now time.Time, actor, action, target, detail string) error {
	if actor == "" {
		actor = "system"
	}
	_, err := tx.NewInsert().Model(&AuditEntry{Actor: actor, Action: action, Target: target, Detail: detail, CreatedAt: now}).Exec(ctx)
	return err
}
