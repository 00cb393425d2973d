package domain_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/providers"
	"kami/providers/fault"
	"kami/providers/sandbox"
)

// countedGateway is a sandbox under another name that counts the calls
// the pre-close check makes to it.
type countedGateway struct {
	*sandbox.Provider
	name  string
	calls atomic.Int64
}

func (g *countedGateway) Name() string { return g.name }

func (g *countedGateway) QueryPayment(ctx context.Context, orderNo string) (providers.TradeState, error) {
	g.calls.Add(1)
	return g.Provider.QueryPayment(ctx, orderNo)
}

func (g *countedGateway) ClosePayment(ctx context.Context, orderNo string) error {
	g.calls.Add(1)
	return g.Provider.ClosePayment(ctx, orderNo)
}

func newCountedGateway(t *testing.T, name string, timeout time.Duration) *countedGateway {
	t.Helper()
	sb, err := sandbox.New(sandbox.Config{Secret: "s", BaseURL: "http://127.0.0.1/", Timeout: timeout})
	if err != nil {
		t.Fatal(err)
	}
	return &countedGateway{Provider: sb, name: name}
}

// placeWith places n orders of one card of p paid through provider.
func (b *bundle) placeWith(t *testing.T, p *domain.Product, provider string, n int) []string {
	t.Helper()
	var nos []string
	for range n {
		placed, err := b.ledger.PlaceOrder(b.ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: "buyer@example.com", Provider: provider})
		if err != nil {
			t.Fatal(err)
		}
		nos = append(nos, placed.Order.OrderNo)
	}
	return nos
}

func outcomes(rs []domain.CloseResult) map[domain.CloseOutcome]int {
	out := map[domain.CloseOutcome]int{}
	for _, r := range rs {
		out[r.Outcome]++
	}
	return out
}

// TestPreCloseCheckKeepsToItsBudget: a gateway that never answers (each
// call would wait for an hour) cannot hold a close batch past its budget:
// the check returns, and every order it could not check is deferred, none
// closed unchecked.
func TestPreCloseCheckKeepsToItsBudget(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{OrderTTL: time.Minute})
		p := b.product(t, 500, 40)
		gw := newCountedGateway(t, sandbox.Name, time.Hour)
		gw.InjectFault(fault.OpQueryPayment, fault.Timeout, 0)
		shop := checkingShop(b, gw)
		shop.ProviderTimeout = time.Hour
		shop.CheckBudget = 100 * time.Millisecond
		nos := b.placeWith(t, p, sandbox.Name, 40)
		b.clock.Advance(2 * time.Minute)

		type answer struct {
			rs  []domain.CloseResult
			err error
		}
		done := make(chan answer, 1)
		go func() {
			rs, err := shop.CloseOrders(b.ctx, nos, domain.CloseTimeout)
			done <- answer{rs, err}
		}()
		var got answer
		select {
		case got = <-done:
		case <-time.After(60 * time.Second):
			t.Fatal("the pre-close check outlived its budget by far (a gateway that never answers held it)")
		}
		if got.err != nil {
			t.Fatal(got.err)
		}
		if o := outcomes(got.rs); o[domain.CloseDeferred] != len(nos) {
			t.Fatalf("outcomes %v, want all %d deferred", o, len(nos))
		}
		pending, err := b.db.NewSelect().Table("orders").Where("status = ?", domain.OrderPending).Count(b.ctx)
		if err != nil || pending != int64(len(nos)) {
			t.Fatalf("%d PENDING orders (%v), want all %d", pending, err, len(nos))
		}
		b.mustAudit(t)
	})
}

