package domain_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/providers"
	"kami/providers/sandbox"
)

// paidAtGateway is a sandbox whose gateway says every trade was paid (its
// notification was lost), and which counts the trades it was told to close.
type paidAtGateway struct {
	*sandbox.Provider
	amountFen int64
	closed    atomic.Int64
}

func (p *paidAtGateway) QueryPayment(ctx context.Context, orderNo string) (providers.TradeState, error) {
	return providers.TradeState{Status: providers.TradePaid, TradeNo: "T-" + orderNo, AmountFen: p.amountFen}, nil
}

func (p *paidAtGateway) ClosePayment(ctx context.Context, orderNo string) error {
	p.closed.Add(1)
	return nil
}

// tickingClock moves on by a microsecond every time it is read, so that
// two reads a moment apart see different times, as in production.
type tickingClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *tickingClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(time.Microsecond)
	return c.t
}

// TestCloseAtTheDueBoundary: an order claimed a microsecond before it
// expires (the queue's scores are milliseconds) must not be closed without
// the pre-close question to its gateway, even though it expires while the
// close runs. Here the gateway says it was paid: the order must end PAID,
// never CLOSED, and its trade must not be closed at the gateway.
func TestCloseAtTheDueBoundary(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{OrderTTL: time.Minute})
		p := b.product(t, 500, 1)
		o := b.order(t, p, 1).Order
		sb, err := sandbox.New(sandbox.Config{Secret: "s", BaseURL: "http://127.0.0.1/"})
		if err != nil {
			t.Fatal(err)
		}
		gw := &paidAtGateway{Provider: sb, amountFen: o.AmountFen}
		shop := &domain.Shop{Ledger: b.ledger, Providers: providers.NewRegistry(gw), PreCloseCheck: true, Log: slog.New(slog.NewTextHandler(io.Discard, nil))}

		clock := &tickingClock{t: o.ExpiresAt.Add(-2 * time.Microsecond)} // the first read is one microsecond early
		b.ledger.Now, b.ledger.DBClock = clock.Now, clock.Now
		rs, err := shop.CloseOrders(b.ctx, []string{o.OrderNo}, domain.CloseTimeout)
		if err != nil {
			t.Fatal(err)
		}
		if len(rs) != 1 || rs[0].Outcome != domain.CloseNotDue {
			t.Fatalf("results %+v, want the order not due yet", rs)
		}
		if gw.closed.Load() != 0 {
			t.Fatal("the trade of an order not due was closed at the gateway")
		}
		// The next round, when it is due, asks the gateway and delivers.
		rs, err = shop.CloseOrders(b.ctx, []string{o.OrderNo}, domain.CloseTimeout)
		if err != nil {
			t.Fatal(err)
		}
		if got, _ := b.ledger.Order(b.ctx, o.OrderNo); got.Status != domain.OrderPaid {
			t.Fatalf("order %s after the due close, results %+v; want PAID", got.Status, rs)
		}
		b.mustAudit(t)
	})
}

// failQueries makes the database fail the statements whose text holds a
// given string while it is armed, as a database that errs or times out in
// the middle of a flow: the statement runs under a cancelled context.
type failQueries struct {
	mu    sync.Mutex
	match string
	left  int // statements still to fail; < 0: until disarmed
	hits  int
}

func (f *failQueries) arm(match string, n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.match, f.left = match, n
}

func (f *failQueries) BeforeQuery(ctx context.Context, ev *bun.QueryEvent) context.Context {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.left == 0 || f.match == "" || !strings.Contains(ev.Query, f.match) {
		return ctx
	}
	f.left--
	f.hits++
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	return cctx
}

func (f *failQueries) AfterQuery(context.Context, *bun.QueryEvent) {}

