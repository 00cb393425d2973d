package alipay_test

import (
	"archive/zip"
	"bytes"
	"context"
	"io"
	"strings"
	"testing"
	"time"

	"golang.org/x/text/encoding/simplifiedchinese"

	"kami/domain/money"
	"kami/providers"
	"kami/providers/alipay"
)

// TestStatementNotReady: a day that is not over has no bill yet; that is
// told apart from every other failure, and from an empty day.
func TestStatementNotReady(t *testing.T) {
	t.Parallel()
	b := setup(t)
	today := providers.DayOf(time.Now())
	st, err := b.client.Statement(context.Background(), today)
	if !providers.NotReady(err) || providers.KindOf(err) != providers.Temporary || st != nil {
		t.Fatalf("today's bill: %v, %v; want not ready", st, err)
	}
	st, err = b.client.Statement(context.Background(), today.AddDays(-2))
	if err != nil || len(st.Trades)+len(st.Refunds) != 0 {
		t.Fatalf("the bill of a quiet day: %+v, %v; want an empty bill", st, err)
	}
}

// sampleBill is a detail file as Alipay writes it: header lines, rows with
// trailing tabs, a quoted product name with a comma, a refund with negative
// amounts, a row of a kind kami takes no part in, and the 合计 lines.
const sampleBill = "#支付宝业务明细查询\r\n" +
	"#账号：[20881011064993640156]\r\n" +
	"#起始日期：[2026年12月01日 00:00:00]   终止日期：[2026年12月02日 00:00:00]\r\n" +
	"#-----------------------------------------业务明细列表----------------------------------------\r\n" +
	"支付宝交易号,商户订单号,业务类型,商品名称,创建时间,完成时间,门店编号,门店名称,操作员,终端号,对方账户,订单金额（元）,商家实收（元）,支付宝红包（元）,集分宝（元）,支付宝优惠（元）,商家优惠（元）,券核销金额（元）,券名称,商家红包消费金额（元）,卡消费金额（元）,退款批次号/请求号,服务费（元）,分润（元）,备注\r\n" +
	"2026120122001400001000000001\t,26120108000000000001\t,交易\t,\"Game key, gold\t\",2026-12-01 08:00:00,2026-12-01 08:00:07,\t,\t,\t,\t,kam***@example.com\t,12.50,12.40,0.10,0.00,0.00,0.00,0.00,\t,0.00,0.00,\t,-0.07,0.00,\t\r\n" +
	"2026120122001400001000000002\t,26120109000000000002\t,交易\t,游戏点卡\t,2026-12-01 09:00:00,2026-12-01 09:00:02,\t,\t,\t,\t,kam***@example.com\t,1000000.01,1000000.01,0.00,0.00,0.00,0.00,0.00,\t,0.00,0.00,\t,0.00,0.00,\t\r\n" +
	"2026120122001400001000000001\t,26120108000000000001\t,退款\t,\"Game key, gold\t\",2026-12-01 08:00:00,2026-12-01 23:59:59,\t,\t,\t,\t,kam***@example.com\t,-12.50,-12.40,-0.10,0.00,0.00,0.00,0.00,\t,0.00,0.00,RL26120108000000000001-0a1b2c3d4e5f\t,0.07,0.00,\t\r\n" +
	"2026120122001400001000000003\t,\t,冻结\t,\t,2026-12-01 10:00:00,2026-12-01 10:00:00,\t,\t,\t,\t,\t,0.00,0.00,0.00,0.00,0.00,0.00,0.00,\t,0.00,0.00,\t,0.00,0.00,\t\r\n" +
	"#-----------------------------------------业务明细列表结束------------------------------------\r\n" +
	"#交易合计：2笔，商家实收共1000012.41元，商家优惠共0.00元\r\n" +
	"#退款合计：1笔，商家实收退款共-12.40元，商家优惠退款共0.00元\r\n" +
	"#导出时间：[2026年12月02日 09:12:03]\r\n"

