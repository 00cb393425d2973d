package domain_test

import (
	"testing"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
)

// TestRefusedRedeliveryInASplitBatch: a refused notification delivered
// again is answered as seen before (DUPLICATE), also when it shares a
// batch whose usual payments meet a surprise and are recorded one by one:
// the split must not wipe the answer the refusal already has (the batcher
// then answers "no answer", an internal error, and the gateway is told to
// send again).
func TestRefusedRedeliveryInASplitBatch(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 300, 10)
		order := func() *domain.Order { return b.order(t, p, 1).Order }
		pay := func(o *domain.Order, trade, notify string) domain.Payment {
			return domain.Payment{Provider: o.Provider, NotifyID: notify, OrderNo: o.OrderNo, TradeNo: trade, AmountFen: o.AmountFen, Raw: "{}"}
		}
		wrongOrder, seen, four, five := order(), order(), order(), order()
		wrong := pay(wrongOrder, "T-WRONG", "N-WRONG")
		wrong.AmountFen = 1
		if _, err := b.ledger.RecordPayment(b.ctx, wrong); domain.ErrorCode(err) != domain.EBADINPUT {
			t.Fatalf("first delivery of a wrong amount: %v, want BAD_INPUT", err)
		}
		b.pay(t, seen, "T-SEEN", "N-SEEN")
		// five's notification id was seen before: the shared insert fails
		// and the batch is split.
		res, errs := b.ledger.RecordPaymentsForTest(b.ctx, []domain.Payment{wrong, pay(four, "T-4", "N-4"), pay(five, "T-5", "N-SEEN")})
		if errs[0] != nil || res[0] == nil || res[0].Outcome != domain.PaymentDuplicate {
			t.Errorf("refused notification again, in a split batch: %+v, %v; want DUPLICATE", res[0], errs[0])
		}
		if errs[1] != nil || res[1] == nil || res[1].Outcome != domain.PaymentDelivered {
			t.Errorf("usual payment in a split batch: %+v, %v; want DELIVERED", res[1], errs[1])
		}
		if errs[2] != nil || res[2] == nil || res[2].Outcome != domain.PaymentDuplicate {
			t.Errorf("replayed notification id: %+v, %v; want DUPLICATE", res[2], errs[2])
		}
		if n := b.alerts.count("amount_mismatch"); n != 1 {
			t.Errorf("%d amount_mismatch alerts, want 1", n)
		}
		b.mustAudit(t)
	})
}
