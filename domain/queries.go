package domain

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/uptrace/bun"
)

// Read-only queries for the admin lists and the GraphQL dataloaders. Each
// list is a keyset page whose order matches an index, so a page costs the
// same however deep it is; each batch loader is one query for any number
// of keys.

// MaxPageSize caps every list page.
const MaxPageSize = 100

// Keyset is a position in a list ordered by (At, ID) descending: the last
// row of one page, from which the next page starts. The zero Keyset is the
// start of the list.
type Keyset struct {
	At time.Time
	ID int64
}

// IsZero reports whether k is the start of a list.
func (k Keyset) IsZero() bool { return k.ID == 0 && k.At.IsZero() }

// OrderFilter selects orders for the admin list. Zero fields select all.
type OrderFilter struct {
	Status    OrderStatus
	ProductID int64
	Contact   string
	// CreatedFrom and CreatedBefore bound created_at to [from, before).
	CreatedFrom   time.Time
	CreatedBefore time.Time
}

// OrderPage is one page of orders, newest first.
type OrderPage struct {
	Orders  []Order
	HasNext bool
}

func clampLimit(limit int) (int, error) {
	if limit < 0 {
		return 0, Errorf(EBADINPUT, "first must not be negative")
	}
	if limit == 0 || limit > MaxPageSize {
		return 0, Errorf(EBADINPUT, "first must be 1 to %d", MaxPageSize)
	}
	return limit, nil
}

// idPage reads one page of q's model, newest first by id, after the row
// afterID (0: from the newest), into rows: at most limit rows, and whether
// there are more. The scan is the caller's index, then the primary key.
func idPage[T any](ctx context.Context, q *bun.SelectQuery, rows *[]T, afterID int64, limit int) (bool, error) {
	if afterID > 0 {
		q = q.Where("?TableAlias.id < ?", afterID)
	}
	if err := q.OrderExpr("?TableAlias.id DESC").Limit(int64(limit + 1)).Scan(ctx); err != nil {
		return false, err
	}
	if len(*rows) > limit {
		*rows = (*rows)[:limit]
		return true, nil
	}
	return false, nil
}

// afterKeyset continues a (created_at DESC, id DESC) list after k.
func afterKeyset(q *bun.SelectQuery, k Keyset) *bun.SelectQuery {
	if k.IsZero() {
		return q
	}
	at := k.At.UTC()
	return q.Where("(created_at < ? OR (created_at = ? AND id < ?))", at, at, k.ID)
}

// ListOrders pages through orders newest first by (created_at, id). The
// filters by product and by contact are served by an index that starts
// with its column: (product_id, created_at), (contact, created_at). The
// status is in no index of orders (so that a payment or close rewrites its
// order in place, see PendingOrder): PENDING is read through
// pending_order; another status alone reads the newest orders first and
// keeps those in it, which finds the PAID and CLOSED ones at once and
// reads further for a rare status (REFUNDING).
// BAD_INPUT for a page size outside 1..MaxPageSize or an unknown status.
func (l *Ledger) ListOrders(ctx context.Context, f OrderFilter, after Keyset, limit int) (*OrderPage, error) {
	limit, err := clampLimit(limit)
	if err != nil {
		return nil, err
	}
	if f.Status != "" && !slices.Contains(OrderStatuses, f.Status) {
		return nil, Errorf(EBADINPUT, "unknown order status %q", f.Status)
	}
	var os []Order
	q := l.db.NewSelect().Model(&os)
	if f.Status != "" {
		q = q.Where("status = ?", f.Status)
	}
	if f.Status == OrderPending {
		// pending_order holds them, a few hundred in a busy shop: read
		// through it, not through every order newest first, which reads
		// the whole table when there are fewer than a page of them.
		q = q.Where("order_no IN (SELECT order_no FROM pending_order)")
	}
	if f.ProductID != 0 {
		q = q.Where("product_id = ?", f.ProductID)
	}
	if f.Contact != "" {
		q = q.Where("contact = ?", NormalizeContact(f.Contact)) // as stored
	}
	if !f.CreatedFrom.IsZero() {
		q = q.Where("created_at >= ?", f.CreatedFrom.UTC())
	}
	if !f.CreatedBefore.IsZero() {
		q = q.Where("created_at < ?", f.CreatedBefore.UTC())
	}
	q = afterKeyset(q, after).OrderExpr("created_at DESC, id DESC").Limit(int64(limit + 1))
	if err := q.Scan(ctx); err != nil {
		return nil, err
	}
	page := &OrderPage{Orders: os}
	if len(os) > limit {
		page.Orders, page.HasNext = os[:limit], true
	}
	return page, nil
}

