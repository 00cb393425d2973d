package sandbox

import (
	"context"
	"fmt"
	"time"

	"kami/providers"
)

// Op names a sandbox call for fault injection. The values are those of
// providertest.Op, which this package does not import (it would bring the
// testing package into the server).
type Op string

const (
	OpCreate       Op = "create"
	OpRefund       Op = "refund"
	OpQueryRefund  Op = "query_refund"
	OpQueryPayment Op = "query_payment"
	OpClose        Op = "close"
)

// Fault is a failure a real gateway can show, played by the sandbox; the
// values are those of providertest.Fault.
type Fault string

const (
	FaultNone     Fault = ""
	FaultTimeout  Fault = "timeout"  // hang for Config.Timeout, do nothing, Temporary
	Fault5xx      Fault = "5xx"      // do nothing, Temporary (HTTP 503)
	FaultBusiness Fault = "business" // do nothing, Rejected
	FaultSlow     Fault = "slow"     // wait a quarter of Config.Timeout, then work
	// FaultTimeoutAfterEffect does the work, then hangs for Config.Timeout
	// and fails Temporary: the answer was lost, the effect was not.
	FaultTimeoutAfterEffect Fault = "timeout-after-effect"
)

type fault struct {
	f Fault
	n int // calls left; 0 means until cleared
}

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
	p.mu.Lock()
	defer p.mu.Unlock()
	if f == FaultNone {
		delete(p.faults, op)
		return
	}
	p.faults[op] = fault{f: f, n: max(n, 0)}
}

// take returns the fault for this call of op and counts it.
func (p *Provider) take(op Op) Fault {
	p.mu.Lock()
	defer p.mu.Unlock()
	ft, ok := p.faults[op]
	if !ok {
		return FaultNone
	}
	if ft.n > 0 {
		if ft.n--; ft.n == 0 {
			delete(p.faults, op)
		} else {
			p.faults[op] = ft
		}
	}
	return ft.f
}

// before plays the part of a fault that comes before the work: it returns
// the fault for after, or the error that ends the call.
func (p *Provider) before(ctx context.Context, op Op, name string) (Fault, error) {
	if err := ctx.Err(); err != nil {
		return FaultNone, p.fail(providers.Temporary, name, "", "not sent", err)
	}
	f := p.take(op)
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
