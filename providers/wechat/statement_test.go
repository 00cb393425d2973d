package wechat_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"kami/domain/money"
	"kami/providers"
	"kami/providers/wechat"
	"kami/providers/wechat/wechatemu"
)

func early(o *wechatemu.Options) { o.EarlyStatements = true }

// TestStatementNotReadyOrEmpty: today's bill is still being made (not
// ready); a day without trades has none, which is an empty statement.
func TestStatementNotReadyOrEmpty(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	today := providers.DayOf(time.Now())
	st, err := b.client.Statement(context.Background(), today)
	if !providers.NotReady(err) || providers.KindOf(err) != providers.Temporary || st != nil {
		t.Fatalf("today's bill: %v, %v; want not ready", st, err)
	}
	st, err = b.client.Statement(context.Background(), today.AddDays(-2))
	if err != nil || st == nil || len(st.Trades)+len(st.Refunds) != 0 {
		t.Fatalf("a quiet day's bill: %+v, %v; want an empty statement", st, err)
	}
}

// sampleBill is a trade bill as WeChat Pay writes it: backtick-prefixed
// values, a quoted product name with a comma, a payment, a refund, a
// refund still processing, a row of another kind, and the summary.
const sampleBill = "交易时间,公众账号ID,商户号,特约商户号,设备号,微信订单号,商户订单号,用户标识,交易类型,交易状态,付款银行,货币种类,应结订单金额,代金券金额,微信退款单号,商户退款单号,退款金额,充值券退款金额,退款类型,退款状态,商品名称,商户数据包,手续费,费率,订单金额,申请退款金额,费率备注\r\n" +
	"`2026-12-01 08:00:07,`wxd678efh567hg6787,`1900000109,`0,`,`4200001234202612010000000001,`26120108000000000001,`oUpF8uMuAJO_M2pxb1Q9zNjWeS6o,`NATIVE,`SUCCESS,`OTHERS,`CNY,`12.40,`0.10,`0,`0,`0.00,`0.00,`,`,\"`Game key, gold\",`,`0.07440,`0.60%,`12.50,`0.00,`\r\n" +
	"`2026-12-01 09:00:02,`wxd678efh567hg6787,`1900000109,`0,`,`4200001234202612010000000002,`26120109000000000002,`oUpF8uMuAJO_M2pxb1Q9zNjWeS6o,`MWEB,`SUCCESS,`CMB_DEBIT,`CNY,`1000000.01,`0.00,`0,`0,`0.00,`0.00,`,`,`游戏点卡,`,`6000.00006,`0.60%,`1000000.01,`0.00,`\r\n" +
	"`2026-12-01 23:59:59,`wxd678efh567hg6787,`1900000109,`0,`,`4200001234202612010000000001,`26120108000000000001,`oUpF8uMuAJO_M2pxb1Q9zNjWeS6o,`NATIVE,`REFUND,`OTHERS,`CNY,`0.00,`0.00,`50300000000000000000000001,`RL26120108000000000001-0a1b2c3d4e5f,`12.40,`0.00,`ORIGINAL,`SUCCESS,\"`Game key, gold\",`,`-0.07440,`0.60%,`0.00,`12.50,`\r\n" +
	"`2026-12-01 23:59:59,`wxd678efh567hg6787,`1900000109,`0,`,`4200001234202612010000000002,`26120109000000000002,`oUpF8uMuAJO_M2pxb1Q9zNjWeS6o,`MWEB,`REFUND,`CMB_DEBIT,`CNY,`0.00,`0.00,`50300000000000000000000002,`RA26120109000000000002,`1.00,`0.00,`ORIGINAL,`PROCESSING,`游戏点卡,`,`-0.00600,`0.60%,`0.00,`1.00,`\r\n" +
	"`2026-12-01 10:00:00,`wxd678efh567hg6787,`1900000109,`0,`,`4200001234202612010000000003,`26120110000000000003,`oUpF8uMuAJO_M2pxb1Q9zNjWeS6o,`MICROPAY,`SOMETHING_NEW,`OTHERS,`CNY,`0.00,`0.00,`0,`0,`0.00,`0.00,`,`,`x,`,`0.00000,`0.60%,`0.00,`0.00,`\r\n" +
	"总交易单数,应结订单总金额,退款总金额,充值券退款总金额,手续费总金额,订单总金额,申请退款总金额\r\n" +
	"`5,`1000012.41,`13.40,`0.00,`5999.99446,`1000012.51,`13.50\r\n"

