package graph

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"

	"github.com/99designs/gqlgen/graphql"
	"github.com/vektah/gqlparser/v2/gqlerror"

	"kami/domain"
)

// Codes the API adds to domain's for errors of the request itself.
const (
	codeParseFailed      = "GRAPHQL_PARSE_FAILED"      // the query does not parse
	codeValidationFailed = "GRAPHQL_VALIDATION_FAILED" // unknown field, wrong argument or variable type, ...
	codeTooComplex       = "COMPLEXITY_LIMIT_EXCEEDED" // as gqlgen's FixedComplexityLimit (see operationLimits)
	codeTooDeep          = "DEPTH_LIMIT_EXCEEDED"
	codeBadRequest       = "BAD_REQUEST"       // not a GraphQL request: bad JSON, bad method, subscription over HTTP
	codeBodyTooLarge     = "PAYLOAD_TOO_LARGE" // the body is over Config.MaxBodyBytes
)

// requestErrorCodes are the codes of errors that stop a request before it
// executes: GraphQL-over-HTTP's request errors, 400 under
// application/graphql-response+json.
var requestErrorCodes = map[string]bool{
	codeParseFailed: true, codeValidationFailed: true, codeTooComplex: true,
	codeTooDeep: true, codeBadRequest: true, codeBodyTooLarge: true, codeTooLarge: true,
	codePersistedQueryNotFound: true,
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
// so no SQL, provider text or stack reaches a client; once the request's
// context has ended (the client left), it is UNAVAILABLE and not an error.
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
		if ctx.Err() != nil {
			// The request's own context ended: the client left (a closed
			// connection or WebSocket) or the server is stopping, and the
			// work in flight failed with it. Nobody reads this answer, and
			// it is no fault of kami's: anyone could fill the error log,
			// and the alerts read from it, by hanging up.
			log.DebugContext(ctx, "graphql request ended before its work", "path", gqlErr.Path.String(), "err", err)
			out.Message = "the request ended before it was done"
			out.Extensions = map[string]any{"code": domain.EUNAVAILABLE}
			return out
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
