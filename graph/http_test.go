package graph_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"

	"github.com/99designs/gqlgen/graphql/introspection"

	"kami/domain"
	"kami/graph"
)

type httpResult struct {
	status      int
	contentType string
	allow       string
	hasData     bool // the body has a data entry (null or not)
	result
}

func send(t *testing.T, req *http.Request) httpResult {
	t.Helper()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	out := httpResult{status: resp.StatusCode, contentType: resp.Header.Get("Content-Type"), allow: resp.Header.Get("Allow")}
	var raw struct {
		Data   json.RawMessage
		Errors []gqlError
	}
	if err := json.Unmarshal(body, &raw); err != nil {
		t.Fatalf("%s %s: body %q is not JSON: %v", req.Method, req.URL, body, err)
	}
	out.Data, out.Errors, out.hasData = raw.Data, raw.Errors, raw.Data != nil
	return out
}

func post(t *testing.T, srv *httptest.Server, accept, contentType, body string, header ...string) httpResult {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/graphql", strings.NewReader(body))
	if accept != "" {
		req.Header.Set("Accept", accept)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	return send(t, req)
}

func get(t *testing.T, srv *httptest.Server, accept string, params url.Values) httpResult {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, srv.URL+"/graphql?"+params.Encode(), nil)
	if accept != "" {
		req.Header.Set("Accept", accept)
	}
	return send(t, req)
}

func body(query string, vars map[string]any) string {
	b, _ := json.Marshal(map[string]any{"query": query, "variables": vars})
	return string(b)
}

const (
	gqlResp = "application/graphql-response+json"
	appJSON = "application/json"
)

