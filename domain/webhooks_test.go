package domain_test

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/domain/webhook"
)

// receiver is a test webhook endpoint on 127.0.0.1: it answers each
// request with the next of its statuses (the last one repeated) and keeps
// what it got.
type receiver struct {
	srv      *httptest.Server
	mu       sync.Mutex
	statuses []int
	got      []received
	hold     chan struct{} // if set, each request waits for it
	echo     bool          // answer with the request's body
}

type received struct {
	header http.Header
	body   []byte
}

func newReceiver(t testing.TB, statuses ...int) *receiver {
	r := newReceiverOn(statuses)
	r.srv.Start()
	t.Cleanup(r.srv.Close)
	return r
}

// newTLSReceiver is a receiver over https (an endpoint that receives
// codes must be); h.Client is set to one that trusts its certificate.
func newTLSReceiver(t testing.TB, h *domain.Webhooks, statuses ...int) *receiver {
	r := newReceiverOn(statuses)
	r.srv.StartTLS()
	t.Cleanup(r.srv.Close)
	h.Client = r.srv.Client()
	return r
}

func newReceiverOn(statuses []int) *receiver {
	r := &receiver{statuses: statuses}
	r.srv = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		body, _ := io.ReadAll(req.Body)
		r.mu.Lock()
		r.got = append(r.got, received{header: req.Header.Clone(), body: body})
		status := r.statuses[min(len(r.got), len(r.statuses))-1]
		hold, echo := r.hold, r.echo
		r.mu.Unlock()
		if hold != nil {
			<-hold
		}
		w.WriteHeader(status)
		if echo {
			w.Write(body)
			return
		}
		w.Write([]byte("answer \x00 of the receiver"))
	}))
	return r
}

func (r *receiver) requests() []received {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.got)
}

// hooks is the webhook service over b's ledger; receivers on 127.0.0.1
// are allowed.
func (b *bundle) hooks(cfg domain.WebhookConfig) *domain.Webhooks {
	cfg.Guard.AllowPrivate = true
	return domain.NewWebhooks(b.ledger, cfg, b.alerts, nil)
}

func (b *bundle) endpoint(t testing.TB, h *domain.Webhooks, url string, codes bool, events ...domain.EventType) (*domain.WebhookEndpoint, string) {
	t.Helper()
	e, secret, err := h.CreateEndpoint(b.ctx, domain.WebhookEndpointInput{URL: &url, Events: events, ReceivesCodes: &codes}, "admin")
	if err != nil {
		t.Fatalf("CreateEndpoint: %v", err)
	}
	return e, secret
}

// fanOut fans every waiting event out and returns the new deliveries.
func fanOut(t testing.TB, b *bundle, h *domain.Webhooks) []domain.DeliveryDue {
	t.Helper()
	ds, _, err := h.FanOut(b.ctx, 100)
	if err != nil {
		t.Fatalf("FanOut: %v", err)
	}
	return ds
}

// checkSignature checks that r is signed by exactly secrets, in order.
func checkSignature(t testing.TB, r received, secrets ...string) {
	t.Helper()
	h := r.header.Get(webhook.SignatureHeader)
	ts, _, _ := strings.Cut(strings.TrimPrefix(h, "t="), ",")
	unix, err := strconv.ParseInt(ts, 10, 64)
	if err != nil {
		t.Fatalf("signature %q: %v", h, err)
	}
	if want := webhook.Sign(time.Unix(unix, 0), r.body, secrets...); h != want {
		t.Fatalf("signature %q, want %q", h, want)
	}
}

