package domain

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sort"
	"sync"
	"time"

	"kami/domain/money"
	"kami/providers"
)

// StockGate is the admission counter in front of the ledger (Redis
// stock:product:{id} in package queue). It may refuse a sale the database
// would allow; it can never make one the database refuses, since the card
// lock in PlaceOrder is the real gate.
type StockGate interface {
	// Take takes qty from the product's counter if that many are left.
	// false: not enough. An error means the gate cannot answer (Redis down).
	Take(ctx context.Context, productID int64, qty int) (bool, error)
	// GiveBack returns qty to the product's counter.
	GiveBack(ctx context.Context, productID int64, qty int) error
}

// Scheduler puts work on the Redis delay queues. Losing a schedule is never
// fatal: the sweepers rebuild it from the database.
type Scheduler interface {
	ScheduleClose(ctx context.Context, orderNo string, due time.Time) error
	// CancelClose takes a paid order's close off the queue. Losing it is
	// harmless: the close finds the order PAID and skips it.
	CancelClose(ctx context.Context, orderNo string) error
	ScheduleRefund(ctx context.Context, refundNo string, due time.Time) error
}

// Events hears every order status change (GraphQL subscriptions).
type Events interface {
	OrderChanged(ctx context.Context, orderNo string, status OrderStatus)
}

// Shop is the application service every entry point calls: it puts the
// ledger together with the stock gate, the schedulers, the payment
// providers and the event stream. The ledger decides; Shop only sequences
// the outside effects around its transactions.
type Shop struct {
	Ledger    *Ledger
	Gate      StockGate
	Scheduler Scheduler
	Events    Events
	Providers *providers.Registry
	Log       *slog.Logger
	// PublicBaseURL prefixes pay URLs that kami serves itself (sandbox).
	PublicBaseURL string
	// PreCloseCheck asks the provider whether an order was paid before
	// closing it, on its timeout or its buyer's cancel (a lost
	// notification then delivers instead of closing), and closes the trade
	// at the provider; an order without a clear "not paid" is not closed.
	// On in the server.
	PreCloseCheck bool
	// ProviderTimeout bounds each call made to a provider (the pre-close
	// check, order sync, statement look-ups); default 10 s, as the server's
	// KAMI_PROVIDER_TIMEOUT.
	ProviderTimeout time.Duration
	// CheckRetry is how long an order waits to be checked again when its
	// pre-close check had no clear answer; default DefaultCheckRetry.
	CheckRetry time.Duration
	// CheckBudget bounds the pre-close check of one batch as a whole: the
	// orders not checked within it are deferred, not closed. The close
	// workers keep it well under their lease (a third of it), so that a
	// batch is closed before lease recovery hands it to another process;
	// default DefaultCheckBudget.
	CheckBudget time.Duration
	// BreakerFailures is how many provider calls of the pre-close check
	// may fail in a row before that provider is not called for
	// BreakerCooldown: its orders are deferred meanwhile, the others'
	// closes go on. Defaults DefaultBreakerFailures, DefaultBreakerCooldown.
	BreakerFailures int
	BreakerCooldown time.Duration
	// Observer hears every placement, close, payment and refund attempt
	// (metrics); nil for none.
	Observer Observer
	// MailQueue schedules the mails payments queue (see mail.go); nil
	// leaves them to the mail sweeper.
	MailQueue MailScheduler

	products sync.Map // product ids known to exist (see productExists)
	breakers sync.Map // provider name → *breaker (see preClose)
	inFlight inFlight // orders admitted by the gate, not yet answered (see inFlight.enter)
}

// inFlight counts, per client address (AddressKey), the orders the stock
// gate has admitted and the ledger has not yet answered, and their cards.
type inFlight struct {
	mu     sync.Mutex
	orders map[string]int
	cards  map[string]int
}

// enter takes a place among the orders in flight of the address key, for
// an order of qty cards, which the per-address caps bound as they bound
// its unpaid orders: the gate admits an order before the ledger counts
// the caps, so without this bound an address at its cap could hold any
// number of admissions at once (each refused only when the ledger
// answers) and leave everyone else SOLD_OUT with cards free. An address
// thus holds at most one cap's worth of admissions (or one order's)
// beyond its orders; per process, as the caps' other races are.
// LIMIT_EXCEEDED when the address has no place left; leave gives the
// place back once the ledger has answered.
func (f *inFlight) enter(key string, qty int, caps holderCaps) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.orders == nil {
		f.orders, f.cards = map[string]int{}, map[string]int{}
	}
	// The first order in flight always goes on: the ledger's answer to it
	// says what the caps allow.
	if f.orders[key] > 0 && (caps.ordersFull(f.orders[key]) || caps.cardsOver(f.cards[key], qty)) {
		return Errorf(ELIMIT, "this address has %d orders (%d cards) being placed; its caps allow no more at once: wait for their answers",
			f.orders[key], f.cards[key])
	}
	f.orders[key]++
	f.cards[key] += qty
	return nil
}

func (f *inFlight) leave(key string, qty int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.orders[key]--; f.orders[key] <= 0 {
		delete(f.orders, key)
		delete(f.cards, key)
		return
	}
	f.cards[key] -= qty
}

func (s *Shop) log() *slog.Logger {
	if s.Log != nil {
		return s.Log
	}
	return slog.Default()
}

func (s *Shop) changed(ctx context.Context, o *Order) {
	if s.Events != nil && o != nil {
		s.Events.OrderChanged(ctx, o.OrderNo, o.Status)
	}
}

// maxMethodLen bounds a payment method's name ("page", "native", ...).
const maxMethodLen = 16

// Checkout is what a buyer gets from placing an order.
type Checkout struct {
	*PlacedOrder
	Payment providers.PaymentAction
}

