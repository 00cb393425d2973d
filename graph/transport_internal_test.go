package graph

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/99designs/gqlgen/graphql"
)

// TestWriteResponseAsMarshalWould: the usual answer (data, nothing else)
// is written without json.Marshal, byte for byte as json.Marshal writes
// it, escapes included; an answer over the cap is still refused.
func TestWriteResponseAsMarshalWould(t *testing.T) {
	for _, data := range []string{
		`{"createOrder":{"order":{"orderNo":"26120200000000000001","status":"PENDING","amount":"1.00"},"accessToken":"t0k3n"}}`,
		`{"product":{"name":"<b>Gift & card</b>","description":"line\u2028sep\u2029end"}}`,
		`{"orders":{"edges":[],"pageInfo":{"hasNextPage":false}}}`,
		`null`,
	} {
		resp := &graphql.Response{Data: json.RawMessage(data)}
		want, err := json.Marshal(resp)
		if err != nil {
			t.Fatal(err)
		}
		rec := httptest.NewRecorder()
		writeResponse(rec, mediaGraphQLResponse, http.StatusOK, resp, 1<<20)
		if got := rec.Body.String(); got != string(want) {
			t.Errorf("wrote %s, json.Marshal writes %s", got, want)
		}
		if ct := rec.Header().Get("Content-Type"); ct != mediaGraphQLResponse+"; charset=utf-8" {
			t.Errorf("Content-Type %q", ct)
		}
	}
	rec := httptest.NewRecorder()
	writeResponse(rec, mediaJSON, http.StatusOK, &graphql.Response{Data: json.RawMessage(`{"x":"` + strings.Repeat("x", 64) + `"}`)}, 40)
	var out graphql.Response
	if err := json.Unmarshal(rec.Body.Bytes(), &out); err != nil || len(out.Errors) != 1 || out.Errors[0].Extensions["code"] != codeResponseTooLarge {
		t.Errorf("over the cap: %s", rec.Body.Bytes())
	}
}
