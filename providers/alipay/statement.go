package alipay

import (
	"archive/zip"
	"bytes"
	"context"
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/go-pay/gopay"
	"golang.org/x/text/encoding/simplifiedchinese"

	"kami/providers"
)

// The trade bill (bill_type "trade", 业务账单) of one day: kami asks
// alipay.data.dataservice.bill.downloadurl.query for its address and
// downloads the zip at once (the address is good for 30 seconds). The zip
// holds two CSV files in GBK, named (in GBK too, without the UTF-8 flag)
// <account>_<yyyymmdd>_业务明细.csv and ..._业务明细(汇总).csv. The first is
// the one kami reads:
//
//	#支付宝业务明细查询
//	#账号：[20881234567890120156]
//	#起始日期：[2026年12月01日 00:00:00]   终止日期：[2026年12月02日 00:00:00]
//	#-----------------------------------------业务明细列表----------------------------------------
//	支付宝交易号,商户订单号,业务类型,商品名称,创建时间,完成时间,...,订单金额（元）,商家实收（元）,...,退款批次号/请求号,...
//	2026120122001...\t,O2026...\t,交易\t,Game key\t,2026-12-01 10:00:00,2026-12-01 10:00:05,...,12.50,12.50,...
//	2026120122001...\t,O2026...\t,退款\t,Game key\t,2026-12-01 10:00:00,2026-12-01 11:00:00,...,-12.50,-12.50,...,RL2026...\t,...
//	#-----------------------------------------业务明细列表结束------------------------------------
//	#交易合计：1笔，商家实收共12.50元，商家优惠共0.00元
//	#退款合计：1笔，商家实收退款共-12.50元，商家优惠退款共0.00元
//	#导出时间：[2026年12月02日 09:12:03]
//
// Fields carry trailing tabs (to keep spreadsheets from reading the numbers
// as numbers), refunds are negative, and the columns are found by their
// names: Alipay has added columns over the years.

const (
	opStatement = "statement"
	// subBillNotExist is Alipay's answer for a bill it has not made (yet).
	subBillNotExist = "isp.bill_not_exist"
)

// Limits on what a statement download may take: the zip, and each file in
// it once unpacked (a card shop's busiest day is a few MiB).
const (
	maxStatementZip = 64 << 20
	maxStatementCSV = 256 << 20
)

var _ providers.StatementSource = (*Client)(nil)

// Statement implements providers.StatementSource.
func (c *Client) Statement(ctx context.Context, day providers.Day) (*providers.Statement, error) {
	if day.IsZero() {
		return nil, rejected(opStatement, "INVALID_REQUEST", "no day given")
	}
	bm := make(gopay.BodyMap)
	bm.Set("bill_type", "trade").Set("bill_date", day.String())
	rctx, rec := record(ctx)
	rsp, err := c.api.DataBillDownloadUrlQuery(rctx, bm)
	if err != nil {
		pe := c.callError(opStatement, err, rec)
		if pe.Code == subBillNotExist {
			// Alipay makes a bill for every day, empty or not, the next
			// morning: a bill that does not exist is one not made yet.
			return nil, &providers.Error{Provider: Name, Op: opStatement, Kind: providers.Temporary,
				Code: providers.CodeNotReady, Message: "the bill of " + day.String() + " is not published yet"}
		}
		return nil, pe
	}
	u, err := url.Parse(strings.TrimSpace(rsp.Response.BillDownloadUrl))
	if err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Host == "" {
		return nil, badAnswer(opStatement, "bill_download_url is not an http(s) URL")
	}
	data, err := c.download(ctx, u.String())
	if err != nil {
		return nil, err
	}
	st, err := ParseStatement(data, day)
	if err != nil {
		return nil, &providers.Error{Provider: Name, Op: opStatement, Kind: providers.Temporary, Code: "BAD_STATEMENT",
			Message: clip(err.Error())}
	}
	return st, nil
}

// download fetches the bill. The address is Alipay's (signed answer) and
// carries its own token; nothing of kami's goes with the request.
func (c *Client) download(ctx context.Context, u string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, badAnswer(opStatement, "bill_download_url is not usable")
	}
	res, err := c.dl.Do(req)
	if err != nil {
		return nil, gatewayError(opStatement, err)
	}
	defer res.Body.Close()
	if res.StatusCode != http.StatusOK {
		return nil, &providers.Error{Provider: Name, Op: opStatement, Kind: providers.Temporary,
			Code: "HTTP_" + strconv.Itoa(res.StatusCode), Message: "bill download answered with an HTTP error"}
	}
	data, err := io.ReadAll(io.LimitReader(res.Body, maxStatementZip+1))
	if err != nil {
		return nil, gatewayError(opStatement, err)
	}
	if len(data) > maxStatementZip {
		return nil, &providers.Error{Provider: Name, Op: opStatement, Kind: providers.Temporary, Code: "TOO_LARGE",
			Message: "bill larger than 64 MiB"}
	}
	return data, nil
}

