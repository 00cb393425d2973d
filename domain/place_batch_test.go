package domain_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"

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

// isCardLock matches the placement's pick of cards (… FROM card_for_sale
// AS f WHERE f.product_id … LIMIT n).
func isCardLock(q string) bool {
	return strings.Contains(q, "FROM card_for_sale AS f WHERE f.product_id") && strings.Contains(q, "LIMIT")
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
		first := placeStalled(t, shop, hook, p)
		ctx, cancel := context.WithCancel(context.Background())
		gaveUp := []<-chan error{placeAsync(ctx, shop, p, "quitter1@example.com"), placeAsync(ctx, shop, p, "quitter2@example.com")}
		waitFor(t, "two queued placements", func() bool { return b.ledger.QueuedPlacesForTest() == 2 })
		cancel()
		for _, c := range gaveUp {
			if err := receive(t, "an abandoned placement's answer", c); !errors.Is(err, context.Canceled) {
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
		answers := []<-chan error{placeStalled(t, shop, hook, p)}
		answers = append(answers, placeAsync(b.ctx, shop, p, "second@example.com"), placeAsync(b.ctx, shop, p, "third@example.com"))
		waitFor(t, "two queued placements", func() bool { return b.ledger.QueuedPlacesForTest() == 2 })
		over := placeAsync(b.ctx, shop, p, "fourth@example.com")
		wantCode(t, receive(t, "the placement beyond the queue's bound", over), domain.EUNAVAILABLE)
		if got := gate.count(p.ID); got != 2 {
			t.Fatalf("stock gate %d with three placements admitted, want 2", got)
		}
		close(hook.release)
		for _, c := range answers {
			if err := receive(t, "a queued placement's answer", c); err != nil {
				t.Fatal(err)
			}
		}
		if n := b.orderCount(t); n != 3 {
			t.Fatalf("%d orders, want 3", n)
		}
		b.mustAudit(t)
	})
}

// placeAsync places an order of one card for contact in the background;
// its answer comes on the channel returned.
func placeAsync(ctx context.Context, shop *domain.Shop, p *domain.Product, contact string) <-chan error {
	c := make(chan error, 1)
	go func() {
		_, err := shop.PlaceOrder(ctx, orderInput(p, contact), "", "127.0.0.1")
		c <- err
	}()
	return c
}

