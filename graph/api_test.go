package graph_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/99designs/gqlgen/client"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/graph"
	"kami/providers/fault"
)

func TestProducts(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	id := b.product(t, "12.5", 3)

	var dup struct {
		ImportCards struct{ Imported, Duplicates int }
	}
	b.do(t, admin, `mutation($p: ID!, $c: [String!]!) { importCards(productId: $p, codes: $c) { imported duplicates } }`,
		map[string]any{"p": id, "c": []string{codeOf(id, 0), "NEW-1", "NEW-1"}}).decode(t, &dup)
	if dup.ImportCards.Imported != 1 || dup.ImportCards.Duplicates != 2 {
		t.Errorf("import with duplicates: %+v, want 1 imported, 2 duplicates", dup.ImportCards)
	}

	type product struct {
		ID, Name, Description, Price, CreatedAt string
		Active                                  bool
		MaxPerOrder, Stock                      int
	}
	const fields = `id name description price active maxPerOrder stock createdAt`
	var list struct{ Products []product }
	b.do(t, anon, `{ products { `+fields+` } }`, nil).decode(t, &list)
	if len(list.Products) != 1 || list.Products[0].Price != "12.50" || list.Products[0].Stock != 4 || !list.Products[0].Active {
		t.Fatalf("products: %+v, want one at 12.50 with 4 in stock", list.Products)
	}

	var upd struct{ UpdateProduct product }
	b.do(t, admin, `mutation($id: ID!) { updateProduct(id: $id, input: {price: "0.99", active: false, maxPerOrder: 2, description: "d"}) { `+fields+` } }`,
		map[string]any{"id": id}).decode(t, &upd)
	if p := upd.UpdateProduct; p.Price != "0.99" || p.Active || p.MaxPerOrder != 2 || p.Description != "d" || p.Name != "Game key" {
		t.Errorf("updated product: %+v", p)
	}
	b.do(t, anon, `{ products { id } }`, nil).decode(t, &list)
	if len(list.Products) != 0 {
		t.Errorf("an inactive product is listed to buyers: %+v", list.Products)
	}
	b.do(t, admin, `{ products(all: true) { id } }`, nil).decode(t, &list)
	if len(list.Products) != 1 {
		t.Errorf("admins see inactive products: %+v", list.Products)
	}
	b.do(t, anon, `{ products(all: true) { id } }`, nil).wantCode(t, domain.EUNAUTH)

	var one struct{ Product *product }
	b.do(t, anon, `query($id: ID!) { product(id: $id) { id } }`, map[string]any{"id": id}).decode(t, &one)
	if one.Product != nil {
		t.Errorf("an inactive product is shown to buyers: %+v", one.Product)
	}
	b.do(t, admin, `query($id: ID!) { product(id: $id) { id price } }`, map[string]any{"id": id}).decode(t, &one)
	if one.Product == nil || one.Product.Price != "0.99" {
		t.Errorf("admin product(id): %+v", one.Product)
	}
	b.do(t, anon, `{ product(id: "999") { id } }`, nil).decode(t, &one)
	if one.Product != nil {
		t.Errorf("missing product: %+v", one.Product)
	}

	// Bad input changes nothing.
	for _, price := range []string{"12.505", "-1", "1e3", "abc", ""} {
		r := b.do(t, admin, `mutation($p: Money!) { createProduct(input: {name: "x", price: $p}) { id } }`, map[string]any{"p": price})
		if e := r.wantCode(t, domain.EBADINPUT); strings.Contains(e.Message, "money:") {
			t.Errorf("price %q: message leaks internals: %q", price, e.Message)
		}
	}
	b.do(t, admin, `mutation { createProduct(input: {name: "x", price: 12.5}) { id } }`, nil).wantCode(t, domain.EBADINPUT) // a float is never an amount
	b.do(t, admin, `mutation { createProduct(input: {name: " ", price: "1"}) { id } }`, nil).wantCode(t, domain.EBADINPUT)
	b.do(t, admin, `mutation { updateProduct(id: "999", input: {price: "1"}) { id } }`, nil).wantCode(t, domain.ENOTFOUND)
	b.do(t, admin, `mutation { updateProduct(id: "x", input: {price: "1"}) { id } }`, nil).wantCode(t, domain.EBADINPUT)
	b.do(t, admin, `mutation { importCards(productId: "999", codes: ["A"]) { imported } }`, nil).wantCode(t, domain.ENOTFOUND)
	b.do(t, admin, `mutation($p: ID!) { importCards(productId: $p, codes: []) { imported } }`, map[string]any{"p": id}).wantCode(t, domain.EBADINPUT)
	b.do(t, admin, `{ products(all: true) { id } }`, nil).decode(t, &list)
	if len(list.Products) != 1 {
		t.Errorf("a refused createProduct made a product: %+v", list.Products)
	}

	// Admin mutations without the admin token.
	for _, who := range []as{anon, "Bearer wrong", "Basic " + adminToken, as("Bearer " + adminToken + "x")} {
		b.do(t, who, `mutation { createProduct(input: {name: "x", price: "1"}) { id } }`, nil).wantCode(t, domain.EUNAUTH)
		b.do(t, who, `mutation($p: ID!) { updateProduct(id: $p, input: {active: true}) { id } }`, map[string]any{"p": id}).wantCode(t, domain.EUNAUTH)
		b.do(t, who, `mutation($p: ID!) { importCards(productId: $p, codes: ["Z"]) { imported } }`, map[string]any{"p": id}).wantCode(t, domain.EUNAUTH)
	}
	b.do(t, admin, `query($id: ID!) { product(id: $id) { active stock } }`, map[string]any{"id": id}).decode(t, &one)
	if one.Product.Active || one.Product.Stock != 4 {
		t.Errorf("unauthenticated mutations changed the product: %+v", one.Product)
	}
}

