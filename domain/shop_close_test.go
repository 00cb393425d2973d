package domain_test

import (
	"context"
	"io"
	"log/slog"
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
		b.ledger.Now = clock.Now
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
