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
// change, until a status where subscriptionEnds, the client leaves (ctx
// ends) or the event stream breaks. It subscribes before it reads the
// order, so a change between the two is never missed; an event that does
// not change the status (a duplicate, or one already seen in the read) is
// not sent again.
func watchOrder(ctx context.Context, cfg Config, read func(context.Context) (*model.Order, error), orderNo string) (<-chan *model.Order, error) {
	var events <-chan domain.OrderStatus
	stop := func() {}
	if cfg.Events != nil {
		events, stop = cfg.Events.Subscribe(ctx, orderNo)
	}
	o, err := read(ctx)
	if err != nil {
		stop()
		return nil, err
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
			case _, ok := <-events:
				if !ok {
					return
				}
				o, err := read(ctx)
				if err != nil {
					if ctx.Err() == nil {
						cfg.Logger.WarnContext(ctx, "order subscription ended: cannot read the order", "order", orderNo, "err", err)
					}
					return
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
