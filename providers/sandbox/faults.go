package sandbox

import (
	"context"
	"fmt"
	"time"

	"kami/providers"
	"kami/providers/fault"
)

// Op names a sandbox call for fault injection: fault.Op.
type Op = fault.Op

const (
	OpCreate       = fault.OpCreate
	OpRefund       = fault.OpRefund
	OpQueryRefund  = fault.OpQueryRefund
	OpQueryPayment = fault.OpQueryPayment
	OpClose        = fault.OpClose
)

// Fault is a failure a real gateway can show, played by the sandbox:
// fault.Fault.
type Fault = fault.Fault

const (
	FaultNone     = fault.None
	FaultTimeout  = fault.Timeout   // hang for Config.Timeout, do nothing, Temporary
	Fault5xx      = fault.Server5xx // do nothing, Temporary (HTTP 503)
	FaultBusiness = fault.Business  // do nothing, Rejected
	FaultSlow     = fault.Slow      // wait a quarter of Config.Timeout, then work
	// FaultTimeoutAfterEffect does the work, then hangs for Config.Timeout
	// and fails Temporary: the answer was lost, the effect was not.
	FaultTimeoutAfterEffect = fault.TimeoutAfterEffect
)

// InjectFault makes the next n calls of op fail with f (n <= 0: until
// cleared with FaultNone). Whole-system tests use it to try the retry paths;
// it panics on an op or fault it does not know, as that is a broken test.
func (p *Provider) InjectFault(op Op, f Fault, n int) {
	switch op {
	case OpCreate, OpRefund, OpQueryRefund, OpQueryPayment, OpClose:
	default:
		panic(fmt.Sprintf("sandbox: unknown op %q", op))
	}
	switch f {
	case FaultNone, FaultTimeout, Fault5xx, FaultBusiness, FaultSlow, FaultTimeoutAfterEffect:
	default:
		panic(fmt.Sprintf("sandbox: unknown fault %q", f))
	}
	p.faults.Inject(op, f, n)
}

// before plays the part of a fault that comes before the work: it returns
// the fault for after, or the error that ends the call.
func (p *Provider) before(ctx context.Context, op Op, name string) (Fault, error) {
	if err := ctx.Err(); err != nil {
		return FaultNone, p.fail(providers.Temporary, name, "", "not sent", err)
	}
	f := p.faults.Take(op)
	switch f {
	case FaultTimeout:
		return f, p.hang(ctx, name, p.timeout)
	case Fault5xx:
		return f, p.fail(providers.Temporary, name, "HTTP_503", "gateway unavailable", nil)
	case FaultBusiness:
		return f, p.fail(providers.Rejected, name, "SANDBOX_BUSINESS_ERROR", "injected business error", nil)
	case FaultSlow:
		if err := wait(ctx, p.timeout/4); err != nil {
			return f, p.fail(providers.Temporary, name, "", "canceled", err)
		}
	}
	return f, nil
}

// after plays the part of a fault that comes after the work.
func (p *Provider) after(ctx context.Context, f Fault, name string) error {
	if f == FaultTimeoutAfterEffect {
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
