package main

import (
	"bytes"
	"context"
	"fmt"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/domain/domaintest"
	"kami/providers/alipay/alipayemu"
	"kami/providers/providertest"
	"kami/queue"
	"kami/queue/redistest"
)

// stack is a database kind with a Redis kind: the end-to-end tests run on
// SQLite with the in-process Redis (as `go run .` does), and on the real
// PostgreSQL and MariaDB with the real Redis.
type stack struct {
	db    dbtest.Kind
	redis redistest.Kind
}

var stacks = []stack{{dbtest.SQLite, redistest.Mini}, {dbtest.Postgres, redistest.Real}, {dbtest.MySQL, redistest.Real}}

// eachStack runs fn as a parallel subtest per stack.
func eachStack(t *testing.T, fn func(t *testing.T, s stack)) {
	for _, s := range stacks {
		t.Run(string(s.db)+"+"+string(s.redis), func(t *testing.T) {
			t.Parallel()
			fn(t, s)
		})
	}
}

// alipayApp is a whole kami wired to an Alipay gateway emulator; start
// runs its workers.
type alipayApp struct {
	*testApp
	emu *alipayemu.Server
}

func newAlipayApp(t *testing.T, s stack, extra env) *alipayApp {
	t.Helper()
	emu, err := alipayemu.New(alipayemu.Options{Hold: 3 * time.Second, Slow: 50 * time.Millisecond, EarlyStatements: true})
	if err != nil {
		t.Fatal(err)
	}
	gw := httptest.NewServer(emu)
	t.Cleanup(gw.Close)
	r := redistest.Open(t, s.redis)
	e := env{
		"KAMI_REDIS_URL": r.URL, "KAMI_REDIS_PREFIX": r.Prefix(t),
		"KAMI_ALIPAY_APP_ID": emu.AppID(), "KAMI_ALIPAY_PRIVATE_KEY": emu.AppPrivateKeyPEM(),
		"KAMI_ALIPAY_PUBLIC_KEY": emu.PublicKeyPEM(), "KAMI_ALIPAY_GATEWAY": gw.URL,
		"KAMI_PROVIDER_TIMEOUT": "1s",
	}
	for k, v := range extra {
		e[k] = v
	}
	return &alipayApp{testApp: newTestApp(t, s.db, e), emu: emu}
}

// running starts the app's queue workers and reconciliation cron.
func (a *alipayApp) running(t *testing.T) *alipayApp {
	t.Helper()
	if err := a.start(t.Context()); err != nil {
		t.Fatal(err)
	}
	return a
}

// eventually waits for a condition; see domaintest.Eventually.
var eventually = domaintest.Eventually

func (a *alipayApp) order(t *testing.T, p *domain.Product) *domain.Order {
	t.Helper()
	co, err := a.shop.PlaceOrder(t.Context(), domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1,
		Contact: fmt.Sprintf("buyer-%d@example.com", time.Now().UnixNano()), Provider: "alipay"}, "qr", "127.0.0.1")
	if err != nil {
		gate := a.shop.Gate.(*queue.StockGate)
		n, ok, cerr := gate.Counter(context.Background(), p.ID)
		c, _ := a.ledger.StockCounts(context.Background(), p.ID)
		keys, _ := a.rdb.Keys(context.Background(), a.keys.Prefix()+"*").Result()
		t.Fatalf("%v; counter %d %v %v db %+v rebuilds %d keys %v", err, n, ok, cerr, c, gate.Rebuilds(), keys)
	}
	if co.Payment.Kind != "QR_CODE" || co.Payment.QRCode == "" {
		t.Fatalf("payment %+v", co.Payment)
	}
	return co.Order
}

func (a *alipayApp) status(t *testing.T, orderNo string) domain.OrderStatus {
	t.Helper()
	o, err := a.ledger.Order(context.Background(), orderNo)
	if err != nil {
		t.Fatal(err)
	}
	return o.Status
}

