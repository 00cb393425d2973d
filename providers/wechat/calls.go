package wechat

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/go-pay/gopay"
	wv3 "github.com/go-pay/gopay/wechat/v3"

	"kami/providers"
)

// Gateway codes the adapter acts on.
const (
	codeSystemError      = "SYSTEM_ERROR"
	codeFrequencyLimited = "FREQUENCY_LIMITED"
	codeOrderNotExist    = "ORDER_NOT_EXIST"
	codeResourceNotExist = "RESOURCE_NOT_EXISTS"
	codeParamError       = "PARAM_ERROR"
)

// Ops, as they appear in providers.Error.
const (
	opCreate       = "create_payment"
	opRefund       = "refund"
	opQueryRefund  = "query_refund"
	opQueryPayment = "query_payment"
	opClose        = "close_payment"
	opNotification = "notification"
)

// cst is the zone WeChat Pay writes its times in.
var cst = time.FixedZone("CST", 8*60*60)

// CreatePayment implements providers.Provider: "native" (default) answers a
// code_url to show as a QR code, "h5" an h5_url to open.
func (c *Client) CreatePayment(ctx context.Context, p providers.PaymentRequest) (providers.PaymentAction, error) {
	method := p.Method
	if method == "" {
		method = "native"
	}
	if method != "native" && method != "h5" {
		return providers.PaymentAction{}, &providers.Error{Kind: providers.Unsupported, Provider: Name, Op: opCreate,
			Message: fmt.Sprintf("method %q (wechat knows native and h5)", method)}
	}
	if err := checkTradeNo(opCreate, p.OrderNo); err != nil {
		return providers.PaymentAction{}, err
	}
	if method == "h5" && p.ClientIP == "" {
		return providers.PaymentAction{}, &providers.Error{Kind: providers.Rejected, Provider: Name, Op: opCreate,
			Code: codeParamError, Message: "h5 payment needs the buyer's IP"}
	}

	desc := p.Subject
	if desc == "" {
		desc = p.OrderNo
	}
	bm := make(gopay.BodyMap)
	bm.Set("appid", c.appID).
		Set("mchid", c.mchID).
		Set("description", truncateBytes(desc, 127)).
		Set("out_trade_no", p.OrderNo).
		Set("notify_url", c.notifyURL).
		SetBodyMap("amount", func(b gopay.BodyMap) {
			b.Set("total", p.AmountFen).Set("currency", "CNY")
		})
	if !p.ExpiresAt.IsZero() {
		bm.Set("time_expire", p.ExpiresAt.In(cst).Format(time.RFC3339))
	}

	if method == "h5" {
		bm.SetBodyMap("scene_info", func(b gopay.BodyMap) {
			b.Set("payer_client_ip", p.ClientIP).
				SetBodyMap("h5_info", func(h gopay.BodyMap) { h.Set("type", "Wap") })
		})
		rsp, err := c.gp.V3TransactionH5(ctx, bm)
		if perr := c.check(opCreate, rsp, err); perr != nil {
			return providers.PaymentAction{}, perr
		}
		if rsp.Response.H5Url == "" {
			return providers.PaymentAction{}, c.malformed(opCreate, "answer has no h5_url")
		}
		return providers.PaymentAction{Kind: providers.ActionRedirect, URL: rsp.Response.H5Url, ExpiresAt: p.ExpiresAt}, nil
	}

	rsp, err := c.gp.V3TransactionNative(ctx, bm)
	if perr := c.check(opCreate, rsp, err); perr != nil {
		return providers.PaymentAction{}, perr
	}
	if rsp.Response.CodeUrl == "" {
		return providers.PaymentAction{}, c.malformed(opCreate, "answer has no code_url")
	}
	return providers.PaymentAction{Kind: providers.ActionQRCode, QRCode: rsp.Response.CodeUrl, ExpiresAt: p.ExpiresAt}, nil
}

// Refund implements providers.Provider. out_refund_no is r.RefundNo, so
// asking again refunds nothing more: the gateway answers with the refund
// it already has.
func (c *Client) Refund(ctx context.Context, r providers.RefundRequest) (providers.RefundResult, error) {
	if err := checkRefundNo(opRefund, r.RefundNo); err != nil {
		return providers.RefundResult{}, err
	}
	bm := make(gopay.BodyMap)
	bm.Set("out_refund_no", r.RefundNo)
	// Either number names the trade; kami always has its own.
	if r.OrderNo != "" {
		if err := checkTradeNo(opRefund, r.OrderNo); err != nil {
			return providers.RefundResult{}, err
		}
		bm.Set("out_trade_no", r.OrderNo)
	} else {
		bm.Set("transaction_id", r.TradeNo)
	}
	if r.Reason != "" {
		bm.Set("reason", truncateBytes(r.Reason, 80))
	}
	if c.notifyURL != "" {
		bm.Set("notify_url", c.notifyURL)
	}
	bm.SetBodyMap("amount", func(b gopay.BodyMap) {
		b.Set("refund", r.RefundFen).Set("total", r.TotalFen).Set("currency", "CNY")
	})

	rsp, err := c.gp.V3Refund(ctx, bm)
	if perr := c.check(opRefund, rsp, err); perr != nil {
		return providers.RefundResult{}, perr
	}
	return refundResult(rsp.Response.Status, rsp.Response.RefundId, rsp.Response.Amount), nil
}

