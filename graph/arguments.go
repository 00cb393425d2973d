package graph

import (
	"context"
	"strings"
	"unicode/utf8"

	"github.com/99designs/gqlgen/graphql"

	"kami/domain"
)

// refuseUnstorableText is a field middleware: a field whose arguments hold
// a string with a NUL character or invalid UTF-8, anywhere (an order
// number, a token, a filter, a field of an input object), is answered
// BAD_INPUT without running. No such string is anything kami stored
// (PostgreSQL refuses both outright), and passed on, the database's
// refusal would reach the client as an internal error. The value is not
// echoed. Finer rules for what a buyer may send into an order live in the
// domain (PlaceOrderInput's checks).
func refuseUnstorableText(ctx context.Context, next graphql.Resolver) (any, error) {
	fc := graphql.GetFieldContext(ctx)
	if fc == nil || len(fc.Field.Arguments) == 0 || !graphql.HasOperationContext(ctx) {
		return next(ctx)
	}
	vars := graphql.GetOperationContext(ctx).Variables
	for _, arg := range fc.Field.Arguments {
		// The arguments as written (a variable's value, or a literal and
		// the variables within it), without building the field's argument
		// map: the schema's defaults are kami's own text. A literal that
		// cannot be read fails the field's own argument parsing.
		v, err := arg.Value.Value(vars)
		if err == nil && !storableText(v) {
			return nil, domain.Errorf(domain.EBADINPUT, "%s must be UTF-8 text without NUL characters", arg.Name)
		}
	}
	return next(ctx)
}

// storableText reports whether every string in v (an argument's value:
// scalars, lists and input objects) is valid UTF-8 without NUL.
func storableText(v any) bool {
	switch v := v.(type) {
	case string:
		return utf8.ValidString(v) && !strings.ContainsRune(v, 0)
	case []any:
		for _, e := range v {
			if !storableText(e) {
				return false
			}
		}
	case map[string]any:
		for _, e := range v {
			if !storableText(e) {
				return false
			}
		}
	}
	return true
}
