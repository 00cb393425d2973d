package money

import (
	"fmt"
	"math"
	"testing"
)

func TestParseFormat(t *testing.T) {
	t.Parallel()
	good := map[string]int64{"0": 0, "0.01": 1, "12.5": 1250, "12.50": 1250, "12": 1200, "1000000.00": 100000000, "100000000.00": MaxFen}
	for s, want := range good {
		got, err := Parse(s)
		if err != nil || got != want {
			t.Errorf("Parse(%q) = %d, %v; want %d", s, got, err, want)
		}
	}
	for _, s := range []string{"", "-1", "+1", "1.", ".5", "1.234", "1e3", " 1", "1 ", "abc", "1,00", "100000000.01", "99999999999999999999"} {
		if got, err := Parse(s); err == nil {
			t.Errorf("Parse(%q) = %d, want error", s, got)
		}
	}
	for fen, want := range map[int64]string{0: "0.00", 1: "0.01", 1250: "12.50", -5: "-0.05", 100: "1.00"} {
		if got := Format(fen); got != want {
			t.Errorf("Format(%d) = %q, want %q", fen, got, want)
		}
	}
}

// TestFormatAsPrinted: Format (and Append) write what "%s%d.%02d" of the
// sign, the yuan and the fen would, at the edges of int64 too.
func TestFormatAsPrinted(t *testing.T) {
	t.Parallel()
	printed := func(fen int64) string {
		if fen == math.MinInt64 {
			return "-92233720368547758.08"
		}
		sign := ""
		if fen < 0 {
			sign, fen = "-", -fen
		}
		return fmt.Sprintf("%s%d.%02d", sign, fen/100, fen%100)
	}
	fens := []int64{math.MinInt64, math.MinInt64 + 1, math.MaxInt64, -MaxFen, MaxFen, MaxFen + 1}
	for fen := int64(-1005); fen <= 1005; fen++ {
		fens = append(fens, fen)
	}
	for _, fen := range fens {
		want := printed(fen)
		if got := Format(fen); got != want {
			t.Errorf("Format(%d) = %q, want %q", fen, got, want)
		}
		if got := string(Append([]byte("x"), fen)); got != "x"+want {
			t.Errorf("Append(x, %d) = %q, want %q", fen, got, "x"+want)
		}
	}
}

func FuzzParse(f *testing.F) {
	for _, s := range []string{"12.50", "0.01", "1.234", "-1"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		fen, err := Parse(s)
		if err != nil {
			return
		}
		if fen < 0 || fen > MaxFen {
			t.Fatalf("Parse(%q) = %d out of range", s, fen)
		}
		back, err := Parse(Format(fen))
		if err != nil || back != fen {
			t.Fatalf("round trip of %q: %d → %q → %d, %v", s, fen, Format(fen), back, err)
		}
	})
}