// QueryRefund implements providers.Provider.
func (c *Client) QueryRefund(ctx context.Context, r providers.RefundRequest) (providers.RefundResult, error) {
	if err := checkRefundNo(opQueryRefund, r.RefundNo); err != nil {
		return providers.RefundResult{}, err
	}
	rsp, err := c.gp.V3RefundQuery(ctx, r.RefundNo, nil)
	if perr := c.check(opQueryRefund, rsp, err); perr != nil {
		if perr.Kind == providers.Rejected && perr.Code == codeResourceNotExist {
			return providers.RefundResult{State: providers.RefundNotFound, Detail: perr.Code}, nil
		}
		return providers.RefundResult{}, perr
	}
	if rsp.Response.OutRefundNo != "" && rsp.Response.OutRefundNo != r.RefundNo {
		return providers.RefundResult{}, c.malformed(opQueryRefund, "answer names another refund")
	}
	return refundResult(rsp.Response.Status, rsp.Response.RefundId, rsp.Response.Amount), nil
}

func refundResult(status, refundID string, amount *wv3.RefundOrderAmount) providers.RefundResult {
	res := providers.RefundResult{ProviderRefundID: refundID, Detail: status}
	if amount != nil {
		res.RefundFen = int64(amount.Refund)
	}
	switch status {
	case "SUCCESS":
		res.State = providers.RefundSucceeded
	case "ABNORMAL", "CLOSED":
		res.State = providers.RefundFailed
	default:
		// PROCESSING, or a state newer than this adapter: the gateway has
		// the refund and has not finished it.
		res.State = providers.RefundProcessing
	}
	return res
}

// QueryPayment implements providers.Provider.
func (c *Client) QueryPayment(ctx context.Context, orderNo string) (providers.TradeState, error) {
	if err := checkTradeNo(opQueryPayment, orderNo); err != nil {
		return providers.TradeState{}, err
	}
	rsp, err := c.gp.V3TransactionQueryOrder(ctx, wv3.OutTradeNo, orderNo)
	if perr := c.check(opQueryPayment, rsp, err); perr != nil {
		if perr.Kind == providers.Rejected && (perr.Code == codeOrderNotExist || perr.Code == codeResourceNotExist) {
			return providers.TradeState{Status: providers.TradeNotFound}, nil
		}
		return providers.TradeState{}, perr
	}
	q := rsp.Response
	if q.OutTradeNo != orderNo || (q.Mchid != "" && q.Mchid != c.mchID) {
		return providers.TradeState{}, c.malformed(opQueryPayment, "answer names another trade or merchant")
	}
	st := providers.TradeState{TradeNo: q.TransactionId}
	if q.Amount != nil {
		st.AmountFen = int64(q.Amount.Total)
	}
	switch q.TradeState {
	case "NOTPAY", "USERPAYING", "PAYERROR":
		// PAYERROR (the bank refused a payment) is not final: the trade
		// can still be paid until it is closed, as WeChat's close-order
		// guide says.
		st.Status = providers.TradeWaiting
	case "SUCCESS", "REFUND":
		st.Status = providers.TradePaid
		if q.TransactionId == "" || q.Amount == nil {
			return providers.TradeState{}, c.malformed(opQueryPayment, "paid trade without transaction_id or amount")
		}
		paidAt, err := time.Parse(time.RFC3339, q.SuccessTime)
		if err != nil {
			return providers.TradeState{}, c.malformed(opQueryPayment, "paid trade without a valid success_time")
		}
		st.PaidAt = paidAt
	case "CLOSED", "REVOKED":
		st.Status = providers.TradeClosed
	default:
		return providers.TradeState{}, c.malformed(opQueryPayment, fmt.Sprintf("unknown trade_state %q", truncateBytes(q.TradeState, 32)))
	}
	return st, nil
}

// ClosePayment implements providers.Provider. A trade the gateway never
// created (ORDER_NOT_EXIST) is already as closed as it can be.
func (c *Client) ClosePayment(ctx context.Context, orderNo string) error {
	if err := checkTradeNo(opClose, orderNo); err != nil {
		return err
	}
	rsp, err := c.gp.V3TransactionCloseOrder(ctx, orderNo)
	if perr := c.check(opClose, rsp, err); perr != nil {
		if perr.Kind == providers.Rejected && perr.Code == codeOrderNotExist {
			return nil
		}
		return perr
	}
	return nil
}