const orderFields = `orderNo status quantity amount contact provider expiresAt createdAt paidAt closedAt refundedAt cards product { id price }`

type order struct {
	OrderNo, Status, Amount, Contact, Provider, ExpiresAt, CreatedAt string
	Quantity                                                         int
	PaidAt, ClosedAt, RefundedAt, TradeNo                            *string
	Cards                                                            []string
	Product                                                          struct{ ID, Price string }
}

// TestBuyerSeesOwnOrderAndCodesOnlyWhenPaid is the authorization table of
// one order through its life.
func TestBuyerSeesOwnOrderAndCodesOnlyWhenPaid(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	id := b.product(t, "5.00", 5)
	mine := b.order(t, id, 2, "me@example.com")
	theirs := b.order(t, id, 1, "them@example.com")

	if mine.Order.Status != "PENDING" || mine.Order.Amount != "10.00" || mine.AccessToken == "" {
		t.Fatalf("createOrder: %+v", mine)
	}
	if mine.Payment.Kind != "REDIRECT" || !strings.Contains(mine.Payment.URL, "/sandbox/pay/"+mine.Order.OrderNo) || mine.Payment.ExpiresAt == "" {
		t.Errorf("payment: %+v", mine.Payment)
	}
	if string(mine.Payment.QRCode) != "null" {
		t.Errorf("a redirect payment's qrCode = %s, want null", mine.Payment.QRCode)
	}

	read := func(who as, orderNo string, token *string, fields string) result {
		vars := map[string]any{"no": orderNo}
		if token != nil {
			vars["t"] = *token
		}
		return b.do(t, who, `query($no: String!, $t: String) { order(orderNo: $no, accessToken: $t) { `+fields+` } }`, vars)
	}
	var got struct{ Order order }
	read(anon, mine.Order.OrderNo, &mine.AccessToken, orderFields).decode(t, &got)
	if got.Order.Status != "PENDING" || got.Order.Cards != nil || got.Order.Quantity != 2 || got.Order.Product.ID != id || got.Order.Contact != "me@example.com" {
		t.Fatalf("buyer reads pending order: %+v", got.Order)
	}
	// Another buyer's token, a made-up token, a made-up order: all the same NOT_FOUND.
	e1 := read(anon, mine.Order.OrderNo, &theirs.AccessToken, "orderNo").wantCode(t, domain.ENOTFOUND)
	read(anon, mine.Order.OrderNo, ptr("guess"), "orderNo").wantCode(t, domain.ENOTFOUND)
	e3 := read(anon, "20261129120000123456", &mine.AccessToken, "orderNo").wantCode(t, domain.ENOTFOUND)
	if strings.Replace(e1.Message, mine.Order.OrderNo, "N", 1) != strings.Replace(e3.Message, "20261129120000123456", "N", 1) {
		t.Errorf("a wrong token reads differently from a missing order: %q vs %q", e1.Message, e3.Message)
	}
	read(anon, mine.Order.OrderNo, nil, "orderNo").wantCode(t, domain.EUNAUTH)
	read("Bearer nope", mine.Order.OrderNo, nil, "orderNo").wantCode(t, domain.EUNAUTH)
	r := read(anon, mine.Order.OrderNo, &mine.AccessToken, "orderNo tradeNo")
	if e := r.wantCode(t, domain.EFORBIDDEN); len(e.Path) != 2 || e.Path[1] != "tradeNo" {
		t.Errorf("FORBIDDEN path: %v", e.Path)
	}

	b.pay(t, mine.Order.OrderNo, "TRADE-MINE")
	read(anon, mine.Order.OrderNo, &mine.AccessToken, orderFields).decode(t, &got)
	want := []string{codeOf(id, 0), codeOf(id, 1)}
	if got.Order.Status != "PAID" || !slices.Equal(got.Order.Cards, want) || got.Order.PaidAt == nil {
		t.Fatalf("buyer reads paid order: %+v, want codes %v", got.Order, want)
	}
	read(anon, mine.Order.OrderNo, &theirs.AccessToken, "cards").wantCode(t, domain.ENOTFOUND)
	read(anon, theirs.Order.OrderNo, &theirs.AccessToken, orderFields).decode(t, &got)
	if got.Order.Cards != nil {
		t.Errorf("unpaid order shows codes: %v", got.Order.Cards)
	}
	read(admin, theirs.Order.OrderNo, nil, orderFields+" tradeNo").decode(t, &got)
	if got.Order.Cards != nil || got.Order.TradeNo != nil {
		t.Errorf("admin sees codes of an unpaid order: %+v", got.Order)
	}
	read(admin, mine.Order.OrderNo, nil, orderFields+" tradeNo").decode(t, &got)
	if !slices.Equal(got.Order.Cards, want) || got.Order.TradeNo == nil || *got.Order.TradeNo != "TRADE-MINE" {
		t.Errorf("admin reads the paid order: %+v", got.Order)
	}

	// Refunded by an admin: the buyer no longer gets the codes, the admin does.
	var refund struct {
		RefundOrder struct {
			RefundNo, Status, Cause, Amount, Reason string
			Order                                   struct{ Status string }
		}
	}
	b.do(t, admin, `mutation($no: String!) { refundOrder(orderNo: $no, reason: "asked") { refundNo status cause amount reason order { status } } }`,
		map[string]any{"no": mine.Order.OrderNo}).decode(t, &refund)
	if rf := refund.RefundOrder; rf.Status != "PROCESSING" || rf.Cause != "ADMIN" || rf.Amount != "10.00" || rf.Reason != "asked" || rf.Order.Status != "REFUNDING" {
		t.Fatalf("refundOrder: %+v", rf)
	}
	read(anon, mine.Order.OrderNo, &mine.AccessToken, orderFields).decode(t, &got)
	if got.Order.Status != "REFUNDING" || got.Order.Cards != nil {
		t.Errorf("buyer reads refunding order: %+v", got.Order)
	}
	read(admin, mine.Order.OrderNo, nil, "cards").decode(t, &got)
	if !slices.Equal(got.Order.Cards, want) {
		t.Errorf("admin reads refunding order's codes: %v", got.Order.Cards)
	}
	b.do(t, admin, `mutation($no: String!) { refundOrder(orderNo: $no) { refundNo } }`, map[string]any{"no": mine.Order.OrderNo}).wantCode(t, domain.ECONFLICT)
	b.do(t, admin, `mutation($no: String!) { refundOrder(orderNo: $no) { refundNo } }`, map[string]any{"no": theirs.Order.OrderNo}).wantCode(t, domain.ECONFLICT)
	b.do(t, admin, `mutation { refundOrder(orderNo: "nope") { refundNo } }`, nil).wantCode(t, domain.ENOTFOUND)
	b.do(t, anon, `mutation($no: String!) { refundOrder(orderNo: $no) { refundNo } }`, map[string]any{"no": theirs.Order.OrderNo}).wantCode(t, domain.EUNAUTH)
}

