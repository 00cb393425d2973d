package graph

import (
	"context"
	"sync/atomic"

	"github.com/99designs/gqlgen/graphql"
	"github.com/99designs/gqlgen/graphql/errcode"
	lru "github.com/hashicorp/golang-lru/v2"
	"github.com/vektah/gqlparser/v2/ast"
	"github.com/vektah/gqlparser/v2/gqlerror"
	"github.com/vektah/gqlparser/v2/lexer"
	"github.com/vektah/gqlparser/v2/parser"
)

// A GraphQL request is priced in three steps, each bounded by the one
// before, so that no document costs more work than its size allows:
//
//  1. documentLimits, before gqlgen parses and validates a document it has
//     not seen: at most MaxTokens tokens (counted by the lexer, which stops
//     at the limit), then at most MaxFields fields, MaxAliases aliases and
//     maxSameName fields of one response name in one selection set.
//     gqlparser's validation compares the fields of one response name pair
//     by pair (OverlappingFieldsCanBeMerged), so 16,000 copies of one field
//     cost it 19 s; within these limits it costs a few milliseconds.
//  2. gqlgen's validation, of documents that passed; valid documents are
//     kept (queryCache) and not parsed or validated again.
//  3. operationLimits, on the validated operation: its price (gqlgen's
//     complexity, introspection included), its depth, and the root fields
//     that may appear once. Each fragment is priced once however often it
//     is spread (a fragment spreading the next twice, 26 deep, made
//     gqlgen's own walk visit 2^26 fields), and the walk stops once past
//     the limit.
//
// work counts what each step did, for the tests that prove it bounded.

// Limits on the document itself (see documentLimits).
const (
	defaultMaxTokens  = 2000 // the playground's introspection query has 180
	defaultMaxFields  = 200  // it has 69
	defaultMaxAliases = 30
	// maxSameName bounds the fields of one response name in one selection
	// set: the pairs validation compares grow with its square.
	maxSameName = 10
	// maxIntrospectionDepth is the depth allowed under __schema and
	// __type: the standard introspection query reaches 15 (nine ofType).
	maxIntrospectionDepth = 15
	// maxCachedQuery is the longest query text kept parsed; longer ones
	// are parsed and validated each time (storefront documents are a few
	// hundred bytes), so the cache's memory stays bounded.
	maxCachedQuery = 4 << 10
	queryCacheSize = 500
)

// codeTooLarge refuses a document over the limits of documentLimits.
const codeTooLarge = "QUERY_TOO_LARGE"

// work counts the work done on documents, for tests.
type work struct {
	parsed    atomic.Int64 // documents documentLimits parsed
	validated atomic.Int64 // documents gqlgen validated
	priced    atomic.Int64 // fields whose complexity was asked (countedSchema)
}

// countedSchema counts the fields priced, whichever walk prices them: one
// question to the schema per field visited.
type countedSchema struct {
	graphql.ExecutableSchema
	asked *atomic.Int64
}

func (s countedSchema) Complexity(ctx context.Context, typeName, field string, child int, args map[string]any) (int, bool) {
	s.asked.Add(1)
	return s.ExecutableSchema.Complexity(ctx, typeName, field, child, args)
}

// queryCache keeps validated documents by their text, the short ones only.
type queryCache struct {
	docs *lru.Cache[string, *ast.QueryDocument]
}

var _ graphql.Cache[*ast.QueryDocument] = queryCache{}

func newQueryCache() queryCache {
	docs, err := lru.New[string, *ast.QueryDocument](queryCacheSize)
	if err != nil {
		panic(err) // only for a size below 1
	}
	return queryCache{docs: docs}
}

func (c queryCache) Get(_ context.Context, query string) (*ast.QueryDocument, bool) {
	return c.docs.Get(query)
}

func (c queryCache) Add(_ context.Context, query string, doc *ast.QueryDocument) {
	if len(query) <= maxCachedQuery {
		c.docs.Add(query, doc)
	}
}

func (c queryCache) has(query string) bool { return c.docs.Contains(query) }

// documentLimits refuses, before gqlgen parses and validates it, a
// document too large to validate cheaply; a document gqlgen has validated
// before passes at once. Its parse error, if it has one, is answered here
// too, so the document is not parsed twice.
type documentLimits struct {
	maxTokens, maxFields, maxAliases int
	cache                            queryCache
	work                             *work
}

var (
	_ graphql.HandlerExtension          = documentLimits{}
	_ graphql.OperationParameterMutator = documentLimits{}
)

func (documentLimits) ExtensionName() string                   { return "DocumentLimits" }
func (documentLimits) Validate(graphql.ExecutableSchema) error { return nil }

