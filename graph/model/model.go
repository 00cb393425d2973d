// Package model holds the GraphQL types that are not domain types, and the
// scalars' marshalling. Money leaves as a decimal string ("12.50") and IDs
// as strings of decimal digits, both through kami/domain/money and strconv,
// never a float.
package model

import (
	"encoding/json"
	"io"
	"strconv"
	"time"

	"github.com/99designs/gqlgen/graphql"

	"kami/domain"
	"kami/domain/money"
	"kami/providers"
)

// Order is an order as one caller sees it: Buyer is set when the caller
// proved it holds the order's access token, which decides whether its codes
// are shown.
type Order struct {
	domain.Order
	Buyer bool
}

// Payment is how to pay an order, as the API shows it: a URL or QR code
// the provider did not give is null, not "". Its fields are plain, so
// gqlgen writes them as it goes; a resolver field would cost every
// createOrder a goroutine of its own (gqlgen runs resolvers concurrently).
type Payment struct {
	Kind      providers.PaymentActionKind
	URL       *string
	QRCode    *string
	ExpiresAt time.Time
}

// MarshalMoney writes fen as a decimal string.
func MarshalMoney(fen int64) graphql.Marshaler {
	return graphql.WriterFunc(func(w io.Writer) {
		// Digits, a point and a sign: nothing to escape.
		var b [32]byte
		w.Write(append(money.Append(append(b[:0], '"'), fen), '"'))
	})
}

// UnmarshalMoney reads a decimal string ("12.50"); a number or anything
// else is BAD_INPUT, so no float ever becomes an amount.
func UnmarshalMoney(v any) (int64, error) {
	s, ok := v.(string)
	if !ok {
		return 0, domain.Errorf(domain.EBADINPUT, "an amount is a string like \"12.50\"")
	}
	fen, err := money.Parse(s)
	if err != nil {
		return 0, domain.Errorf(domain.EBADINPUT, "%q is not an amount like \"12.50\"", truncate(s, 24))
	}
	return fen, nil
}

// MarshalInt64ID writes an id as a string, as GraphQL's ID is serialised.
func MarshalInt64ID(id int64) graphql.Marshaler {
	return graphql.WriterFunc(func(w io.Writer) {
		var b [24]byte
		w.Write(append(strconv.AppendInt(append(b[:0], '"'), id, 10), '"'))
	})
}

// UnmarshalInt64ID reads an id given as a string or an integer.
func UnmarshalInt64ID(v any) (int64, error) {
	var s string
	switch v := v.(type) {
	case string:
		s = v
	case json.Number:
		s = v.String()
	case int64:
		return v, nil
	case int:
		return int64(v), nil
	default:
		return 0, domain.Errorf(domain.EBADINPUT, "an id is a string of digits")
	}
	id, err := strconv.ParseInt(s, 10, 64)
	if err != nil || id <= 0 {
		return 0, domain.Errorf(domain.EBADINPUT, "%q is not an id", truncate(s, 24))
	}
	return id, nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// MarshalTime writes an RFC 3339 time, as gqlgen does (a zero time is
// null), appended into a buffer of its own instead of formatted and
// quoted as two strings.
func MarshalTime(t time.Time) graphql.Marshaler {
	if t.IsZero() {
		return graphql.Null
	}
	return graphql.WriterFunc(func(w io.Writer) {
		// Digits and -:.TZ+: nothing to escape.
		var b [48]byte
		w.Write(append(t.AppendFormat(append(b[:0], '"'), time.RFC3339Nano), '"'))
	})
}

// UnmarshalTime reads an RFC 3339 time; anything else is the caller's
// mistake (BAD_INPUT), not an internal error.
func UnmarshalTime(v any) (time.Time, error) {
	t, err := graphql.UnmarshalTime(v)
	if err != nil {
		return time.Time{}, domain.Errorf(domain.EBADINPUT, "a time is an RFC 3339 string like \"2026-12-01T08:00:00Z\"")
	}
	return t, nil
}

// MarshalInt writes an Int.
func MarshalInt(i int) graphql.Marshaler { return graphql.MarshalInt(i) }

// UnmarshalInt reads an Int; a value that is not one, or does not fit, is
// BAD_INPUT.
func UnmarshalInt(v any) (int, error) {
	i, err := graphql.UnmarshalInt(v)
	if err != nil {
		return 0, domain.Errorf(domain.EBADINPUT, "not a whole number that fits an Int")
	}
	return i, nil
}