// TestProviderBreaker: a provider whose calls keep failing is not called
// any more for a while: its orders are deferred (never closed unchecked)
// while another provider's orders close; once the cooldown has passed and
// the provider answers again, its orders close too.
func TestProviderBreaker(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{OrderTTL: time.Minute})
		p := b.product(t, 500, 60)
		down := newCountedGateway(t, "down", time.Second)
		up := newCountedGateway(t, "up", time.Second)
		down.InjectFault(fault.OpQueryPayment, fault.Server5xx, 0)
		shop := checkingShop(b, down, up)
		shop.BreakerFailures, shop.BreakerCooldown = 3, time.Minute
		downNos := b.placeWith(t, p, "down", 40)
		upNos := b.placeWith(t, p, "up", 5)
		b.clock.Advance(2 * time.Minute)

		rs, err := shop.CloseOrders(b.ctx, append(downNos, upNos...), domain.CloseTimeout)
		if err != nil {
			t.Fatal(err)
		}
		if o := outcomes(rs); o[domain.CloseDeferred] != len(downNos) || o[domain.Closed] != len(upNos) {
			t.Fatalf("outcomes %v, want the %d orders of the failing provider deferred and the other %d closed", o, len(downNos), len(upNos))
		}
		// Calls already in flight when it opened may finish; no more start.
		if n := down.calls.Load(); n >= int64(len(downNos)) {
			t.Fatalf("%d calls to a provider failing every call, for %d orders: the breaker never opened", n, len(downNos))
		}
		if b.alerts.count("provider_unavailable") != 1 {
			t.Fatalf("alerts %v, want one provider_unavailable", b.alerts.kinds())
		}

		// Open: not called at all.
		before := down.calls.Load()
		rs, err = shop.CloseOrders(b.ctx, downNos, domain.CloseTimeout)
		if err != nil {
			t.Fatal(err)
		}
		if o := outcomes(rs); o[domain.CloseDeferred] != len(downNos) || down.calls.Load() != before {
			t.Fatalf("outcomes %v, %d calls while the breaker is open; want all deferred, no call", o, down.calls.Load()-before)
		}

		// Cooled down and healed: its orders close.
		down.InjectFault(fault.OpQueryPayment, fault.None, 0)
		b.clock.Advance(time.Minute)
		rs, err = shop.CloseOrders(b.ctx, downNos, domain.CloseTimeout)
		if err != nil {
			t.Fatal(err)
		}
		if o := outcomes(rs); o[domain.Closed] != len(downNos) {
			t.Fatalf("outcomes %v once the provider healed; want all %d closed", o, len(downNos))
		}
		b.mustAudit(t)
	})
}

// TestProviderBreakerProbesOnce: once a provider's breaker has cooled
// down, one call goes through to see whether the provider is back; the
// other orders of the batch are deferred without a call until that one
// answers. Here the provider still hangs: the probe times out, the
// breaker opens again, and the batch made that one call, not one per
// free slot of the check (16 calls, each held a whole timeout).
func TestProviderBreakerProbesOnce(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{OrderTTL: time.Minute})
		p := b.product(t, 500, 40)
		down := newCountedGateway(t, "down", 200*time.Millisecond)
		down.InjectFault(fault.OpQueryPayment, fault.Timeout, 0)
		shop := checkingShop(b, down)
		shop.ProviderTimeout, shop.CheckBudget = time.Hour, time.Hour
		shop.BreakerFailures, shop.BreakerCooldown = 1, time.Minute
		nos := b.placeWith(t, p, "down", 30)
		b.clock.Advance(2 * time.Minute)

		// Open it: the first call fails.
		if _, err := shop.CloseOrders(b.ctx, nos[:1], domain.CloseTimeout); err != nil {
			t.Fatal(err)
		}
		if b.alerts.count("provider_unavailable") != 1 {
			t.Fatalf("alerts %v, want one provider_unavailable", b.alerts.kinds())
		}

		b.clock.Advance(time.Minute)
		before := down.calls.Load()
		rs, err := shop.CloseOrders(b.ctx, nos[1:], domain.CloseTimeout)
		if err != nil {
			t.Fatal(err)
		}
		if o := outcomes(rs); o[domain.CloseDeferred] != len(nos)-1 {
			t.Fatalf("outcomes %v, want all %d deferred", o, len(nos)-1)
		}
		if n := down.calls.Load() - before; n != 1 {
			t.Fatalf("%d calls to a provider still down after its cooldown; want the one probe", n)
		}
		if b.alerts.count("provider_unavailable") != 1 {
			t.Fatalf("alerts %v: the failed probe alerted again", b.alerts.kinds())
		}
		b.mustAudit(t)
	})
}
