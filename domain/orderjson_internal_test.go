package domain

import (
	"bytes"
	"encoding/json"
	"math"
	"math/rand/v2"
	"reflect"
	"testing"
	"time"
)

// TestOrderObjectJSONIsEncodingJSONs: the order events' payload written by
// appendJSON is byte for byte encoding/json's, for plain orders (which it
// must write itself, or it saves nothing) and for every kind of text and
// time it must hand back to encoding/json.
func TestOrderObjectJSONIsEncodingJSONs(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	plain := "0123456789abcXYZ @.-_+:/=!#$%'()*,;?[]^`{|}~"
	tricky := []string{`"`, `\`, "<", ">", "&", "\n", "\t", "\x00", "\x1f", "\x7f", "é", "卡密", "\u2028", "\u2029", "\xff", "\xe5\x8d"}
	text := func(hard bool) string {
		var b []byte
		for range rng.IntN(12) {
			b = append(b, plain[rng.IntN(len(plain))])
		}
		if hard {
			at := rng.IntN(len(b) + 1)
			b = append(b[:at], append([]byte(tricky[rng.IntN(len(tricky))]), b[at:]...)...)
		}
		return string(b)
	}
	zones := []*time.Location{time.UTC, time.FixedZone("CST", 8*3600), time.FixedZone("", -(3*3600 + 1800)), time.FixedZone("odd", 3600+17)}
	when := func() time.Time {
		years := []int{2026, 1, 9999, 10000, -1}
		y := years[0]
		if rng.IntN(10) == 0 {
			y = years[rng.IntN(len(years))]
		}
		nanos := []int{0, 1, 120000000, 123456789, 999999999}
		return time.Date(y, time.Month(1+rng.IntN(12)), 1+rng.IntN(28), rng.IntN(24), rng.IntN(60), rng.IntN(60),
			nanos[rng.IntN(len(nanos))], zones[rng.IntN(len(zones))])
	}
	maybe := func() *time.Time {
		if rng.IntN(2) == 0 {
			return nil
		}
		t := when()
		return &t
	}
	wrote := 0
	for i := range 20000 {
		hard := i%2 == 1
		o := OrderObject{OrderNo: text(hard && rng.IntN(4) == 0), Status: OrderStatus(text(hard && rng.IntN(4) == 0)),
			ProductID: text(false), Quantity: rng.IntN(2000) - 1000, Amount: text(false), Contact: text(hard),
			Provider: text(false), ExpiresAt: when(), CreatedAt: when(), PaidAt: maybe(), ClosedAt: maybe(), RefundedAt: maybe()}
		if rng.IntN(2) == 0 {
			s := text(hard && rng.IntN(2) == 0)
			o.TradeNo = &s
		}
		if rng.IntN(50) == 0 {
			o.Cards = []string{text(false)}
		}
		if rng.IntN(50) == 0 {
			o.CodesWithheld = text(false)
		}
		want, err := json.Marshal(o)
		got, ok := o.appendJSON([]byte("prefix"))
		if !ok {
			if string(got) != "prefix" {
				t.Fatalf("declined %+v but left %q", o, got)
			}
			continue
		}
		wrote++
		if err != nil {
			t.Fatalf("wrote %s where encoding/json refuses %+v: %v", got, o, err)
		}
		if !bytes.Equal(got, append([]byte("prefix"), want...)) {
			t.Fatalf("%+v:\nappendJSON   %s\nencoding/json %s", o, got[len("prefix"):], want)
		}
	}
	// The plain half is most of what a shop writes: it must be written here.
	if wrote < 5000 {
		t.Errorf("appendJSON wrote %d of 20000 orders itself, want most of the plain ones", wrote)
	}
}

// BenchmarkOrderEventPayload: an order event's payload by appendJSON
// against encoding/json.
func BenchmarkOrderEventPayload(b *testing.B) {
	paid := time.Date(2026, 12, 3, 8, 1, 2, 345678000, time.UTC)
	trade := "2026120322001400001234567890"
	o := OrderObject{OrderNo: "26120308010212345678", Status: OrderPaid, ProductID: "42", Quantity: 1, Amount: "12.50",
		Contact: "buyer@example.com", Provider: "alipay", ExpiresAt: paid.Add(15 * time.Minute), CreatedAt: paid.Add(-time.Minute),
		PaidAt: &paid, TradeNo: &trade}
	b.Run("appendJSON", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, ok := o.appendJSON(make([]byte, 0, 512)); !ok {
				b.Fatal("declined")
			}
		}
	})
	b.Run("encoding/json", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := json.Marshal(o); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// TestOrderObjectJSONEdges: appendJSON against encoding/json at the edges
// the random orders of TestOrderObjectJSONIsEncodingJSONs reach seldom or
// never: zero times, times with a monotonic reading, named zones (and
// their local mean times, offsets with seconds), offsets of 24 hours and
// more, years pushed past 9999 or below 0 by their zone, the widest
// quantities, empty text, DEL and every printable ASCII character.
func TestOrderObjectJSONEdges(t *testing.T) {
	var zones []*time.Location
	for _, name := range []string{"UTC", "Local", "Asia/Shanghai", "America/St_Johns", "Asia/Kathmandu", "Africa/Monrovia",
		"Europe/Amsterdam", "Pacific/Kiritimati", "Pacific/Pago_Pago"} {
		if loc, err := time.LoadLocation(name); err == nil {
			zones = append(zones, loc)
		}
	}
	for _, off := range []int{0, 1, -1, 59, -59, 60, -60, 3600 + 17, -(3600 + 17), 23*3600 + 59*60 + 59, -(23*3600 + 59*60 + 59),
		24 * 3600, -24 * 3600, 99 * 3600, -100 * 3600, math.MaxInt32, math.MinInt32} {
		zones = append(zones, time.FixedZone("", off), time.FixedZone("Z", off))
	}
	instants := []time.Time{{}, time.Now(), time.Now().Add(-time.Hour), time.Unix(0, 0), time.Unix(1<<40, 1),
		time.Date(9999, 12, 31, 23, 59, 59, 999999999, time.UTC), time.Date(0, 1, 1, 0, 0, 0, 0, time.UTC),
		time.Date(1800, 6, 1, 12, 0, 0, 0, time.UTC), time.Date(1900, 1, 1, 0, 0, 0, 0, time.UTC),
		time.Date(1970, 1, 1, 0, 0, 0, 0, time.UTC), time.Date(-1, 1, 1, 0, 0, 0, 0, time.UTC), time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC),
		time.Unix(1<<62, 0), time.Unix(-1<<62, 0)}
	var times []time.Time
	for _, at := range instants {
		times = append(times, at)
		for _, loc := range zones {
			times = append(times, at.In(loc))
		}
	}
	var printable []byte
	for c := byte(0x20); c < 0x7f; c++ {
		printable = append(printable, c)
	}
	texts := []string{"", " ", "~", "\x7f", "a\x7fb", string(printable), "PAID", "null", "0", "\u00a0"}
	wrote, declined := 0, 0
	check := func(o OrderObject) {
		t.Helper()
		want, err := json.Marshal(o)
		got, ok := o.appendJSON(nil)
		if !ok {
			declined++
			return
		}
		wrote++
		if err != nil {
			t.Fatalf("wrote %s where encoding/json refuses %+v: %v", got, o, err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("%+v:\nappendJSON    %s\nencoding/json %s", o, got, want)
		}
	}
	base := OrderObject{OrderNo: "1", Status: OrderPaid, ProductID: "2", Quantity: 1, Amount: "0.01", Provider: "alipay"}
	for _, at := range times {
		at := at
		o := base
		o.ExpiresAt, o.CreatedAt, o.PaidAt, o.ClosedAt, o.RefundedAt = at, at, &at, &at, &at
		check(o)
		o.ExpiresAt, o.CreatedAt = time.Time{}, at
		check(o)
	}
	for _, q := range []int{0, -1, math.MaxInt, math.MinInt, math.MaxInt32 + 1} {
		o := base
		o.Quantity = q
		check(o)
	}
	for _, s := range texts {
		s := s
		o := OrderObject{OrderNo: s, Status: OrderStatus(s), ProductID: s, Amount: s, Contact: s, Provider: s, TradeNo: &s,
			Cards: []string{}}
		check(o)
	}
	// Most times in a zone of less than 24 hours are written here (557 of
	// 1,247 with the tz database), not handed back: they test appendJSON.
	if wrote < 300 {
		t.Errorf("appendJSON wrote %d of the edges itself, declined %d", wrote, declined)
	}
}

// TestOrderObjectJSONWritesEveryField: with every field of OrderObject
// set (but the two set only at delivery, which appendJSON hands back to
// encoding/json), appendJSON writes the order itself and as encoding/json
// does. A field added to OrderObject and not to appendJSON fails here,
// also one with omitempty, which the random orders leave empty.
func TestOrderObjectJSONWritesEveryField(t *testing.T) {
	delivery := map[string]bool{"Cards": true, "CodesWithheld": true}
	at := time.Date(2026, 12, 3, 8, 1, 2, 345678000, time.FixedZone("CST", 8*3600))
	var o OrderObject
	v := reflect.ValueOf(&o).Elem()
	for i := range v.NumField() {
		f, name := v.Field(i), v.Type().Field(i).Name
		if delivery[name] {
			continue
		}
		switch {
		case f.Kind() == reflect.String:
			f.SetString(name)
		case f.Kind() == reflect.Int:
			f.SetInt(int64(i + 1))
		case f.Type() == reflect.TypeFor[time.Time]():
			f.Set(reflect.ValueOf(at.Add(time.Duration(i) * time.Second)))
		case f.Type() == reflect.TypeFor[*time.Time]():
			when := at.Add(time.Duration(i) * time.Hour)
			f.Set(reflect.ValueOf(&when))
		case f.Type() == reflect.TypeFor[*string]():
			s := name
			f.Set(reflect.ValueOf(&s))
		default:
			t.Fatalf("OrderObject.%s is a %s, which this test cannot fill: teach it and appendJSON", name, f.Type())
		}
	}
	want, err := json.Marshal(o)
	if err != nil {
		t.Fatal(err)
	}
	got, ok := o.appendJSON(nil)
	if !ok || !bytes.Equal(got, want) {
		t.Fatalf("every field set (ok %v):\nappendJSON    %s\nencoding/json %s", ok, got, want)
	}
}