func TestCancelOrder(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	id := b.product(t, "1.00", 2)
	o := b.order(t, id, 2, "me@example.com")
	cancel := func(token string) result {
		return b.do(t, anon, `mutation($no: String!, $t: String!) { cancelOrder(orderNo: $no, accessToken: $t) { status closedAt cards } }`,
			map[string]any{"no": o.Order.OrderNo, "t": token})
	}
	cancel("wrong").wantCode(t, domain.ENOTFOUND)
	var got struct{ CancelOrder order }
	cancel(o.AccessToken).decode(t, &got)
	if got.CancelOrder.Status != "CLOSED" || got.CancelOrder.ClosedAt == nil {
		t.Fatalf("cancelOrder: %+v", got.CancelOrder)
	}
	cancel(o.AccessToken).wantCode(t, domain.ECONFLICT)
	var p struct{ Product struct{ Stock int } }
	b.do(t, anon, `query($id: ID!) { product(id: $id) { stock } }`, map[string]any{"id": id}).decode(t, &p)
	if p.Product.Stock != 2 {
		t.Errorf("stock after cancel: %d, want 2", p.Product.Stock)
	}
	paid := b.order(t, id, 1, "me@example.com")
	b.pay(t, paid.Order.OrderNo, "T-1")
	b.do(t, anon, `mutation($no: String!, $t: String!) { cancelOrder(orderNo: $no, accessToken: $t) { status } }`,
		map[string]any{"no": paid.Order.OrderNo, "t": paid.AccessToken}).wantCode(t, domain.ECONFLICT)
}

