package providers

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"kami/domain/money"
)

// StatementSource is a Provider whose gateway publishes a statement of
// each day: every trade paid and every refund made in it (Alipay's and
// WeChat Pay's trade bills; the sandbox keeps one from its own books).
//
// It is an interface of its own, not a method of Provider, because not
// every gateway publishes a statement through an API: a provider without
// one still takes payments, and kami then checks its trades by queries
// only. The contract suite (providertest) checks it for every provider
// that has it.
type StatementSource interface {
	Provider
	// Statement downloads the statement of day. Every amount is exact
	// (fen); every row the gateway lists is kept, its summary lines are
	// checked against the rows. A day the gateway has not published yet is
	// an error for which NotReady is true; a day on which nothing happened
	// is an empty statement. An error never comes with a partial statement.
	// Errors are *Error.
	Statement(ctx context.Context, day Day) (*Statement, error)
}

// Statement is a gateway's record of one day, in one form for every
// gateway.
type Statement struct {
	Provider string
	Day      Day
	Trades   []StatementTrade
	Refunds  []StatementRefund
	// Other counts rows of kinds kami does not take part in (a gateway's
	// own adjustments, say): listed, not reconciled.
	Other int
}

// StatementTrade is one payment in a statement.
type StatementTrade struct {
	OrderNo   string // kami's order number (out_trade_no)
	TradeNo   string // the gateway's trade number
	AmountFen int64  // the order's total, as the buyer paid it
	PaidAt    time.Time
	// Status is TradePaid for a payment; TradeClosed for a trade the
	// gateway reversed the same day (WeChat's REVOKED).
	Status TradeStatus
}

// StatementRefund is one refund in a statement.
type StatementRefund struct {
	RefundNo  string // kami's refund number (out_request_no, out_refund_no)
	OrderNo   string
	TradeNo   string
	AmountFen int64 // what was asked to be refunded
	At        time.Time
	Status    RefundState // SUCCEEDED, PROCESSING or FAILED
}

// TradeFen and RefundFen are the statement's totals.
func (s *Statement) TradeFen() int64 {
	var sum int64
	for _, t := range s.Trades {
		if t.Status == TradePaid {
			sum += t.AmountFen
		}
	}
	return sum
}

func (s *Statement) RefundFen() int64 {
	var sum int64
	for _, r := range s.Refunds {
		if r.Status == RefundSucceeded {
			sum += r.AmountFen
		}
	}
	return sum
}

// CodeNotReady is the Code of a statement error for a day the gateway has
// not published yet: the statement of a day comes the next morning
// (WeChat Pay after 10:00, Alipay after 09:00, Beijing time). The error is
// Temporary: asking again later works.
const CodeNotReady = "STATEMENT_NOT_READY"

// NotReady reports whether err says the statement is not published yet.
func NotReady(err error) bool {
	var pe *Error
	return errors.As(err, &pe) && pe.Code == CodeNotReady
}

// Zone is the gateways' time zone: Alipay and WeChat Pay keep their books
// and cut their days in Beijing time. China has kept no daylight saving
// time since 1991, so a fixed zone is exact.
var Zone = time.FixedZone("CST", 8*3600)

// DayLayout is how a Day is written: 2026-12-01.
const DayLayout = "2006-01-02"

// Day is a calendar day in Zone: the span a statement covers.
type Day struct{ start time.Time }

// DayOf is the day t falls in, in Zone.
func DayOf(t time.Time) Day {
	y, m, d := t.In(Zone).Date()
	return Day{time.Date(y, m, d, 0, 0, 0, 0, Zone)}
}

// ParseDay reads "2006-01-02".
func ParseDay(s string) (Day, error) {
	t, err := time.ParseInLocation(DayLayout, s, Zone)
	if err != nil || len(s) != len(DayLayout) {
		return Day{}, fmt.Errorf("%q is not a day like 2026-12-01", clipText(s, 32))
	}
	return Day{t}, nil
}

// String writes the day as "2006-01-02"; the zero Day is "".
func (d Day) String() string {
	if d.start.IsZero() {
		return ""
	}
	return d.start.Format(DayLayout)
}

// IsZero reports whether d is the zero Day.
func (d Day) IsZero() bool { return d.start.IsZero() }

// Start is the day's first instant and End the next day's: the day is
// [Start, End).
func (d Day) Start() time.Time { return d.start }
func (d Day) End() time.Time   { return d.start.AddDate(0, 0, 1) }

// Contains reports whether t falls in the day.
func (d Day) Contains(t time.Time) bool { return !t.Before(d.Start()) && t.Before(d.End()) }

// AddDays is the day n days later (earlier for n < 0).
func (d Day) AddDays(n int) Day { return Day{d.start.AddDate(0, 0, n)} }

// Before reports whether d comes before e.
func (d Day) Before(e Day) bool { return d.start.Before(e.start) }

// ParseSignedAmount reads a statement amount: a decimal with at most two
// places and an optional minus sign ("-12.50" for a refund), exactly, into
// fen. Fees with more places are not amounts kami reads.
func ParseSignedAmount(s string) (int64, error) {
	neg := strings.HasPrefix(s, "-")
	fen, err := money.Parse(strings.TrimPrefix(s, "-"))
	if err != nil {
		return 0, err
	}
	if neg {
		return -fen, nil
	}
	return fen, nil
}

// ParseStatementTime reads a statement's "2006-01-02 15:04:05" in Zone.
func ParseStatementTime(s string) (time.Time, error) {
	return time.ParseInLocation("2006-01-02 15:04:05", s, Zone)
}

// clipText bounds gateway text quoted in errors.
func clipText(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return strings.ToValidUTF8(s[:n], "") + "…"
}
