package main

import (
	"context"
	"testing"
	"time"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/providers/sandbox"
)

// TestServerOrderTTLReadsTheOrdersTTL: with -url the server's TTL is
// whatever it was started with; the tool reads it from the orders the
// place phase made, to give the direct side's orders the same.
func TestServerOrderTTLReadsTheOrdersTTL(t *testing.T) {
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
}
