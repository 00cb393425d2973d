package graph_test

import (
	"fmt"
	"strings"
	"testing"
)

// TestPageCostsFixedQueries counts the SELECTs a page costs: the same for
// a page of 3 as for a page of 30, whatever each node asks for.
func TestPageCostsFixedQueries(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	var products []string
	for range 6 {
		products = append(products, b.product(t, "1.00", 20))
	}
	for i := range 30 {
		o := b.order(t, products[i%len(products)], 1, fmt.Sprintf("buyer%d@example.com", i))
		if i%2 == 0 {
			b.pay(t, o.Order.OrderNo, fmt.Sprintf("T-%d", i))
			if i%4 == 0 {
				b.do(t, admin, `mutation($no: String!) { refundOrder(orderNo: $no) { refundNo } }`, map[string]any{"no": o.Order.OrderNo}).decode(t, &struct{}{})
			}
		}
	}
	cost := func(query string, first int) int64 {
		t.Helper()
		before := b.queries.selects.Load()
		var page struct {
			Orders, Refunds, Cards struct{ Edges []struct{} }
			Products               []struct{}
		}
		var vars map[string]any
		if strings.Contains(query, "$first") {
			vars = map[string]any{"first": first}
		}
		b.do(t, admin, query, vars).decode(t, &page)
		n := len(page.Orders.Edges) + len(page.Refunds.Edges) + len(page.Cards.Edges)
		if page.Products == nil && n != first {
			t.Fatalf("page of %d has %d nodes", first, n)
		}
		return b.queries.selects.Load() - before
	}
	for name, q := range map[string]string{
		"orders":   `query($first: Int) { orders(first: $first) { edges { node { orderNo cards product { id name stock } } } } }`,
		"refunds":  `query($first: Int) { refunds(first: $first) { edges { node { refundNo order { orderNo cards product { id stock } } } } } }`,
		"cards":    `query($first: Int) { cards(first: $first) { edges { node { id code product { id stock } } } } }`,
		"products": `{ products(all: true) { id stock } stats { stock { product { id stock } } } }`,
	} {
		small, large := 3, 30
		if name == "refunds" {
			small, large = 2, 8
		}
		if name == "products" {
			small, large = 0, 0 // one list of 6; the point is the count below
		}
		cs, cl := cost(q, small), cost(q, large)
		if cs != cl {
			t.Errorf("%s: a page of %d costs %d SELECTs, a page of %d costs %d", name, small, cs, large, cl)
		}
		if cl > 5 {
			t.Errorf("%s: a page costs %d SELECTs", name, cl)
		}
		t.Logf("%s: %d SELECTs per page", name, cl)
	}
}
