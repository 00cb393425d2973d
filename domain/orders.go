package domain

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect"
)

// notFound turns sql.ErrNoRows into NOT_FOUND and passes other errors on.
func notFound(err error, format string, args ...any) error {
	if errors.Is(err, sql.ErrNoRows) {
		return Errorf(ENOTFOUND, format, args...)
	}
	return err
}

// PlaceOrderInput is a buyer's order.
type PlaceOrderInput struct {
	ProductID      int64
	Quantity       int
	Contact        string // how the buyer is reached (email, phone, QQ); also the anti-hoarding key (see NormalizeContact)
	Provider       string // payment provider name, checked by the caller against the registry
	IdempotencyKey string // optional; the same key from the same client address returns the same order
	ClientAddr     string // the buyer's address, for the per-address caps (see AddressKey)

	// normalized is set once normalize has checked the input and put it
	// in the form the ledger stores (the idempotency key bound to
	// ClientAddr), so that normalizing again (the shop, then the ledger)
	// leaves it as it is and costs nothing.
	normalized bool
}

// Limits on order input.
const (
	MaxContactLen        = 128
	MaxIdempotencyKeyLen = 64
)

// normalize checks the input and puts it in the form the ledger stores and
// counts: the contact normalized, the client address as the caps count it,
// the idempotency key bound to that address. Normalizing twice is the same
// as once.
func (in *PlaceOrderInput) normalize() error {
	if in.normalized {
		return nil
	}
	for _, f := range []struct{ name, value string }{
		{"contact", in.Contact}, {"provider", in.Provider}, {"idempotencyKey", in.IdempotencyKey},
	} {
		if err := checkBuyerText(f.name, f.value); err != nil {
			return err
		}
	}
	in.IdempotencyKey = strings.TrimSpace(in.IdempotencyKey)
	switch {
	case in.ProductID <= 0:
		return Errorf(EBADINPUT, "productId must be a product's id")
	case in.Quantity <= 0:
		return Errorf(EBADINPUT, "quantity must be at least 1")
	case len(in.Contact) > 4*MaxContactLen:
		return Errorf(EBADINPUT, "contact must be 1 to %d characters", MaxContactLen)
	case in.Provider == "" || len(in.Provider) > 16:
		return Errorf(EBADINPUT, "provider is required")
	case len(in.IdempotencyKey) > MaxIdempotencyKeyLen:
		return Errorf(EBADINPUT, "idempotencyKey is longer than %d characters", MaxIdempotencyKeyLen)
	}
	in.Contact = NormalizeContact(in.Contact)
	if in.Contact == "" || utf8.RuneCountInString(in.Contact) > MaxContactLen || len(in.Contact) > 4*MaxContactLen {
		return Errorf(EBADINPUT, "contact must be 1 to %d characters", MaxContactLen)
	}
	in.ClientAddr = AddressKey(in.ClientAddr)
	if in.IdempotencyKey != "" {
		in.IdempotencyKey = scopedIdempotencyKey(in.ClientAddr, in.IdempotencyKey)
	}
	in.normalized = true
	return nil
}

// checkBuyerText refuses a string a buyer sends into an order (contact,
// provider, idempotency key, payment method) that is not valid UTF-8 or
// holds a control character other than white space (which normalization
// trims or removes). Such a string is never a real contact or key, and
// PostgreSQL refuses NUL and invalid UTF-8 outright: let through, it
// would fail the shared INSERT of every batch it joined and split each
// into one transaction per order. The value is not echoed.
func checkBuyerText(field, s string) error {
	if !utf8.ValidString(s) {
		return Errorf(EBADINPUT, "%s is not valid UTF-8 text", field)
	}
	if strings.ContainsFunc(s, func(r rune) bool { return unicode.IsControl(r) && !unicode.IsSpace(r) }) {
		return Errorf(EBADINPUT, "%s must not contain control characters", field)
	}
	return nil
}

// PlacedOrder is what a buyer gets back from PlaceOrder.
type PlacedOrder struct {
	Order       *Order
	Product     *Product // the product as the order was priced
	AccessToken string
	// Replayed is true when the idempotency key matched an existing order:
	// nothing new was locked.
	Replayed bool
	cardIDs  []int64 // the cards the placing transaction locked (not for a replay)
}

// PlaceOrder creates a PENDING order holding Quantity lockable cards until
// ExpiresAt, in one transaction with its stock journal entry.
// BAD_INPUT, NOT_FOUND (no such product on sale), SOLD_OUT, LIMIT_EXCEEDED,
// CONFLICT (an idempotency key reused for a different order).
//
// Orders placed at the same moment share that transaction (see group.Batcher):
// each is decided on its own, and one refused order never fails another.
func (l *Ledger) PlaceOrder(ctx context.Context, in PlaceOrderInput) (*PlacedOrder, error) {
	if err := in.normalize(); err != nil {
		return nil, err
	}
	// A reused idempotency key is answered inside the batch (replayBatch).
	placed, err := l.placer.Do(ctx, in)
	return placed, groupErr(err)
}

// placeBatch places a batch of normalized orders in one transaction. Should
// the transaction itself fail (not one order refused: the statement), each
// order is placed again in a transaction of its own, so that whatever
// caused it fails only its own order.
//
// A COMMIT whose answer was lost (the connection reset after it was sent,
// the batch's time ran out while it was under way) may or may not have
// been applied. Placing again blind would leave the first orders, if they
// were written, PENDING with their cards and nobody to pay them. So the
// batch's order numbers are looked up first, as payments are (see
// recordPayments): what was written is the answer; only a batch that was
// not written is placed again (a lone order once more).
func (l *Ledger) placeBatch(ctx context.Context, ins []PlaceOrderInput) ([]*PlacedOrder, []error) {
	return l.placeTx(ctx, ins, true)
}

// placeTx is placeBatch; a lone order whose COMMIT was not applied is
// placed once more if again is set.
func (l *Ledger) placeTx(ctx context.Context, ins []PlaceOrderInput, again bool) ([]*PlacedOrder, []error) {
	var (
		placed    []*PlacedOrder
		errs      []error
		committed bool // the last attempt got as far as its COMMIT
	)
	l.places.batches.Add(1)
	l.places.calls.Add(int64(len(ins)))
	err := inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
		var err error
		placed, errs, err = l.placeOrders(ctx, tx, ins)
		committed = err == nil
		return err
	})
	if err == nil {
		return placed, errs
	}
	if committed {
		if answered, ok := l.afterUncertainCommit(ctx, placed, errs, err); ok {
			return answered, errs
		}
		// Not written: as if the transaction had failed before its COMMIT.
	}
	placed, errs = make([]*PlacedOrder, len(ins)), make([]error, len(ins))
	if ctx.Err() == nil && (len(ins) > 1 || committed && again) {
		if len(ins) > 1 {
			l.places.split.Add(1)
		}
		for i := range ins {
			one, oneErr := l.placeTx(ctx, ins[i:i+1], false)
			placed[i], errs[i] = one[0], oneErr[0]
		}
		return placed, errs
	}
	// Out of time (or a batch of one): every caller of the batch gets the
	// error, so each gives back what it took for the order.
	for i := range errs {
		errs[i] = err
	}
	if len(ins) == 1 && ins[0].IdempotencyKey != "" && isUniqueViolation(err) {
		// Another request with the same key won the race; its order is
		// this request's answer.
		if again, rerr := l.replay(ctx, ins[0]); again != nil || rerr != nil {
			placed[0], errs[0] = again, rerr
		}
	}
	return placed, errs
}

