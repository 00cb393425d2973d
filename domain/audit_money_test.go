package domain_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/providers"
	"kami/providers/sandbox"
)

// TestRefusedRedeliveryInASplitBatch: a refused notification delivered
// again is answered as seen before (DUPLICATE), also when it shares a
// batch whose usual payments meet a surprise and are recorded one by one:
// the split must not wipe the answer the refusal already has (the batcher
// then answers "no answer", an internal error, and the gateway is told to
// send again).
func TestRefusedRedeliveryInASplitBatch(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 300, 10)
		order := func() *domain.Order { return b.order(t, p, 1).Order }
		pay := func(o *domain.Order, trade, notify string) domain.Payment {
			return domain.Payment{Provider: o.Provider, NotifyID: notify, OrderNo: o.OrderNo, TradeNo: trade, AmountFen: o.AmountFen, Raw: "{}"}
		}
		wrongOrder, seen, four, five := order(), order(), order(), order()
		wrong := pay(wrongOrder, "T-WRONG", "N-WRONG")
		wrong.AmountFen = 1
		if _, err := b.ledger.RecordPayment(b.ctx, wrong); domain.ErrorCode(err) != domain.EBADINPUT {
			t.Fatalf("first delivery of a wrong amount: %v, want BAD_INPUT", err)
		}
		b.pay(t, seen, "T-SEEN", "N-SEEN")
		// five's notification id was seen before: the shared insert fails
		// and the batch is split.
		res, errs := b.ledger.RecordPaymentsForTest(b.ctx, []domain.Payment{wrong, pay(four, "T-4", "N-4"), pay(five, "T-5", "N-SEEN")})
		if errs[0] != nil || res[0] == nil || res[0].Outcome != domain.PaymentDuplicate {
			t.Errorf("refused notification again, in a split batch: %+v, %v; want DUPLICATE", res[0], errs[0])
		}
		if errs[1] != nil || res[1] == nil || res[1].Outcome != domain.PaymentDelivered {
			t.Errorf("usual payment in a split batch: %+v, %v; want DELIVERED", res[1], errs[1])
		}
		if errs[2] != nil || res[2] == nil || res[2].Outcome != domain.PaymentDuplicate {
			t.Errorf("replayed notification id: %+v, %v; want DUPLICATE", res[2], errs[2])
		}
		if n := b.alerts.count("amount_mismatch"); n != 1 {
			t.Errorf("%d amount_mismatch alerts, want 1", n)
		}
		b.mustAudit(t)
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
