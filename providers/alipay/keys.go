package alipay

import (
	"crypto/rsa"
	"crypto/x509"
	"encoding/base64"
	"encoding/pem"
	"errors"
	"os"
	"strings"
)

// A key setting may be PEM text, a path to a PEM file, or the bare base64
// body that Alipay's console shows (no BEGIN/END lines). None of the errors
// below repeats the setting: it may be the key itself.

// maxKeyFile bounds what we read from a key path; a PEM RSA key is a few KiB.
const maxKeyFile = 64 << 10

// keyBytes resolves a setting to the PEM or DER bytes it names.
// It returns (data, isPEM).
func keyBytes(setting string) ([]byte, bool, error) {
	s := strings.TrimSpace(setting)
	if s == "" {
		return nil, false, errors.New("not set")
	}
	if strings.Contains(s, "-----BEGIN") {
		return []byte(s), true, nil
	}
	if der, ok := bareBase64(s); ok {
		return der, false, nil
	}
	// Anything else must be a file. A key that failed to decode above
	// would look like a missing file here; say both.
	if strings.ContainsAny(s, "\n\r") || len(s) > 4096 {
		return nil, false, errors.New("neither a PEM key, a bare base64 key nor a file path")
	}
	st, err := os.Stat(s)
	if err != nil {
		return nil, false, errors.New("neither a PEM key, a bare base64 key nor a readable file")
	}
	if st.Size() > maxKeyFile {
		return nil, false, errors.New("file too large to be a key")
	}
	b, err := os.ReadFile(s)
	if err != nil {
		return nil, false, errors.New("key file not readable")
	}
	t := strings.TrimSpace(string(b))
	if strings.Contains(t, "-----BEGIN") {
		return []byte(t), true, nil
	}
	if der, ok := bareBase64(t); ok {
		return der, false, nil
	}
	return nil, false, errors.New("file holds neither a PEM key nor a bare base64 key")
}

// bareBase64 decodes the console's one-line base64 key. Short strings are
// not keys (a relative path like "keys/app" is valid base64 too).
func bareBase64(s string) ([]byte, bool) {
	compact := strings.Join(strings.Fields(s), "")
	if len(compact) < 128 {
		return nil, false
	}
	der, err := base64.StdEncoding.DecodeString(compact)
	if err != nil {
		return nil, false
	}
	return der, true
}

// derBlock returns the DER body of data: its first PEM block, or data
// itself when it is already DER.
func derBlock(data []byte, isPEM bool) (der []byte, pemType string, err error) {
	if !isPEM {
		return data, "", nil
	}
	block, _ := pem.Decode(data)
	if block == nil {
		return nil, "", errors.New("PEM text does not decode")
	}
	return block.Bytes, block.Type, nil
}

// parsePrivateKey reads the app's RSA private key (PKCS#1 or PKCS#8).
func parsePrivateKey(setting string) (*rsa.PrivateKey, error) {
	data, isPEM, err := keyBytes(setting)
	if err != nil {
		return nil, err
	}
	der, typ, err := derBlock(data, isPEM)
	if err != nil {
		return nil, err
	}
	if typ != "" && typ != "RSA PRIVATE KEY" && typ != "PRIVATE KEY" {
		return nil, errors.New("PEM block is " + typ + ", want an RSA private key")
	}
	var key *rsa.PrivateKey
	if k, err := x509.ParsePKCS1PrivateKey(der); err == nil {
		key = k
	} else if k8, err := x509.ParsePKCS8PrivateKey(der); err == nil {
		rk, ok := k8.(*rsa.PrivateKey)
		if !ok {
			return nil, errors.New("not an RSA private key (RSA2 needs RSA)")
		}
		key = rk
	} else {
		return nil, errors.New("not a PKCS#1 or PKCS#8 RSA private key")
	}
	if key.N.BitLen() < 2048 {
		return nil, errors.New("RSA key shorter than 2048 bits; RSA2 needs 2048")
	}
	return key, nil
}

// parsePublicKey reads Alipay's RSA public key (PKIX or PKCS#1). Alipay's
// public-key certificate mode (alipayCertPublicKey_RSA2.crt with root cert
// SNs) is not supported: it needs more than a key.
func parsePublicKey(setting string) (*rsa.PublicKey, error) {
	data, isPEM, err := keyBytes(setting)
	if err != nil {
		return nil, err
	}
	der, typ, err := derBlock(data, isPEM)
	if err != nil {
		return nil, err
	}
	switch typ {
	case "", "PUBLIC KEY", "RSA PUBLIC KEY":
	case "CERTIFICATE":
		return nil, errors.New("a certificate was given; certificate mode is not supported, give Alipay's public key")
	default:
		return nil, errors.New("PEM block is " + typ + ", want Alipay's RSA public key")
	}
	if pub, err := x509.ParsePKIXPublicKey(der); err == nil {
		rk, ok := pub.(*rsa.PublicKey)
		if !ok {
			return nil, errors.New("not an RSA public key")
		}
		return rk, nil
	}
	if rk, err := x509.ParsePKCS1PublicKey(der); err == nil {
		return rk, nil
	}
	return nil, errors.New("not a PKIX or PKCS#1 RSA public key")
}
