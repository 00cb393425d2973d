package domain_test

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/providers"
	"kami/providers/sandbox"
)

func TestReconcileClosesStragglersAndReportsStaleRefunds(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{OrderTTL: 15 * time.Minute})
		sb, err := sandbox.New(sandbox.Config{Secret: "s", BaseURL: "http://kami.test"})
		if err != nil {
			t.Fatal(err)
		}
		shop := &domain.Shop{Ledger: b.ledger, Providers: providers.NewRegistry(sb)}
		p := b.product(t, 100, 4)
		straggler := b.order(t, p, 1).Order
		// A late payment whose refund will have been PROCESSING for over a day.
		late := b.order(t, p, 1).Order
		b.clock.Advance(time.Hour)
		b.ledger.CloseOrders(b.ctx, []string{late.OrderNo}, domain.CloseTimeout)
		refund := b.pay(t, late, "T-LATE", "N-LATE").Refund
		b.clock.Advance(25 * time.Hour)
		// Due 20 minutes ago: within the 30-minute grace, the queue's job.
		graceful := b.order(t, p, 1).Order
		b.clock.Advance(35 * time.Minute)

		rec := &domain.Reconciler{Shop: shop, Alerts: b.alerts}
		run, err := rec.Run(b.ctx)
		if err != nil {
			t.Fatal(err)
		}
		// Everything more than 30 minutes overdue is closed, cards and all.
		for _, o := range []*domain.Order{straggler} {
			got, _ := b.ledger.Order(b.ctx, o.OrderNo)
			if got.Status != domain.OrderClosed || b.cardStatuses(t, o.OrderNo)[domain.CardRecycled] != 1 {
				t.Errorf("%s: %s, cards %v", o.OrderNo, got.Status, b.cardStatuses(t, o.OrderNo))
			}
		}
		if got, _ := b.ledger.Order(b.ctx, graceful.OrderNo); got.Status != domain.OrderPending {
			t.Errorf("an order within the grace was closed: %s", got.Status)
		}
		if run.ClosedStragglers != 1 || run.StaleRefunds != 1 || run.Violations != 0 || run.Error != "" {
			t.Fatalf("run %+v", run)
		}
		if b.alerts.count("stragglers") != 1 || b.alerts.count("stale_refunds") != 1 {
			t.Fatalf("alerts %v", b.alerts.kinds())
		}
		runs, err := b.ledger.ReconcileRuns(b.ctx, 10)
		if err != nil || len(runs) != 1 || runs[0].Summary != run.Summary {
			t.Fatalf("recorded runs %+v %v", runs, err)
		}
		if r, _ := b.ledger.Refund(b.ctx, refund.RefundNo); r.Status != domain.RefundProcessing {
			t.Errorf("the reconciliation moved a refund: %s", r.Status)
		}
		b.mustAudit(t)
	})
}

// failingRepairer fails the repair of one product and counts the others.
type failingRepairer struct {
	failOn   int64
	repaired []int64
}

func (r *failingRepairer) Repair(_ context.Context, productID int64) (int, error) {
	if productID == r.failOn {
		return 0, errors.New("redis: connection refused")
	}
	r.repaired = append(r.repaired, productID)
	return 0, nil
}

// One product whose counter cannot be repaired does not leave the other
// products' counters unrepaired: the run goes on and names the failure.
func TestReconcileRepairsStockPastAFailedProduct(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{OrderTTL: 15 * time.Minute})
		shop := &domain.Shop{Ledger: b.ledger, Providers: providers.NewRegistry()}
		first, second, third := b.product(t, 100, 1), b.product(t, 100, 1), b.product(t, 100, 1)
		stock := &failingRepairer{failOn: first.ID}
		rec := &domain.Reconciler{Shop: shop, Alerts: b.alerts, Stock: stock}
		run, err := rec.Run(b.ctx)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Contains(stock.repaired, second.ID) || !slices.Contains(stock.repaired, third.ID) {
			t.Fatalf("repaired %v; products %d, %d must be repaired past the failure of %d", stock.repaired, second.ID, third.ID, first.ID)
		}
		if run.CountersRepaired != len(stock.repaired) {
			t.Errorf("run counts %d repaired counters, %d were", run.CountersRepaired, len(stock.repaired))
		}
		if !strings.Contains(run.Error, "stock counters") || !strings.Contains(run.Error, strconv.FormatInt(first.ID, 10)) {
			t.Errorf("run error %q does not name the failed product", run.Error)
		}
	})
}

// cancellingGate cancels the run's context when the first close of
// stragglers gives its stock back: the run is cut short between two pages.
type cancellingGate struct{ cancel context.CancelFunc }

func (g cancellingGate) Take(context.Context, int64, int) (bool, error) { return true, nil }
func (g cancellingGate) GiveBack(context.Context, int64, int) error {
	g.cancel()
	return nil
}

// TestReconcileReportsStragglersCutShort: a run whose context ends after
// a full page of stragglers (a shutdown, an admin's request gone) leaves
// the stragglers after it, and its record says the stragglers' part
// failed, not only the parts that came after it.
func TestReconcileReportsStragglersCutShort(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{OrderTTL: 15 * time.Minute})
		p := b.product(t, 100, 501)
		// A first page of 500 stragglers, and one due after them.
		first := b.order(t, p, 1).Order
		for range 499 {
			b.order(t, p, 1)
		}
		b.clock.Advance(time.Minute)
		last := b.order(t, p, 1).Order
		b.clock.Advance(2 * time.Hour)

		ctx, cancel := context.WithCancel(b.ctx)
		defer cancel()
		sb, err := sandbox.New(sandbox.Config{Secret: "s", BaseURL: "http://kami.test"})
		if err != nil {
			t.Fatal(err)
		}
		shop := &domain.Shop{Ledger: b.ledger, Providers: providers.NewRegistry(sb), Gate: cancellingGate{cancel}}
		run, err := (&domain.Reconciler{Shop: shop, Alerts: b.alerts}).Run(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if got, _ := b.ledger.Order(b.ctx, first.OrderNo); got.Status != domain.OrderClosed {
			t.Fatalf("the first page's straggler: %s", got.Status)
		}
		if got, _ := b.ledger.Order(b.ctx, last.OrderNo); got.Status != domain.OrderPending {
			t.Fatalf("the straggler after the cut: %s", got.Status)
		}
		if !strings.Contains(run.Error, "stragglers: ") {
			t.Errorf("the run's error does not name the stragglers it left: %q", run.Error)
		}
	})
}
