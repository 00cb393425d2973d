package domain_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
)

// deadlockLog records every statement the database ended with a deadlock
// (PostgreSQL's 40P01, MariaDB's 1213): a retry hides them from the
// callers, not from it.
type deadlockLog struct{ n atomic.Int64 }

func (d *deadlockLog) BeforeQuery(ctx context.Context, _ *bun.QueryEvent) context.Context { return ctx }

func (d *deadlockLog) AfterQuery(_ context.Context, ev *bun.QueryEvent) {
	var pgErr *pgconn.PgError
	var myErr *mysql.MySQLError
	if errors.As(ev.Err, &pgErr) && pgErr.Code == "40P01" || errors.As(ev.Err, &myErr) && myErr.Number == 1213 {
		d.n.Add(1)
	}
}

// stallOnce holds the first statement containing match, once armed, after
// it ran and before its transaction goes on (the transaction keeps what
// it locked), until released.
type stallOnce struct {
	match   string
	armed   atomic.Bool
	entered chan struct{}
	release chan struct{}
}

func newStallOnce(match string) *stallOnce {
	return &stallOnce{match: match, entered: make(chan struct{}), release: make(chan struct{})}
}

func (s *stallOnce) BeforeQuery(ctx context.Context, _ *bun.QueryEvent) context.Context { return ctx }

func (s *stallOnce) AfterQuery(_ context.Context, ev *bun.QueryEvent) {
	if ev.Err == nil && strings.Contains(ev.Query, s.match) && s.armed.CompareAndSwap(true, false) {
		close(s.entered)
		<-s.release
	}
}

