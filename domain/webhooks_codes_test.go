package domain_test

import (
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
)

// TestWebhookCodesWithheldAfterRefund: an endpoint that receives codes
// gets them while the order is PAID; sent again after the order was
// refunded, the event carries no codes, says why, and no reveal is
// recorded for it.
func TestWebhookCodesWithheldAfterRefund(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		h := b.hooks(domain.WebhookConfig{})
		r := newTLSReceiver(t, h, 200)
		b.endpoint(t, h, r.srv.URL, true, domain.EventOrderPaid)
		p := b.product(t, 500, 2)
		o := b.order(t, p, 2).Order
		b.pay(t, o, "T1", "N1")
		ds := fanOut(t, b, h)
		if d, err := h.Deliver(b.ctx, ds[0].ID); err != nil || d.Status != domain.DeliveryDelivered {
			t.Fatalf("Deliver: %+v, %v", d, err)
		}
		rf, err := b.ledger.RequestRefund(b.ctx, o.OrderNo, "", "admin")
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := b.ledger.RefundSucceeded(b.ctx, rf.RefundNo, "P-1"); err != nil {
			t.Fatal(err)
		}
		rs, err := h.Redeliver(b.ctx, outboxEvents(t, b, domain.EventOrderPaid)[0].ID, 0, "admin")
		if err != nil || len(rs) != 1 {
			t.Fatalf("Redeliver: %+v, %v", rs, err)
		}
		if d, err := h.Deliver(b.ctx, rs[0].ID); err != nil || d.Status != domain.DeliveryDelivered {
			t.Fatalf("Deliver again: %+v, %v", d, err)
		}
		reqs := r.requests()
		if len(reqs) != 2 {
			t.Fatalf("%d requests", len(reqs))
		}
		var first, again struct{ Data domain.OrderObject }
		if json.Unmarshal(reqs[0].body, &first) != nil || len(first.Data.Cards) != 2 || first.Data.CodesWithheld != "" {
			t.Fatalf("first delivery: %s", reqs[0].body)
		}
		if json.Unmarshal(reqs[1].body, &again) != nil || len(again.Data.Cards) != 0 || strings.Contains(string(reqs[1].body), "CODE-") ||
			again.Data.CodesWithheld != "order is REFUNDED" {
			t.Fatalf("delivery after the refund: %s", reqs[1].body)
		}
		page, err := b.ledger.ListReveals(b.ctx, o.OrderNo, 0, 0, 10)
		if err != nil || len(page.Reveals) != 1 {
			t.Fatalf("reveals: %+v, %v", page, err)
		}
	})
}

// TestWebhookSnippetNotKeptWithCodes: a receiver that echoes the request
// does not put the codes in the delivery log: the answer to a delivery
// that carried codes is not kept; one without codes is.
func TestWebhookSnippetNotKeptWithCodes(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		h := b.hooks(domain.WebhookConfig{})
		codes, plain := newTLSReceiver(t, h, 200), newReceiver(t, 200)
		codes.echo, plain.echo = true, true
		b.endpoint(t, h, codes.srv.URL, true, domain.EventOrderPaid)
		b.endpoint(t, h, plain.srv.URL, false, domain.EventOrderPaid)
		p := b.product(t, 500, 1)
		b.pay(t, b.order(t, p, 1).Order, "T1", "N1")
		ds := fanOut(t, b, h)
		if len(ds) != 2 {
			t.Fatalf("%d deliveries", len(ds))
		}
		var snippets []string
		for _, d := range ds {
			got, err := h.Deliver(b.ctx, d.ID)
			if err != nil || got.Status != domain.DeliveryDelivered {
				t.Fatalf("Deliver: %+v, %v", got, err)
			}
			snippets = append(snippets, got.ResponseSnippet)
		}
		if !strings.Contains(string(codes.requests()[0].body), "CODE-") {
			t.Fatal("the codes were not sent")
		}
		if strings.Contains(snippets[0], "CODE-") || !strings.Contains(snippets[0], "not kept") || !strings.Contains(snippets[1], `"orderNo"`) {
			t.Fatalf("snippets: %q", snippets)
		}
		var stored []string
		if err := db.NewSelect().Table("webhook_delivery").Column("response_snippet").Scan(b.ctx, &stored); err != nil {
			t.Fatal(err)
		}
		if strings.Contains(strings.Join(stored, ""), "CODE-") {
			t.Fatal("a code was stored in the delivery log")
		}
	})
}

