package graph

import (
	"context"

	"kami/domain"
	"kami/graph/model"
)

// hooks is the webhook service for an admin; UNAUTHENTICATED or FORBIDDEN
// for anyone else, UNAVAILABLE when the server runs without it.
func (r *Resolver) hooks(ctx context.Context) (*domain.Webhooks, error) {
	if err := requireAdmin(ctx); err != nil {
		return nil, err
	}
	if r.cfg.Webhooks == nil {
		return nil, domain.Errorf(domain.EUNAVAILABLE, "webhooks are not available on this server")
	}
	return r.cfg.Webhooks, nil
}

func eventTypes(names []string) []domain.EventType {
	if names == nil {
		return nil
	}
	out := make([]domain.EventType, len(names))
	for i, n := range names {
		out[i] = domain.EventType(n)
	}
	return out
}

func withSecret(e *domain.WebhookEndpoint, secret string, err error) (*model.WebhookEndpointWithSecret, error) {
	if err != nil {
		return nil, err
	}
	return &model.WebhookEndpointWithSecret{Endpoint: e, Secret: secret}, nil
}

func deliveryConnection(page *domain.DeliveryPage) *model.WebhookDeliveryConnection {
	c := &model.WebhookDeliveryConnection{Edges: make([]*model.WebhookDeliveryEdge, len(page.Deliveries))}
	end := ""
	for i := range page.Deliveries {
		end = idCursor("webhookDeliveries", page.Deliveries[i].ID)
		c.Edges[i] = &model.WebhookDeliveryEdge{Cursor: end, Node: &page.Deliveries[i]}
	}
	c.PageInfo = pageInfo(page.HasNext, end)
	return c
}

func nonZeroInt(n int) *int {
	if n == 0 {
		return nil
	}
	return &n
}