// checkingShop is a Shop over b's ledger that checks every due order at
// gw before closing it.
func checkingShop(b *bundle, ps ...providers.Provider) *domain.Shop {
	return &domain.Shop{Ledger: b.ledger, Providers: providers.NewRegistry(ps...), PreCloseCheck: true,
		ProviderTimeout: gatewayTimeout, Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
}

// paidDueOrder is a due order whose buyer paid at a gateway whose
// notification was lost, over a database that fail can break, and the
// checking shop that closes it.
func paidDueOrder(t *testing.T, db *bun.DB) (*bundle, *failQueries, *paidAtGateway, *domain.Shop, *domain.Order) {
	t.Helper()
	fail := &failQueries{}
	b := setup(t, db.WithQueryHook(fail), domain.Config{OrderTTL: time.Minute})
	o := b.order(t, b.product(t, 500, 1), 1).Order
	sb, err := sandbox.New(sandbox.Config{Secret: "s", BaseURL: "http://127.0.0.1/"})
	if err != nil {
		t.Fatal(err)
	}
	gw := &paidAtGateway{Provider: sb, amountFen: o.AmountFen}
	b.clock.Advance(2 * time.Minute)
	return b, fail, gw, checkingShop(b, gw), o
}

func closeOne(t *testing.T, shop *domain.Shop, ctx context.Context, orderNo string) (domain.CloseResult, error) {
	t.Helper()
	rs, err := shop.CloseOrders(ctx, []string{orderNo}, domain.CloseTimeout)
	if err != nil {
		return domain.CloseResult{}, err
	}
	if len(rs) != 1 || rs[0].OrderNo != orderNo {
		t.Fatalf("close results %+v, want one for %s", rs, orderNo)
	}
	return rs[0], nil
}

// TestPaidButUnrecordedIsNotClosed: the gateway says the due order was
// paid, and recording that payment fails (the database errs). The order
// must not close (its money is at the gateway): it stays PENDING, answered
// DEFERRED with a time to try again, an alert is raised, and the next
// check records the payment and delivers.
func TestPaidButUnrecordedIsNotClosed(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b, fail, gw, shop, o := paidDueOrder(t, db)

		fail.arm("payment_notification", -1) // every write of the payment fails
		r, err := closeOne(t, shop, b.ctx, o.OrderNo)
		if err != nil {
			t.Fatal(err)
		}
		if got, _ := b.ledger.Order(b.ctx, o.OrderNo); got.Status != domain.OrderPending {
			t.Fatalf("order %s after a paid trade could not be recorded (result %+v); want PENDING", got.Status, r)
		}
		if r.Outcome != domain.CloseDeferred || !r.RetryAt.After(b.clock.Now()) {
			t.Fatalf("result %+v, want DEFERRED with a retry time ahead", r)
		}
		if b.alerts.count("payment_unrecorded") != 1 {
			t.Fatalf("alerts %v, want one payment_unrecorded", b.alerts.kinds())
		}
		if gw.closed.Load() != 0 {
			t.Fatal("the trade of a paid order was closed at the gateway")
		}

		fail.arm("", 0)
		if r, err = closeOne(t, shop, b.ctx, o.OrderNo); err != nil {
			t.Fatal(err)
		}
		if got, _ := b.ledger.Order(b.ctx, o.OrderNo); got.Status != domain.OrderPaid || r.Outcome != domain.CloseSkipped {
			t.Fatalf("order %s, result %+v after the database healed; want PAID and skipped", got.Status, r)
		}
		b.mustAudit(t)
	})
}

// TestUncheckedOrdersAreNotClosed: the pre-close check cannot even read
// the orders of the batch (the database errs): nothing of the batch may
// close unchecked. The call fails, the order stays PENDING, and the next
// close (the lease brings the batch back) checks and delivers it.
func TestUncheckedOrdersAreNotClosed(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b, fail, _, shop, o := paidDueOrder(t, db)
		obs := &closeFailures{}
		shop.Observer = obs

		fail.arm("orders", 1) // the check's first read
		if r, err := closeOne(t, shop, b.ctx, o.OrderNo); err == nil && r.Outcome == domain.Closed {
			t.Fatalf("an order nobody checked was closed: %+v", r)
		}
		// The failed batch is counted (kami_close_failures_total,
		// closeSuccessRate): a check that cannot read is a close failure.
		if n := obs.orders.Load(); n != 1 {
			t.Fatalf("close failures counted for %d orders, want 1", n)
		}
		if got, _ := b.ledger.Order(b.ctx, o.OrderNo); got.Status != domain.OrderPending {
			t.Fatalf("order %s after its check could not run; want PENDING", got.Status)
		}
		if _, err := closeOne(t, shop, b.ctx, o.OrderNo); err != nil {
			t.Fatal(err)
		}
		if got, _ := b.ledger.Order(b.ctx, o.OrderNo); got.Status != domain.OrderPaid {
			t.Fatalf("order %s once the check ran; want PAID", got.Status)
		}
		b.mustAudit(t)
	})
}

// closeFailures is an Observer that counts the orders of failed close
// batches.
type closeFailures struct {
	orders atomic.Int64
}

func (o *closeFailures) OrderPlaced()                                                       {}
func (o *closeFailures) OrderRefused(string)                                                {}
func (o *closeFailures) OrderClosed(domain.CloseReason, domain.CloseOutcome, time.Duration) {}
func (o *closeFailures) CloseFailed(orders int)                                             { o.orders.Add(int64(orders)) }
func (o *closeFailures) PaymentRecorded(domain.PaymentOutcome)                              {}
func (o *closeFailures) RefundAttempt(string, int)                                          {}

// payDuringQuery is a real gateway client whose first trade query is
// answered as of just before the buyer paid: the payment lands between
// the pre-close query and the close of the trade.
type payDuringQuery struct {
	providers.Provider
	once sync.Once
	pay  func()
}

