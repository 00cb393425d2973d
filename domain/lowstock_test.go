package domain_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/providers"
	"kami/providers/sandbox"
)

func productNow(b *bundle, t testing.TB, id int64) *domain.Product {
	t.Helper()
	p, err := b.ledger.Product(b.ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// shop is a Shop over the bundle's ledger with the sandbox provider and an
// in-memory stock gate.
func (b *bundle) shop(t testing.TB) *domain.Shop {
	t.Helper()
	sb, err := sandbox.New(sandbox.Config{Secret: "lowstock-test", BaseURL: "http://shop.test"})
	if err != nil {
		t.Fatal(err)
	}
	return &domain.Shop{Ledger: b.ledger, Providers: providers.NewRegistry(sb), Gate: &memGate{n: map[int64]int{}}}
}

func (b *bundle) buy(t testing.TB, s *domain.Shop, p *domain.Product, qty int) *domain.Checkout {
	t.Helper()
	co, err := s.PlaceOrder(b.ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: qty, Contact: fmt.Sprintf("c%d", time.Now().UnixNano()),
		Provider: "sandbox"}, "", "127.0.0.1")
	if err != nil {
		t.Fatalf("PlaceOrder: %v", err)
	}
	return co
}

// TestLowStockAlert: a product with a threshold of 3 alerts once when its
// sellable cards fall to 3, not again while they stay at or below it, and
// again only after they rose above it (an order closed, an import) and
// fell back. A recall and a new threshold are crossings too.
func TestLowStockAlert(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		s := b.shop(t)
		p := b.product(t, 100, 0)
		if _, err := s.ImportCards(b.ctx, p.ID, []string{"C1", "C2", "C3", "C4", "C5"}, "admin"); err != nil {
			t.Fatal(err)
		}
		p, err := b.ledger.UpdateProduct(b.ctx, p.ID, domain.ProductInput{LowStockThreshold: ptr(3)}, "admin")
		if err != nil || p.LowStockAlerted {
			t.Fatalf("set threshold: %+v, %v", p, err)
		}
		alerts := func() int { return b.alerts.count("low_stock") }
		// A new product with a threshold has no cards: no alert, and its
		// first import arms it.
		name := "New"
		fresh, err := b.ledger.CreateProduct(b.ctx, domain.ProductInput{Name: &name, PriceFen: ptr(int64(100)), LowStockThreshold: ptr(1)}, "admin")
		if err != nil || !fresh.LowStockAlerted || alerts() != 0 {
			t.Fatalf("new product %+v, %v, %d alerts", fresh, err, alerts())
		}
		if _, err := s.ImportCards(b.ctx, fresh.ID, []string{"F1", "F2"}, "admin"); err != nil {
			t.Fatal(err)
		}
		if got, _ := b.ledger.Product(b.ctx, fresh.ID); got.LowStockAlerted {
			t.Fatal("an import above the threshold left the alert raised")
		}
		b.buy(t, s, productNow(b, t, fresh.ID), 1)
		if alerts() != 1 {
			t.Fatalf("%d alerts after the new product fell to its threshold, want 1", alerts())
		}
		b.alerts.mu.Lock()
		b.alerts.got = nil
		b.alerts.mu.Unlock()
		o1 := b.buy(t, s, p, 1) // 4 left
		if alerts() != 0 {
			t.Fatal("alerted above the threshold")
		}
		o2 := b.buy(t, s, p, 1) // 3 left: the crossing
		if alerts() != 1 {
			t.Fatalf("%d alerts at the threshold, want 1", alerts())
		}
		b.buy(t, s, p, 1) // 2 left
		if alerts() != 1 {
			t.Fatalf("%d alerts below the threshold, want still 1", alerts())
		}
		// One order closes: 3 left, still at the threshold: not re-armed.
		if _, err := s.CloseOrders(b.ctx, []string{o1.Order.OrderNo}, domain.CloseCancel); err != nil {
			t.Fatal(err)
		}
		b.buy(t, s, p, 1) // 2 left
		if alerts() != 1 {
			t.Fatalf("%d alerts without rising above the threshold, want 1", alerts())
		}
		// Two close: 4 left, above: re-armed; the next order crosses again.
		if _, err := s.CloseOrders(b.ctx, []string{o2.Order.OrderNo}, domain.CloseCancel); err != nil {
			t.Fatal(err)
		}
		if _, err := s.ImportCards(b.ctx, p.ID, []string{"C6"}, "admin"); err != nil {
			t.Fatal(err)
		}
		b.buy(t, s, p, 1) // 3 left
		if alerts() != 2 {
			t.Fatalf("%d alerts after rising and falling again, want 2", alerts())
		}
		// A recall is a fall too: re-arm with an import, then recall it.
		res, err := s.ImportCards(b.ctx, p.ID, []string{"C7", "C8"}, "admin")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.RecallBatch(b.ctx, res.Batch.ID, "bad", "admin"); err != nil {
			t.Fatal(err)
		}
		if alerts() != 3 {
			t.Fatalf("%d alerts after a recall took stock to the threshold, want 3", alerts())
		}
		// A threshold raised above the stock alerts at once (re-armed first
		// by lowering it below).
		if _, err := b.ledger.UpdateProduct(b.ctx, p.ID, domain.ProductInput{LowStockThreshold: ptr(1)}, "admin"); err != nil {
			t.Fatal(err)
		}
		if got, _ := b.ledger.Product(b.ctx, p.ID); got.LowStockAlerted {
			t.Fatal("a threshold below the stock left the alert raised")
		}
		if _, err := b.ledger.UpdateProduct(b.ctx, p.ID, domain.ProductInput{LowStockThreshold: ptr(10)}, "admin"); err != nil {
			t.Fatal(err)
		}
		if alerts() != 4 {
			t.Fatalf("%d alerts after a threshold above the stock, want 4", alerts())
		}
		for _, a := range b.alerts.got {
			if a.Kind == "low_stock" && a.Subject != fmt.Sprintf("product %d", p.ID) {
				t.Errorf("alert subject %q", a.Subject)
			}
		}
	})
}

// TestRaceLowStockOnce: 40 buyers race past the threshold of a product
// through two shops (two processes): exactly one alert.
func TestRaceLowStockOnce(t *testing.T) {
	t.Parallel()
	dbtest.Servers(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 50)
		p, err := b.ledger.UpdateProduct(b.ctx, p.ID, domain.ProductInput{LowStockThreshold: ptr(20)}, "admin")
		if err != nil {
			t.Fatal(err)
		}
		shops := []*domain.Shop{b.shop(t), b.shop(t)}
		other := domain.NewLedger(db, b.ledger.Sealer(), domain.Config{}, b.alerts)
		shops[1].Ledger = other
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := 0; i < 40; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				s := shops[i%2]
				if _, err := s.PlaceOrder(b.ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: fmt.Sprintf("b%d", i),
					Provider: "sandbox"}, "", ""); err != nil && domain.ErrorCode(err) != domain.EUNAVAILABLE {
					t.Error(err)
				}
			}()
		}
		// The gates start empty: fill them so every buyer is admitted.
		for _, s := range shops {
			s.Gate.GiveBack(b.ctx, p.ID, 50)
		}
		close(start)
		wg.Wait()
		if n := b.alerts.count("low_stock"); n != 1 {
			t.Fatalf("%d low-stock alerts, want exactly 1", n)
		}
	})
}
