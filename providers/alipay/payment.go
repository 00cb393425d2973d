package alipay

import (
	"context"
	"time"

	"github.com/go-pay/gopay"

	"kami/domain/money"
	"kami/providers"
)

// Operation names used in errors; they match providertest's Op names.
const (
	opCreate       = "create"
	opRefund       = "refund"
	opQueryRefund  = "query_refund"
	opQueryPayment = "query_payment"
	opClose        = "close"
	opNotification = "notification"
)

// Trade states of alipay.trade.query and of notifications.
const (
	tradeWaitBuyerPay = "WAIT_BUYER_PAY"
	tradeSuccess      = "TRADE_SUCCESS"
	tradeFinished     = "TRADE_FINISHED"
	tradeClosed       = "TRADE_CLOSED"
)

// subTradeNotExist is the gateway's answer for an out_trade_no it never saw.
const subTradeNotExist = "ACQ.TRADE_NOT_EXIST"

// CreatePayment implements providers.Provider. "page" and "wap" URLs are
// signed locally (the trade exists at Alipay once the buyer opens them);
// "qr" calls alipay.trade.precreate.
func (c *Client) CreatePayment(ctx context.Context, p providers.PaymentRequest) (providers.PaymentAction, error) {
	if p.OrderNo == "" || len(p.OrderNo) > 64 {
		return providers.PaymentAction{}, rejected(opCreate, "INVALID_REQUEST", "order number must be 1 to 64 characters")
	}
	if p.AmountFen <= 0 || p.AmountFen > money.MaxFen {
		return providers.PaymentAction{}, rejected(opCreate, "INVALID_REQUEST", "amount out of range")
	}
	subject := p.Subject
	if subject == "" {
		subject = p.OrderNo
	}
	bm := make(gopay.BodyMap)
	bm.Set("out_trade_no", p.OrderNo).
		Set("total_amount", money.Format(p.AmountFen)).
		Set("subject", subject)
	if !p.ExpiresAt.IsZero() {
		bm.Set("time_expire", p.ExpiresAt.In(beijing).Format(alipayTime))
	}
	action := providers.PaymentAction{ExpiresAt: p.ExpiresAt}

	switch p.Method {
	case "", "page":
		u, err := c.api.TradePagePay(ctx, bm)
		if err != nil {
			return providers.PaymentAction{}, gatewayError(opCreate, err)
		}
		action.Kind, action.URL = providers.ActionRedirect, c.payURL(u)
	case "wap":
		if c.api.ReturnUrl != "" {
			bm.Set("quit_url", c.api.ReturnUrl)
		}
		u, err := c.api.TradeWapPay(ctx, bm)
		if err != nil {
			return providers.PaymentAction{}, gatewayError(opCreate, err)
		}
		action.Kind, action.URL = providers.ActionRedirect, c.payURL(u)
	case "qr":
		rctx, rec := record(ctx)
		rsp, err := c.api.TradePrecreate(rctx, bm)
		if err != nil {
			return providers.PaymentAction{}, c.callError(opCreate, err, rec)
		}
		if rsp.Response.QrCode == "" {
			return providers.PaymentAction{}, badAnswer(opCreate, "precreate answered without qr_code")
		}
		action.Kind, action.QRCode = providers.ActionQRCode, rsp.Response.QrCode
	default:
		return providers.PaymentAction{}, &providers.Error{Provider: Name, Op: opCreate, Kind: providers.Unsupported,
			Code: "METHOD", Message: "unknown payment method " + clip(p.Method) + `; want "page", "wap" or "qr"`}
	}
	return action, nil
}

// QueryPayment implements providers.Provider with alipay.trade.query.
func (c *Client) QueryPayment(ctx context.Context, orderNo string) (providers.TradeState, error) {
	if orderNo == "" {
		return providers.TradeState{}, rejected(opQueryPayment, "INVALID_REQUEST", "empty order number")
	}
	bm := make(gopay.BodyMap)
	bm.Set("out_trade_no", orderNo)
	rctx, rec := record(ctx)
	rsp, err := c.api.TradeQuery(rctx, bm)
	if err != nil {
		pe := c.callError(opQueryPayment, err, rec)
		if pe.Code == subTradeNotExist {
			return providers.TradeState{Status: providers.TradeNotFound}, nil
		}
		return providers.TradeState{}, pe
	}
	r := rsp.Response
	if r.OutTradeNo != "" && r.OutTradeNo != orderNo {
		return providers.TradeState{}, badAnswer(opQueryPayment, "answer names another order")
	}
	st := providers.TradeState{TradeNo: r.TradeNo}
	switch r.TradeStatus {
	case tradeWaitBuyerPay:
		st.Status = providers.TradeWaiting
	case tradeSuccess, tradeFinished:
		st.Status = providers.TradePaid
	case tradeClosed:
		st.Status = providers.TradeClosed
	default:
		return providers.TradeState{}, badAnswer(opQueryPayment, "unknown trade_status "+clip(r.TradeStatus))
	}
	if r.TotalAmount != "" {
		fen, err := money.Parse(r.TotalAmount)
		if err != nil {
			return providers.TradeState{}, badAnswer(opQueryPayment, "total_amount is not an amount")
		}
		st.AmountFen = fen
	}
	if st.Status == providers.TradePaid {
		if st.TradeNo == "" || r.TotalAmount == "" {
			return providers.TradeState{}, badAnswer(opQueryPayment, "paid trade without trade_no or total_amount")
		}
		if r.SendPayDate != "" {
			t, err := time.ParseInLocation(alipayTime, r.SendPayDate, beijing)
			if err != nil {
				return providers.TradeState{}, badAnswer(opQueryPayment, "send_pay_date is not a time")
			}
			st.PaidAt = t
		}
	}
	return st, nil
}

