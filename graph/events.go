package graph

import (
	"context"

	"kami/domain"
	"kami/graph/model"
)

// subscriptionEnds reports the statuses at which orderStatusChanged
// completes: nothing more happens to the order while its buyer waits. PAID
// is delivered (a later admin refund is not part of the wait), CLOSED and
// REFUNDED are done; a CLOSED order paid late moves on to REFUNDING, which
// a client that cares follows with a new subscription (it starts with the
// current status).
func subscriptionEnds(s domain.OrderStatus) bool {
	return s == domain.OrderPaid || s == domain.OrderClosed || s == domain.OrderRefunded
}

// watchOrder streams the order as it is now and again after every status
// change, until a status where subscriptionEnds or until the client leaves
// (ctx ends). It never completes for any other reason: an interrupted event
// stream is caught up (see OrderEvents), and an order that cannot be read
// for a moment is read again at the next news of it.
//
// The order is read first, which checks the access token (or the admin
// token) before anything is held;
// then it subscribes and reads again, so that a change between the first
// read and the subscription is not missed. An event that does not change
// the status (a duplicate, a catch-up, one already seen in a read) is not
// sent again.
func watchOrder(ctx context.Context, cfg Config, read func(context.Context) (*model.Order, error), orderNo string) (<-chan *model.Order, error) {
	o, err := read(ctx)
	if err != nil {
		return nil, err
	}
	var events <-chan domain.OrderStatus
	stop := func() {}
	if cfg.Events != nil && !subscriptionEnds(o.Status) {
		events, stop = cfg.Events.Subscribe(ctx, orderNo)
		if o, err = read(ctx); err != nil {
			stop()
			return nil, err
		}
	}
	out := make(chan *model.Order, 1)
	go func() {
		defer close(out)
		defer stop()
		send := func(o *model.Order) bool {
			select {
			case out <- o:
				return !subscriptionEnds(o.Status)
			case <-ctx.Done():
				return false
			}
		}
		if !send(o) {
			return
		}
		last := o.Status
		for {
			select {
			case <-ctx.Done():
				return
			case st, ok := <-events:
				if !ok {
					return // the subscription ended with ctx
				}
				if st == last {
					continue
				}
				o, err := read(ctx)
				if err != nil {
					if ctx.Err() == nil {
						cfg.Logger.WarnContext(ctx, "order subscription cannot read the order; reading again at its next news", "order", orderNo, "err", err)
					}
					continue
				}
				if o.Status == last {
					continue
				}
				last = o.Status
				if !send(o) {
					return
				}
			}
		}
	}()
	return out, nil
}