func encodeGBK(t testing.TB, s string) []byte {
	t.Helper()
	b, err := simplifiedchinese.GBK.NewEncoder().Bytes([]byte(s))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func day(t testing.TB, s string) providers.Day {
	t.Helper()
	d, err := providers.ParseDay(s)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func TestParseStatementCSV(t *testing.T) {
	t.Parallel()
	st, err := alipay.ParseStatementCSV(encodeGBK(t, sampleBill), day(t, "2026-12-01"))
	if err != nil {
		t.Fatal(err)
	}
	want := []providers.StatementTrade{
		{OrderNo: "26120108000000000001", TradeNo: "2026120122001400001000000001", AmountFen: 1250,
			PaidAt: time.Date(2026, 12, 1, 8, 0, 7, 0, providers.Zone), Status: providers.TradePaid},
		{OrderNo: "26120109000000000002", TradeNo: "2026120122001400001000000002", AmountFen: 100000001,
			PaidAt: time.Date(2026, 12, 1, 9, 0, 2, 0, providers.Zone), Status: providers.TradePaid},
	}
	if len(st.Trades) != len(want) {
		t.Fatalf("trades %+v", st.Trades)
	}
	for i := range want {
		if g := st.Trades[i]; g.OrderNo != want[i].OrderNo || g.TradeNo != want[i].TradeNo || g.AmountFen != want[i].AmountFen ||
			!g.PaidAt.Equal(want[i].PaidAt) || g.Status != want[i].Status {
			t.Errorf("trade %d = %+v, want %+v", i, g, want[i])
		}
	}
	if len(st.Refunds) != 1 {
		t.Fatalf("refunds %+v", st.Refunds)
	}
	if r := st.Refunds[0]; r.RefundNo != "RL26120108000000000001-0a1b2c3d4e5f" || r.AmountFen != 1250 || r.OrderNo != "26120108000000000001" ||
		!r.At.Equal(time.Date(2026, 12, 1, 23, 59, 59, 0, providers.Zone)) || r.Status != providers.RefundSucceeded {
		t.Errorf("refund %+v", r)
	}
	if st.Other != 1 {
		t.Errorf("other rows %d, want 1 (the 冻结 row)", st.Other)
	}
	if st.TradeFen() != 100001251 || st.RefundFen() != 1250 {
		t.Errorf("totals %s / %s", money.Format(st.TradeFen()), money.Format(st.RefundFen()))
	}
}

// TestParseStatementCSVColumnsByName: Alipay adds columns and moves them;
// half-width parentheses come from some exports.
func TestParseStatementCSVColumnsByName(t *testing.T) {
	t.Parallel()
	bill := "#支付宝业务明细查询\n" +
		"#-----------------------------------------业务明细列表----------------------------------------\n" +
		"商户订单号,支付宝交易号,订单金额(元),业务类型,完成时间,实收净额（元）,退款批次号/请求号,商户识别号\n" +
		"O1\t,T1\t,0.01,交易\t,2026-12-01 00:00:00,0.01,\t,shop\t\n" +
		"#-----------------------------------------业务明细列表结束------------------------------------\n" +
		"#交易合计：1笔\n#退款合计：0笔\n"
	st, err := alipay.ParseStatementCSV(encodeGBK(t, bill), day(t, "2026-12-01"))
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Trades) != 1 || st.Trades[0].OrderNo != "O1" || st.Trades[0].TradeNo != "T1" || st.Trades[0].AmountFen != 1 {
		t.Fatalf("trades %+v", st.Trades)
	}
}

// TestParseStatementCSVRefuses: a bill cut short, of another day, with
// totals that do not add up or amounts that are not exact is refused, never
// read as fewer rows.
func TestParseStatementCSVRefuses(t *testing.T) {
	t.Parallel()
	cut := func(s, from string) string { return s[:strings.Index(s, from)] }
	cases := map[string]string{
		"cut short":        cut(sampleBill, "#-----------------------------------------业务明细列表结束"),
		"cut mid-row":      cut(sampleBill, "2026-12-01 09:00:00"),
		"no summary":       cut(sampleBill, "#交易合计"),
		"another day":      strings.Replace(sampleBill, "2026年12月01日 00:00:00", "2026年11月30日 00:00:00", 1),
		"count disagrees":  strings.Replace(sampleBill, "#交易合计：2笔", "#交易合计：3笔", 1),
		"sum disagrees":    strings.Replace(sampleBill, "商家实收共1000012.41元", "商家实收共1000012.40元", 1),
		"refunds disagree": strings.Replace(sampleBill, "#退款合计：1笔", "#退款合计：0笔", 1),
		"three decimals":   strings.Replace(sampleBill, ",12.50,12.40,", ",12.505,12.40,", 1),
		"float exponent":   strings.Replace(sampleBill, ",12.50,12.40,", ",1.25e1,12.40,", 1),
		"no header":        strings.Replace(sampleBill, "支付宝交易号,商户订单号", "交易号,订单号", 1),
		"no marker":        strings.Replace(sampleBill, "业务明细列表---", "---", 1),
		"negative trade":   strings.Replace(sampleBill, ",12.50,12.40,", ",-12.50,12.40,", 1),
		"row after end":    sampleBill + "T9\t,O9\t,交易\t,x\t,,2026-12-01 10:00:00\r\n",
		"empty":            "",
	}
	for name, bill := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			st, err := alipay.ParseStatementCSV(encodeGBK(t, bill), day(t, "2026-12-01"))
			if err == nil {
				t.Fatalf("accepted: %+v", st)
			}
		})
	}
}

