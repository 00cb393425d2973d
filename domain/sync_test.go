package domain_test

import (
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/providers"
	"kami/providers/fault"
)

func (sb *statementBundle) sync(t *testing.T, orderNo string) *domain.SyncResult {
	t.Helper()
	res, err := sb.shop.SyncOrder(sb.ctx, orderNo, "admin")
	if err != nil {
		t.Fatalf("SyncOrder(%s): %v", orderNo, err)
	}
	return res
}

func (sb *statementBundle) sells(t *testing.T, orderNo string) int64 {
	t.Helper()
	n, err := sb.db.NewSelect().Table("stock_flow").Where("order_no = ?", orderNo).Where("change_type = ?", domain.FlowSell).Count(sb.ctx)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func (sb *statementBundle) audits(t *testing.T, action, target string) int64 {
	t.Helper()
	n, err := sb.db.NewSelect().Model((*domain.AuditEntry)(nil)).Where("action = ?", action).Where("target = ?", target).Count(sb.ctx)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestSyncOrderDeliversALostPayment: "I paid", says the buyer; the
// gateway's notification never came. Syncing the order asks the gateway
// and delivers through the payment path; syncing again changes nothing.
func TestSyncOrderDeliversALostPayment(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		for _, gw := range gateways(t) {
			t.Run(gw.name, func(t *testing.T) {
				sb := newStatementBundle(t, db, gw, domain.Config{})
				o := sb.place(t)
				unpaid := sb.place(t)
				gw.pay(t, o.OrderNo, o.AmountFen) // the notification is lost

				res := sb.sync(t, o.OrderNo)
				if !res.Trade.Answered || res.Trade.State.Status != providers.TradePaid || res.Trade.Action != domain.ActDelivered {
					t.Fatalf("sync: %+v", res.Trade)
				}
				if res.Order.Status != domain.OrderPaid || res.Order.TradeNo != res.Trade.State.TradeNo || sb.cardStatuses(t, o.OrderNo)[domain.CardSold] != 1 {
					t.Fatalf("order after the sync: %+v, cards %v", res.Order, sb.cardStatuses(t, o.OrderNo))
				}

				again := sb.sync(t, o.OrderNo)
				if again.Trade.Action != domain.ActNone || again.Order.Status != domain.OrderPaid || sb.sells(t, o.OrderNo) != 1 {
					t.Fatalf("sync again: %+v, %d sales", again.Trade, sb.sells(t, o.OrderNo))
				}
				if n := len(sb.refundsOf(t, o.OrderNo)); n != 0 {
					t.Fatalf("%d refunds after syncing twice", n)
				}

				// An order not paid at the gateway is left as it is.
				res = sb.sync(t, unpaid.OrderNo)
				if res.Trade.Action != domain.ActNone || res.Order.Status != domain.OrderPending {
					t.Fatalf("sync of an unpaid order: %+v, order %s", res.Trade, res.Order.Status)
				}
				if n := sb.audits(t, "order.sync", o.OrderNo); n != 2 {
					t.Fatalf("%d audit entries for two syncs", n)
				}
				sb.mustAudit(t)
			})
		}
	})
}

// TestSyncOrderLatePayment: the buyer paid after the order closed; the
// sync takes the late-payment policy, once.
func TestSyncOrderLatePayment(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		gw := wechatGateway(t)
		sb := newStatementBundle(t, db, gw, domain.Config{OrderTTL: time.Minute})
		o := sb.place(t)
		gw.pay(t, o.OrderNo, o.AmountFen)
		sb.clock.Advance(2 * time.Minute)
		if _, err := sb.shop.CloseOrders(sb.ctx, []string{o.OrderNo}, domain.CloseTimeout); err != nil {
			t.Fatal(err)
		}
		res := sb.sync(t, o.OrderNo)
		if res.Trade.Action != domain.ActLateRefund || res.Order.Status != domain.OrderRefunding {
			t.Fatalf("sync of a closed order paid late: %+v, order %s", res.Trade, res.Order.Status)
		}
		again := sb.sync(t, o.OrderNo)
		if again.Trade.Action != domain.ActNone || len(again.Refunds) != 1 || again.Refunds[0].Action != domain.ActNone {
			t.Fatalf("sync again: %+v %+v", again.Trade, again.Refunds)
		}
		rs := sb.refundsOf(t, o.OrderNo)
		if len(rs) != 1 || rs[0].Status != domain.RefundProcessing {
			t.Fatalf("refunds %+v", rs)
		}
		// The sync never refunds: that is the refund worker's.
		if fen, calls := gw.refunded(rs[0].RefundNo); fen != 0 || calls != 0 {
			t.Fatalf("the sync refunded %d fen in %d calls", fen, calls)
		}
	})
}

