package graph

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"os"
	"strconv"
	"strings"

	"github.com/99designs/gqlgen/graphql"
	"github.com/vektah/gqlparser/v2/ast"
	"github.com/vektah/gqlparser/v2/gqlerror"

	"kami/domain"
)

// File uploads (importCardFile) follow the graphql-multipart-request-spec,
// streamed: the parts must come in the spec's order, operations, then
// map, then the one file, and the file part is handed to the resolver as
// it arrives. Nothing is spooled to memory or disk, so an upload's memory
// does not grow with its size. gqlgen's own MultipartForm transport reads
// every part before it executes, so it is not used.
//
// Only admins upload, and that is checked before any of the body is read:
// a stranger's 2 GB costs kami nothing. The body's limit is
// Config.MaxUploadBytes (KAMI_MAX_UPLOAD_BYTES), checked against
// Content-Length before reading and enforced while reading; JSON requests
// keep Config.MaxBodyBytes. Cross-site forms cannot upload: a browser
// sends no Authorization header with them, and the admin token travels
// only there.

const mediaMultipart = "multipart/form-data"

func isUpload(r *http.Request) bool {
	mt, err := mediaType(r.Header.Get("Content-Type"))
	return err == nil && mt == mediaMultipart && r.Method == http.MethodPost && r.Header.Get("Upgrade") == ""
}

// RollingBody is a request body whose read deadline can be made to move
// on while the body keeps arriving (the server's bodyDeadline wraps every
// body in one). Only the upload transport turns it on, and only for an
// admin: a file import is read for as long as it is imported, and every
// other body, whoever sends it, keeps its one deadline.
type RollingBody interface {
	RollDeadline()
}

func keepReadingBody(ctx context.Context) {
	if b := callerOf(ctx).body; b != nil {
		b.RollDeadline()
	}
}

type uploadTransport struct {
	maxUpload int64 // the whole body
	maxParts  int64 // the operations and map parts each
	// maxResponse caps the answer, as for JSON requests.
	maxResponse int
}

var _ graphql.Transport = uploadTransport{}

func (uploadTransport) Supports(r *http.Request) bool { return isUpload(r) }

func (t uploadTransport) Do(w http.ResponseWriter, r *http.Request, exec graphql.GraphExecutor) {
	mt, ok := acceptedType(w, r)
	if !ok {
		return
	}
	if err := requireAdmin(r.Context()); err != nil {
		writeError(w, r, http.StatusUnauthorized, domain.EUNAUTH, domain.ErrorMessage(err))
		return
	}
	if r.ContentLength > t.maxUpload {
		writeError(w, r, http.StatusRequestEntityTooLarge, codeBodyTooLarge, t.tooLarge())
		return
	}
	keepReadingBody(r.Context())
	body := &limitWatch{r: r.Body}
	r.Body = body
	params, err := t.readOperation(r)
	if err != nil {
		status, code, msg := http.StatusBadRequest, codeBadRequest, err.Error()
		switch {
		case body.hitLimit():
			status, code = http.StatusRequestEntityTooLarge, codeBodyTooLarge
		case body.late:
			writeLate(w, r)
			return
		}
		writeError(w, r, status, code, msg)
		return
	}
	ctx := r.Context()
	opCtx := operation(w, r, exec, params, mt, t.maxResponse)
	if opCtx == nil {
		return
	}
	if opCtx.Operation.Operation != ast.Mutation {
		err := gqlerror.Errorf("a file upload is a mutation; send queries as application/json")
		err.Extensions = map[string]any{"code": codeBadRequest}
		writeNotExecuted(w, mt, http.StatusBadRequest, exec.DispatchError(graphql.WithOperationContext(ctx, opCtx), gqlerror.List{err}), t.maxResponse)
		return
	}
	responses, ctx := exec.DispatchOperation(ctx, opCtx)
	resp := responses(ctx)
	switch {
	case body.hitLimit():
		// The file ran past the limit while it was read (no Content-Length
		// to refuse it by): the import rolled back; say so plainly.
		writeError(w, r, http.StatusRequestEntityTooLarge, codeBodyTooLarge, t.tooLarge())
		return
	case body.late:
		// The upload stalled past the body deadline (see bodyDeadline in
		// the server): the import rolled back. A slow body, as for JSON.
		writeLate(w, r)
		return
	}
	writeResponse(w, mt, http.StatusOK, resp, t.maxResponse)
}