// TestHTTP checks GraphQL over HTTP through a real server: media types,
// status codes and error codes for good and bad requests alike.
func TestHTTP(t *testing.T) {
	t.Parallel()
	b := setup(t, options{mod: func(c *graph.Config) { c.MaxBodyBytes = 4096; c.MaxDepth = 5; c.MaxComplexity = 200 }})
	srv := httptest.NewServer(b.handler)
	t.Cleanup(srv.Close)
	id := b.product(t, "1.00", 1)

	deep := `{ orders { edges { node { product { id } } } } }` // depth 5
	tooDeep := `{ refunds { edges { node { order { product { id } } } } } }`
	pageQuery := `query($n: Int) { orders(first: $n) { edges { node { orderNo status amount product { id name } } } } }`
	var wide strings.Builder // 25 lists of products at 9 each: 225, over 200
	wide.WriteString("{")
	for i := range 25 {
		fmt.Fprintf(&wide, " p%d: products { ...P }", i)
	}
	wide.WriteString(" } fragment P on Product { id name price description active maxPerOrder stock createdAt }")
	cases := []struct {
		name        string
		do          func() httpResult
		status      int
		contentType string
		code        string // "" means success
	}{
		{"post, new media type", func() httpResult { return post(t, srv, gqlResp, appJSON, body(`{ products { id } }`, nil)) }, 200, gqlResp, ""},
		{"post, legacy json", func() httpResult { return post(t, srv, appJSON, appJSON, body(`{ products { id } }`, nil)) }, 200, appJSON, ""},
		{"post, no accept", func() httpResult { return post(t, srv, "", appJSON, body(`{ products { id } }`, nil)) }, 200, appJSON, ""},
		{"post, any accept", func() httpResult {
			return post(t, srv, "*/*", appJSON+"; charset=utf-8", body(`{ products { id } }`, nil))
		}, 200, appJSON, ""},
		{"post, application/* accept", func() httpResult {
			return post(t, srv, "application/*", appJSON, body(`{ products { id } }`, nil))
		}, 200, appJSON, ""},
		{"post, named type before wildcard", func() httpResult {
			return post(t, srv, "*/*;q=0.1, "+gqlResp, appJSON, body(`{ products { id } }`, nil))
		}, 200, gqlResp, ""},
		{"get query", func() httpResult { return get(t, srv, gqlResp, url.Values{"query": {`{ products { id price } }`}}) }, 200, gqlResp, ""},
		{"get with variables", func() httpResult {
			return get(t, srv, appJSON, url.Values{"query": {`query($id: ID!) { product(id: $id) { id } }`}, "variables": {`{"id":"` + id + `"}`}})
		}, 200, appJSON, ""},
		{"parse error", func() httpResult { return post(t, srv, gqlResp, appJSON, body(`{ products { id `, nil)) }, 400, gqlResp, "GRAPHQL_PARSE_FAILED"},
		{"parse error, legacy", func() httpResult { return post(t, srv, appJSON, appJSON, body(`{ products { id `, nil)) }, 200, appJSON, "GRAPHQL_PARSE_FAILED"},
		{"unknown field", func() httpResult { return post(t, srv, gqlResp, appJSON, body(`{ products { id secret } }`, nil)) }, 400, gqlResp, "GRAPHQL_VALIDATION_FAILED"},
		{"unknown field, legacy", func() httpResult { return post(t, srv, appJSON, appJSON, body(`{ products { id secret } }`, nil)) }, 200, appJSON, "GRAPHQL_VALIDATION_FAILED"},
		{"wrong variable type", func() httpResult {
			return post(t, srv, gqlResp, appJSON, body(`query($id: ID!) { product(id: $id) { id } }`, map[string]any{"id": map[string]any{"x": 1}}))
		}, 400, gqlResp, "GRAPHQL_VALIDATION_FAILED"},
		{"missing variable", func() httpResult {
			return post(t, srv, gqlResp, appJSON, body(`query($id: ID!) { product(id: $id) { id } }`, nil))
		}, 400, gqlResp, "GRAPHQL_VALIDATION_FAILED"},
		{"empty query", func() httpResult { return post(t, srv, gqlResp, appJSON, body(``, nil)) }, 400, gqlResp, "GRAPHQL_VALIDATION_FAILED"},
		{"depth at the limit", func() httpResult {
			return post(t, srv, gqlResp, appJSON, body(deep, nil), "Authorization", string(admin))
		}, 200, gqlResp, ""},
		{"too deep", func() httpResult {
			return post(t, srv, gqlResp, appJSON, body(tooDeep, nil), "Authorization", string(admin))
		}, 400, gqlResp, "DEPTH_LIMIT_EXCEEDED"},
		{"too deep through fragments", func() httpResult {
			return post(t, srv, gqlResp, appJSON, body(`{ refunds { ...R } } fragment R on RefundConnection { edges { node { ...N } } } fragment N on Refund { order { product { id } } }`, nil))
		}, 400, gqlResp, "DEPTH_LIMIT_EXCEEDED"},
		{"too complex", func() httpResult {
			return post(t, srv, gqlResp, appJSON, body(`{ orders(first: 100) { edges { node { orderNo status amount product { id name } } } } }`, nil), "Authorization", string(admin))
		}, 400, gqlResp, "COMPLEXITY_LIMIT_EXCEEDED"},
		// A page size from a variable is priced per request, though the
		// document is the same.
		{"page from a variable", func() httpResult {
			return post(t, srv, gqlResp, appJSON, body(pageQuery, map[string]any{"n": 1}), "Authorization", string(admin))
		}, 200, gqlResp, ""},
		{"too complex page from a variable", func() httpResult {
			return post(t, srv, gqlResp, appJSON, body(pageQuery, map[string]any{"n": 100}), "Authorization", string(admin))
		}, 400, gqlResp, "COMPLEXITY_LIMIT_EXCEEDED"},
		// A price that no variable changes is kept: asked twice, refused twice.
		{"too complex, fixed price", func() httpResult { return post(t, srv, gqlResp, appJSON, body(wide.String(), nil)) }, 400, gqlResp, "COMPLEXITY_LIMIT_EXCEEDED"},
		{"too complex, fixed price again", func() httpResult { return post(t, srv, gqlResp, appJSON, body(wide.String(), nil)) }, 400, gqlResp, "COMPLEXITY_LIMIT_EXCEEDED"},
		{"body too large", func() httpResult {
			return post(t, srv, gqlResp, appJSON, body(`{ products { id } }`+strings.Repeat(" ", 5000), nil))
		}, 413, gqlResp, "PAYLOAD_TOO_LARGE"},
		{"body not JSON", func() httpResult { return post(t, srv, gqlResp, appJSON, `{"query": "{ products { id } }"`) }, 400, gqlResp, "BAD_REQUEST"},
		{"body not JSON, legacy", func() httpResult { return post(t, srv, appJSON, appJSON, `query=products`) }, 400, appJSON, "BAD_REQUEST"},
		{"wrong content type", func() httpResult { return post(t, srv, gqlResp, "text/plain", `{ products { id } }`) }, 415, gqlResp, "BAD_REQUEST"},
		{"not acceptable", func() httpResult { return post(t, srv, "text/html", appJSON, body(`{ products { id } }`, nil)) }, 406, appJSON, "BAD_REQUEST"},
		{"mutation over GET", func() httpResult {
			return get(t, srv, gqlResp, url.Values{"query": {`mutation { createProduct(input: {name: "x", price: "1"}) { id } }`}})
		}, 405, gqlResp, "BAD_REQUEST"},
		{"subscription over POST", func() httpResult {
			return post(t, srv, gqlResp, appJSON, body(`subscription { orderStatusChanged(orderNo: "x", accessToken: "y") { status } }`, nil))
		}, 400, gqlResp, "BAD_REQUEST"},
		{"bad variables over GET", func() httpResult {
			return get(t, srv, gqlResp, url.Values{"query": {`{ products { id } }`}, "variables": {`{`}})
		}, 400, gqlResp, "BAD_REQUEST"},
		{"domain error is 200", func() httpResult { return post(t, srv, gqlResp, appJSON, body(`{ orders { edges { cursor } } }`, nil)) }, 200, gqlResp, domain.EUNAUTH},
	}
	for _, c := range cases {
		r := c.do()
		if r.status != c.status || !strings.HasPrefix(r.contentType, c.contentType) {
			t.Errorf("%s: %d %s, want %d %s (%+v)", c.name, r.status, r.contentType, c.status, c.contentType, r.Errors)
			continue
		}
		if c.code == "" {
			if len(r.Errors) > 0 {
				t.Errorf("%s: errors %+v", c.name, r.Errors)
			}
			continue
		}
		if len(r.Errors) == 0 || r.Errors[0].Extensions.Code != c.code {
			t.Errorf("%s: errors %+v, want code %s", c.name, r.Errors, c.code)
		}
		// Only a request that executed has a data entry; one refused before
		// execution (parse, validation, limits, transport) has none.
		if executed := c.code == domain.EUNAUTH; r.hasData != executed {
			t.Errorf("%s: data entry present = %v, want %v", c.name, r.hasData, executed)
		}
		if c.name == "mutation over GET" && r.allow != "POST" {
			t.Errorf("mutation over GET: Allow %q", r.allow)
		}
	}

	// Nothing the bad requests asked for happened, and the server still serves.
	var list struct{ Products []struct{ ID string } }
	r := post(t, srv, gqlResp, appJSON, body(`{ products(all: true) { id } }`, nil), "Authorization", string(admin))
	r.decode(t, &list)
	if len(list.Products) != 1 {
		t.Errorf("products after the bad requests: %+v", list.Products)
	}

	// Other methods.
	req, _ := http.NewRequest(http.MethodPut, srv.URL+"/graphql", bytes.NewReader(nil))
	if r := send(t, req); r.status != http.StatusMethodNotAllowed || r.allow != "GET, POST" {
		t.Errorf("PUT: %d, Allow %q", r.status, r.allow)
	}
}

// TestIntrospectionUnderLimits: the playground's introspection query (15
// deep, under the introspection depth limit, and priced under the
// complexity limit) works under the default limits.
func TestIntrospectionUnderLimits(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	var got struct {
		Schema struct{ Types []struct{ Name string } } `json:"__schema"`
	}
	b.do(t, anon, introspection.Query, nil).decode(t, &got)
	if len(got.Schema.Types) < 10 {
		t.Errorf("introspection: %d types", len(got.Schema.Types))
	}
}