// gbk reads the bills' text: GB18030 is GBK's superset, so every GBK file
// decodes the same.
var gbk = simplifiedchinese.GB18030

// ParseStatement reads the zip Alipay serves as the trade bill of day.
func ParseStatement(zipData []byte, day providers.Day) (*providers.Statement, error) {
	zr, err := zip.NewReader(bytes.NewReader(zipData), int64(len(zipData)))
	if err != nil {
		return nil, errors.New("the bill is not a zip file")
	}
	var detail *zip.File
	for _, f := range zr.File {
		name := f.Name
		if f.NonUTF8 {
			if n, err := gbk.NewDecoder().String(f.Name); err == nil {
				name = n
			}
		}
		if strings.HasSuffix(strings.ToLower(name), ".csv") && strings.Contains(name, "业务明细") && !strings.Contains(name, "汇总") {
			detail = f
			break
		}
	}
	if detail == nil {
		// Names a tool rewrote: look for the file that starts as the
		// detail file does.
		for _, f := range zr.File {
			head, err := readEntry(f, 256)
			if err == nil && strings.HasPrefix(decodeGBK(head), "#支付宝业务明细查询") {
				detail = f
				break
			}
		}
	}
	if detail == nil {
		return nil, errors.New("the bill holds no 业务明细 file")
	}
	data, err := readEntry(detail, maxStatementCSV)
	if err != nil {
		return nil, err
	}
	return ParseStatementCSV(data, day)
}

func readEntry(f *zip.File, limit int64) ([]byte, error) {
	rc, err := f.Open()
	if err != nil {
		return nil, errors.New("a file of the bill cannot be opened")
	}
	defer rc.Close()
	data, err := io.ReadAll(io.LimitReader(rc, limit+1))
	if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) {
		return nil, errors.New("a file of the bill cannot be read")
	}
	if int64(len(data)) > limit {
		if limit >= maxStatementCSV {
			return nil, errors.New("the bill's detail file is larger than 256 MiB")
		}
		data = data[:limit]
	}
	return data, nil
}

func decodeGBK(b []byte) string {
	s, err := gbk.NewDecoder().Bytes(b)
	if err != nil {
		return ""
	}
	return string(s)
}

// The columns kami reads, by name. The parentheses are full-width in the
// bill; half-width ones are accepted too.
const (
	colTradeNo  = "支付宝交易号"
	colOrderNo  = "商户订单号"
	colBizType  = "业务类型"
	colCreated  = "创建时间"
	colFinished = "完成时间"
	colAmount   = "订单金额（元）"
	colReceived = "商家实收（元）"
	colRefundNo = "退款批次号/请求号"
)

var (
	startDateRE = regexp.MustCompile(`起始日期：\[(\d{4})年(\d{2})月(\d{2})日`)
	tradeSumRE  = regexp.MustCompile(`^#交易合计：(\d+)笔(?:，商家实收共(-?\d+(?:\.\d+)?)元)?`)
	refundSumRE = regexp.MustCompile(`^#退款合计：(\d+)笔(?:，商家实收退款共(-?\d+(?:\.\d+)?)元)?`)
)

