package domain_test

import (
	"context"
	"database/sql/driver"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/domain/domaintest"
)

// roundTrips counts what kami asks of a database server through one pool:
// each BEGIN, statement, COMMIT and ROLLBACK is a round trip.
type roundTrips struct{ n atomic.Int64 }

func (r *roundTrips) wrap(c driver.Connector) driver.Connector {
	return connWrapper{c, func(conn driver.Conn) driver.Conn { return &countingConn{passConn{conn}, r} }}
}

type countingConn struct {
	passConn
	r *roundTrips
}

func (c *countingConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	c.r.n.Add(1)
	tx, err := c.Conn.(driver.ConnBeginTx).BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return countingTx{tx, c.r}, nil
}

func (c *countingConn) ExecContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Result, error) {
	c.r.n.Add(1)
	return c.Conn.(driver.ExecerContext).ExecContext(ctx, q, args)
}

func (c *countingConn) QueryContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Rows, error) {
	c.r.n.Add(1)
	return c.Conn.(driver.QueryerContext).QueryContext(ctx, q, args)
}

// countedLedger is a ledger over a fresh database of kind k whose round
// trips rt counts.
func countedLedger(t *testing.T, k dbtest.Kind, cfg domain.Config) (*domain.Ledger, *bun.DB, *roundTrips) {
	t.Helper()
	rt := &roundTrips{}
	db := dbtest.OpenWith(t, k, domain.DBOptions{WrapConnector: rt.wrap})
	sealer, err := domain.NewSealer(domaintest.Key())
	if err != nil {
		t.Fatal(err)
	}
	return domain.NewLedger(db, sealer, cfg, &alerts{}), db, rt
}

type countingTx struct {
	driver.Tx
	r *roundTrips
}

func (t countingTx) Commit() error   { t.r.n.Add(1); return t.Tx.Commit() }
func (t countingTx) Rollback() error { t.r.n.Add(1); return t.Tx.Rollback() }

// TestPlaceAndPayRoundTrips: a batch of orders and a batch of payments
// wait for the database only a fixed, small number of times, whatever
// their size: on PostgreSQL a batch's writes are one statement (placing:
// BEGIN, the products with the database's clock, the cards, the writes,
// COMMIT; paying: the orders, BEGIN, the writes, COMMIT). A round trip is
// what a batch mostly waits for on a busy machine, and the next batch
// waits for this one. Run with the database's own clock, which the
// products' query reads.
func TestPlaceAndPayRoundTrips(t *testing.T) {
	t.Parallel()
	want := map[dbtest.Kind]struct{ place, pay int64 }{
		dbtest.Postgres: {place: 5, pay: 4},
		dbtest.MySQL:    {place: 9, pay: 9}, // no data-modifying WITH: a statement per write (pending_order's and card_for_sale's among them)
	}
	for _, k := range []dbtest.Kind{dbtest.Postgres, dbtest.MySQL} {
		t.Run(string(k), func(t *testing.T) {
			t.Parallel()
			const ttl = 10 * time.Minute
			l, db, rt := countedLedger(t, k, domain.Config{OrderTTL: ttl})
			ctx := context.Background()
			name, price := "Game key", int64(500)
			p, err := l.CreateProduct(ctx, domain.ProductInput{Name: &name, PriceFen: &price}, "test")
			if err != nil {
				t.Fatal(err)
			}
			if _, err := l.ImportCards(ctx, p.ID, []string{"RT-1", "RT-2"}, "test"); err != nil {
				t.Fatal(err)
			}

			before := rt.n.Load()
			placed, err := l.PlaceOrder(ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 2, Contact: "rt@example.com", Provider: "sandbox"})
			if err != nil {
				t.Fatal(err)
			}
			if got := rt.n.Load() - before; got > want[k].place {
				t.Errorf("placing an order took %d round trips, want at most %d", got, want[k].place)
			}
			o := placed.Order
			dbNow, err := l.DBNow(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if !o.ExpiresAt.Equal(o.CreatedAt.Add(ttl)) || o.CreatedAt.After(dbNow) || dbNow.Sub(o.CreatedAt) > time.Minute {
				t.Errorf("order created %v, expires %v; the database's clock says %v", o.CreatedAt, o.ExpiresAt, dbNow)
			}
			stored, err := l.Order(ctx, o.OrderNo)
			if err != nil || !stored.CreatedAt.Equal(o.CreatedAt) || !stored.ExpiresAt.Equal(o.ExpiresAt) || stored.Status != domain.OrderPending {
				t.Fatalf("stored %+v, %v; placed %+v", stored, err, o)
			}

			before = rt.n.Load()
			res, err := l.RecordPayment(ctx, domain.Payment{Provider: o.Provider, NotifyID: "N-RT", OrderNo: o.OrderNo,
				TradeNo: "T-RT", AmountFen: o.AmountFen, Raw: "{}"})
			if err != nil || res.Outcome != domain.PaymentDelivered {
				t.Fatalf("RecordPayment: %+v, %v", res, err)
			}
			if got := rt.n.Load() - before; got > want[k].pay {
				t.Errorf("a payment took %d round trips, want at most %d", got, want[k].pay)
			}
			var events int
			if err := db.NewSelect().Table("events").ColumnExpr("COUNT(*)").Where("subject = ? AND type = ?", o.OrderNo, domain.EventOrderPaid).Scan(ctx, &events); err != nil || events != 1 {
				t.Fatalf("%d order.paid events, %v", events, err)
			}
			vs, err := l.Audit(ctx)
			if err != nil || len(vs) > 0 {
				t.Fatalf("audit: %v %v", vs, err)
			}
		})
	}
}

