package fault_test

import (
	"sync"
	"testing"

	"kami/providers/fault"
)

func TestTable(t *testing.T) {
	t.Parallel()
	type call struct {
		inject bool // Inject(op, f, n) instead of Take(op)
		op     fault.Op
		f      fault.Fault // injected, or wanted from Take
		n      int
	}
	inject := func(op fault.Op, f fault.Fault, n int) call { return call{true, op, f, n} }
	take := func(op fault.Op, want fault.Fault) call { return call{op: op, f: want} }
	for name, calls := range map[string][]call{
		"Empty": {
			take(fault.OpCreate, fault.None),
		},
		"CountsDown": {
			inject(fault.OpRefund, fault.Timeout, 2),
			take(fault.OpRefund, fault.Timeout),
			take(fault.OpRefund, fault.Timeout),
			take(fault.OpRefund, fault.None),
		},
		"PerOp": {
			inject(fault.OpRefund, fault.Server5xx, 1),
			take(fault.OpCreate, fault.None),
			take(fault.OpQueryRefund, fault.None),
			take(fault.OpRefund, fault.Server5xx),
			take(fault.OpRefund, fault.None),
		},
		"UntilCleared": {
			inject(fault.OpClose, fault.Business, 0),
			take(fault.OpClose, fault.Business),
			take(fault.OpClose, fault.Business),
			take(fault.OpClose, fault.Business),
			inject(fault.OpClose, fault.None, 0),
			take(fault.OpClose, fault.None),
		},
		"NegativeIsUntilCleared": {
			inject(fault.OpQueryPayment, fault.Slow, -3),
			take(fault.OpQueryPayment, fault.Slow),
			take(fault.OpQueryPayment, fault.Slow),
			inject(fault.OpQueryPayment, fault.None, 5),
			take(fault.OpQueryPayment, fault.None),
		},
		"ClearBeforeUsedUp": {
			inject(fault.OpRefund, fault.TimeoutAfterEffect, 3),
			take(fault.OpRefund, fault.TimeoutAfterEffect),
			inject(fault.OpRefund, fault.None, 0),
			take(fault.OpRefund, fault.None),
		},
		"InjectReplaces": {
			inject(fault.OpCreate, fault.Timeout, 0),
			inject(fault.OpCreate, fault.Server5xx, 1),
			take(fault.OpCreate, fault.Server5xx),
			take(fault.OpCreate, fault.None),
		},
		"OtherFaults": {
			inject(fault.OpCreate, fault.Fault("garbage"), 1),
			take(fault.OpCreate, fault.Fault("garbage")),
			take(fault.OpCreate, fault.None),
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			var tab fault.Table // the zero value is ready
			for i, c := range calls {
				if c.inject {
					tab.Inject(c.op, c.f, c.n)
					continue
				}
				if got := tab.Take(c.op); got != c.f {
					t.Errorf("call %d: Take(%q) = %q, want %q", i, c.op, got, c.f)
				}
			}
		})
	}
}

// Under -race: n injected faults are taken exactly n times however many
// goroutines take them.
func TestTableConcurrent(t *testing.T) {
	t.Parallel()
	const n, goroutines, each = 100, 8, 50
	var tab fault.Table
	tab.Inject(fault.OpRefund, fault.Server5xx, n)
	var (
		wg  sync.WaitGroup
		mu  sync.Mutex
		got int
	)
	for range goroutines {
		wg.Go(func() {
			for range each {
				if tab.Take(fault.OpRefund) == fault.Server5xx {
					mu.Lock()
					got++
					mu.Unlock()
				}
				tab.Take(fault.OpCreate)
				tab.Inject(fault.OpClose, fault.Slow, 0)
				tab.Inject(fault.OpClose, fault.None, 0)
			}
		})
	}
	wg.Wait()
	if got != n {
		t.Errorf("faults taken = %d, want %d", got, n)
	}
	if f := tab.Take(fault.OpRefund); f != fault.None {
		t.Errorf("after the faults were used up: Take = %q, want none", f)
	}
}