// TestWebhookDeliveredOnce: a paid order's event reaches a 2xx endpoint
// once, signed with its secret, with the event id header, and without
// codes; an endpoint marked to receive codes gets them, and that is
// recorded as a reveal. An endpoint that does not want the event gets
// nothing. A second Deliver of a delivered delivery sends nothing.
func TestWebhookDeliveredOnce(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		h := b.hooks(domain.WebhookConfig{})
		plain, withCodes, other := newReceiver(t, 200), newTLSReceiver(t, h, 201), newReceiver(t, 200)
		_, secret := b.endpoint(t, h, plain.srv.URL+"/hook", false, domain.EventOrderPaid, domain.EventOrderClosed)
		_, secret2 := b.endpoint(t, h, withCodes.srv.URL, true, domain.EventOrderPaid)
		b.endpoint(t, h, other.srv.URL, false, domain.EventStockLow)

		p := b.product(t, 500, 3)
		o := b.order(t, p, 2).Order
		b.pay(t, o, "T1", "N1")
		ds := fanOut(t, b, h)
		if len(ds) != 2 {
			t.Fatalf("%d deliveries, want 2", len(ds))
		}
		if again := fanOut(t, b, h); len(again) != 0 {
			t.Fatalf("fanned out twice: %v", again)
		}
		for _, d := range ds {
			got, err := h.Deliver(b.ctx, d.ID)
			if err != nil || got.Status != domain.DeliveryDelivered || got.Attempts != 1 || got.LastStatus/100 != 2 ||
				got.ResponseSnippet != "answer  of the receiver" && got.LastStatus != 201 {
				t.Fatalf("Deliver: %+v, %v", got, err)
			}
			if again, err := h.Deliver(b.ctx, d.ID); err != nil || again.Attempts != 1 {
				t.Fatalf("second Deliver: %+v, %v", again, err)
			}
		}
		reqs := plain.requests()
		if len(reqs) != 1 || len(other.requests()) != 0 || len(withCodes.requests()) != 1 {
			t.Fatalf("requests: %d, %d, %d", len(reqs), len(withCodes.requests()), len(other.requests()))
		}
		checkSignature(t, reqs[0], secret)
		var msg struct {
			ID   string
			Type string
			Data domain.OrderObject
		}
		if err := json.Unmarshal(reqs[0].body, &msg); err != nil {
			t.Fatal(err)
		}
		if msg.Type != "order.paid" || msg.ID == "" || reqs[0].header.Get(webhook.EventIDHeader) != msg.ID ||
			msg.Data.OrderNo != o.OrderNo || len(msg.Data.Cards) != 0 || strings.Contains(string(reqs[0].body), "CODE-") {
			t.Fatalf("delivery: %s", reqs[0].body)
		}
		c := withCodes.requests()[0]
		checkSignature(t, c, secret2)
		if err := json.Unmarshal(c.body, &msg); err != nil {
			t.Fatal(err)
		}
		if len(msg.Data.Cards) != 2 || !strings.HasPrefix(msg.Data.Cards[0], "CODE-") {
			t.Fatalf("codes not sent to the endpoint that receives them: %s", c.body)
		}
		page, err := b.ledger.ListReveals(b.ctx, o.OrderNo, 0, 0, 10)
		if err != nil || len(page.Reveals) != 1 || page.Reveals[0].Channel != domain.RevealWebhook || page.Reveals[0].Codes != 2 {
			t.Fatalf("reveals: %+v, %v", page, err)
		}
		// The codes are nowhere in the database in the clear.
		var payloads []string
		if err := db.NewSelect().Table("events").Column("payload").Scan(b.ctx, &payloads); err != nil {
			t.Fatal(err)
		}
		if strings.Contains(strings.Join(payloads, ""), "CODE-") {
			t.Fatal("a code was stored in the outbox")
		}
	})
}