// uncertainLookupTimeout bounds the look-up after an unanswered COMMIT; it
// runs even when the batch's own time is up.
const uncertainLookupTimeout = 10 * time.Second

// afterUncertainCommit finds out whether a batch whose COMMIT failed with
// commitErr was written after all, by its order numbers. Written (any of
// them: a transaction commits whole): the batch's decisions stand, each
// placed order answered with its row as the database has it, and ok.
// Not written: not ok, and the caller places the batch again. Unknown
// (the look-up failed too): every call gets UNAVAILABLE and ok, since
// placing again might place twice; an order that was written after all is
// PENDING like any unpaid one, and its close comes (the sweeper schedules
// a PENDING order missing from the close queue).
func (l *Ledger) afterUncertainCommit(ctx context.Context, placed []*PlacedOrder, errs []error, commitErr error) ([]*PlacedOrder, bool) {
	var (
		nos     []string
		cardIDs []int64
	)
	for _, p := range placed {
		if p != nil && !p.Replayed {
			nos = append(nos, p.Order.OrderNo)
			cardIDs = append(cardIDs, p.cardIDs...)
		}
	}
	if len(nos) == 0 {
		return nil, false // nothing was to be written: placing again is harmless
	}
	lookCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), uncertainLookupTimeout)
	defer cancel()
	written, err := l.afterTx(lookCtx, cardIDs, nos)
	if err != nil {
		l.alerts.Alert(ctx, Alert{Kind: "uncertain_commit", Subject: nos[0],
			Message: fmt.Sprintf("a batch of %d orders may or may not have been placed (commit: %v; look-up: %v); a written one closes unpaid", len(nos), commitErr, err)})
		for i := range errs {
			placed[i], errs[i] = nil, Errorf(EUNAVAILABLE, "the order could not be confirmed; try again")
		}
		return placed, true
	}
	if len(written) == 0 {
		return nil, false
	}
	for i, p := range placed {
		if p == nil || p.Replayed {
			continue
		}
		o, ok := written[p.Order.OrderNo]
		if !ok || !o.CreatedAt.Equal(p.Order.CreatedAt) || o.Contact != p.Order.Contact {
			// Not ours after all (cannot be, a transaction commits whole).
			placed[i], errs[i] = nil, Errorf(EINTERNAL, "the order could not be confirmed; try again")
			continue
		}
		p.Order = o
	}
	return placed, true
}

// afterTx reads the orders nos once the transaction that placed them,
// having locked cardIDs, has ended. The server may still be finishing its
// COMMIT (a slow disk), or not have read it yet (the connection reset on
// the way): read at once, the orders would not be there yet and the batch
// would be placed twice. A locking read of the cards that transaction
// updated waits for it to commit or roll back, on PostgreSQL and
// MySQL/MariaDB alike (the new order rows would not do: PostgreSQL's
// locking read skips rows it cannot see, and an uncommitted insert is
// one). ctx bounds the wait: a server that never ends the transaction
// makes it an error, the unknown answer. SQLite needs no wait: its one
// connection is the batch's, and free again only once its COMMIT is done.
func (l *Ledger) afterTx(ctx context.Context, cardIDs []int64, nos []string) (map[string]*Order, error) {
	if shareLock(l.db) != "" {
		var ids []int64
		if err := shareLockIDs(l.db, tableCards, cardIDs, "id").Scan(ctx, &ids); err != nil {
			return nil, err
		}
	}
	return l.OrdersByNo(ctx, nos)
}