// parts returns what every gopay v3 response has: Code 0 is success,
// anything else is the HTTP status with the gateway's {"code","message"}.
// ok is false for a nil response.
func parts(rsp any) (code int, er wv3.ErrResponse, si *wv3.SignInfo, ok bool) {
	switch r := rsp.(type) {
	case *wv3.NativeRsp:
		if r != nil {
			return r.Code, r.ErrResponse, r.SignInfo, true
		}
	case *wv3.H5Rsp:
		if r != nil {
			return r.Code, r.ErrResponse, r.SignInfo, true
		}
	case *wv3.RefundRsp:
		if r != nil {
			return r.Code, r.ErrResponse, r.SignInfo, true
		}
	case *wv3.RefundQueryRsp:
		if r != nil {
			return r.Code, r.ErrResponse, r.SignInfo, true
		}
	case *wv3.QueryOrderRsp:
		if r != nil {
			return r.Code, r.ErrResponse, r.SignInfo, true
		}
	case *wv3.EmptyRsp:
		if r != nil {
			return r.Code, r.ErrResponse, r.SignInfo, true
		}
	case *wv3.BillRsp:
		if r != nil {
			return r.Code, r.ErrResponse, r.SignInfo, true
		}
	}
	return 0, wv3.ErrResponse{}, nil, false
}

// check turns gopay's two ways of failing into one *providers.Error, or nil
// when the call worked and its answer was verified.
//
// gopay returns a non-nil error for transport failures, unreadable answers
// and answers whose signature does not verify (the outcome is then unknown:
// Temporary), and a nil error with a non-zero Code for every non-2xx answer.
func (c *Client) check(op string, rsp any, err error) *providers.Error {
	if err != nil {
		return c.callError(op, err)
	}
	code, er, si, ok := parts(rsp)
	if !ok {
		return &providers.Error{Kind: providers.Temporary, Provider: Name, Op: op, Message: "no answer"}
	}
	if code == wv3.Success {
		return nil
	}
	// gopay verifies only 2xx answers. A failure answer is trusted as it
	// comes (the official SDKs do the same), but one that carries a
	// signature must carry a good one: a bad signature means someone in
	// between wrote it, and what really happened is unknown.
	if si != nil && si.HeaderSignature != "" && !c.verifyAnswer(si) {
		return &providers.Error{Kind: providers.Temporary, Provider: Name, Op: op,
			Message: fmt.Sprintf("HTTP %d answer with a signature that does not verify", code)}
	}
	e := &providers.Error{Kind: providers.Rejected, Provider: Name, Op: op, Code: er.Code,
		Message: truncateBytes(er.Message, 200)}
	if e.Code == "" {
		e.Code = fmt.Sprintf("HTTP_%d", code)
	}
	if code >= 500 || code == http.StatusTooManyRequests || er.Code == codeSystemError || er.Code == codeFrequencyLimited {
		e.Kind = providers.Temporary
	}
	return e
}

func (c *Client) verifyAnswer(si *wv3.SignInfo) bool {
	if si.HeaderSerial != c.platformID {
		return false
	}
	return wv3.V3VerifySignByPK(si.HeaderTimestamp, si.HeaderNonce, si.SignBody, si.HeaderSignature, c.platformKey) == nil
}

// callError classifies an error gopay returned. gopay's own error texts may
// quote the answer's body, so only network errors are kept as causes.
func (c *Client) callError(op string, err error) *providers.Error {
	e := &providers.Error{Kind: providers.Temporary, Provider: Name, Op: op}
	var ne net.Error
	switch {
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &ne) && ne.Timeout():
		e.Message = "timeout"
		e.Err = err
	case errors.Is(err, context.Canceled):
		e.Message = "canceled"
		e.Err = context.Canceled
	case errors.As(err, &ne):
		e.Message = "transport error"
		e.Err = err
	case errors.Is(err, gopay.VerifySignatureErr):
		e.Message = "answer signature does not verify"
	case errors.Is(err, gopay.UnmarshalErr):
		e.Message = "unreadable answer"
	default:
		// Anything else (a serial gopay has no key for, a failed signing)
		// leaves the outcome as unknown as a timeout.
		e.Message = "call failed before a verified answer"
	}
	return e
}

// malformed is a verified 2xx answer that does not say what it should.
// Nothing is known about the outcome, so it is Temporary.
func (c *Client) malformed(op, msg string) *providers.Error {
	return &providers.Error{Kind: providers.Temporary, Provider: Name, Op: op, Message: msg}
}

// checkTradeNo and checkRefundNo keep gopay from building a request path
// out of characters WeChat never allows in these numbers (gopay puts them
// in the path unescaped).
func checkTradeNo(op, no string) *providers.Error {
	if no == "" || len(no) > 32 || strings.Trim(no, idChars) != "" {
		return &providers.Error{Kind: providers.Rejected, Provider: Name, Op: op, Code: codeParamError,
			Message: "out_trade_no must be 1-32 of [0-9A-Za-z_-|*]"}
	}
	return nil
}

func checkRefundNo(op, no string) *providers.Error {
	if no == "" || len(no) > 64 || strings.Trim(no, idChars+"@") != "" {
		return &providers.Error{Kind: providers.Rejected, Provider: Name, Op: op, Code: codeParamError,
			Message: "out_refund_no must be 1-64 of [0-9A-Za-z_-|*@]"}
	}
	return nil
}

const idChars = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_-|*"

// truncateBytes cuts s to at most n bytes without splitting a character.
func truncateBytes(s string, n int) string {
	if len(s) <= n {
		return s
	}
	s = s[:n]
	for len(s) > 0 && !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s
}