// TestWebhookRetriedWithBackoff: an endpoint that fails twice and then
// answers 2xx gets exactly three attempts, the second due BackoffBase
// after the first, the third twice that after the second (the test clock
// moves; nothing sleeps). An endpoint that never answers 2xx is FAILED
// after MaxAttempts, with one alert.
func TestWebhookRetriedWithBackoff(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		cfg := domain.WebhookConfig{BackoffBase: time.Minute, BackoffMax: 4 * time.Minute, RetryFor: 10 * time.Minute}
		h := b.hooks(cfg)
		flaky, dead := newReceiver(t, 500, 503, 200), newReceiver(t, 500)
		b.endpoint(t, h, flaky.srv.URL, false, domain.EventOrderPaid)
		b.endpoint(t, h, dead.srv.URL, false, domain.EventOrderPaid)
		p := b.product(t, 500, 1)
		b.pay(t, b.order(t, p, 1).Order, "T1", "N1")
		// Not sent yet: it cannot be sent again.
		_, err := h.Redeliver(b.ctx, outboxEvents(t, b, domain.EventOrderPaid)[0].ID, 0, "admin")
		wantCode(t, err, domain.ECONFLICT)
		if bl, err := h.Backlog(b.ctx); err != nil || bl.Events != 1 || bl.Pending != 0 || !bl.OldestSince.Equal(b.clock.Now()) {
			t.Fatalf("backlog before the fan-out: %+v, %v", bl, err)
		}
		ds := fanOut(t, b, h)
		if bl, err := h.Backlog(b.ctx); err != nil || bl.Events != 0 || bl.Pending != 2 || !bl.OldestSince.Equal(b.clock.Now()) {
			t.Fatalf("backlog after the fan-out: %+v, %v", bl, err)
		}
		if len(ds) != 2 {
			t.Fatalf("%d deliveries", len(ds))
		}
		flakyID, deadID := ds[0].ID, ds[1].ID

		var dues []time.Duration
		for i := 0; ; i++ {
			d, err := h.Deliver(b.ctx, flakyID)
			if err != nil {
				t.Fatal(err)
			}
			if d.Status == domain.DeliveryDelivered {
				break
			}
			if d.Status != domain.DeliveryPending || i > 5 {
				t.Fatalf("after attempt %d: %+v", i+1, d)
			}
			// Not due before its time: nothing is sent.
			if again, err := h.Deliver(b.ctx, flakyID); err != nil || again.Attempts != d.Attempts {
				t.Fatalf("sent before it was due: %+v, %v", again, err)
			}
			dues = append(dues, d.NextAttemptAt.Sub(b.clock.Now()))
			b.clock.Advance(d.NextAttemptAt.Sub(b.clock.Now()))
		}
		if n := len(flaky.requests()); n != 3 {
			t.Fatalf("%d attempts, want 3", n)
		}
		if !slices.Equal(dues, []time.Duration{time.Minute, 2 * time.Minute}) {
			t.Fatalf("waits %v, want [1m 2m]", dues)
		}

		// 1m, 2m, 4m, 4m fit in 10 minutes: the fourth failure is the last.
		if n := cfg.MaxAttempts(); n != 4 {
			t.Fatalf("MaxAttempts %d, want 4", n)
		}
		for i := 0; i < 10; i++ {
			d, err := h.Deliver(b.ctx, deadID)
			if err != nil {
				t.Fatal(err)
			}
			if d.Status == domain.DeliveryFailed {
				break
			}
			b.clock.Advance(d.NextAttemptAt.Sub(b.clock.Now()))
		}
		if n := len(dead.requests()); n != 4 {
			t.Fatalf("%d attempts at the dead endpoint, want 4", n)
		}
		if n := b.alerts.count("webhook_failed"); n != 1 {
			t.Fatalf("%d webhook_failed alerts, want 1", n)
		}
		// An admin sends it again: a new round for every endpoint.
		var evID int64
		if err := db.NewSelect().Table("webhook_delivery").Column("event_id").Where("id = ?", deadID).Scan(b.ctx, &evID); err != nil {
			t.Fatal(err)
		}
		rs, err := h.Redeliver(b.ctx, evID, 0, "admin")
		if err != nil || len(rs) != 2 {
			t.Fatalf("Redeliver: %+v, %v", rs, err)
		}
		for _, r := range rs {
			if r.Status != domain.DeliveryPending || r.Attempts != 0 {
				t.Fatalf("redelivered: %+v", r)
			}
		}
	})
}