// placeStalled arms hook and places an order that the database then holds
// at its card lock; it returns once the order is held, with the channel
// of its answer (which comes once hook.release is closed).
func placeStalled(t *testing.T, shop *domain.Shop, hook *stallHook, p *domain.Product) <-chan error {
	t.Helper()
	hook.armed.Store(true)
	c := placeAsync(context.Background(), shop, p, "first@example.com")
	receive(t, "the stalled placement", hook.entered)
	return c
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

// TestOrderTextIsCheckedAtTheEdge: a contact, idempotency key, provider or
// payment method that is not valid UTF-8 or holds a control character is
// refused BAD_INPUT before the order reaches a batch (without echoing it),
// and nothing is placed or held. White space is still only trimmed.
func TestOrderTextIsCheckedAtTheEdge(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b, shop, gate, p := placeShop(t, db, noHook{}, 5, 5)
		for name, c := range map[string]struct {
			in     func(*domain.PlaceOrderInput)
			method string
		}{
			"NUL in contact":        {in: func(in *domain.PlaceOrderInput) { in.Contact = "a\x00b@example.com" }},
			"bell in contact":       {in: func(in *domain.PlaceOrderInput) { in.Contact = "a\ab@example.com" }},
			"C1 control in contact": {in: func(in *domain.PlaceOrderInput) { in.Contact = "a\u0085\u009bb@example.com" }},
			"invalid UTF-8 contact": {in: func(in *domain.PlaceOrderInput) { in.Contact = "a\xffb@example.com" }},
			"invalid UTF-8 key":     {in: func(in *domain.PlaceOrderInput) { in.IdempotencyKey = "key-\xc3" }},
			"NUL in key":            {in: func(in *domain.PlaceOrderInput) { in.IdempotencyKey = "key\x00" }},
			"escape in key":         {in: func(in *domain.PlaceOrderInput) { in.IdempotencyKey = "key\x1b[2J" }},
			"NUL in provider":       {in: func(in *domain.PlaceOrderInput) { in.Provider = "sandbox\x00" }},
			"NUL in payment method": {method: "page\x00"},
			"invalid UTF-8 method":  {method: "page\xfe"},
		} {
			in := orderInput(p, "edge@example.com")
			if c.in != nil {
				c.in(&in)
			}
			_, err := shop.PlaceOrder(b.ctx, in, c.method, "127.0.0.1")
			if domain.ErrorCode(err) != domain.EBADINPUT {
				t.Errorf("%s: %v, want BAD_INPUT", name, err)
				continue
			}
			if msg := err.Error(); strings.ContainsFunc(msg, unicode.IsControl) || !utf8.ValidString(msg) {
				t.Errorf("%s: the message echoes the input: %q", name, msg)
			}
			if c.in == nil {
				continue // the method is the Shop's
			}
			if _, err := b.ledger.PlaceOrder(b.ctx, in); domain.ErrorCode(err) != domain.EBADINPUT {
				t.Errorf("%s through the ledger: %v, want BAD_INPUT", name, err)
			}
		}
		if n := b.orderCount(t); n != 0 {
			t.Fatalf("%d orders placed from bad input", n)
		}
		if got := gate.count(p.ID); got != 5 {
			t.Fatalf("stock gate %d, want 5: bad input held stock", got)
		}
		// White space around a contact or key is trimmed, not refused.
		in := orderInput(p, " \tSpaced@Example.com\n")
		in.IdempotencyKey = " k-1 "
		if _, err := shop.PlaceOrder(b.ctx, in, "", "127.0.0.1"); err != nil {
			t.Fatalf("contact with white space: %v", err)
		}
		b.mustAudit(t)
	})
}

// TestBadTextDoesNotSplitBatches: an order with a NUL in its contact,
// arriving with good ones, is refused on its own: the good ones share one
// transaction that is not split (before, the NUL failed the shared INSERT
// on PostgreSQL and every order of the batch was placed again alone).
func TestBadTextDoesNotSplitBatches(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		hook := newStallHook(isCardLock)
		b, shop, _, p := placeShop(t, db, hook, 5, 5)
		answers := []<-chan error{placeStalled(t, shop, hook, p)}
		bad := placeAsync(b.ctx, shop, p, "bad\x00@example.com")
		answers = append(answers, placeAsync(b.ctx, shop, p, "second@example.com"), placeAsync(b.ctx, shop, p, "third@example.com"))
		waitFor(t, "the good placements queued", func() bool { return b.ledger.QueuedPlacesForTest() >= 2 })
		close(hook.release)
		for _, c := range answers {
			if err := receive(t, "a good placement's answer", c); err != nil {
				t.Fatal(err)
			}
		}
		wantCode(t, receive(t, "the bad placement's answer", bad), domain.EBADINPUT)
		if s := b.ledger.PlaceStats().Split; s != 0 {
			t.Fatalf("%d batches split, want none", s)
		}
		if n := b.orderCount(t); n != 3 {
			t.Fatalf("%d orders, want 3", n)
		}
		b.mustAudit(t)
	})
}

// noHook is a query hook that does nothing.
type noHook struct{}

func (noHook) BeforeQuery(ctx context.Context, _ *bun.QueryEvent) context.Context { return ctx }
func (noHook) AfterQuery(context.Context, *bun.QueryEvent)                        {}