// placeOrders decides every order of a batch with a fixed number of
// statements, whatever the batch's size: read the idempotency keys, the
// products and the buyers' unpaid orders; lock cards (their rows of
// card_for_sale) product by product with SKIP LOCKED; then insert the
// orders, mark their cards, write the journal and delete the used cards'
// rows, each in one statement. An order refused for its own reasons gets
// its error in errs; the returned error is the transaction's.
func (l *Ledger) placeOrders(ctx context.Context, tx bun.Tx, ins []PlaceOrderInput) ([]*PlacedOrder, []error, error) {
	placed, errs := make([]*PlacedOrder, len(ins)), make([]error, len(ins))
	// follows[i] = j: order i has the same new idempotency key as order j,
	// ahead of it in the batch. It is not placed; j's outcome answers it,
	// as a replay would (one key, one order).
	follows := map[int]int{}
	open := func(yield func(int, PlaceOrderInput) bool) { // the orders not yet decided
		for i, in := range ins {
			if _, f := follows[i]; placed[i] == nil && errs[i] == nil && !f && !yield(i, in) {
				return
			}
		}
	}
	done := func() ([]*PlacedOrder, []error, error) {
		for i, j := range follows {
			if placed[j] != nil {
				placed[i], errs[i] = l.replayed(ins[i], *placed[j].Order)
			} else {
				errs[i] = errs[j]
			}
		}
		return placed, errs, nil
	}

	if err := l.replayBatch(ctx, tx, ins, placed, errs); err != nil {
		return nil, nil, err
	}
	first := map[string]int{}
	for i, in := range open {
		if in.IdempotencyKey == "" {
			continue
		}
		if j, ok := first[in.IdempotencyKey]; ok {
			follows[i] = j
		} else {
			first[in.IdempotencyKey] = i
		}
	}

	productIDs := map[int64]bool{}
	for _, in := range ins {
		productIDs[in.ProductID] = true
	}
	// The database's clock comes with the products: an order expires by
	// the clock every process judges due times by, not by this process's.
	products, now, err := l.productsNow(ctx, tx, sortedKeys(productIDs))
	if err != nil {
		return nil, nil, err
	}
	for i, in := range open {
		p, ok := products[in.ProductID]
		switch {
		case !ok:
			errs[i] = Errorf(ENOTFOUND, "product %d not found", in.ProductID)
		case !p.Active:
			errs[i] = Errorf(ENOTFOUND, "product %d is not on sale", in.ProductID)
		case in.Quantity > l.maxQuantity(p):
			errs[i] = Errorf(EBADINPUT, "quantity must be at most %d", l.maxQuantity(p))
		}
	}

	if err := l.checkPendingCaps(ctx, tx, ins, open, errs); err != nil {
		return nil, nil, err
	}

	// Cards, product by product in id order, first come first served
	// within the batch.
	want := map[int64]int{}
	for _, in := range open {
		want[in.ProductID] += in.Quantity
	}
	cards := map[int][]int64{}
	var offSale []writeQuery // the rows of card_for_sale of the cards used, deleted with the writes
	for _, productID := range sortedKeys(want) {
		free, err := pickCards(ctx, tx, productID, want[productID])
		if err != nil {
			return nil, nil, err
		}
		var used []int64
		for i, in := range open {
			if in.ProductID != productID {
				continue
			}
			if len(free) < in.Quantity {
				errs[i] = Errorf(ESOLDOUT, "product %d has fewer than %d cards left", productID, in.Quantity)
				continue
			}
			cards[i], free = free[:in.Quantity], free[in.Quantity:]
			used = append(used, cards[i]...)
		}
		// Cards picked and left over (an order wanted more than were
		// left) keep their rows: still for sale.
		if len(used) > 0 {
			offSale = append(offSale, takeOffSale(tx, productID, used))
		}
	}
	if len(cards) == 0 {
		return done()
	}

	var (
		orders  = make([]Order, 0, len(cards))
		flows   = make([]StockFlow, 0, len(cards))
		cardIDs []int64
		orderOf = make([]any, 0, 2*len(cards)) // CASE arms: card ids, then their order number
		tokens  = make([]string, 0, len(cards))
		numbers = make(map[string]bool, len(cards))
		hasKey  bool
	)
	for i, in := range open {
		ids := cards[i]
		p := products[in.ProductID]
		no := newOrderNo(now)
		for numbers[no] {
			no = newOrderNo(now)
		}
		numbers[no] = true
		hasKey = hasKey || in.IdempotencyKey != ""
		token := l.sealer.AccessToken(no)
		tokens = append(tokens, token)
		orders = append(orders, Order{
			OrderNo: no, ProductID: p.ID, Quantity: in.Quantity,
			UnitPriceFen: p.PriceFen, AmountFen: p.PriceFen * int64(in.Quantity),
			Contact: in.Contact, ClientAddr: in.ClientAddr, Provider: in.Provider,
			Status: OrderPending, IdempotencyKey: in.IdempotencyKey,
			ExpiresAt: now.Add(l.cfg.OrderTTL), CreatedAt: now, UpdatedAt: now,
			AccessTokenHash: HashToken(token),
		})
		flows = append(flows, StockFlow{ProductID: p.ID, OrderNo: no, ChangeType: FlowLock, Quantity: in.Quantity})
		cardIDs = append(cardIDs, ids...)
		orderOf = append(orderOf, bun.List(ids), no)
	}
	// One round trip on PostgreSQL (writeAll).
	caseOrderNo := "order_no = CASE" + strings.Repeat(" WHEN id IN (?) THEN ?", len(orders)) + " END"
	pending := make([]PendingOrder, len(orders))
	for i := range orders {
		pending[i] = pendingOrderOf(&orders[i])
	}
	n, err := writeAll(ctx, tx, append([]writeQuery{
		tx.NewInsert().Model(&orders),
		transition(tx, CardLock, now, whereIDs(cardIDs), []column{col(caseOrderNo, orderOf...), col("locked_at = ?", now)}),
		flowInsert(tx, nil, now, flows),
		tx.NewInsert().Model(&pending)}, offSale...)...)
	if err != nil {
		if isUniqueViolation(err) && !hasKey {
			return nil, nil, errRetry // an order number drawn twice in one second: draw again
		}
		return nil, nil, err
	}
	if n[1] != int64(len(cardIDs)) {
		return nil, nil, errRetry // the rows were locked by us; only SQLite's missing row locks get here
	}
	k := 0
	for i, in := range open {
		p := products[in.ProductID]
		placed[i] = &PlacedOrder{Order: &orders[k], Product: p, AccessToken: tokens[k], cardIDs: cards[i]}
		k++
	}
	return done()
}

func (l *Ledger) maxQuantity(p *Product) int {
	if p.MaxPerOrder > 0 {
		return p.MaxPerOrder
	}
	return l.cfg.MaxQuantity
}

// quantityCeiling is the largest quantity any product can allow.
func (l *Ledger) quantityCeiling() int { return max(maxProductMaxPerOrder, l.cfg.MaxQuantity) }

// whyNotAdmitted answers an order the stock gate refused: the gate knows
// only how many cards are left, so an order that names no product on sale,
// or more than its product allows, is told that instead of SOLD_OUT.
func (l *Ledger) whyNotAdmitted(ctx context.Context, in PlaceOrderInput) error {
	p, err := l.Product(ctx, in.ProductID)
	switch {
	case ErrorCode(err) == ENOTFOUND || (err == nil && !p.Active):
		return Errorf(ENOTFOUND, "product %d is not on sale", in.ProductID)
	case err == nil && in.Quantity > l.maxQuantity(p):
		return Errorf(EBADINPUT, "quantity must be at most %d", l.maxQuantity(p))
	}
	return Errorf(ESOLDOUT, "product %d has fewer than %d cards left", in.ProductID, in.Quantity)
}

// replayBatch answers the orders whose idempotency key was already used:
// with that order, or CONFLICT when it was used for a different one. (One
// new key twice in a batch is placeOrders' follows: the first is placed,
// the second replays it.)
func (l *Ledger) replayBatch(ctx context.Context, tx bun.Tx, ins []PlaceOrderInput, placed []*PlacedOrder, errs []error) error {
	var keys []string
	for _, in := range ins {
		if in.IdempotencyKey != "" {
			keys = append(keys, in.IdempotencyKey)
		}
	}
	if len(keys) == 0 {
		return nil
	}
	var found []Order
	if err := tx.NewSelect().Model(&found).Where("idempotency_key IN (?)", bun.List(keys)).Scan(ctx); err != nil {
		return err
	}
	for _, o := range found {
		for i, in := range ins {
			if in.IdempotencyKey == o.IdempotencyKey {
				placed[i], errs[i] = l.replayed(in, o)
			}
		}
	}
	return nil
}

func sortedKeys[V any](m map[int64]V) []int64 {
	keys := make([]int64, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool { return keys[i] < keys[j] })
	return keys
}

// replay returns the order already placed with in's idempotency key, or nil.
func (l *Ledger) replay(ctx context.Context, in PlaceOrderInput) (*PlacedOrder, error) {
	var o Order
	err := l.db.NewSelect().Model(&o).Where("idempotency_key = ?", in.IdempotencyKey).Scan(ctx)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return l.replayed(in, o)
}

// replayed answers in with o, the order placed earlier with its key.
func (l *Ledger) replayed(in PlaceOrderInput, o Order) (*PlacedOrder, error) {
	// An order stored before contacts were normalized compares by its
	// normalized contact.
	if o.ProductID != in.ProductID || o.Quantity != in.Quantity || NormalizeContact(o.Contact) != in.Contact || o.Provider != in.Provider {
		return nil, Errorf(ECONFLICT, "idempotencyKey was already used for a different order")
	}
	return &PlacedOrder{Order: &o, AccessToken: l.sealer.AccessToken(o.OrderNo), Replayed: true}, nil
}

