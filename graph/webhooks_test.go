package graph_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"kami/domain"
	"kami/graph"
)

// TestWebhookAdmin: an admin creates an endpoint (its secret answered
// once), lists it, rotates its secret, disables and deletes it; a paid
// order's event shows in its delivery log, and can be sent again. A URL
// on a private address is refused when the guard is on, and everything
// is refused to anyone but an admin.
func TestWebhookAdmin(t *testing.T) {
	t.Parallel()
	var hits atomic.Int32
	recv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		hits.Add(1)
		w.Write([]byte("thanks"))
	}))
	defer recv.Close()
	var hooks *domain.Webhooks
	b := setup(t, options{mod: func(c *graph.Config) {
		hooks = domain.NewWebhooks(c.Ledger, domain.WebhookConfig{}, nil, quietLogger())
		hooks.Config.Guard.AllowPrivate = true
		hooks.Client = hooks.Config.Guard.Client(hooks.Config.Timeout)
		c.Webhooks = hooks
	}})
	const create = `mutation($in: CreateWebhookEndpointInput!) { createWebhookEndpoint(input: $in) { secret endpoint { id url events enabled receivesCodes } } }`
	for _, who := range []as{anon, "Bearer not-the-token"} {
		b.do(t, who, `{ webhookEndpoints { id } }`, nil).wantCode(t, domain.EUNAUTH)
		b.do(t, who, create, map[string]any{"in": map[string]any{"url": recv.URL, "events": []string{"order.paid"}}}).wantCode(t, domain.EUNAUTH)
	}
	var created struct {
		CreateWebhookEndpoint struct {
			Secret   string
			Endpoint struct {
				ID, URL string
				Events  []string
				Enabled bool
			}
		}
	}
	b.do(t, admin, create, map[string]any{"in": map[string]any{"url": recv.URL, "events": []string{"order.paid", "order.closed"}}}).decode(t, &created)
	ep := created.CreateWebhookEndpoint
	if !strings.HasPrefix(ep.Secret, "whsec_") || ep.Endpoint.URL != recv.URL || len(ep.Endpoint.Events) != 2 || !ep.Endpoint.Enabled {
		t.Fatalf("created: %+v", ep)
	}
	b.do(t, admin, create, map[string]any{"in": map[string]any{"url": recv.URL, "events": []string{"order.eaten"}}}).wantCode(t, domain.EBADINPUT)

	// A paid order: its event is fanned out and delivered, and listed.
	p := b.product(t, "5.00", 1)
	o := b.order(t, p, 1, "buyer@example.com")
	b.pay(t, o.Order.OrderNo, "T-1")
	ds, _, err := hooks.FanOut(b.ctx, 10)
	if err != nil || len(ds) != 1 {
		t.Fatalf("FanOut: %v, %v", ds, err)
	}
	if d, err := hooks.Deliver(b.ctx, ds[0].ID); err != nil || d.Status != domain.DeliveryDelivered {
		t.Fatalf("Deliver: %+v, %v", d, err)
	}
	var log struct {
		WebhookDeliveries struct {
			Edges []struct {
				Node struct {
					EventID, EventType, Status string
					Attempts                   int
					LastStatusCode             *int
					ResponseSnippet            *string
				}
			}
		}
	}
	const deliveries = `query($id: ID!) { webhookDeliveries(endpointId: $id) { edges { node { eventId eventType status attempts lastStatusCode responseSnippet } } } }`
	b.do(t, admin, deliveries, map[string]any{"id": ep.Endpoint.ID}).decode(t, &log)
	if e := log.WebhookDeliveries.Edges; len(e) != 1 || e[0].Node.EventType != "order.paid" || e[0].Node.Status != "DELIVERED" ||
		e[0].Node.LastStatusCode == nil || *e[0].Node.LastStatusCode != 200 || e[0].Node.ResponseSnippet == nil || *e[0].Node.ResponseSnippet != "thanks" {
		t.Fatalf("delivery log: %+v", log)
	}
	var again struct{ RedeliverWebhookEvent []struct{ Status string } }
	b.do(t, admin, `mutation($ev: ID!) { redeliverWebhookEvent(eventId: $ev) { status } }`,
		map[string]any{"ev": log.WebhookDeliveries.Edges[0].Node.EventID}).decode(t, &again)
	if len(again.RedeliverWebhookEvent) != 1 || again.RedeliverWebhookEvent[0].Status != "PENDING" {
		t.Fatalf("redeliver: %+v", again)
	}

	var rotated struct {
		RotateWebhookSecret struct {
			Secret   string
			Endpoint struct{ PreviousSecretValidUntil *string }
		}
	}
	b.do(t, admin, `mutation($id: ID!) { rotateWebhookSecret(id: $id) { secret endpoint { previousSecretValidUntil } } }`,
		map[string]any{"id": ep.Endpoint.ID}).decode(t, &rotated)
	if rotated.RotateWebhookSecret.Secret == ep.Secret || rotated.RotateWebhookSecret.Endpoint.PreviousSecretValidUntil == nil {
		t.Fatalf("rotated: %+v", rotated)
	}
	var updated struct{ UpdateWebhookEndpoint struct{ Enabled bool } }
	b.do(t, admin, `mutation($id: ID!) { updateWebhookEndpoint(id: $id, input: {enabled: false}) { enabled } }`,
		map[string]any{"id": ep.Endpoint.ID}).decode(t, &updated)
	if updated.UpdateWebhookEndpoint.Enabled {
		t.Fatal("not disabled")
	}
	b.do(t, admin, `mutation($id: ID!) { deleteWebhookEndpoint(id: $id) { id } }`, map[string]any{"id": ep.Endpoint.ID})
	var list struct{ WebhookEndpoints []struct{ ID string } }
	b.do(t, admin, `{ webhookEndpoints { id } }`, nil).decode(t, &list)
	if len(list.WebhookEndpoints) != 0 {
		t.Fatalf("listed after delete: %+v", list)
	}
	b.do(t, admin, `mutation($id: ID!) { deleteWebhookEndpoint(id: $id) { id } }`, map[string]any{"id": ep.Endpoint.ID}).wantCode(t, domain.ENOTFOUND)

	// The guard on: a receiver on 127.0.0.1 is refused.
	hooks.Config.Guard.AllowPrivate = false
	b.do(t, admin, create, map[string]any{"in": map[string]any{"url": recv.URL, "events": []string{"order.paid"}}}).wantCode(t, domain.EBADINPUT)
}
