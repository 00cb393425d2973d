package alipay

import (
	"context"
	"errors"
	"net"
	"net/url"
	"strings"

	"github.com/go-pay/gopay"
	goalipay "github.com/go-pay/gopay/alipay"

	"kami/providers"
)

// Sub codes Alipay documents for "ask again later": the outcome is unknown.
var temporarySubCodes = map[string]bool{
	"ACQ.SYSTEM_ERROR":     true,
	"aop.ACQ.SYSTEM_ERROR": true,
	"ACQ.REQ_TOO_FAST":     true, // rate limit
	"isp.unknow-error":     true,
	"aop.unknow-error":     true,
	"isp.unknown-error":    true,
	"aop.unknown-error":    true,
}

// gatewayError turns what gopay returned into a *providers.Error. gopay
// puts raw answers into some of its errors (unmarshal failures quote the
// body), so only errors we know to be clean are wrapped.
func gatewayError(op string, err error) *providers.Error {
	e := &providers.Error{Provider: Name, Op: op, Kind: providers.Temporary}
	if biz, ok := goalipay.IsBizError(err); ok {
		e.Code = biz.SubCode
		if e.Code == "" {
			e.Code = biz.Code
		}
		e.Message = clip(firstNonEmpty(biz.SubMsg, biz.Msg))
		// 20000 is "service unavailable"; isp.* are Alipay-side faults.
		if biz.Code != "20000" && !temporarySubCodes[biz.SubCode] && !strings.HasPrefix(biz.SubCode, "isp.") {
			e.Kind = providers.Rejected
		}
		return e
	}
	var ue *url.Error
	var ne net.Error
	switch {
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &ne) && ne.Timeout():
		e.Code, e.Message = "TIMEOUT", "no answer in time"
		e.Err = context.DeadlineExceeded
	case errors.Is(err, context.Canceled):
		e.Code, e.Message, e.Err = "CANCELED", "call canceled", context.Canceled
	case errors.As(err, &ue):
		// The URL is the gateway's; the inner error is the network's.
		e.Code, e.Message, e.Err = "TRANSPORT", "gateway unreachable", ue.Err
	case errors.Is(err, gopay.VerifySignatureErr), errors.Is(err, gopay.GetSignDataErr):
		e.Code, e.Message = "BAD_RESPONSE_SIGNATURE", "answer not signed by Alipay's key"
	case errors.Is(err, gopay.UnmarshalErr):
		e.Code, e.Message = "BAD_RESPONSE", "answer could not be read"
	case strings.HasPrefix(err.Error(), "HTTP Request Error, StatusCode = "):
		e.Code = "HTTP_" + strings.TrimPrefix(err.Error(), "HTTP Request Error, StatusCode = ")
		e.Message = "gateway answered with an HTTP error"
	default:
		e.Code, e.Message = "UNKNOWN", "gateway call failed"
	}
	return e
}

// callError is gatewayError for a call made with a recorder: a business
// error must be signed by Alipay when it carries a signature, and always
// when kami would read it as a success (no trade: nothing to close, no such
// refund, not paid). Unverified, the outcome stays unknown.
func (c *Client) callError(op string, err error, rec *recorder) *providers.Error {
	pe := gatewayError(op, err)
	if _, biz := goalipay.IsBizError(err); !biz {
		return pe
	}
	present, valid := c.answerSignature(rec.body)
	if valid || (!present && pe.Code != subTradeNotExist) {
		return pe
	}
	return &providers.Error{Provider: Name, Op: op, Kind: providers.Temporary, Code: "BAD_RESPONSE_SIGNATURE",
		Message: "business error " + pe.Code + " not signed by Alipay's key"}
}

// rejected is a refusal decided here, before or after calling the gateway.
func rejected(op, code, msg string) *providers.Error {
	return &providers.Error{Provider: Name, Op: op, Kind: providers.Rejected, Code: code, Message: msg}
}

// badAnswer is a signed answer we cannot use; the outcome stays unknown.
func badAnswer(op, msg string) *providers.Error {
	return &providers.Error{Provider: Name, Op: op, Kind: providers.Temporary, Code: "BAD_RESPONSE", Message: msg}
}

func firstNonEmpty(s ...string) string {
	for _, v := range s {
		if v != "" {
			return v
		}
	}
	return ""
}

// clip bounds gateway text kept in errors and details.
func clip(s string) string {
	const max = 200
	if len(s) <= max {
		return s
	}
	return strings.ToValidUTF8(s[:max], "") + "…"
}