// holderCaps are the caps on one holder (a contact, an address): the
// unpaid orders it may hold and the cards they may lock; 0 is no cap. The
// ledger applies them to what a holder has in the database
// (checkPendingCaps), the shop to what it has in flight (inFlight.enter).
type holderCaps struct {
	maxOrders int
	maxLocked int
}

func (l *Ledger) contactCaps() holderCaps {
	return holderCaps{maxOrders: l.cfg.MaxPendingPerContact, maxLocked: l.cfg.MaxLockedPerContact}
}

func (l *Ledger) addressCaps() holderCaps {
	return holderCaps{maxOrders: l.cfg.MaxPendingPerAddress, maxLocked: l.cfg.MaxLockedPerAddress}
}

// off: no cap at all.
func (c holderCaps) off() bool { return c.maxOrders <= 0 && c.maxLocked <= 0 }

// ordersFull: a holder with held orders may take no other.
func (c holderCaps) ordersFull(held int) bool { return c.maxOrders > 0 && held >= c.maxOrders }

// cardsOver: a holder whose orders lock locked cards may not lock qty more.
func (c holderCaps) cardsOver(locked, qty int) bool {
	return c.maxLocked > 0 && locked+qty > c.maxLocked
}

// checkPendingCaps refuses a buyer who already holds too much in unpaid
// orders: too many orders, or too many cards locked by them, per contact
// and per client address. It counts the orders placed before the batch and
// those ahead in it. The caps are a brake on hoarding, not a ledger rule:
// two orders racing past the last free slot in two transactions may both
// pass.
func (l *Ledger) checkPendingCaps(ctx context.Context, tx bun.Tx, ins []PlaceOrderInput, open func(func(int, PlaceOrderInput) bool), errs []error) error {
	type capRule struct {
		column, what string
		holderCaps
		of           func(PlaceOrderInput) string
		held, locked map[string]int
	}
	rules := []*capRule{
		{column: "contact", what: "contact", holderCaps: l.contactCaps(),
			of: func(in PlaceOrderInput) string { return in.Contact }},
		{column: "client_addr", what: "address", holderCaps: l.addressCaps(),
			of: func(in PlaceOrderInput) string { return in.ClientAddr }},
	}
	for _, r := range rules {
		if r.off() {
			continue
		}
		var values []string
		for _, in := range open {
			if v := r.of(in); v != "" {
				values = append(values, v)
			}
		}
		if len(values) == 0 {
			continue
		}
		var rows []struct {
			Value  string `bun:"value"`
			Held   int    `bun:"held"`
			Locked int    `bun:"locked"`
		}
		if err := tx.NewSelect().Model((*PendingOrder)(nil)).ColumnExpr("? AS value, COUNT(*) AS held, SUM(quantity) AS locked", bun.Ident(r.column)).
			Where("? IN (?)", bun.Ident(r.column), bun.List(values)).
			GroupExpr("?", bun.Ident(r.column)).Scan(ctx, &rows); err != nil {
			return err
		}
		r.held, r.locked = make(map[string]int, len(rows)), make(map[string]int, len(rows))
		for _, row := range rows {
			r.held[row.Value], r.locked[row.Value] = row.Held, row.Locked
		}
	}
	for i, in := range open {
		for _, r := range rules {
			v := r.of(in)
			if r.held == nil || v == "" {
				continue
			}
			if r.ordersFull(r.held[v]) {
				errs[i] = Errorf(ELIMIT, "this %s already has %d unpaid orders; pay or cancel one first", r.what, r.held[v])
				break
			}
			if r.cardsOver(r.locked[v], in.Quantity) {
				errs[i] = Errorf(ELIMIT, "one %s may hold at most %d cards in unpaid orders and this one holds %d; pay or cancel an order first, or order fewer",
					r.what, r.maxLocked, r.locked[v])
				break
			}
		}
		if errs[i] != nil {
			continue
		}
		for _, r := range rules {
			if v := r.of(in); r.held != nil && v != "" {
				r.held[v]++
				r.locked[v] += in.Quantity
			}
		}
	}
	return nil
}

// Order returns one order. NOT_FOUND; BAD_INPUT for a number no order can
// have (see checkOrderNo).
func (l *Ledger) Order(ctx context.Context, orderNo string) (*Order, error) {
	if err := checkOrderNo(orderNo); err != nil {
		return nil, err
	}
	var o Order
	if err := l.db.NewSelect().Model(&o).Where("order_no = ?", orderNo).Scan(ctx); err != nil {
		return nil, notFound(err, "order %s not found", orderNo)
	}
	return &o, nil
}

// BuyerOrder returns the order if token is its access token. A wrong token
// gets the same NOT_FOUND as a missing order, so order numbers cannot be
// probed.
func (l *Ledger) BuyerOrder(ctx context.Context, orderNo, token string) (*Order, error) {
	o, err := l.Order(ctx, orderNo)
	if err != nil {
		if ErrorCode(err) == ENOTFOUND {
			HashToken(token) // same work as a real check
		}
		return nil, err
	}
	if !TokenMatches(token, o.AccessTokenHash) {
		return nil, Errorf(ENOTFOUND, "order %s not found", orderNo)
	}
	return o, nil
}

// DeliveredCodes returns the card codes sold to a delivered order, opened.
// Callers must have checked that the caller is the order's buyer or an
// admin. CONFLICT if the order was not delivered.
func (l *Ledger) DeliveredCodes(ctx context.Context, o *Order) ([]string, error) {
	if o.DeliveredAt.IsZero() {
		return nil, Errorf(ECONFLICT, "order %s has not been paid", o.OrderNo)
	}
	codes, err := l.SoldCodes(ctx, []string{o.OrderNo})
	if err != nil {
		return nil, err
	}
	return codes[o.OrderNo], nil
}

// --- close ----------------------------------------------------------------

// CloseReason says who closes an order.
type CloseReason string

const (
	CloseTimeout CloseReason = "timeout" // its time ran out; only after expires_at
	CloseCancel  CloseReason = "cancel"  // its buyer gave up; any time while PENDING
)

// CloseOutcome is what closing did to one order.
type CloseOutcome string

const (
	Closed       CloseOutcome = "CLOSED"    // PENDING → CLOSED now, cards recycled
	CloseSkipped CloseOutcome = "SKIPPED"   // not PENDING any more (paid, closed by someone else)
	CloseNotDue  CloseOutcome = "NOT_DUE"   // PENDING but expires_at is still ahead
	CloseMissing CloseOutcome = "NOT_FOUND" // no such order
	// CloseDeferred: PENDING and due, but its gateway's answer was not a
	// clear "not paid" (no answer, a payment that could not be recorded):
	// left open and checked again at RetryAt.
	CloseDeferred CloseOutcome = "DEFERRED"
)

