package graph

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"reflect"
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

// TestQueryTextsDecodeAsTheWholeBody holds the remembered query literal to
// the decoder's own reading: every body, sent once to learn its literal
// and again to use it, decodes to the same request (or is refused) as the
// whole body decoded alone, however its rest is written.
func TestQueryTextsDecodeAsTheWholeBody(t *testing.T) {
	const doc = `"mutation Buy($in: CreateOrderInput!) {\n  createOrder(input: $in) { order { orderNo } accessToken }\n}"`
	rests := []string{
		`}`,
		` }`,
		`,"variables":{"in":{"productId":"12","quantity":1,"contact":"a@b.c","provider":"sandbox"}}}`,
		`,"variables":{"n":12345678901234567890,"f":1.5e3}}`,
		`,"operationName":"Buy","variables":null,"extensions":{"persistedQuery":{"version":1}}}`,
		`,"query":"{ products { id } }"}`,
		`,"query":null}`,
		`,"QUERY":"{ a }"}`,
		`,"variables":{"in":1}} `,
		`,"variables":{"in":1}}}`,
		`,"variables":{"in":1}} {}`,
		`,"variables":{"in":1}}x`,
		`,"variables":{"in":}`,
		`,"variables":{"in":1}`,
		`,"query":5}`,
		`,}`,
		`, }`,
		`,,"variables":{}}`,
		`,"variables":"x"}`,
		`,"extra":[1,2,{"x":"\u00e9\ud83d\ude00"}]}`,
	}
	literals := []string{doc, `"{ a }"`, `"\"quoted\" \\ \u0041 \t"`, `""`, "\"bad \xff utf-8\""}
	for _, lit := range literals {
		for _, rest := range rests {
			body := `{"query":` + lit + rest
			var want graphql.RawParams
			wantOK := decodeParams([]byte(body), &want)
			// Learned from another body, or from this one.
			q := &queryTexts{}
			q.decode([]byte(`{"query":`+lit+`}`), &graphql.RawParams{})
			for round := range 2 { // learn, then use
				var got graphql.RawParams
				ok := q.decode([]byte(body), &got)
				if ok != wantOK || (ok && !reflect.DeepEqual(got, want)) {
					t.Fatalf("round %d of %s: got %v %+v, want %v %+v", round, body, ok, got, wantOK, want)
				}
			}
		}
	}
	// Not remembered: an unterminated literal, another first key, spaces.
	for _, body := range []string{`{"query":"abc`, `{"query":"abc\"}`, `{"query": "a"}`, `{"variables":{},"query":"a"}`, `{ "query":"a"}`} {
		if lit := queryLiteral([]byte(body)); lit != nil {
			t.Fatalf("queryLiteral(%q) = %q, want none", body, lit)
		}
		var want, got graphql.RawParams
		wantOK := decodeParams([]byte(body), &want)
		q := &queryTexts{}
		for range 2 {
			if ok := q.decode([]byte(body), &got); ok != wantOK || !reflect.DeepEqual(got, want) {
				t.Fatalf("%s: got %v %+v, want %v %+v", body, ok, got, wantOK, want)
			}
		}
	}
}

// BenchmarkDecodeParams is a storefront's createOrder body, the same
// document with new variables each time, read whole and with its query
// literal remembered:
//
//	go test ./graph/ -run '^$' -bench DecodeParams
func BenchmarkDecodeParams(b *testing.B) {
	body := []byte(`{"query":"mutation Buy($in: CreateOrderInput!) {\n  createOrder(input: $in) {\n    order { orderNo status amount expiresAt }\n    accessToken\n    payment { kind url expiresAt }\n  }\n}","variables":{"in":{"contact":"buyer-1c2d3e-123456@bench.test","productId":"12","provider":"sandbox","quantity":1}}}`)
	buf := make([]byte, len(body))
	for _, c := range []struct {
		name string
		q    *queryTexts
	}{{"whole", nil}, {"remembered", &queryTexts{}}} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for range b.N {
				copy(buf, body) // as read from the request, which decode may change
				var params graphql.RawParams
				if !c.q.decode(buf, &params) {
					b.Fatal("not decoded")
				}
			}
		})
	}
}