// PlaceOrder admits the order through the stock gate, places it in the
// ledger, schedules its close and asks the provider how the buyer pays.
// Errors as Ledger.PlaceOrder, plus UNAVAILABLE when the gate or the
// provider cannot answer (nothing is held then).
func (s *Shop) PlaceOrder(ctx context.Context, in PlaceOrderInput, method, clientIP string) (*Checkout, error) {
	co, err := s.placeOrder(ctx, in, method, clientIP)
	if err != nil {
		s.observer().OrderRefused(ErrorCode(err))
	} else if !co.Replayed {
		s.observer().OrderPlaced()
		s.logPlaced(ctx, co.Order)
	}
	return co, err
}

func (s *Shop) placeOrder(ctx context.Context, in PlaceOrderInput, method, clientIP string) (*Checkout, error) {
	// Input is checked before any of it is echoed in an error.
	if err := in.normalize(); err != nil {
		return nil, err
	}
	if len(method) > maxMethodLen {
		return nil, Errorf(EBADINPUT, "method is longer than %d characters", maxMethodLen)
	}
	if err := checkBuyerText("method", method); err != nil {
		return nil, err
	}
	p, ok := s.Providers.Offered(in.Provider)
	if !ok {
		return nil, Errorf(EBADINPUT, "provider %q is not enabled; use one of %v", in.Provider, s.Providers.OfferedNames())
	}
	if in.Quantity > s.Ledger.quantityCeiling() {
		// No product allows this many: refused before the stock gate, which
		// would only say how few cards are left.
		return nil, Errorf(EBADINPUT, "quantity must be at most %d", s.Ledger.quantityCeiling())
	}
	if in.IdempotencyKey != "" {
		placed, err := s.Ledger.replay(ctx, in)
		if err != nil {
			return nil, err
		}
		if placed != nil {
			return s.checkout(ctx, p, placed, method, clientIP)
		}
	}
	if err := s.productExists(ctx, in.ProductID); err != nil {
		return nil, err
	}
	placed, err := s.admitAndPlace(ctx, in)
	if err != nil {
		return nil, err
	}
	if !placed.Replayed && s.Scheduler != nil {
		// The order exists now, whether or not its buyer is still there.
		if err := s.Scheduler.ScheduleClose(context.WithoutCancel(ctx), placed.Order.OrderNo, placed.Order.ExpiresAt); err != nil {
			// The sweeper finds PENDING orders missing from the queue.
			s.log().WarnContext(ctx, "schedule close failed; the sweeper will", "order", placed.Order.OrderNo, "err", err)
		}
	}
	if !placed.Replayed {
		// Free unless the product has a low-stock threshold it is above.
		if err := s.Ledger.CheckStockFell(context.WithoutCancel(ctx), placed.Product); err != nil {
			s.log().WarnContext(ctx, "low-stock check failed", "product", in.ProductID, "err", err)
		}
	}
	// No event for the new order: nobody can be subscribed to it yet, and
	// a subscription starts with the order's current status.
	return s.checkout(ctx, p, placed, method, clientIP)
}

// admitAndPlace places in as one of its address's orders in flight (see
// inFlight.enter), whose place it gives back however the placing ends, a
// panic included: a place kept would refuse that address for the life of
// the process.
func (s *Shop) admitAndPlace(ctx context.Context, in PlaceOrderInput) (*PlacedOrder, error) {
	caps := s.Ledger.addressCaps()
	if in.ClientAddr == "" || caps.off() {
		return s.gateAndPlace(ctx, in)
	}
	if err := s.inFlight.enter(in.ClientAddr, in.Quantity, caps); err != nil {
		return nil, err
	}
	defer s.inFlight.leave(in.ClientAddr, in.Quantity)
	return s.gateAndPlace(ctx, in)
}

// gateAndPlace admits in through the stock gate and places it in the
// ledger; an admission that locked nothing is given back.
func (s *Shop) gateAndPlace(ctx context.Context, in PlaceOrderInput) (*PlacedOrder, error) {
	if s.Gate != nil {
		ok, err := s.Gate.Take(ctx, in.ProductID, in.Quantity)
		if err != nil {
			s.log().WarnContext(ctx, "stock gate unavailable", "err", err)
			return nil, Errorf(EUNAVAILABLE, "ordering is paused for a moment; try again")
		}
		if !ok {
			return nil, s.Ledger.whyNotAdmitted(ctx, in)
		}
	}
	placed, err := s.Ledger.PlaceOrder(ctx, in)
	if err == nil && placed == nil {
		// Cannot happen (group.Batcher answers a missing answer with an
		// error); should it, the admission must still go back.
		err = errors.New("the ledger placed no order and reported no error")
	}
	if s.Gate != nil && (err != nil || placed.Replayed) {
		// Nothing was locked for this request: give the admission back.
		if gerr := s.Gate.GiveBack(context.WithoutCancel(ctx), in.ProductID, in.Quantity); gerr != nil {
			s.log().WarnContext(ctx, "stock gate give-back failed; reconciliation repairs it", "product", in.ProductID, "err", gerr)
		}
	}
	return placed, err
}

// productExists refuses an order for a product that does not exist before
// it reaches the stock gate, which would otherwise count and keep a counter
// for any product id a client makes up. Products are never deleted, so one
// found is remembered and costs nothing the next time.
func (s *Shop) productExists(ctx context.Context, productID int64) error {
	if _, ok := s.products.Load(productID); ok {
		return nil
	}
	if _, err := s.Ledger.Product(ctx, productID); err != nil {
		return err
	}
	s.products.Store(productID, true)
	return nil
}