// CloseResult reports one order of a CloseOrders call.
type CloseResult struct {
	OrderNo   string
	Outcome   CloseOutcome
	Status    OrderStatus // the order's status after the call
	ProductID int64
	// Released is how many cards went back on sale; the caller gives that
	// many back to the stock gate.
	Released int
	// Withdrawn is how many of its cards were not recycled but withdrawn:
	// their batch was recalled.
	Withdrawn int
	ExpiresAt time.Time
	// RetryAt is when a CloseDeferred order is to be tried again.
	RetryAt time.Time
	// Inconsistent is set when the order did not hold Quantity locked
	// cards; it was closed all the same and an alert was raised.
	Inconsistent bool
}

// CloseOrders is the one close path: every order that becomes CLOSED,
// whether by the close worker, a buyer's cancel or the nightly
// reconciliation, goes through here. One transaction for the whole batch:
// PENDING → CLOSED (for CloseTimeout only once expires_at has passed), its
// LOCKED cards → RECYCLED (→ WITHDRAWN for a card of a recalled batch),
// one stock journal entry (type 3, or 7 for withdrawn cards) per order.
// Orders already moved on are skipped, so running a batch twice is harmless.
func (l *Ledger) CloseOrders(ctx context.Context, orderNos []string, reason CloseReason) ([]CloseResult, error) {
	return l.closeDueBy(ctx, orderNos, reason, time.Time{})
}

// closeDueBy is CloseOrders where, for CloseTimeout, an order is due when
// it expired by dueBy (zero: by the transaction's own now). The Shop passes
// the time its pre-close check used, so that an order expiring between the
// check and the transaction is never closed unchecked.
func (l *Ledger) closeDueBy(ctx context.Context, orderNos []string, reason CloseReason, dueBy time.Time) ([]CloseResult, error) {
	nos := uniqueSorted(orderNos)
	if len(nos) == 0 {
		return nil, nil
	}
	var results []CloseResult
	var alerts []Alert
	err := inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
		var err error
		results, alerts, err = l.closeOrders(ctx, tx, nos, reason, dueBy)
		return err
	})
	if err != nil {
		return nil, err
	}
	for _, a := range alerts {
		l.alerts.Alert(ctx, a)
	}
	return results, nil
}

func (l *Ledger) closeOrders(ctx context.Context, tx bun.Tx, nos []string, reason CloseReason, dueBy time.Time) ([]CloseResult, []Alert, error) {
	pg := dialectName(tx) == dialect.PG
	var closed, others []Order
	var now time.Time
	var err error
	if pg {
		// One statement reads the database's clock, locks, closes and
		// reads the orders (see close_pg.go).
		closed, others, now, err = l.closeOrderRowsPG(ctx, tx, nos, reason, dueBy)
	} else {
		// Due is judged by the database's clock, read in this
		// transaction: a process whose own clock runs fast closes
		// nothing early.
		if now, err = l.dbNow(ctx, tx); err != nil {
			return nil, nil, err
		}
		if dueBy.IsZero() || dueBy.After(now) {
			dueBy = now
		}
		closed, others, err = closeOrderRows(ctx, tx, nos, reason, dueBy, now)
	}
	if err != nil {
		return nil, nil, err
	}
	results := make([]CloseResult, 0, len(nos))
	found := make(map[string]bool, len(closed)+len(others))
	var left []string
	for _, o := range others {
		found[o.OrderNo] = true
		r := CloseResult{OrderNo: o.OrderNo, Outcome: CloseSkipped, Status: o.Status, ProductID: o.ProductID, ExpiresAt: o.ExpiresAt}
		if o.Status == OrderPending {
			// Still PENDING, not closed: for a timeout, not due by dueBy.
			r.Outcome = CloseNotDue
		} else {
			left = append(left, o.OrderNo)
		}
		results = append(results, r)
	}
	// Orders no longer PENDING (left) have no row in pending_order, unless
	// a process of a version from before it paid or closed them (a rolling
	// upgrade): the sweeper schedules such a row's close again and again,
	// and the caps count it, so it goes here, where its order is locked,
	// not only in the nightly RepairPendingRows; with the closed orders'
	// rows when some closed (writeClose), in no round trip of its own.
	closing := make([]string, len(closed))
	for i := range closed {
		closing[i] = closed[i].OrderNo
		found[closed[i].OrderNo] = true
	}
	for _, no := range nos {
		if !found[no] {
			results = append(results, CloseResult{OrderNo: no, Outcome: CloseMissing})
		}
	}
	if len(closed) == 0 {
		if len(left) > 0 {
			if _, err := leavePending(tx, nil, left).Exec(ctx); err != nil {
				return nil, nil, err
			}
		}
		sort.Slice(results, func(i, j int) bool { return results[i].OrderNo < results[j].OrderNo })
		return results, nil, nil
	}
	var locked []lockedCard
	if pg {
		locked, err = lockedCardsPG(ctx, tx, closing)
	} else {
		locked, err = lockedCardsAndBatches(ctx, tx, closing)
	}
	if err != nil {
		return nil, nil, err
	}
	// A recalled batch's cards are withdrawn, the others go back on sale.
	recycledBy, withdrawnBy := map[string]int{}, map[string]int{}
	var toWithdraw, toRecycle []lockedCard
	for _, c := range locked {
		if c.BatchStatus == BatchRecalled {
			withdrawnBy[c.OrderNo]++
			toWithdraw = append(toWithdraw, c)
		} else {
			recycledBy[c.OrderNo]++
			toRecycle = append(toRecycle, c)
		}
	}
	var flows []StockFlow
	var alerts []Alert
	events := make([]Event, 0, len(closed))
	for i := range closed {
		o := &closed[i]
		no := o.OrderNo
		events = append(events, orderEvent(EventOrderClosed, o))
		r := CloseResult{OrderNo: no, Outcome: Closed, Status: OrderClosed, ProductID: o.ProductID,
			Released: recycledBy[no], Withdrawn: withdrawnBy[no], ExpiresAt: o.ExpiresAt}
		if held := r.Released + r.Withdrawn; held != o.Quantity {
			r.Inconsistent = true
			alerts = append(alerts, Alert{Kind: "inconsistency", Subject: no,
				Message: fmt.Sprintf("closed order held %d locked cards, want %d", held, o.Quantity)})
		}
		if r.Released > 0 {
			flows = append(flows, StockFlow{ProductID: o.ProductID, OrderNo: no, ChangeType: FlowReturn, Quantity: r.Released})
		}
		if r.Withdrawn > 0 {
			flows = append(flows, StockFlow{ProductID: o.ProductID, OrderNo: no, ChangeType: FlowWithdrawLocked, Quantity: r.Withdrawn})
		}
		results = append(results, r)
	}
	if err := writeClose(ctx, tx, now, closing, left, toWithdraw, toRecycle, flows, events); err != nil {
		return nil, nil, err
	}
	sort.Slice(results, func(i, j int) bool { return results[i].OrderNo < results[j].OrderNo })
	return results, alerts, nil
}

