package domain

import (
	"strconv"
	"time"
)

// appendJSON appends o as encoding/json writes it. Every order event of
// every place, payment and close carries one, and encoding/json (by
// reflection, each time through MarshalJSON for the times) was an eighth
// of kami's CPU in a close drain. ok is false (b returned as given,
// though the room past its length may have been written) where o holds
// anything this does not write byte for byte as encoding/json does: text
// needing an escape (a quote, a backslash, a control character, <, > or
// &, anything outside ASCII), a time encoding/json refuses, the fields
// set only at delivery. The caller then marshals it with encoding/json
// (newEvent). TestOrderObjectJSONIsEncodingJSONs, TestOrderObjectJSONEdges
// and TestOrderObjectJSONWritesEveryField hold the two to the same bytes.
func (o *OrderObject) appendJSON(b []byte) (_ []byte, ok bool) {
	if len(o.Cards) > 0 || o.CodesWithheld != "" {
		return b, false
	}
	start := len(b)
	fail := func() ([]byte, bool) { return b[:start], false }
	str := func(name, v string) bool {
		b = append(b, name...)
		return appendPlainJSONString(&b, v)
	}
	if !str(`{"orderNo":`, o.OrderNo) || !str(`,"status":`, string(o.Status)) || !str(`,"productId":`, o.ProductID) {
		return fail()
	}
	b = append(b, `,"quantity":`...)
	b = strconv.AppendInt(b, int64(o.Quantity), 10)
	if !str(`,"amount":`, o.Amount) || !str(`,"contact":`, o.Contact) || !str(`,"provider":`, o.Provider) {
		return fail()
	}
	for _, f := range []struct {
		name string
		t    *time.Time
	}{{`,"expiresAt":`, &o.ExpiresAt}, {`,"createdAt":`, &o.CreatedAt}, {`,"paidAt":`, o.PaidAt},
		{`,"closedAt":`, o.ClosedAt}, {`,"refundedAt":`, o.RefundedAt}} {
		b = append(b, f.name...)
		if f.t == nil {
			b = append(b, "null"...)
			continue
		}
		out, err := f.t.AppendText(append(b, '"'))
		if err != nil {
			return fail()
		}
		b = append(out, '"')
	}
	b = append(b, `,"tradeNo":`...)
	if o.TradeNo == nil {
		b = append(b, "null"...)
	} else if !appendPlainJSONString(&b, *o.TradeNo) {
		return fail()
	}
	return append(b, '}'), true
}

// appendPlainJSONString appends s quoted, and is true, when s is printable
// ASCII that encoding/json writes as it is: none of ", \, <, >, & (which
// it escapes, the last three for HTML) and no control character.
func appendPlainJSONString(b *[]byte, s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c > 0x7e || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			return false
		}
	}
	*b = append(append(append(*b, '"'), s...), '"')
	return true
}