func (p *payDuringQuery) QueryPayment(ctx context.Context, orderNo string) (providers.TradeState, error) {
	st, err := p.Provider.QueryPayment(ctx, orderNo)
	p.once.Do(p.pay)
	return st, err
}

// TestTradeCloseRefusedAsPaid: the gateway refuses to close the trade of
// a due order because it was paid meanwhile (Alipay ACQ.TRADE_STATUS_ERROR,
// WeChat ORDERPAID). That answer means "paid": the order is delivered,
// never closed.
func TestTradeCloseRefusedAsPaid(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		for _, gw := range gateways(t) {
			t.Run(gw.name, func(t *testing.T) {
				sb := newStatementBundle(t, db, gw, domain.Config{OrderTTL: time.Minute})
				o := sb.place(t)
				racy := &payDuringQuery{Provider: gw.provider, pay: func() { gw.pay(t, o.OrderNo, o.AmountFen) }}
				shop := checkingShop(sb.bundle, racy)
				sb.clock.Advance(2 * time.Minute)

				r, err := closeOne(t, shop, sb.ctx, o.OrderNo)
				if err != nil {
					t.Fatal(err)
				}
				if got := sb.order(t, o.OrderNo); got.Status != domain.OrderPaid || r.Outcome == domain.Closed {
					t.Fatalf("order %s, result %+v: the gateway refused to close a paid trade; want PAID", got.Status, r)
				}
				if sb.cardStatuses(t, o.OrderNo)[domain.CardSold] != 1 {
					t.Fatalf("cards %v, want the order's card SOLD", sb.cardStatuses(t, o.OrderNo))
				}
				sb.mustAudit(t)
			})
		}
	})
}

// TestFastProcessClockClosesNothingEarly: a process whose own clock runs
// an hour fast neither closes an order before it is due by the database's
// clock (nor closes its trade at the gateway), nor gives a new order an
// expiry an hour late: due times are the database's.
func TestFastProcessClockClosesNothingEarly(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{OrderTTL: time.Minute})
		p := b.product(t, 500, 2)
		o := b.order(t, p, 1).Order // placed by a process with a true clock
		sb, err := sandbox.New(sandbox.Config{Secret: "s", BaseURL: "http://127.0.0.1/"})
		if err != nil {
			t.Fatal(err)
		}
		gw := &paidAtGateway{Provider: sb, amountFen: o.AmountFen}
		shop := checkingShop(b, gw)

		b.ledger.Now = func() time.Time { return b.clock.Now().Add(time.Hour) } // this process runs fast
		r, err := closeOne(t, shop, b.ctx, o.OrderNo)
		if err != nil {
			t.Fatal(err)
		}
		if r.Outcome != domain.CloseNotDue || gw.closed.Load() != 0 {
			t.Fatalf("a fast process's close: %+v, %d trades closed at the gateway; want NOT_DUE and none", r, gw.closed.Load())
		}
		rs, err := b.ledger.CloseOrders(b.ctx, []string{o.OrderNo}, domain.CloseTimeout)
		if err != nil || rs[0].Outcome != domain.CloseNotDue {
			t.Fatalf("the ledger's close in a fast process: %+v, %v; want NOT_DUE", rs, err)
		}

		placed := b.order(t, p, 1).Order // placed by the fast process
		if want := b.clock.Now().Add(time.Minute); !placed.ExpiresAt.Equal(want) {
			t.Fatalf("a fast process's order expires at %s, want %s (the database's now plus the TTL)", placed.ExpiresAt, want)
		}
		if got, _ := b.ledger.Order(b.ctx, o.OrderNo); got.Status != domain.OrderPending {
			t.Fatalf("order %s, want PENDING until it is due", got.Status)
		}
	})
}

// TestDatabaseClockIsRead: with no stand-in, the ledger reads the
// database's own clock, on every database kind; a process clock an hour
// fast changes neither a new order's expiry nor what is due.
func TestDatabaseClockIsRead(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{OrderTTL: time.Minute})
		b.ledger.DBClock = nil
		b.ledger.Now = func() time.Time { return time.Now().Add(time.Hour) }
		p := b.product(t, 500, 1)
		before := time.Now().Add(-time.Minute) // generous: the database's clock may lag this one a little
		o := b.order(t, p, 1).Order
		after := time.Now().Add(time.Minute)
		if o.ExpiresAt.Before(before.Add(time.Minute)) || o.ExpiresAt.After(after.Add(time.Minute)) {
			t.Fatalf("expires at %s, want about the database's now plus a minute (%s .. %s)", o.ExpiresAt, before.Add(time.Minute), after.Add(time.Minute))
		}
		rs, err := b.ledger.CloseOrders(b.ctx, []string{o.OrderNo}, domain.CloseTimeout)
		if err != nil || rs[0].Outcome != domain.CloseNotDue {
			t.Fatalf("close by a fast process: %+v, %v; want NOT_DUE", rs, err)
		}
		if err := b.ledger.SyncClock(b.ctx); err != nil {
			t.Fatal(err)
		}
		if d := time.Until(b.ledger.DBTime()); d > time.Minute || d < -time.Minute {
			t.Fatalf("DBTime is %s away from the machine's clock, want the database's time despite the fast process clock", d)
		}
	})
}

