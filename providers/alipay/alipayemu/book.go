package alipayemu

import (
	"sort"
	"time"
)

// Book is the gateway's own books: every trade and every refund it holds,
// as the real gateway's merchant portal would list them. Whole-system tests
// (the fault campaign in chaos/) check kami's ledger against it.
type Book struct {
	Trades  []TradeView // by out_trade_no
	Refunds []RefundView
}

// RefundView is a refund as the emulator holds it.
type RefundView struct {
	OutRequestNo        string // kami's refund number
	OutTradeNo, TradeNo string // the trade refunded
	Fen                 int64
	At                  time.Time
}

// Paid reports whether the buyer paid the trade (refunded since or not).
func (t TradeView) Paid() bool { return !t.PaidAt.IsZero() }

// Book returns a copy of the books, trades sorted by out_trade_no and
// refunds by out_request_no.
func (s *Server) Book() Book {
	s.mu.Lock()
	defer s.mu.Unlock()
	var b Book
	for _, t := range s.trades {
		s.expireLocked(t)
		b.Trades = append(b.Trades, TradeView{OutTradeNo: t.outTradeNo, TradeNo: t.tradeNo, Status: t.status,
			TotalFen: t.totalFen, RefundedFen: t.refundedFen, PaidAt: t.paidAt, Expire: t.expire})
	}
	for _, rf := range s.refunds {
		b.Refunds = append(b.Refunds, RefundView{OutRequestNo: rf.outRequestNo, OutTradeNo: rf.trade.outTradeNo,
			TradeNo: rf.trade.tradeNo, Fen: rf.fen, At: rf.at})
	}
	sort.Slice(b.Trades, func(i, j int) bool { return b.Trades[i].OutTradeNo < b.Trades[j].OutTradeNo })
	sort.Slice(b.Refunds, func(i, j int) bool { return b.Refunds[i].OutRequestNo < b.Refunds[j].OutRequestNo })
	return b
}
