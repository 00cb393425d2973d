package alipayemu

import (
	"crypto"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"regexp"
	"sort"
	"strconv"
	"strings"
)

// signContent is Alipay's string to sign: the fields not excluded and not
// empty, sorted by name, as k=v joined with '&', values unescaped. Requests
// exclude only sign; notifications exclude sign and sign_type.
func signContent(params map[string]string, exclude ...string) string {
	keys := make([]string, 0, len(params))
outer:
	for k, v := range params {
		if v == "" {
			continue
		}
		for _, x := range exclude {
			if k == x {
				continue outer
			}
		}
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + params[k]
	}
	return strings.Join(parts, "&")
}

// rsa2Sign is SHA256withRSA (PKCS#1 v1.5), base64: Alipay's RSA2.
func rsa2Sign(key *rsa.PrivateKey, content string) string {
	sum := sha256.Sum256([]byte(content))
	sig, err := rsa.SignPKCS1v15(rand.Reader, key, crypto.SHA256, sum[:])
	if err != nil {
		panic(fmt.Sprintf("alipayemu: sign: %v", err)) // only for a broken key
	}
	return base64.StdEncoding.EncodeToString(sig)
}

func rsa2Verify(pub *rsa.PublicKey, content, sign string) error {
	sig, err := base64.StdEncoding.DecodeString(sign)
	if err != nil {
		return errors.New("sign is not base64")
	}
	sum := sha256.Sum256([]byte(content))
	return rsa.VerifyPKCS1v15(pub, crypto.SHA256, sum[:], sig)
}

// The gateway's own reading of amounts, kept apart from kami's money
// package on purpose: yuan with at most two decimals, 0.01 to 100000000.
var amountRE = regexp.MustCompile(`^(0|[1-9][0-9]{0,8})(\.[0-9]{1,2})?$`)

func parseAmount(s string) (int64, bool) {
	m := amountRE.FindStringSubmatch(s)
	if m == nil {
		return 0, false
	}
	yuan, _ := strconv.ParseInt(m[1], 10, 64)
	var fen int64
	if m[2] != "" {
		frac := m[2][1:]
		if len(frac) == 1 {
			frac += "0"
		}
		fen, _ = strconv.ParseInt(frac, 10, 64)
	}
	total := yuan*100 + fen
	if total < 1 || total > 100000000*100 {
		return 0, false
	}
	return total, true
}

func formatAmount(fen int64) string {
	return strconv.FormatInt(fen/100, 10) + "." + fmt.Sprintf("%02d", fen%100)
}
