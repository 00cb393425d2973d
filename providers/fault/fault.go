// Package fault names the failures a payment gateway emulator (or the
// sandbox provider) can be told to play, the calls it plays them on, and
// keeps the table of injected faults.
//
// It does not import the testing package, so the server may use it.
package fault

import "sync"

// Fault is a failure the emulator injects into its next answers.
type Fault string

const (
	None      Fault = ""
	Timeout   Fault = "timeout"  // hold the request past the client's timeout
	Server5xx Fault = "5xx"      // answer HTTP 500/503
	Business  Fault = "business" // answer a signed business error
	Slow      Fault = "slow"     // answer correctly, but late (within the timeout)
	// TimeoutAfterEffect does the work (a refund is made) and then holds
	// the answer past the client's timeout, as a real gateway that
	// refunded but whose answer was lost.
	TimeoutAfterEffect Fault = "timeout-after-effect"
)

// Op names an emulator endpoint for fault injection.
type Op string

const (
	OpCreate       Op = "create"
	OpRefund       Op = "refund"
	OpQueryRefund  Op = "query_refund"
	OpQueryPayment Op = "query_payment"
	OpClose        Op = "close"
	// OpStatement is a day's statement: asking for it and downloading it.
	OpStatement Op = "statement"
)

// Table holds the faults injected per op. Its zero value is an empty table
// ready to use; it is safe for concurrent use.
type Table struct {
	mu      sync.Mutex
	entries map[Op]entry
}

type entry struct {
	f Fault
	n int // calls left; 0 means until cleared
}

// Inject makes the next n calls of op fail with f (n <= 0: until cleared
// with None). Injecting None clears op's fault.
func (t *Table) Inject(op Op, f Fault, n int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if f == None {
		delete(t.entries, op)
		return
	}
	if t.entries == nil {
		t.entries = map[Op]entry{}
	}
	t.entries[op] = entry{f: f, n: max(n, 0)}
}

// Take returns the fault for this call of op (None if there is none) and
// counts it, deleting it when it is used up.
func (t *Table) Take(op Op) Fault {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.entries[op]
	if !ok {
		return None
	}
	if e.n > 0 {
		if e.n--; e.n == 0 {
			delete(t.entries, op)
		} else {
			t.entries[op] = e
		}
	}
	return e.f
}