// TestRaceWebhookAttemptOnce: two workers (two processes would be the
// same: each takes the attempt by a conditional update) deliver the same
// delivery at once: one sends it, the other finds it taken.
func TestRaceWebhookAttemptOnce(t *testing.T) {
	t.Parallel()
	dbtest.Servers(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		h1, h2 := b.hooks(domain.WebhookConfig{}), b.hooks(domain.WebhookConfig{})
		r := newReceiver(t, 200)
		r.hold = make(chan struct{})
		b.endpoint(t, h1, r.srv.URL, false, domain.EventOrderPaid)
		p := b.product(t, 500, 1)
		b.pay(t, b.order(t, p, 1).Order, "T1", "N1")
		ds := fanOut(t, b, h1)
		if len(ds) != 1 {
			t.Fatalf("%d deliveries", len(ds))
		}
		var wg sync.WaitGroup
		var delivered atomic.Int32
		for _, h := range []*domain.Webhooks{h1, h2} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				d, err := h.Deliver(b.ctx, ds[0].ID)
				if err != nil {
					t.Error(err)
					return
				}
				if d.Status == domain.DeliveryDelivered {
					delivered.Add(1)
				}
			}()
		}
		// The one that took the attempt is at the receiver; the other
		// returns without sending.
		waitFor(t, "the attempt reaches the receiver", func() bool { return len(r.requests()) == 1 })
		close(r.hold)
		wg.Wait()
		if n := len(r.requests()); n != 1 {
			t.Fatalf("%d requests, want 1", n)
		}
		var d domain.WebhookDelivery
		if err := db.NewSelect().Model(&d).Where("id = ?", ds[0].ID).Scan(b.ctx); err != nil {
			t.Fatal(err)
		}
		if d.Status != domain.DeliveryDelivered || d.Attempts != 1 {
			t.Fatalf("delivery: %+v", d)
		}
	})
}

// TestWebhookEndpointAdmin: the guard refuses a loopback URL unless
// allowed; a rotation signs with both secrets for the grace period, then
// with the new one; a deleted endpoint's pending delivery is cancelled
// and it is no longer listed; the secret is sealed at rest.
func TestWebhookEndpointAdmin(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		strict := domain.NewWebhooks(b.ledger, domain.WebhookConfig{}, b.alerts, nil)
		url := "http://127.0.0.1:9/hook"
		_, _, err := strict.CreateEndpoint(b.ctx, domain.WebhookEndpointInput{URL: &url, Events: []domain.EventType{domain.EventOrderPaid}}, "admin")
		wantCode(t, err, domain.EBADINPUT)
		bogus := []domain.EventType{"order.eaten"}
		h := b.hooks(domain.WebhookConfig{})
		_, _, err = h.CreateEndpoint(b.ctx, domain.WebhookEndpointInput{URL: &url, Events: bogus}, "admin")
		wantCode(t, err, domain.EBADINPUT)

		r := newReceiver(t, 200)
		e, old := b.endpoint(t, h, r.srv.URL, false, domain.EventOrderPaid, domain.EventOrderClosed)
		if strings.Contains(string(e.SecretEnc), old) || !strings.HasPrefix(old, "whsec_") {
			t.Fatal("the secret is stored in the clear")
		}
		_, fresh, err := h.RotateSecret(b.ctx, e.ID, "admin")
		if err != nil || fresh == old {
			t.Fatalf("RotateSecret: %v", err)
		}
		p := b.product(t, 500, 3)
		b.pay(t, b.order(t, p, 1).Order, "T1", "N1")
		for _, d := range fanOut(t, b, h) {
			if _, err := h.Deliver(b.ctx, d.ID); err != nil {
				t.Fatal(err)
			}
		}
		checkSignature(t, r.requests()[0], fresh, old)
		b.clock.Advance(25 * time.Hour)
		b.pay(t, b.order(t, p, 1).Order, "T2", "N2")
		for _, d := range fanOut(t, b, h) {
			if _, err := h.Deliver(b.ctx, d.ID); err != nil {
				t.Fatal(err)
			}
		}
		checkSignature(t, r.requests()[1], fresh)

		closing := b.order(t, p, 1).Order
		b.clock.Advance(time.Hour)
		if _, err := b.ledger.CloseOrders(b.ctx, []string{closing.OrderNo}, domain.CloseTimeout); err != nil {
			t.Fatal(err)
		}
		ds := fanOut(t, b, h)
		if _, err := h.DeleteEndpoint(b.ctx, e.ID, "admin"); err != nil {
			t.Fatal(err)
		}
		d, err := h.Deliver(b.ctx, ds[0].ID)
		if err != nil || d.Status != domain.DeliveryCancelled || len(r.requests()) != 2 {
			t.Fatalf("delivery to a deleted endpoint: %+v, %v", d, err)
		}
		if es, err := h.Endpoints(b.ctx); err != nil || len(es) != 0 {
			t.Fatalf("Endpoints after delete: %+v, %v", es, err)
		}
		page, err := h.Deliveries(b.ctx, e.ID, 0, 10)
		if err != nil || len(page.Deliveries) != 3 || page.Deliveries[0].Event == nil || page.Deliveries[0].Event.Type != domain.EventOrderClosed {
			t.Fatalf("Deliveries: %+v, %v", page, err)
		}
	})
}

