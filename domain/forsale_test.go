package domain_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect"

	"kami/domain"
	"kami/domain/dbtest"
)

// forSale reads card_for_sale's card ids of product, in order.
func forSale(t testing.TB, db bun.IDB, productID int64) []int64 {
	t.Helper()
	var ids []int64
	if err := db.NewSelect().Model((*domain.CardForSale)(nil)).Column("card_id").Where("product_id = ?", productID).
		OrderExpr("card_id").Scan(context.Background(), &ids); err != nil {
		t.Fatal(err)
	}
	return ids
}

// cardsIn reads the ids of product's cards in one of statuses, in order.
func cardsIn(t testing.TB, db bun.IDB, productID int64, statuses ...domain.CardStatus) []int64 {
	t.Helper()
	var ids []int64
	if err := db.NewSelect().Table("card_stock").Column("id").Where("product_id = ?", productID).
		Where("status IN (?)", bun.List(statuses)).OrderExpr("id").Scan(context.Background(), &ids); err != nil {
		t.Fatal(err)
	}
	return ids
}

// TestCardsForSaleFollowTheCards: a card has its row in card_for_sale
// exactly while it is for sale (UNSOLD or RECYCLED), through an import, a
// placement, a payment, a close, a late payment that takes its recycled
// cards back, and a recall; the sellable counts read the rows.
func TestCardsForSaleFollowTheCards(t *testing.T) {
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{LatePayment: domain.LateDeliver})
		p := b.product(t, 100, 10)
		check := func(step string, sellable int) {
			t.Helper()
			rows, cards := forSale(t, db, p.ID), cardsIn(t, db, p.ID, domain.CardUnsold, domain.CardRecycled)
			if !slices.Equal(rows, cards) || len(rows) != sellable {
				t.Fatalf("after %s: card_for_sale %v, cards for sale %v; want %d", step, rows, cards, sellable)
			}
			counts, err := b.ledger.SellableCounts(b.ctx, p.ID)
			if err != nil || counts[p.ID] != sellable {
				t.Fatalf("after %s: sellable counts %v, %v; want %d", step, counts, err, sellable)
			}
			b.mustAudit(t)
		}
		check("the import", 10)
		paid, closed := b.order(t, p, 2).Order, b.order(t, p, 3).Order
		check("two placements", 5)
		b.pay(t, paid, "T-1", "N-1")
		check("a payment", 5)
		if rs, err := b.ledger.CloseOrders(b.ctx, []string{closed.OrderNo}, domain.CloseCancel); err != nil || rs[0].Released != 3 {
			t.Fatalf("close: %+v, %v", rs, err)
		}
		check("a close", 8)
		if res := b.pay(t, closed, "T-2", "N-2"); res.Outcome != domain.PaymentLateDelivered {
			t.Fatalf("late payment: %s, want %s", res.Outcome, domain.PaymentLateDelivered)
		}
		check("a late payment delivered", 5)
		rec, err := b.ledger.RecallBatch(b.ctx, b.onlyBatch(t, p.ID), "supplier said so", "admin")
		if err != nil || rec.Withdrawn != 5 {
			t.Fatalf("recall: %+v, %v", rec, err)
		}
		check("a recall", 0)
	})
}

// TestPickedCardsLeftOverGoBackOnSale: a placement batch whose order
// wants more cards than are left holds the ones there are while it
// decides, and leaves them on sale: the order is SOLD_OUT, and the cards
// are still for sale to the next buyer.
func TestPickedCardsLeftOverGoBackOnSale(t *testing.T) {
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 2)
		big := orderInput(p, "big@example.com")
		big.Quantity = 3
		placed, errs := b.ledger.PlaceBatchForTest(b.ctx, []domain.PlaceOrderInput{big})
		if placed[0] != nil || domain.ErrorCode(errs[0]) != domain.ESOLDOUT {
			t.Fatalf("3 of 2 cards: %v, %v; want SOLD_OUT", placed[0], errs[0])
		}
		if rows := forSale(t, db, p.ID); len(rows) != 2 {
			t.Fatalf("card_for_sale after the refused order: %v; want both cards", rows)
		}
		b.mustAudit(t)
		if o := b.order(t, p, 2); o.Order.Quantity != 2 {
			t.Fatalf("the next buyer's order: %+v", o.Order)
		}
	})
}

