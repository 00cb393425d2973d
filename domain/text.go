package domain

import (
	"strings"
	"unicode/utf8"
)

// StoredText is text that came from outside kami (a webhook receiver's
// answer, a TLS or SMTP error) made fit to store on every database, at
// most maxBytes bytes: NUL dropped (PostgreSQL refuses it), invalid UTF-8
// replaced (PostgreSQL and MySQL refuse it), and cut on a rune boundary
// (a cut inside a rune is invalid UTF-8 again). A receiver controls these
// bytes: one the database refused would fail the UPDATE that records the
// attempt, again at every attempt.
func StoredText(s string, maxBytes int) string {
	s = strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "")
	if len(s) <= maxBytes {
		return s
	}
	cut := maxBytes
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut]
}
