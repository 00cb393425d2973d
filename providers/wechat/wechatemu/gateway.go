package wechatemu

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"time"

	"kami/providers/fault"
)

// cst is the zone the gateway writes its times in.
var cst = time.FixedZone("CST", 8*60*60)

// Trade states, as v3 names them.
const (
	stateNotPay = "NOTPAY"
	stateSucc   = "SUCCESS"
	stateRefund = "REFUND"
	stateClosed = "CLOSED"
)

type trade struct {
	appID       string
	outTradeNo  string
	txID        string // set when paid
	tradeType   string // NATIVE or MWEB
	description string
	total       int64
	state       string
	successTime time.Time
	refunded    int64
	codeURL     string
	h5URL       string
	notifyID    string // the payment notification's id, one per payment
	payerIP     string // scene_info.payer_client_ip of an H5 payment
}

type refund struct {
	refundID    string
	outRefundNo string
	outTradeNo  string
	txID        string
	refund      int64
	total       int64
	status      string
	createTime  time.Time
	successTime time.Time
	notifyID    string
	held        bool // stays PROCESSING at queries (RefundStaysProcessing, SetRefundStatus)
}

func (s *Server) routes() {
	m := http.NewServeMux()
	m.HandleFunc("POST /v3/pay/transactions/native", s.handle(fault.OpCreate, s.create("NATIVE")))
	m.HandleFunc("POST /v3/pay/transactions/h5", s.handle(fault.OpCreate, s.create("MWEB")))
	m.HandleFunc("GET /v3/pay/transactions/out-trade-no/{no}", s.handle(fault.OpQueryPayment, s.queryByOutTradeNo))
	m.HandleFunc("GET /v3/pay/transactions/id/{id}", s.handle(fault.OpQueryPayment, s.queryByTransactionID))
	m.HandleFunc("POST /v3/pay/transactions/out-trade-no/{no}/close", s.handle(fault.OpClose, s.close))
	m.HandleFunc("POST /v3/refund/domestic/refunds", s.handle(fault.OpRefund, s.refund))
	m.HandleFunc("GET /v3/refund/domestic/refunds/{no}", s.handle(fault.OpQueryRefund, s.queryRefund))
	m.HandleFunc("GET /v3/bill/tradebill", s.handle(fault.OpStatement, s.tradeBill))
	m.HandleFunc("GET /v3/billdownload/file", s.downloadBill)
	m.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		s.unknown = append(s.unknown, r.Method+" "+r.URL.Path)
		s.mu.Unlock()
		s.writeError(w, errorf(http.StatusNotFound, "NOT_FOUND", "no such API"))
	})
	s.mux = m
}

// ---- create ----

type createRequest struct {
	AppID       string `json:"appid"`
	MchID       string `json:"mchid"`
	Description string `json:"description"`
	OutTradeNo  string `json:"out_trade_no"`
	TimeExpire  string `json:"time_expire,omitempty"`
	Attach      string `json:"attach,omitempty"`
	NotifyURL   string `json:"notify_url"`
	Amount      *struct {
		Total    *int64 `json:"total"`
		Currency string `json:"currency,omitempty"`
	} `json:"amount"`
	SceneInfo *struct {
		PayerClientIP string `json:"payer_client_ip"`
		H5Info        *struct {
			Type string `json:"type"`
		} `json:"h5_info,omitempty"`
	} `json:"scene_info,omitempty"`
}

