package alipayemu

import (
	"archive/zip"
	"bytes"
	"encoding/csv"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/text/encoding/simplifiedchinese"

	"kami/providers/fault"
)

// The daily trade bill, built from the emulator's own books in Alipay's
// format: alipay.data.dataservice.bill.downloadurl.query answers an address
// good for 30 seconds; GET on it answers a zip of two GBK CSV files (the
// detail and the summary), named in GBK without the UTF-8 flag, as Alipay
// serves them. The detail lists every trade paid on the day (业务类型 交易)
// and every refund made on it (退款, with negative amounts), between its
// header lines and its 合计 lines.
//
// A day's bill is published once the day is over (Beijing time, by the
// emulator's clock); before that the query answers isp.bill_not_exist, as
// Alipay does before its morning run. Options.EarlyStatements publishes the
// books so far at once, so that tests need not wait for tomorrow.

const billMethod = "alipay.data.dataservice.bill.downloadurl.query"

// billPath is where bills are downloaded, as on Alipay's dwbillcenter.
const billPath = "/downloadBillFile.resource"

// billLinkTTL is how long a download address works.
const billLinkTTL = 30 * time.Second

// OpDownload is the bill download itself, for fault injection (OpStatement
// is the query for its address). It takes fault.Timeout, fault.Server5xx,
// FaultGarbage and FaultTruncated.
const OpDownload fault.Op = "statement_download"

// FaultTruncated serves the bill's zip cut short, as a broken connection
// would leave it.
const FaultTruncated fault.Fault = "truncated"

// account is the merchant's Alipay account in the bills: the seller's
// 2088 id and Alipay's four-digit suffix.
const account = "20881011064993640156"

type billLink struct {
	day     time.Time // 00:00 Beijing
	expires time.Time
}

// billLocked answers the address query for a day's bill.
func (s *Server) billLocked(key string, b biz, base string) reply {
	if t := b.str("bill_type"); t != "trade" {
		return invalidParam(key, "bill_type")
	}
	day, err := time.ParseInLocation("2006-01-02", b.str("bill_date"), beijing)
	if err != nil {
		return invalidParam(key, "bill_date")
	}
	now := s.now()
	publishedAt := day.AddDate(0, 0, 1)
	if s.early {
		publishedAt = day
	}
	if now.Before(publishedAt) {
		return bizFailure(key, "isp.bill_not_exist", "账单不存在")
	}
	token := randomID(16)
	if s.billLinks == nil {
		s.billLinks = map[string]billLink{}
	}
	for tok, l := range s.billLinks {
		if now.After(l.expires) {
			delete(s.billLinks, tok)
		}
	}
	s.billLinks[token] = billLink{day: day, expires: now.Add(billLinkTTL)}
	ymd := day.Format("20060102")
	q := url.Values{
		"bizType":          {"trade"},
		"userId":           {account},
		"fileType":         {"csv.zip"},
		"bizDates":         {ymd},
		"downloadFileName": {account + "_" + ymd + ".csv.zip"},
		"fileId":           {"/trade/" + account + "/" + ymd + ".csv.zip"},
		"timestamp":        {strconv.FormatInt(now.UnixMilli(), 10)},
		"token":            {token},
	}
	return success(key, map[string]any{"bill_download_url": base + billPath + "?" + q.Encode()})
}

// serveBill answers a download: the zip, or an error page for an address
// that is unknown or has expired.
func (s *Server) serveBill(w http.ResponseWriter, r *http.Request) {
	switch s.faults.Take(OpDownload) {
	case fault.Timeout:
		s.holdFor(r.Context())
		http.Error(w, "gateway timeout", http.StatusGatewayTimeout)
		return
	case fault.Server5xx:
		http.Error(w, "Service Unavailable", http.StatusServiceUnavailable)
		return
	case FaultGarbage:
		w.Header().Set("Content-Type", "text/html")
		io.WriteString(w, "<html><body>upstream proxy garbage</body></html>")
		return
	case FaultTruncated:
		data := s.billFor(r)
		if data != nil {
			w.Header().Set("Content-Type", "application/oct-stream")
			w.Write(data[:len(data)/2])
			return
		}
	}
	data := s.billFor(r)
	if data == nil {
		w.Header().Set("Content-Type", "text/html;charset=utf-8")
		w.WriteHeader(http.StatusForbidden)
		io.WriteString(w, "<html><body>链接已失效</body></html>")
		return
	}
	w.Header().Set("Content-Type", "application/oct-stream")
	w.Header().Set("Content-Disposition", "attachment; filename="+r.URL.Query().Get("downloadFileName"))
	w.Write(data)
}

// billFor builds the zip a download address names, nil if it names none.
func (s *Server) billFor(r *http.Request) []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	l, ok := s.billLinks[r.URL.Query().Get("token")]
	if !ok || s.now().After(l.expires) {
		return nil
	}
	return s.billZipLocked(l.day)
}

// BillZip is the bill of the day that starts at day (Beijing), as a
// download would serve it now; tests of the parser use it.
func (s *Server) BillZip(day time.Time) []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	y, m, d := day.In(beijing).Date()
	return s.billZipLocked(time.Date(y, m, d, 0, 0, 0, 0, beijing))
}

var gbk = simplifiedchinese.GBK

var detailHeader = []string{"支付宝交易号", "商户订单号", "业务类型", "商品名称", "创建时间", "完成时间", "门店编号", "门店名称",
	"操作员", "终端号", "对方账户", "订单金额（元）", "商家实收（元）", "支付宝红包（元）", "集分宝（元）", "支付宝优惠（元）", "商家优惠（元）",
	"券核销金额（元）", "券名称", "商家红包消费金额（元）", "卡消费金额（元）", "退款批次号/请求号", "服务费（元）", "分润（元）", "备注"}

