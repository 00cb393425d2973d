package main

import (
	"context"
	"testing"
	"time"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/providers/sandbox"
)

// TestDirectOrdersGetTheServersTTL: with -url the server's TTL is whatever
// it was started with (5s, as the bench started it before -ttl became 1s);
// the tool reads it from the orders the place phase made and gives the
// direct side's orders the same, or the side with the longer TTL would
// place without closes for longer.
func TestDirectOrdersGetTheServersTTL(t *testing.T) {
	t.Parallel()
	db := dbtest.Open(t, dbtest.Postgres)
	ctx := context.Background()
	ledger, err := directLedger(db, 5*time.Second) // a server started as the bench did before -ttl became 1s
	if err != nil {
		t.Fatal(err)
	}
	name, price := "ttl", int64(100)
	p, err := ledger.CreateProduct(ctx, domain.ProductInput{Name: &name, PriceFen: &price}, "test")
	if err != nil {
		t.Fatal(err)
	}
	if _, found, err := serverOrderTTL(ctx, db, p.ID); err != nil || found {
		t.Fatalf("no order yet: found %v, err %v", found, err)
	}
	if _, err := ledger.ImportCards(ctx, p.ID, []string{"ttl-1"}, "test"); err != nil {
		t.Fatal(err)
	}
	if _, err := ledger.PlaceOrder(ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: "ttl@bench.test",
		Provider: sandbox.Name, ClientAddr: "127.0.0.1"}); err != nil {
		t.Fatal(err)
	}
	ttl, found, err := serverOrderTTL(ctx, db, p.ID)
	if err != nil || !found || ttl != 5*time.Second {
		t.Errorf("serverOrderTTL = %v, %v, %v; want 5s", ttl, found, err)
	}

	// With -url (-ttl left at its 1s) the direct side's orders get the
	// server's 5s; a server the tool started has -ttl by construction.
	rep := &Report{TTL: "1s"}
	if got := directTTL(ctx, &options{url: "http://127.0.0.1:8080", ttl: time.Second}, db, p.ID, rep); got != 5*time.Second || rep.TTL != "5s" || len(rep.Notes) != 1 {
		t.Errorf("with -url: directTTL = %v, report TTL %q, notes %q; want 5s, 5s and a note", got, rep.TTL, rep.Notes)
	}
	rep = &Report{TTL: "1s"}
	if got := directTTL(ctx, &options{ttl: time.Second}, db, p.ID, rep); got != time.Second || rep.TTL != "1s" || len(rep.Notes) != 0 {
		t.Errorf("started server: directTTL = %v, report TTL %q, notes %q; want -ttl's 1s", got, rep.TTL, rep.Notes)
	}
}
