package wechat

import (
	"bytes"
	"context"
	"crypto/sha1"
	"encoding/csv"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/go-pay/gopay"
	wv3 "github.com/go-pay/gopay/wechat/v3"

	"kami/providers"
)

// The trade bill (交易账单, bill_type ALL) of one day: GET /v3/bill/tradebill
// answers, signed, the file's SHA1 and a download address; gopay's
// V3BillDownLoadBill fetches the file (signed request, unsigned answer, as
// the gateway serves files), and the SHA1 is what proves it whole. The file
// is UTF-8 CSV: a header, one row per payment (交易状态 SUCCESS) and per
// refund (REFUND), every value prefixed with a backtick (so that
// spreadsheets keep numbers as text), then the summary header and its row:
//
//	交易时间,公众账号ID,商户号,特约商户号,设备号,微信订单号,商户订单号,用户标识,交易类型,交易状态,付款银行,货币种类,应结订单金额,代金券金额,微信退款单号,商户退款单号,退款金额,充值券退款金额,退款类型,退款状态,商品名称,商户数据包,手续费,费率,订单金额,申请退款金额,费率备注
//	`2026-12-01 10:00:05,`wxd678efh567hg6787,`1900000109,`0,`,`4200001234...,`O2026...,`oUpF8u...,`NATIVE,`SUCCESS,`OTHERS,`CNY,`12.50,`0.00,`0,`0,`0.00,`0.00,`,`,`Game key,`,`0.07500,`0.60%,`12.50,`0.00,`
//	`2026-12-01 11:00:00,...,`REFUND,...,`50300...,`RL2026...,`12.50,`0.00,`ORIGINAL,`SUCCESS,...,`12.50,`
//	总交易单数,应结订单总金额,退款总金额,充值券退款总金额,手续费总金额,订单总金额,申请退款总金额
//	`2,`12.50,`12.50,`0.00,`0.00000,`12.50,`12.50
//
// A day without a single trade has no bill (NO_STATEMENT_EXIST): that is an
// empty statement. A day whose bill is still being made (STATEMENT_CREATING,
// until 10:00 the next morning) is not ready.

const (
	opStatement = "statement"

	codeNoStatement       = "NO_STATEMENT_EXIST"
	codeStatementCreating = "STATEMENT_CREATING"
)

// bodyLimit is gopay's answer limit (10 MiB); a file cut there fails its
// SHA1, and the error says why.
const bodyLimit = 10 << 20

var _ providers.StatementSource = (*Client)(nil)

// Statement implements providers.StatementSource.
func (c *Client) Statement(ctx context.Context, day providers.Day) (*providers.Statement, error) {
	if day.IsZero() {
		return nil, &providers.Error{Kind: providers.Rejected, Provider: Name, Op: opStatement, Code: codeParamError, Message: "no day given"}
	}
	bm := make(gopay.BodyMap)
	bm.Set("bill_date", day.String()).Set("bill_type", "ALL")
	rsp, err := c.gp.V3BillTradeBill(ctx, bm)
	if perr := c.check(opStatement, rsp, err); perr != nil {
		switch {
		case perr.Kind != providers.Rejected:
			return nil, perr
		case perr.Code == codeStatementCreating:
			return nil, &providers.Error{Kind: providers.Temporary, Provider: Name, Op: opStatement, Code: providers.CodeNotReady,
				Message: "the bill of " + day.String() + " is still being made"}
		case perr.Code == codeNoStatement:
			// "Nothing was paid that day" empties the day, so it is taken
			// only from the gateway's own signature.
			if !c.signed(rsp.SignInfo) {
				return nil, &providers.Error{Kind: providers.Temporary, Provider: Name, Op: opStatement,
					Message: "NO_STATEMENT_EXIST answer not signed by WeChat Pay"}
			}
			return &providers.Statement{Provider: Name, Day: day}, nil
		}
		return nil, perr
	}
	bill := rsp.Response
	if !strings.EqualFold(bill.HashType, "SHA1") || len(bill.HashValue) != 40 || bill.DownloadUrl == "" {
		return nil, c.malformed(opStatement, "tradebill answer without a SHA1 and a download_url")
	}
	data, err := c.gp.V3BillDownLoadBill(ctx, bill.DownloadUrl)
	if err != nil {
		// gopay's error for a non-200 download is the answer's body; it
		// is not passed on.
		return nil, c.callError(opStatement, err)
	}
	sum := sha1.Sum(data)
	if !strings.EqualFold(hex.EncodeToString(sum[:]), bill.HashValue) {
		msg := "the downloaded bill does not match its SHA1"
		if len(data) >= bodyLimit {
			msg += ": it was cut at gopay's 10 MiB answer limit"
		}
		return nil, &providers.Error{Kind: providers.Temporary, Provider: Name, Op: opStatement, Code: "BAD_STATEMENT", Message: msg}
	}
	st, err := ParseStatement(data, day)
	if err != nil {
		return nil, &providers.Error{Kind: providers.Temporary, Provider: Name, Op: opStatement, Code: "BAD_STATEMENT",
			Message: truncateBytes(err.Error(), 200)}
	}
	return st, nil
}

// signed reports whether a failure answer carries a valid signature.
func (c *Client) signed(si *wv3.SignInfo) bool {
	return si != nil && si.HeaderSignature != "" && c.verifyAnswer(si)
}

