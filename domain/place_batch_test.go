package domain_test

import (
	"context"
	"testing"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
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
