// Package money is kami's one definition of an amount: integer fen (1/100
// yuan), written as a decimal string with two places ("12.50") wherever it
// leaves the process. It never goes through a float.
package money

import (
	"errors"
	"math"
	"strconv"
	"strings"
)

// MaxFen bounds every amount kami accepts: 100 million yuan. Far above any
// card shop's order, far below int64 overflow when summed.
const MaxFen int64 = 100_000_000_00

// ErrFormat is returned for a string that is not a decimal amount.
var ErrFormat = errors.New("money: not an amount like 12.50")

// Format writes fen as yuan with exactly two decimals: 1250 → "12.50".
func Format(fen int64) string {
	var b [24]byte
	return string(Append(b[:0], fen))
}

// Append appends Format(fen) to dst.
func Append(dst []byte, fen int64) []byte {
	u := fen
	if fen < 0 {
		if fen == math.MinInt64 {
			return append(dst, "-92233720368547758.08"...)
		}
		dst = append(dst, '-')
		u = -fen
	}
	dst = strconv.AppendInt(dst, u/100, 10)
	c := u % 100
	return append(dst, '.', byte('0'+c/10), byte('0'+c%10))
}

// Parse reads a non-negative decimal amount with at most two decimals
// ("12", "12.5", "12.50", "0.01") into fen. Signs, exponents, spaces,
// more than two decimals and amounts above MaxFen are refused: a gateway
// that reports 12.505 has not paid 12.50.
func Parse(s string) (int64, error) {
	if s == "" || len(s) > 20 {
		return 0, ErrFormat
	}
	whole, frac, hasDot := strings.Cut(s, ".")
	if whole == "" || !allDigits(whole) || (hasDot && (frac == "" || len(frac) > 2 || !allDigits(frac))) {
		return 0, ErrFormat
	}
	w, err := strconv.ParseInt(whole, 10, 64)
	if err != nil || w > MaxFen/100 {
		return 0, ErrFormat
	}
	f := int64(0)
	if hasDot {
		if len(frac) == 1 {
			frac += "0"
		}
		f, _ = strconv.ParseInt(frac, 10, 64)
	}
	fen := w*100 + f
	if fen > MaxFen {
		return 0, ErrFormat
	}
	return fen, nil
}

func allDigits(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}