// CardPage is one page of cards, newest first.
type CardPage struct {
	Cards   []Card
	HasNext bool
}

// CardFilter selects cards for the admin list. Zero fields select all.
type CardFilter struct {
	ProductID int64
	BatchID   int64
	Status    CardStatus
}

// ListCards pages through cards by id descending, after the card with id
// afterID (0: from the newest). With a product the (product_id, status,
// id) index serves the scan, with a batch the (batch_id, status, id) one.
// BAD_INPUT for a bad page size or status.
func (l *Ledger) ListCards(ctx context.Context, f CardFilter, afterID int64, limit int) (*CardPage, error) {
	limit, err := clampLimit(limit)
	if err != nil {
		return nil, err
	}
	if f.Status != "" && !slices.Contains(CardStatuses, f.Status) {
		return nil, Errorf(EBADINPUT, "unknown card status %q", f.Status)
	}
	var cs []Card
	q := l.db.NewSelect().Model(&cs)
	if f.ProductID != 0 {
		q = q.Where("product_id = ?", f.ProductID)
	}
	if f.BatchID != 0 {
		q = q.Where("batch_id = ?", f.BatchID)
	}
	if f.Status != "" {
		q = q.Where("status = ?", f.Status)
	}
	hasNext, err := idPage(ctx, q, &cs, afterID, limit)
	if err != nil {
		return nil, err
	}
	return &CardPage{Cards: cs, HasNext: hasNext}, nil
}

// CardCode opens a card's code. Callers must have checked the caller is an
// admin.
func (l *Ledger) CardCode(c *Card) (string, error) {
	code, err := l.sealer.Open(c.ProductID, c.CodeEnc)
	if err != nil {
		return "", fmt.Errorf("card %d: %w", c.ID, err)
	}
	return code, nil
}

// RefundPage is one page of refunds, newest first.
type RefundPage struct {
	Refunds []Refund
	HasNext bool
}

// ListRefunds pages through refunds newest first by (created_at, id); a
// status filter is served by the (status, created_at) index. BAD_INPUT for a
// bad page size or status.
func (l *Ledger) ListRefunds(ctx context.Context, status RefundStatus, after Keyset, limit int) (*RefundPage, error) {
	limit, err := clampLimit(limit)
	if err != nil {
		return nil, err
	}
	if status != "" && !slices.Contains(RefundStatuses, status) {
		return nil, Errorf(EBADINPUT, "unknown refund status %q", status)
	}
	var rs []Refund
	q := l.db.NewSelect().Model(&rs)
	if status != "" {
		q = q.Where("status = ?", status)
	}
	q = afterKeyset(q, after).OrderExpr("created_at DESC, id DESC").Limit(int64(limit + 1))
	if err := q.Scan(ctx); err != nil {
		return nil, err
	}
	page := &RefundPage{Refunds: rs}
	if len(rs) > limit {
		page.Refunds, page.HasNext = rs[:limit], true
	}
	return page, nil
}

// --- batch loaders ----------------------------------------------------------

// ProductsByID returns the products with the given ids in one query; ids
// with no product are missing from the map.
func (l *Ledger) ProductsByID(ctx context.Context, ids []int64) (map[int64]*Product, error) {
	return productsByID(ctx, l.db, ids)
}

