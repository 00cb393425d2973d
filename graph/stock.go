package graph

import (
	"context"
	"errors"
	"net/http"
	"time"

	"github.com/vektah/gqlparser/v2/gqlerror"

	"kami/domain"
	"kami/graph/model"
)

// Conversions for the stock part of the schema (stock.graphqls).

func batchConnection(ctx context.Context, page *domain.BatchPage) *model.BatchConnection {
	c := &model.BatchConnection{Edges: make([]*model.BatchEdge, len(page.Batches))}
	ls := loadersOf(ctx)
	end := ""
	for i := range page.Batches {
		b := &page.Batches[i]
		end = idCursor("batches", b.ID)
		c.Edges[i] = &model.BatchEdge{Cursor: end, Node: b}
		ls.products.prime(b.ProductID)
		ls.batchStocks.prime(b.ID)
	}
	c.PageInfo = pageInfo(page.HasNext, end)
	return c
}

func batchOrderConnection(ctx context.Context, page *domain.BatchOrderPage) *model.OrderConnection {
	c := &model.OrderConnection{Edges: make([]*model.OrderEdge, len(page.Orders))}
	nodes := make([]*model.Order, len(page.Orders))
	end := ""
	for i := range page.Orders {
		end = idCursor("batchOrders", page.Orders[i].ID)
		nodes[i] = &model.Order{Order: page.Orders[i]}
		c.Edges[i] = &model.OrderEdge{Cursor: end, Node: nodes[i]}
	}
	primeOrders(ctx, nodes)
	c.PageInfo = pageInfo(page.HasNext, end)
	return c
}

func revealConnection(page *domain.RevealPage) *model.RevealConnection {
	c := &model.RevealConnection{Edges: make([]*model.RevealEdge, len(page.Reveals))}
	end := ""
	for i := range page.Reveals {
		end = idCursor("reveals", page.Reveals[i].ID)
		c.Edges[i] = &model.RevealEdge{Cursor: end, Node: &page.Reveals[i]}
	}
	c.PageInfo = pageInfo(page.HasNext, end)
	return c
}

func batchStock(s domain.BatchStock) *model.BatchStock {
	return &model.BatchStock{Unsold: s[domain.CardUnsold], Locked: s[domain.CardLocked], Sold: s[domain.CardSold],
		Recycled: s[domain.CardRecycled], Withdrawn: s[domain.CardWithdrawn]}
}

// refusalCounts lists a report's refusals by reason, in the order of
// domain.RefusalReasons, leaving out the reasons no line had.
func refusalCounts(r *domain.ImportReport) []*model.RefusalCount {
	out := []*model.RefusalCount{}
	for _, reason := range domain.RefusalReasons {
		if n := r.ByReason[reason]; n > 0 {
			out = append(out, &model.RefusalCount{Reason: reason, Count: n})
		}
	}
	return out
}

// uploadError says what became of an import whose file could not be read
// to its end: past the size limit, or the client went away. Either way
// nothing was imported.
func uploadError(ctx context.Context, err error) error {
	var tooLarge *http.MaxBytesError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &tooLarge):
		e := gqlerror.Errorf("the upload is larger than %d bytes (KAMI_MAX_UPLOAD_BYTES); nothing was imported", tooLarge.Limit)
		e.Extensions = map[string]any{"code": codeBodyTooLarge}
		return e
	case ctx.Err() != nil:
		return domain.Errorf(domain.EUNAVAILABLE, "the upload was interrupted; nothing was imported")
	}
	return err
}

func nonZeroTime(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	return &t
}
