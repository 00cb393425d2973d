// Package providertest is the contract every payment provider must keep,
// run against the provider's gateway emulator through the real client.
//
// Each provider package has a test that builds a Harness around its emulator
// and calls Run(t, h).
package providertest

import (
	"net/http"
	"testing"

	"kami/providers"
	"kami/providers/fault"
)

// Fault is a failure the emulator injects into its next answers; the names
// and values are those of package fault.
type Fault = fault.Fault

const (
	FaultNone     = fault.None
	FaultTimeout  = fault.Timeout   // hold the request past the client's timeout
	Fault5xx      = fault.Server5xx // answer HTTP 500/503
	FaultBusiness = fault.Business  // answer a signed business error
	FaultSlow     = fault.Slow      // answer correctly, but late (within the timeout)
	// FaultTimeoutAfterEffect does the work (a refund is made) and then
	// holds the answer past the client's timeout, as a real gateway that
	// refunded but whose answer was lost.
	FaultTimeoutAfterEffect = fault.TimeoutAfterEffect
)

// Op names an emulator endpoint for fault injection.
type Op = fault.Op

const (
	OpCreate       = fault.OpCreate
	OpRefund       = fault.OpRefund
	OpQueryRefund  = fault.OpQueryRefund
	OpQueryPayment = fault.OpQueryPayment
	OpClose        = fault.OpClose
	OpStatement    = fault.OpStatement
)

// Harness is one provider wired to its emulator.
type Harness struct {
	// Provider under test, configured to talk to the emulator, with a client
	// timeout short enough for FaultTimeout tests (about a second).
	Provider providers.Provider

	// Pay makes the emulator record a payment of amountFen for orderNo (a
	// payment created before with CreatePayment, or not: the emulator
	// accepts either) and returns the notification the gateway would send
	// for it, signed as the real gateway signs.
	Pay func(t testing.TB, orderNo string, amountFen int64) (header http.Header, body []byte)

	// RefundNotification returns the signed notification the gateway sends
	// when the refund refundNo finished, or nil if the gateway sends none
	// for refunds (Alipay's trade notification covers it).
	RefundNotification func(t testing.TB, refundNo string) (header http.Header, body []byte)

	// Forge returns a notification for orderNo that fails verification:
	// signed with a key that is not the gateway's.
	Forge func(t testing.TB, orderNo string, amountFen int64) (header http.Header, body []byte)

	// OtherMerchant returns a correctly signed notification that names
	// another app or merchant id than the one configured.
	OtherMerchant func(t testing.TB, orderNo string, amountFen int64) (header http.Header, body []byte)

	// InjectFault makes the next n calls of op fail with f (n <= 0: until
	// cleared with FaultNone).
	InjectFault func(op Op, f Fault, n int)

	// Refunded is the total the emulator has refunded under refundNo, and
	// how many refund calls it received with that number.
	Refunded func(refundNo string) (fen int64, calls int)

	// StatementFaults are the provider's own ways for a statement to fail
	// (a download cut short, a file that does not match its hash, a
	// business error...), each with the Kind of error it must give. The
	// suite injects each once and requires that error and no statement.
	StatementFaults []StatementFault

	// SupportsClose and SupportsQueryPayment are false for providers whose
	// gateway has no such call (ClosePayment then is a no-op).
	SupportsClose        bool
	SupportsQueryPayment bool
}

// StatementFault is one way for a provider's statement to fail.
type StatementFault struct {
	Op    Op
	Fault Fault
	Kind  providers.ErrorKind
}

// Run checks every promise of providers.Provider against h.
func Run(t *testing.T, h Harness) {
	t.Helper()
	run(t, h)
}
