package domain_test

import (
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
)

// TestWebhookRotationGraceByDatabaseClock: the old secret's grace is set
// and judged by the database's clock: a process whose clock runs two
// hours fast rotates, and once the database's clock is past the grace a
// process with a right clock signs with the new secret only.
func TestWebhookRotationGraceByDatabaseClock(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		var skew atomic.Int64
		skew.Store(int64(2 * time.Hour))
		b.ledger.Now = func() time.Time { return b.clock.Now().Add(time.Duration(skew.Load())) }
		if err := b.ledger.SyncClock(b.ctx); err != nil {
			t.Fatal(err)
		}
		h := b.hooks(domain.WebhookConfig{})
		r := newReceiver(t, 200)
		e, old := b.endpoint(t, h, r.srv.URL, false, domain.EventOrderPaid)
		e, fresh, err := h.RotateSecret(b.ctx, e.ID, "admin")
		if err != nil {
			t.Fatal(err)
		}
		if want := b.clock.Now().Add(24 * time.Hour); !e.PrevSecretUntil.Equal(want) {
			t.Fatalf("old secret valid until %v, want %v (the database's clock)", e.PrevSecretUntil, want)
		}
		if until, ok := h.PreviousSecretUntil(e); !ok || !until.Equal(e.PrevSecretUntil) {
			t.Fatalf("PreviousSecretUntil: %v, %v", until, ok)
		}
		b.clock.Advance(24*time.Hour + time.Minute)
		skew.Store(0)
		if err := b.ledger.SyncClock(b.ctx); err != nil {
			t.Fatal(err)
		}
		if _, ok := h.PreviousSecretUntil(e); ok {
			t.Fatal("the old secret is still valid after its grace")
		}
		p := b.product(t, 500, 1)
		b.pay(t, b.order(t, p, 1).Order, "T1", "N1")
		for _, d := range fanOut(t, b, h) {
			if _, err := h.Deliver(b.ctx, d.ID); err != nil {
				t.Fatal(err)
			}
		}
		_ = old
		checkSignature(t, r.requests()[0], fresh)
	})
}

// TestWebhookUpdateAudited: an update's audit entry names the URL, the
// events and receivesCodes before and after.
func TestWebhookUpdateAudited(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		h := b.hooks(domain.WebhookConfig{})
		e, _ := b.endpoint(t, h, "http://127.0.0.1:9/old", false, domain.EventOrderPaid)
		url, yes := "https://127.0.0.1:9/new", true
		if _, err := h.UpdateEndpoint(b.ctx, e.ID, domain.WebhookEndpointInput{URL: &url, ReceivesCodes: &yes,
			Events: []domain.EventType{domain.EventOrderPaid, domain.EventOrderClosed}}, "admin"); err != nil {
			t.Fatal(err)
		}
		var entries []domain.AuditEntry
		if err := db.NewSelect().Model(&entries).Where("action = ?", "webhook.update").Scan(b.ctx); err != nil {
			t.Fatal(err)
		}
		if len(entries) != 1 {
			t.Fatalf("%d audit entries", len(entries))
		}
		for _, want := range []string{"http://127.0.0.1:9/old", url, "order.paid -> order.paid,order.closed", "receivesCodes false -> true"} {
			if !strings.Contains(entries[0].Detail, want) {
				t.Fatalf("audit detail %q lacks %q", entries[0].Detail, want)
			}
		}
	})
}

// TestWebhookDescriptionText: a description with NUL, another control
// character or invalid UTF-8 is refused, at creation and at update.
func TestWebhookDescriptionText(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		h := b.hooks(domain.WebhookConfig{})
		url := "http://127.0.0.1:9/hook"
		paid := []domain.EventType{domain.EventOrderPaid}
		e, _ := b.endpoint(t, h, url, false, paid...)
		for _, bad := range []string{"a\x00b", "a\x1bb", "a\xffb"} {
			_, _, err := h.CreateEndpoint(b.ctx, domain.WebhookEndpointInput{URL: &url, Events: paid, Description: &bad}, "admin")
			wantCode(t, err, domain.EBADINPUT)
			_, err = h.UpdateEndpoint(b.ctx, e.ID, domain.WebhookEndpointInput{Description: &bad}, "admin")
			wantCode(t, err, domain.EBADINPUT)
		}
		good := "订单 hook\tfor the ERP"
		if got, err := h.UpdateEndpoint(b.ctx, e.ID, domain.WebhookEndpointInput{Description: &good}, "admin"); err != nil || got.Description != good {
			t.Fatalf("UpdateEndpoint: %+v, %v", got, err)
		}
	})
}

