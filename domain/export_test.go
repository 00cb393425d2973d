package domain

import (
	"context"
	"time"

	"github.com/uptrace/bun"
)

// ApplyForTest applies t to the row whose key is key (order_no, refund_no,
// or for cards the order_no they carry), for the transition table test.
func ApplyForTest(ctx context.Context, db bun.IDB, t Transition, key string) (int64, error) {
	where := whereOrderNo(truncate(key, 32))
	if t.Table == tableRefunds {
		where = whereRefundNo(key)
	}
	return apply(ctx, db, t, time.Now().UTC(), where)
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