func (l documentLimits) MutateOperationParameters(ctx context.Context, p *graphql.RawParams) *gqlerror.Error {
	if ctx.Err() != nil {
		return clientGone()
	}
	if l.cache.has(p.Query) {
		return nil
	}
	l.work.parsed.Add(1)
	src := &ast.Source{Input: p.Query}
	lex := lexer.New(src)
	for n := 0; ; n++ {
		tok, err := lex.ReadToken()
		if err != nil || tok.Kind == lexer.EOF {
			break // a lexing error is the parser's to report
		}
		if n == l.maxTokens {
			return tooLarge("the query has more than %d tokens", l.maxTokens)
		}
	}
	doc, err := parser.ParseQueryWithTokenLimit(src, l.maxTokens)
	if err != nil {
		gqlErr, ok := err.(*gqlerror.Error)
		if !ok {
			gqlErr = gqlerror.Errorf("the query does not parse")
		}
		errcode.Set(gqlErr, errcode.ParseFailed)
		return gqlErr
	}
	var c docCount
	for _, op := range doc.Operations {
		c.selectionSet(op.SelectionSet)
	}
	for _, f := range doc.Fragments {
		c.selectionSet(f.SelectionSet)
	}
	switch {
	case c.fields > l.maxFields:
		return tooLarge("the query has %d fields; at most %d are allowed", c.fields, l.maxFields)
	case c.aliases > l.maxAliases:
		return tooLarge("the query has %d aliases; at most %d are allowed", c.aliases, l.maxAliases)
	case c.sameName > maxSameName:
		return tooLarge("a selection asks for one field %d times; at most %d are allowed", c.sameName, maxSameName)
	}
	return nil
}

// docCount counts a document as written: every field once, fragments
// where they are defined.
type docCount struct {
	fields, aliases, sameName int
}

func (c *docCount) selectionSet(set ast.SelectionSet) {
	names := map[string]int{}
	for _, sel := range set {
		switch s := sel.(type) {
		case *ast.Field:
			c.fields++
			if s.Alias != s.Name {
				c.aliases++
			}
			names[s.Alias]++
			c.sameName = max(c.sameName, names[s.Alias])
			c.selectionSet(s.SelectionSet)
		case *ast.InlineFragment:
			c.selectionSet(s.SelectionSet)
		}
	}
}

func tooLarge(format string, args ...any) *gqlerror.Error {
	err := gqlerror.Errorf(format, args...)
	errcode.Set(err, codeTooLarge)
	return err
}

// clientGone answers a request whose client left before it was read; the
// answer goes nowhere, the point is that nothing more is done.
func clientGone() *gqlerror.Error {
	err := gqlerror.Errorf("the request was cancelled")
	errcode.Set(err, codeBadRequest)
	return err
}

// operationLimits refuses an operation that costs more than maxCost
// (gqlgen's complexity), nests deeper than maxDepth (maxIntrospectionDepth
// under __schema and __type), introspects while introspection is off or
// more than once, or places more than one order.
//
// An operation's price is kept with its parsed operation (which the query
// cache keeps too) when it cannot depend on the variables: when no field
// on the way has a complexity function of its own (see newSchemaConfig:
// the lists, priced by their page size).
type operationLimits struct {
	maxCost, maxDepth int
	introspection     bool
	work              *work
	es                graphql.ExecutableSchema
	// fixed holds the prices that do not depend on variables.
	fixed *lru.Cache[*ast.OperationDefinition, price]
}

var (
	_ graphql.HandlerExtension        = (*operationLimits)(nil)
	_ graphql.OperationContextMutator = (*operationLimits)(nil)
)

func newOperationLimits(maxCost, maxDepth int, introspection bool, w *work) *operationLimits {
	fixed, err := lru.New[*ast.OperationDefinition, price](queryCacheSize)
	if err != nil {
		panic(err)
	}
	return &operationLimits{maxCost: maxCost, maxDepth: maxDepth, introspection: introspection, work: w, fixed: fixed}
}

func (*operationLimits) ExtensionName() string { return "OperationLimits" }

func (l *operationLimits) Validate(es graphql.ExecutableSchema) error {
	l.es = es
	return nil
}

func (l *operationLimits) MutateOperationContext(ctx context.Context, opCtx *graphql.OperationContext) *gqlerror.Error {
	pr, ok := l.fixed.Get(opCtx.Operation)
	if !ok {
		w := &pricer{ctx: ctx, es: l.es, vars: opCtx.Variables, limit: l.maxCost,
			memo: map[string]price{}, rootMemo: map[string]price{}}
		pr = w.selectionSet(opCtx.Operation.SelectionSet, true)
		if w.gone {
			return clientGone()
		}
		if !w.variable && len(opCtx.RawQuery) <= maxCachedQuery {
			// Kept only beside a kept document: a price would otherwise
			// keep a long document alive.
			l.fixed.Add(opCtx.Operation, pr)
		}
	}
	refuse := func(code, format string, args ...any) *gqlerror.Error {
		err := gqlerror.Errorf(format, args...)
		errcode.Set(err, code)
		return err
	}
	switch {
	case pr.introRoots > 0 && !l.introspection:
		return refuse(codeValidationFailed, "introspection is turned off on this server")
	case pr.introRoots > 1:
		return refuse(codeValidationFailed, "an operation may ask for __schema or __type once")
	case pr.orders > 1:
		return refuse(codeValidationFailed, "a request may place one order: send each createOrder as a request of its own")
	case pr.depth > l.maxDepth:
		return refuse(codeTooDeep, "the query is nested %d deep; at most %d is allowed", pr.depth, l.maxDepth)
	case pr.introDepth > maxIntrospectionDepth:
		return refuse(codeTooDeep, "the introspection is nested %d deep; at most %d is allowed", pr.introDepth, maxIntrospectionDepth)
	case pr.cost > l.maxCost:
		if pr.stopped {
			return refuse(codeTooComplex, "operation has a complexity over %d, which exceeds the limit of %d", l.maxCost, l.maxCost)
		}
		return refuse(codeTooComplex, "operation has complexity %d, which exceeds the limit of %d", pr.cost, l.maxCost)
	}
	return nil
}

