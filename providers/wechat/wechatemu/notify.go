package wechatemu

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rsa"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"
)

// Notification describes a notification to build. Zero fields take the
// real gateway's values, so a test changes only what it means to break.
type Notification struct {
	ID           string // default: fresh
	EventType    string // TRANSACTION.SUCCESS, REFUND.SUCCESS, ...
	Summary      string
	OriginalType string // "transaction" or "refund"
	// Resource is marshalled to JSON and encrypted with AEAD_AES_256_GCM;
	// nil sends no resource.
	Resource any
	// Time is the Wechatpay-Timestamp; zero: the gateway's now.
	Time time.Time
	// Serial is the Wechatpay-Serial; empty: the platform key ID.
	Serial string
	// SignWith signs instead of the platform key (a forger).
	SignWith *rsa.PrivateKey
	// APIv3Key encrypts instead of the merchant's key.
	APIv3Key string
}

// Notify builds a signed, encrypted v3 notification as the gateway posts it
// to notify_url.
func (s *Server) Notify(n Notification) (http.Header, []byte, error) {
	now := s.opts.Now()
	if n.ID == "" {
		n.ID = s.newNotifyID()
	}
	if n.Time.IsZero() {
		n.Time = now
	}
	if n.Serial == "" {
		n.Serial = s.opts.PlatformKeyID
	}
	key := n.SignWith
	if key == nil {
		key = s.opts.PlatformKey
	}
	apiKey := n.APIv3Key
	if apiKey == "" {
		apiKey = s.opts.APIv3Key
	}
	body := map[string]any{
		"id":            n.ID,
		"create_time":   now.In(cst).Format(time.RFC3339),
		"event_type":    n.EventType,
		"resource_type": "encrypt-resource",
		"summary":       n.Summary,
	}
	if n.Resource != nil {
		plain, err := json.Marshal(n.Resource)
		if err != nil {
			return nil, nil, fmt.Errorf("wechatemu: resource: %w", err)
		}
		res, err := encrypt(apiKey, n.OriginalType, plain)
		if err != nil {
			return nil, nil, err
		}
		body["resource"] = res
	}
	b, err := json.Marshal(body)
	if err != nil {
		return nil, nil, err
	}
	h := s.signatureHeaders(key, n.Serial, n.Time, b)
	h.Set("Content-Type", "application/json")
	h.Set("User-Agent", "Mozilla/4.0")
	return h, b, nil
}

func (s *Server) newNotifyID() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.seq++
	return fmt.Sprintf("%08x-%04x-5%03x-8%03x-%012x", s.seq, s.seq&0xffff, s.seq&0xfff, s.seq&0xfff, time.Now().UnixNano()&0xffffffffffff)
}

// encrypt seals plain as v3 does: AES-256-GCM under the API v3 key with a
// 12-character nonce and associated_data, ciphertext base64 with its tag.
func encrypt(apiV3Key, originalType string, plain []byte) (map[string]string, error) {
	block, err := aes.NewCipher([]byte(apiV3Key))
	if err != nil {
		return nil, fmt.Errorf("wechatemu: API v3 key: %w", err)
	}
	gcm, err := cipher.NewGCM(block)
	if err != nil {
		return nil, err
	}
	nonce := randomHex(6) // 12 characters
	ad := originalType
	sealed := gcm.Seal(nil, []byte(nonce), plain, []byte(ad))
	return map[string]string{
		"algorithm":       "AEAD_AES_256_GCM",
		"ciphertext":      base64.StdEncoding.EncodeToString(sealed),
		"associated_data": ad,
		"original_type":   originalType,
		"nonce":           nonce,
	}, nil
}

// Pay records that the buyer paid amountFen for orderNo (created before or
// not) and returns the payment notification. Paying a paid trade again
// returns the same notification, as a redelivery.
func (s *Server) Pay(orderNo string, amountFen int64) (http.Header, []byte, error) {
	if e := checkTradeNo(orderNo); e != nil {
		return nil, nil, errors.New("wechatemu: " + e.Message)
	}
	if amountFen < 1 {
		return nil, nil, errors.New("wechatemu: amount must be at least 1 fen")
	}
	s.mu.Lock()
	t, ok := s.trades[orderNo]
	if !ok {
		t = &trade{appID: s.opts.AppID, outTradeNo: orderNo, tradeType: "NATIVE", description: orderNo, state: stateNotPay}
		s.trades[orderNo] = t
	}
	if t.txID == "" {
		s.seq++
		t.txID = fmt.Sprintf("4200%06d%s%08d", s.seq%1000000, s.opts.Now().In(cst).Format("20060102"), s.seq)
		t.total = amountFen
		t.state = stateSucc
		t.successTime = s.opts.Now().Truncate(time.Second)
		s.byTxID[t.txID] = orderNo
	}
	if t.notifyID == "" {
		t.notifyID = fmt.Sprintf("pay-%s", t.txID)
	}
	res := s.tradeBody(t, s.opts.MchID)
	res["trade_state"] = stateSucc // the notification tells of the payment
	id := t.notifyID
	s.mu.Unlock()
	return s.Notify(Notification{ID: id, EventType: "TRANSACTION.SUCCESS", Summary: "支付成功", OriginalType: "transaction", Resource: res})
}

