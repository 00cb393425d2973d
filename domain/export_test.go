package domain

import (
	"context"
	"time"

	"github.com/uptrace/bun"
)

// ApplyForTest applies t to the row whose key is key (order_no, refund_no,
// for cards the order_no they carry, for batches their supplier note), for
// the transition table test.
func ApplyForTest(ctx context.Context, db bun.IDB, t Transition, key string) (int64, error) {
	where := whereOrderNo(truncate(key, 32))
	var cols []column
	switch t.Table {
	case tableRefunds:
		where = whereRefundNo(key)
	case tableMails:
		where = func(q *bun.UpdateQuery) *bun.UpdateQuery { return q.Where("dedup_key = ?", key) }
	case tableDeliveries:
		where = func(q *bun.UpdateQuery) *bun.UpdateQuery { return q.Where("last_error = ?", key) }
	case tableBatches:
		where = func(q *bun.UpdateQuery) *bun.UpdateQuery { return q.Where("supplier_note = ?", key) }
		cols = append(cols, col("recalled_at = ?", time.Now().UTC())) // the schema wants a RECALLED batch's time
	}
	return apply(ctx, db, t, time.Now().UTC(), where, cols...)
}

// PlaceBatchForTest places ins as one batch, as the batcher would when
// they arrive together.
func (l *Ledger) PlaceBatchForTest(ctx context.Context, ins []PlaceOrderInput) ([]*PlacedOrder, []error) {
	for i := range ins {
		if err := ins[i].normalize(); err != nil {
			panic(err)
		}
	}
	return l.placeBatch(ctx, ins)
}

// RecordPaymentsForTest records ps as one batch, as the batcher would when
// they arrive together.
func (l *Ledger) RecordPaymentsForTest(ctx context.Context, ps []Payment) ([]*PaymentResult, []error) {
	return l.recordPayments(ctx, ps)
}

// QueuedPlacesForTest is how many PlaceOrder calls wait for a batch.
func (l *Ledger) QueuedPlacesForTest() int { return l.placer.Queued() }

// SetMaxQueuedPlacesForTest bounds the PlaceOrder calls waiting for a
// batch; call it before the ledger is used.
func (l *Ledger) SetMaxQueuedPlacesForTest(n int) { l.placer.MaxQueued = n }

// SetPlaceTimeoutForTest bounds each placement batch's work; call it
// before the ledger is used.
func (l *Ledger) SetPlaceTimeoutForTest(d time.Duration) { l.placer.Timeout = d }

// SetOutboxForTest turns the outbox off (no event built nor written) or
// back on, for the benchmarks' figure without it. Never from a test that
// runs beside others.
func SetOutboxForTest(on bool) { outboxOff.Store(!on) }

// PendingOfForTest is the pre-close check's read of the PENDING orders
// among nos (sorted, distinct) and the database's clock.
func (l *Ledger) PendingOfForTest(ctx context.Context, nos []string) ([]Order, time.Time, error) {
	return l.pendingOf(ctx, nos, true)
}

// TakeOffSaleForTest is the statement that takes ids, cards of product,
// off sale, as the place and the recall send it.
func TakeOffSaleForTest(db bun.IDB, productID int64, ids []int64) string {
	return takeOffSale(db, productID, ids).(interface{ String() string }).String()
}

// CloseInTxForTest runs the close of nos in tx, the caller's transaction,
// which reads what the close did before it commits.
func (l *Ledger) CloseInTxForTest(ctx context.Context, tx bun.Tx, nos []string, reason CloseReason) ([]CloseResult, error) {
	rs, _, err := l.closeOrders(ctx, tx, uniqueSorted(nos), reason, time.Time{})
	return rs, err
}

// BindsForTest collects a statement's values as binds (binds.go): Value
// is the placeholder to write in its text, Context the context that
// sends the values beside it.
type BindsForTest struct{ b binds }

func (t *BindsForTest) Value(v any) any                             { return t.b.value(v) }
func (t *BindsForTest) Context(ctx context.Context) context.Context { return withBinds(ctx, &t.b) }

// BindsOfForTest are the values ctx sends beside its statement's text.
func BindsOfForTest(ctx context.Context) []any {
	if b, ok := ctx.Value(bindsKey{}).(*binds); ok {
		return b.values
	}
	return nil
}

// WithBindsForTest is ctx sending values beside its statement's text.
func WithBindsForTest(ctx context.Context, values []any) context.Context {
	return withBinds(ctx, &binds{values: values})
}

// WriteEventsAndFlowsForTest writes evs and flows as a close's writes do
// on PostgreSQL (writeAll), with binds when bound, else with their values
// in the text.
func WriteEventsAndFlowsForTest(ctx context.Context, db *bun.DB, now time.Time, evs []Event, flows []StockFlow, bound bool) error {
	return db.RunInTx(ctx, nil, func(ctx context.Context, tx bun.Tx) error {
		var b *binds
		if bound {
			b = &binds{}
		}
		_, err := writeAll(withBinds(ctx, b), tx, eventsInsert(tx, b, now, evs), flowInsert(tx, b, now, flows))
		return err
	})
}
