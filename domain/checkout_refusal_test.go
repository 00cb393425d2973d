package domain_test

import (
	"strings"
	"testing"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/providers/fault"
)

// TestCreatePaymentRefusedSaysSo: a gateway that answers CreatePayment
// with a business refusal answered; the buyer is told that it refused and
// that the order is cancelled (cancelUnpayable gives its cards back),
// not that it "did not answer". A gateway that really did not answer
// keeps that message. Real gopay clients against the emulators.
func TestCreatePaymentRefusedSaysSo(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		for _, gw := range gateways(t) {
			t.Run(gw.name, func(t *testing.T) {
				sb := newStatementBundle(t, db, gw, domain.Config{})
				method := "" // WeChat Pay's native payment is made at the gateway
				if gw.name == "alipay" {
					method = "qr" // precreate asks the gateway; a page payment is a signed URL made here
				}
				place := func(contact string) error {
					_, err := sb.shop.PlaceOrder(sb.ctx, domain.PlaceOrderInput{ProductID: sb.p.ID, Quantity: 1,
						Contact: contact, Provider: gw.name}, method, "203.0.113.9")
					return err
				}
				lockable := func() int {
					cs, err := sb.ledger.StockCounts(sb.ctx, sb.p.ID)
					if err != nil {
						t.Fatal(err)
					}
					return cs[sb.p.ID].Lockable
				}
				before := lockable()

				gw.fault(fault.OpCreate, fault.Business, 1)
				err := place("refused@example.com")
				msg := domain.ErrorMessage(err)
				if domain.ErrorCode(err) != domain.EUNAVAILABLE || !strings.Contains(msg, "refused") ||
					!strings.Contains(msg, "cancelled") || strings.Contains(msg, "did not answer") {
					t.Errorf("a refused CreatePayment: %v, want UNAVAILABLE saying the provider refused and the order is cancelled", err)
				}
				var statuses []domain.OrderStatus
				if err := sb.db.NewSelect().Model((*domain.Order)(nil)).Column("status").Where("product_id = ?", sb.p.ID).Scan(sb.ctx, &statuses); err != nil {
					t.Fatal(err)
				}
				if len(statuses) != 1 || statuses[0] != domain.OrderClosed {
					t.Errorf("orders after the refusal: %v, want one CLOSED (the message says cancelled)", statuses)
				}
				if n := lockable(); n != before {
					t.Errorf("lockable cards %d after the refusal, want %d (given back)", n, before)
				}

				gw.fault(fault.OpCreate, fault.Server5xx, 1)
				if err := place("down@example.com"); domain.ErrorCode(err) != domain.EUNAVAILABLE || !strings.Contains(domain.ErrorMessage(err), "did not answer") {
					t.Errorf("a CreatePayment with no answer: %v, want UNAVAILABLE \"did not answer\"", err)
				}
			})
		}
	})
}
