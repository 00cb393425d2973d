package graph

import (
	"context"
	"encoding/base64"
	"fmt"
	"strconv"
	"strings"
	"time"

	"kami/domain"
	"kami/graph/model"
	"kami/providers"
)

// Cursors are opaque to clients: base64url of "<list>:<position>", so a
// cursor from one list is refused by another.

func keysetCursor(list string, at time.Time, id int64) string {
	return base64.RawURLEncoding.EncodeToString(fmt.Appendf(nil, "%s:%d:%d", list, at.UnixMicro(), id))
}

func idCursor(list string, id int64) string {
	return base64.RawURLEncoding.EncodeToString(fmt.Appendf(nil, "%s:%d", list, id))
}

func badCursor() error {
	return domain.Errorf(domain.EBADINPUT, "after is not a cursor of this list")
}

func decodeCursor(list string, after *string, parts int) ([]int64, error) {
	if after == nil || *after == "" {
		return nil, nil
	}
	raw, err := base64.RawURLEncoding.DecodeString(*after)
	if err != nil {
		return nil, badCursor()
	}
	fields := strings.Split(string(raw), ":")
	if len(fields) != parts+1 || fields[0] != list {
		return nil, badCursor()
	}
	out := make([]int64, parts)
	for i, f := range fields[1:] {
		if out[i], err = strconv.ParseInt(f, 10, 64); err != nil {
			return nil, badCursor()
		}
	}
	return out, nil
}

func keysetAfter(list string, after *string) (domain.Keyset, error) {
	v, err := decodeCursor(list, after, 2)
	if err != nil || v == nil {
		return domain.Keyset{}, err
	}
	return domain.Keyset{At: time.UnixMicro(v[0]).UTC(), ID: v[1]}, nil
}

func idAfter(list string, after *string) (int64, error) {
	v, err := decodeCursor(list, after, 1)
	if err != nil || v == nil {
		return 0, err
	}
	return v[0], nil
}

func pageSize(first *int) int {
	if first == nil {
		return 20
	}
	return *first
}

func pageInfo(hasNext bool, end string) *model.PageInfo {
	pi := &model.PageInfo{HasNextPage: hasNext}
	if end != "" {
		pi.EndCursor = &end
	}
	return pi
}

func orderConnection(ctx context.Context, page *domain.OrderPage) *model.OrderConnection {
	c := &model.OrderConnection{Edges: make([]*model.OrderEdge, len(page.Orders))}
	nodes := make([]*model.Order, len(page.Orders))
	end := ""
	for i := range page.Orders {
		o := &page.Orders[i]
		end = keysetCursor("orders", o.CreatedAt, o.ID)
		nodes[i] = &model.Order{Order: *o}
		c.Edges[i] = &model.OrderEdge{Cursor: end, Node: nodes[i]}
	}
	primeOrders(ctx, nodes)
	c.PageInfo = pageInfo(page.HasNext, end)
	return c
}

func cardConnection(ctx context.Context, page *domain.CardPage) *model.CardConnection {
	c := &model.CardConnection{Edges: make([]*model.CardEdge, len(page.Cards))}
	ls := loadersOf(ctx)
	end := ""
	for i := range page.Cards {
		card := &page.Cards[i]
		end = idCursor("cards", card.ID)
		c.Edges[i] = &model.CardEdge{Cursor: end, Node: card}
		ls.products.prime(card.ProductID)
	}
	c.PageInfo = pageInfo(page.HasNext, end)
	return c
}

func refundConnection(ctx context.Context, page *domain.RefundPage) *model.RefundConnection {
	c := &model.RefundConnection{Edges: make([]*model.RefundEdge, len(page.Refunds))}
	ls := loadersOf(ctx)
	end := ""
	for i := range page.Refunds {
		r := &page.Refunds[i]
		end = keysetCursor("refunds", r.CreatedAt, r.ID)
		c.Edges[i] = &model.RefundEdge{Cursor: end, Node: r}
		ls.orders.prime(r.OrderNo)
	}
	c.PageInfo = pageInfo(page.HasNext, end)
	return c
}

func orderFilter(f *model.OrderFilter) domain.OrderFilter {
	var out domain.OrderFilter
	if f == nil {
		return out
	}
	if f.Status != nil {
		out.Status = *f.Status
	}
	if f.ProductID != nil {
		out.ProductID = *f.ProductID
	}
	if f.Contact != nil {
		out.Contact = *f.Contact
	}
	if f.CreatedFrom != nil {
		out.CreatedFrom = *f.CreatedFrom
	}
	if f.CreatedBefore != nil {
		out.CreatedBefore = *f.CreatedBefore
	}
	return out
}

func productInput(name, description *string, price *int64, active *bool, maxPerOrder *int) domain.ProductInput {
	return domain.ProductInput{Name: name, Description: description, PriceFen: price, Active: active, MaxPerOrder: maxPerOrder}
}

// withStockRules adds a product input's code rule and low-stock threshold.
func withStockRules(in domain.ProductInput, pattern *string, minLen, maxLen, threshold *int) domain.ProductInput {
	in.CodePattern, in.CodeMinLen, in.CodeMaxLen, in.LowStockThreshold = pattern, minLen, maxLen, threshold
	return in
}

func stats(ctx context.Context, cfg Config) (*model.Stats, error) {
	out := &model.Stats{Queues: []*model.QueueStat{}}
	if cfg.Stats != nil {
		h, err := cfg.Stats.Health(ctx)
		if err != nil {
			return nil, err
		}
		for _, q := range h.Queues {
			out.Queues = append(out.Queues, &model.QueueStat{Name: q.Name, Backlog: int(q.Backlog), OldestOverdueSeconds: q.OldestOverdue.Seconds()})
		}
		out.CloseSuccessRate, out.RefundFailureRate = h.CloseSuccessRate, h.RefundFailureRate
	}
	ps, err := cfg.Ledger.Products(ctx, false)
	if err != nil {
		return nil, err
	}
	counts, err := cfg.Ledger.StockCounts(ctx)
	if err != nil {
		return nil, err
	}
	ls := loadersOf(ctx)
	for i := range ps {
		c := counts[ps[i].ID]
		ls.stock.prime(ps[i].ID)
		out.Stock = append(out.Stock, &model.ProductStock{Product: &ps[i], Lockable: c.Lockable, Locked: c.Locked, Sold: c.Sold, Withdrawn: c.Withdrawn})
	}
	if out.Stock == nil {
		out.Stock = []*model.ProductStock{}
	}
	return out, nil
}

func deref[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}

func nonEmpty(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// paymentOf is a provider's payment action as the API shows it.
func paymentOf(a providers.PaymentAction) *model.Payment {
	return &model.Payment{Kind: a.Kind, URL: nonEmpty(a.URL), QRCode: nonEmpty(a.QRCode), ExpiresAt: a.ExpiresAt}
}
