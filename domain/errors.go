package domain

import (
	"errors"
	"fmt"
)

// Error codes. They are the GraphQL extensions.code values clients rely on;
// only the transport maps them to HTTP statuses.
const (
	ECONFLICT     = "CONFLICT"  // the state moved on, or an idempotency key was reused differently
	EINTERNAL     = "INTERNAL"  // a bug or an outage; details are logged, never shown
	EBADINPUT     = "BAD_INPUT" // the request itself is wrong
	ENOTFOUND     = "NOT_FOUND" // no such thing (or not yours to see)
	ESOLDOUT      = "SOLD_OUT"  // not enough lockable cards
	EUNAUTH       = "UNAUTHENTICATED"
	EFORBIDDEN    = "FORBIDDEN"
	ELIMIT        = "LIMIT_EXCEEDED" // an anti-hoarding cap was reached
	EUNAVAILABLE  = "UNAVAILABLE"    // a dependency is down; retrying later can work
	EINCONSISTENT = "INCONSISTENT"   // the ledger contradicts itself: a person must look
)

// Error is kami's one error type for anything a caller may be told.
// Message is safe to show to the caller: it never holds SQL, provider text or
// a card code.
type Error struct {
	Code    string
	Message string
}

func (e *Error) Error() string { return fmt.Sprintf("kami: %s: %s", e.Code, e.Message) }

// Errorf returns an *Error with the given code.
func Errorf(code, format string, args ...any) *Error {
	return &Error{Code: code, Message: fmt.Sprintf(format, args...)}
}

// ErrorCode returns the code of err, EINTERNAL for anything that is not an
// *Error (and "" for nil).
func ErrorCode(err error) string {
	if err == nil {
		return "" // before e, which errors.As makes escape: no allocation for the usual nil
	}
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	return EINTERNAL
}

// ErrorMessage returns the message of err that may be shown to a caller.
func ErrorMessage(err error) string {
	if err == nil {
		return ""
	}
	var e *Error
	if errors.As(err, &e) {
		return e.Message
	}
	return "internal error"
}
