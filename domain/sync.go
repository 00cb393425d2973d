package domain

import (
	"context"
	"fmt"
	"strings"
	"time"

	"kami/domain/money"
	"kami/providers"
)

// SyncOrder is the "I paid" button: it asks the order's gateway about its
// trade and about each of its refunds now, and applies what the gateway
// says through the paths every payment and refund takes: a payment kami
// missed is recorded (RecordPayment: delivered, or the late-payment policy
// for a closed order, or a second trade refunded), a refund the gateway
// made is confirmed (Ledger.RefundSucceeded). It never asks the gateway to
// refund: refunds are made by the refund worker alone. An amount that
// differs, or a payment or refund kami has that the gateway denies, is
// alerted for a person. Repeating it changes nothing more. Each sync is in
// the audit log.
//
// NOT_FOUND for an unknown order; UNAVAILABLE when its provider is not
// enabled in this process.
func (s *Shop) SyncOrder(ctx context.Context, orderNo, actor string) (*SyncResult, error) {
	o, err := s.Ledger.Order(ctx, orderNo)
	if err != nil {
		return nil, err
	}
	p, ok := s.Providers.Get(o.Provider)
	if !ok {
		return nil, Errorf(EUNAVAILABLE, "order %s was placed with %s, which is not enabled here", orderNo, o.Provider)
	}
	res := &SyncResult{}
	res.Trade = s.syncTrade(ctx, p, o)
	refunds, err := refundsWhere(ctx, s.Ledger.db, "order_no", []string{orderNo})
	if err != nil {
		return nil, err
	}
	for i := range refunds {
		res.Refunds = append(res.Refunds, s.syncRefund(ctx, p, &refunds[i]))
	}

	if res.Order, err = s.Ledger.Order(ctx, orderNo); err != nil {
		return nil, err
	}
	for i := range res.Refunds {
		// A payment just recorded may have made a refund: show each as it is now.
		if cur, err := s.Ledger.Refund(ctx, res.Refunds[i].Refund.RefundNo); err == nil {
			res.Refunds[i].Refund = cur
		}
	}
	if err := audit(ctx, s.Ledger.db, s.Ledger.now(), actor, "order.sync", orderNo, truncate(res.summary(), 2000)); err != nil {
		return nil, err
	}
	return res, nil
}

// SyncResult is what SyncOrder found and did.
type SyncResult struct {
	Order *Order // as it is now
	Trade SyncTrade
	// Refunds are the order's refunds the gateway was asked about, each
	// as it is now. A refund the sync itself caused (a late or second
	// payment being refunded) is named in Trade.Detail.
	Refunds []SyncRefund
}

// SyncTrade is what the gateway said about the order's trade, and what
// was done.
type SyncTrade struct {
	Answered bool // false: the gateway could not be asked (Detail says why)
	State    providers.TradeState
	Action   SettleAction
	Detail   string
}

// SyncRefund is what the gateway said about one refund, and what was done.
type SyncRefund struct {
	Refund   *Refund
	Answered bool
	State    providers.RefundState
	// GatewayFen is the amount the gateway says it refunded (0: it did
	// not say).
	GatewayFen int64
	Action     SettleAction
	Detail     string
}

func (r *SyncResult) summary() string {
	var b strings.Builder
	fmt.Fprintf(&b, "trade %s: %s", r.Trade.State.Status, r.Trade.Action)
	for _, rf := range r.Refunds {
		fmt.Fprintf(&b, "; refund %s %s: %s", rf.Refund.RefundNo, rf.State, rf.Action)
	}
	return b.String()
}