// TestPickSkipsARowOfACardNotForSale: a row of card_for_sale left for a
// card that is LOCKED (by a process of a version from before the table,
// during an upgrade) is never picked: orders take the other cards
// instead of failing on it again and again. The audit names the row and
// the nightly repair removes it; a card for sale without its row is given
// one.
func TestPickSkipsARowOfACardNotForSale(t *testing.T) {
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 4)
		first := b.order(t, p, 1).Order
		locked := cardsIn(t, db, p.ID, domain.CardLocked)
		stale := []domain.CardForSale{{ProductID: p.ID, CardID: locked[0]}}
		if _, err := db.NewInsert().Model(&stale).Exec(b.ctx); err != nil {
			t.Fatal(err)
		}
		second := b.order(t, p, 2).Order
		if got := b.cardStatuses(t, second.OrderNo); got[domain.CardLocked] != 2 {
			t.Fatalf("the second order holds %v", got)
		}
		if got := b.cardStatuses(t, first.OrderNo); got[domain.CardLocked] != 1 {
			t.Fatalf("the first order holds %v after the second took its cards", got)
		}
		// And a card for sale whose row is missing.
		free := cardsIn(t, db, p.ID, domain.CardUnsold)
		if len(free) != 1 {
			t.Fatalf("cards left: %v", free)
		}
		if _, err := db.NewDelete().Model((*domain.CardForSale)(nil)).Where("card_id = ?", free[0]).Exec(b.ctx); err != nil {
			t.Fatal(err)
		}
		vs, err := b.ledger.Audit(b.ctx)
		if err != nil {
			t.Fatal(err)
		}
		named := map[string]bool{}
		for _, v := range vs {
			if v.Rule == "card_for_sale" {
				named[v.Subject] = true
			}
		}
		if !named[fmt.Sprint("card ", locked[0])] || !named[fmt.Sprint("card ", free[0])] || len(vs) != 2 {
			t.Errorf("audit: %v; want card_for_sale for cards %d and %d", vs, locked[0], free[0])
		}
		added, removed, err := b.ledger.RepairCardsForSale(b.ctx)
		if err != nil || added != 1 || removed != 1 {
			t.Fatalf("repair: added %d, removed %d, %v; want 1 and 1", added, removed, err)
		}
		b.mustAudit(t)
		if rows := forSale(t, db, p.ID); !slices.Equal(rows, free) {
			t.Fatalf("card_for_sale after the repair: %v, want %v", rows, free)
		}
		if added, removed, err := b.ledger.RepairCardsForSale(b.ctx); err != nil || added+removed != 0 {
			t.Errorf("a second repair: added %d, removed %d, %v", added, removed, err)
		}
		b.order(t, p, 1)
	})
}

// TestRaceLatePaymentAndPick: a late payment that takes its closed
// order's recycled card back races a new order for the same card, the
// product's only one: one of them gets it (the payment is delivered, or
// it is refunded and the new order placed), never both and never
// neither, and neither deadlocks: the late payment takes the card's row
// of card_for_sale before the card, as a pick does.
func TestRaceLatePaymentAndPick(t *testing.T) {
	t.Parallel()
	dbtest.Servers(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{LatePayment: domain.LateDeliver})
		outcomes := map[string]int{}
		for i := range 40 {
			p := b.product(t, 100, 1)
			o := b.order(t, p, 1).Order
			if rs, err := b.ledger.CloseOrders(b.ctx, []string{o.OrderNo}, domain.CloseCancel); err != nil || rs[0].Released != 1 {
				t.Fatalf("close: %+v, %v", rs, err)
			}
			var (
				wg      sync.WaitGroup
				res     *domain.PaymentResult
				payErr  error
				placed  *domain.PlacedOrder
				placeEr error
			)
			start := make(chan struct{})
			wg.Add(2)
			go func() {
				defer wg.Done()
				<-start
				res, payErr = b.ledger.RecordPayment(b.ctx, domain.Payment{Provider: o.Provider, NotifyID: fmt.Sprint("N-", i), OrderNo: o.OrderNo,
					TradeNo: fmt.Sprint("T-", i), AmountFen: o.AmountFen, PaidAt: b.clock.Now(), Raw: "{}"})
			}()
			go func() {
				defer wg.Done()
				<-start
				placed, placeEr = b.ledger.PlaceOrder(b.ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: fmt.Sprint("r", i), Provider: "sandbox"})
			}()
			close(start)
			wg.Wait()
			if payErr != nil {
				t.Fatalf("run %d: late payment: %v", i, payErr)
			}
			switch {
			case res.Outcome == domain.PaymentLateDelivered && domain.ErrorCode(placeEr) == domain.ESOLDOUT:
				outcomes["payment first"]++
			case res.Outcome == domain.PaymentLateRefund && placeEr == nil && placed != nil:
				outcomes["order first"]++
			default:
				t.Fatalf("run %d: payment %s, order %v, %v", i, res.Outcome, placed, placeEr)
			}
			if rows := forSale(t, db, p.ID); len(rows) != 0 {
				t.Fatalf("run %d: card_for_sale %v after the card went", i, rows)
			}
		}
		t.Logf("outcomes: %v", outcomes)
		b.mustAudit(t)
	})
}