// PaymentResource is the decrypted resource of a payment notification for a
// trade that exists nowhere, to build notifications that must be refused.
func (s *Server) PaymentResource(orderNo string, amountFen int64, mchID, appID string) map[string]any {
	s.mu.Lock()
	s.seq++
	seq := s.seq
	s.mu.Unlock()
	t := &trade{
		appID: appID, outTradeNo: orderNo, tradeType: "NATIVE", total: amountFen, state: stateSucc,
		txID: fmt.Sprintf("4200%06d%s%08d", seq%1000000, s.opts.Now().In(cst).Format("20060102"), seq), successTime: s.opts.Now(),
	}
	return s.tradeBody(t, mchID)
}

// Forge returns a payment notification that is right in every way but its
// signature, made with a key that is not the gateway's.
func (s *Server) Forge(orderNo string, amountFen int64) (http.Header, []byte, error) {
	k, err := s.forgerKey()
	if err != nil {
		return nil, nil, err
	}
	return s.Notify(Notification{EventType: "TRANSACTION.SUCCESS", OriginalType: "transaction", SignWith: k,
		Resource: s.PaymentResource(orderNo, amountFen, s.opts.MchID, s.opts.AppID)})
}

// OtherMerchant returns a correctly signed payment notification whose
// resource names another mchid and appid.
func (s *Server) OtherMerchant(orderNo string, amountFen int64) (http.Header, []byte, error) {
	return s.Notify(Notification{EventType: "TRANSACTION.SUCCESS", OriginalType: "transaction",
		Resource: s.PaymentResource(orderNo, amountFen, "1900009999", "wx0000000000other")})
}

func (s *Server) forgerKey() (*rsa.PrivateKey, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.otherKey == nil {
		k, err := GenerateKey()
		if err != nil {
			return nil, err
		}
		s.otherKey = k
	}
	return s.otherKey, nil
}

// RefundNotification returns the notification for the refund refundNo in
// its present state: REFUND.SUCCESS, REFUND.ABNORMAL or REFUND.CLOSED. A
// refund still PROCESSING has none yet.
func (s *Server) RefundNotification(refundNo string) (http.Header, []byte, error) {
	s.mu.Lock()
	rf, ok := s.refunds[refundNo]
	if !ok {
		s.mu.Unlock()
		return nil, nil, fmt.Errorf("wechatemu: no refund %s", refundNo)
	}
	var event, summary string
	switch rf.status {
	case stateSucc:
		event, summary = "REFUND.SUCCESS", "退款成功"
	case "ABNORMAL":
		event, summary = "REFUND.ABNORMAL", "退款异常"
	case stateClosed:
		event, summary = "REFUND.CLOSED", "退款关闭"
	default:
		s.mu.Unlock()
		return nil, nil, fmt.Errorf("wechatemu: refund %s is %s: no notification yet", refundNo, rf.status)
	}
	if rf.notifyID == "" {
		s.seq++
		rf.notifyID = fmt.Sprintf("refund-%s-%d", rf.refundID, s.seq)
	}
	res := map[string]any{
		"mchid":                 s.opts.MchID,
		"out_trade_no":          rf.outTradeNo,
		"transaction_id":        rf.txID,
		"out_refund_no":         rf.outRefundNo,
		"refund_id":             rf.refundID,
		"refund_status":         rf.status,
		"user_received_account": "支付用户零钱",
		"amount": map[string]any{
			"total":        rf.total,
			"refund":       rf.refund,
			"payer_total":  rf.total,
			"payer_refund": rf.refund,
		},
	}
	if !rf.successTime.IsZero() {
		res["success_time"] = rf.successTime.In(cst).Format(time.RFC3339)
	}
	id := rf.notifyID
	s.mu.Unlock()
	return s.Notify(Notification{ID: id, EventType: event, Summary: summary, OriginalType: "refund", Resource: res})
}
