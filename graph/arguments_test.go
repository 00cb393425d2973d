package graph_test

import (
	"testing"

	"kami/domain"
	"kami/domain/dbtest"
)

// TestNULArgumentsAreBadInput: on PostgreSQL, which refuses NUL in text
// outright, a string argument holding one (an order number, a token, a
// filter, an order's contact or idempotency key, a refund number), sent as
// a variable or written in the query, is answered BAD_INPUT, never the
// INTERNAL error the database's refusal would become; nothing is placed.
func TestNULArgumentsAreBadInput(t *testing.T) {
	t.Parallel()
	b := setup(t, options{kind: dbtest.Postgres})
	id := b.product(t, "1.00", 3)
	o := b.order(t, id, 1, "nul@example.com")
	nul := "2611\x00"
	for _, c := range []struct {
		name  string
		who   as
		query string
		vars  map[string]any
	}{
		{"order number", anon, `query($no: String!) { order(orderNo: $no) { status } }`, map[string]any{"no": nul}},
		{"access token", anon, `query($no: String!, $t: String) { order(orderNo: $no, accessToken: $t) { status } }`,
			map[string]any{"no": o.Order.OrderNo, "t": "tok\x00en"}},
		{"literal order number", anon, `{ order(orderNo: "2611\u0000") { status } }`, nil},
		{"admin order", admin, `query($no: String!) { order(orderNo: $no) { status } }`, map[string]any{"no": nul}},
		{"cancel", anon, `mutation($no: String!, $t: String!) { cancelOrder(orderNo: $no, accessToken: $t) { status } }`,
			map[string]any{"no": nul, "t": o.AccessToken}},
		{"refund", admin, `mutation($no: String!) { refundOrder(orderNo: $no) { status } }`, map[string]any{"no": nul}},
		{"retry refund", admin, `mutation($no: String!) { retryRefund(refundNo: $no) { status } }`, map[string]any{"no": nul}},
		{"contact filter", admin, `query($c: String) { orders(filter: {contact: $c}) { edges { node { orderNo } } } }`,
			map[string]any{"c": "a\x00b"}},
		{"sync order", admin, `mutation($no: String!) { syncOrder(orderNo: $no) { order { status } } }`, map[string]any{"no": nul}},
		{"reveals", admin, `query($no: String) { reveals(orderNo: $no) { edges { node { orderNo } } } }`, map[string]any{"no": nul}},
		{"contact", anon, createOrder, map[string]any{"in": map[string]any{
			"productId": id, "quantity": 1, "contact": "a\x00b@example.com", "provider": "sandbox"}}},
		{"idempotency key", anon, createOrder, map[string]any{"in": map[string]any{
			"productId": id, "quantity": 1, "contact": "k@example.com", "provider": "sandbox", "idempotencyKey": "k\x00"}}},
		// Hostile forms: a variable's default, a variable inside an input
		// literal, a field in a fragment, a list element, a list literal.
		{"variable default", anon, `query($no: String! = "2611\u0000") { order(orderNo: $no) { status } }`, nil},
		{"variable in a literal", anon, `mutation($c: String!) { createOrder(input: {productId: "` + id + `", quantity: 1, contact: $c, provider: "sandbox"}) { accessToken } }`,
			map[string]any{"c": "a\x00b@example.com"}},
		{"literal in a literal", anon, `mutation { createOrder(input: {productId: "` + id + `", quantity: 1, contact: "a\u0000b@example.com", provider: "sandbox"}) { accessToken } }`, nil},
		{"fragment", anon, `query($no: String!) { ...F } fragment F on Query { order(orderNo: $no) { status } }`, map[string]any{"no": nul}},
		{"inline fragment", anon, `query($no: String!) { ... on Query { order(orderNo: $no) { status } } }`, map[string]any{"no": nul}},
		{"list element", admin, `mutation($codes: [String!]!) { importCards(productId: "` + id + `", codes: $codes) { imported } }`,
			map[string]any{"codes": []any{"ok-code", "bad\x00code"}}},
		{"list literal", admin, `mutation { importCards(productId: "` + id + `", codes: ["ok-code", "bad\u0000code"]) { imported } }`, nil},
		{"single value as a list", admin, `mutation($codes: [String!]!) { importCards(productId: "` + id + `", codes: $codes) { imported } }`,
			map[string]any{"codes": "bad\x00code"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			if e := b.do(t, c.who, c.query, c.vars).wantCode(t, domain.EBADINPUT); e.Message == "" {
				t.Error("no message")
			}
		})
	}
	n, err := b.db.NewSelect().Table("orders").Count(b.ctx)
	if err != nil || n != 1 {
		t.Fatalf("%d orders (%v), want only the first", n, err)
	}
}