// closedColumns are the columns of a closed order that its close reads:
// those of its order.closed event (orderObject) and its result.
var closedColumns = []string{"order_no", "product_id", "quantity", "amount_fen", "contact", "provider", "status",
	"trade_no", "paid_at", "expires_at", "closed_at", "refunded_at", "created_at"}

// closeOrderRows moves the orders among nos (sorted, distinct) that are
// PENDING and, for a timeout, expired by dueBy to CLOSED, and returns them
// as they now are, in order_no order; others are the orders among nos it
// left as they were (an order in neither does not exist). The closed rows
// stay locked until the transaction ends: a payment of one of them waits,
// then finds it CLOSED.
//
// SQLite closes and reads in one statement (UPDATE … RETURNING), and reads
// the others (usually none) afterwards: only the conditional UPDATE
// decides. MySQL and MariaDB, which have no UPDATE … RETURNING, lock and
// read the orders first (in order_no order, the order every payment
// locks in), then close exactly the ones read as closable. (PostgreSQL:
// closeOrderRowsPG.)
func closeOrderRows(ctx context.Context, tx bun.Tx, nos []string, reason CloseReason, dueBy, now time.Time) (closed, others []Order, err error) {
	due := func(nos []string) func(q *bun.UpdateQuery) *bun.UpdateQuery {
		if reason != CloseTimeout {
			return whereOrderNos(nos)
		}
		return func(q *bun.UpdateQuery) *bun.UpdateQuery {
			return whereOrderNos(nos)(q).Where("expires_at <= ?", dueBy)
		}
	}
	if dialectName(tx) != dialect.MySQL {
		if err := applyReturning(ctx, tx, OrderClose, now, due(nos), closedColumns, &closed, col("closed_at = ?", now)); err != nil {
			return nil, nil, err
		}
		others, err := notClosed(ctx, tx, nos, closed)
		return closed, others, err
	}
	// Read by order_no's index (nameIndexMySQL), as the batch's UPDATE
	// is: left to choose, for a batch that is most of a small table
	// MariaDB scans the whole table and sorts, and a locking scan waits
	// for every row it reads, another transaction's orders too
	// (TestCloseWaitsOnlyForItsOrders), and locks in id order.
	var orders []Order
	if err := forUpdate(tx.NewSelect().Model(&orders).Column(closedColumns...).
		ForceIndex(nameIndexMySQL[[2]string{tableOrders, "order_no"}]).
		Where("order_no IN (?)", bun.List(nos)).Order("order_no")).Scan(ctx); err != nil {
		return nil, nil, err
	}
	var closing []string
	for _, o := range orders {
		if o.Status == OrderPending && (reason != CloseTimeout || !o.ExpiresAt.After(dueBy)) {
			closing = append(closing, o.OrderNo)
			o.Status, o.ClosedAt, o.UpdatedAt = OrderClosed, now, now
			closed = append(closed, o)
		} else {
			others = append(others, o)
		}
	}
	if len(closing) == 0 {
		return nil, others, nil
	}
	n, err := apply(ctx, tx, OrderClose, now, due(closing), col("closed_at = ?", now))
	if err != nil {
		return nil, nil, err
	}
	if n != int64(len(closing)) {
		return nil, nil, errRetry
	}
	return closed, others, nil
}

// notClosed sorts closed, the orders among nos (sorted, distinct) that
// one UPDATE … RETURNING closed, by order_no, and reads the rest of nos
// (usually none) without a lock: the conditional UPDATE decided them.
func notClosed(ctx context.Context, tx bun.Tx, nos []string, closed []Order) (others []Order, err error) {
	sort.Slice(closed, func(i, j int) bool { return closed[i].OrderNo < closed[j].OrderNo })
	if len(closed) == len(nos) {
		return nil, nil
	}
	isClosed := make(map[string]bool, len(closed))
	for _, o := range closed {
		isClosed[o.OrderNo] = true
	}
	rest := make([]string, 0, len(nos)-len(closed))
	for _, no := range nos {
		if !isClosed[no] {
			rest = append(rest, no)
		}
	}
	err = tx.NewSelect().Model(&others).Column("order_no", "product_id", "status", "expires_at").
		Where("order_no IN (?)", bun.List(rest)).Scan(ctx)
	return others, err
}

// lockedCard is a LOCKED card of an order being closed, and the status of
// its batch, read under a share lock (see lockedCardsAndBatches).
type lockedCard struct {
	// Place is the card's ctid on PostgreSQL, where lockedCardsPG locks
	// it: writeClose moves it by its place (byPlaces).
	Place       string      `bun:"ctid"`
	ID          int64       `bun:"id"`
	ProductID   int64       `bun:"product_id"`
	OrderNo     string      `bun:"order_no"`
	BatchID     int64       `bun:"batch_id"`
	BatchStatus BatchStatus `bun:"batch_status"`
}

// lockedCardsAndBatches reads the LOCKED cards of orderNos, orders being
// closed, and share-locks their batches' rows to read their status. A
// recall updates its batch row first, so it either committed before (the
// batch reads RECALLED here and its cards are withdrawn) or waits until
// this transaction commits (and then finds the cards RECYCLED, which it
// withdraws). Without the lock a recall committing between this read and
// the recycle would leave a recalled card on sale.
//
// The cards are found by their orders and then moved by their ids
// (writeClose): no card can become LOCKED to an order meanwhile (the
// orders are locked and CLOSED in this transaction), and a card that left
// LOCKED since it was read makes the count differ, and the transaction
// runs again. (PostgreSQL: lockedCardsPG, one statement.)
func lockedCardsAndBatches(ctx context.Context, tx bun.Tx, orderNos []string) ([]lockedCard, error) {
	// (Place stays empty: lockedCardRows names the cards by id.)
	var cards []lockedCard
	if err := tx.NewSelect().Table("card_stock").Column("id", "product_id", "order_no", "batch_id").
		Where("order_no IN (?)", bun.List(orderNos)).Where("status = ?", CardLocked).Scan(ctx, &cards); err != nil {
		return nil, err
	}
	batchIDs := map[int64]bool{}
	for _, c := range cards {
		batchIDs[c.BatchID] = true
	}
	if len(batchIDs) == 0 {
		return cards, nil
	}
	var batches []struct {
		ID     int64       `bun:"id"`
		Status BatchStatus `bun:"status"`
	}
	if err := shareLockIDs(tx, tableBatches, sortedKeys(batchIDs), "id", "status").Scan(ctx, &batches); err != nil {
		return nil, err
	}
	status := make(map[int64]BatchStatus, len(batches))
	for _, b := range batches {
		status[b.ID] = b.Status
	}
	for i := range cards {
		cards[i].BatchStatus = status[cards[i].BatchID]
	}
	return cards, nil
}

