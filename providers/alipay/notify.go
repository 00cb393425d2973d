package alipay

import (
	"context"
	"crypto"
	"crypto/rsa"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"mime"
	"net/http"
	"net/url"
	"sort"
	"strings"
	"time"

	"kami/domain/money"
	"kami/providers"
)

// MaxNotificationBytes bounds a notification body. Alipay's are about 2 KiB.
const MaxNotificationBytes = 64 << 10

// Codes of notification errors (Kind Invalid).
const (
	CodeTooLarge     = "TOO_LARGE"
	CodeMalformed    = "MALFORMED"
	CodeBadSignature = "BAD_SIGNATURE"
	CodeWrongAppID   = "WRONG_APP_ID"
	CodeWrongSeller  = "WRONG_SELLER_ID"
)

func invalid(code, msg string) *providers.Error {
	return &providers.Error{Provider: Name, Op: opNotification, Kind: providers.Invalid, Code: code, Message: msg}
}

// ParseNotification implements providers.Provider for Alipay's asynchronous
// notification (a form post). Nothing in the body is read before its RSA2
// signature checks out with Alipay's public key and its app_id is ours.
//
// Alipay reports a refund on the trade's own notification: it then carries
// out_biz_no (our out_request_no) and refund_fee (the total refunded on the
// trade so far; for kami's one refund per order, that refund's amount).
func (c *Client) ParseNotification(_ context.Context, header http.Header, body []byte) (providers.Event, error) {
	if len(body) > MaxNotificationBytes {
		return providers.Event{}, invalid(CodeTooLarge, "body over 64 KiB")
	}
	if ct := header.Get("Content-Type"); ct != "" {
		mt, _, err := mime.ParseMediaType(ct)
		if err != nil || mt != "application/x-www-form-urlencoded" {
			return providers.Event{}, invalid(CodeMalformed, "not a form post")
		}
	}
	form, err := url.ParseQuery(string(body))
	if err != nil {
		return providers.Event{}, invalid(CodeMalformed, "body is not form-encoded")
	}
	params := make(map[string]string, len(form))
	for k, vs := range form {
		if len(vs) != 1 {
			// One value must mean one thing to the signer and to us.
			return providers.Event{}, invalid(CodeMalformed, "repeated field")
		}
		params[k] = vs[0]
	}
	if err := c.verifyNotification(params); err != nil {
		return providers.Event{}, err
	}
	if params["app_id"] != c.appID {
		return providers.Event{}, invalid(CodeWrongAppID, "notification is for another app id")
	}
	if c.sellerID != "" && params["seller_id"] != c.sellerID {
		return providers.Event{}, invalid(CodeWrongSeller, "notification is for another seller")
	}
	return eventFrom(params)
}

// verifyNotification checks the RSA2 signature the way Alipay computes it:
// over every field but sign and sign_type, empty ones left out, sorted by
// name, joined as k=v with '&', unescaped.
func (c *Client) verifyNotification(params map[string]string) error {
	sig := params["sign"]
	if sig == "" {
		return invalid(CodeBadSignature, "not signed")
	}
	// RSA (SHA-1) is refused: accepting it would let a weaker signature
	// stand in for the one Alipay sends RSA2 apps.
	if params["sign_type"] != "RSA2" {
		return invalid(CodeBadSignature, "sign_type is not RSA2")
	}
	raw, err := base64.StdEncoding.DecodeString(sig)
	if err != nil {
		return invalid(CodeBadSignature, "sign is not base64")
	}
	sum := sha256.Sum256([]byte(notificationSignContent(params)))
	if err := rsa.VerifyPKCS1v15(c.pub, crypto.SHA256, sum[:], raw); err != nil {
		return invalid(CodeBadSignature, "signature does not verify with Alipay's public key")
	}
	return nil
}

func notificationSignContent(params map[string]string) string {
	keys := make([]string, 0, len(params))
	for k, v := range params {
		if k == "sign" || k == "sign_type" || v == "" {
			continue
		}
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for i, k := range keys {
		if i > 0 {
			b.WriteByte('&')
		}
		b.WriteString(k)
		b.WriteByte('=')
		b.WriteString(params[k])
	}
	return b.String()
}

// eventFrom reads a verified notification.
func eventFrom(p map[string]string) (providers.Event, error) {
	ev := providers.Event{
		NotifyID: p["notify_id"],
		OrderNo:  p["out_trade_no"],
		TradeNo:  p["trade_no"],
		Merchant: p["app_id"],
	}
	if ev.NotifyID == "" || ev.OrderNo == "" {
		return providers.Event{}, invalid(CodeMalformed, "notify_id or out_trade_no missing")
	}
	if s := p["total_amount"]; s != "" {
		fen, err := money.Parse(s)
		if err != nil {
			return providers.Event{}, invalid(CodeMalformed, "total_amount is not an amount with at most two decimals")
		}
		ev.AmountFen = fen
	}
	status := p["trade_status"]

	if p["out_biz_no"] != "" && p["refund_fee"] != "" {
		fen, err := money.Parse(p["refund_fee"])
		if err != nil || fen == 0 {
			return providers.Event{}, invalid(CodeMalformed, "refund_fee is not a positive amount with at most two decimals")
		}
		ev.Kind, ev.RefundNo, ev.RefundFen = providers.EventRefundSucceeded, p["out_biz_no"], fen
		return ev, nil
	}

	switch status {
	case tradeSuccess, tradeFinished:
		if ev.TradeNo == "" || p["total_amount"] == "" || ev.AmountFen == 0 {
			return providers.Event{}, invalid(CodeMalformed, "payment without trade_no or total_amount")
		}
		paid, err := time.ParseInLocation(alipayTime, p["gmt_payment"], beijing)
		if err != nil {
			return providers.Event{}, invalid(CodeMalformed, "gmt_payment is not a time")
		}
		ev.Kind, ev.PaidAt = providers.EventPaymentSucceeded, paid
	case tradeWaitBuyerPay, tradeClosed:
		ev.Kind = providers.EventIgnored
	default:
		return providers.Event{}, invalid(CodeMalformed, "unknown trade_status")
	}
	return ev, nil
}

// Acknowledge implements providers.Provider: Alipay stops sending once it
// reads "success"; anything else makes it send again later.
func (c *Client) Acknowledge(w http.ResponseWriter, err error) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	if err == nil {
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write([]byte("success"))
		return
	}
	status := http.StatusInternalServerError
	var pe *providers.Error
	if errors.As(err, &pe) && pe.Kind == providers.Invalid {
		status = http.StatusBadRequest
	}
	w.WriteHeader(status)
	_, _ = w.Write([]byte("fail"))
}