func TestCreateOrderErrors(t *testing.T) {
	t.Parallel()
	b := setup(t, options{ledger: domain.Config{MaxPendingPerContact: 2, MaxPendingPerAddress: 3}})
	id := b.product(t, "1.00", 20)
	empty := b.product(t, "1.00", 0)
	create := func(in map[string]any, opts ...client.Option) result {
		t.Helper()
		base := map[string]any{"productId": id, "quantity": 1, "contact": "c@example.com", "provider": "sandbox"}
		for k, v := range in {
			base[k] = v
		}
		resp, err := b.client.RawPost(createOrder, append(opts, client.Var("in", base))...)
		if err != nil {
			t.Fatal(err)
		}
		var r result
		r.Data, _ = jsonMarshal(resp.Data)
		if resp.Errors != nil {
			jsonUnmarshal(t, resp.Errors, &r.Errors)
		}
		return r
	}
	create(map[string]any{"productId": empty}).wantCode(t, domain.ESOLDOUT)
	create(map[string]any{"productId": "999"}).wantCode(t, domain.ENOTFOUND)
	create(map[string]any{"quantity": 0}).wantCode(t, domain.EBADINPUT)
	create(map[string]any{"quantity": 101}).wantCode(t, domain.EBADINPUT)
	create(map[string]any{"contact": ""}).wantCode(t, domain.EBADINPUT)
	create(map[string]any{"provider": "paypal"}).wantCode(t, domain.EBADINPUT)
	create(map[string]any{"method": "carrier-pigeon"}).wantCode(t, domain.EBADINPUT)
	create(map[string]any{"quantity": "one"}).wantCode(t, "GRAPHQL_VALIDATION_FAILED")
	create(map[string]any{"nope": 1}).wantCode(t, "GRAPHQL_VALIDATION_FAILED")

	// The same idempotency key gives the same order; a different order under it is a CONFLICT.
	var first, again struct{ CreateOrder placed }
	create(map[string]any{"idempotencyKey": "k-1", "contact": "idem@example.com"}).decode(t, &first)
	create(map[string]any{"idempotencyKey": "k-1", "contact": "idem@example.com"}).decode(t, &again)
	if first.CreateOrder.Order.OrderNo != again.CreateOrder.Order.OrderNo || first.CreateOrder.AccessToken != again.CreateOrder.AccessToken {
		t.Errorf("idempotent retry: %+v then %+v", first.CreateOrder, again.CreateOrder)
	}
	create(map[string]any{"idempotencyKey": "k-1", "contact": "idem@example.com", "quantity": 2}).wantCode(t, domain.ECONFLICT)

	// Caps: per contact, then per client address (the request's RemoteAddr).
	from := func(addr string) client.Option {
		return func(r *client.Request) { r.HTTP.RemoteAddr = addr + ":40000" }
	}
	create(map[string]any{"contact": "cap@example.com"}, from("198.51.100.1")).decode(t, &first)
	create(map[string]any{"contact": "cap@example.com"}, from("198.51.100.1")).decode(t, &first)
	create(map[string]any{"contact": "cap@example.com"}, from("198.51.100.2")).wantCode(t, domain.ELIMIT)
	create(map[string]any{"contact": "other@example.com"}, from("198.51.100.1")).decode(t, &first)
	create(map[string]any{"contact": "third@example.com"}, from("198.51.100.1")).wantCode(t, domain.ELIMIT)
	create(map[string]any{"contact": "third@example.com"}, from("198.51.100.3")).decode(t, &first)

	// A provider that does not answer: UNAVAILABLE, and nothing is held.
	b.sandbox.InjectFault(fault.OpCreate, fault.Server5xx, 1)
	create(map[string]any{"contact": "down@example.com", "productId": b.product(t, "1.00", 1)}).wantCode(t, domain.EUNAVAILABLE)
}

