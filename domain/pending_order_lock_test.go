package domain_test

import (
	"context"
	"testing"

	"kami/domain"
	"kami/domain/dbtest"
)

// TestPendingRowDeletesWaitOnlyForTheirRows: a close or a payment batch
// deletes its orders' rows of pending_order, and must not wait for another
// transaction's row there (a close or a payment of another order, which
// holds its deleted row locked until it commits), as it does not on the
// orders (TestCloseWaitsOnlyForItsOrders). InnoDB locks every row a DELETE
// reads: read by a scan of the whole table, which MariaDB chooses for a
// batch that is a large share of it, every close and payment batch waits
// for the COMMIT of every other one, and of every order placed meanwhile.
func TestPendingRowDeletesWaitOnlyForTheirRows(t *testing.T) {
	t.Parallel()
	for _, c := range sessionProbes {
		for _, op := range []string{"close", "pay"} {
			t.Run(string(c.kind)+"/"+op, func(t *testing.T) {
				t.Parallel()
				db := dbtest.Open(t, c.kind)
				b := setup(t, db, domain.Config{})
				p := b.product(t, 100, 5)
				other := b.order(t, p, 1).Order
				orders, ps := b.payable(t, p, "x", 1, 1, 1)
				var nos []string
				for _, o := range orders {
					nos = append(nos, o.OrderNo)
				}
				tx, err := db.BeginTx(b.ctx, nil)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = tx.Rollback() })
				var id int64
				if err := tx.QueryRowContext(b.ctx, c.idQuery).Scan(&id); err != nil {
					t.Fatal(err)
				}
				// As a close or payment of other holds it, from its DELETE
				// to its COMMIT.
				if _, err := tx.NewDelete().Model((*domain.PendingOrder)(nil)).Where("order_no = ?", other.OrderNo).Exec(b.ctx); err != nil {
					t.Fatal(err)
				}
				finished := make(chan error, 1)
				go func() {
					if op == "close" {
						_, err := b.ledger.CloseOrders(b.ctx, nos, domain.CloseCancel)
						finished <- err
						return
					}
					_, errs := b.ledger.RecordPaymentsForTest(context.WithoutCancel(b.ctx), ps)
					for _, err := range errs {
						if err != nil {
							finished <- err
							return
						}
					}
					finished <- nil
				}()
				if finishesUnblocked(t, "the "+op, finished, tx, func() (bool, error) { return c.waited("pending_order")(b.ctx, db, id) }) {
					t.Errorf("the %s of %d orders waits for another order's row of pending_order", op, len(nos))
				}
				if err := receive(t, "the "+op, finished); err != nil {
					t.Fatalf("%s: %v", op, err)
				}
				b.mustAudit(t)
			})
		}
	}
}
