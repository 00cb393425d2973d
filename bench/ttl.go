package main

import (
	"context"
	"fmt"
	"time"

	"github.com/uptrace/bun"
)

// serverOrderTTL is the TTL the server gave a product's orders: expires_at
// − created_at of one of them (the ledger sets both from one clock
// reading). With -url the tool did not start the server and cannot set its
// KAMI_ORDER_TTL, so -ttl only says what the direct side's orders get; the
// two sides must get the same, or the one with the longer TTL places
// without closes for longer, which is faster (see phase 3 in main.go).
// found is false when the product has no order.
func serverOrderTTL(ctx context.Context, db *bun.DB, productID int64) (ttl time.Duration, found bool, err error) {
	var rows []struct {
		CreatedAt time.Time `bun:"created_at"`
		ExpiresAt time.Time `bun:"expires_at"`
	}
	if err := db.NewSelect().Table("orders").Column("created_at", "expires_at").
		Where("product_id = ?", productID).Limit(1).Scan(ctx, &rows); err != nil {
		return 0, false, err
	}
	if len(rows) == 0 {
		return 0, false, nil
	}
	return rows[0].ExpiresAt.Sub(rows[0].CreatedAt).Round(time.Millisecond), true, nil
}

// directTTL is the TTL the direct side's orders get: -ttl, which is the
// server's when the tool started it; with -url, the one the server gave the
// place phase's orders (product productID) when it differs, said in the
// report's notes and load line.
func directTTL(ctx context.Context, o *options, db *bun.DB, productID int64, rep *Report) time.Duration {
	if o.url == "" {
		return o.ttl
	}
	ttl, found, err := serverOrderTTL(ctx, db, productID)
	switch {
	case err != nil:
		rep.Notes = append(rep.Notes, fmt.Sprintf("reading the server's order TTL: %v; the direct side uses -ttl %s", err, o.ttl))
		return o.ttl
	case !found || ttl == o.ttl:
		return o.ttl
	}
	rep.Notes = append(rep.Notes, fmt.Sprintf("the server's orders expire after %s, not -ttl %s: the direct side's orders do too", ttl, o.ttl))
	rep.TTL = ttl.String()
	return ttl
}