func TestAdminLists(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	p1 := b.product(t, "1.00", 10)
	p2 := b.product(t, "2.00", 10)
	var nos []string // oldest first
	for i := range 5 {
		p, contact := p1, "a@example.com"
		if i%2 == 1 {
			p, contact = p2, "b@example.com"
		}
		nos = append(nos, b.order(t, p, 1, contact).Order.OrderNo)
	}
	b.pay(t, nos[3], "T-3")

	type page struct {
		Edges []struct {
			Cursor string
			Node   order
		}
		PageInfo struct {
			HasNextPage bool
			EndCursor   *string
		}
	}
	list := func(filter map[string]any, first int) []string {
		t.Helper()
		var out []string
		var after *string
		for {
			var got struct{ Orders page }
			vars := map[string]any{"f": filter, "first": first}
			if after != nil {
				vars["after"] = *after
			}
			b.do(t, admin, `query($f: OrderFilter, $first: Int, $after: String) { orders(filter: $f, first: $first, after: $after) {
				edges { cursor node { orderNo status cards tradeNo product { id } } } pageInfo { hasNextPage endCursor } } }`, vars).decode(t, &got)
			for _, e := range got.Orders.Edges {
				out = append(out, e.Node.OrderNo)
				if e.Node.Status == "PAID" && (len(e.Node.Cards) != 1 || e.Node.TradeNo == nil) {
					t.Errorf("admin list: paid order without codes or trade: %+v", e.Node)
				}
			}
			if !got.Orders.PageInfo.HasNextPage {
				return out
			}
			after = got.Orders.PageInfo.EndCursor
		}
	}
	rev := func(idx ...int) []string {
		var out []string
		for i := len(idx) - 1; i >= 0; i-- {
			out = append(out, nos[idx[i]])
		}
		return out
	}
	if got := list(nil, 2); !slices.Equal(got, rev(0, 1, 2, 3, 4)) {
		t.Errorf("all orders in pages of 2: %v", got)
	}
	if got := list(map[string]any{"status": "PAID"}, 10); !slices.Equal(got, rev(3)) {
		t.Errorf("PAID: %v", got)
	}
	if got := list(map[string]any{"productId": p2, "status": "PENDING"}, 10); !slices.Equal(got, rev(1)) {
		t.Errorf("product 2 PENDING: %v", got)
	}
	if got := list(map[string]any{"contact": "a@example.com"}, 1); !slices.Equal(got, rev(0, 2, 4)) {
		t.Errorf("contact a: %v", got)
	}
	future := time.Now().Add(time.Hour).UTC().Format(time.RFC3339)
	if got := list(map[string]any{"createdFrom": future}, 10); len(got) != 0 {
		t.Errorf("created after now: %v", got)
	}
	if got := list(map[string]any{"createdBefore": future}, 10); len(got) != 5 {
		t.Errorf("created before the future: %v", got)
	}

	var cards struct {
		Cards struct {
			Edges []struct {
				Node struct {
					ID, Status, Code string
					OrderNo          *string
					Product          struct{ ID string }
				}
			}
			PageInfo struct{ HasNextPage bool }
		}
	}
	b.do(t, admin, `query($p: ID) { cards(productId: $p, status: SOLD) { edges { node { id status code orderNo product { id } } } pageInfo { hasNextPage } } }`,
		map[string]any{"p": p2}).decode(t, &cards)
	if e := cards.Cards.Edges; len(e) != 1 || e[0].Node.Code != codeOf(p2, 1) || e[0].Node.OrderNo == nil || *e[0].Node.OrderNo != nos[3] || e[0].Node.Product.ID != p2 {
		t.Errorf("sold cards of product 2: %+v", cards)
	}
	b.do(t, admin, `query($p: ID) { cards(productId: $p, status: UNSOLD, first: 100) { edges { node { id orderNo } } pageInfo { hasNextPage } } }`,
		map[string]any{"p": p1}).decode(t, &cards)
	if len(cards.Cards.Edges) != 7 || cards.Cards.Edges[0].Node.OrderNo != nil {
		t.Errorf("unsold cards of product 1: %+v", cards)
	}

	b.do(t, admin, `mutation($no: String!) { refundOrder(orderNo: $no) { refundNo } }`, map[string]any{"no": nos[3]}).decode(t, &struct{}{})
	var refunds struct {
		Refunds struct {
			Edges []struct {
				Node struct {
					RefundNo, Status string
					LastError        *string
					RetryCount       int
					Order            struct {
						OrderNo string
						Cards   []string
						Product struct{ ID string }
					}
				}
			}
		}
	}
	b.do(t, admin, `{ refunds(status: PROCESSING) { edges { node { refundNo status lastError retryCount nextRetryAt createdAt order { orderNo cards product { id } } } } } }`, nil).decode(t, &refunds)
	if e := refunds.Refunds.Edges; len(e) != 1 || e[0].Node.Order.OrderNo != nos[3] || len(e[0].Node.Order.Cards) != 1 || e[0].Node.Order.Product.ID != p2 {
		t.Errorf("refunds: %+v", refunds)
	}

	// Bad paging input and the wrong caller.
	b.do(t, admin, `{ orders(first: 101) { edges { cursor } } }`, nil).wantCode(t, domain.EBADINPUT)
	b.do(t, admin, `{ orders(first: 0) { edges { cursor } } }`, nil).wantCode(t, domain.EBADINPUT)
	b.do(t, admin, `{ orders(after: "bm9wZQ") { edges { cursor } } }`, nil).wantCode(t, domain.EBADINPUT)
	b.do(t, admin, `{ orders(after: "%%%") { edges { cursor } } }`, nil).wantCode(t, domain.EBADINPUT)
	var c struct {
		Cards struct{ PageInfo struct{ EndCursor string } }
	}
	b.do(t, admin, `{ cards(first: 1) { pageInfo { endCursor } } }`, nil).decode(t, &c)
	b.do(t, admin, `query($a: String) { orders(after: $a) { edges { cursor } } }`, map[string]any{"a": c.Cards.PageInfo.EndCursor}).wantCode(t, domain.EBADINPUT)
	b.do(t, admin, `{ orders(filter: {status: LOST}) { edges { cursor } } }`, nil).wantCode(t, "GRAPHQL_VALIDATION_FAILED")
	for _, q := range []string{`{ orders { edges { cursor } } }`, `{ cards { edges { cursor } } }`, `{ refunds { edges { cursor } } }`, `{ stats { closeSuccessRate } }`} {
		b.do(t, anon, q, nil).wantCode(t, domain.EUNAUTH)
		b.do(t, "Bearer not-the-token", q, nil).wantCode(t, domain.EUNAUTH)
	}
}

