package model

import (
	"bytes"
	"math"
	"strconv"
	"testing"
	"time"

	"github.com/99designs/gqlgen/graphql"

	"kami/domain/money"
)

// TestScalarsWrittenAsQuoted: the Money, ID and Time scalars write what
// quoting their formatted text (strconv.Quote, as gqlgen's own Time does)
// would, byte for byte.
func TestScalarsWrittenAsQuoted(t *testing.T) {
	t.Parallel()
	written := func(m graphql.Marshaler) string {
		var b bytes.Buffer
		m.MarshalGQL(&b)
		return b.String()
	}
	for _, fen := range []int64{0, 1, 99, 100, 1250, -5, -1250, money.MaxFen, math.MaxInt64, math.MinInt64} {
		if got, want := written(MarshalMoney(fen)), strconv.Quote(money.Format(fen)); got != want {
			t.Errorf("Money %d: %s, want %s", fen, got, want)
		}
	}
	for _, id := range []int64{0, 1, 42, 1 << 40, math.MaxInt64, -7} {
		if got, want := written(MarshalInt64ID(id)), strconv.Quote(strconv.FormatInt(id, 10)); got != want {
			t.Errorf("ID %d: %s, want %s", id, got, want)
		}
	}
	shanghai := time.FixedZone("CST", 8*3600)
	for _, tm := range []time.Time{
		{},
		time.Date(2026, 12, 1, 8, 0, 0, 0, time.UTC),
		time.Date(2026, 12, 1, 8, 0, 0, 123456789, time.UTC),
		time.Date(2026, 12, 1, 16, 0, 0, 120000, shanghai),
		time.Date(1, 1, 1, 0, 0, 0, 1, time.UTC),
		time.Date(9999, 12, 31, 23, 59, 59, 999999999, time.FixedZone("", -(9*3600+30*60))),
	} {
		if got, want := written(MarshalTime(tm)), written(graphql.MarshalTime(tm)); got != want {
			t.Errorf("Time %v: %s, want %s", tm, got, want)
		}
	}
}
