package wechat

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"time"

	wv3 "github.com/go-pay/gopay/wechat/v3"

	"kami/providers"
)

// MaxNotificationBytes bounds a notification body; WeChat's are a few
// hundred bytes.
const MaxNotificationBytes = 64 << 10

// MaxClockSkew is how far a notification's Wechatpay-Timestamp may be from
// now. An older one is a replay.
const MaxClockSkew = 5 * time.Minute

// notification is the outer JSON of a v3 notification.
type notification struct {
	ID           string `json:"id"`
	CreateTime   string `json:"create_time"`
	EventType    string `json:"event_type"`
	ResourceType string `json:"resource_type"`
	Summary      string `json:"summary"`
	Resource     *struct {
		Algorithm      string `json:"algorithm"`
		OriginalType   string `json:"original_type"`
		Ciphertext     string `json:"ciphertext"`
		AssociatedData string `json:"associated_data"`
		Nonce          string `json:"nonce"`
	} `json:"resource"`
}

// ParseNotification implements providers.Provider. Nothing in the body is
// read before its signature, its key ID and its age have been checked.
func (c *Client) ParseNotification(_ context.Context, header http.Header, body []byte) (providers.Event, error) {
	if len(body) > MaxNotificationBytes {
		return providers.Event{}, invalid("body over %d bytes", MaxNotificationBytes)
	}
	ts := header.Get(wv3.HeaderTimestamp)
	nonce := header.Get(wv3.HeaderNonce)
	sig := header.Get(wv3.HeaderSignature)
	serial := header.Get(wv3.HeaderSerial)
	if ts == "" || nonce == "" || sig == "" || serial == "" {
		return providers.Event{}, invalid("missing Wechatpay-* signature headers")
	}
	if serial != c.platformID {
		return providers.Event{}, invalid("Wechatpay-Serial is not the configured public key ID")
	}
	sec, err := strconv.ParseInt(ts, 10, 64)
	if err != nil {
		return providers.Event{}, invalid("Wechatpay-Timestamp is not a number")
	}
	if d := c.now().Sub(time.Unix(sec, 0)); d > MaxClockSkew || d < -MaxClockSkew {
		return providers.Event{}, invalid("Wechatpay-Timestamp is more than %s from now (replay?)", MaxClockSkew)
	}
	if err := wv3.V3VerifySignByPK(ts, nonce, string(body), sig, c.platformKey); err != nil {
		return providers.Event{}, invalid("signature does not verify")
	}

	var n notification
	if err := json.Unmarshal(body, &n); err != nil {
		return providers.Event{}, invalid("body is not JSON")
	}
	if n.ID == "" || n.EventType == "" {
		return providers.Event{}, invalid("no id or event_type")
	}
	var plain []byte
	if n.Resource != nil {
		if n.Resource.Algorithm != "AEAD_AES_256_GCM" {
			return providers.Event{}, invalid("resource algorithm is not AEAD_AES_256_GCM")
		}
		plain, err = wv3.V3DecryptNotifyCipherTextToBytes(n.Resource.Ciphertext, n.Resource.Nonce, n.Resource.AssociatedData, c.apiV3Key)
		if err != nil {
			return providers.Event{}, invalid("resource does not decrypt with the API v3 key")
		}
	}

	switch n.EventType {
	case "TRANSACTION.SUCCESS":
		return c.paymentEvent(n.ID, plain)
	case "REFUND.SUCCESS":
		return c.refundEvent(n.ID, providers.EventRefundSucceeded, plain)
	case "REFUND.ABNORMAL", "REFUND.CLOSED":
		return c.refundEvent(n.ID, providers.EventRefundFailed, plain)
	}
	// Some other event for this merchant: acknowledge it and do nothing,
	// unless what it carries names another merchant.
	ev := providers.Event{Kind: providers.EventIgnored, NotifyID: n.ID}
	if plain != nil {
		var owner struct {
			Mchid string `json:"mchid"`
		}
		if err := json.Unmarshal(plain, &owner); err != nil {
			return providers.Event{}, invalid("resource is not JSON")
		}
		if owner.Mchid != "" && owner.Mchid != c.mchID {
			return providers.Event{}, invalid("notification names another mchid")
		}
		ev.Merchant = owner.Mchid
	}
	return ev, nil
}