// The columns kami reads, by name (WeChat adds columns over the years).
const (
	colTime          = "交易时间"
	colTransactionID = "微信订单号"
	colOutTradeNo    = "商户订单号"
	colState         = "交易状态"
	colSettleAmount  = "应结订单金额"
	colTotal         = "订单金额"
	colOutRefundNo   = "商户退款单号"
	colRefundAmount  = "退款金额"
	colRefundAsked   = "申请退款金额"
	colRefundState   = "退款状态"
	colSummaryCount  = "总交易单数"
)

// ParseStatement reads the trade bill (bill_type ALL) of day. It refuses a
// file that is not UTF-8 CSV, lacks a column it needs, ends before its
// summary (cut short), or whose summary counts another number of rows.
func ParseStatement(data []byte, day providers.Day) (*providers.Statement, error) {
	data = bytes.TrimPrefix(data, []byte("\ufeff"))
	if !utf8.Valid(data) {
		return nil, errors.New("the bill is not UTF-8 text")
	}
	r := csv.NewReader(bytes.NewReader(data))
	r.FieldsPerRecord = -1
	r.LazyQuotes = true
	head, err := r.Read()
	if err != nil {
		return nil, errors.New("the bill has no header")
	}
	cols := map[string]int{}
	for i, h := range head {
		cols[strings.TrimSpace(h)] = i
	}
	for _, c := range []string{colTime, colTransactionID, colOutTradeNo, colState, colOutRefundNo, colRefundState} {
		if _, ok := cols[c]; !ok {
			return nil, fmt.Errorf("the header has no %s column", c)
		}
	}
	amountCol, refundCol := colTotal, colRefundAsked
	if _, ok := cols[amountCol]; !ok {
		amountCol = colSettleAmount // bills from before 订单金额 was added
	}
	if _, ok := cols[refundCol]; !ok {
		refundCol = colRefundAmount
	}
	for _, c := range []string{amountCol, refundCol} {
		if _, ok := cols[c]; !ok {
			return nil, fmt.Errorf("the header has no %s column", c)
		}
	}

	st := &providers.Statement{Provider: Name, Day: day}
	rows := 0
	for {
		rec, err := r.Read()
		if err == io.EOF {
			return nil, errors.New("the bill ends before its summary: cut short")
		}
		if err != nil {
			return nil, errors.New("the bill is not CSV")
		}
		line, _ := r.FieldPos(0)
		if strings.TrimSpace(rec[0]) == colSummaryCount {
			if err := checkSummary(r, rows); err != nil {
				return nil, err
			}
			return st, nil
		}
		rows++
		get := func(col string) string {
			i, ok := cols[col]
			if !ok || i >= len(rec) {
				return ""
			}
			return strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(rec[i]), "`"))
		}
		if err := addRow(st, get, amountCol, refundCol); err != nil {
			return nil, fmt.Errorf("line %d: %w", line, err)
		}
	}
}

// checkSummary reads the summary row and what follows it: nothing.
func checkSummary(r *csv.Reader, rows int) error {
	rec, err := r.Read()
	if err != nil {
		return errors.New("the bill ends before its summary row: cut short")
	}
	n, err := strconv.Atoi(strings.TrimPrefix(strings.TrimSpace(rec[0]), "`"))
	if err != nil {
		return errors.New("the summary's 总交易单数 is not a number")
	}
	if n != rows {
		return fmt.Errorf("the summary counts %d rows, the bill has %d", n, rows)
	}
	if _, err := r.Read(); err != io.EOF {
		return errors.New("rows after the summary")
	}
	return nil
}

func addRow(st *providers.Statement, get func(string) string, amountCol, refundCol string) error {
	state := get(colState)
	orderNo, txID := get(colOutTradeNo), get(colTransactionID)
	var status providers.TradeStatus
	switch state {
	case "SUCCESS":
		status = providers.TradePaid
	case "REVOKED":
		status = providers.TradeClosed
	case "REFUND":
	default:
		st.Other++
		return nil
	}
	if txID == "" || len(txID) > 64 || len(orderNo) > 64 {
		return errors.New("a row without a usable 微信订单号 or 商户订单号")
	}
	at, err := providers.ParseStatementTime(get(colTime))
	if err != nil {
		return errors.New("a row without a 交易时间")
	}
	if state != "REFUND" {
		fen, err := providers.ParseSignedAmount(get(amountCol))
		if err != nil || fen <= 0 {
			return fmt.Errorf("%s is not an amount above zero", amountCol)
		}
		st.Trades = append(st.Trades, providers.StatementTrade{OrderNo: orderNo, TradeNo: txID, AmountFen: fen, PaidAt: at, Status: status})
		return nil
	}
	refundNo := get(colOutRefundNo)
	if refundNo == "" || len(refundNo) > 64 {
		return errors.New("a refund without a usable 商户退款单号")
	}
	fen, err := providers.ParseSignedAmount(get(refundCol))
	if err != nil || fen == 0 {
		return fmt.Errorf("%s is not an amount", refundCol)
	}
	if fen < 0 {
		fen = -fen
	}
	var rs providers.RefundState
	switch get(colRefundState) {
	case "SUCCESS":
		rs = providers.RefundSucceeded
	case "PROCESSING":
		rs = providers.RefundProcessing
	case "REFUNDCLOSE", "CLOSED", "ABNORMAL", "CHANGE", "FAIL":
		rs = providers.RefundFailed
	default:
		return errors.New("a refund with an unknown 退款状态")
	}
	st.Refunds = append(st.Refunds, providers.StatementRefund{RefundNo: refundNo, OrderNo: orderNo, TradeNo: txID,
		AmountFen: fen, At: at, Status: rs})
	return nil
}