func (s *Shop) checkout(ctx context.Context, p providers.Provider, placed *PlacedOrder, method, clientIP string) (*Checkout, error) {
	o := placed.Order
	if placed.Replayed && o.Status != OrderPending {
		// A retry of an order that was paid, closed or refunded: there is
		// nothing left to pay, and a new payment for it would take money
		// for an order that can no longer deliver. The contract's payment
		// is never null, so the answer is an error naming the order.
		return nil, Errorf(ECONFLICT, "the order placed with this idempotencyKey (%s) is %s and can no longer be paid; see it with order(orderNo, accessToken), or place a new order with a new key",
			o.OrderNo, o.Status)
	}
	var subject string
	if placed.Product != nil {
		subject = placed.Product.Name
	} else if prod, err := s.Ledger.Product(ctx, o.ProductID); err == nil { // a replayed order
		subject = prod.Name
	} else {
		subject = "Order " + o.OrderNo
	}
	action, err := p.CreatePayment(ctx, providers.PaymentRequest{OrderNo: o.OrderNo, AmountFen: o.AmountFen,
		Subject: subject, ExpiresAt: o.ExpiresAt, ClientIP: clientIP, Method: method})
	if err != nil {
		if providers.KindOf(err) == providers.Unsupported {
			if !placed.Replayed {
				// Only the order this request made is cancelled: a retry
				// with a bad method leaves the buyer's live order alone.
				s.cancelUnpayable(ctx, o)
			}
			return nil, Errorf(EBADINPUT, "payment method %q is not offered by %s", method, p.Name())
		}
		s.log().ErrorContext(ctx, "create payment failed", "order", o.OrderNo, "provider", p.Name(), "err", err)
		if !placed.Replayed {
			s.cancelUnpayable(ctx, o)
		}
		if providers.KindOf(err) == providers.Rejected {
			// The gateway answered, and refused (a merchant account it
			// suspended, a limit of its own): "did not answer" would be
			// untrue. Its own text stays in the log; the buyer learns
			// that it refused and that the order is cancelled, so a new
			// order, perhaps with another provider, is the way on.
			// UNAVAILABLE still fits: kami cannot take this payment now,
			// and the same request may succeed once the provider accepts
			// again.
			if placed.Replayed {
				// A retry leaves the buyer's live order alone (above).
				return nil, Errorf(EUNAVAILABLE, "%s refused to create the payment for order %s; try again later, or place a new order with another payment provider", p.Name(), o.OrderNo)
			}
			return nil, Errorf(EUNAVAILABLE, "%s refused to create the payment for order %s, which is cancelled; place a new order, or try another payment provider", p.Name(), o.OrderNo)
		}
		return nil, Errorf(EUNAVAILABLE, "the payment provider did not answer; try again")
	}
	return &Checkout{PlacedOrder: placed, Payment: action}, nil
}

// cancelUnpayable gives back the cards of a new order the buyer cannot
// pay, through the one close path (which also closes its trade, should
// the gateway have made one). An order it cannot close now keeps its
// scheduled close.
func (s *Shop) cancelUnpayable(ctx context.Context, o *Order) {
	rs, err := s.CloseOrders(context.WithoutCancel(ctx), []string{o.OrderNo}, CloseCancel)
	switch {
	case err != nil:
		s.log().ErrorContext(ctx, "cancel of an unpayable order failed; its close is scheduled", "order", o.OrderNo, "err", err)
	case len(rs) == 1 && rs[0].Outcome != Closed:
		s.log().WarnContext(ctx, "unpayable order not cancelled; its close is scheduled", "order", o.OrderNo, "outcome", rs[0].Outcome)
	}
}

// ImportCards imports codes through the ledger and adds the new cards to
// the stock gate. Without this a counter built while the product had no
// cards (a buyer or the sweeper found it missing) would stay at zero and
// refuse every sale until the nightly repair. A counter rebuilt from the
// database between the commit and the give-back counts the new cards twice;
// too high is safe, since the card lock in the ledger is the real gate.
func (s *Shop) ImportCards(ctx context.Context, productID int64, codes []string, actor string) (ImportResult, error) {
	res, err := s.Ledger.ImportCards(ctx, productID, codes, actor)
	if err != nil {
		return res, err
	}
	s.imported(ctx, productID, res.Imported)
	return res, nil
}

// imported tells the stock gate and the low-stock alert of n new cards.
func (s *Shop) imported(ctx context.Context, productID int64, n int) {
	if n == 0 {
		return
	}
	ctx = context.WithoutCancel(ctx)
	if s.Gate != nil {
		if err := s.Gate.GiveBack(ctx, productID, n); err != nil {
			s.log().WarnContext(ctx, "stock gate not told of imported cards; reconciliation repairs it", "product", productID, "err", err)
		}
	}
	s.stockRose(ctx, productID)
}

// CancelOrder closes a buyer's PENDING order now.
func (s *Shop) CancelOrder(ctx context.Context, orderNo, token string) (*Order, error) {
	if _, err := s.Ledger.BuyerOrder(ctx, orderNo, token); err != nil {
		return nil, err
	}
	rs, err := s.CloseOrders(ctx, []string{orderNo}, CloseCancel)
	if err != nil {
		return nil, err
	}
	if rs[0].Outcome == CloseDeferred {
		return nil, Errorf(EUNAVAILABLE, "the payment provider did not confirm that order %s is unpaid; try again in a moment", orderNo)
	}
	if rs[0].Outcome != Closed {
		return nil, Errorf(ECONFLICT, "order %s is %s and can no longer be cancelled", orderNo, rs[0].Status)
	}
	return s.Ledger.Order(ctx, orderNo)
}