func TestRetryRefund(t *testing.T) {
	t.Parallel()
	b := setup(t, options{ledger: domain.Config{RefundBackoff: []time.Duration{}}})
	id := b.product(t, "3.00", 1)
	o := b.order(t, id, 1, "me@example.com")
	b.pay(t, o.Order.OrderNo, "T-1")
	var r struct{ RefundOrder struct{ RefundNo string } }
	b.do(t, admin, `mutation($no: String!) { refundOrder(orderNo: $no) { refundNo } }`, map[string]any{"no": o.Order.OrderNo}).decode(t, &r)
	retry := func(who as) result {
		return b.do(t, who, `mutation($no: String!) { retryRefund(refundNo: $no) { status retryCount lastError } }`, map[string]any{"no": r.RefundOrder.RefundNo})
	}
	retry(admin).wantCode(t, domain.ECONFLICT) // still PROCESSING
	if _, err := b.ledger.RefundAttemptFailed(b.ctx, r.RefundOrder.RefundNo, 0, "gateway said no"); err != nil {
		t.Fatal(err)
	}
	var failed struct {
		Refunds struct {
			Edges []struct {
				Node struct{ Status, LastError string }
			}
		}
	}
	b.do(t, admin, `{ refunds(status: FAILED) { edges { node { status lastError } } } }`, nil).decode(t, &failed)
	if len(failed.Refunds.Edges) != 1 || failed.Refunds.Edges[0].Node.LastError != "gateway said no" {
		t.Fatalf("failed refunds: %+v", failed)
	}
	retry(anon).wantCode(t, domain.EUNAUTH)
	var got struct {
		RetryRefund struct {
			Status     string
			RetryCount int
		}
	}
	retry(admin).decode(t, &got)
	if got.RetryRefund.Status != "PROCESSING" {
		t.Errorf("retried refund: %+v", got.RetryRefund)
	}
	b.do(t, admin, `mutation { retryRefund(refundNo: "RA-nope") { status } }`, nil).wantCode(t, domain.ENOTFOUND)
}

