package main

import (
	"container/heap"
	"context"
	"time"

	"kami/domain"
)

// closeBatch is kami's close workers' default batch (queue.Config's
// CloseBatch): members per claim and per close transaction.
const closeBatch = 500

// closeGather is the close waker's default pause between drains
// (queue.Config's CloseGather): due orders gather into batches meanwhile.
const closeGather = 50 * time.Millisecond

// dueOrder is an unpaid order waiting for its expiry.
type dueOrder struct {
	no string
	at time.Time // expires_at
}

// dueHeap orders the waiting orders by expiry, then number: the order the
// close queue (a sorted set scored by due time) hands them out in.
type dueHeap []dueOrder

func (h dueHeap) Len() int { return len(h) }
func (h dueHeap) Less(i, j int) bool {
	if !h[i].at.Equal(h[j].at) {
		return h[i].at.Before(h[j].at)
	}
	return h[i].no < h[j].no
}
func (h dueHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *dueHeap) Push(x any)   { *h = append(*h, x.(dueOrder)) }
func (h *dueHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// closer does in the bench what kami's close workers do for the direct
// phase's unpaid orders: every closeGather it closes the orders that fell
// due, up to closeBatch per Ledger.CloseOrders (the ledger's one close
// path, which the workers reach through Shop.CloseOrders), earliest first.
// An order the database finds not yet due waits for its time again; a
// batch that fails is tried again at the next pass.
type closer struct {
	ledger *domain.Ledger
	in     chan dueOrder
	done   chan struct{}

	// Read after done.
	closed  int            // closed by this closer
	skipped int            // no longer PENDING when their batch ran (closed by another, e.g. the server's sweeper)
	batches int            // CloseOrders calls that committed
	errs    map[string]int // failed calls by error code, odd outcomes by outcome
}

// startCloser starts a closer that expects up to n orders.
func startCloser(ctx context.Context, ledger *domain.Ledger, n int) *closer {
	c := &closer{ledger: ledger, in: make(chan dueOrder, n), done: make(chan struct{}), errs: map[string]int{}}
	go c.run(ctx)
	return c
}

// add hands an order to the closer; it must not block (the channel holds
// every order the phase can place).
func (c *closer) add(no string, expiresAt time.Time) { c.in <- dueOrder{no, expiresAt} }

// finish says no more orders come and waits until every order handed over
// is closed, or ctx ends.
func (c *closer) finish() {
	close(c.in)
	<-c.done
}

func (c *closer) run(ctx context.Context) {
	defer close(c.done)
	var due dueHeap
	in := c.in
	tick := time.NewTicker(closeGather)
	defer tick.Stop()
	for in != nil || due.Len() > 0 {
		select {
		case o, ok := <-in:
			if !ok {
				in = nil
			} else {
				heap.Push(&due, o)
			}
			continue
		case <-tick.C:
		case <-ctx.Done():
			return
		}
		c.closeDue(ctx, &due)
	}
}

// closeDue closes the orders due by the database's clock (as this process
// knows it), a batch at a time, until none is.
func (c *closer) closeDue(ctx context.Context, due *dueHeap) {
	for due.Len() > 0 && ctx.Err() == nil {
		now := c.ledger.DBTime()
		batch := make([]string, 0, closeBatch)
		at := map[string]time.Time{}
		for due.Len() > 0 && len(batch) < closeBatch && !(*due)[0].at.After(now) {
			o := heap.Pop(due).(dueOrder)
			batch = append(batch, o.no)
			at[o.no] = o.at
		}
		if len(batch) == 0 {
			return
		}
		rs, err := c.ledger.CloseOrders(ctx, batch, domain.CloseTimeout)
		if err != nil {
			c.errs[domain.ErrorCode(err)]++
			for _, no := range batch {
				heap.Push(due, dueOrder{no, at[no]})
			}
			return
		}
		c.batches++
		notDue := false
		for _, r := range rs {
			switch r.Outcome {
			case domain.Closed:
				c.closed++
			case domain.CloseSkipped:
				c.skipped++
			case domain.CloseNotDue:
				// This process's view of the database's clock ran ahead.
				heap.Push(due, dueOrder{r.OrderNo, r.ExpiresAt})
				notDue = true
			default:
				c.errs[string(r.Outcome)]++
			}
		}
		if notDue {
			return
		}
	}
}