// CloseOrders closes a batch through the ledger's one close path, then
// gives the released cards back to the stock gate and tells subscribers.
// With PreCloseCheck, due orders are first checked at their provider (see
// preClose): an order whose check gave no clear "not paid" is not closed
// but answered CloseDeferred, with the time to try it again.
func (s *Shop) CloseOrders(ctx context.Context, orderNos []string, reason CloseReason) ([]CloseResult, error) {
	var dueBy time.Time
	var decided []CloseResult
	if s.PreCloseCheck {
		closeNow, checked, checkedBy, err := s.preClose(ctx, orderNos, reason == CloseTimeout)
		if err != nil {
			// Nothing could be checked: nothing is closed.
			s.observer().CloseFailed(len(orderNos))
			return nil, err
		}
		orderNos, decided, dueBy = closeNow, checked, checkedBy
	}
	rs, err := s.Ledger.closeDueBy(ctx, orderNos, reason, dueBy)
	if err != nil {
		s.observer().CloseFailed(len(orderNos))
		return nil, err
	}
	if len(decided) > 0 {
		rs = append(rs, decided...)
		sort.Slice(rs, func(i, j int) bool { return rs[i].OrderNo < rs[j].OrderNo })
	}
	now := s.Ledger.DBTime() // expires_at is the database's time
	released := map[int64]int{}
	for _, r := range rs {
		var lateBy time.Duration
		if r.Outcome == Closed && reason == CloseTimeout {
			lateBy = now.Sub(r.ExpiresAt)
		}
		s.observer().OrderClosed(reason, r.Outcome, lateBy)
		if r.Outcome == Closed {
			s.logClosed(ctx, r, reason)
			if reason != CloseTimeout && s.Scheduler != nil {
				// Closed before its time (its buyer cancelled): its
				// close task would only wait in the queue until then.
				if err := s.Scheduler.CancelClose(ctx, r.OrderNo); err != nil {
					s.log().DebugContext(ctx, "close task of a cancelled order left queued; its close will skip it", "order", r.OrderNo, "err", err)
				}
			}
			released[r.ProductID] += r.Released
			if s.Events != nil {
				s.Events.OrderChanged(ctx, r.OrderNo, OrderClosed)
			}
		}
	}
	if s.Gate != nil {
		for pid, n := range released {
			if n == 0 {
				continue
			}
			if err := s.Gate.GiveBack(context.WithoutCancel(ctx), pid, n); err != nil {
				s.log().WarnContext(ctx, "stock gate give-back failed; reconciliation repairs it", "product", pid, "err", err)
			}
		}
	}
	var rose []int64
	for pid, n := range released {
		if n > 0 {
			rose = append(rose, pid)
		}
	}
	s.stockRose(context.WithoutCancel(ctx), rose...)
	return rs, nil
}

// DefaultCheckRetry is how long an order whose pre-close check was not a
// clear "not paid" waits before it is checked again.
const DefaultCheckRetry = time.Minute

// Defaults of the pre-close check's bounds.
const (
	DefaultCheckBudget     = 10 * time.Second
	DefaultBreakerFailures = 5
	DefaultBreakerCooldown = 30 * time.Second
)

func (s *Shop) checkBudget() time.Duration {
	if s.CheckBudget > 0 {
		return s.CheckBudget
	}
	return DefaultCheckBudget
}

// breaker is the circuit breaker of one provider on the pre-close check.
type breaker struct {
	mu        sync.Mutex
	fails     int       // calls failed in a row
	openUntil time.Time // no calls before this
}

// allow reports whether the provider may be called at now. Once open and
// cooled down, one call goes through (probe): the breaker stays shut to
// the others for another cooldown, unless the probe succeeds first.
// Without this, every slot of the check would call the provider at once
// and each wait a whole timeout.
func (b *breaker) allow(now time.Time, failures int, cooldown time.Duration) (allowed, probe bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if now.Before(b.openUntil) {
		return false, false
	}
	if b.fails >= failures {
		b.openUntil = now.Add(cooldown)
		return true, true
	}
	return true, false
}

// record notes a call's outcome, and reports whether this failure opened
// the breaker. A success closes it; a failed probe leaves it open (no
// second alert).
func (b *breaker) record(failed bool, now time.Time, failures int, cooldown time.Duration) (opened bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !failed {
		b.fails, b.openUntil = 0, time.Time{}
		return false
	}
	b.fails++
	if b.fails >= failures && !now.Before(b.openUntil) {
		b.openUntil = now.Add(cooldown)
		return true
	}
	return false
}

// breakerLimits are BreakerFailures and BreakerCooldown, or their defaults.
func (s *Shop) breakerLimits() (failures int, cooldown time.Duration) {
	failures, cooldown = s.BreakerFailures, s.BreakerCooldown
	if failures <= 0 {
		failures = DefaultBreakerFailures
	}
	if cooldown <= 0 {
		cooldown = DefaultBreakerCooldown
	}
	return failures, cooldown
}

func (s *Shop) breaker(provider string) *breaker {
	b, _ := s.breakers.LoadOrStore(provider, &breaker{})
	return b.(*breaker)
}

// providerCalled feeds a pre-close call's outcome to the provider's
// breaker. A call cut short by the check's own budget says nothing of
// the provider; an answer, even a refusal, says it is up.
func (s *Shop) providerCalled(ctx context.Context, p providers.Provider, err error) {
	if ctx.Err() != nil {
		return
	}
	failures, cooldown := s.breakerLimits()
	failed := err != nil && providers.KindOf(err) == providers.Temporary
	if s.breaker(p.Name()).record(failed, s.Ledger.now(), failures, cooldown) {
		msg := fmt.Sprintf("%d calls in a row failed; its orders are not checked, and so not closed, for %s", failures, cooldown)
		s.log().ErrorContext(ctx, "provider circuit breaker opened", "provider", p.Name(), "failures", failures, "cooldown", cooldown)
		s.Ledger.alerts.Alert(ctx, Alert{Kind: "provider_unavailable", Subject: p.Name(), Message: msg})
	}
}