// writeClose writes what a close batch changes besides its orders (closed,
// the numbers of those it closed): their rows of pending_order deleted
// (and any of left, orders of the batch no longer PENDING), their cards
// withdrawn or recycled (by id, or on PostgreSQL by the place
// lockedCardsPG locked, guarded, each count checked) and the
// recycled ones put back on sale (card_for_sale), their journal entries
// and events; on PostgreSQL in one statement (writeAll), in this order.
func writeClose(ctx context.Context, tx bun.Tx, now time.Time, closed, left []string, toWithdraw, toRecycle []lockedCard, flows []StockFlow, events []Event) error {
	var b *binds // on PostgreSQL the statement is written with binds (binds.go)
	if dialectName(tx) == dialect.PG {
		b = &binds{}
	}
	qs, want := []writeQuery{leavePending(tx, b, append(slices.Clip(closed), left...))}, []int{-1}
	for _, m := range []struct {
		t     Transition
		cards []lockedCard
	}{{CardWithdrawLocked, toWithdraw}, {CardRecycle, toRecycle}} {
		if len(m.cards) > 0 {
			qs, want = append(qs, transitionLocked(tx, b, m.t, now, lockedCardRows(m.cards), nil, nil)), append(want, len(m.cards))
		}
	}
	if len(toRecycle) > 0 {
		onSale := make([]CardForSale, len(toRecycle))
		for i, c := range toRecycle {
			onSale[i] = CardForSale{ProductID: c.ProductID, CardID: c.ID}
		}
		qs, want = append(qs, putOnSale(tx, b, onSale)), append(want, -1)
	}
	if len(flows) > 0 {
		qs, want = append(qs, flowInsert(tx, b, now, flows)), append(want, -1)
	}
	if len(events) > 0 && !outboxOff.Load() {
		qs, want = append(qs, eventsInsert(tx, b, now, events)), append(want, -1)
	}
	counts, err := writeAll(withBinds(ctx, b), tx, qs...)
	if err != nil {
		return err
	}
	for i, n := range want {
		if n >= 0 && counts[i] != int64(n) {
			// A card left LOCKED since it was read: run again.
			return errRetry
		}
	}
	return nil
}

// CancelOrder closes a PENDING order for its buyer now, through the one
// close path. NOT_FOUND (also for a wrong token), CONFLICT if it is no
// longer PENDING.
func (l *Ledger) CancelOrder(ctx context.Context, orderNo, token string) (CloseResult, error) {
	if _, err := l.BuyerOrder(ctx, orderNo, token); err != nil {
		return CloseResult{}, err
	}
	rs, err := l.CloseOrders(ctx, []string{orderNo}, CloseCancel)
	if err != nil {
		return CloseResult{}, err
	}
	r := rs[0]
	if r.Outcome != Closed {
		return r, Errorf(ECONFLICT, "order %s is %s and can no longer be cancelled", orderNo, r.Status)
	}
	return r, nil
}

func uniqueSorted(xs []string) []string {
	out := make([]string, 0, len(xs))
	seen := make(map[string]bool, len(xs))
	for _, x := range xs {
		if x != "" && !seen[x] {
			seen[x] = true
			out = append(out, x)
		}
	}
	sort.Strings(out)
	return out
}

// pendingOf reads the PENDING orders among nos (sorted, distinct), in
// order_no order, for the pre-close check; withClock, also the database's
// clock, in the same statement where it can (a round trip of its own
// only when no order was read).
func (l *Ledger) pendingOf(ctx context.Context, nos []string, withClock bool) ([]Order, time.Time, error) {
	var orders []Order
	var now time.Time
	if dialectName(l.db) == dialect.PG {
		var err error
		if orders, now, err = l.pendingOfPG(ctx, nos, withClock); err != nil {
			return nil, time.Time{}, err
		}
	} else {
		q := l.db.NewSelect().Table("orders").Column("order_no", "product_id", "provider", "status", "expires_at").
			Where("order_no IN (?)", bun.List(nos)).Where("status = ?", OrderPending)
		if clock := l.clockSQL(l.db); withClock && clock != "" {
			q = q.ColumnExpr(clock + " AS db_now")
		}
		var rs []pendingRow
		if err := q.Scan(ctx, &rs); err != nil {
			return nil, time.Time{}, err
		}
		orders, now = pendingRows(rs)
	}
	if withClock && now.IsZero() {
		var err error
		if now, err = l.dbNow(ctx, l.db); err != nil {
			return nil, time.Time{}, err
		}
	}
	return orders, now, nil
}

// PendingOrder is a PENDING order's row in pending_order, all the
// schedulers and the caps read of it: the row is inserted with its order
// and deleted in the transaction that pays or closes it (leavePending),
// so that status is in no index of orders and a payment or close
// rewrites the order in place (migration 20261201000017).
type PendingOrder struct {
	bun.BaseModel `bun:"table:pending_order"`
	OrderNo       string    `bun:"order_no,pk"`
	ProductID     int64     `bun:"product_id"`
	Quantity      int       `bun:"quantity"`
	Contact       string    `bun:"contact"`
	ClientAddr    string    `bun:"client_addr"`
	ExpiresAt     time.Time `bun:"expires_at"`
}

// pendingOrderOf is o's row in pending_order.
func pendingOrderOf(o *Order) PendingOrder {
	return PendingOrder{OrderNo: o.OrderNo, ProductID: o.ProductID, Quantity: o.Quantity,
		Contact: o.Contact, ClientAddr: o.ClientAddr, ExpiresAt: o.ExpiresAt}
}

// leavePending deletes the rows of pending_order of nos, orders this
// transaction has just moved out of PENDING (and holds locked).
//
// On PostgreSQL each row is found by one probe of the table's key (the
// lateral pattern of lockedCardsPG) and deleted by its place (ctid).
// pending_order holds the PENDING orders: a few hundred in a busy shop,
// but tens of thousands after a restart that finds a backlog, and its
// statistics are those of the quiet moment before. Asked as "order_no IN
// (…500 numbers…)", the planner believed the table small and compared
// every row with the list: 13 ms of a close batch's 33 in the bench's
// drain of 40,000 orders, and it grew with the backlog.
//
// On MySQL/MariaDB the rows are found through their orders, read on
// order_no's index (nameIndexMySQL), one probe of pending_order's primary
// key each. Left to choose, for a batch that is a large share of
// pending_order (which holds only the PENDING orders, a few hundred: a
// close batch is up to 500), MariaDB reads the whole table, and InnoDB
// locks every row a DELETE reads: the batch waits for every other
// transaction's row there (an order placed, paid or closed meanwhile, until
// its COMMIT), so the close and payment batches run one after another. A
// single-table DELETE takes no index hint, and MariaDB drops a hint on the
// only table of a multi-table one.
func leavePending(tx bun.IDB, b *binds, nos []string) writeQuery {
	switch dialectName(tx) {
	case dialect.PG:
		return deleteProbedPG(tx, b, "pending_order", "text[]", nos, "order_no = u.v")
	case dialect.MySQL:
		return tx.NewRaw("DELETE p FROM orders AS o FORCE INDEX (?) STRAIGHT_JOIN pending_order AS p ON p.order_no = o.order_no"+
			" WHERE o.order_no IN (?)", bun.Ident(nameIndexMySQL[[2]string{tableOrders, "order_no"}]), bun.List(nos))
	}
	return deletePendingRows(tx, nos)
}

