package graph

import (
	"encoding/csv"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"kami/domain"
)

// ExportPath is where the card export is served.
const ExportPath = "/export/cards"

// NewExportHandler serves GET /export/cards: the admin's CSV export of
// card codes, streamed page by page (domain.Ledger.ExportCards), so a
// shop's whole stock leaves in constant memory. Query parameters filter:
// product=<id>, batch=<id>, status=<STATUS> (repeatable). It needs the
// admin token in Authorization, checked first. Every code in it is
// recorded as revealed to the admin at the client's address before it is
// written. An error after the first row aborts the response, so a client
// never mistakes a cut-off file for a whole one.
func NewExportHandler(cfg Config) http.Handler {
	cfg = cfg.withDefaults()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet {
			w.Header().Set("Allow", "GET")
			writeError(w, r, http.StatusMethodNotAllowed, codeBadRequest, "use GET")
			return
		}
		if err := requireAdmin(withViewer(r.Context(), viewerFrom(r.Header.Get("Authorization"), cfg.AdminToken))); err != nil {
			writeError(w, r, http.StatusUnauthorized, domain.EUNAUTH, domain.ErrorMessage(err))
			return
		}
		f, err := exportFilter(r)
		if err != nil {
			writeError(w, r, http.StatusBadRequest, domain.EBADINPUT, domain.ErrorMessage(err))
			return
		}
		who := domain.Reveal{Viewer: domain.ViewerAdmin, Actor: actor, ClientAddr: cfg.ClientAddr(r)}
		out := csv.NewWriter(w)
		started := false
		start := func() {
			w.Header().Set("Content-Type", "text/csv; charset=utf-8")
			w.Header().Set("Content-Disposition", fmt.Sprintf(`attachment; filename="kami-cards-%s.csv"`, time.Now().UTC().Format("20060102T150405Z")))
			w.Header().Set("Cache-Control", "no-store")
			out.Write(exportHeader)
			started = true
		}
		n, err := cfg.Ledger.ExportCards(r.Context(), f, who, func(rows []domain.ExportedCard) error {
			if !started {
				start()
			}
			for i := range rows {
				out.Write(exportRow(&rows[i]))
			}
			out.Flush()
			if fl, ok := w.(http.Flusher); ok {
				fl.Flush()
			}
			return out.Error()
		})
		switch {
		case err != nil && !started:
			if code := domain.ErrorCode(err); code != domain.EINTERNAL {
				writeError(w, r, http.StatusBadRequest, code, domain.ErrorMessage(err))
				return
			}
			cfg.Logger.ErrorContext(r.Context(), "card export failed", "err", err)
			writeError(w, r, http.StatusInternalServerError, domain.EINTERNAL, "internal error")
		case err != nil:
			if r.Context().Err() == nil {
				cfg.Logger.ErrorContext(r.Context(), "card export broke off", "cards", n, "err", err)
			}
			panic(http.ErrAbortHandler) // the client sees a broken transfer, not a short file
		case !started: // no card matched: the header alone
			start()
			out.Flush()
		}
	})
}

var exportHeader = []string{"card_id", "product_id", "product", "batch_id", "status", "order_no", "imported_at", "locked_at", "sold_at", "code"}

func exportRow(c *domain.ExportedCard) []string {
	ts := func(t time.Time) string {
		if t.IsZero() {
			return ""
		}
		return t.UTC().Format(time.RFC3339)
	}
	return []string{strconv.FormatInt(c.ID, 10), strconv.FormatInt(c.ProductID, 10), c.ProductName,
		strconv.FormatInt(c.BatchID, 10), string(c.Status), c.OrderNo, ts(c.CreatedAt), ts(c.LockedAt), ts(c.SoldAt), c.Code}
}

func exportFilter(r *http.Request) (domain.ExportFilter, error) {
	q := r.URL.Query()
	var f domain.ExportFilter
	for name, dst := range map[string]*int64{"product": &f.ProductID, "batch": &f.BatchID} {
		if v := q.Get(name); v != "" {
			id, err := strconv.ParseInt(v, 10, 64)
			if err != nil || id <= 0 {
				return f, domain.Errorf(domain.EBADINPUT, "%s must be an id", name)
			}
			*dst = id
		}
	}
	for _, v := range q["status"] {
		for _, s := range strings.Split(v, ",") {
			st := domain.CardStatus(strings.ToUpper(strings.TrimSpace(s)))
			if !slices.Contains(domain.CardStatuses, st) {
				return f, domain.Errorf(domain.EBADINPUT, "status must be one of %v", domain.CardStatuses)
			}
			if !slices.Contains(f.Statuses, st) {
				f.Statuses = append(f.Statuses, st)
			}
		}
	}
	return f, nil
}
