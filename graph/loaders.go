package graph

import (
	"context"
	"sync"

	"kami/domain"
	"kami/graph/model"
)

// loader batches the reads of one response. A parent that knows which keys
// its children will ask for primes them (a page of orders primes its
// products); the first load then fetches every primed key and its own in
// one query, and the rest are answered from what that fetch brought.
// Nothing waits on a timer, so the number of queries for a page does not
// depend on scheduling. Results are matched to keys, never to positions.
//
// The loaders of a response are fields of one struct (response), made
// when the response starts: a loader costs nothing until it is used.
type loader[K comparable, V any] struct {
	ls    *loaders
	fetch func(ctx context.Context, ls *loaders, keys []K) (map[K]V, error)

	mu     sync.Mutex
	primed []K
	done   map[K]result[V]
}

type result[V any] struct {
	v   V
	ok  bool
	err error
}

func (l *loader[K, V]) init(ls *loaders, fetch func(context.Context, *loaders, []K) (map[K]V, error)) {
	l.ls, l.fetch = ls, fetch
}

// prime notes keys that the next fetch should bring as well.
func (l *loader[K, V]) prime(keys ...K) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, k := range keys {
		if _, ok := l.done[k]; !ok {
			l.primed = append(l.primed, k)
		}
	}
}

// load returns the value for key; ok is false when there is none.
func (l *loader[K, V]) load(ctx context.Context, key K) (V, bool, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if r, ok := l.done[key]; ok {
		return r.v, r.ok, r.err
	}
	seen := map[K]bool{key: true}
	batch := []K{key}
	for _, k := range l.primed {
		if _, ok := l.done[k]; !ok && !seen[k] {
			seen[k] = true
			batch = append(batch, k)
		}
	}
	l.primed = nil
	got, err := l.fetch(ctx, l.ls, batch)
	if l.done == nil {
		l.done = map[K]result[V]{}
	}
	for _, k := range batch {
		v, ok := got[k]
		l.done[k] = result[V]{v: v, ok: ok, err: err}
	}
	r := l.done[key]
	return r.v, r.ok, r.err
}

// loaders are one response's loaders.
type loaders struct {
	ledger   *domain.Ledger
	products loader[int64, *domain.Product]
	stock    loader[int64, int] // cards for sale
	orders   loader[string, *domain.Order]
	codes    loader[string, []string]
	batches  loader[int64, *domain.Batch]
	// batchStocks counts batches' cards by status.
	batchStocks loader[int64, domain.BatchStock]
}

func (ls *loaders) init(l *domain.Ledger) {
	ls.ledger = l
	ls.products.init(ls, func(ctx context.Context, ls *loaders, ids []int64) (map[int64]*domain.Product, error) {
		ps, err := ls.ledger.ProductsByID(ctx, ids)
		for id := range ps {
			ls.stock.prime(id)
		}
		return ps, err
	})
	ls.stock.init(ls, func(ctx context.Context, ls *loaders, ids []int64) (map[int64]int, error) {
		return ls.ledger.SellableCounts(ctx, ids...)
	})
	ls.orders.init(ls, func(ctx context.Context, ls *loaders, nos []string) (map[string]*domain.Order, error) {
		os, err := ls.ledger.OrdersByNo(ctx, nos)
		for _, o := range os {
			ls.products.prime(o.ProductID)
			if viewerOf(ctx).admin && !o.DeliveredAt.IsZero() {
				ls.codes.prime(o.OrderNo)
			}
		}
		return os, err
	})
	ls.codes.init(ls, func(ctx context.Context, ls *loaders, nos []string) (map[string][]string, error) {
		return ls.ledger.SoldCodes(ctx, nos)
	})
	ls.batches.init(ls, func(ctx context.Context, ls *loaders, ids []int64) (map[int64]*domain.Batch, error) {
		return ls.ledger.BatchesByID(ctx, ids)
	})
	ls.batchStocks.init(ls, func(ctx context.Context, ls *loaders, ids []int64) (map[int64]domain.BatchStock, error) {
		return ls.ledger.BatchStocks(ctx, ids)
	})
}

// response is what one response (one query or mutation, one subscription
// event) keeps while it is made: its loaders and the card codes it
// reveals (reveals.go). One allocation, made when the response starts.
type response struct {
	loaders loaders
	reveals revealNotes
}

type responseKey struct{}

func withResponse(ctx context.Context, l *domain.Ledger) context.Context {
	r := &response{}
	r.loaders.init(l)
	return context.WithValue(ctx, responseKey{}, r)
}

func responseOf(ctx context.Context) *response {
	r, _ := ctx.Value(responseKey{}).(*response)
	return r
}

func loadersOf(ctx context.Context) *loaders {
	return &responseOf(ctx).loaders
}

// primeOrders tells the loaders what a list of orders will ask for: their
// products, and the codes of those the caller may see.
func primeOrders(ctx context.Context, os []*model.Order) {
	ls := loadersOf(ctx)
	for _, o := range os {
		ls.products.prime(o.ProductID)
		if codesVisible(ctx, o) {
			ls.codes.prime(o.OrderNo)
		}
	}
}

// primeProducts tells the loaders a list of products will ask for stock.
func primeProducts(ctx context.Context, ps []*domain.Product) {
	ls := loadersOf(ctx)
	for _, p := range ps {
		ls.stock.prime(p.ID)
	}
}

func (ls *loaders) product(ctx context.Context, id int64) (*domain.Product, error) {
	p, ok, err := ls.products.load(ctx, id)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, domain.Errorf(domain.ENOTFOUND, "product %d not found", id)
	}
	return p, nil
}

func (ls *loaders) batch(ctx context.Context, id int64) (*domain.Batch, error) {
	b, ok, err := ls.batches.load(ctx, id)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, domain.Errorf(domain.ENOTFOUND, "batch %d not found", id)
	}
	return b, nil
}

func (ls *loaders) order(ctx context.Context, orderNo string) (*domain.Order, error) {
	o, ok, err := ls.orders.load(ctx, orderNo)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, domain.Errorf(domain.ENOTFOUND, "order %s not found", orderNo)
	}
	return o, nil
}
