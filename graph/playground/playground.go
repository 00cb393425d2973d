// Package playground serves kami's GraphQL playground: GraphiQL with its
// scripts, stylesheet and fonts embedded in the binary, so the page works
// on a machine that reaches no CDN (many servers, and many buyers in
// mainland China, cannot rely on one). No request leaves kami.
//
// The GraphiQL and React files in assets/ are the npm releases pinned in
// refresh.sh, unchanged but for their source-map comments, with their
// licenses beside them; `go generate ./graph/playground/` fetches them
// again.
package playground

//go:generate bash refresh.sh

import (
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"html/template"
	"mime"
	"net/http"
	"path"
	"strings"
	"sync"
)

//go:embed assets page.html playground.js example.graphql example-variables.json order.graphql favicon.ico
var files embed.FS

// Prefix is the path the page's scripts and stylesheet are served under.
const Prefix = "/playground/"

// asset is one file the page loads, kept compressed as well.
type asset struct {
	body, gz []byte
	ctype    string
	sum      string // of body: the page asks for name?v=sum
}

// assets holds the files under Prefix (and the favicon), read and
// compressed once, on the first request.
var assets = sync.OnceValue(func() map[string]*asset {
	out := map[string]*asset{}
	add := func(name, file string) {
		body, err := files.ReadFile(file)
		if err != nil {
			panic("playground: " + file + " is not embedded: " + err.Error())
		}
		sum := sha256.Sum256(body)
		a := &asset{body: body, ctype: mime.TypeByExtension(path.Ext(name)), sum: hex.EncodeToString(sum[:8])}
		if a.ctype == "" || strings.HasPrefix(name, "LICENSE") || name == "VERSIONS" {
			a.ctype = "text/plain; charset=utf-8"
		}
		if name == "favicon.ico" {
			a.ctype = "image/x-icon"
		}
		var buf bytes.Buffer
		zw, _ := gzip.NewWriterLevel(&buf, gzip.BestCompression)
		zw.Write(body)
		zw.Close()
		if buf.Len() < len(body) {
			a.gz = buf.Bytes()
		}
		out[name] = a
	}
	entries, err := files.ReadDir("assets")
	if err != nil {
		panic("playground: assets are not embedded: " + err.Error())
	}
	for _, e := range entries {
		add(e.Name(), "assets/"+e.Name())
	}
	add("playground.js", "playground.js")
	add("favicon.ico", "favicon.ico")
	return out
})

var pageTemplate = template.Must(template.ParseFS(files, "page.html"))

// pageConfig is what playground.js reads from the page.
type pageConfig struct {
	Endpoint         string `json:"endpoint"`
	Example          string `json:"example"`
	ExampleVariables string `json:"exampleVariables"`
	OrderQuery       string `json:"orderQuery"`
}

// Handler serves the playground for the GraphQL endpoint at endpoint
// ("/graphql"), whose WebSocket (same path) carries subscriptions:
//
//	GET /                    the page, opened on a walk-through document
//	GET /?orderNo=…          the page, opened on that order's query
//	GET /playground/{file}   GraphiQL, React, the page's script, their licenses
//	GET /favicon.ico
func Handler(endpoint string) http.Handler {
	page := renderPage(endpoint)
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Type", "text/html; charset=utf-8")
		h.Set("Cache-Control", "no-cache")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Referrer-Policy", "no-referrer")
		// Everything from kami itself. GraphiQL and React set inline
		// styles; the fonts and icons are data: URLs in the stylesheet.
		h.Set("Content-Security-Policy", "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "+
			"img-src 'self' data:; font-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
		w.Write(page)
	})
	mux.HandleFunc("GET "+Prefix+"{file}", func(w http.ResponseWriter, r *http.Request) {
		serveAsset(w, r, r.PathValue("file"))
	})
	mux.HandleFunc("GET /favicon.ico", func(w http.ResponseWriter, r *http.Request) {
		serveAsset(w, r, "favicon.ico")
	})
	return mux
}

func renderPage(endpoint string) []byte {
	read := func(name string) string {
		b, err := files.ReadFile(name)
		if err != nil {
			panic("playground: " + name + " is not embedded")
		}
		return string(b)
	}
	as := assets()
	url := func(name string) string { return Prefix + name + "?v=" + as[name].sum }
	var buf bytes.Buffer
	err := pageTemplate.Execute(&buf, map[string]any{
		"Endpoint": endpoint,
		"CSS":      url("graphiql.min.css"),
		"React":    url("react.production.min.js"),
		"ReactDOM": url("react-dom.production.min.js"),
		"GraphiQL": url("graphiql.min.js"),
		"Page":     url("playground.js"),
		"Config": pageConfig{Endpoint: endpoint, Example: read("example.graphql"),
			ExampleVariables: read("example-variables.json"), OrderQuery: read("order.graphql")},
	})
	if err != nil {
		panic("playground: page template: " + err.Error())
	}
	return buf.Bytes()
}

// serveAsset answers with the file, compressed when the browser takes
// gzip. A request naming the file's current sum (the page's) may be cached
// for good; any other is revalidated by its ETag.
func serveAsset(w http.ResponseWriter, r *http.Request, name string) {
	a, ok := assets()[name]
	if !ok {
		http.NotFound(w, r)
		return
	}
	h := w.Header()
	etag := `"` + a.sum + `"`
	h.Set("ETag", etag)
	h.Set("Content-Type", a.ctype)
	h.Set("X-Content-Type-Options", "nosniff")
	h.Add("Vary", "Accept-Encoding")
	if r.URL.Query().Get("v") == a.sum {
		h.Set("Cache-Control", "public, max-age=31536000, immutable")
	} else {
		h.Set("Cache-Control", "no-cache")
	}
	if inm := r.Header.Get("If-None-Match"); inm != "" && strings.Contains(inm, etag) {
		w.WriteHeader(http.StatusNotModified)
		return
	}
	body := a.body
	if a.gz != nil && acceptsGzip(r) {
		h.Set("Content-Encoding", "gzip")
		body = a.gz
	}
	w.Write(body)
}

func acceptsGzip(r *http.Request) bool {
	for _, part := range strings.Split(r.Header.Get("Accept-Encoding"), ",") {
		enc, q, _ := strings.Cut(strings.TrimSpace(part), ";")
		if strings.EqualFold(strings.TrimSpace(enc), "gzip") && strings.ReplaceAll(q, " ", "") != "q=0" {
			return true
		}
	}
	return false
}