// TestPaymentLocksTheOrderBeforeItsCards: the writes of a payment batch,
// one statement on PostgreSQL, still lock the order's row before its
// cards, as the close path does (orders first, in order_no order): a
// payment and a close racing for one order wait for each other instead of
// deadlocking. PostgreSQL runs a data-modifying WITH part when the outer
// query first reads it, and writeAll reads them in the order given; this
// holds it to that. A transaction holds one of the order's cards; the
// payment, blocked on that card, must already hold the order.
func TestPaymentLocksTheOrderBeforeItsCards(t *testing.T) {
	t.Parallel()
	db := dbtest.Open(t, dbtest.Postgres)
	b := setup(t, db, domain.Config{OrderTTL: time.Hour})
	p := b.product(t, 500, 2)
	o := b.order(t, p, 2).Order

	holder, err := db.BeginTx(b.ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback()
	var held int64
	if err := holder.NewRaw("SELECT id FROM card_stock WHERE order_no = ? ORDER BY id DESC LIMIT 1 FOR UPDATE", o.OrderNo).Scan(b.ctx, &held); err != nil {
		t.Fatal(err)
	}
	paid := make(chan error, 1)
	go func() {
		res, err := b.ledger.RecordPayment(b.ctx, domain.Payment{Provider: o.Provider, NotifyID: "N-LO", OrderNo: o.OrderNo,
			TradeNo: "T-LO", AmountFen: o.AmountFen, Raw: "{}"})
		if err == nil && res.Outcome != domain.PaymentDelivered {
			err = fmt.Errorf("outcome %s", res.Outcome)
		}
		paid <- err
	}()
	// A waiter on a row holds the row's tuple lock while it waits.
	waitFor(t, "the payment waiting for the held card", func() bool {
		var n int
		err := db.NewRaw("SELECT count(*) FROM pg_locks WHERE locktype = 'tuple' AND relation = 'card_stock'::regclass").Scan(b.ctx, &n)
		return err == nil && n > 0
	})
	probe, err := db.BeginTx(b.ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	var no string
	err = probe.NewRaw("SELECT order_no FROM orders WHERE order_no = ? FOR UPDATE NOWAIT", o.OrderNo).Scan(b.ctx, &no)
	probe.Rollback()
	if !isLockNotAvailable(err) {
		t.Errorf("the order's row was free while its payment waited for a card (%v): the cards were locked first", err)
	}
	holder.Rollback()
	if err := <-paid; err != nil {
		t.Fatalf("RecordPayment: %v", err)
	}
}

// isLockNotAvailable is PostgreSQL's 55P03, a NOWAIT that found the row locked.
func isLockNotAvailable(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "55P03"
}
