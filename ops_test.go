package main

import (
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"kami/domain"
	"kami/domain/domaintest"
	"kami/queue"
)

// TestReconcileRepairs damages a running shop in each way the
// reconciliation promises to repair, runs it, and checks each repair.
func TestReconcileRepairs(t *testing.T) {
	t.Parallel()
	eachStack(t, func(t *testing.T, s stack) {
		// No workers: the reconciliation alone must find the damage.
		a := newAlipayApp(t, s, nil)
		ctx := t.Context()
		p := a.product(t, 100, "S-1", "S-2", "S-3", "S-4")

		// An order placed with no schedule (the crash window between the
		// commit and the ZADD), overdue by more than 30 minutes.
		lost, err := a.ledger.PlaceOrder(ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: "lost", Provider: "alipay"})
		if err != nil {
			t.Fatal(err)
		}
		overdue := time.Now().UTC().Add(-time.Hour)
		for _, table := range []string{"orders", "pending_order"} {
			if _, err := a.db.NewUpdate().Table(table).Set("expires_at = ?", overdue).
				Where("order_no = ?", lost.Order.OrderNo).Exec(ctx); err != nil {
				t.Fatal(err)
			}
		}
		// A wrong stock counter.
		gate := a.shop.Gate.(*queue.StockGate)
		if err := a.rdb.Set(ctx, a.keys.Stock(p.ID), 42, 0).Err(); err != nil {
			t.Fatal(err)
		}
		// A refund PROCESSING for more than a day.
		now := time.Now().UTC()
		if _, err := a.db.NewInsert().Model(&domain.Refund{RefundNo: "RX-STALE", OrderNo: lost.Order.OrderNo, Provider: "alipay",
			TradeNo: "T-X", Cause: domain.CauseDuplicatePayment, AmountFen: 100, PaidFen: 100, Reason: "test",
			Status: domain.RefundProcessing, NextRetryAt: now.Add(time.Hour), CreatedAt: now.Add(-25 * time.Hour), UpdatedAt: now}).Exec(ctx); err != nil {
			t.Fatal(err)
		}

		run, err := a.reconcile(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if run.ClosedStragglers != 1 || run.StaleRefunds != 1 || run.CountersRepaired < 1 || run.Error != "" {
			t.Fatalf("run %+v", run)
		}
		if st, _ := a.ledger.Order(ctx, lost.Order.OrderNo); st.Status != domain.OrderClosed {
			t.Fatalf("straggler %s", st.Status)
		}
		if got := a.cardsOf(t, lost.Order.OrderNo); got[domain.CardRecycled] != 1 {
			t.Fatalf("straggler cards %v", got)
		}
		n, ok, err := gate.Counter(ctx, p.ID)
		if err != nil || !ok || n != 4 {
			t.Fatalf("stock counter %d %v %v, want 4 (every card free again)", n, ok, err)
		}
		for _, kind := range []string{"stragglers", "stale_refunds"} {
			if v := counterValue(t, a.metrics.alerts.WithLabelValues(kind)); v != 1 {
				t.Errorf("%s alerts: %v", kind, v)
			}
		}
		runs, err := a.ledger.ReconcileRuns(ctx, 5)
		if err != nil || len(runs) != 1 {
			t.Fatalf("runs %v %v", runs, err)
		}
		// A second process finds the lock taken.
		unlock, ok, err := queue.NewLocker(a.rdb, a.keys).TryLock(ctx, "reconcile", time.Minute)
		if err != nil || !ok {
			t.Fatal("lock", err)
		}
		if _, err := a.reconciler.Run(ctx); err != domain.ErrReconcileRunning {
			t.Fatalf("second reconciler: %v", err)
		}
		unlock()
	})
}

// TestMetricsMove checks that /metrics reflects the work as it happens.
func TestMetricsMove(t *testing.T) {
	t.Parallel()
	a := newAlipayApp(t, stacks[0], env{"KAMI_ORDER_TTL": "1s"}).running(t)
	p := a.product(t, 100, "M-1", "M-2")
	paid := a.order(t, p)
	h, b, _ := a.emu.Pay(paid.OrderNo, paid.AmountFen)
	a.post(t, "/webhooks/alipay", h, b)
	fh, fb := a.emu.Forge(paid.OrderNo, paid.AmountFen)
	a.post(t, "/webhooks/alipay", fh, fb)
	unpaid := a.order(t, p)
	eventually(t, 10*time.Second, "the unpaid order closes", func() bool { return a.status(t, unpaid.OrderNo) == domain.OrderClosed })
	_, err := a.shop.PlaceOrder(t.Context(), domain.PlaceOrderInput{ProductID: p.ID, Quantity: 5, Contact: "x", Provider: "alipay"}, "qr", "")
	if domain.ErrorCode(err) != domain.ESOLDOUT {
		t.Fatalf("want SOLD_OUT, got %v", err)
	}

	wants := []string{
		`kami_orders_placed_total 2`,
		`kami_orders_refused_total{code="SOLD_OUT"} 1`,
		`kami_payments_total{outcome="DELIVERED"} 1`,
		`kami_webhook_notifications_total{provider="alipay",result="ok"} 1`,
		`kami_webhook_notifications_total{provider="alipay",result="invalid"} 1`,
		`kami_closes_total{outcome="CLOSED",reason="timeout"} 1`,
		`kami_close_latency_seconds_count 1`,
		`kami_queue_backlog{queue="close"} 0`,
		`kami_queue_up 1`,
		`kami_queue_backlog{queue="webhook"} 0`,
		`kami_webhook_backlog{kind="events"} 0`,
		`kami_webhook_backlog{kind="deliveries"} 0`,
		`kami_webhook_oldest_undelivered_seconds 0`,
		`kami_group_calls_total{kind="place"} 2`,
		`kami_group_batches_total{kind="pay"} 1`,
		`kami_group_split_total{kind="pay"} 0`,
		`go_goroutines`,
	}
	// The counters move just after the commits the test watches (a close
	// is counted once its transaction is done): wait for them, don't race.
	missing := func() []string {
		res, err := http.Get(a.srv.URL + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(res.Body)
		res.Body.Close()
		var out []string
		for _, want := range wants {
			if !strings.Contains(string(body), want) {
				out = append(out, want)
			}
		}
		return out
	}
	lacking := missing()
	for deadline := time.Now().Add(domaintest.MinPatience); len(lacking) > 0 && time.Now().Before(deadline); lacking = missing() {
		time.Sleep(20 * time.Millisecond)
	}
	for _, want := range lacking {
		t.Errorf("/metrics lacks %s", want)
	}
}

// TestImportAfterEmptyCounter: a product's stock counter is built while it
// has no cards (a buyer asked first); importing cards must open the gate at
// once, not after the nightly repair.
func TestImportAfterEmptyCounter(t *testing.T) {
	t.Parallel()
	eachStack(t, func(t *testing.T, s stack) {
		a := newAlipayApp(t, s, nil)
		p := a.product(t, 100)
		place := func() error {
			_, err := a.shop.PlaceOrder(t.Context(), domain.PlaceOrderInput{ProductID: p.ID, Quantity: 2, Contact: "early", Provider: "alipay"}, "qr", "")
			return err
		}
		if err := place(); domain.ErrorCode(err) != domain.ESOLDOUT {
			t.Fatalf("no cards yet: %v", err)
		}
		if _, err := a.shop.ImportCards(t.Context(), p.ID, []string{"I-1", "I-2"}, "admin"); err != nil {
			t.Fatal(err)
		}
		if err := place(); err != nil {
			t.Fatalf("after the import: %v", err)
		}
	})
}
