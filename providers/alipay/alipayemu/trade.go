package alipayemu

import (
	"time"
)

// dispatch runs one authenticated call.
// base is the emulator's address, for the bill download address.
func (s *Server) dispatch(method, key string, b biz, base string) reply {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch method {
	case "alipay.trade.precreate":
		return s.createLocked(key, b, "")
	case "alipay.trade.page.pay":
		return s.createLocked(key, b, "FAST_INSTANT_TRADE_PAY")
	case "alipay.trade.wap.pay":
		return s.createLocked(key, b, "QUICK_WAP_WAY")
	case "alipay.trade.query":
		return s.queryLocked(key, b)
	case "alipay.trade.close":
		return s.closeLocked(key, b)
	case "alipay.trade.refund":
		return s.refundLocked(key, b)
	case "alipay.trade.fastpay.refund.query":
		return s.refundQueryLocked(key, b)
	case billMethod:
		return s.billLocked(key, b, base)
	}
	return failure("error_response", "40002", "Invalid Arguments", "isv.invalid-method", "不存在的方法名")
}

// findLocked looks a trade up by out_trade_no or trade_no; both given must
// agree.
func (s *Server) findLocked(b biz) (*trade, bool) {
	out, no := b.str("out_trade_no"), b.str("trade_no")
	var t *trade
	switch {
	case out != "":
		t = s.trades[out]
		if t != nil && no != "" && t.tradeNo != no {
			return nil, false
		}
	case no != "":
		t = s.byNo[no]
	}
	if t == nil {
		return nil, false
	}
	s.expireLocked(t)
	return t, true
}

func invalidParam(key, what string) reply {
	return bizFailure(key, "ACQ.INVALID_PARAMETER", "参数无效: "+what)
}

// createLocked is alipay.trade.precreate, or the buyer opening a page/wap
// pay URL (productCode set): either creates the trade, unpaid. Asking again
// with the same order and amount answers the same trade.
func (s *Server) createLocked(key string, b biz, productCode string) reply {
	out, subject := b.str("out_trade_no"), b.str("subject")
	if out == "" || len(out) > 64 {
		return invalidParam(key, "out_trade_no")
	}
	if subject == "" {
		return invalidParam(key, "subject")
	}
	fen, ok := parseAmount(b.str("total_amount"))
	if !ok {
		return invalidParam(key, "total_amount")
	}
	if productCode != "" && b.str("product_code") != productCode {
		return invalidParam(key, "product_code")
	}
	var expire time.Time
	if te := b.str("time_expire"); te != "" {
		var err error
		if expire, err = time.ParseInLocation(alipayTime, te, beijing); err != nil {
			return invalidParam(key, "time_expire")
		}
	}
	t, exists := s.trades[out]
	if exists {
		s.expireLocked(t)
		switch {
		case t.status == statusSuccess || t.status == statusFinished:
			return bizFailure(key, "ACQ.TRADE_HAS_SUCCESS", "交易已被支付")
		case t.status == statusClosed:
			return bizFailure(key, "ACQ.TRADE_HAS_CLOSE", "交易已经关闭")
		case t.totalFen != fen:
			return bizFailure(key, "ACQ.CONTEXT_INCONSISTENT", "交易信息被篡改")
		}
	} else {
		t = s.newTradeLocked(out, subject, fen)
		t.expire = expire
	}
	if t.qrCode == "" && productCode == "" {
		t.qrCode = "https://qr.alipay.com/bax0" + randomID(10)
	}
	fields := map[string]any{"out_trade_no": out}
	if productCode == "" {
		fields["qr_code"] = t.qrCode
	}
	return success(key, fields)
}

func (s *Server) queryLocked(key string, b biz) reply {
	if b.str("out_trade_no") == "" && b.str("trade_no") == "" {
		return invalidParam(key, "out_trade_no")
	}
	t, ok := s.findLocked(b)
	if !ok {
		return bizFailure(key, "ACQ.TRADE_NOT_EXIST", "交易不存在")
	}
	fields := map[string]any{
		"trade_no":       t.tradeNo,
		"out_trade_no":   t.outTradeNo,
		"trade_status":   t.status,
		"total_amount":   formatAmount(t.totalFen),
		"buyer_logon_id": "kam***@example.com",
	}
	if !t.paidAt.IsZero() {
		fields["send_pay_date"] = t.paidAt.In(beijing).Format(alipayTime)
		fields["receipt_amount"] = formatAmount(t.totalFen)
		fields["buyer_pay_amount"] = formatAmount(t.totalFen)
		fields["buyer_user_id"] = "2088102177846880"
	}
	return success(key, fields)
}

