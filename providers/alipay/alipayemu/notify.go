package alipayemu

import (
	"crypto/rand"
	"crypto/rsa"
	"fmt"
	"net/http"
	"net/url"
)

// Asynchronous notifications, built as the gateway posts them to notify_url:
// a form whose RSA2 signature covers every field but sign and sign_type.

// forger is a key that is not the gateway's, made on first use.
func (s *Server) forger() keySigner {
	s.forgeOnce.Do(func() {
		if s.forgeKey != nil {
			return
		}
		k, err := rsa.GenerateKey(rand.Reader, 2048)
		if err != nil {
			panic(fmt.Sprintf("alipayemu: forge key: %v", err))
		}
		s.forgeKey = k
	})
	return keySigner{s.forgeKey}
}

type keySigner struct{ key *rsa.PrivateKey }

func (k keySigner) sign(content string) string { return rsa2Sign(k.key, content) }

// NotificationHeader is the header Alipay's notification posts carry.
func NotificationHeader() http.Header {
	return http.Header{"Content-Type": {"application/x-www-form-urlencoded; charset=utf-8"}}
}

// Notification signs fields as a gateway notification with the gateway's
// key (sign_type RSA2 is added) and returns the body. Tests use it to
// send what a real gateway would not (odd amounts, unknown states).
func (s *Server) Notification(fields map[string]string) []byte {
	return encodeNotice(fields, keySigner{s.key})
}

func encodeNotice(fields map[string]string, k keySigner) []byte {
	v := url.Values{}
	for name, val := range fields {
		v.Set(name, val)
	}
	v.Set("sign_type", "RSA2")
	v.Set("sign", k.sign(signContent(fields, "sign", "sign_type")))
	return []byte(v.Encode())
}

// Pay makes the buyer pay orderNo amountFen and returns the notification.
// It is the test's hand, so it pays whatever the trade's state: a trade
// never created is created, an unpaid or closed one is paid (a payment that
// raced the close is what late-payment refunds are for). Paying a paid
// trade again returns its notification again, unchanged, as a redelivery.
func (s *Server) Pay(orderNo string, amountFen int64) (http.Header, []byte, error) {
	if orderNo == "" || amountFen <= 0 || amountFen > 100000000*100 {
		return nil, nil, fmt.Errorf("alipayemu: Pay(%q, %d): bad arguments", orderNo, amountFen)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	t, ok := s.trades[orderNo]
	if !ok {
		t = s.newTradeLocked(orderNo, "kami order "+orderNo, amountFen)
	}
	if t.payNotice != nil {
		return NotificationHeader(), t.payNotice, nil
	}
	t.totalFen, t.status, t.closed, t.paidAt = amountFen, statusSuccess, false, s.now()
	fields := s.paymentFieldsLocked(t)
	fields["notify_id"] = randomID(16)
	t.payNotice = encodeNotice(fields, keySigner{s.key})
	return NotificationHeader(), t.payNotice, nil
}

// RefundNotification is the trade notification Alipay sends after the
// refund refundNo: it carries out_biz_no (the out_request_no) and refund_fee
// (the trade's refunded total right after that refund).
func (s *Server) RefundNotification(refundNo string) (http.Header, []byte, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	rf, ok := s.refunds[refundNo]
	if !ok {
		return nil, nil, fmt.Errorf("alipayemu: no refund %q", refundNo)
	}
	t := rf.trade
	fields := s.paymentFieldsLocked(t)
	fields["notify_id"] = rf.notifyID
	fields["out_biz_no"] = rf.outRequestNo
	fields["refund_fee"] = formatAmount(rf.refundedTill)
	fields["gmt_refund"] = rf.at.In(beijing).Format(alipayTime + ".000")
	if rf.refundedTill == t.totalFen {
		fields["trade_status"] = statusClosed
		fields["gmt_close"] = rf.at.In(beijing).Format(alipayTime)
	}
	return NotificationHeader(), encodeNotice(fields, keySigner{s.key}), nil
}

// Forge returns a payment notification for orderNo signed with a key that
// is not the gateway's. Nothing is recorded.
func (s *Server) Forge(orderNo string, amountFen int64) (http.Header, []byte) {
	fields := s.detachedPayment(orderNo, amountFen, s.appID)
	return NotificationHeader(), encodeNotice(fields, s.forger())
}

// OtherApp returns a payment notification correctly signed by the gateway
// but naming OtherAppID. Nothing is recorded.
func (s *Server) OtherApp(orderNo string, amountFen int64) (http.Header, []byte) {
	fields := s.detachedPayment(orderNo, amountFen, OtherAppID)
	return NotificationHeader(), encodeNotice(fields, keySigner{s.key})
}

// PaymentFields returns the fields of a genuine-looking payment notification
// for orderNo without recording anything; sign them with Notification.
func (s *Server) PaymentFields(orderNo string, amountFen int64) map[string]string {
	return s.detachedPayment(orderNo, amountFen, s.appID)
}

func (s *Server) detachedPayment(orderNo string, amountFen int64, appID string) map[string]string {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	s.seq++
	t := &trade{
		outTradeNo: orderNo,
		tradeNo:    fmt.Sprintf("%s22001%011d", now.In(beijing).Format("20060102"), s.seq),
		subject:    "kami order " + orderNo,
		totalFen:   amountFen,
		status:     statusSuccess,
		created:    now,
		paidAt:     now,
	}
	fields := s.paymentFieldsLocked(t)
	fields["notify_id"] = randomID(16)
	fields["app_id"], fields["auth_app_id"] = appID, appID
	return fields
}

func (s *Server) paymentFieldsLocked(t *trade) map[string]string {
	amount := formatAmount(t.totalFen)
	return map[string]string{
		"notify_type":      "trade_status_sync",
		"notify_time":      s.now().In(beijing).Format(alipayTime),
		"app_id":           s.appID,
		"auth_app_id":      s.appID,
		"charset":          "utf-8",
		"version":          "1.0",
		"trade_no":         t.tradeNo,
		"out_trade_no":     t.outTradeNo,
		"trade_status":     statusSuccess,
		"subject":          t.subject,
		"total_amount":     amount,
		"receipt_amount":   amount,
		"invoice_amount":   amount,
		"buyer_pay_amount": amount,
		"point_amount":     "0.00",
		"gmt_create":       t.created.In(beijing).Format(alipayTime),
		"gmt_payment":      t.paidAt.In(beijing).Format(alipayTime),
		"buyer_id":         "2088102177846880",
		"buyer_logon_id":   "kam***@example.com",
		"seller_id":        SellerID,
		"seller_email":     "shop@example.com",
		"fund_bill_list":   `[{"amount":"` + amount + `","fundChannel":"ALIPAYACCOUNT"}]`,
	}
}