// tupleWaiters counts the row-lock waits on the test's orders table:
// granted, a transaction first in line for a row someone holds; not
// granted, one queued behind it.
func tupleWaiters(t *testing.T, db *bun.DB, granted bool) int {
	t.Helper()
	var n int
	if err := db.NewRaw("SELECT count(*) FROM pg_locks WHERE locktype = 'tuple' AND relation = 'orders'::regclass AND granted = ?", granted).
		Scan(context.Background(), &n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestPaymentBatchAndCloseBatchNeverDeadlock: a payment batch locks its
// orders in order_no order whatever order its payments arrived in, as a
// close batch does, so the two never hold one order each while waiting
// for the other's. The payments of x < y arrive y first. A transaction
// holds x; a close of x and y waits for it, first in line; the payment
// batch queues behind on x. Locking in arrival order, the batch would
// already hold y: released, the close takes x and waits for y, the batch
// waits for x, and PostgreSQL ends one of them a second later (40P01).
func TestPaymentBatchAndCloseBatchNeverDeadlock(t *testing.T) {
	t.Parallel()
	deadlocks := &deadlockLog{}
	db := dbtest.Open(t, dbtest.Postgres).WithQueryHook(deadlocks)
	b := setup(t, db, domain.Config{OrderTTL: time.Hour})
	p := b.product(t, 500, 2)
	x, y := b.order(t, p, 1).Order, b.order(t, p, 1).Order
	if y.OrderNo < x.OrderNo {
		x, y = y, x
	}
	holder, err := db.BeginTx(b.ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback()
	if _, err := holder.ExecContext(b.ctx, "SELECT 1 FROM orders WHERE order_no = ? FOR UPDATE", x.OrderNo); err != nil {
		t.Fatal(err)
	}

	var wg sync.WaitGroup
	wg.Go(func() {
		if _, err := b.ledger.CloseOrders(b.ctx, []string{x.OrderNo, y.OrderNo}, domain.CloseCancel); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	waitFor(t, "the close waiting for x", func() bool { return tupleWaiters(t, db, true) == 1 })
	wg.Go(func() {
		ps := []domain.Payment{
			{Provider: y.Provider, NotifyID: "N-Y", OrderNo: y.OrderNo, TradeNo: "T-Y", AmountFen: y.AmountFen, Raw: "{}"},
			{Provider: x.Provider, NotifyID: "N-X", OrderNo: x.OrderNo, TradeNo: "T-X", AmountFen: x.AmountFen, Raw: "{}"},
		}
		_, errs := b.ledger.RecordPaymentsForTest(b.ctx, ps)
		for _, err := range errs {
			if err != nil {
				t.Errorf("payment: %v", err)
			}
		}
	})
	waitFor(t, "the payment batch queued behind the close", func() bool { return tupleWaiters(t, db, false) == 1 })
	if err := holder.Rollback(); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	if n := deadlocks.n.Load(); n > 0 {
		t.Errorf("%d statements ended in a deadlock", n)
	}
	for _, o := range []*domain.Order{x, y} {
		got, err := b.ledger.Order(b.ctx, o.OrderNo)
		if err != nil {
			t.Fatal(err)
		}
		// The close came first: each payment is then a late one, refunded.
		if got.Status != domain.OrderRefunding {
			t.Errorf("order %s ended %s", o.OrderNo, got.Status)
		}
	}
	b.mustAudit(t)
}

// stalledPair opens a database whose first statement containing match,
// once armed, stalls (newStallOnce), and places two orders of 2 cards.
func stalledPair(t *testing.T, match string) (*stallOnce, *bun.DB, *bundle, *domain.Order, *domain.Order) {
	t.Helper()
	stall := newStallOnce(match)
	db := dbtest.Open(t, dbtest.Postgres).WithQueryHook(stall)
	b := setup(t, db, domain.Config{OrderTTL: time.Hour})
	p := b.product(t, 500, 4)
	return stall, db, b, b.order(t, p, 2).Order, b.order(t, p, 2).Order
}

// TestBatchesTestTheStatusAsLocked: a close batch and a payment batch read
// each order's status from the row they locked, after waiting for the
// transaction that held it, not from the statement's snapshot taken while
// it was still PENDING. A payment is held open after its writes (the order
// PAID, its cards SOLD, not committed); a close of it and another order
// waits for it, then must leave it PAID. And the other way round: a close
// held open, a payment batch of its order and another must not pay it
// (its payment is late: refunded).
func TestBatchesTestTheStatusAsLocked(t *testing.T) {
	t.Parallel()
	t.Run("close after pay", func(t *testing.T) {
		t.Parallel()
		stall, db, b, x, y := stalledPair(t, `UPDATE "orders" SET status = 'PAID'`)

		stall.armed.Store(true)
		paid := make(chan *domain.PaymentResult, 1)
		go func() {
			res, err := b.ledger.RecordPayment(b.ctx, domain.Payment{Provider: x.Provider, NotifyID: "N-X", OrderNo: x.OrderNo,
				TradeNo: "T-X", AmountFen: x.AmountFen, Raw: "{}"})
			if err != nil {
				res = &domain.PaymentResult{Outcome: domain.PaymentOutcome("error: " + err.Error())}
			}
			paid <- res
		}()
		receive(t, "the payment's writes", stall.entered)
		closed := make(chan []domain.CloseResult, 1)
		go func() {
			rs, err := b.ledger.CloseOrders(b.ctx, []string{x.OrderNo, y.OrderNo}, domain.CloseCancel)
			if err != nil {
				t.Errorf("close: %v", err)
			}
			closed <- rs
		}()
		waitFor(t, "the close waiting for the payment", func() bool { return tupleWaiters(t, db, true) == 1 })
		close(stall.release)
		if res := <-paid; res.Outcome != domain.PaymentDelivered {
			t.Errorf("payment: %s", res.Outcome)
		}
		for _, r := range <-closed {
			if want := map[string]domain.CloseOutcome{x.OrderNo: domain.CloseSkipped, y.OrderNo: domain.Closed}[r.OrderNo]; r.Outcome != want {
				t.Errorf("close of %s: %s, want %s", r.OrderNo, r.Outcome, want)
			}
		}
		if got, cards := b.status(t, x.OrderNo), b.cardStatuses(t, x.OrderNo); got != domain.OrderPaid || cards[domain.CardSold] != 2 || len(cards) != 1 {
			t.Errorf("the paid order ended %s with cards %v", got, cards)
		}
		b.mustAudit(t)
	})
	t.Run("pay after close", func(t *testing.T) {
		t.Parallel()
		stall, db, b, x, y := stalledPair(t, `UPDATE "orders" SET status = 'CLOSED'`)

		stall.armed.Store(true)
		closed := make(chan error, 1)
		go func() {
			_, err := b.ledger.CloseOrders(b.ctx, []string{x.OrderNo}, domain.CloseCancel)
			closed <- err
		}()
		receive(t, "the close's write", stall.entered)
		var results []*domain.PaymentResult
		var errs []error
		done := make(chan struct{})
		go func() {
			defer close(done)
			results, errs = b.ledger.RecordPaymentsForTest(b.ctx, []domain.Payment{
				{Provider: x.Provider, NotifyID: "N-X", OrderNo: x.OrderNo, TradeNo: "T-X", AmountFen: x.AmountFen, Raw: "{}"},
				{Provider: y.Provider, NotifyID: "N-Y", OrderNo: y.OrderNo, TradeNo: "T-Y", AmountFen: y.AmountFen, Raw: "{}"},
			})
		}()
		waitFor(t, "the payment batch waiting for the close", func() bool { return tupleWaiters(t, db, true) == 1 })
		close(stall.release)
		if err := <-closed; err != nil {
			t.Fatalf("close: %v", err)
		}
		<-done
		for i, want := range []domain.PaymentOutcome{domain.PaymentLateRefund, domain.PaymentDelivered} {
			if errs[i] != nil || results[i] == nil || results[i].Outcome != want {
				t.Errorf("payment %d: %+v, %v; want %s", i, results[i], errs[i], want)
			}
		}
		if got, cards := b.status(t, x.OrderNo), b.cardStatuses(t, x.OrderNo); got != domain.OrderRefunding || cards[domain.CardRecycled] != 2 || len(cards) != 1 {
			t.Errorf("the closed order ended %s with cards %v", got, cards)
		}
		b.mustAudit(t)
	})
}

// status is the order's status as stored.
func (b *bundle) status(t *testing.T, orderNo string) domain.OrderStatus {
	t.Helper()
	o, err := b.ledger.Order(b.ctx, orderNo)
	if err != nil {
		t.Fatal(err)
	}
	return o.Status
}

// finishesUnblocked waits until what (finished tells when it is done, its
// error sent back for receive to read) is done or waits on a lock (waited),
// then rolls back tx, the transaction holding that lock; whether what
// waited.
func finishesUnblocked(t *testing.T, what string, finished chan error, tx bun.Tx, waited func() (bool, error)) (blocked bool) {
	t.Helper()
	var err error
	done := false
	waitFor(t, what+" done, or waiting on another transaction's lock", func() bool {
		select {
		case err = <-finished:
			done = true
			return true
		default:
		}
		w, werr := waited()
		if werr != nil {
			t.Fatal(werr)
		}
		return w
	})
	if done {
		finished <- err // for receive
	}
	if rerr := tx.Rollback(); rerr != nil {
		t.Fatal(rerr)
	}
	return !done
}

// TestCloseWaitsOnlyForItsOrders: a close batch locks its own orders and
// no other, so another order locked by a transaction still open (a
// payment under way) does not hold the close up. MariaDB plans the close's
// SELECT … WHERE order_no IN (…) ORDER BY order_no FOR UPDATE over a batch
// that is most of a small table as a scan of the whole table, sorted
// afterwards, unless told to read orders_order_no; a locking scan locks
// each row it reads before its WHERE drops it, so the close waited for
// the other order (and locked its own in id order, not order_no order).
// The wait is seen as the server reports it (sessionProbes), never timed.
// SQLite has one writer.
func TestCloseWaitsOnlyForItsOrders(t *testing.T) {
	t.Parallel()
	for _, c := range sessionProbes {
		t.Run(string(c.kind), func(t *testing.T) {
			t.Parallel()
			db := dbtest.Open(t, c.kind)
			b := setup(t, db, domain.Config{})
			p := b.product(t, 100, 5)
			other := b.order(t, p, 1).Order
			var nos []string
			for range 3 {
				nos = append(nos, b.order(t, p, 1).Order.OrderNo)
			}
			tx, err := db.BeginTx(b.ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = tx.Rollback() }) // before the database is dropped
			var id int64
			if err := tx.QueryRowContext(b.ctx, c.idQuery).Scan(&id); err != nil {
				t.Fatal(err)
			}
			var no string
			if err := tx.NewRaw("SELECT order_no FROM orders WHERE order_no = ? FOR UPDATE", other.OrderNo).Scan(b.ctx, &no); err != nil {
				t.Fatal(err)
			}
			closed := make(chan error, 1)
			go func() {
				_, err := b.ledger.CloseOrders(b.ctx, nos, domain.CloseCancel)
				closed <- err
			}()
			if finishesUnblocked(t, "the close", closed, tx, func() (bool, error) { return c.waited("orders")(b.ctx, db, id) }) {
				t.Errorf("the close of %d orders waits for another order's lock", len(nos))
			}
			if closeErr := receive(t, "the close", closed); closeErr != nil {
				t.Fatalf("CloseOrders: %v", closeErr)
			}
			for _, no := range nos {
				if s := b.status(t, no); s != domain.OrderClosed {
					t.Fatalf("order %s %s, want CLOSED", no, s)
				}
			}
			if s := b.status(t, other.OrderNo); s != domain.OrderPending {
				t.Fatalf("the other order %s, want PENDING", s)
			}
			b.mustAudit(t)
		})
	}
}

// rowWaiters counts the transactions first in line for a row of table
// that another holds (each holds the row's tuple lock while it waits).
func rowWaiters(t *testing.T, db *bun.DB, table string) int {
	t.Helper()
	var n int
	if err := db.NewRaw("SELECT count(*) FROM pg_locks WHERE locktype = 'tuple' AND relation = ?::regclass AND granted",
		table).Scan(context.Background(), &n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestCloseAndRecallTakeTurns: on PostgreSQL a close locks its orders'
// LOCKED cards as it reads them and only then share-locks their batches
// (lockedCardsPG), where a recall locks the batch (its UPDATE) and then
// moves the batch's UNSOLD and RECYCLED cards, never a LOCKED one. Each
// holds what it locked while the other waits for it: neither ever waits
// for a row the waiting one holds (no deadlock), and either way the card
// of the closed order ends WITHDRAWN, never on sale.
func TestCloseAndRecallTakeTurns(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name, holder, match string
	}{
		{name: "recall holds the batch", holder: "recall", match: `UPDATE "card_batch" SET status = 'RECALLED'`},
		{name: "close holds its cards and batch", holder: "close", match: `b AS MATERIALIZED (SELECT id, status FROM card_batch`},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			deadlocks := &deadlockLog{}
			stall := newStallOnce(c.match)
			db := dbtest.Open(t, dbtest.Postgres).WithQueryHook(deadlocks).WithQueryHook(stall)
			b := setup(t, db, domain.Config{OrderTTL: time.Hour})
			p := b.product(t, 500, 3)
			batch := b.onlyBatch(t, p.ID)
			o := b.order(t, p, 1).Order

			stall.armed.Store(true)
			type closed struct {
				rs  []domain.CloseResult
				err error
			}
			type recalled struct {
				rec *domain.Recall
				err error
			}
			closeDone, recallDone := make(chan closed, 1), make(chan recalled, 1)
			closeNow := func() {
				rs, err := b.ledger.CloseOrders(b.ctx, []string{o.OrderNo}, domain.CloseCancel)
				closeDone <- closed{rs, err}
			}
			recallNow := func() {
				rec, err := b.ledger.RecallBatch(b.ctx, batch, "supplier said so", "admin")
				recallDone <- recalled{rec, err}
			}
			first, second := recallNow, closeNow
			if c.holder == "close" {
				first, second = closeNow, recallNow
			}
			go first()
			receive(t, "the "+c.holder+" holding its locks", stall.entered)
			go second()
			waitFor(t, "the other waiting for the card's batch", func() bool { return rowWaiters(t, db, "card_batch") == 1 })
			if c.holder == "recall" {
				// The close waits for the batch holding the card it read.
				_, err := db.ExecContext(b.ctx, "SELECT 1 FROM card_stock WHERE order_no = ? FOR NO KEY UPDATE NOWAIT", o.OrderNo)
				if pgErr := (*pgconn.PgError)(nil); !errors.As(err, &pgErr) || pgErr.Code != "55P03" {
					t.Errorf("the waiting close's card was free: %v", err)
				}
			}
			close(stall.release)
			cl, re := receive(t, "the close", closeDone), receive(t, "the recall", recallDone)
			if cl.err != nil || re.err != nil {
				t.Fatalf("close: %v; recall: %v", cl.err, re.err)
			}
			r := cl.rs[0]
			switch c.holder {
			case "recall": // the close reads the batch RECALLED
				if r.Outcome != domain.Closed || r.Withdrawn != 1 || r.Released != 0 || re.rec.Withdrawn != 2 || re.rec.Locked != 1 {
					t.Errorf("close %+v, recall %+v", r, re.rec)
				}
			case "close": // the recall finds the card RECYCLED
				if r.Outcome != domain.Closed || r.Withdrawn != 0 || r.Released != 1 || re.rec.Withdrawn != 3 || re.rec.Locked != 0 {
					t.Errorf("close %+v, recall %+v", r, re.rec)
				}
			}
			if got := b.cardStatuses(t, o.OrderNo); got[domain.CardWithdrawn] != 1 || len(got) != 1 {
				t.Errorf("the closed order's card: %v, want WITHDRAWN", got)
			}
			if rows := forSale(t, db, p.ID); len(rows) != 0 {
				t.Errorf("cards %v of the recalled batch on sale", rows)
			}
			if n := deadlocks.n.Load(); n > 0 {
				t.Errorf("%d statements ended in a deadlock", n)
			}
			b.mustAudit(t)
		})
	}
}

// TestBatchMovesLeaveTheirStatuses: a batch's UPDATE on PostgreSQL
// (transitionLocked) fetches each row at the place its lock read; a row
// another transaction changed and committed meanwhile is locked at its
// new place, which the UPDATE's snapshot does not see, and is skipped
// whatever its status. That is right only while every change of a
// PENDING order or a LOCKED card takes it out of that status: no
// transition may move an order from PENDING to PENDING or a card from
// LOCKED to LOCKED (a "touch" of such a row would make the close and the
// payment batches skip it).
func TestBatchMovesLeaveTheirStatuses(t *testing.T) {
	t.Parallel()
	held := map[string]string{"orders": string(domain.OrderPending), "card_stock": string(domain.CardLocked)}
	for _, tr := range domain.Transitions {
		if s, ok := held[tr.Table]; ok && slices.Contains(tr.From, s) && tr.To == s {
			t.Errorf("%s moves %s rows from %s to %s: a batch's UPDATE racing it would skip the row", tr.Name, tr.Table, s, s)
		}
	}
}
