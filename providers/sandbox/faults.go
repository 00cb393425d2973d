package sandbox

import (
	"context"
	"fmt"
	"time"

	"kami/providers"
	"kami/providers/fault"
)

// The sandbox plays the gateway faults of package fault; how each one
// behaves here:
//   - fault.Timeout: hang for Config.Timeout, do nothing, Temporary;
//   - fault.Server5xx: do nothing, Temporary (HTTP 503);
//   - fault.Business: do nothing, Rejected;
//   - fault.Slow: wait a quarter of Config.Timeout, then work;
//   - fault.TimeoutAfterEffect: do the work, then hang for Config.Timeout
//     and fail Temporary: the answer was lost, the effect was not.

// InjectFault makes the next n calls of op fail with f (n <= 0: until
// cleared with fault.None). Whole-system tests use it to try the retry paths;
// it panics on an op or fault it does not know, as that is a broken test.
func (p *Provider) InjectFault(op fault.Op, f fault.Fault, n int) {
	switch op {
	case fault.OpCreate, fault.OpRefund, fault.OpQueryRefund, fault.OpQueryPayment, fault.OpClose, fault.OpStatement:
	default:
		panic(fmt.Sprintf("sandbox: unknown op %q", op))
	}
	switch f {
	case fault.None, fault.Timeout, fault.Server5xx, fault.Business, fault.Slow, fault.TimeoutAfterEffect:
	default:
		panic(fmt.Sprintf("sandbox: unknown fault %q", f))
	}
	p.faults.Inject(op, f, n)
}

// before plays the part of a fault that comes before the work: it returns
// the fault for after, or the error that ends the call.
func (p *Provider) before(ctx context.Context, op fault.Op, name string) (fault.Fault, error) {
	if err := ctx.Err(); err != nil {
		return fault.None, p.fail(providers.Temporary, name, "", "not sent", err)
	}
	f := p.faults.Take(op)
	switch f {
	case fault.Timeout:
		return f, p.hang(ctx, name, p.timeout)
	case fault.Server5xx:
		return f, p.fail(providers.Temporary, name, "HTTP_503", "gateway unavailable", nil)
	case fault.Business:
		return f, p.fail(providers.Rejected, name, "SANDBOX_BUSINESS_ERROR", "injected business error", nil)
	case fault.Slow:
		if err := wait(ctx, p.timeout/4); err != nil {
			return f, p.fail(providers.Temporary, name, "", "canceled", err)
		}
	}
	return f, nil
}

// after plays the part of a fault that comes after the work.
func (p *Provider) after(ctx context.Context, f fault.Fault, name string) error {
	if f == fault.TimeoutAfterEffect {
		return p.hang(ctx, name, p.timeout)
	}
	return nil
}

// hang waits as a client waits for an answer that does not come, and fails
// as its timeout does.
func (p *Provider) hang(ctx context.Context, name string, d time.Duration) error {
	err := wait(ctx, d)
	if err == nil {
		err = context.DeadlineExceeded
	}
	return p.fail(providers.Temporary, name, "", "no answer", err)
}

// wait returns after d, or ctx's error if it ends first.
func wait(ctx context.Context, d time.Duration) error {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
