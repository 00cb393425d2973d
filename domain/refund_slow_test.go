package domain_test

import (
	"strings"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/providers"
	"kami/providers/fault"
)

// TestSlowRefundStaysProcessing: a refund the gateway accepted and is
// still processing (a WeChat refund to a bank card takes days; Alipay
// answers fund_change "N" and its query lists no finished refund) is not a
// failed attempt. It stays PROCESSING however often it is polled, on the
// slow schedule, never gives up or raises refund_failed; after a day the
// nightly reconciliation reports it (stale_refunds); once the gateway
// finishes it, the next poll records it SUCCEEDED. Before, each poll counted
// as a failed attempt: the refund ended FAILED with an alert while the
// gateway was paying it out.
func TestSlowRefundStaysProcessing(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		for _, gw := range slowRefundGateways(t) {
			t.Run(gw.name, func(t *testing.T) {
				backoff := []time.Duration{time.Minute, 5 * time.Minute}
				sb := newStatementBundle(t, db, gw, domain.Config{RefundBackoff: backoff})
				o := sb.place(t)
				sb.deliver(t, gw.pay(t, o.OrderNo, o.AmountFen))
				r, err := sb.shop.RequestRefund(sb.ctx, o.OrderNo, "buyer asked", "admin")
				if err != nil {
					t.Fatal(err)
				}
				// More polls than the backoff has steps, and every other
				// query unanswered (a 5xx): a refund the gateway accepted
				// is not failing when a look at it fails.
				for i := range 2*len(backoff) + 3 {
					if i%2 == 1 {
						gw.fault(fault.OpQueryRefund, fault.Server5xx, 1)
					}
					cur, err := sb.shop.ProcessRefund(sb.ctx, r.RefundNo)
					if err != nil {
						t.Fatal(err)
					}
					if cur.Status != domain.RefundProcessing || cur.RetryCount != 0 || !strings.Contains(cur.LastError, "processing") && i%2 == 0 {
						t.Fatalf("poll %d of a refund the gateway is processing: %s, %d failed attempts, %q", i+1, cur.Status, cur.RetryCount, cur.LastError)
					}
					if want := sb.clock.Now().Add(5 * time.Minute); !cur.NextRetryAt.Equal(want) {
						t.Fatalf("poll %d: next look at %v, want %v (the slow poll: the backoff's longest step)", i+1, cur.NextRetryAt, want)
					}
					sb.clock.Advance(5 * time.Minute)
				}
				if n := sb.alerts.count("refund_failed"); n != 0 {
					t.Fatalf("%d refund_failed alerts for a refund the gateway is processing", n)
				}
				if fen, _ := gw.refunded(r.RefundNo); fen != o.AmountFen {
					t.Fatalf("the gateway holds %d fen under %s, want %d (one refund)", fen, r.RefundNo, o.AmountFen)
				}

				// A day later it is the nightly reconciliation's stale refund.
				sb.clock.Advance(24 * time.Hour)
				run, err := (&domain.Reconciler{Shop: sb.shop, Alerts: sb.alerts}).Run(sb.ctx)
				if err != nil {
					t.Fatal(err)
				}
				if run.StaleRefunds != 1 || sb.alerts.count("stale_refunds") != 1 {
					t.Fatalf("run %+v, alerts %v: want the refund reported stale", run, sb.alerts.kinds())
				}

				gw.finishRefund(t, r.RefundNo)
				cur, err := sb.shop.ProcessRefund(sb.ctx, r.RefundNo)
				if err != nil || cur.Status != domain.RefundSucceeded {
					t.Fatalf("poll once the gateway finished: %+v, %v", cur, err)
				}
				if got := sb.order(t, o.OrderNo); got.Status != domain.OrderRefunded {
					t.Fatalf("order %s after its refund succeeded", got.Status)
				}
				if fen, _ := gw.refunded(r.RefundNo); fen != o.AmountFen {
					t.Fatalf("the gateway refunded %d fen, want %d", fen, o.AmountFen)
				}
				sb.mustAudit(t)
			})
		}
	})
}