// TestSyncOrderConfirmsRefund: a refund the gateway made whose answer was
// lost is confirmed by the sync; one kami has SUCCEEDED that the gateway
// never made is alerted.
func TestSyncOrderConfirmsRefund(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		for _, gw := range gateways(t) {
			t.Run(gw.name, func(t *testing.T) {
				sb := newStatementBundle(t, db, gw, domain.Config{})
				o := sb.place(t)
				sb.deliver(t, gw.pay(t, o.OrderNo, o.AmountFen))
				r, err := sb.shop.RequestRefund(sb.ctx, o.OrderNo, "buyer asked", "admin")
				if err != nil {
					t.Fatal(err)
				}
				gw.fault(fault.OpRefund, fault.TimeoutAfterEffect, 1)
				if cur, err := sb.shop.ProcessRefund(sb.ctx, r.RefundNo); err != nil || cur.Status != domain.RefundProcessing {
					t.Fatalf("refund with its answer lost: %+v, %v", cur, err)
				}

				res := sb.sync(t, o.OrderNo)
				if len(res.Refunds) != 1 || res.Refunds[0].State != providers.RefundSucceeded || res.Refunds[0].Action != domain.ActRefundConfirmed ||
					res.Refunds[0].Refund.Status != domain.RefundSucceeded || res.Order.Status != domain.OrderRefunded {
					t.Fatalf("sync: %+v, order %s", res.Refunds, res.Order.Status)
				}
				again := sb.sync(t, o.OrderNo)
				if again.Refunds[0].Action != domain.ActNone || again.Trade.Action != domain.ActNone {
					t.Fatalf("sync again: %+v %+v", again.Trade, again.Refunds)
				}
				if fen, calls := gw.refunded(r.RefundNo); fen != o.AmountFen || calls != 1 {
					t.Fatalf("the gateway refunded %d fen in %d calls, want once", fen, calls)
				}

				// kami has a refund SUCCEEDED that the gateway never made.
				forged := sb.place(t)
				sb.deliver(t, gw.pay(t, forged.OrderNo, forged.AmountFen))
				fr, err := sb.shop.RequestRefund(sb.ctx, forged.OrderNo, "", "admin")
				if err != nil {
					t.Fatal(err)
				}
				sb.ledger.RefundSucceeded(sb.ctx, fr.RefundNo, "")
				res = sb.sync(t, forged.OrderNo)
				if res.Refunds[0].State != providers.RefundNotFound || res.Refunds[0].Action != domain.ActAlerted || sb.alerts.count("gateway_disagrees") != 1 {
					t.Fatalf("sync of a refund the gateway never made: %+v, alerts %v", res.Refunds, sb.alerts.kinds())
				}
			})
		}
	})
}

// TestSyncOrderGatewayDown: a gateway that does not answer changes
// nothing and says so; an unknown order is NOT_FOUND.
func TestSyncOrderGatewayDown(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		gw := alipayGateway(t)
		sb := newStatementBundle(t, db, gw, domain.Config{})
		o := sb.place(t)
		gw.pay(t, o.OrderNo, o.AmountFen)
		gw.fault(fault.OpQueryPayment, fault.Server5xx, 1)
		res := sb.sync(t, o.OrderNo)
		if res.Trade.Answered || res.Trade.Action != domain.ActNone || res.Trade.Detail == "" || res.Order.Status != domain.OrderPending {
			t.Fatalf("sync with the gateway down: %+v, order %s", res.Trade, res.Order.Status)
		}
		if res = sb.sync(t, o.OrderNo); res.Trade.Action != domain.ActDelivered {
			t.Fatalf("sync once the gateway is back: %+v", res.Trade)
		}
		if _, err := sb.shop.SyncOrder(sb.ctx, "26120100000000000000", "admin"); domain.ErrorCode(err) != domain.ENOTFOUND {
			t.Fatalf("sync of an unknown order: %v", err)
		}
	})
}