// TestParseStatementZip reads the zip as Alipay serves it: GBK file names
// without the UTF-8 flag, the summary file beside the detail.
func TestParseStatementZip(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	zw := zip.NewWriter(&buf)
	for _, f := range []struct{ name, body string }{
		{"20881011064993640156_20261201_业务明细(汇总).csv", "#支付宝业务汇总查询\r\n"},
		{"20881011064993640156_20261201_业务明细.csv", sampleBill},
	} {
		w, err := zw.CreateHeader(&zip.FileHeader{Name: string(encodeGBK(t, f.name)), NonUTF8: true, Method: zip.Deflate})
		if err != nil {
			t.Fatal(err)
		}
		w.Write(encodeGBK(t, f.body))
	}
	zw.Close()
	st, err := alipay.ParseStatement(buf.Bytes(), day(t, "2026-12-01"))
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Trades) != 2 || len(st.Refunds) != 1 {
		t.Fatalf("%d trades, %d refunds", len(st.Trades), len(st.Refunds))
	}
	if _, err := alipay.ParseStatement([]byte("PK\x03\x04 not really"), day(t, "2026-12-01")); err == nil {
		t.Fatal("accepted a broken zip")
	}
}

// FuzzParseStatementCSV: whatever the bytes, the parser never panics, and
// what it accepts is a bill kami can trust: every trade and refund has its
// numbers and an exact, positive amount within range, at a time of the
// day asked for or near it.
func FuzzParseStatementCSV(f *testing.F) {
	f.Add(encodeGBK(f, sampleBill))
	b := setup(f, setupOpts{early: true})
	if _, _, err := b.emu.Pay("FZ0001", 4321); err != nil {
		f.Fatal(err)
	}
	bill := b.emu.BillZip(time.Now())
	zr, err := zip.NewReader(bytes.NewReader(bill), int64(len(bill)))
	if err != nil {
		f.Fatal(err)
	}
	for _, zf := range zr.File {
		rc, _ := zf.Open()
		data, _ := io.ReadAll(rc)
		rc.Close()
		f.Add(data)
	}
	d := day(f, "2026-12-01")
	f.Fuzz(func(t *testing.T, data []byte) {
		st, err := alipay.ParseStatementCSV(data, d)
		if err != nil {
			if st != nil {
				t.Fatal("an error with a bill")
			}
			return
		}
		for _, tr := range st.Trades {
			if tr.TradeNo == "" || tr.AmountFen <= 0 || tr.AmountFen > money.MaxFen || tr.PaidAt.IsZero() || tr.Status != providers.TradePaid {
				t.Fatalf("accepted trade %+v", tr)
			}
		}
		for _, r := range st.Refunds {
			if r.TradeNo == "" || r.AmountFen <= 0 || r.AmountFen > money.MaxFen || r.At.IsZero() || r.Status != providers.RefundSucceeded {
				t.Fatalf("accepted refund %+v", r)
			}
		}
	})
}
