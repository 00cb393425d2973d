package graph

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"os"
	"strings"
	"sync"

	"github.com/99designs/gqlgen/graphql"
	"github.com/vektah/gqlparser/v2/ast"
	"github.com/vektah/gqlparser/v2/gqlerror"
)

// The HTTP transports follow the GraphQL-over-HTTP spec where gqlgen's own
// differ: GET refuses a mutation with 405 (gqlgen answers 406), request
// errors are 400 only under application/graphql-response+json (200 under
// application/json), an oversized body is 413 (gqlgen reads the limit error
// as a 200), a body that is not JSON is 400 without echoing it, a
// non-JSON POST is 415, subscriptions need the WebSocket, and a request
// that fails before execution (it does not parse or validate) has no data
// entry at all, not "data": null.

const (
	mediaJSON            = "application/json"
	mediaGraphQLResponse = "application/graphql-response+json"
)

// responseType picks the response media type from Accept; "" when the
// client accepts neither JSON type (406). No Accept, or only a wildcard
// (*/*, application/*), means a legacy client: application/json, which
// every client understands. application/graphql-response+json is for the
// clients that ask for it by name.
func responseType(r *http.Request) string {
	accept := r.Header.Values("Accept")
	if len(accept) == 0 {
		return mediaJSON
	}
	wildcard := false
	for _, value := range accept {
		for part := range strings.SplitSeq(value, ",") {
			mt, err := mediaType(strings.TrimSpace(part))
			if err != nil {
				continue
			}
			switch mt {
			case mediaGraphQLResponse, mediaJSON:
				return mt
			case "*/*", "application/*":
				wildcard = true
			}
		}
	}
	if wildcard {
		return mediaJSON
	}
	return ""
}

// mediaType is the media type of a Content-Type value or an Accept entry,
// as mime.ParseMediaType reads it (parameters aside). The types a
// storefront sends on every request, written as they usually are, are
// known without parsing.
func mediaType(v string) (string, error) {
	switch v {
	case mediaJSON, mediaGraphQLResponse, "*/*":
		return v, nil
	}
	mt, _, err := mime.ParseMediaType(v)
	return mt, err
}

// codeResponseTooLarge replaces a response over Config.MaxResponseBytes.
const codeResponseTooLarge = "RESPONSE_TOO_LARGE"

// writeResponse writes resp with status. Under application/json every
// response to a well-formed request is 200. A response longer than
// maxBytes is not sent: an error says so instead.
func writeResponse(w http.ResponseWriter, mediaType string, status int, resp *graphql.Response, maxBytes int) {
	if resp != nil && len(resp.Errors) == 0 && len(resp.Extensions) == 0 && resp.Label == "" && resp.Path == nil && resp.HasNext == nil &&
		len(resp.Data) > 0 {
		// The usual answer, the bytes json.Marshal would write, without
		// its second pass over the data (gqlgen wrote it compact and
		// valid): only the escapes of <, >, & and U+2028/9 it adds.
		var b bytes.Buffer
		b.Grow(len(resp.Data) + 16)
		b.WriteString(`{"data":`)
		json.HTMLEscape(&b, resp.Data)
		b.WriteByte('}')
		if b.Len() <= maxBytes {
			writeBody(w, mediaType, status, b.Bytes())
			return
		}
	}
	writeJSON(w, mediaType, status, resp, maxBytes)
}

// notExecuted is the response to a request that failed before execution:
// the GraphQL spec leaves the data entry out then (gqlgen's Response would
// write "data": null, which says execution began).
type notExecuted struct {
	Errors     gqlerror.List  `json:"errors"`
	Extensions map[string]any `json:"extensions,omitempty"`
}

// writeNotExecuted writes resp, whose request never executed, without data.
func writeNotExecuted(w http.ResponseWriter, mediaType string, status int, resp *graphql.Response, maxBytes int) {
	writeJSON(w, mediaType, status, notExecuted{Errors: resp.Errors, Extensions: resp.Extensions}, maxBytes)
}