func (c *Client) paymentEvent(id string, plain []byte) (providers.Event, error) {
	if plain == nil {
		return providers.Event{}, invalid("payment notification without resource")
	}
	var r wv3.V3DecryptPayResult
	if err := json.Unmarshal(plain, &r); err != nil {
		return providers.Event{}, invalid("payment resource is not JSON")
	}
	if r.Mchid != c.mchID {
		return providers.Event{}, invalid("notification names another mchid")
	}
	if r.Appid != c.appID {
		return providers.Event{}, invalid("notification names another appid")
	}
	if r.TradeState != "SUCCESS" {
		return providers.Event{Kind: providers.EventIgnored, NotifyID: id, OrderNo: r.OutTradeNo, Merchant: r.Mchid}, nil
	}
	if r.OutTradeNo == "" || r.TransactionId == "" || r.Amount == nil || r.Amount.Total <= 0 {
		return providers.Event{}, invalid("payment resource lacks out_trade_no, transaction_id or amount")
	}
	paidAt, err := time.Parse(time.RFC3339, r.SuccessTime)
	if err != nil {
		return providers.Event{}, invalid("payment resource has no valid success_time")
	}
	return providers.Event{
		Kind:      providers.EventPaymentSucceeded,
		NotifyID:  id,
		OrderNo:   r.OutTradeNo,
		TradeNo:   r.TransactionId,
		AmountFen: int64(r.Amount.Total),
		PaidAt:    paidAt,
		Merchant:  r.Mchid,
	}, nil
}

func (c *Client) refundEvent(id string, kind providers.EventKind, plain []byte) (providers.Event, error) {
	if plain == nil {
		return providers.Event{}, invalid("refund notification without resource")
	}
	var r wv3.V3DecryptRefundResult
	if err := json.Unmarshal(plain, &r); err != nil {
		return providers.Event{}, invalid("refund resource is not JSON")
	}
	if r.Mchid != c.mchID {
		return providers.Event{}, invalid("notification names another mchid")
	}
	if r.OutRefundNo == "" || r.OutTradeNo == "" || r.Amount == nil {
		return providers.Event{}, invalid("refund resource lacks out_refund_no, out_trade_no or amount")
	}
	return providers.Event{
		Kind:      kind,
		NotifyID:  id,
		OrderNo:   r.OutTradeNo,
		TradeNo:   r.TransactionId,
		AmountFen: int64(r.Amount.Total),
		RefundNo:  r.OutRefundNo,
		RefundFen: int64(r.Amount.Refund),
		Merchant:  r.Mchid,
	}, nil
}

func invalid(format string, args ...any) *providers.Error {
	return &providers.Error{Kind: providers.Invalid, Provider: Name, Op: opNotification, Message: fmt.Sprintf(format, args...)}
}

// Acknowledge implements providers.Provider. v3 wants 200 or 204 with no
// body for success, and 4xx/5xx with {"code":"FAIL","message":...} for a
// failure, after which it sends again later.
func (c *Client) Acknowledge(w http.ResponseWriter, err error) {
	if err == nil {
		w.WriteHeader(http.StatusOK)
		return
	}
	status, msg := http.StatusInternalServerError, "failed, send again later"
	if providers.KindOf(err) == providers.Invalid {
		// The message stays generic: whoever sent a bad notification learns
		// nothing about what kami checks.
		status, msg = http.StatusBadRequest, "invalid notification"
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(wv3.V3NotifyRsp{Code: "FAIL", Message: msg})
}
