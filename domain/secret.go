package domain

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"hash"
	"strings"
	"sync"
)

// CardKeySize is the size of KAMI_CARD_KEY: an AES-256 key.
const CardKeySize = 32

// Sealer keeps card codes secret at rest and derives the other secrets kami
// needs from the one card key: each use gets its own subkey, so a leak of
// one (say the dedup hash) says nothing about another.
type Sealer struct {
	aead     cipher.AEAD
	codeHash *keyedMAC // keyed hash of codes, to find duplicates
	tokens   *keyedMAC // buyers' access tokens
}

// keyedMAC is HMAC-SHA256 under one key. The states it made are reset and
// used again: a new one costs several allocations, a reset one none, and
// a token is made for every order.
type keyedMAC struct {
	key    []byte
	states sync.Pool
}

func newKeyedMAC(key []byte) *keyedMAC { return &keyedMAC{key: key} }

// sum returns the MAC of the parts, written one after the other.
func (k *keyedMAC) sum(dst []byte, parts ...[]byte) []byte {
	m, ok := k.states.Get().(hash.Hash)
	if ok {
		m.Reset()
	} else {
		m = hmac.New(sha256.New, k.key)
	}
	for _, p := range parts {
		m.Write(p)
	}
	dst = m.Sum(dst)
	k.states.Put(m)
	return dst
}

// ParseCardKey reads KAMI_CARD_KEY: 32 bytes as hex (64 characters) or
// base64.
func ParseCardKey(s string) ([]byte, error) {
	s = strings.TrimSpace(s)
	if b, err := hex.DecodeString(s); err == nil && len(b) == CardKeySize {
		return b, nil
	}
	for _, enc := range []*base64.Encoding{base64.StdEncoding, base64.RawStdEncoding, base64.URLEncoding, base64.RawURLEncoding} {
		if b, err := enc.DecodeString(s); err == nil && len(b) == CardKeySize {
			return b, nil
		}
	}
	return nil, errors.New("KAMI_CARD_KEY: want 32 bytes as 64 hex characters or base64")
}

// NewCardKey returns a fresh random key in the form ParseCardKey reads.
func NewCardKey() string {
	b := make([]byte, CardKeySize)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// NewSealer returns a Sealer for a 32-byte key.
func NewSealer(key []byte) (*Sealer, error) {
	if len(key) != CardKeySize {
		return nil, errors.New("KAMI_CARD_KEY: want 32 bytes")
	}
	block, err := aes.NewCipher(subkey(key, "kami card code encryption v1"))
	if err != nil {
		return nil, err
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return nil, err
	}
	return &Sealer{
		aead:     aead,
		codeHash: newKeyedMAC(subkey(key, "kami card code dedup v1")),
		tokens:   newKeyedMAC(subkey(key, "kami order access token v1")),
	}, nil
}

func subkey(key []byte, label string) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(label))
	return m.Sum(nil)
}

// productAD binds a sealed code to its product: a ciphertext copied to
// another product's row does not open.
func productAD(productID int64) []byte {
	return binary.BigEndian.AppendUint64([]byte("card:"), uint64(productID))
}

// Seal encrypts code with AES-256-GCM under a fresh random nonce.
func (s *Sealer) Seal(productID int64, code string) []byte {
	return s.seal(productAD(productID), code)
}

// Open decrypts what Seal produced.
func (s *Sealer) Open(productID int64, sealed []byte) (string, error) {
	plain, err := s.open(productAD(productID), sealed)
	if err != nil {
		return "", errors.New("sealed card code does not open with KAMI_CARD_KEY")
	}
	return plain, nil
}

func (s *Sealer) seal(ad []byte, plain string) []byte {
	nonce := make([]byte, s.aead.NonceSize(), s.aead.NonceSize()+len(plain)+s.aead.Overhead())
	rand.Read(nonce)
	return s.aead.Seal(nonce, nonce, []byte(plain), ad)
}

func (s *Sealer) open(ad, sealed []byte) (string, error) {
	n := s.aead.NonceSize()
	if len(sealed) < n+s.aead.Overhead() {
		return "", errors.New("sealed value too short")
	}
	plain, err := s.aead.Open(nil, sealed[:n], sealed[n:], ad)
	if err != nil {
		return "", err
	}
	return string(plain), nil
}

// CodeHash is the keyed hash that detects a code imported twice for one
// product without storing the code in the clear.
func (s *Sealer) CodeHash(productID int64, code string) string {
	var sum [sha256.Size]byte
	return hex.EncodeToString(s.codeHash.sum(sum[:0], productAD(productID), []byte(code)))
}

// AccessToken is the buyer's token for orderNo. It is derived, not random,
// so that a createOrder retried with the same idempotency key hands back
// the same token although only its hash is stored.
func (s *Sealer) AccessToken(orderNo string) string {
	var sum [sha256.Size]byte
	return base64.RawURLEncoding.EncodeToString(s.tokens.sum(sum[:0], []byte(orderNo)))
}

// HashToken is what the database keeps of an access token.
func HashToken(token string) string {
	sum := sha256.Sum256([]byte(token))
	return hex.EncodeToString(sum[:])
}

// TokenMatches compares a presented token with a stored hash in constant time.
func TokenMatches(token, storedHash string) bool {
	got := HashToken(token)
	return hmac.Equal([]byte(got), []byte(storedHash))
}

// webhookSecretAD binds a sealed secret to its use: a sealed card code
// copied into an endpoint's row does not open as its secret.
var webhookSecretAD = []byte("webhook endpoint secret v1")

// SealWebhookSecret encrypts a webhook endpoint's signing secret at rest,
// as card codes are.
func (s *Sealer) SealWebhookSecret(secret string) []byte { return s.seal(webhookSecretAD, secret) }

// OpenWebhookSecret decrypts what SealWebhookSecret produced.
func (s *Sealer) OpenWebhookSecret(sealed []byte) (string, error) {
	plain, err := s.open(webhookSecretAD, sealed)
	if err != nil {
		return "", errors.New("sealed webhook secret does not open with KAMI_CARD_KEY")
	}
	return plain, nil
}