// deletePendingRows deletes the rows of pending_order of nos, found by
// their own key.
func deletePendingRows(db bun.IDB, nos []string) *bun.DeleteQuery {
	return db.NewDelete().Model((*PendingOrder)(nil)).Where("order_no IN (?)", bun.List(nos))
}

// RepairPendingRows makes pending_order agree with the orders, as the
// audit's pending_row rule checks: a row for every PENDING order that has
// none, and none for an order that is no longer PENDING. kami itself
// keeps them in step; a process of a version from before the table (a
// rolling upgrade) does not, and an order it placed would never be seen
// by the sweeper, its cards locked for good. It reads all of orders
// (status is in none of its indexes), so it runs with the nightly
// reconciliation, as the audit does; up to repairLimit rows each way a
// run.
func (l *Ledger) RepairPendingRows(ctx context.Context) (added, removed int, err error) {
	// An order that left PENDING never returns to it: its row can go
	// without a lock. (The row and its order are written in one
	// transaction, so the read sees both or neither.)
	var stale []string
	if err := l.db.NewSelect().TableExpr("pending_order AS p").
		Join("LEFT JOIN orders AS o ON o.order_no = p.order_no").ColumnExpr("p.order_no").
		Where("o.id IS NULL OR o.status <> ?", OrderPending).Limit(repairLimit).Scan(ctx, &stale); err != nil {
		return 0, 0, err
	}
	if len(stale) > 0 {
		// Rows of orders no longer PENDING, or of none, which no other
		// transaction writes: read by a scan of the whole table, this may
		// wait for a live order's row, but nothing waits for it.
		if _, err := deletePendingRows(l.db, stale).Exec(ctx); err != nil {
			return 0, 0, err
		}
	}
	var orphans []string
	if err := l.db.NewSelect().TableExpr("orders AS o").ColumnExpr("o.order_no").
		Where("o.status = ?", OrderPending).
		Where("NOT EXISTS (SELECT 1 FROM pending_order AS p WHERE p.order_no = o.order_no)").
		Limit(repairLimit).Scan(ctx, &orphans); err != nil {
		return 0, len(stale), err
	}
	if len(orphans) == 0 {
		return 0, len(stale), nil
	}
	// Each order locked and still PENDING gets its row: one paid or
	// closed meanwhile is left alone, and one another run of this gave
	// its row meanwhile (it locked the order first too) is not given a
	// second. On MariaDB the orders are read by order_no's index, so
	// that they are locked in that order (see closeOrderRows).
	err = inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
		var os []Order
		if err := forUpdate(tx.NewSelect().Model(&os).ForceIndex(nameIndexMySQL[[2]string{tableOrders, "order_no"}]).
			Where("order_no IN (?)", bun.List(uniqueSorted(orphans))).
			Where("status = ?", OrderPending).OrderExpr("order_no")).Scan(ctx); err != nil {
			return err
		}
		var have []string
		if len(os) > 0 {
			if err := forUpdate(tx.NewSelect().Model((*PendingOrder)(nil)).Column("order_no").
				Where("order_no IN (?)", bun.List(orphans))).Scan(ctx, &have); err != nil {
				return err
			}
		}
		has := make(map[string]bool, len(have))
		for _, no := range have {
			has[no] = true
		}
		rows := make([]PendingOrder, 0, len(os))
		for i := range os {
			if !has[os[i].OrderNo] {
				rows = append(rows, pendingOrderOf(&os[i]))
			}
		}
		added = len(rows)
		if len(rows) == 0 {
			return nil
		}
		_, err := tx.NewInsert().Model(&rows).Exec(ctx)
		return err
	})
	if err != nil {
		return 0, len(stale), err
	}
	return added, len(stale), nil
}

// repairLimit bounds the rows RepairPendingRows adds or removes a run.
const repairLimit = 10000

// PendingPages walks the PENDING orders expiring before dueBefore (all,
// if zero) page by page in PendingOrders' order, size to a page, calling
// fn with each until fn says stop, a page is short, fn fails, or ctx
// ends (quietly: a caller that must know a walk was cut checks ctx). The
// sweeper and the reconciliation's stragglers walk them so.
//
// After a first full page, on PostgreSQL, pending_order is analyzed
// (analyzeBriefly). The table is a queue: a few rows in a quiet moment,
// when its statistics are usually taken, and tens of thousands when
// Redis is down or a backlog awaits its closes, which is when it is
// walked. With the statistics of the quiet moment the planner believed
// the table small and read every row of it, sorted, for each page
// (4 ms a page of 20,000 PENDING orders against 0.1 ms on the index):
// a walk of n orders cost n²/500 rows.
func (l *Ledger) PendingPages(ctx context.Context, dueBefore time.Time, size int, fn func([]PendingOrder) (more bool, err error)) error {
	var after PendingOrder
	for first := true; ; first = false {
		page, err := l.PendingOrders(ctx, after, dueBefore, size)
		if err != nil {
			return err
		}
		if len(page) == 0 {
			return nil
		}
		more, err := fn(page)
		if err != nil || !more || len(page) < size || ctx.Err() != nil {
			return err
		}
		if first {
			analyzeBriefly(ctx, l.db, "pending_order")
		}
		after = page[len(page)-1]
	}
}

// PendingOrders pages through PENDING orders by (expires_at, order_no),
// the order of the pending_order_due index: pass the last row of one page
// as after to get the next. dueBefore, when not zero, stops at orders
// expiring at or after it.
func (l *Ledger) PendingOrders(ctx context.Context, after PendingOrder, dueBefore time.Time, limit int) ([]PendingOrder, error) {
	var out []PendingOrder
	q := l.db.NewSelect().Column("order_no", "product_id", "quantity", "expires_at")
	if dialectName(l.db) == dialect.SQLite {
		// kami never analyzes SQLite's tables, and without statistics
		// SQLite may take another index and sort every PENDING order for
		// each page.
		q = q.TableExpr("pending_order INDEXED BY pending_order_due")
	} else {
		q = q.Model((*PendingOrder)(nil))
	}
	if !after.ExpiresAt.IsZero() {
		// The first condition is implied by the second; it is there for
		// the index, which seeks to it instead of walking every PENDING
		// order before the page (a sweep of n pages read n²/2 pages).
		q = q.Where("expires_at >= ?", after.ExpiresAt).
			Where("(expires_at > ? OR (expires_at = ? AND order_no > ?))", after.ExpiresAt, after.ExpiresAt, after.OrderNo)
	}
	if !dueBefore.IsZero() {
		q = q.Where("expires_at < ?", dueBefore.UTC())
	}
	err := q.OrderExpr("expires_at, order_no").Limit(int64(limit)).Scan(ctx, &out)
	return out, err
}
