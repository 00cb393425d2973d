package domain_test

import (
	"slices"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
)

// TestQueriesListOrders pages through orders with every filter on every
// database: pages join up without gaps or repeats, newest first.
func TestQueriesListOrders(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p1 := b.product(t, 100, 10)
		p2 := b.product(t, 250, 10)
		var all []string // oldest first
		for i := range 7 {
			p := p1
			if i%2 == 1 {
				p = p2
			}
			contact := "a@example.com"
			if i >= 5 {
				contact = "b@example.com"
			}
			placed, err := b.ledger.PlaceOrder(b.ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: contact, Provider: "sandbox"})
			if err != nil {
				t.Fatal(err)
			}
			all = append(all, placed.Order.OrderNo)
			b.clock.Advance(time.Minute)
		}
		paid, err := b.ledger.Order(b.ctx, all[2])
		if err != nil {
			t.Fatal(err)
		}
		b.pay(t, paid, "T-1", "")

		collect := func(f domain.OrderFilter, size int) []string {
			t.Helper()
			var got []string
			var after domain.Keyset
			for range 20 {
				page, err := b.ledger.ListOrders(b.ctx, f, after, size)
				if err != nil {
					t.Fatalf("ListOrders: %v", err)
				}
				for _, o := range page.Orders {
					got = append(got, o.OrderNo)
				}
				if !page.HasNext {
					return got
				}
				last := page.Orders[len(page.Orders)-1]
				after = domain.Keyset{At: last.CreatedAt, ID: last.ID}
			}
			t.Fatal("paging did not end")
			return nil
		}
		rev := func(idx ...int) []string {
			var out []string
			for i := len(idx) - 1; i >= 0; i-- {
				out = append(out, all[idx[i]])
			}
			return out
		}
		cases := []struct {
			name string
			f    domain.OrderFilter
			want []string
		}{
			{"all", domain.OrderFilter{}, rev(0, 1, 2, 3, 4, 5, 6)},
			{"status", domain.OrderFilter{Status: domain.OrderPaid}, rev(2)},
			{"pending", domain.OrderFilter{Status: domain.OrderPending}, rev(0, 1, 3, 4, 5, 6)},
			{"product", domain.OrderFilter{ProductID: p2.ID}, rev(1, 3, 5)},
			{"contact", domain.OrderFilter{Contact: "b@example.com"}, rev(5, 6)},
			{"range", domain.OrderFilter{CreatedFrom: time.Date(2026, 11, 29, 12, 1, 0, 0, time.UTC), CreatedBefore: time.Date(2026, 11, 29, 12, 4, 0, 0, time.UTC)}, rev(1, 2, 3)},
			{"combined", domain.OrderFilter{ProductID: p1.ID, Contact: "a@example.com", Status: domain.OrderPending}, rev(0, 4)},
		}
		for _, c := range cases {
			for _, size := range []int{1, 2, 100} {
				if got := collect(c.f, size); !slices.Equal(got, c.want) {
					t.Errorf("%s, pages of %d: %v, want %v", c.name, size, got, c.want)
				}
			}
		}
		for _, bad := range []int{0, -1, domain.MaxPageSize + 1} {
			_, err := b.ledger.ListOrders(b.ctx, domain.OrderFilter{}, domain.Keyset{}, bad)
			wantCode(t, err, domain.EBADINPUT)
		}
		_, err = b.ledger.ListOrders(b.ctx, domain.OrderFilter{Status: "LOST"}, domain.Keyset{}, 10)
		wantCode(t, err, domain.EBADINPUT)
	})
}

