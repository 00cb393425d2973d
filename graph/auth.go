package graph

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"strings"

	"github.com/99designs/gqlgen/graphql/handler/transport"

	"kami/domain"
	"kami/graph/model"
)

// viewer is who is calling, decided once per request (or per WebSocket
// connection) from the Authorization header.
type viewer struct {
	admin bool
	// presented is set when a bearer token was sent, right or wrong.
	presented bool
}

// caller is what kami knows of who sent a request, put on its context
// once (httpHandler, or a WebSocket's init): the viewer, the client's
// address, and the request's body when the server lets its read deadline
// move on (see RollingBody).
type caller struct {
	viewer viewer
	addr   string
	body   RollingBody
}

type callerKey struct{}

func withCaller(ctx context.Context, c caller) context.Context {
	return context.WithValue(ctx, callerKey{}, c)
}

func callerOf(ctx context.Context) caller {
	c, _ := ctx.Value(callerKey{}).(caller)
	return c
}

// withViewer replaces the viewer of ctx's caller.
func withViewer(ctx context.Context, v viewer) context.Context {
	c := callerOf(ctx)
	c.viewer = v
	return withCaller(ctx, c)
}

func viewerOf(ctx context.Context) viewer { return callerOf(ctx).viewer }

func clientAddrOf(ctx context.Context) string { return callerOf(ctx).addr }

// viewerFrom checks an Authorization header against the admin token in
// constant time. Both sides are hashed first so that neither the token's
// length nor its content leaks through timing; an empty admin token admits
// nobody.
func viewerFrom(authorization, adminToken string) viewer {
	scheme, token, ok := strings.Cut(strings.TrimSpace(authorization), " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return viewer{presented: authorization != ""}
	}
	token = strings.TrimSpace(token)
	got := sha256.Sum256([]byte(token))
	want := sha256.Sum256([]byte(adminToken))
	match := subtle.ConstantTimeCompare(got[:], want[:]) == 1
	return viewer{admin: match && adminToken != "", presented: true}
}

// requireAdmin: UNAUTHENTICATED without a valid admin token.
func requireAdmin(ctx context.Context) error {
	v := viewerOf(ctx)
	switch {
	case v.admin:
		return nil
	case v.presented:
		return domain.Errorf(domain.EUNAUTH, "the admin token is not valid")
	default:
		return domain.Errorf(domain.EUNAUTH, "this needs the admin token (Authorization: Bearer …)")
	}
}

// adminField guards a field of an object the caller may see whose value
// only admins may: FORBIDDEN for anyone else.
func adminField(ctx context.Context, field string) error {
	if viewerOf(ctx).admin {
		return nil
	}
	return domain.Errorf(domain.EFORBIDDEN, "%s is for admins only", field)
}

// codesVisible says whether the caller may see o's card codes: its buyer
// once it is PAID, an admin once it was delivered (also when refunded
// since: the codes were shown).
func codesVisible(ctx context.Context, o *model.Order) bool {
	if o.DeliveredAt.IsZero() {
		return false
	}
	if viewerOf(ctx).admin {
		return true
	}
	return o.Buyer && o.Status == domain.OrderPaid
}

// wsInit lets a WebSocket client that cannot set headers (a browser) send
// the admin token in connection_init's payload as "Authorization". Buyers
// need nothing: their access token is an argument.
func wsInit(adminToken string) transport.WebsocketInitFunc {
	return func(ctx context.Context, p transport.InitPayload) (context.Context, *transport.InitPayload, error) {
		auth := p.Authorization()
		if auth == "" {
			if s, ok := p["authorization"].(string); ok {
				auth = s
			}
		}
		if auth != "" {
			ctx = withViewer(ctx, viewerFrom(auth, adminToken))
		}
		return ctx, nil, nil
	}
}