// TestWebhookPrune: the delivery log and the outbox keep Keep and no
// more. A delivery that ended and an event no delivery needs go once they
// are older than Keep; a PENDING delivery (and so its event) stays however
// old, and so does an event not yet fanned out.
func TestWebhookPrune(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		keep := 48 * time.Hour
		h := b.hooks(domain.WebhookConfig{Keep: keep, BackoffBase: time.Hour, BackoffMax: time.Hour, RetryFor: 1000 * time.Hour})
		ok, dead := newReceiver(t, 200), newReceiver(t, 500)
		b.endpoint(t, h, ok.srv.URL, false, domain.EventOrderPaid)
		p := b.product(t, 500, 4)
		b.pay(t, b.order(t, p, 1).Order, "T1", "N1") // delivered to ok
		for _, d := range fanOut(t, b, h) {
			if got, err := h.Deliver(b.ctx, d.ID); err != nil || got.Status != domain.DeliveryDelivered {
				t.Fatalf("deliver: %+v, %v", got, err)
			}
		}
		// An event no endpoint wants: fanned out into nothing.
		unpaid := b.order(t, p, 1).Order
		b.clock.Advance(time.Hour)
		if res, err := b.ledger.CloseOrders(b.ctx, []string{unpaid.OrderNo}, domain.CloseTimeout); err != nil || len(res) != 1 {
			t.Fatalf("close: %+v, %v", res, err)
		}
		fanOut(t, b, h)
		// A delivery that keeps failing stays PENDING.
		b.endpoint(t, h, dead.srv.URL, false, domain.EventOrderPaid)
		b.pay(t, b.order(t, p, 1).Order, "T2", "N2")
		pending := fanOut(t, b, h)
		if len(pending) != 2 {
			t.Fatalf("%d deliveries of the second payment, want 2", len(pending))
		}
		for _, d := range pending {
			h.Deliver(b.ctx, d.ID)
		}

		if ds, evs, err := h.Prune(b.ctx, 100); err != nil || ds != 0 || evs != 0 {
			t.Fatalf("prune within Keep: %d deliveries, %d events, %v; want nothing", ds, evs, err)
		}
		// Not yet fanned out when the prune runs (a fan-out backlog older
		// than Keep): stays, old as it is.
		b.pay(t, b.order(t, p, 1).Order, "T3", "N3")
		b.clock.Advance(keep + time.Hour)
		countEvents := func() int {
			n, err := db.NewSelect().Model((*domain.Event)(nil)).Count(b.ctx)
			if err != nil {
				t.Fatal(err)
			}
			return int(n)
		}
		before := countEvents()
		ds, evs, err := h.Prune(b.ctx, 100)
		if err != nil {
			t.Fatal(err)
		}
		// Gone: the first payment's delivery and event, and the close's
		// event; the second payment's delivered delivery too, but not its
		// PENDING one, so not its event.
		if ds != 2 || evs != 2 {
			t.Fatalf("pruned %d deliveries and %d events, want 2 and 2", ds, evs)
		}
		if after := countEvents(); after != before-2 {
			t.Fatalf("%d events left of %d", after, before)
		}
		var left []domain.WebhookDelivery
		if err := db.NewSelect().Model(&left).Scan(b.ctx); err != nil {
			t.Fatal(err)
		}
		if len(left) != 1 || left[0].Status != domain.DeliveryPending {
			t.Fatalf("deliveries left %+v, want the PENDING one", left)
		}
	})
}
