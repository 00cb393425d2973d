package graph

import (
	"context"

	"github.com/99designs/gqlgen/graphql"
	"github.com/99designs/gqlgen/graphql/errcode"
	"github.com/99designs/gqlgen/graphql/handler/extension"
	lru "github.com/hashicorp/golang-lru/v2"
	"github.com/vektah/gqlparser/v2/gqlerror"
)

// Automatic persisted queries: a storefront sends a document's SHA-256
// (extensions.persistedQuery.sha256Hash) instead of its text; the first
// time, or once kami has forgotten it, kami answers
// PERSISTED_QUERY_NOT_FOUND and the client sends the text with the hash,
// which kami keeps. gqlgen's extension does the protocol; kami keeps the
// texts in a bounded cache (persistedTexts) and gives its errors codes.
//
// The text a hash stands for is put back on the request before anything
// else reads it, so it passes every limit of limits.go exactly as if it
// had been sent: documentLimits, validation (both skipped for a document
// already validated) and operationLimits with this request's variables.

// codePersistedQueryNotFound asks the client to send the query's text
// with its hash (the code Apollo's and gqlgen's clients look for).
const codePersistedQueryNotFound = "PERSISTED_QUERY_NOT_FOUND"

// persistedTexts keeps query texts by their SHA-256, the short ones only
// (as queryCache): at most queryCacheSize texts of maxCachedQuery bytes.
type persistedTexts struct {
	texts *lru.Cache[string, string]
}

var _ graphql.Cache[string] = persistedTexts{}

func newPersistedTexts() persistedTexts {
	texts, err := lru.New[string, string](queryCacheSize)
	if err != nil {
		panic(err) // only for a size below 1
	}
	return persistedTexts{texts: texts}
}

func (c persistedTexts) Get(_ context.Context, hash string) (string, bool) {
	return c.texts.Get(hash)
}

func (c persistedTexts) Add(_ context.Context, hash, query string) {
	if len(query) <= maxCachedQuery {
		c.texts.Add(hash, query)
	}
}

// persistedQueries is gqlgen's AutomaticPersistedQuery with a code on each
// of its errors: PERSISTED_QUERY_NOT_FOUND for an unknown hash, BAD_REQUEST
// for a malformed extension or a hash that is not the text's.
type persistedQueries struct {
	extension.AutomaticPersistedQuery
}

var _ graphql.OperationParameterMutator = persistedQueries{}

func (p persistedQueries) MutateOperationParameters(ctx context.Context, params *graphql.RawParams) *gqlerror.Error {
	err := p.AutomaticPersistedQuery.MutateOperationParameters(ctx, params)
	if err == nil {
		return nil
	}
	if code, _ := err.Extensions["code"].(string); code == "" {
		errcode.Set(err, codeBadRequest)
	}
	return err
}