func (s *Server) create(tradeType string) handler {
	return func(r *http.Request, body []byte) (reply, *apiError) {
		var req createRequest
		if e := decodeStrict(body, &req); e != nil {
			return reply{}, e
		}
		if req.MchID != s.opts.MchID {
			return reply{}, errorf(http.StatusBadRequest, "PARAM_ERROR", "mchid is not the signing merchant")
		}
		if req.AppID != s.opts.AppID {
			return reply{}, errorf(http.StatusBadRequest, "APPID_MCHID_NOT_MATCH", "appid和mch_id不匹配")
		}
		if e := checkTradeNo(req.OutTradeNo); e != nil {
			return reply{}, e
		}
		if req.Description == "" || len(req.Description) > 127 {
			return reply{}, errorf(http.StatusBadRequest, "PARAM_ERROR", "description must be 1-127 bytes")
		}
		if u, err := url.Parse(req.NotifyURL); err != nil || u.Scheme != "https" || u.Host == "" || u.RawQuery != "" {
			return reply{}, errorf(http.StatusBadRequest, "PARAM_ERROR", "notify_url must be an https URL without query")
		}
		if req.Amount == nil || req.Amount.Total == nil || *req.Amount.Total < 1 {
			return reply{}, errorf(http.StatusBadRequest, "PARAM_ERROR", "amount.total must be at least 1 fen")
		}
		if req.Amount.Currency != "" && req.Amount.Currency != "CNY" {
			return reply{}, errorf(http.StatusBadRequest, "PARAM_ERROR", "currency must be CNY")
		}
		if req.TimeExpire != "" {
			exp, err := time.Parse(time.RFC3339, req.TimeExpire)
			if err != nil {
				return reply{}, errorf(http.StatusBadRequest, "PARAM_ERROR", "time_expire is not RFC3339")
			}
			if !exp.After(s.opts.Now()) {
				return reply{}, errorf(http.StatusBadRequest, "INVALID_REQUEST", "time_expire is in the past")
			}
		}
		if tradeType == "MWEB" {
			if req.SceneInfo == nil || req.SceneInfo.PayerClientIP == "" || req.SceneInfo.H5Info == nil || req.SceneInfo.H5Info.Type == "" {
				return reply{}, errorf(http.StatusBadRequest, "PARAM_ERROR", "h5 needs scene_info.payer_client_ip and scene_info.h5_info.type")
			}
		}
		total := *req.Amount.Total

		s.mu.Lock()
		defer s.mu.Unlock()
		t, ok := s.trades[req.OutTradeNo]
		if ok {
			switch {
			case t.state == stateSucc || t.state == stateRefund:
				return reply{}, errorf(http.StatusBadRequest, "ORDERPAID", "该订单已支付")
			case t.state == stateClosed:
				return reply{}, errorf(http.StatusBadRequest, "ORDER_CLOSED", "订单已关闭")
			case t.total != total || t.tradeType != tradeType || t.description != req.Description:
				return reply{}, errorf(http.StatusBadRequest, "INVALID_REQUEST", "201 商户订单号重复")
			}
		} else {
			s.seq++
			t = &trade{
				appID:       req.AppID,
				outTradeNo:  req.OutTradeNo,
				tradeType:   tradeType,
				description: req.Description,
				total:       total,
				state:       stateNotPay,
				codeURL:     fmt.Sprintf("weixin://wxpay/bizpayurl?pr=%s", randomHex(5)),
				h5URL:       fmt.Sprintf("https://wx.tenpay.com/cgi-bin/mmpayweb-bin/checkmweb?prepay_id=wx%014d&package=%s", s.seq, randomHex(5)),
			}
			s.trades[req.OutTradeNo] = t
		}
		if tradeType == "MWEB" {
			t.payerIP = req.SceneInfo.PayerClientIP
			return reply{http.StatusOK, map[string]string{"h5_url": t.h5URL}}, nil
		}
		return reply{http.StatusOK, map[string]string{"code_url": t.codeURL}}, nil
	}
}

// ---- query payment ----

// PayerClientIP is the payer_client_ip the H5 payment of outTradeNo was
// created with; "" when there is none.
func (s *Server) PayerClientIP(outTradeNo string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if t, ok := s.trades[outTradeNo]; ok {
		return t.payerIP
	}
	return ""
}

func (s *Server) queryByOutTradeNo(r *http.Request, _ []byte) (reply, *apiError) {
	return s.query(r, r.PathValue("no"))
}

func (s *Server) queryByTransactionID(r *http.Request, _ []byte) (reply, *apiError) {
	s.mu.Lock()
	no, ok := s.byTxID[r.PathValue("id")]
	s.mu.Unlock()
	if !ok {
		if e := s.checkQueryMchID(r); e != nil {
			return reply{}, e
		}
		return reply{}, errorf(http.StatusNotFound, "ORDER_NOT_EXIST", "订单不存在")
	}
	return s.query(r, no)
}

