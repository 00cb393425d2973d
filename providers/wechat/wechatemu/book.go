package wechatemu

import (
	"sort"
	"time"
)

// Book is the gateway's own books: every trade and every refund it holds,
// as the merchant platform would list them. Whole-system tests (the fault
// campaign in chaos/) check kami's ledger against it.
type Book struct {
	Trades  []TradeView // by out_trade_no
	Refunds []RefundView
}

// TradeView is a trade as the emulator holds it.
type TradeView struct {
	OutTradeNo    string
	TransactionID string // empty until paid
	State         string // NOTPAY, SUCCESS, REFUND, CLOSED
	TotalFen      int64  // set when paid
	RefundedFen   int64  // held by refunds SUCCESS or PROCESSING
	PaidAt        time.Time
}

// Paid reports whether the buyer paid the trade (refunded since or not).
func (t TradeView) Paid() bool { return t.TransactionID != "" }

// RefundView is a refund as the emulator holds it.
type RefundView struct {
	OutRefundNo, RefundID     string
	OutTradeNo, TransactionID string
	Fen                       int64
	Status                    string // SUCCESS, PROCESSING, ABNORMAL, CLOSED
	CreatedAt                 time.Time
}

// Book returns a copy of the books, trades sorted by out_trade_no and
// refunds by out_refund_no.
func (s *Server) Book() Book {
	s.mu.Lock()
	defer s.mu.Unlock()
	var b Book
	for _, t := range s.trades {
		b.Trades = append(b.Trades, TradeView{OutTradeNo: t.outTradeNo, TransactionID: t.txID, State: t.state,
			TotalFen: t.total, RefundedFen: t.refunded, PaidAt: t.successTime})
	}
	for _, rf := range s.refunds {
		b.Refunds = append(b.Refunds, RefundView{OutRefundNo: rf.outRefundNo, RefundID: rf.refundID, OutTradeNo: rf.outTradeNo,
			TransactionID: rf.txID, Fen: rf.refund, Status: rf.status, CreatedAt: rf.createTime})
	}
	sort.Slice(b.Trades, func(i, j int) bool { return b.Trades[i].OutTradeNo < b.Trades[j].OutTradeNo })
	sort.Slice(b.Refunds, func(i, j int) bool { return b.Refunds[i].OutRefundNo < b.Refunds[j].OutRefundNo })
	return b
}