// TestWebhookFailedAlertRedactsURL: the alert for a delivery that failed
// names the endpoint's URL without its query or fragment.
func TestWebhookFailedAlertRedactsURL(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		h := b.hooks(domain.WebhookConfig{BackoffBase: time.Minute, BackoffMax: time.Minute, RetryFor: 30 * time.Second}) // one attempt
		r := newReceiver(t, 500)
		b.endpoint(t, h, r.srv.URL+"/hook?token=s3cret#frag", false, domain.EventOrderPaid)
		p := b.product(t, 500, 1)
		b.pay(t, b.order(t, p, 1).Order, "T1", "N1")
		ds := fanOut(t, b, h)
		if d, err := h.Deliver(b.ctx, ds[0].ID); err != nil || d.Status != domain.DeliveryFailed {
			t.Fatalf("Deliver: %+v, %v", d, err)
		}
		b.alerts.mu.Lock()
		defer b.alerts.mu.Unlock()
		if len(b.alerts.got) != 1 || !strings.Contains(b.alerts.got[0].Message, r.srv.URL+"/hook ") ||
			strings.Contains(b.alerts.got[0].Message, "s3cret") || strings.Contains(b.alerts.got[0].Message, "frag") {
			t.Fatalf("alerts: %+v", b.alerts.got)
		}
	})
}

// TestWebhookStaleAttemptAfterResend: a worker whose attempt outlived its
// time, while the delivery was cancelled, sent again and attempted anew
// (the new round's attempt has the same number), reports last: its
// answer does not overwrite the new round's record.
func TestWebhookStaleAttemptAfterResend(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		h := b.hooks(domain.WebhookConfig{})
		r := newReceiver(t, 200, 500) // the stale attempt is answered 200, the new round's 500
		hold := make(chan struct{})
		r.hold = hold
		e, _ := b.endpoint(t, h, r.srv.URL, false, domain.EventOrderPaid)
		p := b.product(t, 500, 1)
		b.pay(t, b.order(t, p, 1).Order, "T1", "N1")
		ds := fanOut(t, b, h)
		stale := make(chan error, 1)
		go func() {
			_, err := h.Deliver(b.ctx, ds[0].ID)
			stale <- err
		}()
		waitFor(t, "the first attempt reaches the receiver", func() bool { return len(r.requests()) == 1 })
		r.mu.Lock()
		r.hold = nil
		r.mu.Unlock()

		// Its time is up; the endpoint is disabled (the delivery is
		// cancelled), enabled again, and the event sent again.
		b.clock.Advance(time.Hour)
		no, yes := false, true
		if _, err := h.UpdateEndpoint(b.ctx, e.ID, domain.WebhookEndpointInput{Enabled: &no}, "admin"); err != nil {
			t.Fatal(err)
		}
		if d, err := h.Deliver(b.ctx, ds[0].ID); err != nil || d.Status != domain.DeliveryCancelled {
			t.Fatalf("Deliver to a disabled endpoint: %+v, %v", d, err)
		}
		if _, err := h.UpdateEndpoint(b.ctx, e.ID, domain.WebhookEndpointInput{Enabled: &yes}, "admin"); err != nil {
			t.Fatal(err)
		}
		var evID int64
		if err := db.NewSelect().Table("webhook_delivery").Column("event_id").Where("id = ?", ds[0].ID).Scan(b.ctx, &evID); err != nil {
			t.Fatal(err)
		}
		if _, err := h.Redeliver(b.ctx, evID, e.ID, "admin"); err != nil {
			t.Fatal(err)
		}
		d, err := h.Deliver(b.ctx, ds[0].ID)
		if err != nil || d.Status != domain.DeliveryPending || d.Attempts != 1 || d.LastStatus != 500 {
			t.Fatalf("the new round's first attempt: %+v, %v", d, err)
		}

		close(hold)
		if err := <-stale; err != nil {
			t.Fatal(err)
		}
		var after domain.WebhookDelivery
		if err := db.NewSelect().Model(&after).Where("id = ?", ds[0].ID).Scan(b.ctx); err != nil {
			t.Fatal(err)
		}
		if after.Status != domain.DeliveryPending || after.Attempts != 1 || after.LastStatus != 500 || !after.NextAttemptAt.Equal(d.NextAttemptAt) {
			t.Fatalf("the stale attempt overwrote the new round: %+v", after)
		}
	})
}

// TestDBTimeNeverAheadOfTheDatabase: a clock read whose round trip was
// stretched on the way out (the process descheduled between reading its
// own clock and sending the query, on a busy machine) leaves DBTime
// behind the database's clock, never ahead of it. Before, SyncClock took
// the database's read to be at the round trip's middle, and DBTime ran
// ahead by half of it: the close queue then claimed orders the database
// did not hold due yet.
func TestDBTimeNeverAheadOfTheDatabase(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		// The database's clock is this process's (no skew); reading it
		// takes a minute of this process's time before the database reads.
		b.ledger.DBClock = func() time.Time {
			b.clock.Advance(time.Minute)
			return b.clock.Now()
		}
		if err := b.ledger.SyncClock(b.ctx); err != nil {
			t.Fatal(err)
		}
		if est, db := b.ledger.DBTime(), b.clock.Now(); est.After(db) {
			t.Fatalf("DBTime %v is ahead of the database's clock %v by %v", est, db, est.Sub(db))
		}
	})
}
