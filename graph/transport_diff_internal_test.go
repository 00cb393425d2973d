package graph

import (
	"math/rand/v2"
	"reflect"
	"testing"

	"github.com/99designs/gqlgen/graphql"
)

// TestQueryTextsDecodeAsTheWholeBodyRandom: random rests and literals
// built of JSON's tokens decode with the remembered literal exactly as
// the whole body does.
func TestQueryTextsDecodeAsTheWholeBodyRandom(t *testing.T) {
	tokens := []string{`"`, `\`, `,`, `{`, `}`, `[`, `]`, `:`, ` `, "\n", `query`, `QUERY`, `variables`,
		`operationName`, `extensions`, `headers`, `1`, `null`, `"a"`, `\u0071`, `\"`, `x`, "\xff", `"query":`, `"variables":{}`, `1e400`, `-0`, `true`}
	lits := []string{`"a"`, `""`, `"\"q\""`, `"\\"`, `"a\u0062"`, `"{ a }"`}
	r := rand.New(rand.NewPCG(1, 2))
	gen := func(n int) string {
		s := ""
		for range n {
			s += tokens[r.IntN(len(tokens))]
		}
		return s
	}
	q := &queryTexts{}
	for _, lit := range lits {
		q.decode([]byte(`{"query":`+lit+`}`), &graphql.RawParams{})
	}
	accepted := 0
	for i := 0; i < 300000; i++ {
		lit := lits[r.IntN(len(lits))]
		rest := gen(r.IntN(8))
		if r.IntN(2) == 0 {
			rest = "," + rest
		}
		if r.IntN(2) == 0 {
			rest += "}"
		}
		body := `{"query":` + lit + rest
		var want, got graphql.RawParams
		wantOK := decodeParams([]byte(body), &want)
		ok := q.decode([]byte(body), &got)
		if ok != wantOK || (ok && !reflect.DeepEqual(got, want)) {
			t.Fatalf("%q: got %v %+v, want %v %+v", body, ok, got, wantOK, want)
		}
		if ok {
			accepted++
		}
	}
	t.Logf("%d accepted", accepted)
}
