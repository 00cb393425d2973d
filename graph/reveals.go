package graph

import (
	"context"
	"log/slog"
	"sync"

	"github.com/99designs/gqlgen/graphql"
	"github.com/vektah/gqlparser/v2/ast"
	"github.com/vektah/gqlparser/v2/gqlerror"

	"kami/domain"
	"kami/graph/model"
)

// The reveal audit of the GraphQL API: a resolver that hands out card
// codes (Order.cards, Card.code) notes who it showed them to; the notes of
// one response (one query or mutation, one subscription event) are
// written in one insert when the response is complete and before it is
// sent. If they cannot be written, the response is replaced by an error:
// no code leaves unrecorded.

// revealNotes are one response's reveals (kept in its response).
type revealNotes struct {
	mu      sync.Mutex
	reveals []domain.Reveal
}

func noteReveal(ctx context.Context, r domain.Reveal) {
	resp := responseOf(ctx)
	if resp == nil {
		return
	}
	n := &resp.reveals
	n.mu.Lock()
	defer n.mu.Unlock()
	n.reveals = append(n.reveals, r)
}

// viewerReveal is a reveal to the caller, over the channel its operation
// is: ORDER for a query or mutation, SUBSCRIPTION for an event.
func viewerReveal(ctx context.Context, buyer bool) domain.Reveal {
	r := domain.Reveal{Channel: domain.RevealOrder, Viewer: domain.ViewerAdmin, Actor: actor, ClientAddr: clientAddrOf(ctx)}
	if graphql.HasOperationContext(ctx) {
		if op := graphql.GetOperationContext(ctx).Operation; op != nil && op.Operation == ast.Subscription {
			r.Channel = domain.RevealSubscription
		}
	}
	if buyer && !viewerOf(ctx).admin {
		r.Viewer, r.Actor = domain.ViewerBuyer, "buyer"
	}
	return r
}

// noteOrderReveal notes that an order's n codes were shown to the caller.
func noteOrderReveal(ctx context.Context, o *model.Order, n int) {
	if n == 0 {
		return
	}
	r := viewerReveal(ctx, o.Buyer)
	r.OrderNo, r.Codes = o.OrderNo, n
	noteReveal(ctx, r)
}

// noteCardReveal notes that an admin read a card's code.
func noteCardReveal(ctx context.Context, c *domain.Card) {
	r := viewerReveal(ctx, false)
	r.Channel = domain.RevealAdminCode
	noteReveal(ctx, domain.CardRevealOf(r, c))
}

// recordReveals writes the response's reveals; when it cannot, the codes
// are withheld and the caller told to try again.
func recordReveals(ctx context.Context, l *domain.Ledger, log *slog.Logger, resp *graphql.Response) *graphql.Response {
	state := responseOf(ctx)
	if state == nil || resp == nil {
		return resp
	}
	n := &state.reveals
	n.mu.Lock()
	reveals := n.reveals
	n.mu.Unlock()
	if len(reveals) == 0 {
		return resp
	}
	if err := l.RecordReveals(context.WithoutCancel(ctx), reveals...); err != nil {
		log.ErrorContext(ctx, "card codes withheld: their reveal could not be recorded", "err", err)
		e := gqlerror.Errorf("the card codes cannot be shown right now; try again")
		e.Extensions = map[string]any{"code": domain.EUNAVAILABLE}
		return &graphql.Response{Errors: gqlerror.List{e}, Extensions: resp.Extensions}
	}
	return resp
}