func day(t testing.TB, s string) providers.Day {
	t.Helper()
	d, err := providers.ParseDay(s)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func TestParseStatement(t *testing.T) {
	t.Parallel()
	st, err := wechat.ParseStatement([]byte(sampleBill), day(t, "2026-12-01"))
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Trades) != 2 || st.Other != 1 || len(st.Refunds) != 2 {
		t.Fatalf("%d trades, %d refunds, %d other", len(st.Trades), len(st.Refunds), st.Other)
	}
	if tr := st.Trades[0]; tr.OrderNo != "26120108000000000001" || tr.TradeNo != "4200001234202612010000000001" || tr.AmountFen != 1250 ||
		!tr.PaidAt.Equal(time.Date(2026, 12, 1, 8, 0, 7, 0, providers.Zone)) || tr.Status != providers.TradePaid {
		t.Errorf("trade %+v: want the order's total (订单金额), not what is settled after the coupon", tr)
	}
	if tr := st.Trades[1]; tr.AmountFen != 100000001 {
		t.Errorf("trade %+v", tr)
	}
	if r := st.Refunds[0]; r.RefundNo != "RL26120108000000000001-0a1b2c3d4e5f" || r.AmountFen != 1250 || r.Status != providers.RefundSucceeded ||
		r.OrderNo != "26120108000000000001" || r.TradeNo != "4200001234202612010000000001" {
		t.Errorf("refund %+v: want the amount asked (申请退款金额)", r)
	}
	if r := st.Refunds[1]; r.RefundNo != "RA26120109000000000002" || r.AmountFen != 100 || r.Status != providers.RefundProcessing {
		t.Errorf("refund %+v", r)
	}
}

// TestParseStatementOlderColumns: bills from before 订单金额 and 申请退款金额
// were added are read by what they have.
func TestParseStatementOlderColumns(t *testing.T) {
	t.Parallel()
	bill := "交易时间,公众账号ID,商户号,子商户号,设备号,微信订单号,商户订单号,用户标识,交易类型,交易状态,付款银行,货币种类,总金额,代金券或立减优惠金额,微信退款单号,商户退款单号,退款金额,代金券或立减优惠退款金额,退款类型,退款状态,商品名称,商户数据包,手续费,费率\n" +
		"`2026-12-01 08:00:07,`wx1,`1900000109,`0,`,`T1,`O1,`u,`NATIVE,`SUCCESS,`OTHERS,`CNY,`0.01,`0.00,`0,`0,`0.00,`0.00,`,`,`x,`,`0.00000,`0.60%\n" +
		"总交易单数,总交易额,总退款金额,总代金券或立减优惠退款金额,手续费总金额\n`1,`0.01,`0.00,`0.00,`0.00000\n"
	if _, err := wechat.ParseStatement([]byte(bill), day(t, "2026-12-01")); err == nil {
		t.Fatal("a bill without 应结订单金额 or 订单金额 accepted")
	}
	bill = strings.Replace(bill, ",总金额,", ",应结订单金额,", 1)
	st, err := wechat.ParseStatement([]byte(bill), day(t, "2026-12-01"))
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Trades) != 1 || st.Trades[0].AmountFen != 1 {
		t.Fatalf("trades %+v", st.Trades)
	}
}

// TestParseStatementRefuses: a bill cut short, with a summary that counts
// other rows or amounts that are not exact, is refused, never read as
// fewer rows.
func TestParseStatementRefuses(t *testing.T) {
	t.Parallel()
	cut := func(s, from string) string { return s[:strings.Index(s, from)] }
	cases := map[string]string{
		"cut short":       cut(sampleBill, "总交易单数"),
		"cut mid-row":     cut(sampleBill, "`2026-12-01 09:00:02"),
		"no summary row":  cut(sampleBill, "`5,`1000012.41"),
		"count disagrees": strings.Replace(sampleBill, "`5,`1000012.41", "`4,`1000012.41", 1),
		"three decimals":  strings.Replace(sampleBill, ",`12.50,`0.00,`\r\n", ",`12.505,`0.00,`\r\n", 1),
		"exponent":        strings.Replace(sampleBill, ",`12.50,`0.00,`\r\n", ",`1.25e1,`0.00,`\r\n", 1),
		"rows after":      sampleBill + "`2026-12-01 08:00:07,`wx\r\n",
		"no header":       strings.Replace(sampleBill, "商户订单号", "订单号", 1),
		"not UTF-8":       sampleBill[:40] + "\xff\xfe" + sampleBill[40:],
		"unknown refund":  strings.Replace(sampleBill, "`ORIGINAL,`PROCESSING", "`ORIGINAL,`MAYBE", 1),
		"empty":           "",
	}
	for name, bill := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			if st, err := wechat.ParseStatement([]byte(bill), day(t, "2026-12-01")); err == nil {
				t.Fatalf("accepted: %+v", st)
			}
		})
	}
}

// FuzzParseStatement: whatever the bytes, the parser never panics, and
// what it accepts has its numbers and exact amounts in range.
func FuzzParseStatement(f *testing.F) {
	f.Add([]byte(sampleBill))
	b := setup(f, setupOptions{emu: early})
	must(f)(b.emu.Pay("FZ000001", 4321))
	if bill, rows := b.emu.Bill(time.Now()); rows > 0 {
		f.Add(bill)
	}
	d := day(f, "2026-12-01")
	f.Fuzz(func(t *testing.T, data []byte) {
		st, err := wechat.ParseStatement(data, d)
		if err != nil {
			if st != nil {
				t.Fatal("an error with a bill")
			}
			return
		}
		for _, tr := range st.Trades {
			if tr.TradeNo == "" || tr.AmountFen <= 0 || tr.AmountFen > money.MaxFen || tr.PaidAt.IsZero() {
				t.Fatalf("accepted trade %+v", tr)
			}
		}
		for _, r := range st.Refunds {
			if r.RefundNo == "" || r.AmountFen <= 0 || r.AmountFen > money.MaxFen || r.At.IsZero() || r.Status == "" {
				t.Fatalf("accepted refund %+v", r)
			}
		}
	})
}
