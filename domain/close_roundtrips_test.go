package domain_test

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/domain/domaintest"
	"kami/providers"
	"kami/providers/sandbox"
)

// TestCloseRoundTrips: closing a batch of due orders, pre-close check on,
// waits for the database a fixed, small number of times, whatever the
// batch's size, as placing and paying do (TestPlaceAndPayRoundTrips). On
// PostgreSQL: the check's read of the orders with the database's clock;
// BEGIN, the orders closed and read back, their cards and batches, the
// cards, journal and events written, COMMIT; the low-stock re-arm's read.
// A restart's backlog is closed 500 orders to a batch, four batches at a
// time, and every round trip of one is a wait the next batch makes too.
// Run with the database's own clock, which both reads judge due by. A
// batch that also holds an order paid meanwhile takes one more on
// PostgreSQL (that order read after the close) and none on MySQL: the row
// of pending_order such an order may have left (paid by an older version)
// goes in the delete of the closed orders' rows.
func TestCloseRoundTrips(t *testing.T) {
	t.Parallel()
	want := map[dbtest.Kind]int64{
		dbtest.Postgres: 7,
		dbtest.MySQL:    14, // no UPDATE … RETURNING, no data-modifying WITH: a statement each (pending_order's delete and card_for_sale's insert among them)
	}
	for _, k := range []dbtest.Kind{dbtest.Postgres, dbtest.MySQL} {
		for _, withPaid := range []bool{false, true} {
			name := string(k)
			if withPaid {
				name += "/with a paid order"
			}
			t.Run(name, func(t *testing.T) { closeRoundTrips(t, k, withPaid, want[k]) })
		}
	}
}

func closeRoundTrips(t *testing.T, k dbtest.Kind, withPaid bool, want int64) {
	t.Parallel()
	l, db, rt := countedLedger(t, k, domain.Config{OrderTTL: time.Millisecond})
	ctx := context.Background()
	name, price := "Game key", int64(500)
	p, err := l.CreateProduct(ctx, domain.ProductInput{Name: &name, PriceFen: &price}, "test")
	if err != nil {
		t.Fatal(err)
	}
	codes := []string{"RT-1", "RT-2", "RT-3", "RT-4"}
	if _, err := l.ImportCards(ctx, p.ID, codes, "test"); err != nil {
		t.Fatal(err)
	}
	var nos []string
	var last time.Time
	for range 3 {
		placed, err := l.PlaceOrder(ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: "rt@example.com", Provider: "sandbox"})
		if err != nil {
			t.Fatal(err)
		}
		nos, last = append(nos, placed.Order.OrderNo), placed.Order.ExpiresAt
	}
	var paid string
	if withPaid {
		placed, err := l.PlaceOrder(ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: "rt@example.com", Provider: "sandbox"})
		if err != nil {
			t.Fatal(err)
		}
		o := placed.Order
		if _, err := l.RecordPayment(ctx, domain.Payment{Provider: o.Provider, NotifyID: "N-RT", OrderNo: o.OrderNo,
			TradeNo: "T-RT", AmountFen: o.AmountFen, Raw: "{}"}); err != nil {
			t.Fatal(err)
		}
		paid, nos = o.OrderNo, append(nos, o.OrderNo)
	}
	domaintest.Eventually(t, time.Second, "the orders are due by the database's clock", func() bool {
		now, err := l.DBNow(ctx)
		return err == nil && now.After(last)
	})
	sb, err := sandbox.New(sandbox.Config{Secret: "s", BaseURL: "http://127.0.0.1/"})
	if err != nil {
		t.Fatal(err)
	}
	shop := &domain.Shop{Ledger: l, Providers: providers.NewRegistry(sb), PreCloseCheck: true,
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))}

	if withPaid && k == dbtest.Postgres {
		want++ // the paid order read after the close
	}
	before := rt.n.Load()
	rs, err := shop.CloseOrders(ctx, nos, domain.CloseTimeout)
	if err != nil {
		t.Fatal(err)
	}
	if got := rt.n.Load() - before; got > want {
		t.Errorf("closing %d orders took %d round trips, want at most %d", len(nos), got, want)
	}
	closed := 0
	for _, r := range rs {
		switch {
		case r.OrderNo == paid:
			if r.Outcome != domain.CloseSkipped {
				t.Errorf("the paid order %s: %s", r.OrderNo, r.Outcome)
			}
		case r.Outcome != domain.Closed || r.Released != 1:
			t.Errorf("%s: %s, %d released", r.OrderNo, r.Outcome, r.Released)
		default:
			closed++
		}
	}
	var events int
	if err := db.NewSelect().Table("events").ColumnExpr("COUNT(*)").Where("type = ?", domain.EventOrderClosed).Scan(ctx, &events); err != nil || events != closed {
		t.Fatalf("%d order.closed events, %v", events, err)
	}
	vs, err := l.Audit(ctx)
	if err != nil || len(vs) > 0 {
		t.Fatalf("audit: %v %v", vs, err)
	}
}