func (s *Shop) syncTrade(ctx context.Context, p providers.Provider, o *Order) SyncTrade {
	qctx, cancel := context.WithTimeout(ctx, s.providerTimeout())
	defer cancel()
	ts, err := p.QueryPayment(qctx, o.OrderNo)
	if err != nil {
		return SyncTrade{Action: ActNone, Detail: "the gateway did not answer: " + errorDetail(err)}
	}
	out := SyncTrade{Answered: true, State: ts, Action: ActNone}
	mismatch := func(kami int64) SyncTrade {
		out.Action = ActAlerted
		out.Detail = fmt.Sprintf("the gateway says %s was paid (trade %s), kami expects %s", money.Format(ts.AmountFen), ts.TradeNo, money.Format(kami))
		s.Ledger.alerts.Alert(ctx, Alert{Kind: "amount_mismatch", Subject: o.OrderNo, Message: "sync: " + out.Detail})
		return out
	}
	switch {
	case ts.Status == providers.TradePaid && ts.TradeNo == o.TradeNo:
		if ts.AmountFen != o.PaidFen {
			return mismatch(o.PaidFen)
		}
		out.Detail = "kami has this payment"
	case ts.Status == providers.TradePaid && ts.AmountFen != o.AmountFen:
		return mismatch(o.AmountFen)
	case ts.Status == providers.TradePaid:
		if o.TradeNo != "" {
			rs, err := refundsWhere(ctx, s.Ledger.db, "order_no", []string{o.OrderNo})
			if err != nil {
				out.Action, out.Detail = ActFailed, "reading the order's refunds failed"
				return out
			}
			for _, r := range rs {
				if r.TradeNo == ts.TradeNo {
					out.Detail = "this second payment is being refunded already (" + r.RefundNo + ")"
					return out
				}
			}
		}
		out.Action, out.Detail = s.applyGatewayPayment(ctx, Payment{Provider: p.Name(), NotifyID: "query:" + ts.TradeNo,
			OrderNo: o.OrderNo, TradeNo: ts.TradeNo, AmountFen: ts.AmountFen, PaidAt: ts.PaidAt, Raw: "trade query on sync"})
	case o.TradeNo == "":
		out.Detail = "not paid at the gateway"
	case ts.Status == providers.TradeClosed && o.Status != OrderPaid:
		// Alipay closes a trade once it is refunded in full.
		out.Detail = "the trade is closed after its refund"
	default:
		out.Action = ActAlerted
		out.Detail = fmt.Sprintf("kami recorded trade %s paid (%s, order %s), the gateway says %s", o.TradeNo, money.Format(o.PaidFen), o.Status, ts.Status)
		s.Ledger.alerts.Alert(ctx, Alert{Kind: "gateway_disagrees", Subject: o.OrderNo, Message: "sync: " + out.Detail})
	}
	return out
}

func (s *Shop) syncRefund(ctx context.Context, p providers.Provider, r *Refund) SyncRefund {
	qctx, cancel := context.WithTimeout(ctx, s.providerTimeout())
	defer cancel()
	res, err := p.QueryRefund(qctx, providers.RefundRequest{RefundNo: r.RefundNo, OrderNo: r.OrderNo, TradeNo: r.TradeNo,
		RefundFen: r.AmountFen, TotalFen: r.PaidFen, Reason: r.Reason})
	out := SyncRefund{Refund: r, Action: ActNone}
	if err != nil {
		out.Detail = "the gateway did not answer: " + errorDetail(err)
		return out
	}
	out.Answered, out.State, out.GatewayFen = true, res.State, res.RefundFen
	switch {
	case res.State == providers.RefundSucceeded && res.RefundFen != 0 && res.RefundFen != r.AmountFen:
		out.Action = ActAlerted
		out.Detail = fmt.Sprintf("the gateway refunded %s, kami's refund is of %s", money.Format(res.RefundFen), money.Format(r.AmountFen))
		s.Ledger.alerts.Alert(ctx, Alert{Kind: "amount_mismatch", Subject: r.RefundNo, Message: "sync: " + out.Detail})
	case res.State == providers.RefundSucceeded && r.Status != RefundSucceeded:
		out.Action, out.Detail = s.confirmRefund(ctx, r.RefundNo, res.ProviderRefundID)
	case res.State != providers.RefundSucceeded && r.Status == RefundSucceeded:
		out.Action = ActAlerted
		out.Detail = fmt.Sprintf("kami recorded this refund SUCCEEDED, the gateway says %s", res.State)
		s.Ledger.alerts.Alert(ctx, Alert{Kind: "gateway_disagrees", Subject: r.RefundNo, Message: "sync: " + out.Detail})
	case r.Status == RefundSucceeded:
		out.Detail = "refunded, as kami has it"
	default:
		// PROCESSING or NOT_FOUND at the gateway: the refund worker's
		// next attempt asks again before it refunds.
		out.Detail = fmt.Sprintf("the gateway says %s; the refund worker carries on", res.State)
	}
	return out
}

func (s *Shop) providerTimeout() time.Duration {
	if s.ProviderTimeout > 0 {
		return s.ProviderTimeout
	}
	return 10 * time.Second
}