type fakeStats struct {
	h     graph.Health
	err   error
	panic bool
}

func (f fakeStats) Health(context.Context) (graph.Health, error) {
	if f.panic {
		panic("stats exploded: SELECT secret FROM keys")
	}
	return f.h, f.err
}

func TestStats(t *testing.T) {
	t.Parallel()
	rate := 0.75
	b := setup(t, options{stats: fakeStats{h: graph.Health{
		Queues:           []graph.QueueHealth{{Name: "close", Backlog: 3, OldestOverdue: 1500 * time.Millisecond}, {Name: "refund"}},
		CloseSuccessRate: &rate,
	}}})
	id := b.product(t, "1.00", 3)
	b.order(t, id, 1, "me@example.com")
	var got struct {
		Stats struct {
			Queues []struct {
				Name                 string
				Backlog              int
				OldestOverdueSeconds float64
			}
			CloseSuccessRate  *float64
			RefundFailureRate *float64
			Stock             []struct {
				Product                struct{ ID string }
				Lockable, Locked, Sold int
			}
		}
	}
	b.do(t, admin, `{ stats { queues { name backlog oldestOverdueSeconds } closeSuccessRate refundFailureRate stock { product { id stock } lockable locked sold } } }`, nil).decode(t, &got)
	s := got.Stats
	if len(s.Queues) != 2 || s.Queues[0].Backlog != 3 || s.Queues[0].OldestOverdueSeconds != 1.5 || s.CloseSuccessRate == nil || *s.CloseSuccessRate != 0.75 || s.RefundFailureRate != nil {
		t.Errorf("stats: %+v", s)
	}
	if len(s.Stock) != 1 || s.Stock[0].Product.ID != id || s.Stock[0].Lockable != 2 || s.Stock[0].Locked != 1 {
		t.Errorf("stock: %+v", s.Stock)
	}
}