// closeLocked closes a trade waiting for payment; any other is refused
// with ACQ.TRADE_STATUS_ERROR, a closed one too, as Alipay documents for
// alipay.trade.close ("only a trade waiting for the buyer's payment can be
// closed").
func (s *Server) closeLocked(key string, b biz) reply {
	if b.str("out_trade_no") == "" && b.str("trade_no") == "" {
		return invalidParam(key, "out_trade_no")
	}
	t, ok := s.findLocked(b)
	if !ok {
		return bizFailure(key, "ACQ.TRADE_NOT_EXIST", "交易不存在")
	}
	if t.status != statusWait {
		return bizFailure(key, "ACQ.TRADE_STATUS_ERROR", "交易状态不合法")
	}
	t.status, t.closed = statusClosed, true
	return success(key, map[string]any{"trade_no": t.tradeNo, "out_trade_no": t.outTradeNo})
}

// refundLocked refunds part or all of a paid trade. out_request_no makes it
// idempotent: asking again refunds nothing more and answers as before, but
// with fund_change "N" (no money moved this time), as Alipay does.
func (s *Server) refundLocked(key string, b biz) reply {
	if b.str("out_trade_no") == "" && b.str("trade_no") == "" {
		return invalidParam(key, "out_trade_no")
	}
	fen, ok := parseAmount(b.str("refund_amount"))
	if !ok {
		return invalidParam(key, "refund_amount")
	}
	t, ok := s.findLocked(b)
	if !ok {
		return bizFailure(key, "ACQ.TRADE_NOT_EXIST", "交易不存在")
	}
	reqNo := refundNoOf(b)
	answer := func(fundChange string, rf *refund) reply {
		return success(key, map[string]any{
			"trade_no":       t.tradeNo,
			"out_trade_no":   t.outTradeNo,
			"buyer_logon_id": "kam***@example.com",
			"fund_change":    fundChange,
			"refund_fee":     formatAmount(rf.refundedTill),
			"send_back_fee":  formatAmount(rf.fen),
			"gmt_refund_pay": rf.at.In(beijing).Format(alipayTime),
		})
	}
	if rf, seen := s.refunds[reqNo]; seen {
		if rf.trade != t {
			return invalidParam(key, "out_request_no")
		}
		return answer("N", rf)
	}
	switch {
	case t.status == statusWait || t.closed:
		return bizFailure(key, "ACQ.TRADE_STATUS_ERROR", "交易状态不合法")
	case t.status == statusFinished:
		return bizFailure(key, "ACQ.TRADE_HAS_FINISHED", "交易已完结")
	case fen > t.totalFen-t.refundedFen:
		return bizFailure(key, "ACQ.REFUND_AMT_NOT_EQUAL_TOTAL", "退款金额超限")
	}
	t.refundedFen += fen
	if t.refundedFen == t.totalFen {
		t.status = statusClosed // a fully refunded trade is closed
	}
	rf := &refund{outRequestNo: reqNo, trade: t, fen: fen, at: s.now(), notifyID: randomID(16), refundedTill: t.refundedFen,
		processing: s.slowRefund}
	s.refunds[reqNo] = rf
	if rf.processing {
		return answer("N", rf) // accepted; the money moves when the bank answers
	}
	return answer("Y", rf)
}

// refundQueryLocked answers a refund it knows with REFUND_SUCCESS (refunds
// here finish at once, unless Options.RefundProcessing holds them) and one
// it does not, or one still processing, with a bare success, as Alipay does.
func (s *Server) refundQueryLocked(key string, b biz) reply {
	if b.str("out_trade_no") == "" && b.str("trade_no") == "" {
		return invalidParam(key, "out_trade_no")
	}
	reqNo := b.str("out_request_no")
	if reqNo == "" {
		return invalidParam(key, "out_request_no")
	}
	t, ok := s.findLocked(b)
	if !ok {
		return bizFailure(key, "ACQ.TRADE_NOT_EXIST", "交易不存在")
	}
	rf, ok := s.refunds[reqNo]
	if !ok || rf.trade != t || rf.processing {
		// Unknown, or not finished yet: no refund fields, as Alipay
		// answers until the refund has succeeded.
		return success(key, map[string]any{"trade_no": t.tradeNo, "out_trade_no": t.outTradeNo})
	}
	fields := map[string]any{
		"trade_no":       t.tradeNo,
		"out_trade_no":   t.outTradeNo,
		"out_request_no": reqNo,
		"total_amount":   formatAmount(t.totalFen),
		"refund_amount":  formatAmount(rf.fen),
		"refund_status":  "REFUND_SUCCESS",
	}
	if b.has("query_options", "gmt_refund_pay") {
		fields["gmt_refund_pay"] = rf.at.In(beijing).Format(alipayTime)
	}
	return success(key, fields)
}
