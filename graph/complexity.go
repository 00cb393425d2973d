package graph

import (
	"context"

	"github.com/99designs/gqlgen/complexity"
	"github.com/99designs/gqlgen/graphql"
	"github.com/99designs/gqlgen/graphql/errcode"
	lru "github.com/hashicorp/golang-lru/v2"
	"github.com/vektah/gqlparser/v2/ast"
	"github.com/vektah/gqlparser/v2/gqlerror"
)

// complexityLimit refuses operations whose complexity is above max, with
// the error of gqlgen's FixedComplexityLimit. gqlgen prices the operation
// on every request; here an operation's price is kept with its parsed
// document (which the query cache keeps too) when it cannot depend on the
// variables: when no field on the way has a complexity function of its own
// (see newSchemaConfig: the lists, priced by their page size). Every other
// field costs what its selection costs, whatever its arguments, so a
// createOrder costs the same for every buyer.
type complexityLimit struct {
	max int
	es  graphql.ExecutableSchema
	// fixed holds the price of operations that do not depend on their
	// variables, by parsed operation.
	fixed *lru.Cache[*ast.OperationDefinition, int]
}

var (
	_ graphql.HandlerExtension        = (*complexityLimit)(nil)
	_ graphql.OperationContextMutator = (*complexityLimit)(nil)
)

func newComplexityLimit(max int) *complexityLimit {
	fixed, err := lru.New[*ast.OperationDefinition, int](1000) // as many as the query cache holds
	if err != nil {
		panic(err) // only for a size below 1
	}
	return &complexityLimit{max: max, fixed: fixed}
}

func (*complexityLimit) ExtensionName() string { return "ComplexityLimit" }

func (c *complexityLimit) Validate(es graphql.ExecutableSchema) error {
	c.es = es
	return nil
}

func (c *complexityLimit) MutateOperationContext(ctx context.Context, opCtx *graphql.OperationContext) *gqlerror.Error {
	price, ok := c.fixed.Get(opCtx.Operation)
	if !ok {
		probe := &complexityProbe{ExecutableSchema: c.es}
		price = complexity.Calculate(ctx, probe, opCtx.Operation, opCtx.Variables)
		if !probe.priced {
			c.fixed.Add(opCtx.Operation, price)
		}
	}
	if price > c.max {
		err := gqlerror.Errorf("operation has complexity %d, which exceeds the limit of %d", price, c.max)
		errcode.Set(err, codeTooComplex)
		return err
	}
	return nil
}

// complexityProbe notes whether a calculation met a field with a
// complexity function of its own, whose result may depend on arguments.
type complexityProbe struct {
	graphql.ExecutableSchema
	priced bool
}

func (p *complexityProbe) Complexity(ctx context.Context, typeName, field string, child int, args map[string]any) (int, bool) {
	n, ok := p.ExecutableSchema.Complexity(ctx, typeName, field, child, args)
	if ok {
		p.priced = true
	} else if len(args) > 0 {
		// false also means that the arguments could not be read; with
		// none to read, the answer says whether the field has a function.
		if _, own := p.ExecutableSchema.Complexity(ctx, typeName, field, child, nil); own {
			p.priced = true
		}
	}
	return n, ok
}
