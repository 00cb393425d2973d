package domain_test

import (
	"context"
	"database/sql/driver"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgconn"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/domain/domaintest"
)

// deadlocks answers the nth UPDATE of webhook_delivery (counted from 1)
// as the database answers a deadlock's victim, without running it: the
// server rolled it back.
type deadlocks struct {
	nth, seen atomic.Int64
	victim    error
}

func (d *deadlocks) wrap(c driver.Connector) driver.Connector {
	return connWrapper{c, func(conn driver.Conn) driver.Conn { return &deadlockConn{passConn{conn}, d} }}
}

type deadlockConn struct {
	passConn
	d *deadlocks
}

func (c *deadlockConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	return c.Conn.(driver.ConnBeginTx).BeginTx(ctx, opts)
}

func (c *deadlockConn) ExecContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Result, error) {
	if strings.HasPrefix(q, "UPDATE ") && strings.Contains(q, "webhook_delivery") && c.d.seen.Add(1) == c.d.nth.Load() {
		return nil, c.d.victim
	}
	return c.Conn.(driver.ExecerContext).ExecContext(ctx, q, args)
}

func (c *deadlockConn) QueryContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Rows, error) {
	return c.Conn.(driver.QueryerContext).QueryContext(ctx, q, args)
}

// TestWebhookAttemptSurvivesADeadlock: the database picks a delivery's
// update as a deadlock's victim, once, as MariaDB does when two
// deliveries' attempts are taken and recorded at the same moment (the
// update taking an attempt scans the (status, next_attempt_at) index).
// Deliver runs it again: the delivery is sent once and recorded
// DELIVERED. Before, Deliver gave the error back: a victim recording the
// attempt left it sent but PENDING, to be sent again once its attempt's
// time was up, and in a test whose clock stands still never delivered
// (TestWebhookWorkersDeliverOnce/mysql/redis, waiting two minutes).
func TestWebhookAttemptSurvivesADeadlock(t *testing.T) {
	t.Parallel()
	for _, k := range []dbtest.Kind{dbtest.Postgres, dbtest.MySQL} {
		for _, c := range []struct {
			name string
			nth  int64
		}{{"taking the attempt", 1}, {"recording it", 2}} {
			t.Run(string(k)+"/"+c.name, func(t *testing.T) {
				t.Parallel()
				var victim error = &pgconn.PgError{Code: "40P01", Message: "deadlock detected"}
				if k == dbtest.MySQL {
					victim = &mysql.MySQLError{Number: 1213, Message: "Deadlock found when trying to get lock; try restarting transaction"}
				}
				d := &deadlocks{victim: victim}
				db := dbtest.OpenWith(t, k, domain.DBOptions{WrapConnector: d.wrap})
				b := setup(t, db, domain.Config{})
				h := b.hooks(domain.WebhookConfig{Timeout: domaintest.MinPatience})
				r := newReceiver(t, 200)
				b.endpoint(t, h, r.srv.URL, false, domain.EventOrderPaid)
				p := b.product(t, 500, 1)
				b.pay(t, b.order(t, p, 1).Order, "T1", "N1")
				ds := fanOut(t, b, h)
				if len(ds) != 1 {
					t.Fatalf("%d deliveries, want 1", len(ds))
				}
				d.seen.Store(0)
				d.nth.Store(c.nth)
				got, err := h.Deliver(b.ctx, ds[0].ID)
				if d.seen.Load() < c.nth {
					t.Fatalf("%d updates of the delivery, the deadlock was meant for update %d", d.seen.Load(), c.nth)
				}
				if err != nil || got.Status != domain.DeliveryDelivered || got.Attempts != 1 {
					t.Fatalf("Deliver after a deadlock: %+v, %v; want DELIVERED after one attempt", got, err)
				}
				if n := len(r.requests()); n != 1 {
					t.Fatalf("the endpoint got %d requests, want 1", n)
				}
			})
		}
	}
}