func (s *Server) checkQueryMchID(r *http.Request) *apiError {
	if r.URL.Query().Get("mchid") != s.opts.MchID {
		return errorf(http.StatusBadRequest, "PARAM_ERROR", "mchid query parameter is not the signing merchant")
	}
	return nil
}

func (s *Server) query(r *http.Request, outTradeNo string) (reply, *apiError) {
	if e := s.checkQueryMchID(r); e != nil {
		return reply{}, e
	}
	if e := checkTradeNo(outTradeNo); e != nil {
		return reply{}, e
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	t, ok := s.trades[outTradeNo]
	if !ok {
		return reply{}, errorf(http.StatusNotFound, "ORDER_NOT_EXIST", "订单不存在")
	}
	return reply{http.StatusOK, s.tradeBody(t, s.opts.MchID)}, nil
}

// tradeBody is a trade as the query API and the payment notification show it.
func (s *Server) tradeBody(t *trade, mchID string) map[string]any {
	b := map[string]any{
		"appid":            t.appID,
		"mchid":            mchID,
		"out_trade_no":     t.outTradeNo,
		"trade_type":       t.tradeType,
		"trade_state":      t.state,
		"trade_state_desc": stateDesc(t.state),
		"attach":           "",
	}
	amount := map[string]any{"total": t.total, "currency": "CNY"}
	if t.txID != "" {
		b["transaction_id"] = t.txID
		b["bank_type"] = "OTHERS"
		b["success_time"] = t.successTime.In(cst).Format(time.RFC3339)
		b["payer"] = map[string]string{"openid": "oUpF8uMuAJO_M2pxb1Q9zNjWeS6o"}
		amount["payer_total"] = t.total
		amount["payer_currency"] = "CNY"
	}
	b["amount"] = amount
	return b
}

func stateDesc(state string) string {
	switch state {
	case stateNotPay:
		return "订单未支付"
	case stateSucc:
		return "支付成功"
	case stateRefund:
		return "转入退款"
	case stateClosed:
		return "订单已关闭"
	}
	return ""
}

// ---- close ----

func (s *Server) close(r *http.Request, body []byte) (reply, *apiError) {
	var req struct {
		MchID string `json:"mchid"`
	}
	if e := decodeStrict(body, &req); e != nil {
		return reply{}, e
	}
	if req.MchID != s.opts.MchID {
		return reply{}, errorf(http.StatusBadRequest, "PARAM_ERROR", "mchid is not the signing merchant")
	}
	no := r.PathValue("no")
	if e := checkTradeNo(no); e != nil {
		return reply{}, e
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	t, ok := s.trades[no]
	if !ok {
		return reply{}, errorf(http.StatusNotFound, "ORDER_NOT_EXIST", "订单不存在")
	}
	switch t.state {
	case stateSucc, stateRefund:
		return reply{}, errorf(http.StatusBadRequest, "ORDERPAID", "订单已支付")
	}
	t.state = stateClosed
	return reply{status: http.StatusNoContent}, nil
}

// ---- refunds ----

type refundRequest struct {
	TransactionID string `json:"transaction_id,omitempty"`
	OutTradeNo    string `json:"out_trade_no,omitempty"`
	OutRefundNo   string `json:"out_refund_no"`
	Reason        string `json:"reason,omitempty"`
	NotifyURL     string `json:"notify_url,omitempty"`
	FundsAccount  string `json:"funds_account,omitempty"`
	Amount        *struct {
		Refund   *int64 `json:"refund"`
		Total    *int64 `json:"total"`
		Currency string `json:"currency"`
	} `json:"amount"`
}

// countRefundCall counts an authenticated refund call under its number,
// whatever then becomes of it.
func (s *Server) countRefundCall(body []byte) {
	var req struct {
		OutRefundNo string `json:"out_refund_no"`
	}
	if json.Unmarshal(body, &req) == nil && req.OutRefundNo != "" {
		s.mu.Lock()
		s.calls[req.OutRefundNo]++
		s.mu.Unlock()
	}
}

func (s *Server) refund(_ *http.Request, body []byte) (reply, *apiError) {
	var req refundRequest
	if e := decodeStrict(body, &req); e != nil {
		return reply{}, e
	}
	if e := checkRefundNo(req.OutRefundNo); e != nil {
		return reply{}, e
	}
	if (req.OutTradeNo == "") == (req.TransactionID == "") {
		return reply{}, errorf(http.StatusBadRequest, "PARAM_ERROR", "give exactly one of transaction_id and out_trade_no")
	}
	if len(req.Reason) > 80 {
		return reply{}, errorf(http.StatusBadRequest, "PARAM_ERROR", "reason over 80 bytes")
	}
	if req.NotifyURL != "" {
		if u, err := url.Parse(req.NotifyURL); err != nil || u.Scheme != "https" || u.Host == "" {
			return reply{}, errorf(http.StatusBadRequest, "PARAM_ERROR", "notify_url must be an https URL")
		}
	}
	if req.Amount == nil || req.Amount.Refund == nil || req.Amount.Total == nil || req.Amount.Currency != "CNY" {
		return reply{}, errorf(http.StatusBadRequest, "PARAM_ERROR", "amount needs refund, total and currency CNY")
	}
	amt, total := *req.Amount.Refund, *req.Amount.Total
	if amt < 1 || total < 1 {
		return reply{}, errorf(http.StatusBadRequest, "PARAM_ERROR", "amounts must be at least 1 fen")
	}

	s.mu.Lock()
	defer s.mu.Unlock()
	var t *trade
	if req.OutTradeNo != "" {
		if e := checkTradeNo(req.OutTradeNo); e != nil {
			return reply{}, e
		}
		t = s.trades[req.OutTradeNo]
	} else if no, ok := s.byTxID[req.TransactionID]; ok {
		t = s.trades[no]
	}
	if t == nil {
		return reply{}, errorf(http.StatusNotFound, "RESOURCE_NOT_EXISTS", "订单不存在")
	}

	// The same refund number is the same refund: answer with it, refund
	// nothing more.
	if rf, ok := s.refunds[req.OutRefundNo]; ok {
		if rf.outTradeNo != t.outTradeNo || rf.refund != amt || rf.total != total {
			return reply{}, errorf(http.StatusBadRequest, "INVALID_REQUEST", "订单金额或退款金额与之前请求不一致，请核实后再试")
		}
		return reply{http.StatusOK, s.refundBody(rf)}, nil
	}

	if t.state != stateSucc && t.state != stateRefund {
		return reply{}, errorf(http.StatusBadRequest, "INVALID_REQUEST", "订单未支付")
	}
	if total != t.total {
		return reply{}, errorf(http.StatusBadRequest, "INVALID_REQUEST", "订单金额或退款金额与之前请求不一致，请核实后再试")
	}
	if t.refunded+amt > t.total {
		return reply{}, errorf(http.StatusBadRequest, "INVALID_REQUEST", "申请退款金额超过订单可退金额")
	}

	s.seq++
	now := s.opts.Now()
	rf := &refund{
		refundID:    fmt.Sprintf("50300%023d", s.seq),
		outRefundNo: req.OutRefundNo,
		outTradeNo:  t.outTradeNo,
		txID:        t.txID,
		refund:      amt,
		total:       t.total,
		status:      stateSucc,
		createTime:  now,
		successTime: now,
	}
	if s.opts.RefundProcessing || s.opts.RefundStaysProcessing {
		rf.status = "PROCESSING"
		rf.successTime = time.Time{}
		rf.held = s.opts.RefundStaysProcessing
	}
	s.refunds[rf.outRefundNo] = rf
	t.refunded += amt
	t.state = stateRefund
	return reply{http.StatusOK, s.refundBody(rf)}, nil
}

func (s *Server) queryRefund(r *http.Request, _ []byte) (reply, *apiError) {
	no := r.PathValue("no")
	if e := checkRefundNo(no); e != nil {
		return reply{}, e
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	rf, ok := s.refunds[no]
	if !ok {
		return reply{}, errorf(http.StatusNotFound, "RESOURCE_NOT_EXISTS", "退款单不存在")
	}
	if rf.status == "PROCESSING" && !rf.held {
		// The bank has answered by the time anyone asks.
		rf.status = stateSucc
		rf.successTime = s.opts.Now()
	}
	return reply{http.StatusOK, s.refundBody(rf)}, nil
}

func (s *Server) refundBody(rf *refund) map[string]any {
	b := map[string]any{
		"refund_id":             rf.refundID,
		"out_refund_no":         rf.outRefundNo,
		"transaction_id":        rf.txID,
		"out_trade_no":          rf.outTradeNo,
		"channel":               "ORIGINAL",
		"user_received_account": "支付用户零钱",
		"create_time":           rf.createTime.In(cst).Format(time.RFC3339),
		"status":                rf.status,
		"funds_account":         "AVAILABLE",
		"amount": map[string]any{
			"total":             rf.total,
			"refund":            rf.refund,
			"from":              []any{},
			"payer_total":       rf.total,
			"payer_refund":      rf.refund,
			"settlement_refund": rf.refund,
			"settlement_total":  rf.total,
			"discount_refund":   0,
			"currency":          "CNY",
		},
	}
	if !rf.successTime.IsZero() {
		b["success_time"] = rf.successTime.In(cst).Format(time.RFC3339)
	}
	return b
}

// SetTradeState puts an unpaid trade in state (NOTPAY, USERPAYING,
// PAYERROR), for tests of the states a buyer's payment passes through: the
// trade can still be paid, and closed, from any of them.
func (s *Server) SetTradeState(outTradeNo, state string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	t, ok := s.trades[outTradeNo]
	if !ok || t.txID != "" || t.state == stateClosed {
		return fmt.Errorf("wechatemu: no unpaid open trade %s", outTradeNo)
	}
	t.state = state
	return nil
}

// SetRefundStatus moves a refund to status (SUCCESS, PROCESSING, ABNORMAL,
// CLOSED), for tests of refunds that fail at the bank or take days. A
// refund set to PROCESSING stays so at every query; one that no longer
// holds money gives it back to its trade.
func (s *Server) SetRefundStatus(refundNo, status string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	rf, ok := s.refunds[refundNo]
	if !ok {
		return fmt.Errorf("wechatemu: no refund %s", refundNo)
	}
	holds := func(st string) bool { return st == stateSucc || st == "PROCESSING" }
	if t := s.trades[rf.outTradeNo]; t != nil && holds(rf.status) != holds(status) {
		if holds(status) {
			t.refunded += rf.refund
		} else {
			t.refunded -= rf.refund
		}
	}
	rf.status = status
	rf.held = status == "PROCESSING"
	if status == stateSucc && rf.successTime.IsZero() {
		rf.successTime = s.opts.Now()
	}
	return nil
}

// Refunded is what the gateway refunded under refundNo (nothing for a
// refund that failed) and how many authenticated refund calls named it.
func (s *Server) Refunded(refundNo string) (fen int64, calls int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if rf, ok := s.refunds[refundNo]; ok && (rf.status == stateSucc || rf.status == "PROCESSING") {
		fen = rf.refund
	}
	return fen, s.calls[refundNo]
}

// ---- numbers ----

const idChars = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_-|*"

// checkTradeNo applies WeChat's rule for out_trade_no: 6-32 of
// [0-9A-Za-z_-|*].
func checkTradeNo(no string) *apiError {
	if len(no) < 6 || len(no) > 32 || strings.Trim(no, idChars) != "" {
		return errorf(http.StatusBadRequest, "PARAM_ERROR", "out_trade_no must be 6-32 of [0-9A-Za-z_-|*]")
	}
	return nil
}

// checkRefundNo applies WeChat's rule for out_refund_no: 1-64 of
// [0-9A-Za-z_-|*@].
func checkRefundNo(no string) *apiError {
	if len(no) < 1 || len(no) > 64 || strings.Trim(no, idChars+"@") != "" {
		return errorf(http.StatusBadRequest, "PARAM_ERROR", "out_refund_no must be 1-64 of [0-9A-Za-z_-|*@]")
	}
	return nil
}
