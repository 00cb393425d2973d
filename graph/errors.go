package graph

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"

	"github.com/99designs/gqlgen/graphql"
	"github.com/vektah/gqlparser/v2/ast"
	"github.com/vektah/gqlparser/v2/gqlerror"

	"kami/domain"
)

// Codes the API adds to domain's for errors of the request itself.
const (
	codeParseFailed      = "GRAPHQL_PARSE_FAILED"      // the query does not parse
	codeValidationFailed = "GRAPHQL_VALIDATION_FAILED" // unknown field, wrong argument or variable type, ...
	codeTooComplex       = "COMPLEXITY_LIMIT_EXCEEDED" // as gqlgen's FixedComplexityLimit (see complexityLimit)
	codeTooDeep          = "DEPTH_LIMIT_EXCEEDED"
	codeBadRequest       = "BAD_REQUEST"       // not a GraphQL request: bad JSON, bad method, subscription over HTTP
	codeBodyTooLarge     = "PAYLOAD_TOO_LARGE" // the body is over Config.MaxBodyBytes
)

// requestErrorCodes are the codes of errors that stop a request before it
// executes: GraphQL-over-HTTP's request errors, 400 under
// application/graphql-response+json.
var requestErrorCodes = map[string]bool{
	codeParseFailed: true, codeValidationFailed: true, codeTooComplex: true,
	codeTooDeep: true, codeBadRequest: true, codeBodyTooLarge: true,
}

func isRequestError(errs gqlerror.List) bool {
	for _, e := range errs {
		if code, _ := e.Extensions["code"].(string); requestErrorCodes[code] {
			return true
		}
	}
	return false
}

// presenter is the one way out for errors. A domain error shows its code
// and message (written to be shown); gqlgen's own request errors keep
// their code and message (they name only what the query said); anything
// else is INTERNAL "internal error" to the client and logged in full here,
// so no SQL, provider text or stack reaches a client.
func presenter(log *slog.Logger) graphql.ErrorPresenterFunc {
	return func(ctx context.Context, err error) *gqlerror.Error {
		gqlErr := graphql.DefaultErrorPresenter(ctx, err)
		out := &gqlerror.Error{Path: gqlErr.Path, Locations: gqlErr.Locations}
		var de *domain.Error
		if errors.As(err, &de) {
			out.Message = de.Message
			out.Extensions = map[string]any{"code": de.Code}
			return out
		}
		if code, _ := gqlErr.Extensions["code"].(string); code != "" && gqlErr.Err == nil {
			return gqlErr
		}
		log.ErrorContext(ctx, "graphql internal error", "path", gqlErr.Path.String(), "err", err)
		out.Message = "internal error"
		out.Extensions = map[string]any{"code": domain.EINTERNAL}
		return out
	}
}

// recoverer logs a panic with its stack and turns it into an internal
// error for the client.
func recoverer(log *slog.Logger) graphql.RecoverFunc {
	return func(ctx context.Context, v any) error {
		log.ErrorContext(ctx, "graphql resolver panic", "panic", fmt.Sprint(v), "stack", string(debug.Stack()))
		return errors.New("panic in a resolver")
	}
}

// depthLimit refuses operations that nest fields deeper than max.
// Introspection fields (__schema, __type) are not counted, so the
// playground's introspection query works under a small limit; the
// complexity limit still bounds it.
type depthLimit struct{ max int }

var (
	_ graphql.HandlerExtension        = depthLimit{}
	_ graphql.OperationContextMutator = depthLimit{}
)

func (depthLimit) ExtensionName() string                          { return "DepthLimit" }
func (depthLimit) Validate(schema graphql.ExecutableSchema) error { return nil }

func (d depthLimit) MutateOperationContext(ctx context.Context, opCtx *graphql.OperationContext) *gqlerror.Error {
	memo := map[string]int{}
	if depth := selectionDepth(opCtx.Operation.SelectionSet, memo); depth > d.max {
		err := gqlerror.Errorf("the query is nested %d deep; at most %d is allowed", depth, d.max)
		err.Extensions = map[string]any{"code": codeTooDeep}
		return err
	}
	return nil
}

// selectionDepth is the depth of the deepest field under set. Fragments
// are measured once each (memo), so a query that reuses fragments costs
// linear time; validation has already refused fragment cycles.
func selectionDepth(set ast.SelectionSet, memo map[string]int) int {
	deepest := 0
	for _, sel := range set {
		var d int
		switch s := sel.(type) {
		case *ast.Field:
			if len(s.Name) >= 2 && s.Name[:2] == "__" {
				continue
			}
			d = 1 + selectionDepth(s.SelectionSet, memo)
		case *ast.InlineFragment:
			d = selectionDepth(s.SelectionSet, memo)
		case *ast.FragmentSpread:
			cached, ok := memo[s.Name]
			if !ok && s.Definition != nil {
				memo[s.Name] = 0
				cached = selectionDepth(s.Definition.SelectionSet, memo)
				memo[s.Name] = cached
			}
			d = cached
		}
		deepest = max(deepest, d)
	}
	return deepest
}
