package graph

import (
	"context"
	"testing"

	"github.com/99designs/gqlgen/complexity"
	"github.com/vektah/gqlparser/v2"

	"kami/graph/generated"
)

// TestPriceIsGqlgensComplexity: the operation limits price an operation as
// gqlgen's complexity.Calculate does (which they replace because it walks
// every fragment spread again), wherever there is no introspection, which
// gqlgen does not count.
func TestPriceIsGqlgensComplexity(t *testing.T) {
	t.Parallel()
	es := generated.NewExecutableSchema(newSchemaConfig(Config{}.withDefaults()))
	for _, tc := range []struct {
		query string
		vars  map[string]any
	}{
		{`{ products { id name price stock } }`, nil},
		{`{ orders(first: 100) { edges { node { orderNo status amount product { id name } } } } }`, nil},
		{`query($n: Int) { orders(first: $n) { edges { node { orderNo product { id } } } } }`, map[string]any{"n": 7}},
		{`query($n: Int) { orders(first: $n) { edges { cursor } pageInfo { hasNextPage } } }`, map[string]any{"n": 0}},
		{`{ refunds { edges { node { order { product { id } } ...R } } } } fragment R on Refund { refundNo amount }`, nil},
		{`{ a: products { ...P } b: products { ...P ... on Product { name } } } fragment P on Product { id name }`, nil},
		{`{ cards(first: 5) { edges { node { id code product { name } } } } stats { queues { name backlog } } }`, nil},
		{`{ products { ...F0 } } fragment F0 on Product { id ...F1 ...F1 } fragment F1 on Product { id ...F2 ...F2 } fragment F2 on Product { id }`, nil},
		{`mutation($in: CreateOrderInput!) { createOrder(input: $in) { order { orderNo status amount } accessToken payment { kind url } } }`,
			map[string]any{"in": map[string]any{"productId": "1", "quantity": 1, "contact": "c", "provider": "sandbox"}}},
	} {
		doc, errs := gqlparser.LoadQueryWithRules(es.Schema(), tc.query, nil)
		if errs != nil {
			t.Fatalf("%s: %v", tc.query, errs)
		}
		op := doc.Operations[0]
		want := complexity.Calculate(context.Background(), es, op, tc.vars)
		w := &pricer{ctx: context.Background(), es: es, vars: tc.vars, limit: 1 << 30, memo: map[string]price{}, rootMemo: map[string]price{}}
		if got := w.selectionSet(op.SelectionSet, true); got.cost != want {
			t.Errorf("%s: price %d, gqlgen's complexity %d", tc.query, got.cost, want)
		}
	}
}