// TestQueriesCardsRefundsAndLoaders covers the card and refund lists and
// the batch loaders: results keyed right, missing keys missing, codes opened
// only for SOLD cards.
func TestQueriesCardsRefundsAndLoaders(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p1 := b.product(t, 100, 5)
		p2 := b.product(t, 100, 3)
		o1 := b.order(t, p1, 2).Order
		o2 := b.order(t, p1, 1).Order
		b.pay(t, o1, "T-1", "")

		var ids []int64
		var after int64
		for {
			page, err := b.ledger.ListCards(b.ctx, domain.CardFilter{ProductID: p1.ID}, after, 2)
			if err != nil {
				t.Fatal(err)
			}
			for _, c := range page.Cards {
				if c.ProductID != p1.ID {
					t.Fatalf("card %d of product %d in product %d's list", c.ID, c.ProductID, p1.ID)
				}
				ids = append(ids, c.ID)
			}
			if !page.HasNext {
				break
			}
			after = page.Cards[len(page.Cards)-1].ID
		}
		if len(ids) != 5 || !slices.IsSortedFunc(ids, func(a, b int64) int { return int(b - a) }) {
			t.Fatalf("card ids %v: want 5, newest first", ids)
		}
		sold, err := b.ledger.ListCards(b.ctx, domain.CardFilter{ProductID: p1.ID, Status: domain.CardSold}, 0, 10)
		if err != nil || len(sold.Cards) != 2 {
			t.Fatalf("sold cards: %+v, %v", sold, err)
		}
		code, err := b.ledger.CardCode(&sold.Cards[0])
		if err != nil || code != codeFor(p1.ID, 1) {
			t.Fatalf("CardCode = %q, %v; want %q", code, err, codeFor(p1.ID, 1))
		}
		every, err := b.ledger.ListCards(b.ctx, domain.CardFilter{Status: domain.CardUnsold}, 0, 10)
		if err != nil || len(every.Cards) != 5 { // 2 of p1 (3 locked or sold) and 3 of p2
			t.Fatalf("unsold cards of all products: %d, %v", len(every.Cards), err)
		}
		_, err = b.ledger.ListCards(b.ctx, domain.CardFilter{Status: "GONE"}, 0, 10)
		wantCode(t, err, domain.EBADINPUT)

		ps, err := b.ledger.ProductsByID(b.ctx, []int64{p2.ID, p1.ID, 999})
		if err != nil || len(ps) != 2 || ps[p1.ID].ID != p1.ID || ps[p2.ID].ID != p2.ID {
			t.Fatalf("ProductsByID: %v, %v", ps, err)
		}
		os, err := b.ledger.OrdersByNo(b.ctx, []string{o2.OrderNo, o1.OrderNo, "nope"})
		if err != nil || len(os) != 2 || os[o1.OrderNo].Status != domain.OrderPaid || os[o2.OrderNo].Status != domain.OrderPending {
			t.Fatalf("OrdersByNo: %v, %v", os, err)
		}
		codes, err := b.ledger.SoldCodes(b.ctx, []string{o1.OrderNo, o2.OrderNo})
		if err != nil {
			t.Fatal(err)
		}
		if want := []string{codeFor(p1.ID, 0), codeFor(p1.ID, 1)}; !slices.Equal(codes[o1.OrderNo], want) {
			t.Errorf("codes of the paid order: %v, want %v", codes[o1.OrderNo], want)
		}
		if c, ok := codes[o2.OrderNo]; ok {
			t.Errorf("codes of an unpaid order: %v", c)
		}

		r1, err := b.ledger.RequestRefund(b.ctx, o1.OrderNo, "", "admin")
		if err != nil {
			t.Fatal(err)
		}
		b.clock.Advance(time.Minute)
		o3 := b.order(t, p2, 1).Order
		b.pay(t, o3, "T-3", "")
		r3, err := b.ledger.RequestRefund(b.ctx, o3.OrderNo, "", "admin")
		if err != nil {
			t.Fatal(err)
		}
		page, err := b.ledger.ListRefunds(b.ctx, domain.RefundProcessing, domain.Keyset{}, 1)
		if err != nil || len(page.Refunds) != 1 || !page.HasNext || page.Refunds[0].RefundNo != r3.RefundNo {
			t.Fatalf("first refund page: %+v, %v", page, err)
		}
		last := page.Refunds[0]
		page, err = b.ledger.ListRefunds(b.ctx, domain.RefundProcessing, domain.Keyset{At: last.CreatedAt, ID: last.ID}, 1)
		if err != nil || len(page.Refunds) != 1 || page.HasNext || page.Refunds[0].RefundNo != r1.RefundNo {
			t.Fatalf("second refund page: %+v, %v", page, err)
		}
		page, err = b.ledger.ListRefunds(b.ctx, domain.RefundFailed, domain.Keyset{}, 10)
		if err != nil || len(page.Refunds) != 0 {
			t.Fatalf("failed refunds: %+v, %v", page, err)
		}
	})
}