// TestRefundDueByTheDatabaseClock: a refund is due by the database's clock,
// the one its queue is claimed by, not by the process's own. In a process
// whose clock runs an hour slow, a refund due now was answered "not due"
// (ProcessRefund judged by the process's clock) and rescheduled at the
// same due time, so the worker claimed it again at once, in a loop for the
// hour; and the next look it recorded (the process's clock plus the slow
// poll) was already an hour past, so the gateway was asked again at once.
func TestRefundDueByTheDatabaseClock(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		gw := slowRefundGateways(t)[1]
		sb := newStatementBundle(t, db, gw, domain.Config{RefundBackoff: []time.Duration{time.Minute, 5 * time.Minute}})
		o := sb.place(t)
		sb.deliver(t, gw.pay(t, o.OrderNo, o.AmountFen))
		r, err := sb.shop.RequestRefund(sb.ctx, o.OrderNo, "buyer asked", "admin") // a process with a true clock
		if err != nil {
			t.Fatal(err)
		}

		// This process's clock is an hour slow; its workers measured that.
		sb.ledger.Now = func() time.Time { return sb.clock.Now().Add(-time.Hour) }
		if err := sb.ledger.SyncClock(sb.ctx); err != nil {
			t.Fatal(err)
		}
		cur, err := sb.shop.ProcessRefund(sb.ctx, r.RefundNo)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(cur.LastError, "processing") {
			t.Fatalf("a refund due by the database's clock was not attempted (last error %q, next look %v)", cur.LastError, cur.NextRetryAt)
		}
		if want := sb.clock.Now().Add(5 * time.Minute); !cur.NextRetryAt.Equal(want) {
			t.Fatalf("next look at %v, want %v (the database's now plus the slow poll)", cur.NextRetryAt, want)
		}
		again, err := sb.shop.ProcessRefund(sb.ctx, r.RefundNo)
		if err != nil {
			t.Fatal(err)
		}
		if !again.UpdatedAt.Equal(cur.UpdatedAt) {
			t.Fatal("a refund polled again before its next look was attempted again")
		}
	})
}

// TestUnconfirmedRefundNeverFailsBlind: the gateway made the refund but its
// answer was lost (a timeout after the effect), and every look at it since
// has gone unanswered. The refund's state is unknown, not failed: it must
// not end FAILED (an admin would then pay the buyer again by hand, or
// retry and hear "refunded" only by luck) however long the backoff; it
// stays PROCESSING on the slow poll with one refund_unconfirmed alert once
// the backoff is used up, and the first answered look records it
// SUCCEEDED, refunded once.
func TestUnconfirmedRefundNeverFailsBlind(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		for _, gw := range gateways(t) {
			t.Run(gw.name, func(t *testing.T) {
				backoff := []time.Duration{time.Minute, 5 * time.Minute}
				sb := newStatementBundle(t, db, gw, domain.Config{RefundBackoff: backoff})
				o := sb.place(t)
				sb.deliver(t, gw.pay(t, o.OrderNo, o.AmountFen))
				gw.fault(fault.OpRefund, fault.TimeoutAfterEffect, 1)
				polls := len(backoff) + 3
				gw.fault(fault.OpQueryRefund, fault.Server5xx, polls)
				r, err := sb.shop.RequestRefund(sb.ctx, o.OrderNo, "buyer asked", "admin")
				if err != nil {
					t.Fatal(err)
				}
				for i := range polls + 1 { // the refund call, then the unanswered looks
					cur, err := sb.shop.ProcessRefund(sb.ctx, r.RefundNo)
					if err != nil {
						t.Fatal(err)
					}
					if cur.Status != domain.RefundProcessing {
						t.Fatalf("attempt %d of a refund whose outcome is unknown: %s (%q)", i+1, cur.Status, cur.LastError)
					}
					if !cur.NextRetryAt.After(sb.clock.Now()) {
						t.Fatalf("attempt %d: next look at %v, not after now %v", i+1, cur.NextRetryAt, sb.clock.Now())
					}
					sb.clock.Advance(cur.NextRetryAt.Sub(sb.clock.Now()))
				}
				if n := sb.alerts.count("refund_failed"); n != 0 {
					t.Fatalf("%d refund_failed alerts for a refund the gateway made", n)
				}
				if n := sb.alerts.count("refund_unconfirmed"); n != 1 {
					t.Fatalf("%d refund_unconfirmed alerts, want 1 once the backoff is used up (alerts %v)", n, sb.alerts.kinds())
				}
				cur, err := sb.shop.ProcessRefund(sb.ctx, r.RefundNo)
				if err != nil || cur.Status != domain.RefundSucceeded {
					t.Fatalf("the first answered look: %+v, %v", cur, err)
				}
				if fen, calls := gw.refunded(r.RefundNo); fen != o.AmountFen || calls != 1 {
					t.Fatalf("the gateway refunded %d fen in %d calls, want %d in one", fen, calls, o.AmountFen)
				}
				if got := sb.order(t, o.OrderNo); got.Status != domain.OrderRefunded {
					t.Fatalf("order %s after its refund succeeded", got.Status)
				}
				sb.mustAudit(t)
			})
		}
	})
}

