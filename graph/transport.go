package graph

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"mime"
	"net/http"
	"strings"

	"github.com/99designs/gqlgen/graphql"
	"github.com/vektah/gqlparser/v2/ast"
	"github.com/vektah/gqlparser/v2/gqlerror"
)

// The HTTP transports follow the GraphQL-over-HTTP spec where gqlgen's own
// differ: GET refuses a mutation with 405 (gqlgen answers 406), request
// errors are 400 only under application/graphql-response+json (200 under
// application/json), an oversized body is 413 (gqlgen reads the limit error
// as a 200), a body that is not JSON is 400 without echoing it, a
// non-JSON POST is 415, and subscriptions need the WebSocket.

const (
	mediaJSON            = "application/json"
	mediaGraphQLResponse = "application/graphql-response+json"
)

// responseType picks the response media type from Accept; "" when the
// client accepts neither JSON type (406). No Accept means a legacy client:
// application/json.
func responseType(r *http.Request) string {
	accept := r.Header.Values("Accept")
	if len(accept) == 0 {
		return mediaJSON
	}
	for _, part := range strings.Split(strings.Join(accept, ","), ",") {
		mt, _, err := mime.ParseMediaType(strings.TrimSpace(part))
		if err != nil {
			continue
		}
		switch mt {
		case mediaGraphQLResponse, "*/*", "application/*":
			return mediaGraphQLResponse
		case mediaJSON:
			return mediaJSON
		}
	}
	return ""
}

// writeResponse writes resp with status. Under application/json every
// response to a well-formed request is 200.
func writeResponse(w http.ResponseWriter, mediaType string, status int, resp *graphql.Response) {
	if mediaType == "" {
		mediaType = mediaJSON
	}
	if mediaType == mediaJSON && status == http.StatusBadRequest {
		status = http.StatusOK
	}
	b, err := json.Marshal(resp)
	if err != nil {
		status = http.StatusInternalServerError
		b = []byte(`{"errors":[{"message":"internal error","extensions":{"code":"INTERNAL"}}]}`)
	}
	w.Header().Set("Content-Type", mediaType+"; charset=utf-8")
	w.WriteHeader(status)
	w.Write(b)
}

// writeError answers a request that never reached GraphQL. Its status
// stands under either media type: the request was not a GraphQL request.
func writeError(w http.ResponseWriter, r *http.Request, status int, code, msg string) {
	mt := responseType(r)
	if mt == "" {
		mt = mediaJSON
	}
	b, _ := json.Marshal(&graphql.Response{Errors: gqlerror.List{{Message: msg, Extensions: map[string]any{"code": code}}}})
	w.Header().Set("Content-Type", mt+"; charset=utf-8")
	w.WriteHeader(status)
	w.Write(b)
}

// acceptedType is the response media type the client accepts; when it
// accepts neither, it answers 406 and reports false.
func acceptedType(w http.ResponseWriter, r *http.Request) (string, bool) {
	mt := responseType(r)
	if mt == "" {
		writeError(w, r, http.StatusNotAcceptable, codeBadRequest, "accept application/graphql-response+json or application/json")
		return "", false
	}
	return mt, true
}

type postTransport struct{}

var _ graphql.Transport = postTransport{}

func (postTransport) Supports(r *http.Request) bool {
	return r.Method == http.MethodPost && r.Header.Get("Upgrade") == ""
}

func (postTransport) Do(w http.ResponseWriter, r *http.Request, exec graphql.GraphExecutor) {
	mt, ok := acceptedType(w, r)
	if !ok {
		return
	}
	if ct, _, err := mime.ParseMediaType(r.Header.Get("Content-Type")); err != nil || ct != mediaJSON {
		writeError(w, r, http.StatusUnsupportedMediaType, codeBadRequest, "send the request as application/json")
		return
	}
	body, err := io.ReadAll(r.Body)
	if err != nil {
		var tooLarge *http.MaxBytesError
		if errors.As(err, &tooLarge) {
			writeError(w, r, http.StatusRequestEntityTooLarge, codeBodyTooLarge, "the request body is too large")
			return
		}
		writeError(w, r, http.StatusBadRequest, codeBadRequest, "the request body could not be read")
		return
	}
	var params graphql.RawParams
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	if err := dec.Decode(&params); err != nil || dec.More() {
		writeError(w, r, http.StatusBadRequest, codeBadRequest, "the body is not a GraphQL request in JSON")
		return
	}
	params.Headers = r.Header
	execute(w, r, exec, &params, mt)
}

type getTransport struct{}

var _ graphql.Transport = getTransport{}

func (getTransport) Supports(r *http.Request) bool {
	return r.Method == http.MethodGet && r.Header.Get("Upgrade") == ""
}

func (getTransport) Do(w http.ResponseWriter, r *http.Request, exec graphql.GraphExecutor) {
	mt, ok := acceptedType(w, r)
	if !ok {
		return
	}
	q := r.URL.Query()
	params := graphql.RawParams{Query: q.Get("query"), OperationName: q.Get("operationName"), Headers: r.Header}
	for name, dst := range map[string]*map[string]any{"variables": &params.Variables, "extensions": &params.Extensions} {
		if v := q.Get(name); v != "" {
			dec := json.NewDecoder(strings.NewReader(v))
			dec.UseNumber()
			if err := dec.Decode(dst); err != nil {
				writeError(w, r, http.StatusBadRequest, codeBadRequest, name+" is not a JSON object")
				return
			}
		}
	}
	execute(w, r, exec, &params, mt)
}

// operation parses and validates a request; when it fails, it answers
// and returns nil.
func operation(w http.ResponseWriter, r *http.Request, exec graphql.GraphExecutor, params *graphql.RawParams, mt string) *graphql.OperationContext {
	ctx := r.Context()
	params.ReadTime = graphql.TraceTiming{Start: graphql.Now(), End: graphql.Now()}
	opCtx, errs := exec.CreateOperationContext(ctx, params)
	if errs != nil {
		status := http.StatusOK
		if isRequestError(errs) {
			status = http.StatusBadRequest
		}
		writeResponse(w, mt, status, exec.DispatchError(graphql.WithOperationContext(ctx, opCtx), errs))
		return nil
	}
	return opCtx
}

// execute runs one GraphQL request over HTTP.
func execute(w http.ResponseWriter, r *http.Request, exec graphql.GraphExecutor, params *graphql.RawParams, mt string) {
	ctx := r.Context()
	opCtx := operation(w, r, exec, params, mt)
	if opCtx == nil {
		return
	}
	switch op := opCtx.Operation.Operation; {
	case r.Method == http.MethodGet && op != ast.Query:
		w.Header().Set("Allow", "POST")
		writeError(w, r, http.StatusMethodNotAllowed, codeBadRequest, "GET is for queries only; send a "+string(op)+" with POST")
		return
	case op == ast.Subscription:
		err := gqlerror.Errorf("subscriptions need a WebSocket (graphql-transport-ws or graphql-ws) on this path")
		err.Extensions = map[string]any{"code": codeBadRequest}
		writeResponse(w, mt, http.StatusBadRequest, exec.DispatchError(graphql.WithOperationContext(ctx, opCtx), gqlerror.List{err}))
		return
	}
	responses, ctx := exec.DispatchOperation(ctx, opCtx)
	writeResponse(w, mt, http.StatusOK, responses(ctx))
}
