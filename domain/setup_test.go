package domain_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/domaintest"
)

// alerts records the alerts a test raised.
type alerts struct {
	mu  sync.Mutex
	got []domain.Alert
}

func (a *alerts) Alert(_ context.Context, al domain.Alert) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.got = append(a.got, al)
}

func (a *alerts) kinds() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	var ks []string
	for _, al := range a.got {
		ks = append(ks, al.Kind)
	}
	return ks
}

func (a *alerts) count(kind string) int {
	n := 0
	for _, k := range a.kinds() {
		if k == kind {
			n++
		}
	}
	return n
}

// bundle is what a ledger test needs.
type bundle struct {
	ctx    context.Context
	db     *bun.DB
	ledger *domain.Ledger
	clock  *domaintest.Clock
	alerts *alerts
	meter  *benchMeter // the benchmarks'
}

func setup(t testing.TB, db *bun.DB, cfg domain.Config) *bundle {
	t.Helper()
	sealer, err := domain.NewSealer(domaintest.Key())
	if err != nil {
		t.Fatal(err)
	}
	b := &bundle{ctx: context.Background(), db: db, clock: domaintest.NewClock(time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)), alerts: &alerts{}}
	b.ledger = domain.NewLedger(db, sealer, cfg, b.alerts)
	b.ledger.Now, b.ledger.DBClock = b.clock.Now, b.clock.Now // the database's clock too: tests move time
	return b
}

// product creates a product priced priceFen with n cards "<prefix>-<i>".
func (b *bundle) product(t testing.TB, priceFen int64, n int) *domain.Product {
	t.Helper()
	name := "Game key"
	p, err := b.ledger.CreateProduct(b.ctx, domain.ProductInput{Name: &name, PriceFen: &priceFen}, "test")
	if err != nil {
		t.Fatalf("CreateProduct: %v", err)
	}
	if n > 0 {
		codes := make([]string, n)
		for i := range codes {
			codes[i] = codeFor(p.ID, i)
		}
		res, err := b.ledger.ImportCards(b.ctx, p.ID, codes, "test")
		if err != nil || res.Imported != n {
			t.Fatalf("ImportCards: %+v, %v", res, err)
		}
	}
	return p
}

func codeFor(productID int64, i int) string { return fmt.Sprintf("CODE-%d-%05d", productID, i) }

// order places an order of qty for p.
func (b *bundle) order(t testing.TB, p *domain.Product, qty int) *domain.PlacedOrder {
	t.Helper()
	placed, err := b.ledger.PlaceOrder(b.ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: qty, Contact: "buyer@example.com", Provider: "sandbox"})
	if err != nil {
		t.Fatalf("PlaceOrder: %v", err)
	}
	return placed
}

// pay records a payment for o with trade tradeNo.
func (b *bundle) pay(t testing.TB, o *domain.Order, tradeNo, notifyID string) *domain.PaymentResult {
	t.Helper()
	res, err := b.ledger.RecordPayment(b.ctx, domain.Payment{Provider: o.Provider, NotifyID: notifyID, OrderNo: o.OrderNo,
		TradeNo: tradeNo, AmountFen: o.AmountFen, PaidAt: b.clock.Now(), Raw: "{}"})
	if err != nil {
		t.Fatalf("RecordPayment: %v", err)
	}
	return res
}

func (b *bundle) mustAudit(t testing.TB) {
	t.Helper()
	vs, err := b.ledger.Audit(b.ctx)
	if err != nil {
		t.Fatalf("Audit: %v", err)
	}
	for _, v := range vs {
		t.Errorf("audit: %s", v)
	}
}

func (b *bundle) cardStatuses(t testing.TB, orderNo string) map[domain.CardStatus]int {
	t.Helper()
	var rows []struct {
		Status domain.CardStatus `bun:"status"`
		N      int               `bun:"n"`
	}
	if err := b.db.NewSelect().Table("card_stock").Column("status").ColumnExpr("COUNT(*) AS n").
		Where("order_no = ?", orderNo).Group("status").Scan(b.ctx, &rows); err != nil {
		t.Fatal(err)
	}
	out := map[domain.CardStatus]int{}
	for _, r := range rows {
		out[r.Status] = r.N
	}
	return out
}

func wantCode(t testing.TB, err error, code string) {
	t.Helper()
	if got := domain.ErrorCode(err); got != code {
		t.Fatalf("error code %q (%v), want %q", got, err, code)
	}
}

func ptr[T any](v T) *T { return &v }
