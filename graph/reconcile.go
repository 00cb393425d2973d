package graph

import (
	"context"

	"kami/domain"
	"kami/graph/model"
	"kami/providers"
)

// dayOf reads a date argument ("2026-12-01"); nil or "" is no day.
func dayOf(date *string) (providers.Day, error) {
	if date == nil || *date == "" {
		return providers.Day{}, nil
	}
	d, err := providers.ParseDay(*date)
	if err != nil {
		return providers.Day{}, domain.Errorf(domain.EBADINPUT, "date: %v", err)
	}
	return d, nil
}

func statementRunConnection(page *domain.StatementRunPage) *model.StatementRunConnection {
	c := &model.StatementRunConnection{Edges: make([]*model.StatementRunEdge, len(page.Runs))}
	end := ""
	for i := range page.Runs {
		run := &page.Runs[i]
		end = keysetCursor("statementRuns", run.StartedAt, run.ID)
		c.Edges[i] = &model.StatementRunEdge{Cursor: end, Node: run}
	}
	c.PageInfo = pageInfo(page.HasNext, end)
	return c
}

func differenceConnection(ctx context.Context, page *domain.DifferencePage) *model.StatementDifferenceConnection {
	c := &model.StatementDifferenceConnection{Edges: make([]*model.StatementDifferenceEdge, len(page.Differences))}
	ls := loadersOf(ctx)
	end := ""
	for i := range page.Differences {
		d := &page.Differences[i]
		end = keysetCursor("statementDifferences", d.CreatedAt, d.ID)
		c.Edges[i] = &model.StatementDifferenceEdge{Cursor: end, Node: d}
		if d.OrderNo != "" {
			ls.orders.prime(d.OrderNo)
		}
	}
	c.PageInfo = pageInfo(page.HasNext, end)
	return c
}

func pointers[T any](xs []T) []*T {
	out := make([]*T, len(xs))
	for i := range xs {
		out[i] = &xs[i]
	}
	return out
}

func nonZero(fen int64) *int64 {
	if fen == 0 {
		return nil
	}
	return &fen
}