func (s *Shop) checkRetry() time.Duration {
	if s.CheckRetry > 0 {
		return s.CheckRetry
	}
	return DefaultCheckRetry
}

// tradeVerdict is what the pre-close check learnt of one order's trade.
type tradeVerdict int

const (
	// tradeUnsure: anything but a clear answer (no answer, a payment that
	// could not be recorded, a gateway that refuses to close a trade it
	// does not call paid). The order stays PENDING and is checked again.
	tradeUnsure tradeVerdict = iota
	// tradeNotPaid: the gateway says unpaid and closed the trade, so no
	// payment can arrive any more: the order may close.
	tradeNotPaid
	// tradeSettled: the gateway says paid and the payment is recorded:
	// the order is no longer PENDING.
	tradeSettled
)

// preClose asks each due order's provider about its trade before the
// order closes, and returns the orders that may close: those whose
// gateway clearly said "not paid" and closed the trade (or whose provider
// is not enabled in this process, so nobody can be asked). A paid one is
// recorded as paid instead (a lost notification then delivers rather than
// closes); anything else keeps the order out of this close, answered
// CloseDeferred with the time to check it again. A money question that
// cannot be answered is never settled by closing: the order waits.
//
// For a close on timeout (due), an order is due when it expired by the
// database's clock, read with the orders: dueBy, which the close
// transaction then judges by too, so that an order expiring between the
// check and the transaction is never closed unchecked. A buyer's cancel
// takes the same check (any PENDING order; dueBy zero), so that a
// cancelled order's trade can no longer be paid, and a payment that
// crossed the cancel delivers.
//
// Orders not PENDING or not due by dueBy pass through: the ledger skips
// them or finds them not due. An error (the orders could not be read)
// means nothing was checked, and nothing may close.
func (s *Shop) preClose(ctx context.Context, orderNos []string, due bool) (closeNow []string, decided []CloseResult, dueBy time.Time, err error) {
	timeout := s.providerTimeout()
	orderNos = uniqueSorted(orderNos) // an order listed twice is checked once
	pending, dueBy, err := s.Ledger.pendingOf(ctx, orderNos, due)
	if err != nil {
		return nil, nil, time.Time{}, fmt.Errorf("read orders to check before close: %w", err)
	}
	dueByNo := make(map[string]*Order, len(pending))
	for i := range pending {
		if o := &pending[i]; !due || !o.ExpiresAt.After(dueBy) {
			dueByNo[o.OrderNo] = o
		}
	}
	verdicts := make([]tradeVerdict, len(orderNos))
	status := make([]OrderStatus, len(orderNos))
	// The whole check fits in its budget: what is not checked by then is
	// deferred, so the batch is closed while its lease still holds it.
	bctx, cancel := context.WithTimeout(ctx, s.checkBudget())
	defer cancel()
	sem := make(chan struct{}, 16)
	var wg sync.WaitGroup
	var skipped, breakerOpen int
	failures, cooldown := s.breakerLimits()
	probes := map[string]chan struct{}{} // provider → closed when its breaker's probe has answered
	for i, no := range orderNos {
		verdicts[i] = tradeNotPaid
		o := dueByNo[no]
		if o == nil {
			continue
		}
		p, ok := s.Providers.Get(o.Provider)
		if !ok {
			// No gateway to ask in this process; it cannot notify this
			// process either. Closing frees the cards; a payment that
			// arrives later is a late payment.
			s.log().WarnContext(ctx, "closing without a trade check: provider not enabled", "order", no, "provider", o.Provider)
			continue
		}
		br := s.breaker(p.Name())
		allowed, probe := br.allow(s.Ledger.now(), failures, cooldown)
		if probed := probes[p.Name()]; !allowed && probed != nil {
			// This provider's probe is under way in this batch: its
			// answer decides whether this order is checked or deferred,
			// while the other providers' orders go on.
			wg.Add(1)
			go func() {
				defer wg.Done()
				verdicts[i] = tradeUnsure
				select {
				case <-probed:
				case <-bctx.Done():
					return
				}
				if ok, _ := br.allow(s.Ledger.now(), failures, cooldown); !ok {
					return
				}
				select {
				case sem <- struct{}{}:
				case <-bctx.Done():
					return
				}
				defer func() { <-sem }()
				verdicts[i], status[i] = s.checkTrade(bctx, p, o, timeout)
			}()
			continue
		}
		if !allowed {
			verdicts[i] = tradeUnsure
			breakerOpen++
			continue
		}
		var answered chan struct{}
		if probe {
			answered = make(chan struct{})
			probes[p.Name()] = answered
		}
		if bctx.Err() == nil {
			select {
			case sem <- struct{}{}:
			case <-bctx.Done():
			}
		}
		if bctx.Err() != nil {
			verdicts[i] = tradeUnsure
			skipped++
			if answered != nil {
				close(answered)
			}
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			if answered != nil {
				defer close(answered)
			}
			verdicts[i], status[i] = s.checkTrade(bctx, p, o, timeout)
		}()
	}
	wg.Wait()
	if skipped > 0 || breakerOpen > 0 {
		s.log().WarnContext(ctx, "orders deferred unchecked", "out_of_budget", skipped, "provider_breaker_open", breakerOpen, "budget", s.checkBudget())
	}
	retryAt := s.Ledger.DBTime().Add(s.checkRetry()) // a due time, as the queues judge them
	for i, no := range orderNos {
		o := dueByNo[no]
		switch verdicts[i] {
		case tradeNotPaid:
			closeNow = append(closeNow, no)
		case tradeSettled:
			decided = append(decided, CloseResult{OrderNo: no, Outcome: CloseSkipped, Status: status[i], ProductID: o.ProductID, ExpiresAt: o.ExpiresAt})
		default:
			decided = append(decided, CloseResult{OrderNo: no, Outcome: CloseDeferred, Status: OrderPending, ProductID: o.ProductID,
				ExpiresAt: o.ExpiresAt, RetryAt: retryAt})
		}
	}
	return closeNow, decided, dueBy, nil
}