func (a *alipayApp) audit(t *testing.T) {
	t.Helper()
	vs, err := a.ledger.Audit(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range vs {
		t.Errorf("audit: %s", v)
	}
}

// TestAlipayDuplicateNotifications: ten copies of one Alipay notification,
// delivered at once through the real webhook, make one delivery.
func TestAlipayDuplicateNotifications(t *testing.T) {
	t.Parallel()
	eachStack(t, func(t *testing.T, s stack) {
		a := newAlipayApp(t, s, nil).running(t)
		p := a.product(t, 1999, "GIFT-1", "GIFT-2")
		o := a.order(t, p)
		header, body, err := a.emu.Pay(o.OrderNo, o.AmountFen)
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		for i := 0; i < 10; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if status, answer := a.post(t, "/webhooks/alipay", header, body); status != 200 || answer != "success" {
					t.Errorf("copy %d: %d %q", i, status, answer)
				}
			}()
		}
		wg.Wait()
		if st := a.status(t, o.OrderNo); st != domain.OrderPaid {
			t.Fatalf("order %s", st)
		}
		sells, _ := a.db.NewSelect().Table("stock_flow").Where("order_no = ?", o.OrderNo).Where("change_type = ?", domain.FlowSell).Count(t.Context())
		if sells != 1 {
			t.Fatalf("%d deliveries, want 1", sells)
		}
		// A forgery and a wrong amount change nothing more.
		fh, fb := a.emu.Forge(o.OrderNo, o.AmountFen)
		if status, answer := a.post(t, "/webhooks/alipay", fh, fb); status == 200 || answer == "success" {
			t.Fatalf("forgery acknowledged: %d %q", status, answer)
		}
		a.audit(t)
	})
}

// TestLatePaymentRefundedOnceDespiteTimeout: an order closes unpaid, its
// payment lands afterwards, and the first refund call times out after the
// gateway did refund. The retry asks the gateway first and finds the refund
// made: exactly one refund at the gateway, the order REFUNDED.
func TestLatePaymentRefundedOnceDespiteTimeout(t *testing.T) {
	t.Parallel()
	eachStack(t, func(t *testing.T, s stack) {
		a := newAlipayApp(t, s, env{"KAMI_ORDER_TTL": "1s", "KAMI_REFUND_BACKOFF": "100ms,100ms,100ms"}).running(t)
		p := a.product(t, 1250, "LATE-1")
		o := a.order(t, p)
		eventually(t, 10*time.Second, "the unpaid order closes on time", func() bool { return a.status(t, o.OrderNo) == domain.OrderClosed })
		if got := a.cardsOf(t, o.OrderNo); got[domain.CardRecycled] != 1 {
			t.Fatalf("cards %v", got)
		}

		a.emu.InjectFault(providertest.OpRefund, providertest.FaultTimeoutAfterEffect, 1)
		header, body, err := a.emu.Pay(o.OrderNo, o.AmountFen)
		if err != nil {
			t.Fatal(err)
		}
		if status, answer := a.post(t, "/webhooks/alipay", header, body); status != 200 || answer != "success" {
			t.Fatalf("late payment: %d %q", status, answer)
		}
		if st := a.status(t, o.OrderNo); st != domain.OrderRefunding {
			t.Fatalf("after the late payment: %s", st)
		}
		eventually(t, 20*time.Second, "the refund completes", func() bool { return a.status(t, o.OrderNo) == domain.OrderRefunded })

		var refunds []domain.Refund
		if err := a.db.NewSelect().Model(&refunds).Where("order_no = ?", o.OrderNo).Scan(t.Context()); err != nil {
			t.Fatal(err)
		}
		if len(refunds) != 1 || refunds[0].Status != domain.RefundSucceeded || refunds[0].RetryCount != 1 {
			t.Fatalf("refunds %+v", refunds)
		}
		fen, calls := a.emu.Refunded(refunds[0].RefundNo)
		if fen != o.AmountFen || calls != 1 {
			t.Fatalf("the gateway refunded %d fen in %d calls; want %d once", fen, calls, o.AmountFen)
		}
		// Alipay's refund notice arriving afterwards changes nothing.
		rh, rb, err := a.emu.RefundNotification(refunds[0].RefundNo)
		if err != nil {
			t.Fatal(err)
		}
		if status, _ := a.post(t, "/webhooks/alipay", rh, rb); status != 200 {
			t.Fatalf("refund notice: %d", status)
		}
		a.audit(t)
	})
}

