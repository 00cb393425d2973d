package domain

import (
	"crypto/sha256"
	"encoding/hex"
	"net/netip"
	"strings"
	"unicode"

	"golang.org/x/text/unicode/norm"
)

// NormalizeContact is the one form of a buyer's contact that kami stores,
// counts the anti-hoarding caps by and filters the admin list by, so that
// "Buyer@Example.com ", "buyer@example.com" and its full-width twin
// "ｂｕｙｅｒ＠ｅｘａｍｐｌｅ．ｃｏｍ" are one contact:
//
//   - Unicode compatibility form (NFKC): full-width letters, digits and
//     signs, as Chinese input methods type them, become their ASCII selves;
//   - no white space and no invisible format characters (zero-width space,
//     joiners, soft hyphen, byte-order mark) anywhere: no contact kami takes
//     (email, phone, QQ, WeChat id) has them, and they would make one buyer
//     look like many;
//   - lower case throughout, the local part of an email included. RFC 5321
//     lets a mail server tell "Bob@" from "bob@", but none of the large ones
//     does, so the codes mailed to the lower-cased address (domain/mail.go)
//     reach the buyer all the same, and a cap that a capital letter escapes
//     is no cap;
//   - a phone number written with separators ("+86 138-0013-8000",
//     "(0086)13800138000") is its digits, and a Chinese mobile number loses
//     its country code (+86 / 0086), so it matches the bare 11 digits.
//
// Sub-addresses (a+tag@) and dots in Gmail local parts are left alone:
// they are real, different addresses to most mail servers, and a hoarder
// who can invent addresses is held by the per-address caps instead.
// NormalizeContact is idempotent.
func NormalizeContact(s string) string {
	s = norm.NFKC.String(s)
	s = strings.Map(func(r rune) rune {
		if unicode.IsSpace(r) || unicode.Is(unicode.Cf, r) {
			return -1
		}
		return r
	}, s)
	// Lower case can leave a string that NFKC would change again (a
	// capital with a combining mark); one more pass makes the result a
	// fixed point.
	s = norm.NFKC.String(strings.ToLower(s))
	if phone, ok := phoneDigits(s); ok {
		return phone
	}
	return s
}

// phoneDigits reads s as a phone number: an optional leading "+", digits,
// and the separators people type between them. It returns the number
// without separators (a Chinese mobile number also without its country
// code), or false when s is not a phone number.
func phoneDigits(s string) (string, bool) {
	var digits strings.Builder
	for i, r := range s {
		switch {
		case r >= '0' && r <= '9':
			digits.WriteRune(r)
		case r == '+' && i == 0:
		case r == '-' || r == '(' || r == ')' || r == '.':
		default:
			return "", false
		}
	}
	d := digits.String()
	if len(d) < 5 {
		return "", false // too short to be a phone number
	}
	plus := strings.HasPrefix(s, "+")
	if len(d) > 2 && d[:2] == "00" && d[2] != '0' { // the international prefix dialled from China, then a country code
		d, plus = d[2:], true
	}
	if len(d) == 13 && strings.HasPrefix(d, "861") { // a Chinese mobile number: 1 and 10 digits
		return d[2:], true
	}
	if plus {
		return "+" + d, true
	}
	return d, true
}

// AddressKey is the client address as the per-address caps count it: an
// IPv4 address as it is, an IPv6 address by its /64, the block one
// household or phone is given (a client picks any address in it at will).
// An address that does not parse is kept as given, cut to 64 bytes.
func AddressKey(addr string) string {
	ip, err := netip.ParseAddr(addr)
	if err != nil {
		if len(addr) > 64 {
			addr = addr[:64]
		}
		return addr
	}
	ip = ip.Unmap().WithZone("")
	if ip.Is4() {
		return ip.String()
	}
	return netip.PrefixFrom(ip, 64).Masked().String()
}

// scopedIdempotencyKey is an idempotency key as it is stored: bound to the
// client address it came from (see AddressKey), so that the same key sent
// from another address is another key. A key is not a password: a client
// who learns or guesses someone else's key must not get their order, and
// with it their access token and, once paid, their codes. The storefront's
// own retry of a request whose answer was lost comes from the same
// address; from a new one (a phone that changed networks) it places a new
// order, and the first, which nobody saw, expires unpaid. The hash keeps
// the stored value within the column's 64 characters and the raw key out
// of the database.
func scopedIdempotencyKey(addressKey, key string) string {
	sum := sha256.Sum256([]byte("kami-idempotency\x00" + addressKey + "\x00" + key))
	return hex.EncodeToString(sum[:])
}