func writeJSON(w http.ResponseWriter, mediaType string, status int, resp any, maxBytes int) {
	b, err := json.Marshal(resp)
	switch {
	case err != nil:
		status = http.StatusInternalServerError
		b = []byte(`{"errors":[{"message":"internal error","extensions":{"code":"INTERNAL"}}]}`)
	case len(b) > maxBytes:
		b, _ = json.Marshal(&graphql.Response{Errors: gqlerror.List{{
			Message:    fmt.Sprintf("the response is larger than %d bytes; ask for fewer fields or a smaller page", maxBytes),
			Extensions: map[string]any{"code": codeResponseTooLarge}}}})
	}
	writeBody(w, mediaType, status, b)
}

// writeBody writes b, a JSON document, with status: under application/json
// every response to a well-formed request is 200.
func writeBody(w http.ResponseWriter, mediaType string, status int, b []byte) {
	if mediaType == "" {
		mediaType = mediaJSON
	}
	if mediaType == mediaJSON && status == http.StatusBadRequest {
		status = http.StatusOK
	}
	w.Header().Set("Content-Type", withCharset(mediaType))
	w.WriteHeader(status)
	w.Write(b)
}

// withCharset is the Content-Type of a JSON answer of media type mt.
func withCharset(mt string) string {
	switch mt {
	case mediaJSON:
		return mediaJSON + "; charset=utf-8"
	case mediaGraphQLResponse:
		return mediaGraphQLResponse + "; charset=utf-8"
	}
	return mt + "; charset=utf-8"
}

// writeError answers a request that never reached GraphQL. Its status
// stands under either media type: the request was not a GraphQL request.
func writeError(w http.ResponseWriter, r *http.Request, status int, code, msg string) {
	mt := responseType(r)
	if mt == "" {
		mt = mediaJSON
	}
	b, _ := json.Marshal(notExecuted{Errors: gqlerror.List{{Message: msg, Extensions: map[string]any{"code": code}}}})
	w.Header().Set("Content-Type", withCharset(mt))
	w.WriteHeader(status)
	w.Write(b)
}