// ClosePayment implements providers.Provider with alipay.trade.close. A trade
// the gateway never created (the buyer never opened the pay page) is closed
// already.
func (c *Client) ClosePayment(ctx context.Context, orderNo string) error {
	if orderNo == "" {
		return rejected(opClose, "INVALID_REQUEST", "empty order number")
	}
	bm := make(gopay.BodyMap)
	bm.Set("out_trade_no", orderNo)
	rctx, rec := record(ctx)
	if _, err := c.api.TradeClose(rctx, bm); err != nil {
		pe := c.callError(opClose, err, rec)
		if pe.Code == subTradeNotExist {
			return nil
		}
		return pe
	}
	return nil
}

// Refund implements providers.Provider with alipay.trade.refund. The refund
// number is out_request_no, so asking again never refunds twice. Alipay says
// fund_change "Y" when this call moved money; a repeated call answers "N",
// and then the refund query decides.
func (c *Client) Refund(ctx context.Context, r providers.RefundRequest) (providers.RefundResult, error) {
	if err := checkRefund(opRefund, r); err != nil {
		return providers.RefundResult{}, err
	}
	if r.RefundFen <= 0 || r.RefundFen > money.MaxFen || (r.TotalFen > 0 && r.RefundFen > r.TotalFen) {
		return providers.RefundResult{}, rejected(opRefund, "INVALID_REQUEST", "refund amount out of range")
	}
	bm := refundKeys(r)
	bm.Set("refund_amount", money.Format(r.RefundFen))
	if r.Reason != "" {
		bm.Set("refund_reason", r.Reason)
	}
	rctx, rec := record(ctx)
	rsp, err := c.api.TradeRefund(rctx, bm)
	if err != nil {
		return providers.RefundResult{}, c.callError(opRefund, err, rec)
	}
	if rsp.Response.FundChange == "Y" {
		return providers.RefundResult{
			State:            providers.RefundSucceeded,
			ProviderRefundID: rsp.Response.TradeNo,
			RefundFen:        r.RefundFen,
			Detail:           "fund_change Y",
		}, nil
	}
	q, err := c.QueryRefund(ctx, r)
	switch {
	case err != nil:
		// Accepted, state unknown for now: the next query settles it.
		return providers.RefundResult{State: providers.RefundProcessing, ProviderRefundID: rsp.Response.TradeNo,
			Detail: "fund_change N; query failed: " + clip(err.Error())}, nil
	case q.State == providers.RefundNotFound:
		return providers.RefundResult{State: providers.RefundProcessing, ProviderRefundID: rsp.Response.TradeNo,
			Detail: "fund_change N; refund not visible yet"}, nil
	}
	return q, nil
}

// QueryRefund implements providers.Provider with
// alipay.trade.fastpay.refund.query.
func (c *Client) QueryRefund(ctx context.Context, r providers.RefundRequest) (providers.RefundResult, error) {
	if err := checkRefund(opQueryRefund, r); err != nil {
		return providers.RefundResult{}, err
	}
	bm := refundKeys(r)
	rctx, rec := record(ctx)
	rsp, err := c.api.TradeFastPayRefundQuery(rctx, bm)
	if err != nil {
		pe := c.callError(opQueryRefund, err, rec)
		if pe.Code == subTradeNotExist {
			return providers.RefundResult{State: providers.RefundNotFound, Detail: subTradeNotExist}, nil
		}
		return providers.RefundResult{}, pe
	}
	q := rsp.Response
	// A refund the gateway does not know is a success answer with no
	// refund fields at all.
	if q.OutRequestNo == "" && q.RefundAmount == "" && q.RefundStatus == "" {
		return providers.RefundResult{State: providers.RefundNotFound, Detail: "no such out_request_no"}, nil
	}
	if q.OutRequestNo != "" && q.OutRequestNo != r.RefundNo {
		return providers.RefundResult{}, badAnswer(opQueryRefund, "answer names another refund")
	}
	res := providers.RefundResult{ProviderRefundID: q.TradeNo, Detail: "refund_status " + clip(q.RefundStatus)}
	if q.RefundAmount != "" {
		fen, err := money.Parse(q.RefundAmount)
		if err != nil {
			return providers.RefundResult{}, badAnswer(opQueryRefund, "refund_amount is not an amount")
		}
		res.RefundFen = fen
	}
	switch q.RefundStatus {
	case "REFUND_SUCCESS":
		res.State = providers.RefundSucceeded
	case "":
		// Older answers leave refund_status out; Alipay documents that
		// an answer carrying the refund means it succeeded.
		if q.RefundAmount == "" {
			return providers.RefundResult{State: providers.RefundNotFound, Detail: "no refund_amount"}, nil
		}
		res.State, res.Detail = providers.RefundSucceeded, "refund listed"
	default:
		res.State = providers.RefundProcessing
	}
	return res, nil
}

func checkRefund(op string, r providers.RefundRequest) error {
	if r.RefundNo == "" || len(r.RefundNo) > 64 {
		return rejected(op, "INVALID_REQUEST", "refund number must be 1 to 64 characters")
	}
	if r.OrderNo == "" && r.TradeNo == "" {
		return rejected(op, "INVALID_REQUEST", "refund names neither order nor trade")
	}
	return nil
}

// refundKeys names the trade and the refund, as both refund calls want.
func refundKeys(r providers.RefundRequest) gopay.BodyMap {
	bm := make(gopay.BodyMap)
	if r.OrderNo != "" {
		bm.Set("out_trade_no", r.OrderNo)
	}
	if r.TradeNo != "" {
		bm.Set("trade_no", r.TradeNo)
	}
	bm.Set("out_request_no", r.RefundNo)
	return bm
}
