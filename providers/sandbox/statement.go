package sandbox

import (
	"context"
	"sort"

	"kami/providers"
	"kami/providers/fault"
)

var _ providers.StatementSource = (*Provider)(nil)

// Statement implements providers.StatementSource from the sandbox's own
// books: the trades paid through Pay and the refunds it made, on day. The
// sandbox has no morning run: a day that has begun is served with its books
// so far; one that has not is not ready. Like everything in the sandbox the
// books are lost on restart, and a payment posted straight to the webhook
// (a test's notification) is in none of them.
func (p *Provider) Statement(ctx context.Context, day providers.Day) (*providers.Statement, error) {
	const op = "statement"
	if day.IsZero() {
		return nil, p.fail(providers.Rejected, op, "INVALID_REQUEST", "no day given", nil)
	}
	f, err := p.before(ctx, fault.OpStatement, op)
	if err != nil {
		return nil, err
	}
	if p.now().Before(day.Start()) {
		return nil, p.fail(providers.Temporary, op, providers.CodeNotReady, "the day has not begun", nil)
	}
	st := &providers.Statement{Provider: Name, Day: day}
	p.mu.Lock()
	for orderNo, t := range p.trades {
		if t.tradeNo != "" && day.Contains(t.paidAt) {
			st.Trades = append(st.Trades, providers.StatementTrade{OrderNo: orderNo, TradeNo: t.tradeNo, AmountFen: t.amountFen,
				PaidAt: t.paidAt.In(providers.Zone), Status: providers.TradePaid})
		}
	}
	for refundNo, rf := range p.refunds {
		if !day.Contains(rf.at) {
			continue
		}
		tradeNo := rf.req.TradeNo
		if t := p.trades[rf.req.OrderNo]; tradeNo == "" && t != nil {
			tradeNo = t.tradeNo
		}
		st.Refunds = append(st.Refunds, providers.StatementRefund{RefundNo: refundNo, OrderNo: rf.req.OrderNo, TradeNo: tradeNo,
			AmountFen: rf.req.RefundFen, At: rf.at.In(providers.Zone), Status: providers.RefundSucceeded})
	}
	p.mu.Unlock()
	sort.Slice(st.Trades, func(i, j int) bool { return st.Trades[i].PaidAt.Before(st.Trades[j].PaidAt) })
	sort.Slice(st.Refunds, func(i, j int) bool { return st.Refunds[i].At.Before(st.Refunds[j].At) })
	if err := p.after(ctx, f, op); err != nil {
		return nil, err
	}
	return st, nil
}