// price is what a selection set costs.
type price struct {
	cost  int // gqlgen's complexity: a field costs 1 + what it selects, or what its own complexity function says
	depth int // the deepest field path, introspection aside (root only)
	// introDepth is the deepest path under __schema or __type; introRoots
	// counts those fields and orders the createOrder fields (root only).
	introDepth, introRoots, orders int
	stopped                        bool // the walk stopped once cost passed the limit
}

// pricer walks one operation. Fragments are priced once each (memo, and
// rootMemo for those spread at the root, where their fields are counted
// by name), so the walk visits each selection of the document once.
type pricer struct {
	ctx            context.Context
	es             graphql.ExecutableSchema
	vars           map[string]any
	limit          int
	memo, rootMemo map[string]price
	steps          int
	variable       bool // a complexity function was asked: the price depends on the variables
	gone           bool // the client left; the walk stopped
}

// selectionSet prices a selection set. At the root its fields are sorted
// into introspection and the rest, and the ones allowed once are counted.
func (w *pricer) selectionSet(set ast.SelectionSet, root bool) price {
	var p price
	for _, sel := range set {
		if w.stop(&p) {
			break
		}
		var q price
		switch s := sel.(type) {
		case *ast.Field:
			cost, depth := w.field(s)
			q.cost = cost
			switch {
			case root && (s.Name == "__schema" || s.Name == "__type"):
				q.introDepth, q.introRoots = depth, 1
			case root && s.Name == "createOrder":
				q.depth, q.orders = depth, 1
			default:
				q.depth = depth
			}
		case *ast.InlineFragment:
			q = w.selectionSet(s.SelectionSet, root)
		case *ast.FragmentSpread:
			q = w.fragment(s, root)
		}
		p = p.add(q)
	}
	return p
}

func (w *pricer) fragment(s *ast.FragmentSpread, root bool) price {
	memo := w.memo
	if root {
		memo = w.rootMemo
	}
	if p, ok := memo[s.Name]; ok {
		return p
	}
	if s.Definition == nil {
		return price{}
	}
	memo[s.Name] = price{} // validation refused cycles; this only guards the walk
	p := w.selectionSet(s.Definition.SelectionSet, root)
	memo[s.Name] = p
	return p
}

// field prices one field as gqlgen's complexity.Calculate does, and
// measures its depth.
func (w *pricer) field(s *ast.Field) (cost, depth int) {
	var child price
	if len(s.SelectionSet) > 0 {
		child = w.selectionSet(s.SelectionSet, false)
	}
	cost = satAdd(1, child.cost)
	if s.ObjectDefinition != nil {
		var args map[string]any
		if s.Definition != nil && len(s.Definition.Arguments) > 0 { // given or defaulted
			args = s.ArgumentMap(w.vars)
		}
		if own, ok := w.es.Complexity(w.ctx, s.ObjectDefinition.Name, s.Name, child.cost, args); ok {
			w.variable = true
			if own >= 1 {
				cost = own
			}
		} else if args != nil {
			// false also means that the arguments could not be read; with
			// none to read, the answer says whether the field has a function.
			if _, has := w.es.Complexity(w.ctx, s.ObjectDefinition.Name, s.Name, child.cost, nil); has {
				w.variable = true
			}
		}
	}
	return cost, 1 + max(child.depth, child.introDepth)
}

// stop ends the walk once p is past the limit (marking it stopped) or the
// client has left.
func (w *pricer) stop(p *price) bool {
	if w.steps++; w.steps%256 == 0 && w.ctx.Err() != nil {
		w.gone = true
	}
	if p.cost > w.limit {
		p.stopped = true
	}
	return w.gone || p.stopped
}

func (p price) add(q price) price {
	return price{
		cost:       satAdd(p.cost, q.cost),
		depth:      max(p.depth, q.depth),
		introDepth: max(p.introDepth, q.introDepth),
		introRoots: p.introRoots + q.introRoots,
		orders:     p.orders + q.orders,
		stopped:    p.stopped || q.stopped,
	}
}

// satAdd adds two costs without overflowing.
func satAdd(a, b int) int {
	if c := a + b; c >= a {
		return c
	}
	return int(^uint(0) >> 1)
}
