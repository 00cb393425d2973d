package domain

import (
	"fmt"
	"regexp"
	"strings"
	"unicode/utf8"
)

// CodeRule is a product's format rule for its codes: what every imported
// code must look like. The zero rule accepts any code within kami's own
// limits (1 to MaxCodeBytes bytes of printable UTF-8).
type CodeRule struct {
	// Pattern is a regular expression (Go's RE2 syntax: it runs in time
	// linear in the code, so no pattern can stall an import) that the whole
	// code must match: it is anchored at both ends, ^ and $ are optional.
	Pattern string `bun:"code_pattern"`
	// MinLen and MaxLen bound the code's length in characters; 0 is no
	// bound.
	MinLen int `bun:"code_min_len"`
	MaxLen int `bun:"code_max_len"`
}

// MaxPatternBytes bounds a rule's pattern: a rule describes one code, it
// is never long; the bound also bounds the compiled program.
const MaxPatternBytes = 512

// IsZero reports whether the rule accepts every code.
func (r CodeRule) IsZero() bool { return r == CodeRule{} }

// Validate checks the rule when it is set, so that a bad rule is refused
// then and never at import time: BAD_INPUT for a pattern that does not
// compile or is too long, or a length range that is empty or beyond
// MaxCodeBytes.
func (r CodeRule) Validate() error {
	_, err := r.compile()
	return err
}

// compiledRule is a CodeRule ready to check codes.
type compiledRule struct {
	CodeRule
	re *regexp.Regexp // nil: no pattern
}

func (r CodeRule) compile() (*compiledRule, error) {
	switch {
	case len(r.Pattern) > MaxPatternBytes:
		return nil, Errorf(EBADINPUT, "the code pattern is longer than %d bytes", MaxPatternBytes)
	case r.MinLen < 0 || r.MaxLen < 0:
		return nil, Errorf(EBADINPUT, "code lengths must not be negative")
	case r.MinLen > MaxCodeBytes || r.MaxLen > MaxCodeBytes:
		return nil, Errorf(EBADINPUT, "code lengths must be at most %d", MaxCodeBytes)
	case r.MaxLen > 0 && r.MinLen > r.MaxLen:
		return nil, Errorf(EBADINPUT, "the shortest code length (%d) is above the longest (%d)", r.MinLen, r.MaxLen)
	}
	c := &compiledRule{CodeRule: r}
	if r.Pattern != "" {
		re, err := regexp.Compile(`^(?:` + r.Pattern + `)$`)
		if err != nil {
			// regexp's message names the fault in the pattern itself
			// ("missing closing ]: `[A-Z`"), which the admin just sent.
			return nil, Errorf(EBADINPUT, "the code pattern is not a valid regular expression: %s", strings.TrimPrefix(err.Error(), "error parsing regexp: "))
		}
		c.re = re
	}
	return c, nil
}

// RefusalReason says why an import refused one line.
type RefusalReason string

const (
	RefusedEmpty           RefusalReason = "EMPTY"              // nothing but blanks
	RefusedTooLong         RefusalReason = "TOO_LONG"           // over the rule's MaxLen or MaxCodeBytes
	RefusedTooShort        RefusalReason = "TOO_SHORT"          // under the rule's MinLen
	RefusedFormat          RefusalReason = "FORMAT"             // does not match the rule's pattern
	RefusedControl         RefusalReason = "CONTROL_CHARACTERS" // control characters inside the code
	RefusedDuplicateInFile RefusalReason = "DUPLICATE_IN_FILE"  // an earlier line of the same import has it
	RefusedDuplicate       RefusalReason = "DUPLICATE_EXISTING" // the product has or ever had it (sold ones too)
)

// RefusalReasons lists every reason, in the order reports list them.
var RefusalReasons = []RefusalReason{RefusedEmpty, RefusedTooLong, RefusedTooShort, RefusedFormat, RefusedControl,
	RefusedDuplicateInFile, RefusedDuplicate}

// IsDuplicate reports whether the reason is one of the duplicates, which
// batches count apart from the other refusals.
func (r RefusalReason) IsDuplicate() bool {
	return r == RefusedDuplicateInFile || r == RefusedDuplicate
}

// check returns why code (already trimmed, valid UTF-8) is refused, or ""
// when the rule accepts it. The message never repeats the code: an import
// report is shown and logged, and a refused line may still be a real code.
func (c *compiledRule) check(code string) (RefusalReason, string) {
	if code == "" {
		return RefusedEmpty, "the line is empty"
	}
	if len(code) > MaxCodeBytes {
		return RefusedTooLong, fmt.Sprintf("%d bytes; a code is at most %d", len(code), MaxCodeBytes)
	}
	if strings.ContainsFunc(code, isControl) {
		return RefusedControl, "the code contains control characters"
	}
	n := utf8.RuneCountInString(code)
	if c.MaxLen > 0 && n > c.MaxLen {
		return RefusedTooLong, fmt.Sprintf("%d characters; this product's codes have at most %d", n, c.MaxLen)
	}
	if n < c.MinLen {
		return RefusedTooShort, fmt.Sprintf("%d characters; this product's codes have at least %d", n, c.MinLen)
	}
	if c.re != nil && !c.re.MatchString(code) {
		return RefusedFormat, "does not match this product's code pattern"
	}
	return "", ""
}

func isControl(r rune) bool { return r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0) }