// closedTradeGateway is a sandbox that answers a close of a trade that is
// closed already as Alipay documents for alipay.trade.close: refused,
// ACQ.TRADE_STATUS_ERROR ("only a trade waiting for the buyer's payment
// can be closed"). A trade is closed already when the gateway closed it
// itself at its time_expire (kami sends the order's expires_at), or when
// an earlier close attempt closed it and the ledger's transaction then
// failed.
//
// expiresNow: the gateway's own close at time_expire comes just as kami's
// close call does, after kami's first look found the trade waiting.
type closedTradeGateway struct {
	*sandbox.Provider
	closes     atomic.Int64
	expiresNow bool
}

func (g *closedTradeGateway) ClosePayment(ctx context.Context, orderNo string) error {
	g.closes.Add(1)
	if g.expiresNow {
		if err := g.Provider.ClosePayment(ctx, orderNo); err != nil {
			return err
		}
	}
	st, err := g.Provider.QueryPayment(ctx, orderNo)
	if err != nil {
		return err
	}
	if st.Status == providers.TradeClosed {
		return &providers.Error{Kind: providers.Rejected, Provider: g.Name(), Op: "close", Code: "ACQ.TRADE_STATUS_ERROR", Message: "交易状态不合法"}
	}
	return g.Provider.ClosePayment(ctx, orderNo)
}

// TestDueOrderWithAClosedTradeCloses: a due order whose trade the gateway
// reports closed can no longer be paid: the pre-close check lets it close.
// Found closed at the first look, the trade is not asked to close again (a
// call the gateway would refuse); closed by the gateway itself between the
// first look and kami's close call, the refusal is followed by a second
// look that finds it closed. Before, either kept the order PENDING, its
// cards locked, checked and alerted every minute for ever: Alipay refuses
// to close any trade not waiting for payment (ACQ.TRADE_STATUS_ERROR), and
// a refusal was taken to mean paid.
func TestDueOrderWithAClosedTradeCloses(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name       string
		expiresNow bool
		closes     int64 // close calls asked of the gateway
	}{
		{"closed before the check", false, 0},
		{"closed by the gateway as kami asks", true, 1},
	} {
		dbtest.Each(t, func(t *testing.T, db *bun.DB) {
			b := setup(t, db, domain.Config{OrderTTL: time.Minute})
			o := b.order(t, b.product(t, 500, 1), 1).Order
			sb, err := sandbox.New(sandbox.Config{Secret: "s", BaseURL: "http://127.0.0.1/"})
			if err != nil {
				t.Fatal(err)
			}
			gw := &closedTradeGateway{Provider: sb, expiresNow: c.expiresNow}
			if !c.expiresNow {
				// The gateway closed the unpaid trade itself at its time_expire.
				if err := sb.ClosePayment(b.ctx, o.OrderNo); err != nil {
					t.Fatal(err)
				}
			}
			b.clock.Advance(2 * time.Minute)
			shop := checkingShop(b, gw)
			r, err := closeOne(t, shop, b.ctx, o.OrderNo)
			if err != nil {
				t.Fatal(err)
			}
			if got, _ := b.ledger.Order(b.ctx, o.OrderNo); got.Status != domain.OrderClosed || r.Outcome != domain.Closed || r.Released != 1 {
				t.Fatalf("%s: order %s, result %+v: its trade is closed at the gateway; want CLOSED with its card released", c.name, got.Status, r)
			}
			if n := gw.closes.Load(); n != c.closes {
				t.Errorf("%s: %d close calls to the gateway, want %d", c.name, n, c.closes)
			}
			if n := b.alerts.count("trade_check_failed"); n != 0 {
				t.Errorf("%s: %d trade_check_failed alerts for a trade the gateway reports closed; want none", c.name, n)
			}
			// A trade closed can no longer be paid: Pay refuses it.
			if _, _, err := sb.Pay(o.OrderNo, o.AmountFen); !errors.Is(err, sandbox.ErrTradeClosed) {
				t.Fatalf("%s: pay after the close: %v, want ErrTradeClosed", c.name, err)
			}
			b.mustAudit(t)
		})
	}
}
