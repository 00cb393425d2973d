package wechatemu

import (
	"bytes"
	"crypto/sha1"
	"encoding/csv"
	"encoding/hex"
	"fmt"
	"net/http"
	"sort"
	"strconv"
	"time"

	"kami/providers/fault"
)

// The daily trade bill, built from the emulator's own books in WeChat Pay's
// format. GET /v3/bill/tradebill?bill_date=2026-12-01&bill_type=ALL answers
// (signed) the file's SHA1 and a download address on api.mch.weixin.qq.com,
// good for 30 seconds; GET /v3/billdownload/file (a signed request) answers
// the file itself, unsigned, as the gateway serves files. The file lists
// every payment made on the day (交易状态 SUCCESS, at its success time) and
// every refund asked on it (REFUND, with its present 退款状态), every value
// prefixed with a backtick, then the summary header and row.
//
// A day's bill exists once the day is over (Beijing time, by the emulator's
// clock): before that the answer is 400 STATEMENT_CREATING; a day without a
// row has none, 400 NO_STATEMENT_EXIST. Options.EarlyStatements serves the
// books so far at once, so that tests need not wait for tomorrow.

// OpDownload is the file download, for fault injection (OpStatement is the
// tradebill call). It takes fault.Timeout, fault.Server5xx and
// FaultTamperedStatement.
const OpDownload fault.Op = "statement_download"

// FaultTamperedStatement serves the file with one byte changed, as a broken
// proxy would: its SHA1 no longer matches.
const FaultTamperedStatement fault.Fault = "tampered-statement"

// billLinkTTL is how long a download address works.
const billLinkTTL = 30 * time.Second

type billFile struct {
	data    []byte
	expires time.Time
}

var billHeader = []string{"交易时间", "公众账号ID", "商户号", "特约商户号", "设备号", "微信订单号", "商户订单号", "用户标识", "交易类型",
	"交易状态", "付款银行", "货币种类", "应结订单金额", "代金券金额", "微信退款单号", "商户退款单号", "退款金额", "充值券退款金额", "退款类型",
	"退款状态", "商品名称", "商户数据包", "手续费", "费率", "订单金额", "申请退款金额", "费率备注"}

// feeRate is the emulated merchant's rate: 0.60%, that is 6 hundred-
// thousandths of a yuan per fen.
const feeRate = "0.60%"

