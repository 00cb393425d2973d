package queue_test

import (
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/queue"
	"kami/queue/redistest"
)

// TestFastProcessNeitherClaimsEarlyNorStealsLeases: a process whose clock
// runs an hour fast judges due times and leases by the database's clock:
// it closes the order that is due, leaves the one that is not unclaimed,
// puts back the claim whose lease ended, and leaves alone the claim
// another process still holds.
func TestFastProcessNeitherClaimsEarlyNorStealsLeases(t *testing.T) {
	combos(t, func(t *testing.T, db *bun.DB, rs *redistest.Server) {
		e := newEnv(t, db, rs, domain.Config{OrderTTL: ttl})
		p := e.product(t, 4)
		due := e.place(t, p, 1)
		e.clock.Advance(ttl)
		notDue := e.place(t, p, 1)

		// Another process holds two claims: one whose lease has ended, one
		// held for another 30 seconds.
		q := queue.CloseQueue(rs.Client, e.keys)
		now := e.clock.Now()
		for _, c := range []struct {
			member string
			lease  time.Duration
		}{{"ended-claim", -time.Second}, {"held-claim", 30 * time.Second}} {
			if err := q.Schedule(e.ctx, c.member, now.Add(-time.Minute)); err != nil {
				t.Fatal(err)
			}
			if got, err := q.Claim(e.ctx, now, 1, c.lease); err != nil || len(got.Members) != 1 {
				t.Fatalf("claim %s: %+v, %v", c.member, got, err)
			}
		}

		e.ledger.Now = func() time.Time { return e.clock.Now().Add(time.Hour) } // this process runs fast
		w := e.workers(t, queue.Config{})
		eventually(t, 15*time.Second, "the due order closed and the ended lease put back", func() bool {
			o, err := e.ledger.Order(e.ctx, due[0])
			return err == nil && o.Status == domain.OrderClosed && w.Stats().Recovered >= 1
		})
		if _, err := rs.Client.ZScore(e.ctx, e.keys.CloseLease(), "held-claim").Result(); err != nil {
			t.Fatalf("the claim another process still holds was taken over by a fast clock: %v", err)
		}
		if n := w.Stats().NotDue; n != 0 {
			t.Fatalf("%d orders claimed before they were due by the database's clock", n)
		}
		if o, err := e.ledger.Order(e.ctx, notDue[0]); err != nil || o.Status != domain.OrderPending {
			t.Fatalf("order not yet due: %+v, %v; want PENDING", o, err)
		}
	})
}
