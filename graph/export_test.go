package graph

import "net/http"

// Work is what a handler did with the documents it was sent.
type Work struct {
	Parsed    int64 // documents parsed to check their size
	Validated int64 // documents gqlgen validated
	Priced    int64 // fields whose complexity was asked, by whatever walk

}

// WorkOf reports the work of a handler made by NewHandler.
func WorkOf(h http.Handler) Work {
	w := h.(*httpHandler).work
	return Work{Parsed: w.parsed.Load(), Validated: w.validated.Load(), Priced: w.priced.Load()}
}