// TestUnconfirmedRefundStaysOpenWhileItsProviderIsOff: a refund whose
// answer was lost (the gateway made it) while its provider is then turned
// off for a while (a deploy without its keys) is not a refusal by the
// gateway: it stays PROCESSING past the backoff, raises no refund_failed,
// and once the provider is back the first look records it SUCCEEDED,
// refunded once. A refund the gateway accepted with an over-long id is
// recorded all the same (the id cut to its column).
func TestUnconfirmedRefundStaysOpenWhileItsProviderIsOff(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		gw := alipayGateway(t)
		backoff := []time.Duration{time.Minute}
		sb := newStatementBundle(t, db, gw, domain.Config{RefundBackoff: backoff})
		o := sb.place(t)
		sb.deliver(t, gw.pay(t, o.OrderNo, o.AmountFen))
		gw.fault(fault.OpRefund, fault.TimeoutAfterEffect, 1)
		r, err := sb.shop.RequestRefund(sb.ctx, o.OrderNo, "buyer asked", "admin")
		if err != nil {
			t.Fatal(err)
		}
		if cur, err := sb.shop.ProcessRefund(sb.ctx, r.RefundNo); err != nil || cur.Status != domain.RefundProcessing {
			t.Fatalf("the lost answer: %+v, %v", cur, err)
		}
		enabled := sb.shop.Providers
		sb.shop.Providers = providers.NewRegistry()
		for i := range len(backoff) + 3 {
			cur, _ := sb.ledger.Refund(sb.ctx, r.RefundNo)
			sb.clock.Advance(cur.NextRetryAt.Sub(sb.clock.Now()))
			cur, err := sb.shop.ProcessRefund(sb.ctx, r.RefundNo)
			if err != nil {
				t.Fatal(err)
			}
			if cur.Status != domain.RefundProcessing {
				t.Fatalf("attempt %d with the provider off: %s (%q); the gateway made this refund", i+2, cur.Status, cur.LastError)
			}
		}
		if n := sb.alerts.count("refund_failed"); n != 0 {
			t.Fatalf("%d refund_failed alerts for a refund the gateway made", n)
		}
		sb.shop.Providers = enabled
		cur, _ := sb.ledger.Refund(sb.ctx, r.RefundNo)
		sb.clock.Advance(cur.NextRetryAt.Sub(sb.clock.Now()))
		if cur, err := sb.shop.ProcessRefund(sb.ctx, r.RefundNo); err != nil || cur.Status != domain.RefundSucceeded {
			t.Fatalf("the provider back: %+v, %v", cur, err)
		}
		if fen, calls := gw.refunded(r.RefundNo); fen != o.AmountFen || calls != 1 {
			t.Fatalf("the gateway refunded %d fen in %d calls, want %d in one", fen, calls, o.AmountFen)
		}

		// An accepted refund's id longer than its column, or with a NUL.
		o2 := sb.place(t)
		sb.deliver(t, gw.pay(t, o2.OrderNo, o2.AmountFen))
		r2, err := sb.shop.RequestRefund(sb.ctx, o2.OrderNo, "buyer asked", "admin")
		if err != nil {
			t.Fatal(err)
		}
		if got, err := sb.ledger.RefundAwaiting(sb.ctx, r2.RefundNo, 0, strings.Repeat("R", 65)+"\x00", "accepted"); err != nil || got.Status != domain.RefundProcessing || len(got.ProviderRefundID) != 64 {
			t.Fatalf("an over-long accepted refund id: %+v, %v", got, err)
		}
	})
}