// checkTrade asks o's gateway about its trade: unpaid, it is closed at the
// gateway so that it can no longer be paid; paid, the payment is recorded.
// It returns the verdict and, when settled, the order's status now.
func (s *Shop) checkTrade(ctx context.Context, p providers.Provider, o *Order, timeout time.Duration) (tradeVerdict, OrderStatus) {
	cctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	st, err := p.QueryPayment(cctx, o.OrderNo)
	s.providerCalled(ctx, p, err)
	if err != nil {
		s.log().WarnContext(ctx, "trade query before close failed; the order stays open and is checked again", "order", o.OrderNo, "provider", p.Name(), "err", err)
		return tradeUnsure, ""
	}
	if st.Status == providers.TradeClosed {
		// Closed unpaid (the gateway closes a trade itself at the
		// time_expire kami sends) or refunded in full: it can no longer
		// be paid, and a gateway asked to close it again refuses.
		return tradeNotPaid, ""
	}
	if st.Status != providers.TradePaid {
		err := p.ClosePayment(cctx, o.OrderNo)
		s.providerCalled(ctx, p, err)
		if err == nil {
			return tradeNotPaid, ""
		}
		if providers.KindOf(err) != providers.Rejected {
			s.log().WarnContext(ctx, "closing the trade at the provider failed; the order stays open and is checked again", "order", o.OrderNo, "provider", p.Name(), "err", err)
			return tradeUnsure, ""
		}
		// The gateway refuses to close the trade: it was paid since the
		// query (Alipay's ACQ.TRADE_STATUS_ERROR, WeChat's ORDERPAID), or
		// it is closed already (Alipay refuses to close any trade not
		// waiting for payment: one it closed itself at its time_expire, or
		// one an earlier check closed before its close transaction failed).
		// Never close a paid one: ask again and record the payment.
		st, err = p.QueryPayment(cctx, o.OrderNo)
		if err == nil && st.Status == providers.TradeClosed {
			return tradeNotPaid, "" // closed: it can no longer be paid
		}
		if err != nil || st.Status != providers.TradePaid {
			msg := fmt.Sprintf("%s refused to close the trade of a PENDING order and does not report it paid (%s); the order stays open and is checked again",
				p.Name(), errorDetailOr(err, "trade "+string(st.Status)))
			s.log().ErrorContext(ctx, "trade close refused before close", "order", o.OrderNo, "provider", p.Name(), "detail", msg)
			s.Ledger.alerts.Alert(ctx, Alert{Kind: "trade_check_failed", Subject: o.OrderNo, Message: msg})
			return tradeUnsure, ""
		}
	}
	// Recording a payment the gateway holds is worth finishing even if
	// the caller gives up: it delivers the buyer's order.
	rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
	defer rcancel()
	res, err := s.RecordPayment(rctx, Payment{Provider: p.Name(), NotifyID: "query:" + st.TradeNo, OrderNo: o.OrderNo,
		TradeNo: st.TradeNo, AmountFen: st.AmountFen, PaidAt: st.PaidAt, Raw: "trade query before close"})
	switch {
	case err != nil && (ErrorCode(err) == EINTERNAL || ErrorCode(err) == EUNAVAILABLE):
		// The money has arrived and is not in the ledger: a person must
		// know until a later check records it.
		msg := fmt.Sprintf("%s reports trade %s paid (%s); recording it failed, so the order stays open and is checked again",
			p.Name(), st.TradeNo, money.Format(st.AmountFen))
		s.log().ErrorContext(ctx, "recording a payment found before close failed", "order", o.OrderNo, "provider", p.Name(), "trade", st.TradeNo, "err", err)
		s.Ledger.alerts.Alert(ctx, Alert{Kind: "payment_unrecorded", Subject: o.OrderNo, Message: msg})
		return tradeUnsure, ""
	case err != nil:
		// Refused by the ledger (an amount or provider that does not
		// match), which alerted; the order is not closed over it.
		s.log().WarnContext(ctx, "payment found before close was refused; the order stays open", "order", o.OrderNo, "err", err)
		return tradeUnsure, ""
	case res.Order == nil || res.Order.Status == OrderPending:
		// Recorded before as refused: still a person's decision.
		return tradeUnsure, ""
	}
	return tradeSettled, res.Order.Status
}

// errorDetailOr is errorDetail(err), or alt when err is nil.
func errorDetailOr(err error, alt string) string {
	if err == nil {
		return alt
	}
	return errorDetail(err)
}