// TestRecallWhilePickedCardsLeftOver: a recall that waits for a placement
// holding some of the batch's rows of card_for_sale, cards the placement
// picked and is left over with (an order of its batch wanted more than
// were left), finds those cards for sale once it commits and takes their
// rows with them: no row is left for a card the recall withdrew. (The
// place used to delete every picked row and insert the left-over ones
// again, rows the recall's DELETE, its snapshot taken before the place
// committed, never saw on PostgreSQL.)
func TestRecallWhilePickedCardsLeftOver(t *testing.T) {
	t.Parallel()
	dbtest.Servers(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 3)
		cards := cardsIn(t, db, p.ID, domain.CardUnsold)
		// A transaction holding the first card's row stops the place
		// after its pick, at its cards' UPDATE.
		hold, err := db.BeginTx(b.ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer hold.Rollback()
		if _, err := hold.ExecContext(b.ctx, "SELECT id FROM card_stock WHERE id = ? FOR UPDATE", cards[0]); err != nil {
			t.Fatal(err)
		}
		two, other := orderInput(p, "two@example.com"), orderInput(p, "other@example.com")
		two.Quantity, other.Quantity = 2, 2
		placedC := make(chan placeAnswer, 1)
		go func() {
			placed, errs := b.ledger.PlaceBatchForTest(b.ctx, []domain.PlaceOrderInput{two, other})
			placedC <- placeAnswer{placed, errs}
		}()
		waitFor(t, "the place waiting on the held card", func() bool { return lockWaits(t, db, "card_stock", 1) })
		recalled := make(chan error, 1)
		go func() {
			_, err := b.ledger.RecallBatch(b.ctx, b.onlyBatch(t, p.ID), "supplier said so", "admin")
			recalled <- err
		}()
		waitFor(t, "the recall waiting on the place's rows", func() bool { return lockWaits(t, db, "card_for_sale", 2) })
		if err := hold.Rollback(); err != nil {
			t.Fatal(err)
		}
		a := receive(t, "the place", placedC)
		if a.placed[0] == nil || domain.ErrorCode(a.errs[1]) != domain.ESOLDOUT {
			t.Fatalf("place: %v, %v; want the first placed, the second SOLD_OUT", a.placed, a.errs)
		}
		if err := receive(t, "the recall", recalled); err != nil {
			t.Fatal(err)
		}
		if rows, left := forSale(t, db, p.ID), cardsIn(t, db, p.ID, domain.CardUnsold, domain.CardRecycled); len(rows) != 0 || len(left) != 0 {
			t.Fatalf("after the recall: card_for_sale %v, cards for sale %v; want none", rows, left)
		}
		b.mustAudit(t)
	})
}

// lockWaits reports whether a session of db's database waits for a row
// lock of table (MySQL/MariaDB), or whether pg sessions of it wait for a
// lock (PostgreSQL, which does not say of which table).
func lockWaits(t *testing.T, db *bun.DB, table string, pg int) bool {
	t.Helper()
	ctx := context.Background()
	if db.Dialect().Name() == dialect.PG {
		var n int
		if err := db.NewRaw(`SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
			AND wait_event_type = 'Lock'`).Scan(ctx, &n); err != nil {
			t.Fatal(err)
		}
		return n >= pg
	}
	var database, typ, name, status string
	if err := db.QueryRowContext(ctx, "SELECT DATABASE()").Scan(&database); err != nil {
		t.Fatal(err)
	}
	if err := db.QueryRowContext(ctx, "SHOW ENGINE INNODB STATUS").Scan(&typ, &name, &status); err != nil {
		t.Fatal(err)
	}
	of := "of table `" + database + "`.`" + table + "`"
	for _, trx := range strings.Split(status, "\n---TRANSACTION ")[1:] {
		if _, lock, ok := strings.Cut(trx, "FOR THIS LOCK TO BE GRANTED:\nRECORD LOCKS "); ok {
			if line, _, _ := strings.Cut(lock, "\n"); strings.Contains(line, of) {
				return true
			}
		}
	}
	return false
}

