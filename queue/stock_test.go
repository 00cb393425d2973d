package queue_test

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/providers"
	"kami/providers/sandbox"
	"kami/queue"
	"kami/queue/redistest"
)

func TestStockGateTakeGiveBackRebuildOnce(t *testing.T) {
	combos(t, func(t *testing.T, db *bun.DB, rs *redistest.Server) {
		e := newEnv(t, db, rs, domain.Config{})
		p := e.product(t, 300)
		// Two processes' gates (own clients); the counter is missing.
		other := queue.NewStockGate(rs.NewClient(t), e.keys, e.ledger)
		// Once, not fast, is what is tested: under -race a thousand
		// goroutines queue on the connection pools for seconds.
		e.gate.RebuildWait, other.RebuildWait = 30*time.Second, 30*time.Second
		var taken atomic.Int64
		var wg sync.WaitGroup
		for i := range 1000 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				g := e.gate
				if i%2 == 1 {
					g = other
				}
				ok, err := g.Take(e.ctx, p.ID, 1)
				if err != nil {
					t.Error(err)
				}
				if ok {
					taken.Add(1)
				}
			}()
		}
		wg.Wait()
		if got := e.gate.Rebuilds() + other.Rebuilds(); got != 1 {
			t.Errorf("%d database counts for 1000 takes on a missing counter, want 1", got)
		}
		if taken.Load() != 300 {
			t.Errorf("%d takes admitted, want 300 (the cards there are)", taken.Load())
		}
		if ok, err := e.gate.Take(e.ctx, p.ID, 1); ok || err != nil {
			t.Errorf("take past zero: %v %v", ok, err)
		}
		if err := e.gate.GiveBack(e.ctx, p.ID, 5); err != nil {
			t.Fatal(err)
		}
		if n, ok, _ := e.gate.Counter(e.ctx, p.ID); !ok || n != 5 {
			t.Errorf("counter after give-back %d %v, want 5", n, ok)
		}
		// A give-back to a missing counter does not create it at a wrong value.
		if err := e.gate.GiveBack(e.ctx, p.ID+1000, 3); err != nil {
			t.Fatal(err)
		}
		if _, ok, _ := e.gate.Counter(e.ctx, p.ID+1000); ok {
			t.Error("give-back created a missing counter")
		}
		// Repair sets it from the database: nothing is locked, all 300 free.
		if n, err := e.gate.Repair(e.ctx, p.ID); err != nil || n != 300 {
			t.Errorf("repair: %d %v", n, err)
		}
		// An unknown product rebuilds to 0 and refuses.
		if ok, err := e.gate.Take(e.ctx, p.ID+1000, 1); ok || err != nil {
			t.Errorf("take of an unknown product: %v %v", ok, err)
		}
	})
}

func TestStockGateGivesBackWhenPlaceOrderFails(t *testing.T) {
	t.Parallel()
	rs := redistest.Open(t, redistest.Mini)
	e := newEnv(t, dbtest.Open(t, dbtest.SQLite), rs, domain.Config{})
	sb, err := sandbox.New(sandbox.Config{Secret: "test-secret", BaseURL: "http://127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	e.shop.Providers = providers.NewRegistry(sb)
	p := e.product(t, 2)
	// The counter says 5 (wrong, too high): the gate admits 3, the ledger
	// finds 2 cards and refuses, and the 3 go back to the gate.
	if _, err := e.gate.Repair(e.ctx, p.ID); err != nil {
		t.Fatal(err)
	}
	e.gate.GiveBack(e.ctx, p.ID, 3)
	_, err = e.shop.PlaceOrder(e.ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 3, Contact: "x@example.com", Provider: sandbox.Name}, "", "")
	if domain.ErrorCode(err) != domain.ESOLDOUT {
		t.Fatalf("order of 3 with 2 cards: %v", err)
	}
	if n, _, _ := e.gate.Counter(e.ctx, p.ID); n != 5 {
		t.Errorf("counter %d after a failed order, want 5", n)
	}
	// A good order takes from the gate, and is scheduled for close.
	co, err := e.shop.PlaceOrder(e.ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 2, Contact: "x@example.com", Provider: sandbox.Name}, "", "")
	if err != nil {
		t.Fatal(err)
	}
	if n, _, _ := e.gate.Counter(e.ctx, p.ID); n != 3 {
		t.Errorf("counter %d after an order of 2, want 3", n)
	}
	due, ok, err := e.sched.Close.NextDue(e.ctx)
	if err != nil || !ok || !due.Equal(co.Order.ExpiresAt.Truncate(time.Millisecond)) {
		t.Errorf("close scheduled at %v %v %v, want %v", due, ok, err, co.Order.ExpiresAt)
	}
	// Redis gone: ordering refuses with a retryable error, never sells.
	rs.Mini.Close()
	_, err = e.shop.PlaceOrder(e.ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: "y@example.com", Provider: sandbox.Name}, "", "")
	if domain.ErrorCode(err) != domain.EUNAVAILABLE {
		t.Errorf("order with Redis down: %v, want UNAVAILABLE", err)
	}
}
