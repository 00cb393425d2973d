package domain

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/uptrace/bun"
)

// ExportFilter selects the cards of an export. Zero fields select all.
type ExportFilter struct {
	ProductID int64
	BatchID   int64
	Statuses  []CardStatus
}

func (f ExportFilter) String() string {
	var parts []string
	if f.ProductID != 0 {
		parts = append(parts, fmt.Sprintf("product=%d", f.ProductID))
	}
	if f.BatchID != 0 {
		parts = append(parts, fmt.Sprintf("batch=%d", f.BatchID))
	}
	if len(f.Statuses) > 0 {
		parts = append(parts, "status="+strings.Join(strs(f.Statuses), ","))
	}
	if len(parts) == 0 {
		return "all cards"
	}
	return strings.Join(parts, " ")
}

// ExportedCard is one row of an export: the card, its product's name and
// its code, opened.
type ExportedCard struct {
	Card
	ProductName string
	Code        string
}

// exportPage is how many cards an export reads, records and writes at a
// time: its memory, whatever the number of cards.
const exportPage = 500

// Exporter writes an export's rows as they are read; an error stops the
// export (the client went away).
type Exporter func(rows []ExportedCard) error

// ExportCards streams the cards f selects, oldest first, page by page by
// id, to write. Each page's codes are recorded as revealed to who (one
// card_reveal row per card, all with the export's Ref) before write gets
// them, so "who saw this card" finds every export that carried it. The
// export itself goes to the audit log with its filter. It returns how
// many cards were written. BAD_INPUT for an unknown status.
func (l *Ledger) ExportCards(ctx context.Context, f ExportFilter, who Reveal, write Exporter) (int, error) {
	for _, st := range f.Statuses {
		if !slices.Contains(CardStatuses, st) {
			return 0, Errorf(EBADINPUT, "unknown card status %q", st)
		}
	}
	who.Channel, who.Ref = RevealExport, newExportRef(l.now())
	if err := audit(ctx, l.db, l.now(), who.Actor, "cards.export", who.Ref, f.String()+" to "+who.ClientAddr); err != nil {
		return 0, err
	}
	names := map[int64]string{}
	var after int64
	total := 0
	for {
		var cards []Card
		q := l.db.NewSelect().Model(&cards).Where("id > ?", after)
		if f.ProductID != 0 {
			q = q.Where("product_id = ?", f.ProductID)
		}
		if f.BatchID != 0 {
			q = q.Where("batch_id = ?", f.BatchID)
		}
		if len(f.Statuses) > 0 {
			q = q.Where("status IN (?)", bun.List(f.Statuses))
		}
		if err := q.Order("id").Limit(exportPage).Scan(ctx); err != nil {
			return total, err
		}
		if len(cards) == 0 {
			return total, nil
		}
		after = cards[len(cards)-1].ID
		rows := make([]ExportedCard, len(cards))
		reveals := make([]Reveal, len(cards))
		var missing []int64
		for i := range cards {
			c := &cards[i]
			code, err := l.CardCode(c)
			if err != nil {
				return total, err
			}
			rows[i] = ExportedCard{Card: *c, Code: code}
			reveals[i] = cardReveal(who, c)
			if _, ok := names[c.ProductID]; !ok {
				missing = append(missing, c.ProductID)
				names[c.ProductID] = ""
			}
		}
		if len(missing) > 0 {
			ps, err := l.ProductsByID(ctx, missing)
			if err != nil {
				return total, err
			}
			for id, p := range ps {
				names[id] = p.Name
			}
		}
		for i := range rows {
			rows[i].ProductName = names[rows[i].ProductID]
		}
		if err := l.RecordReveals(ctx, reveals...); err != nil {
			return total, err
		}
		if err := write(rows); err != nil {
			return total, err
		}
		total += len(rows)
	}
}

// cardReveal is who's reveal of one card. A SOLD card's reveal names its
// order too, so the order's history lists it; any other card's last order
// is not one it was shown to.
func cardReveal(who Reveal, c *Card) Reveal {
	r := who
	r.CardID, r.Codes, r.OrderNo = c.ID, 1, ""
	if c.Status == CardSold {
		r.OrderNo = c.OrderNo
	}
	return r
}

// CardRevealOf is the reveal of one card's code to who (an admin's
// Card.code read, say).
func CardRevealOf(who Reveal, c *Card) Reveal { return cardReveal(who, c) }

func newExportRef(now time.Time) string {
	b := make([]byte, 6)
	rand.Read(b)
	return "export-" + now.UTC().Format("20060102T150405Z") + "-" + hex.EncodeToString(b)
}