// RecordPayment applies a payment and sees to what follows: subscribers
// hear of the change, a refund it created is scheduled.
func (s *Shop) RecordPayment(ctx context.Context, p Payment) (*PaymentResult, error) {
	res, err := s.Ledger.RecordPayment(ctx, p)
	if err != nil {
		return nil, err
	}
	s.observer().PaymentRecorded(res.Outcome)
	s.logPayment(ctx, p, res)
	if res.Outcome != PaymentDuplicate {
		s.changed(ctx, res.Order)
	}
	if res.Outcome == PaymentDelivered && s.Scheduler != nil {
		// A paid order never closes: its close task leaves the queue now,
		// so the backlog counts only orders that can still close. The
		// payments of one batch send these together (one round trip).
		if err := s.Scheduler.CancelClose(ctx, res.Order.OrderNo); err != nil {
			s.log().DebugContext(ctx, "close task of a paid order left queued; its close will skip it", "order", res.Order.OrderNo, "err", err)
		}
	}
	if res.Outcome == PaymentLateDelivered && s.Gate != nil {
		// The re-locked cards were counted as free again when the order
		// closed; the counter is advisory, so a failed take only means
		// the counter stays high until reconciliation (the database still
		// refuses a card it does not have).
		if _, err := s.Gate.Take(context.WithoutCancel(ctx), res.Order.ProductID, res.Order.Quantity); err != nil {
			s.log().WarnContext(ctx, "stock gate take after late delivery failed", "order", res.Order.OrderNo, "err", err)
		}
	}
	if res.Outcome == PaymentLateDelivered {
		s.stockFell(context.WithoutCancel(ctx), res.Order.ProductID)
	}
	if res.Refund != nil {
		s.scheduleRefund(ctx, res.Refund)
	}
	if res.Mail != nil {
		s.ScheduleMail(ctx, res.Mail)
	}
	return res, nil
}

// ScheduleMail puts a queued mail on the mail queue; a lost schedule is
// rebuilt by the mail sweeper.
func (s *Shop) ScheduleMail(ctx context.Context, m *MailSend) {
	if s.MailQueue == nil || m.Status != MailQueued {
		return
	}
	if err := s.MailQueue.ScheduleMail(ctx, m.ID, m.NextDueAt); err != nil {
		s.log().WarnContext(ctx, "schedule mail failed; the sweeper will", "mail", m.ID, "err", err)
	}
}

func (s *Shop) scheduleRefund(ctx context.Context, r *Refund) {
	if s.Scheduler == nil || r.Status != RefundProcessing {
		return
	}
	due := r.NextRetryAt
	if due.IsZero() {
		due = s.Ledger.DBTime()
	}
	if err := s.Scheduler.ScheduleRefund(ctx, r.RefundNo, due); err != nil {
		s.log().WarnContext(ctx, "schedule refund failed; the sweeper will", "refund", r.RefundNo, "err", err)
	}
}

// HandleNotification verifies a provider's notification and applies it.
// It returns the error to acknowledge with (nil: success). A notification
// that fails verification changes nothing.
func (s *Shop) HandleNotification(ctx context.Context, providerName string, header http.Header, body []byte) (providers.Provider, error) {
	p, ok := s.Providers.Get(providerName)
	if !ok {
		return nil, Errorf(ENOTFOUND, "no provider %q", providerName)
	}
	ev, err := p.ParseNotification(ctx, header, body)
	if err != nil {
		return p, err
	}
	switch ev.Kind {
	case providers.EventPaymentSucceeded:
		_, err = s.RecordPayment(ctx, Payment{Provider: p.Name(), NotifyID: ev.NotifyID, OrderNo: ev.OrderNo,
			TradeNo: ev.TradeNo, AmountFen: ev.AmountFen, PaidAt: ev.PaidAt, Raw: string(body)})
	case providers.EventRefundSucceeded, providers.EventRefundFailed:
		var r *Refund
		var moved bool
		r, moved, err = s.Ledger.RecordRefundEvent(ctx, RefundEvent{Provider: p.Name(), NotifyID: ev.NotifyID, RefundNo: ev.RefundNo,
			Succeeded: ev.Kind == providers.EventRefundSucceeded, Raw: string(body)})
		if err == nil && r != nil {
			if r.Status == RefundSucceeded {
				o, oerr := s.Ledger.Order(ctx, r.OrderNo)
				if oerr == nil {
					s.changed(ctx, o)
				}
				if moved {
					s.logRefunded(ctx, r, o, "notification")
				}
			} else if moved { // the gateway reported the refund failed
				result := "retry"
				if r.Status == RefundFailed {
					result = "failed"
				}
				s.logRefundAttempt(ctx, r, r.RetryCount, result, "the gateway reported the refund failed")
			}
			s.scheduleRefund(ctx, r)
		}
	}
	return p, err
}

// ProcessRefund makes one attempt at a PROCESSING refund that is due: if an
// earlier attempt was made, it first asks the provider for the refund's
// state, so a timeout can never become a second refund; then it refunds
// under the same refund number. It records the outcome and schedules the
// next attempt. A refund that is not due or not PROCESSING is left alone.
func (s *Shop) ProcessRefund(ctx context.Context, refundNo string) (*Refund, error) {
	r, err := s.Ledger.Refund(ctx, refundNo)
	if err != nil {
		return nil, err
	}
	// Due by the database's clock, as the refund queue claimed it: by
	// this process's own, a slow clock would answer "not due" to a claim
	// in a loop.
	if r.Status != RefundProcessing || r.NextRetryAt.After(s.Ledger.DBTime().Add(time.Second)) {
		return r, nil
	}
	// A refund that may have been sent before (an attempt failed or was
	// left unknown, the provider accepted it and is still processing it,
	// or an admin retried a FAILED one: its attempts' last error is kept)
	// is asked about before anything is sent again.
	sentBefore := r.RetryCount > 0 || r.ProviderRefundID != "" || r.LastError != ""
	p, ok := s.Providers.Get(r.Provider)
	if !ok {
		// No gateway said no: one sent before may have been made.
		detail := "provider " + r.Provider + " is not enabled"
		if sentBefore {
			return s.refundUnconfirmed(ctx, r, detail)
		}
		return s.refundFailed(ctx, r, detail)
	}
	req := providers.RefundRequest{RefundNo: r.RefundNo, OrderNo: r.OrderNo, TradeNo: r.TradeNo,
		RefundFen: r.AmountFen, TotalFen: r.PaidFen, Reason: r.Reason}
	if sentBefore {
		res, err := p.QueryRefund(ctx, req)
		switch {
		case err != nil && r.ProviderRefundID != "":
			// The gateway accepted this refund before: an unanswered look
			// at it is no failed attempt. It stays PROCESSING on the slow
			// poll (a day of that is the stale-refund alert).
			return s.refundAwaiting(ctx, r, providers.RefundResult{}, "refund query: "+errorDetail(err)+"; accepted by the provider before, still awaited")
		case err != nil:
			// The state is unknown: do not refund blind, and do not call
			// it failed either (an earlier attempt may have been made).
			return s.refundUnconfirmed(ctx, r, "refund query: "+errorDetail(err))
		case res.State == providers.RefundSucceeded:
			return s.refundSucceeded(ctx, r, res.ProviderRefundID)
		case res.State == providers.RefundProcessing:
			return s.refundAwaiting(ctx, r, res, "still processing at the provider")
		}
		// NOT_FOUND or FAILED: refunding under the same number is safe.
	}
	res, err := p.Refund(ctx, req)
	if err != nil {
		if providers.KindOf(err) == providers.Temporary {
			// No answer: the gateway may have made the refund.
			return s.refundUnconfirmed(ctx, r, errorDetail(err))
		}
		return s.refundFailed(ctx, r, errorDetail(err))
	}
	switch res.State {
	case providers.RefundSucceeded:
		return s.refundSucceeded(ctx, r, res.ProviderRefundID)
	case providers.RefundProcessing:
		return s.refundAwaiting(ctx, r, res, "accepted, processing at the provider")
	default:
		return s.refundFailed(ctx, r, "provider refused: "+res.Detail)
	}
}

