package domain_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/providers"
	"kami/providers/sandbox"
)

// TestFailedBatchAnswersEveryCall: a shared placement that fails once its
// time is up (no call-by-call redo then) answers every call of the batch
// with an error, not only the first: a caller told neither "placed" nor
// "failed" would keep the stock it took and dereference nothing.
func TestFailedBatchAnswersEveryCall(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 5)
		ins := make([]domain.PlaceOrderInput, 3)
		for i := range ins {
			ins[i] = domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: "buyer@example.com", Provider: "sandbox"}
		}
		ctx, cancel := context.WithCancel(b.ctx)
		cancel() // the batch's time is up before it starts
		placed, errs := b.ledger.PlaceBatchForTest(ctx, ins)
		for i := range ins {
			if placed[i] != nil || errs[i] == nil {
				t.Errorf("call %d of the failed batch: %v, %v; want an error", i, placed[i], errs[i])
			}
		}
		b.mustAudit(t)
	})
}

// stallHook holds the first query that match accepts, once armed, until
// release is closed: a database that stops answering in the middle of a
// placement.
type stallHook struct {
	match   func(query string) bool
	armed   atomic.Bool
	entered chan struct{} // closed when the query is held
	release chan struct{}
}

func newStallHook(match func(string) bool) *stallHook {
	return &stallHook{match: match, entered: make(chan struct{}), release: make(chan struct{})}
}

func (h *stallHook) BeforeQuery(ctx context.Context, e *bun.QueryEvent) context.Context {
	if h.match(e.Query) && h.armed.CompareAndSwap(true, false) {
		close(h.entered)
		<-h.release
	}
	return ctx
}

func (h *stallHook) AfterQuery(context.Context, *bun.QueryEvent) {}

// isCardLock matches the placement's card lock (SELECT id FROM card_stock
// ... LIMIT n).
func isCardLock(q string) bool {
	return strings.HasPrefix(q, "SELECT") && strings.Contains(q, "card_stock") && strings.Contains(q, "LIMIT")
}

// placeShop is a Shop over a ledger whose queries pass hook, with an
// in-memory stock gate holding gateCount for a product of cards cards.
func placeShop(t *testing.T, db *bun.DB, hook bun.QueryHook, cards, gateCount int) (*bundle, *domain.Shop, *memGate, *domain.Product) {
	t.Helper()
	b := setup(t, db.WithQueryHook(hook), domain.Config{})
	p := b.product(t, 100, cards)
	sb, err := sandbox.New(sandbox.Config{Secret: "s", BaseURL: "http://kami.test"})
	if err != nil {
		t.Fatal(err)
	}
	gate := &memGate{n: map[int64]int{p.ID: gateCount}}
	shop := &domain.Shop{Ledger: b.ledger, Gate: gate, Providers: providers.NewRegistry(sb),
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	return b, shop, gate, p
}

func orderInput(p *domain.Product, contact string) domain.PlaceOrderInput {
	return domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: contact, Provider: "sandbox"}
}

// receive waits for one value of c, failing after a generous deadline.
func receive[T any](t *testing.T, what string, c <-chan T) T {
	t.Helper()
	select {
	case v := <-c:
		return v
	case <-time.After(30 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
		panic("unreachable")
	}
}

func (b *bundle) orderCount(t testing.TB) int {
	t.Helper()
	n, err := b.db.NewSelect().Table("orders").Count(b.ctx)
	if err != nil {
		t.Fatal(err)
	}
	return int(n)
}

// TestStalledBatchDropsAbandonedCallers: while the database holds a
// placement, buyers who give up while queued behind it get their context's
// error at once, their admissions go back to the stock gate, and they are
// never placed once the database answers again.
func TestStalledBatchDropsAbandonedCallers(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		hook := newStallHook(isCardLock)
		b, shop, gate, p := placeShop(t, db, hook, 5, 5)
		hook.armed.Store(true)
		first := make(chan error, 1)
		go func() {
			_, err := shop.PlaceOrder(context.Background(), orderInput(p, "first@example.com"), "", "127.0.0.1")
			first <- err
		}()
		receive(t, "the stalled placement", hook.entered)
		ctx, cancel := context.WithCancel(context.Background())
		gaveUp := make(chan error, 2)
		for i := range 2 {
			go func() {
				_, err := shop.PlaceOrder(ctx, orderInput(p, fmt.Sprintf("quitter%d@example.com", i)), "", "127.0.0.1")
				gaveUp <- err
			}()
		}
		waitFor(t, "two queued placements", func() bool { return b.ledger.QueuedPlacesForTest() == 2 })
		cancel()
		for range 2 {
			if err := receive(t, "an abandoned placement's answer", gaveUp); !errors.Is(err, context.Canceled) {
				t.Fatalf("abandoned placement: %v, want context.Canceled", err)
			}
		}
		if got := gate.count(p.ID); got != 4 {
			t.Fatalf("stock gate %d after two abandoned placements, want 4 (only the stalled one holds its admission)", got)
		}
		close(hook.release)
		if err := receive(t, "the stalled placement's answer", first); err != nil {
			t.Fatal(err)
		}
		if n := b.orderCount(t); n != 1 {
			t.Fatalf("%d orders, want 1: an abandoned placement was placed", n)
		}
		if got := gate.count(p.ID); got != 4 {
			t.Fatalf("stock gate %d, want 4", got)
		}
		b.mustAudit(t)
	})
}

// TestFullPlaceQueueRefusesAtOnce: with the queue of placements full
// behind a stalled one, one more is refused at once with UNAVAILABLE and
// its admission goes back; the queued ones are placed when the database
// answers again.
func TestFullPlaceQueueRefusesAtOnce(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		hook := newStallHook(isCardLock)
		b, shop, gate, p := placeShop(t, db, hook, 5, 5)
		b.ledger.SetMaxQueuedPlacesForTest(2)
		hook.armed.Store(true)
		answers := make(chan error, 3)
		place := func(contact string) {
			_, err := shop.PlaceOrder(context.Background(), orderInput(p, contact), "", "127.0.0.1")
			answers <- err
		}
		go place("first@example.com")
		receive(t, "the stalled placement", hook.entered)
		go place("second@example.com")
		go place("third@example.com")
		waitFor(t, "two queued placements", func() bool { return b.ledger.QueuedPlacesForTest() == 2 })
		over := make(chan error, 1)
		go func() {
			_, err := shop.PlaceOrder(context.Background(), orderInput(p, "fourth@example.com"), "", "127.0.0.1")
			over <- err
		}()
		wantCode(t, receive(t, "the placement beyond the queue's bound", over), domain.EUNAVAILABLE)
		if got := gate.count(p.ID); got != 2 {
			t.Fatalf("stock gate %d with three placements admitted, want 2", got)
		}
		close(hook.release)
		for range 3 {
			if err := receive(t, "a queued placement's answer", answers); err != nil {
				t.Fatal(err)
			}
		}
		if n := b.orderCount(t); n != 3 {
			t.Fatalf("%d orders, want 3", n)
		}
		b.mustAudit(t)
	})
}

// waitFor polls cond until it holds, failing after a generous deadline.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}