// TestWebhookCodesNeedHTTPS: an endpoint cannot be marked to receive
// codes with an http URL, neither at creation nor by an update of either
// field; one stored so anyway gets no codes.
func TestWebhookCodesNeedHTTPS(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		h := b.hooks(domain.WebhookConfig{})
		plainURL, tlsURL, yes := "http://127.0.0.1:9/hook", "https://127.0.0.1:9/hook", true
		paid := []domain.EventType{domain.EventOrderPaid}
		_, _, err := h.CreateEndpoint(b.ctx, domain.WebhookEndpointInput{URL: &plainURL, Events: paid, ReceivesCodes: &yes}, "admin")
		wantCode(t, err, domain.EBADINPUT)
		plain, _ := b.endpoint(t, h, plainURL, false, paid...)
		_, err = h.UpdateEndpoint(b.ctx, plain.ID, domain.WebhookEndpointInput{ReceivesCodes: &yes}, "admin")
		wantCode(t, err, domain.EBADINPUT)
		secure, _ := b.endpoint(t, h, tlsURL, true, paid...)
		_, err = h.UpdateEndpoint(b.ctx, secure.ID, domain.WebhookEndpointInput{URL: &plainURL}, "admin")
		wantCode(t, err, domain.EBADINPUT)
		if e, err := h.Endpoint(b.ctx, secure.ID); err != nil || e.URL != tlsURL || !e.ReceivesCodes {
			t.Fatalf("after the refused update: %+v, %v", e, err)
		}

		// An endpoint stored with codes over http before the rule (written
		// here directly) is sent the event without them.
		r := newReceiver(t, 200)
		old, _ := b.endpoint(t, h, r.srv.URL, false, paid...)
		if _, err := db.NewUpdate().Table("webhook_endpoint").Set("receives_codes = ?", true).Where("id = ?", old.ID).Exec(b.ctx); err != nil {
			t.Fatal(err)
		}
		if _, err := h.DeleteEndpoint(b.ctx, secure.ID, "admin"); err != nil {
			t.Fatal(err)
		}
		if _, err := h.DeleteEndpoint(b.ctx, plain.ID, "admin"); err != nil {
			t.Fatal(err)
		}
		p := b.product(t, 500, 1)
		o := b.order(t, p, 1).Order
		b.pay(t, o, "T1", "N1")
		for _, d := range fanOut(t, b, h) {
			if _, err := h.Deliver(b.ctx, d.ID); err != nil {
				t.Fatal(err)
			}
		}
		var msg struct{ Data domain.OrderObject }
		if reqs := r.requests(); len(reqs) != 1 || json.Unmarshal(reqs[0].body, &msg) != nil || len(msg.Data.Cards) != 0 ||
			!strings.Contains(msg.Data.CodesWithheld, "not https") {
			t.Fatalf("deliveries to the http endpoint: %+v", reqs)
		}
		if page, err := b.ledger.ListReveals(b.ctx, o.OrderNo, 0, 0, 10); err != nil || len(page.Reveals) != 0 {
			t.Fatalf("reveals: %+v, %v", page, err)
		}
	})
}

// failingTransport fails every request with its text, as a hostile
// receiver's TLS alert or a broken proxy can.
type failingTransport string

func (f failingTransport) RoundTrip(*http.Request) (*http.Response, error) {
	return nil, errors.New(string(f))
}

// TestWebhookHostileErrorText: an attempt that fails with an error text
// holding NUL, invalid UTF-8 and multibyte runes across the column's
// bound is recorded (valid UTF-8, no NUL, at most 255 bytes), and the
// delivery ends FAILED after its attempts instead of retrying forever.
func TestWebhookHostileErrorText(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		h := b.hooks(domain.WebhookConfig{BackoffBase: time.Minute, BackoffMax: time.Minute, RetryFor: 2 * time.Minute})
		h.Client = &http.Client{Transport: failingTransport("remote error: tls: \x00\xff\xfe" + strings.Repeat("证书无效", 30))}
		b.endpoint(t, h, "http://127.0.0.1:9/hook", false, domain.EventOrderPaid)
		p := b.product(t, 500, 1)
		b.pay(t, b.order(t, p, 1).Order, "T1", "N1")
		ds := fanOut(t, b, h)
		var d *domain.WebhookDelivery
		for i := 0; i < 10; i++ {
			var err error
			if d, err = h.Deliver(b.ctx, ds[0].ID); err != nil {
				t.Fatalf("attempt %d: %v", i+1, err)
			}
			if d.Status != domain.DeliveryPending {
				break
			}
			b.clock.Advance(d.NextAttemptAt.Sub(b.clock.Now()))
		}
		if d.Status != domain.DeliveryFailed || b.alerts.count("webhook_failed") != 1 {
			t.Fatalf("delivery: %+v", d)
		}
		if e := d.LastError; !utf8.ValidString(e) || strings.ContainsRune(e, 0) || len(e) > 255 || !strings.HasPrefix(e, "remote error: tls: ") {
			t.Fatalf("last error %q", e)
		}
		for _, c := range []struct {
			in   string
			max  int
			want string
		}{{"a\x00b", 10, "ab"}, {"a\xffb", 10, "a\uFFFDb"}, {"ab证", 4, "ab"}, {"ab证", 5, "ab证"}} {
			if got := domain.StoredText(c.in, c.max); got != c.want {
				t.Errorf("StoredText(%q, %d) = %q, want %q", c.in, c.max, got, c.want)
			}
		}
	})
}