// TestLatePaymentWhileItsCardIsSoldAndRecycledAgain: a late payment reads
// its closed order's recycled card, and before it locks the card's row
// another order picks the card and is closed, recycling it again: the
// card, for sale again, is now that order's. The payment must not take
// it (its order holds no card then, and the payment failed as
// INCONSISTENT): it is refunded, and the card stays for sale.
func TestLatePaymentWhileItsCardIsSoldAndRecycledAgain(t *testing.T) {
	t.Parallel()
	dbtest.Servers(t, func(t *testing.T, db *bun.DB) {
		// The late payment's lock of its card's row.
		hook := newStallHook(func(q string) bool {
			return strings.Contains(q, "card_for_sale") && strings.Contains(q, "FOR UPDATE") && !strings.Contains(q, "SKIP LOCKED")
		})
		db = db.WithQueryHook(hook)
		b := setup(t, db, domain.Config{LatePayment: domain.LateDeliver})
		p := b.product(t, 100, 1)
		first := b.order(t, p, 1).Order
		if rs, err := b.ledger.CloseOrders(b.ctx, []string{first.OrderNo}, domain.CloseCancel); err != nil || rs[0].Released != 1 {
			t.Fatalf("close: %+v, %v", rs, err)
		}
		hook.armed.Store(true)
		type payAnswer struct {
			res *domain.PaymentResult
			err error
		}
		paid := make(chan payAnswer, 1)
		go func() {
			res, err := b.ledger.RecordPayment(b.ctx, domain.Payment{Provider: first.Provider, NotifyID: "N-1", OrderNo: first.OrderNo,
				TradeNo: "T-1", AmountFen: first.AmountFen, PaidAt: b.clock.Now(), Raw: "{}"})
			paid <- payAnswer{res, err}
		}()
		receive(t, "the late payment at its card's row", hook.entered)
		second := b.order(t, p, 1).Order
		if rs, err := b.ledger.CloseOrders(b.ctx, []string{second.OrderNo}, domain.CloseCancel); err != nil || rs[0].Released != 1 {
			t.Fatalf("close of the second order: %+v, %v", rs, err)
		}
		close(hook.release)
		a := receive(t, "the late payment", paid)
		if a.err != nil || a.res.Outcome != domain.PaymentLateRefund {
			t.Fatalf("late payment: %+v, %v; want it refunded", a.res, a.err)
		}
		if rows, cards := forSale(t, db, p.ID), cardsIn(t, db, p.ID, domain.CardRecycled); len(rows) != 1 || !slices.Equal(rows, cards) {
			t.Fatalf("card_for_sale %v, recycled cards %v; want the card for sale", rows, cards)
		}
		b.mustAudit(t)
	})
}

// TestRepairBesideARecall: the nightly repair gives a card for sale its
// missing row while a recall of the card's batch is under way: the card
// ends withdrawn and without a row, whichever goes first. (The repair
// held only the card: a recall that had taken the batch's rows off sale,
// not seeing that one yet, then waited for the card and withdrew it,
// leaving the row the repair gave it.)
func TestRepairBesideARecall(t *testing.T) {
	t.Parallel()
	dbtest.Servers(t, func(t *testing.T, db *bun.DB) {
		// The repair's INSERT of the row.
		hook := newStallHook(func(q string) bool { return strings.Contains(q, "INSERT") && strings.Contains(q, "card_for_sale") })
		db = db.WithQueryHook(hook)
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 2)
		cards := cardsIn(t, db, p.ID, domain.CardUnsold)
		if _, err := db.NewDelete().Model((*domain.CardForSale)(nil)).Where("card_id = ?", cards[0]).Exec(b.ctx); err != nil {
			t.Fatal(err)
		}
		hook.armed.Store(true)
		type repairAnswer struct {
			added, removed int
			err            error
		}
		repaired := make(chan repairAnswer, 1)
		go func() {
			added, removed, err := b.ledger.RepairCardsForSale(b.ctx)
			repaired <- repairAnswer{added, removed, err}
		}()
		receive(t, "the repair at its INSERT", hook.entered)
		recalled := make(chan error, 1)
		go func() {
			_, err := b.ledger.RecallBatch(b.ctx, b.onlyBatch(t, p.ID), "supplier said so", "admin")
			recalled <- err
		}()
		// The recall waits (for the card, or, once fixed, the batch), or
		// the repair does; either way both finish once it goes on.
		waitFor(t, "the recall waiting", func() bool { return lockWaits(t, db, "card_stock", 1) || lockWaits(t, db, "card_batch", 1) })
		close(hook.release)
		if a := receive(t, "the repair", repaired); a.err != nil {
			t.Fatal(a.err)
		}
		if err := receive(t, "the recall", recalled); err != nil {
			t.Fatal(err)
		}
		if rows, left := forSale(t, db, p.ID), cardsIn(t, db, p.ID, domain.CardUnsold, domain.CardRecycled); len(rows) != 0 || len(left) != 0 {
			t.Fatalf("after the recall: card_for_sale %v, cards for sale %v; want none", rows, left)
		}
		b.mustAudit(t)
	})
}