func (s *Server) tradeBill(r *http.Request, _ []byte) (reply, *apiError) {
	q := r.URL.Query()
	day, err := time.ParseInLocation("2006-01-02", q.Get("bill_date"), cst)
	if err != nil {
		return reply{}, errorf(http.StatusBadRequest, "PARAM_ERROR", "bill_date 格式不正确")
	}
	kind := q.Get("bill_type")
	switch kind {
	case "":
		kind = "ALL"
	case "ALL", "SUCCESS", "REFUND":
	default:
		return reply{}, errorf(http.StatusBadRequest, "PARAM_ERROR", "bill_type 不正确")
	}
	if t := q.Get("tar_type"); t != "" {
		return reply{}, errorf(http.StatusBadRequest, "PARAM_ERROR", "the emulator serves plain files only (tar_type %q)", t)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.opts.Now()
	if now.Before(day) {
		return reply{}, errorf(http.StatusBadRequest, "PARAM_ERROR", "bill_date 不能晚于今天")
	}
	if !s.opts.EarlyStatements && now.Before(day.AddDate(0, 0, 1)) {
		return reply{}, errorf(http.StatusBadRequest, "STATEMENT_CREATING", "账单生成中")
	}
	data, rows := s.billLocked(day, kind)
	if rows == 0 {
		return reply{}, errorf(http.StatusBadRequest, "NO_STATEMENT_EXIST", "账单文件不存在")
	}
	token := randomHex(16)
	if s.bills == nil {
		s.bills = map[string]billFile{}
	}
	for tok, f := range s.bills {
		if now.After(f.expires) {
			delete(s.bills, tok)
		}
	}
	s.bills[token] = billFile{data: data, expires: now.Add(billLinkTTL)}
	sum := sha1.Sum(data)
	return reply{http.StatusOK, map[string]string{
		"hash_type":    "SHA1",
		"hash_value":   hex.EncodeToString(sum[:]),
		"download_url": "https://api.mch.weixin.qq.com/v3/billdownload/file?token=" + token,
	}}, nil
}

// downloadBill serves a file to a signed request.
func (s *Server) downloadBill(w http.ResponseWriter, r *http.Request) {
	if aerr := s.authenticate(r, nil); aerr != nil {
		s.writeError(w, aerr)
		return
	}
	f := s.faults.Take(OpDownload)
	switch f {
	case fault.Timeout:
		s.hold(r)
		return
	case fault.Server5xx:
		s.write5xx(w)
		return
	}
	s.mu.Lock()
	file, ok := s.bills[r.URL.Query().Get("token")]
	if ok && s.opts.Now().After(file.expires) {
		ok = false
	}
	s.mu.Unlock()
	if !ok {
		s.writeError(w, errorf(http.StatusBadRequest, "PARAM_ERROR", "下载地址已失效"))
		return
	}
	data := file.data
	if f == FaultTamperedStatement {
		data = bytes.Clone(data)
		data[len(data)/2] ^= 0x01
	}
	w.Header().Set("Content-Type", "text/plain;charset=utf-8")
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(data)
}

// Bill is the file of the day that starts at day (Beijing), bill_type ALL,
// as a download would serve it now, and how many rows it has; tests of the
// parser use it.
func (s *Server) Bill(day time.Time) ([]byte, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	y, m, d := day.In(cst).Date()
	return s.billLocked(time.Date(y, m, d, 0, 0, 0, 0, cst), "ALL")
}

type billRow struct {
	at     time.Time
	fields []string
}

func (s *Server) billLocked(day time.Time, kind string) ([]byte, int) {
	end := day.AddDate(0, 0, 1)
	in := func(t time.Time) bool { return !t.IsZero() && !t.Before(day) && t.Before(end) }
	stamp := func(t time.Time) string { return t.In(cst).Format("2006-01-02 15:04:05") }
	var rows []billRow
	var settled, total, refunded, asked, fees int64 // fees in hundred-thousandths of a yuan
	if kind != "REFUND" {
		for _, t := range s.trades {
			if t.txID == "" || !in(t.successTime) {
				continue
			}
			settled += t.total
			total += t.total
			fees += 6 * t.total
			rows = append(rows, billRow{t.successTime, []string{stamp(t.successTime), t.appID, s.opts.MchID, "0", "", t.txID,
				t.outTradeNo, "oUpF8uMuAJO_M2pxb1Q9zNjWeS6o", t.tradeType, stateSucc, "OTHERS", "CNY", yuan(t.total), "0.00",
				"0", "0", "0.00", "0.00", "", "", t.description, "", fee(6 * t.total), feeRate, yuan(t.total), "0.00", ""}})
		}
	}
	if kind != "SUCCESS" {
		for _, rf := range s.refunds {
			if !in(rf.createTime) {
				continue
			}
			tradeType, desc := "NATIVE", rf.outTradeNo
			if t := s.trades[rf.outTradeNo]; t != nil {
				tradeType, desc = t.tradeType, t.description
			}
			refunded += rf.refund
			asked += rf.refund
			fees -= 6 * rf.refund
			rows = append(rows, billRow{rf.createTime, []string{stamp(rf.createTime), s.opts.AppID, s.opts.MchID, "0", "", rf.txID,
				rf.outTradeNo, "oUpF8uMuAJO_M2pxb1Q9zNjWeS6o", tradeType, stateRefund, "OTHERS", "CNY", "0.00", "0.00",
				rf.refundID, rf.outRefundNo, yuan(rf.refund), "0.00", "ORIGINAL", billRefundState(rf.status), desc, "",
				fee(-6 * rf.refund), feeRate, "0.00", yuan(rf.refund), ""}})
		}
	}
	sort.SliceStable(rows, func(i, j int) bool { return rows[i].at.Before(rows[j].at) })

	var b bytes.Buffer
	w := csv.NewWriter(&b)
	w.UseCRLF = true
	tick := func(vs []string) []string {
		out := make([]string, len(vs))
		for i, v := range vs {
			out[i] = "`" + v
		}
		return out
	}
	w.Write(billHeader)
	for _, r := range rows {
		w.Write(tick(r.fields))
	}
	w.Write([]string{"总交易单数", "应结订单总金额", "退款总金额", "充值券退款总金额", "手续费总金额", "订单总金额", "申请退款总金额"})
	w.Write(tick([]string{strconv.Itoa(len(rows)), yuan(settled), yuan(refunded), "0.00", fee(fees), yuan(total), yuan(asked)}))
	w.Flush()
	return b.Bytes(), len(rows)
}

// billRefundState is how the bill writes a refund's state.
func billRefundState(status string) string {
	switch status {
	case "ABNORMAL":
		return "CHANGE"
	case stateClosed:
		return "REFUNDCLOSE"
	}
	return status
}

// yuan writes fen as the bills do, "12.50".
func yuan(fen int64) string {
	sign := ""
	if fen < 0 {
		sign, fen = "-", -fen
	}
	return fmt.Sprintf("%s%d.%02d", sign, fen/100, fen%100)
}

// fee writes hundred-thousandths of a yuan with five places, "0.07500".
func fee(u int64) string {
	sign := ""
	if u < 0 {
		sign, u = "-", -u
	}
	return fmt.Sprintf("%s%d.%05d", sign, u/100000, u%100000)
}