// writeLate answers a request whose body stopped arriving: the server's
// read deadline passed (see bodyDeadline in the server). The connection
// is closed after the answer; nothing of the request was done.
func writeLate(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Connection", "close")
	writeError(w, r, http.StatusRequestTimeout, codeBadRequest, "the request body did not arrive in time; nothing was done")
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

type postTransport struct {
	maxResponse int
	texts       *queryTexts
}

var _ graphql.Transport = postTransport{}

func (postTransport) Supports(r *http.Request) bool {
	return r.Method == http.MethodPost && r.Header.Get("Upgrade") == ""
}

func (t postTransport) Do(w http.ResponseWriter, r *http.Request, exec graphql.GraphExecutor) {
	mt, ok := acceptedType(w, r)
	if !ok {
		return
	}
	if ct, err := mediaType(r.Header.Get("Content-Type")); err != nil || ct != mediaJSON {
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
		if errors.Is(err, os.ErrDeadlineExceeded) {
			writeLate(w, r)
			return
		}
		writeError(w, r, http.StatusBadRequest, codeBadRequest, "the request body could not be read")
		return
	}
	var params graphql.RawParams
	if !t.texts.decode(body, &params) {
		writeError(w, r, http.StatusBadRequest, codeBadRequest, "the body is not a GraphQL request in JSON")
		return
	}
	params.Headers = r.Header
	execute(w, r, exec, &params, mt, t.maxResponse)
}

// decodeParams reads body as one GraphQL request in JSON, numbers as
// json.Number; false when it is not one (or has more after it).
func decodeParams(body []byte, params *graphql.RawParams) bool {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	return dec.Decode(params) == nil && !dec.More()
}

// queryTexts remembers the query texts of recent POST bodies by their JSON
// string literal, as sent (quotes and escapes included), so that the body
// a storefront sends again and again, the same document with new
// variables, is not scanned and unescaped whole every time: its query
// literal, hundreds of bytes of escaped text, is most of the body and of
// what decoding it costs. Only a body that begins with exactly
// {"query":"…", is read this way, and only when that literal was decoded
// before: the text is then known, and the rest of the body, with the comma
// after the literal made the object's opening brace, is decoded into the
// same request as the whole body would have been (a later "query" key
// still wins, as it does in the whole body; an error in the rest is an
// error in the whole). At most queryTextsSize literals of maxCachedQuery
// bytes are kept; when full, the set starts again.
type queryTexts struct {
	mu    sync.RWMutex
	texts map[string]string
}

const queryTextsSize = 100

// queryLead is how a body whose query literal can be remembered begins.
const queryLead = `{"query":"`

// decode is decodeParams, with the query literal of body remembered or
// taken from memory (a nil q remembers nothing). It may change body.
func (q *queryTexts) decode(body []byte, params *graphql.RawParams) bool {
	var lit []byte
	if q != nil {
		lit = queryLiteral(body)
	}
	if lit == nil {
		return decodeParams(body, params)
	}
	end := len(queryLead) - 1 + len(lit)
	q.mu.RLock()
	text, known := q.texts[string(lit)]
	q.mu.RUnlock()
	if known && end < len(body) && body[end] == ',' && keyFollows(body[end+1:]) {
		params.Query = text
		body[end] = '{'
		return decodeParams(body[end:], params)
	}
	if !decodeParams(body, params) {
		return false
	}
	if len(lit) <= maxCachedQuery && json.Unmarshal(lit, &text) == nil {
		q.mu.Lock()
		if q.texts == nil || len(q.texts) >= queryTextsSize {
			q.texts = map[string]string{}
		}
		q.texts[string(lit)] = text
		q.mu.Unlock()
	}
	return true
}

// keyFollows reports whether rest, what follows the comma after the
// query literal, begins (after white space) with a key: "," then "}" is
// no JSON object, but made "{}" it would be one.
func keyFollows(rest []byte) bool {
	rest = bytes.TrimLeft(rest, " \t\r\n")
	return len(rest) > 0 && rest[0] == '"'
}

// queryLiteral is the JSON string literal (quotes included) that body
// begins with after {"query":, or nil. It only finds where the literal
// ends (the first quote not escaped by a backslash); whether it is valid
// JSON is for the decoder to say.
func queryLiteral(body []byte) []byte {
	if !bytes.HasPrefix(body, []byte(queryLead)) {
		return nil
	}
	start := len(queryLead) - 1
	for i := start + 1; i < len(body); i++ {
		switch body[i] {
		case '\\':
			i++
		case '"':
			return body[start : i+1]
		}
	}
	return nil
}

type getTransport struct{ maxResponse int }

var _ graphql.Transport = getTransport{}

func (getTransport) Supports(r *http.Request) bool {
	return r.Method == http.MethodGet && r.Header.Get("Upgrade") == ""
}

func (t getTransport) Do(w http.ResponseWriter, r *http.Request, exec graphql.GraphExecutor) {
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
	execute(w, r, exec, &params, mt, t.maxResponse)
}

// operation parses and validates a request; when it fails, it answers
// (without a data entry: nothing was executed) and returns nil.
func operation(w http.ResponseWriter, r *http.Request, exec graphql.GraphExecutor, params *graphql.RawParams, mt string, maxResponse int) *graphql.OperationContext {
	ctx := r.Context()
	params.ReadTime = graphql.TraceTiming{Start: graphql.Now(), End: graphql.Now()}
	opCtx, errs := exec.CreateOperationContext(ctx, params)
	if errs != nil {
		status := http.StatusOK
		if isRequestError(errs) {
			status = http.StatusBadRequest
		}
		writeNotExecuted(w, mt, status, exec.DispatchError(graphql.WithOperationContext(ctx, opCtx), errs), maxResponse)
		return nil
	}
	return opCtx
}

// execute runs one GraphQL request over HTTP; nothing is executed for a
// client that has left.
func execute(w http.ResponseWriter, r *http.Request, exec graphql.GraphExecutor, params *graphql.RawParams, mt string, maxResponse int) {
	ctx := r.Context()
	opCtx := operation(w, r, exec, params, mt, maxResponse)
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
		writeNotExecuted(w, mt, http.StatusBadRequest, exec.DispatchError(graphql.WithOperationContext(ctx, opCtx), gqlerror.List{err}), maxResponse)
		return
	}
	if ctx.Err() != nil {
		return // the client left while the request was checked
	}
	responses, ctx := exec.DispatchOperation(ctx, opCtx)
	writeResponse(w, mt, http.StatusOK, responses(ctx), maxResponse)
}