// productsByID is ProductsByID on db, also a transaction.
func productsByID(ctx context.Context, db bun.IDB, ids []int64) (map[int64]*Product, error) {
	out := make(map[int64]*Product, len(ids))
	if len(ids) == 0 {
		return out, nil
	}
	var ps []Product
	if err := db.NewSelect().Model(&ps).Where("id IN (?)", bun.List(ids)).Scan(ctx); err != nil {
		return nil, err
	}
	for i := range ps {
		out[ps[i].ID] = &ps[i]
	}
	return out, nil
}

// productsNow is productsByID, and the database's clock as dbNow reads it
// in the same query: one round trip fewer for a batch of orders, which
// needs both. now is zero when no product was found.
func (l *Ledger) productsNow(ctx context.Context, db bun.IDB, ids []int64) (map[int64]*Product, time.Time, error) {
	clock := l.clockSQL(db)
	if clock == "" || len(ids) == 0 {
		ps, err := productsByID(ctx, db, ids)
		return ps, l.localDBNow(), err
	}
	var rows []struct {
		Product `bun:",extend"`
		DBNow   time.Time `bun:"kami_db_now"`
	}
	if err := db.NewSelect().Model(&rows).ColumnExpr("?TableAlias.*").ColumnExpr(clock+" AS kami_db_now").
		Where("?TableAlias.id IN (?)", bun.List(ids)).Scan(ctx); err != nil {
		return nil, time.Time{}, err
	}
	out := make(map[int64]*Product, len(rows))
	var now time.Time
	for i := range rows {
		out[rows[i].ID] = &rows[i].Product
		now = rows[i].DBNow.UTC().Truncate(time.Microsecond)
	}
	return out, now, nil
}

// OrdersByNo returns the orders with the given numbers in one query;
// numbers with no order are missing from the map.
func (l *Ledger) OrdersByNo(ctx context.Context, orderNos []string) (map[string]*Order, error) {
	out := make(map[string]*Order, len(orderNos))
	if len(orderNos) == 0 {
		return out, nil
	}
	var os []Order
	if err := l.db.NewSelect().Model(&os).Where("order_no IN (?)", bun.List(orderNos)).Scan(ctx); err != nil {
		return nil, err
	}
	for i := range os {
		out[os[i].OrderNo] = &os[i]
	}
	return out, nil
}

// OrderStatuses returns the status of each of the given orders in one
// query (order subscriptions catching up after their event stream broke);
// numbers with no order are missing from the map.
func (l *Ledger) OrderStatuses(ctx context.Context, orderNos []string) (map[string]OrderStatus, error) {
	out := make(map[string]OrderStatus, len(orderNos))
	if len(orderNos) == 0 {
		return out, nil
	}
	var rows []struct {
		OrderNo string      `bun:"order_no"`
		Status  OrderStatus `bun:"status"`
	}
	if err := l.db.NewSelect().Table("orders").Column("order_no", "status").
		Where("order_no IN (?)", bun.List(orderNos)).Scan(ctx, &rows); err != nil {
		return nil, err
	}
	for _, r := range rows {
		out[r.OrderNo] = r.Status
	}
	return out, nil
}

// SoldCodes returns the codes of the SOLD cards of the given orders, opened,
// in card order, in one query (the (order_no, status) index). An order that
// sold nothing is missing from the map. Callers must have checked, for each
// order, that the caller is its buyer or an admin and that it was delivered.
func (l *Ledger) SoldCodes(ctx context.Context, orderNos []string) (map[string][]string, error) {
	out := make(map[string][]string, len(orderNos))
	if len(orderNos) == 0 {
		return out, nil
	}
	var cards []Card
	if err := l.db.NewSelect().Model(&cards).Column("id", "product_id", "order_no", "code_enc").
		Where("order_no IN (?)", bun.List(orderNos)).Where("status = ?", CardSold).
		Order("id").Scan(ctx); err != nil {
		return nil, err
	}
	for i := range cards {
		code, err := l.CardCode(&cards[i])
		if err != nil {
			return nil, err
		}
		out[cards[i].OrderNo] = append(out[cards[i].OrderNo], code)
	}
	return out, nil
}