type billRow struct {
	at     time.Time
	fields []string
}

func (s *Server) billZipLocked(day time.Time) []byte {
	end := day.AddDate(0, 0, 1)
	in := func(t time.Time) bool { return !t.IsZero() && !t.Before(day) && t.Before(end) }
	// The text fields end with a tab, as Alipay writes them.
	tab := func(v string) string { return v + "\t" }
	stamp := func(t time.Time) string { return t.In(beijing).Format(alipayTime) }
	var rows []billRow
	var trades, refunds int
	var received, refunded int64
	for _, t := range s.trades {
		if !in(t.paidAt) {
			continue
		}
		trades++
		received += t.totalFen
		rows = append(rows, billRow{t.paidAt, []string{tab(t.tradeNo), tab(t.outTradeNo), tab("交易"), tab(t.subject),
			stamp(t.created), stamp(t.paidAt), tab(""), tab(""), tab(""), tab(""), tab("kam***@example.com"),
			formatAmount(t.totalFen), formatAmount(t.totalFen), "0.00", "0.00", "0.00", "0.00", "0.00", tab(""), "0.00", "0.00",
			tab(""), "0.00", "0.00", tab("")}})
	}
	for _, rf := range s.refunds {
		if !in(rf.at) {
			continue
		}
		refunds++
		refunded += rf.fen
		t := rf.trade
		rows = append(rows, billRow{rf.at, []string{tab(t.tradeNo), tab(t.outTradeNo), tab("退款"), tab(t.subject),
			stamp(t.created), stamp(rf.at), tab(""), tab(""), tab(""), tab(""), tab("kam***@example.com"),
			signedAmount(-rf.fen), signedAmount(-rf.fen), "0.00", "0.00", "0.00", "0.00", "0.00", tab(""), "0.00", "0.00",
			tab(rf.outRequestNo), "0.00", "0.00", tab("")}})
	}
	sort.SliceStable(rows, func(i, j int) bool { return rows[i].at.Before(rows[j].at) })

	now := s.now().In(beijing)
	period := fmt.Sprintf("#起始日期：[%s]   终止日期：[%s]", day.Format("2006年01月02日 15:04:05"), end.Format("2006年01月02日 15:04:05"))
	exported := "#导出时间：[" + now.Format("2006年01月02日 15:04:05") + "]"

	var detail bytes.Buffer
	writeLines(&detail, "#支付宝业务明细查询", "#账号：["+account+"]", period,
		"#-----------------------------------------业务明细列表----------------------------------------")
	cw := csv.NewWriter(&detail)
	cw.UseCRLF = true
	cw.Write(detailHeader)
	for _, r := range rows {
		cw.Write(r.fields)
	}
	cw.Flush()
	writeLines(&detail, "#-----------------------------------------业务明细列表结束------------------------------------",
		fmt.Sprintf("#交易合计：%d笔，商家实收共%s元，商家优惠共0.00元", trades, formatAmount(received)),
		fmt.Sprintf("#退款合计：%d笔，商家实收退款共%s元，商家优惠退款共0.00元", refunds, signedAmount(-refunded)),
		exported)

	var summary bytes.Buffer
	writeLines(&summary, "#支付宝业务汇总查询", "#账号：["+account+"]", period,
		"#-----------------------------------------业务汇总列表----------------------------------------")
	sw := csv.NewWriter(&summary)
	sw.UseCRLF = true
	net := signedAmount(received - refunded)
	sw.Write([]string{"门店编号", "门店名称", "交易订单总笔数", "退款订单总笔数", "订单金额（元）", "商家实收（元）", "支付宝优惠（元）",
		"商家优惠（元）", "卡消费金额（元）", "服务费（元）", "分润（元）", "实收净额（元）"})
	sw.Write([]string{"", "", strconv.Itoa(trades), strconv.Itoa(refunds), net, net, "0.00", "0.00", "0.00", "0.00", "0.00", net})
	sw.Write([]string{"合计", "", strconv.Itoa(trades), strconv.Itoa(refunds), net, net, "0.00", "0.00", "0.00", "0.00", "0.00", net})
	sw.Flush()
	writeLines(&summary, "#----------------------------------------业务汇总列表结束-------------------------------------", exported)

	ymd := day.Format("20060102")
	var out bytes.Buffer
	zw := zip.NewWriter(&out)
	for _, f := range []struct {
		name string
		body []byte
	}{{account + "_" + ymd + "_业务明细.csv", detail.Bytes()}, {account + "_" + ymd + "_业务明细(汇总).csv", summary.Bytes()}} {
		name, err := gbk.NewEncoder().String(f.name)
		if err != nil {
			panic(err) // the names are fixed GBK text
		}
		body, err := gbk.NewEncoder().Bytes(f.body)
		if err != nil {
			// A subject GBK cannot write: Alipay shows "?" for it.
			body, _ = gbk.NewEncoder().Bytes([]byte(strings.Map(gbkOrQuestion, string(f.body))))
		}
		w, err := zw.CreateHeader(&zip.FileHeader{Name: name, NonUTF8: true, Method: zip.Deflate, Modified: now})
		if err != nil {
			panic(err)
		}
		w.Write(body)
	}
	zw.Close()
	return out.Bytes()
}

// writeLines writes the bill's comment lines, CRLF as Alipay ends them.
func writeLines(b *bytes.Buffer, lines ...string) {
	for _, l := range lines {
		b.WriteString(l + "\r\n")
	}
}

func gbkOrQuestion(r rune) rune {
	if _, err := gbk.NewEncoder().String(string(r)); err != nil {
		return '?'
	}
	return r
}

func signedAmount(fen int64) string {
	if fen < 0 {
		return "-" + formatAmount(-fen)
	}
	return formatAmount(fen)
}
