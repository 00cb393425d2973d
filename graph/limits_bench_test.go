package graph

import (
	"context"
	"testing"

	"github.com/99designs/gqlgen/graphql"
	"github.com/vektah/gqlparser/v2"

	"kami/graph/generated"
)

// BenchmarkLimits is the work the request limits add to the storefront's
// two documents, alone: with the document and its price kept (every
// request but a document's first) and without (its first). Compare with
// BenchmarkStorefront, the whole request.
//
//	go test ./graph/ -run '^$' -bench 'Limits|Storefront' -benchtime 2000x
func BenchmarkLimits(b *testing.B) {
	cfg := Config{}.withDefaults()
	w := &work{}
	es := countedSchema{ExecutableSchema: generated.NewExecutableSchema(newSchemaConfig(cfg)), asked: &w.priced}
	known := knownOperations(es.Schema())
	for _, doc := range []struct {
		name, query string
		vars        map[string]any
	}{
		{"createOrder", `mutation CreateOrder($in: CreateOrderInput!) { createOrder(input: $in) {
			order { orderNo status amount expiresAt } accessToken payment { kind url expiresAt } } }`,
			map[string]any{"in": map[string]any{"productId": "1", "quantity": 1, "contact": "c", "provider": "sandbox"}}},
		{"order", `query Order($no: String!, $t: String) { order(orderNo: $no, accessToken: $t) {
			orderNo status amount quantity expiresAt paidAt cards product { name price } } }`,
			map[string]any{"no": "26120100000000000001", "t": "token"}},
	} {
		parsed, errs := gqlparser.LoadQueryWithRules(es.Schema(), doc.query, nil)
		if errs != nil {
			b.Fatal(errs)
		}
		opCtx := &graphql.OperationContext{RawQuery: doc.query, Doc: parsed, Operation: parsed.Operations[0],
			OperationName: parsed.Operations[0].Name, Variables: doc.vars}
		check := func(b *testing.B, dl documentLimits, ol *operationLimits) {
			ctx := context.Background()
			if err := dl.MutateOperationParameters(ctx, &graphql.RawParams{Query: doc.query}); err != nil {
				b.Fatal(err)
			}
			if err := ol.MutateOperationContext(ctx, opCtx); err != nil {
				b.Fatal(err)
			}
			if operationName(opCtx, known) == "other" {
				b.Fatal("a storefront operation named other")
			}
		}
		newLimits := func() (documentLimits, *operationLimits) {
			dl := documentLimits{maxTokens: cfg.MaxTokens, maxFields: cfg.MaxFields, maxAliases: cfg.MaxAliases, cache: newQueryCache(), work: w}
			ol := newOperationLimits(cfg.MaxComplexity, cfg.MaxDepth, true, w)
			ol.Validate(es)
			return dl, ol
		}
		b.Run(doc.name+"/kept", func(b *testing.B) {
			dl, ol := newLimits()
			dl.cache.Add(context.Background(), doc.query, parsed)
			b.ReportAllocs()
			for range b.N {
				check(b, dl, ol)
			}
		})
		b.Run(doc.name+"/first", func(b *testing.B) {
			dl, ol := newLimits() // nothing kept: lexed, parsed, counted and priced each time
			b.ReportAllocs()
			for range b.N {
				ol.fixed.Purge()
				check(b, dl, ol)
			}
		})
	}
}