func (s *Shop) refundSucceeded(ctx context.Context, r *Refund, providerRefundID string) (*Refund, error) {
	s.observer().RefundAttempt("succeeded", r.RetryCount+1)
	r, changed, err := s.Ledger.RefundSucceeded(ctx, r.RefundNo, providerRefundID)
	if err == nil && changed {
		o, oerr := s.Ledger.Order(ctx, r.OrderNo)
		if oerr == nil {
			s.changed(ctx, o)
		}
		s.logRefunded(ctx, r, o, "refund call")
	}
	return r, err
}

// refundAwaiting records that the provider accepted the refund and is
// still processing it: not a failure (a WeChat refund to a bank card takes
// days). The refund stays PROCESSING and is asked about again on the slow
// poll; one processing for over a day is the nightly reconciliation's
// stale-refund alert.
func (s *Shop) refundAwaiting(ctx context.Context, r *Refund, res providers.RefundResult, detail string) (*Refund, error) {
	attempt := r.RetryCount + 1
	if res.Detail != "" {
		detail += ": " + res.Detail
	}
	r, err := s.Ledger.RefundAwaiting(ctx, r.RefundNo, r.RetryCount, res.ProviderRefundID, detail)
	if err != nil {
		return nil, err
	}
	s.observer().RefundAttempt("processing", attempt)
	s.logRefundAttempt(ctx, r, attempt, "processing", detail)
	s.scheduleRefund(ctx, r)
	return r, nil
}

func (s *Shop) refundFailed(ctx context.Context, r *Refund, detail string) (*Refund, error) {
	return s.refundMissed(ctx, r, detail, s.Ledger.RefundAttemptFailed)
}

// refundUnconfirmed records an attempt whose outcome is unknown: past the
// backoff the refund stays PROCESSING on the slow poll (result
// "unconfirmed"), never FAILED.
func (s *Shop) refundUnconfirmed(ctx context.Context, r *Refund, detail string) (*Refund, error) {
	return s.refundMissed(ctx, r, detail, s.Ledger.RefundUnconfirmed)
}

func (s *Shop) refundMissed(ctx context.Context, r *Refund, detail string,
	record func(ctx context.Context, refundNo string, attempt int, detail string) (*Refund, error)) (*Refund, error) {
	attempt := r.RetryCount + 1
	r, err := record(ctx, r.RefundNo, r.RetryCount, detail)
	if err != nil {
		return nil, err
	}
	result := "retry"
	switch {
	case r.Status == RefundFailed:
		result = "failed"
	case attempt > len(s.Ledger.cfg.RefundBackoff):
		result = "unconfirmed"
	}
	s.observer().RefundAttempt(result, attempt)
	s.logRefundAttempt(ctx, r, attempt, result, detail)
	s.scheduleRefund(ctx, r)
	return r, nil
}

// errorDetail is what a refund's last_error keeps of a provider error: the
// kind and the gateway's code, never keys or bodies (providers.Error
// promises that).
func errorDetail(err error) string {
	var pe *providers.Error
	if errors.As(err, &pe) {
		return pe.Error()
	}
	return "provider call failed: " + err.Error()
}

// RequestRefund refunds a delivered order for an admin and schedules it.
func (s *Shop) RequestRefund(ctx context.Context, orderNo, reason, actor string) (*Refund, error) {
	r, err := s.Ledger.RequestRefund(ctx, orderNo, reason, actor)
	if err != nil {
		return nil, err
	}
	s.logRefundRequested(ctx, r, OrderPaid, actor)
	if o, err := s.Ledger.Order(ctx, orderNo); err == nil {
		s.changed(ctx, o)
	}
	s.scheduleRefund(ctx, r)
	return r, nil
}

// RetryRefund restarts a FAILED refund for an admin and schedules it now.
func (s *Shop) RetryRefund(ctx context.Context, refundNo, actor string) (*Refund, error) {
	r, err := s.Ledger.RetryRefund(ctx, refundNo, actor)
	if err != nil {
		return nil, err
	}
	s.logRefundRequested(ctx, r, "", actor)
	s.scheduleRefund(ctx, r)
	return r, nil
}