// TestBatchPastItsDeadlineGivesEveryAdmissionBack: a shared placement of
// several buyers that fails because its time ran out (the database held
// it) answers every buyer with an error, and each admission goes back to
// the stock gate; no order is left.
func TestBatchPastItsDeadlineGivesEveryAdmissionBack(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		// The first placement is held until released; the next one (the
		// shared batch of the two queued meanwhile) until its time is up.
		held := make(chan struct{})
		hook := newStallHook(isCardLock)
		late := &deadlineHook{match: isCardLock, held: held}
		// late sees each query before hook does, so the query hook holds
		// is not late's too.
		b, shop, gate, p := placeShop(t, db, hooks{late, hook}, 5, 5)
		// A short deadline, waited for (never assumed): the first batch,
		// held until released, may run past it too, and then fails alike.
		b.ledger.SetPlaceTimeoutForTest(time.Second)
		first := placeStalled(t, shop, hook, p)
		shared := []<-chan error{placeAsync(b.ctx, shop, p, "second@example.com"), placeAsync(b.ctx, shop, p, "third@example.com")}
		waitFor(t, "two queued placements", func() bool { return b.ledger.QueuedPlacesForTest() == 2 })
		late.armed.Store(true)
		close(hook.release)
		placed := 0
		if err := receive(t, "the first placement's answer", first); err == nil {
			placed = 1
		}
		receive(t, "the shared batch held", held)
		for i, c := range shared {
			if err := receive(t, "a shared placement's answer", c); err == nil {
				t.Fatalf("shared placement %d succeeded past its batch's deadline", i)
			}
		}
		if got := gate.count(p.ID); got != 5-placed {
			t.Fatalf("stock gate %d with %d order placed, want %d", got, placed, 5-placed)
		}
		if n := b.orderCount(t); n != placed {
			t.Fatalf("%d orders, want %d", n, placed)
		}
		b.mustAudit(t)
	})
}

// deadlineHook holds the first query match accepts, once armed, until the
// query's context ends: a database that answers only after the batch's
// time is up.
type deadlineHook struct {
	match func(string) bool
	armed atomic.Bool
	held  chan struct{} // closed when the query is held
}

func (h *deadlineHook) BeforeQuery(ctx context.Context, e *bun.QueryEvent) context.Context {
	if h.match(e.Query) && h.armed.CompareAndSwap(true, false) {
		close(h.held)
		<-ctx.Done()
	}
	return ctx
}

func (h *deadlineHook) AfterQuery(context.Context, *bun.QueryEvent) {}

// hooks runs several query hooks in turn.
type hooks []bun.QueryHook

func (hs hooks) BeforeQuery(ctx context.Context, e *bun.QueryEvent) context.Context {
	for _, h := range hs {
		ctx = h.BeforeQuery(ctx, e)
	}
	return ctx
}

func (hs hooks) AfterQuery(ctx context.Context, e *bun.QueryEvent) {
	for _, h := range hs {
		h.AfterQuery(ctx, e)
	}
}

// TestPlacedOrderCarriesItsID: the order a placement answers with carries
// the id of its row in the database, on every database, for a batch of
// several orders (each its own row's, in order) and for a lone order.
func TestPlacedOrderCarriesItsID(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 10)
		for _, contacts := range [][]string{
			{"id1@example.com", "id2@example.com", "id3@example.com", "id4@example.com"},
			{"id5@example.com"},
		} {
			ins := make([]domain.PlaceOrderInput, len(contacts))
			for i, c := range contacts {
				ins[i] = orderInput(p, c)
			}
			placed, errs := b.ledger.PlaceBatchForTest(b.ctx, ins)
			for i := range ins {
				if errs[i] != nil {
					t.Fatalf("order %d: %v", i, errs[i])
				}
				o := placed[i].Order
				var id int64
				if err := db.NewSelect().Table("orders").Column("id").Where("order_no = ?", o.OrderNo).Scan(b.ctx, &id); err != nil {
					t.Fatal(err)
				}
				if o.ID != id {
					t.Errorf("order %s (%d of a batch of %d) carries id %d; its row's is %d", o.OrderNo, i+1, len(ins), o.ID, id)
				}
			}
		}
	})
}