// TestInternalErrorsAreHidden: an error kami did not write for callers, or
// a panic, reaches the client as INTERNAL "internal error" and nothing else.
func TestInternalErrorsAreHidden(t *testing.T) {
	t.Parallel()
	for name, src := range map[string]fakeStats{
		"error": {err: errors.New(`pq: relation "refund_order" does not exist (SELECT * FROM refund_order)`)},
		"panic": {panic: true},
	} {
		b := setup(t, options{stats: src})
		r := b.do(t, admin, `{ stats { closeSuccessRate } }`, nil)
		e := r.wantCode(t, domain.EINTERNAL)
		if e.Message != "internal error" {
			t.Errorf("%s: message %q", name, e.Message)
		}
		raw, _ := jsonMarshal(r.Errors)
		for _, leak := range []string{"SELECT", "refund_order", "exploded", "goroutine", ".go:"} {
			if strings.Contains(string(raw), leak) {
				t.Errorf("%s: error leaks %q: %s", name, leak, raw)
			}
		}
		// The server is unharmed.
		b.do(t, anon, `{ products { id } }`, nil).decode(t, &struct{}{})
	}
	// A database that fails mid-request.
	b := setup(t, options{})
	b.db.Close()
	r := b.do(t, anon, `{ products { id } }`, nil)
	if e := r.wantCode(t, domain.EINTERNAL); e.Message != "internal error" {
		t.Errorf("closed database: %q", e.Message)
	}
}

// TestOnPostgres runs a buyer's whole path once on PostgreSQL.
func TestOnPostgres(t *testing.T) {
	t.Parallel()
	b := setup(t, options{kind: dbtest.Postgres})
	id := b.product(t, "9.99", 2)
	o := b.order(t, id, 2, "pg@example.com")
	b.pay(t, o.Order.OrderNo, "T-PG")
	var got struct{ Order order }
	b.do(t, anon, `query($no: String!, $t: String) { order(orderNo: $no, accessToken: $t) { `+orderFields+` } }`,
		map[string]any{"no": o.Order.OrderNo, "t": o.AccessToken}).decode(t, &got)
	if got.Order.Status != "PAID" || got.Order.Amount != "19.98" || !slices.Equal(got.Order.Cards, []string{codeOf(id, 0), codeOf(id, 1)}) {
		t.Errorf("order on PostgreSQL: %+v", got.Order)
	}
	var list struct {
		Orders struct {
			Edges []struct{ Node struct{ Cards []string } }
		}
	}
	b.do(t, admin, `{ orders(filter: {status: PAID}) { edges { node { cards } } } }`, nil).decode(t, &list)
	if len(list.Orders.Edges) != 1 || len(list.Orders.Edges[0].Node.Cards) != 2 {
		t.Errorf("admin list on PostgreSQL: %+v", list)
	}
}

func ptr[T any](v T) *T { return &v }
