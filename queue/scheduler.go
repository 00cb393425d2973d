package queue

import (
	"context"
	"time"

	"github.com/redis/go-redis/v9"

	"kami/domain"
)

// Scheduler puts order closes and refund attempts on their delay queues.
type Scheduler struct {
	Close  *DelayQueue
	Refund *DelayQueue
	// onSchedule is called with each due time scheduled, so this process's
	// close waker can wake early for it.
	onSchedule func(due time.Time)
}

var _ domain.Scheduler = (*Scheduler)(nil)

// NewScheduler returns the scheduler over keys' two queues.
func NewScheduler(rdb redis.UniversalClient, keys Keys) *Scheduler {
	return &Scheduler{Close: CloseQueue(rdb, keys), Refund: RefundQueue(rdb, keys)}
}

// ScheduleClose schedules the close of orderNo at due.
func (s *Scheduler) ScheduleClose(ctx context.Context, orderNo string, due time.Time) error {
	if err := s.Close.Schedule(ctx, orderNo, due); err != nil {
		return err
	}
	if s.onSchedule != nil {
		s.onSchedule(due)
	}
	return nil
}

// CancelClose takes orderNo's close off the close queue (and out of a
// worker's lease): the order was paid and will never close.
func (s *Scheduler) CancelClose(ctx context.Context, orderNo string) error {
	return s.Close.Cancel(ctx, orderNo)
}

// ScheduleRefund schedules an attempt at refundNo at due.
func (s *Scheduler) ScheduleRefund(ctx context.Context, refundNo string, due time.Time) error {
	return s.Refund.Schedule(ctx, refundNo, due)
}
