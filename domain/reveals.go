package domain

import (
	"context"
	"time"

	"github.com/uptrace/bun"
)

// The reveal audit: every time a card code leaves kami it is recorded,
// before it leaves (a code whose record cannot be written is not shown).
// This is what a seller shows in a dispute: when, through which channel,
// to whom, from which address.

// RevealChannel is how codes left kami.
type RevealChannel string

const (
	// RevealOrder: an order's codes in a query or mutation answer (the
	// buyer's order query, an admin's order views).
	RevealOrder RevealChannel = "ORDER"
	// RevealSubscription: an order's codes in an orderStatusChanged event.
	RevealSubscription RevealChannel = "SUBSCRIPTION"
	// RevealAdminCode: an admin read one card's code (Card.code).
	RevealAdminCode RevealChannel = "ADMIN_CODE"
	// RevealExport: a card's code in an admin's CSV export.
	RevealExport RevealChannel = "EXPORT"
	// RevealMail: an order's codes in a mail to its buyer (actor "mail"),
	// one row per attempt, recorded before the attempt sends (see mail.go).
	RevealMail RevealChannel = "MAIL"
)

// RevealViewer is who the codes were shown to.
type RevealViewer string

const (
	ViewerBuyer RevealViewer = "BUYER" // the holder of the order's access token
	ViewerAdmin RevealViewer = "ADMIN" // the holder of the admin token
)

// Reveal is one card_reveal row. An order's codes shown together are one
// row (OrderNo set, CardID zero: the order's SOLD cards); a single card's
// code is one row (CardID set, and OrderNo the order it was sold to, if
// any), so a card's history and an order's history are each one indexed
// read.
type Reveal struct {
	bun.BaseModel `bun:"table:card_reveal"`

	ID      int64         `bun:"id,pk,autoincrement"`
	Channel RevealChannel `bun:"channel"`
	Viewer  RevealViewer  `bun:"viewer"`
	// Actor names the viewer: "admin" (there is one admin token), or
	// "buyer" for the holder of the order's access token (the token itself
	// is never stored; the order it opens is OrderNo).
	Actor      string    `bun:"actor"`
	ClientAddr string    `bun:"client_addr"`
	OrderNo    string    `bun:"order_no,nullzero"`
	CardID     int64     `bun:"card_id,nullzero"`
	Codes      int       `bun:"codes"` // how many codes were shown
	Ref        string    `bun:"ref"`   // what groups rows of one reveal (an export's id)
	CreatedAt  time.Time `bun:"created_at"`
}

// RecordReveals writes reveals in one insert. Callers record before the
// codes leave and do not send them when this fails. It is the one place
// reveals are written (codes sent by mail, when kami sends them, record here too).
func (l *Ledger) RecordReveals(ctx context.Context, rs ...Reveal) error {
	return recordReveals(ctx, l.db, l.now(), rs)
}

func recordReveals(ctx context.Context, db bun.IDB, now time.Time, rs []Reveal) error {
	if len(rs) == 0 {
		return nil
	}
	for i := range rs {
		r := &rs[i]
		r.ID = 0
		r.CreatedAt = now
		r.Actor = actorOr(r.Actor)
		r.ClientAddr = truncate(r.ClientAddr, 64)
		r.Ref = truncate(r.Ref, 64)
	}
	_, err := db.NewInsert().Model(&rs).Returning("NULL").Exec(ctx)
	return err
}

// RevealPage is one page of reveals, newest first.
type RevealPage struct {
	Reveals []Reveal
	HasNext bool
}

// ListReveals pages, newest first, through the reveals of one order or one
// card (exactly one of orderNo, cardID): for an order, every showing of its
// codes and every single-card read of one of them; for a card, every read
// of it, and, once it is SOLD, every showing of its order's codes.
// BAD_INPUT (neither or both given, bad page size), NOT_FOUND (no such
// card).
func (l *Ledger) ListReveals(ctx context.Context, orderNo string, cardID, afterID int64, limit int) (*RevealPage, error) {
	limit, err := clampLimit(limit)
	if err != nil {
		return nil, err
	}
	if (orderNo == "") == (cardID == 0) {
		return nil, Errorf(EBADINPUT, "give an order number or a card id")
	}
	var rs []Reveal
	q := l.db.NewSelect().Model(&rs)
	if orderNo != "" {
		if err := checkOrderNo(orderNo); err != nil {
			return nil, err
		}
		q = q.Where("order_no = ?", orderNo)
	} else {
		var c Card
		if err := l.db.NewSelect().Model(&c).Column("id", "status", "order_no").Where("id = ?", cardID).Scan(ctx); err != nil {
			return nil, notFound(err, "card %d not found", cardID)
		}
		if c.Status == CardSold {
			q = q.Where("(card_id = ? OR (card_id IS NULL AND order_no = ?))", cardID, c.OrderNo)
		} else {
			q = q.Where("card_id = ?", cardID)
		}
	}
	hasNext, err := idPage(ctx, q, &rs, afterID, limit)
	if err != nil {
		return nil, err
	}
	return &RevealPage{Reveals: rs, HasNext: hasNext}, nil
}