func (t uploadTransport) tooLarge() string {
	return fmt.Sprintf("the upload is larger than %d bytes (KAMI_MAX_UPLOAD_BYTES)", t.maxUpload)
}

// readOperation reads the operations and map parts and puts the file part,
// unread, into the variables where the map says.
func (t uploadTransport) readOperation(r *http.Request) (*graphql.RawParams, error) {
	mr, err := r.MultipartReader()
	if err != nil {
		return nil, errors.New("the body is not multipart/form-data with a boundary")
	}
	var params graphql.RawParams
	if err := t.readJSONPart(mr, "operations", &params); err != nil {
		return nil, err
	}
	var files map[string][]string
	if err := t.readJSONPart(mr, "map", &files); err != nil {
		return nil, err
	}
	if len(files) != 1 {
		return nil, errors.New("send exactly one file per request (the map names one part)")
	}
	var key string
	var paths []string
	for k, ps := range files {
		key, paths = k, ps
	}
	if len(paths) != 1 {
		return nil, fmt.Errorf("the map must give file %q exactly one variable path", key)
	}
	part, err := mr.NextPart()
	if err != nil {
		return nil, fmt.Errorf("the file part %q is missing: %v", key, err)
	}
	if part.FormName() != key {
		return nil, fmt.Errorf("the part after map must be the file %q", key)
	}
	upload := graphql.Upload{File: uploadStream{part}, Filename: part.FileName(), ContentType: part.Header.Get("Content-Type"), Size: -1}
	if err := setVariable(params.Variables, paths[0], upload); err != nil {
		return nil, err
	}
	params.Headers = r.Header
	return &params, nil
}

// readJSONPart reads the next part, which must be named name, as JSON.
func (t uploadTransport) readJSONPart(mr *multipart.Reader, name string, dst any) error {
	part, err := mr.NextPart()
	if err != nil || part.FormName() != name {
		return fmt.Errorf("the parts must come in order: operations, map, then the file; expected %q", name)
	}
	raw, err := io.ReadAll(io.LimitReader(part, t.maxParts+1))
	if err != nil {
		return fmt.Errorf("the %s part could not be read", name)
	}
	if int64(len(raw)) > t.maxParts {
		return fmt.Errorf("the %s part is larger than %d bytes", name, t.maxParts)
	}
	dec := json.NewDecoder(strings.NewReader(string(raw)))
	dec.UseNumber()
	if err := dec.Decode(dst); err != nil || dec.More() {
		return fmt.Errorf("the %s part is not a JSON object (one operation per upload)", name)
	}
	return nil
}

// setVariable puts v at a map path like "variables.input.file" or
// "variables.files.0".
func setVariable(vars map[string]any, path string, v any) error {
	parts := strings.Split(path, ".")
	if len(parts) < 2 || parts[0] != "variables" || vars == nil {
		return fmt.Errorf("the map path %q does not name a variable", path)
	}
	var cur any = vars
	for i, p := range parts[1:] {
		last := i == len(parts)-2
		switch c := cur.(type) {
		case map[string]any:
			if last {
				c[p] = v
				return nil
			}
			cur = c[p]
		case []any:
			n, err := strconv.Atoi(p)
			if err != nil || n < 0 || n >= len(c) {
				return fmt.Errorf("the map path %q does not name a variable", path)
			}
			if last {
				c[n] = v
				return nil
			}
			cur = c[n]
		default:
			return fmt.Errorf("the map path %q does not name a variable", path)
		}
	}
	return nil
}

// uploadStream is a file part as graphql.Upload wants it. It cannot seek:
// the file is read once, as it arrives.
type uploadStream struct{ io.Reader }

func (uploadStream) Seek(int64, int) (int64, error) {
	return 0, errors.New("an upload is streamed and cannot seek")
}

// limitWatch remembers whether the body ran into its limit
// (http.MaxBytesReader's error) or its read deadline (late), whoever read
// it.
type limitWatch struct {
	r         io.ReadCloser
	hit, late bool
}

func (l *limitWatch) Read(p []byte) (int, error) {
	n, err := l.r.Read(p)
	var tooLarge *http.MaxBytesError
	switch {
	case errors.As(err, &tooLarge):
		l.hit = true
	case errors.Is(err, os.ErrDeadlineExceeded):
		l.late = true
	}
	return n, err
}

func (l *limitWatch) Close() error { return l.r.Close() }

func (l *limitWatch) hitLimit() bool { return l.hit }