// ParseStatementCSV reads the detail file (GBK) of the trade bill of day.
// It refuses a file that covers another day, that ends before its end
// marker (cut short), or whose 合计 lines disagree with its rows.
func ParseStatementCSV(gbkData []byte, day providers.Day) (*providers.Statement, error) {
	text, err := gbk.NewDecoder().Bytes(gbkData)
	if err != nil {
		return nil, errors.New("the detail file is not GBK text")
	}
	r := csv.NewReader(strings.NewReader(strings.TrimPrefix(string(text), "\ufeff")))
	r.FieldsPerRecord = -1
	r.LazyQuotes = true
	st := &providers.Statement{Provider: Name, Day: day}
	const (
		preamble = iota
		header
		rows
		summary
	)
	stage := preamble
	var cols map[string]int
	var received, tradeRows, refundRows int64
	var sawTradeSum, sawRefundSum bool
	for {
		fields, err := r.Read()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, errors.New("the detail file is not CSV")
		}
		n, _ := r.FieldPos(0)
		// A comment line has no commas of its own (its own are full
		// width); should one have, it is still one line.
		comment := strings.HasPrefix(fields[0], "#")
		line := strings.Join(fields, ",")
		switch stage {
		case preamble:
			if !comment {
				return nil, fmt.Errorf("line %d: a row before the 业务明细列表 marker", n)
			}
			if m := startDateRE.FindStringSubmatch(line); m != nil {
				if got := m[1] + "-" + m[2] + "-" + m[3]; got != day.String() {
					return nil, fmt.Errorf("the bill is of %s, not %s", got, day)
				}
			}
			if strings.Contains(line, "业务明细列表") && !strings.Contains(line, "结束") {
				stage = header
			}
		case header:
			if comment {
				return nil, fmt.Errorf("line %d: no header after the 业务明细列表 marker", n)
			}
			cols = map[string]int{}
			for j, f := range fields {
				cols[normalizeColumn(f)] = j
			}
			for _, c := range []string{colTradeNo, colOrderNo, colBizType, colFinished, colAmount, colRefundNo} {
				if _, ok := cols[c]; !ok {
					return nil, fmt.Errorf("the header has no %s column", c)
				}
			}
			stage = rows
		case rows:
			if comment {
				if !strings.Contains(line, "业务明细列表结束") {
					return nil, fmt.Errorf("line %d: a comment among the rows", n)
				}
				stage = summary
				continue
			}
			get := func(col string) string {
				j, ok := cols[col]
				if !ok || j >= len(fields) {
					return ""
				}
				return strings.TrimSpace(fields[j])
			}
			kind, err := addRow(st, get)
			if err != nil {
				return nil, fmt.Errorf("line %d: %w", n, err)
			}
			switch kind {
			case "交易":
				tradeRows++
				if s := get(colReceived); s != "" {
					fen, err := providers.ParseSignedAmount(s)
					if err != nil {
						return nil, fmt.Errorf("line %d: %s is not an amount", n, colReceived)
					}
					received += fen
				}
			case "退款":
				refundRows++
			}
		case summary:
			if !comment {
				return nil, fmt.Errorf("line %d: a row after the end marker", n)
			}
			if m := tradeSumRE.FindStringSubmatch(line); m != nil {
				sawTradeSum = true
				if n, _ := strconv.ParseInt(m[1], 10, 64); n != tradeRows {
					return nil, fmt.Errorf("交易合计 says %s trades, the bill lists %d", m[1], tradeRows)
				}
				if _, listed := cols[colReceived]; listed && m[2] != "" {
					if fen, err := providers.ParseSignedAmount(m[2]); err != nil || fen != received {
						return nil, fmt.Errorf("交易合计 says %s yuan received, the rows add up to another sum", m[2])
					}
				}
			}
			if m := refundSumRE.FindStringSubmatch(line); m != nil {
				sawRefundSum = true
				if n, _ := strconv.ParseInt(m[1], 10, 64); n != refundRows {
					return nil, fmt.Errorf("退款合计 says %s refunds, the bill lists %d", m[1], refundRows)
				}
			}
		}
	}
	switch {
	case stage < rows:
		return nil, errors.New("the bill has no 业务明细列表")
	case stage == rows:
		return nil, errors.New("the bill ends before its 业务明细列表结束 marker: cut short")
	case !sawTradeSum || !sawRefundSum:
		return nil, errors.New("the bill has no 交易合计 and 退款合计 lines")
	}
	return st, nil
}

// addRow adds one detail row to st and returns its 业务类型.
func addRow(st *providers.Statement, get func(string) string) (string, error) {
	kind := get(colBizType)
	orderNo, tradeNo := get(colOrderNo), get(colTradeNo)
	if kind != "交易" && kind != "退款" {
		st.Other++
		return kind, nil
	}
	if tradeNo == "" || len(tradeNo) > 64 || len(orderNo) > 64 {
		return "", errors.New("a row without a usable 支付宝交易号 or 商户订单号")
	}
	fen, err := providers.ParseSignedAmount(get(colAmount))
	if err != nil {
		return "", fmt.Errorf("%s is not an amount", colAmount)
	}
	at, err := rowTime(get(colFinished), get(colCreated))
	if err != nil {
		return "", err
	}
	if kind == "交易" {
		if fen <= 0 {
			return "", errors.New("a trade of no amount")
		}
		st.Trades = append(st.Trades, providers.StatementTrade{OrderNo: orderNo, TradeNo: tradeNo, AmountFen: fen,
			PaidAt: at, Status: providers.TradePaid})
		return kind, nil
	}
	if fen == 0 {
		return "", errors.New("a refund of no amount")
	}
	refundNo := get(colRefundNo)
	if len(refundNo) > 64 {
		return "", errors.New("a 退款批次号/请求号 longer than 64")
	}
	st.Refunds = append(st.Refunds, providers.StatementRefund{RefundNo: refundNo, OrderNo: orderNo, TradeNo: tradeNo,
		AmountFen: abs(fen), At: at, Status: providers.RefundSucceeded})
	return kind, nil
}

func rowTime(finished, created string) (time.Time, error) {
	s := finished
	if s == "" {
		s = created
	}
	t, err := providers.ParseStatementTime(s)
	if err != nil {
		return time.Time{}, errors.New("a row without a 完成时间")
	}
	return t, nil
}

func abs(n int64) int64 {
	if n < 0 {
		return -n
	}
	return n
}

func normalizeColumn(s string) string {
	s = strings.TrimSpace(strings.Trim(s, "\t\ufeff"))
	s = strings.ReplaceAll(s, "(", "（")
	return strings.ReplaceAll(s, ")", "）")
}
