package graph

import (
	"context"

	"kami/graph/model"
)

// Resolver is the root resolver: it holds what the resolvers call.
type Resolver struct {
	cfg Config
}

// actor names admin actions in the audit log; there is one admin token.
const actor = "admin"

// readOrder returns how one caller reads one order: its buyer with the
// access token (a wrong token is NOT_FOUND, like a missing order, so order
// numbers cannot be probed), an admin without it; anyone else is
// UNAUTHENTICATED.
func (r *Resolver) readOrder(orderNo string, accessToken *string) func(context.Context) (*model.Order, error) {
	return func(ctx context.Context) (*model.Order, error) {
		if accessToken != nil {
			o, err := r.cfg.Ledger.BuyerOrder(ctx, orderNo, *accessToken)
			if err != nil {
				return nil, err
			}
			return &model.Order{Order: *o, Buyer: true}, nil
		}
		if err := requireAdmin(ctx); err != nil {
			return nil, err
		}
		o, err := r.cfg.Ledger.Order(ctx, orderNo)
		if err != nil {
			return nil, err
		}
		return &model.Order{Order: *o}, nil
	}
}
