package domain_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
)

// TestExportAndReveals: an export streams the selected cards with their
// codes, page by page, and records each card as revealed to the admin
// before it is handed out; a card's history then answers "who saw this
// card" with the export, an admin's code read and the buyer's views of
// the order it was sold to, and an order's history lists its views and
// the single-card reads of its cards.
func TestExportAndReveals(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 0)
		codes := make([]string, 1203) // three pages
		for i := range codes {
			codes[i] = codeFor(p.ID, i)
		}
		if _, err := b.ledger.ImportCards(b.ctx, p.ID, codes, "admin"); err != nil {
			t.Fatal(err)
		}
		other := b.product(t, 100, 2)
		o := b.order(t, p, 2)
		b.pay(t, o.Order, "T1", "N1")

		admin := domain.Reveal{Viewer: domain.ViewerAdmin, Actor: "admin", ClientAddr: "10.0.0.9"}
		var got []domain.ExportedCard
		pages := 0
		n, err := b.ledger.ExportCards(b.ctx, domain.ExportFilter{ProductID: p.ID}, admin, func(rows []domain.ExportedCard) error {
			pages++
			// Every row handed out is recorded already.
			var recorded int
			if err := db.NewSelect().Table("card_reveal").ColumnExpr("COUNT(*)").Where("channel = ?", domain.RevealExport).Scan(b.ctx, &recorded); err != nil {
				t.Fatal(err)
			}
			if recorded != len(got)+len(rows) {
				t.Fatalf("%d reveals recorded when %d rows were handed out", recorded, len(got)+len(rows))
			}
			got = append(got, rows...)
			return nil
		})
		if err != nil || n != len(codes) || len(got) != len(codes) || pages != 3 {
			t.Fatalf("export: %d cards in %d pages, %v; want %d", n, pages, err, len(codes))
		}
		for i, row := range got {
			if row.Code != codes[i] || row.ProductName != p.Name || row.ProductID != p.ID || row.BatchID == 0 {
				t.Fatalf("row %d: %+v", i, row)
			}
		}
		// Filters: the sold ones only.
		var sold []domain.ExportedCard
		if _, err := b.ledger.ExportCards(b.ctx, domain.ExportFilter{ProductID: p.ID, Statuses: []domain.CardStatus{domain.CardSold}}, admin,
			func(rows []domain.ExportedCard) error { sold = append(sold, rows...); return nil }); err != nil {
			t.Fatal(err)
		}
		if len(sold) != 2 || sold[0].OrderNo != o.Order.OrderNo {
			t.Fatalf("sold export %+v", sold)
		}
		_, err = b.ledger.ExportCards(b.ctx, domain.ExportFilter{Statuses: []domain.CardStatus{"GONE"}}, admin, nil)
		wantCode(t, err, domain.EBADINPUT)
		// A client that goes away stops the export after the page it failed on.
		gone := errors.New("broken pipe")
		if n, err := b.ledger.ExportCards(b.ctx, domain.ExportFilter{ProductID: other.ID}, admin,
			func([]domain.ExportedCard) error { return gone }); !errors.Is(err, gone) || n != 0 {
			t.Fatalf("export to a gone client: %d, %v", n, err)
		}

		// The buyer looks at the order twice, an admin reads one code.
		buyer := domain.Reveal{Channel: domain.RevealOrder, Viewer: domain.ViewerBuyer, Actor: "buyer", ClientAddr: "203.0.113.7", OrderNo: o.Order.OrderNo, Codes: 2}
		if err := b.ledger.RecordReveals(b.ctx, buyer, buyer); err != nil {
			t.Fatal(err)
		}
		card := got[0] // sold to o? find the sold one
		for _, row := range got {
			if row.Status == domain.CardSold {
				card = row
				break
			}
		}
		read := admin
		read.Channel = domain.RevealAdminCode
		if err := b.ledger.RecordReveals(b.ctx, domain.CardRevealOf(read, &card.Card)); err != nil {
			t.Fatal(err)
		}

		history := func(orderNo string, cardID int64) []string {
			t.Helper()
			page, err := b.ledger.ListReveals(b.ctx, orderNo, cardID, 0, 100)
			if err != nil {
				t.Fatal(err)
			}
			var out []string
			for _, r := range page.Reveals {
				out = append(out, string(r.Channel)+"/"+string(r.Viewer)+"/"+r.ClientAddr)
			}
			return out
		}
		// Who saw the sold card: the admin's read, the buyer twice, and the
		// two exports that carried it (the full one and the sold one).
		if h := strings.Join(history("", card.ID), " "); h != "ADMIN_CODE/ADMIN/10.0.0.9 ORDER/BUYER/203.0.113.7 ORDER/BUYER/203.0.113.7 EXPORT/ADMIN/10.0.0.9 EXPORT/ADMIN/10.0.0.9" {
			t.Fatalf("card history: %s", h)
		}
		// An unsold card was only exported once.
		if h := history("", got[len(got)-1].ID); len(h) != 1 || h[0] != "EXPORT/ADMIN/10.0.0.9" {
			t.Fatalf("unsold card history: %v", h)
		}
		// The order's history: its views, the read, and its two cards in
		// both exports.
		if h := history(o.Order.OrderNo, 0); len(h) != 7 {
			t.Fatalf("order history: %v", h)
		}
		_, err = b.ledger.ListReveals(b.ctx, "", 0, 0, 10)
		wantCode(t, err, domain.EBADINPUT)
		_, err = b.ledger.ListReveals(b.ctx, "", 99999999, 0, 10)
		wantCode(t, err, domain.ENOTFOUND)
		// The export is in the admin's audit log with its filter.
		var detail []string
		if err := db.NewSelect().Table("audit_log").Column("detail").Where("action = ?", "cards.export").Order("id").Scan(b.ctx, &detail); err != nil {
			t.Fatal(err)
		}
		if len(detail) != 3 || !strings.Contains(detail[1], "status=SOLD") {
			t.Fatalf("export audit entries %q", detail)
		}
	})
}
