package domain_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/providers/sandbox"
)

// cancelBundle is a checking shop with the sandbox as its gateway.
type cancelBundle struct {
	*bundle
	sb   *sandbox.Provider
	shop *domain.Shop
	p    *domain.Product
}

func newCancelBundle(t *testing.T, db *bun.DB) *cancelBundle {
	t.Helper()
	b := setup(t, db, domain.Config{})
	sb, err := sandbox.New(sandbox.Config{Secret: "s", BaseURL: "http://127.0.0.1/"})
	if err != nil {
		t.Fatal(err)
	}
	return &cancelBundle{bundle: b, sb: sb, shop: checkingShop(b, sb), p: b.product(t, 500, 5)}
}

func (cb *cancelBundle) place(key, method string) (*domain.Checkout, error) {
	return cb.shop.PlaceOrder(cb.ctx, domain.PlaceOrderInput{ProductID: cb.p.ID, Quantity: 1, Contact: "buyer@example.com",
		Provider: sandbox.Name, IdempotencyKey: key}, method, "203.0.113.9")
}

// TestRetryWithABadMethodKeepsTheOrder: a buyer's retry of createOrder
// (same idempotency key) with a payment method the gateway does not offer
// is refused, and the buyer's live order stays as it was.
func TestRetryWithABadMethodKeepsTheOrder(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		cb := newCancelBundle(t, db)
		co, err := cb.place("retry-1", "")
		if err != nil {
			t.Fatal(err)
		}
		_, err = cb.place("retry-1", "no-such-method")
		wantCode(t, err, domain.EBADINPUT)
		if st := cb.status(t, co.Order.OrderNo); st != domain.OrderPending || cb.cardStatuses(t, co.Order.OrderNo)[domain.CardLocked] != 1 {
			t.Fatalf("order %s, cards %v after a retry with a bad method; want it PENDING holding its card", st, cb.cardStatuses(t, co.Order.OrderNo))
		}
		// A new order with a bad method is still cancelled at once.
		_, err = cb.place("retry-2", "no-such-method")
		wantCode(t, err, domain.EBADINPUT)
		var n int64
		if n, err = cb.db.NewSelect().Table("orders").Where("status = ?", domain.OrderPending).Count(cb.ctx); err != nil || n != 1 {
			t.Fatalf("%d PENDING orders (%v), want only the first", n, err)
		}
		cb.mustAudit(t)
	})
}

// TestReplayOfAClosedOrderHandsOutNoPayment: once the order of an
// idempotency key is closed, a retry with that key gets a clear CONFLICT
// naming the order, never a new payment for it.
func TestReplayOfAClosedOrderHandsOutNoPayment(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		cb := newCancelBundle(t, db)
		co, err := cb.place("replay-1", "")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cb.shop.CancelOrder(cb.ctx, co.Order.OrderNo, co.AccessToken); err != nil {
			t.Fatal(err)
		}
		again, err := cb.place("replay-1", "")
		if err == nil {
			t.Fatalf("a retry of a CLOSED order got a payment: %+v", again.Payment)
		}
		wantCode(t, err, domain.ECONFLICT)
		if msg := domain.ErrorMessage(err); !containsAll(msg, co.Order.OrderNo, string(domain.OrderClosed)) {
			t.Fatalf("message %q does not name the order and its status", msg)
		}
	})
}

// TestCancelClosesTheTrade: a buyer's cancel closes the order's trade at
// the gateway too, so its pay page can no longer take money; and a cancel
// that crosses the buyer's payment delivers instead of closing.
func TestCancelClosesTheTrade(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		cb := newCancelBundle(t, db)
		co, err := cb.place("", "")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cb.shop.CancelOrder(cb.ctx, co.Order.OrderNo, co.AccessToken); err != nil {
			t.Fatal(err)
		}
		if _, _, err := cb.sb.Pay(co.Order.OrderNo, co.Order.AmountFen); !errors.Is(err, sandbox.ErrTradeClosed) {
			t.Fatalf("paying a cancelled order at the gateway: %v, want ErrTradeClosed", err)
		}

		paid, err := cb.place("", "")
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := cb.sb.Pay(paid.Order.OrderNo, paid.Order.AmountFen); err != nil { // its notification is late
			t.Fatal(err)
		}
		_, err = cb.shop.CancelOrder(cb.ctx, paid.Order.OrderNo, paid.AccessToken)
		wantCode(t, err, domain.ECONFLICT)
		if st := cb.status(t, paid.Order.OrderNo); st != domain.OrderPaid {
			t.Fatalf("order %s after a cancel crossed its payment; want PAID", st)
		}
		cb.mustAudit(t)
	})
}

func containsAll(s string, parts ...string) bool {
	for _, p := range parts {
		if !strings.Contains(s, p) {
			return false
		}
	}
	return true
}