// TestRefundGivesUpThenAdminRetries: a refund the gateway keeps refusing
// walks the (shortened) backoff to FAILED with an alert; an admin's retry
// then completes it.
func TestRefundGivesUpThenAdminRetries(t *testing.T) {
	t.Parallel()
	eachStack(t, func(t *testing.T, s stack) {
		a := newAlipayApp(t, s, env{"KAMI_REFUND_BACKOFF": "100ms,100ms"}).running(t)
		p := a.product(t, 800, "R-1")
		o := a.order(t, p)
		header, body, err := a.emu.Pay(o.OrderNo, o.AmountFen)
		if err != nil {
			t.Fatal(err)
		}
		if status, _ := a.post(t, "/webhooks/alipay", header, body); status != 200 {
			t.Fatal(status)
		}
		a.emu.InjectFault(providertest.OpRefund, providertest.FaultBusiness, 0)
		r, err := a.shop.RequestRefund(t.Context(), o.OrderNo, "buyer asked", "admin")
		if err != nil {
			t.Fatal(err)
		}
		eventually(t, 20*time.Second, "the refund gives up", func() bool {
			cur, _ := a.ledger.Refund(context.Background(), r.RefundNo)
			return cur.Status == domain.RefundFailed
		})
		cur, _ := a.ledger.Refund(t.Context(), r.RefundNo)
		if cur.RetryCount != 3 || cur.LastError == "" || bytes.Contains([]byte(cur.LastError), []byte("PRIVATE")) {
			t.Fatalf("failed refund %+v", cur)
		}
		// The alert follows the commit that made the refund FAILED: wait
		// for it rather than race it, then make sure there is only one.
		eventually(t, 5*time.Second, "the refund_failed alert", func() bool {
			return counterValue(t, a.metrics.alerts.WithLabelValues("refund_failed")) >= 1
		})
		if n := counterValue(t, a.metrics.alerts.WithLabelValues("refund_failed")); n != 1 {
			t.Fatalf("%v refund_failed alerts, want 1", n)
		}
		if fen, _ := a.emu.Refunded(r.RefundNo); fen != 0 {
			t.Fatalf("the gateway refunded %d", fen)
		}
		if st := a.status(t, o.OrderNo); st != domain.OrderRefunding {
			t.Fatalf("order %s", st)
		}

		a.emu.InjectFault(providertest.OpRefund, providertest.FaultNone, 0)
		if _, err := a.shop.RetryRefund(t.Context(), r.RefundNo, "admin"); err != nil {
			t.Fatal(err)
		}
		eventually(t, 20*time.Second, "the retried refund completes", func() bool { return a.status(t, o.OrderNo) == domain.OrderRefunded })
		if fen, _ := a.emu.Refunded(r.RefundNo); fen != o.AmountFen {
			t.Fatalf("the gateway refunded %d, want %d", fen, o.AmountFen)
		}
		a.audit(t)
	})
}

func (ta *testApp) cardsOf(t *testing.T, orderNo string) map[domain.CardStatus]int {
	t.Helper()
	var rows []struct {
		Status domain.CardStatus `bun:"status"`
		N      int               `bun:"n"`
	}
	if err := ta.db.NewSelect().Table("card_stock").Column("status").ColumnExpr("COUNT(*) AS n").
		Where("order_no = ?", orderNo).Group("status").Scan(t.Context(), &rows); err != nil {
		t.Fatal(err)
	}
	out := map[domain.CardStatus]int{}
	for _, r := range rows {
		out[r.Status] = r.N
	}
	return out
}

// counterValue reads a Prometheus counter.
func counterValue(t *testing.T, c interface{ Write(*dto.Metric) error }) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

// TestLostNotificationDeliversInsteadOfClosing: the buyer paid but the
// gateway's notification never arrived. When the order falls due, kami asks
// the gateway first and delivers instead of closing; an unpaid order is
// closed at the gateway too, so it can no longer be paid.
func TestLostNotificationDeliversInsteadOfClosing(t *testing.T) {
	t.Parallel()
	eachStack(t, func(t *testing.T, s stack) {
		a := newAlipayApp(t, s, env{"KAMI_ORDER_TTL": "1s"}).running(t)
		p := a.product(t, 600, "Q-1", "Q-2")
		paid := a.order(t, p)
		unpaid := a.order(t, p)
		if _, _, err := a.emu.Pay(paid.OrderNo, paid.AmountFen); err != nil { // notification lost: never posted
			t.Fatal(err)
		}
		eventually(t, 10*time.Second, "both orders settle", func() bool {
			return a.status(t, paid.OrderNo) != domain.OrderPending && a.status(t, unpaid.OrderNo) != domain.OrderPending
		})
		if st := a.status(t, paid.OrderNo); st != domain.OrderPaid {
			t.Fatalf("the paid order ended %s, want PAID", st)
		}
		if got := a.cardsOf(t, paid.OrderNo); got[domain.CardSold] != 1 {
			t.Fatalf("paid order's cards %v", got)
		}
		if st := a.status(t, unpaid.OrderNo); st != domain.OrderClosed {
			t.Fatalf("the unpaid order ended %s, want CLOSED", st)
		}
		if tr, ok := a.emu.Trade(unpaid.OrderNo); !ok || tr.Status != "TRADE_CLOSED" {
			t.Fatalf("the unpaid trade at the gateway: %+v %v, want TRADE_CLOSED", tr, ok)
		}
		a.audit(t)
	})
}
