// Package wechatemu emulates the part of the WeChat Pay API v3 gateway that
// kami uses, as an http.Handler to run under httptest.NewServer.
//
// It is strict where the real gateway is strict, because it is what proves
// the adapter right: every request must carry a valid
// WECHATPAY2-SHA256-RSA2048 signature by the merchant key, every answer is
// signed with the emulator's own platform key ("WeChat Pay public key" mode,
// with a PUB_KEY_ID_ serial), errors come in v3's {"code","message"} form with
// the gateway's HTTP status, and notifications are signed and encrypted with
// AEAD_AES_256_GCM under the API v3 key.
//
// Trades are kept by out_trade_no and refunds by out_refund_no. A refund
// asked again under the same number refunds nothing more and answers like
// the first; a refund above what is left of the trade is refused.
package wechatemu

import (
	"bytes"
	"crypto"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"kami/providers/fault"
)

// Defaults for Options.
const (
	DefaultMchID         = "1900000109"
	DefaultAppID         = "wxd678efh567hg6787"
	DefaultPlatformKeyID = "PUB_KEY_ID_0119000001092025010100000000000001"
	DefaultSlowDelay     = 300 * time.Millisecond
	DefaultHoldMax       = 30 * time.Second
)

// maxClockSkew is how far a request's timestamp may be from the gateway's
// clock.
const maxClockSkew = 5 * time.Minute

// Options configures an emulator. MerchantPublicKey and MerchantSerialNo are
// required: they are what requests are verified against.
type Options struct {
	MchID string // default DefaultMchID
	AppID string // default DefaultAppID
	// APIv3Key encrypts notifications; default: 32 random characters.
	APIv3Key string
	// MerchantSerialNo is the serial_no every request must name, and
	// MerchantPublicKey the key its signature must verify with.
	MerchantSerialNo  string
	MerchantPublicKey *rsa.PublicKey
	// PlatformKey signs answers and notifications; default: generated.
	PlatformKey   *rsa.PrivateKey
	PlatformKeyID string // default DefaultPlatformKeyID
	// SlowDelay is how late FaultSlow answers (keep it under the client's
	// timeout); HoldMax the longest a timeout fault holds a request whose
	// client has not given up yet.
	SlowDelay time.Duration
	HoldMax   time.Duration
	// RefundProcessing makes new refunds answer PROCESSING; the next query
	// finds them SUCCESS, as the real gateway does a moment later.
	RefundProcessing bool
	// RefundStaysProcessing makes new refunds answer PROCESSING and stay so
	// at every query, as a refund to a bank card does for days, until
	// SetRefundStatus moves them.
	RefundStaysProcessing bool
	// Now is the gateway's clock; default time.Now.
	Now func() time.Time
	// EarlyStatements serves a day's bill as soon as it is asked for, with
	// the books so far, instead of once the day is over (see
	// statement.go): tests then need not wait for tomorrow.
	EarlyStatements bool
}

// Server is one emulated gateway with its merchant.
type Server struct {
	opts        Options
	platformPEM string
	mux         *http.ServeMux
	faults      fault.Table // injected faults, by op

	mu        sync.Mutex
	trades    map[string]*trade  // by out_trade_no
	byTxID    map[string]string  // transaction_id → out_trade_no
	refunds   map[string]*refund // by out_refund_no
	calls     map[string]int     // refund calls by out_refund_no
	nonces    map[string]time.Time
	seq       int
	fiveXX    int
	answerKey *rsa.PrivateKey     // when set, answers are signed with it instead
	answerID  string              // and name this serial
	unknown   []string            // requests to paths the gateway does not serve
	otherKey  *rsa.PrivateKey     // the forger's key, made when first needed
	bills     map[string]billFile // bill downloads handed out, by token
}

// New starts an emulated gateway.
func New(opts Options) (*Server, error) {
	if opts.MerchantPublicKey == nil {
		return nil, errors.New("wechatemu: MerchantPublicKey is required")
	}
	if opts.MerchantSerialNo == "" {
		return nil, errors.New("wechatemu: MerchantSerialNo is required")
	}
	if opts.MchID == "" {
		opts.MchID = DefaultMchID
	}
	if opts.AppID == "" {
		opts.AppID = DefaultAppID
	}
	if opts.APIv3Key == "" {
		opts.APIv3Key = randomHex(16)
	}
	if len(opts.APIv3Key) != 32 {
		return nil, errors.New("wechatemu: APIv3Key must be 32 bytes")
	}
	if opts.PlatformKeyID == "" {
		opts.PlatformKeyID = DefaultPlatformKeyID
	}
	if opts.SlowDelay <= 0 {
		opts.SlowDelay = DefaultSlowDelay
	}
	if opts.HoldMax <= 0 {
		opts.HoldMax = DefaultHoldMax
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.PlatformKey == nil {
		k, err := rsa.GenerateKey(rand.Reader, 2048)
		if err != nil {
			return nil, fmt.Errorf("wechatemu: platform key: %w", err)
		}
		opts.PlatformKey = k
	}
	pub, err := PublicKeyPEM(&opts.PlatformKey.PublicKey)
	if err != nil {
		return nil, err
	}
	s := &Server{
		opts:        opts,
		platformPEM: pub,
		trades:      map[string]*trade{},
		byTxID:      map[string]string{},
		refunds:     map[string]*refund{},
		calls:       map[string]int{},
		nonces:      map[string]time.Time{},
	}
	s.routes()
	return s, nil
}

// ServeHTTP implements http.Handler.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.mux.ServeHTTP(w, r) }

// PlatformPublicKeyPEM is WeChat Pay's public key, for the merchant's
// KAMI_WECHAT_PLATFORM_PUBLIC_KEY.
func (s *Server) PlatformPublicKeyPEM() string { return s.platformPEM }

// PlatformPublicKeyID is the key's ID (KAMI_WECHAT_PLATFORM_PUBLIC_KEY_ID).
func (s *Server) PlatformPublicKeyID() string { return s.opts.PlatformKeyID }

// MchID, AppID and APIv3Key are the merchant's settings at this gateway.
func (s *Server) MchID() string    { return s.opts.MchID }
func (s *Server) AppID() string    { return s.opts.AppID }
func (s *Server) APIv3Key() string { return s.opts.APIv3Key }

// InjectFault makes the next n calls of op fail with f (n <= 0: until
// cleared with fault.None).
func (s *Server) InjectFault(op fault.Op, f fault.Fault, n int) {
	s.faults.Inject(op, f, n)
}

// SignAnswersWith makes the gateway sign its answers with k instead of the
// platform key and name serial as its ID, as a man in the middle would; nil
// and "" restore the real ones.
func (s *Server) SignAnswersWith(k *rsa.PrivateKey, serial string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.answerKey, s.answerID = k, serial
}

// UnknownRequests lists the requests ("METHOD /path") to paths the gateway
// does not serve, such as a client fetching /v3/certificates.
func (s *Server) UnknownRequests() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.unknown...)
}

// ---- requests ----

// apiError is v3's error body.
type apiError struct {
	status  int
	Code    string `json:"code"`
	Message string `json:"message"`
}

func (e *apiError) Error() string { return fmt.Sprintf("%d %s: %s", e.status, e.Code, e.Message) }

func errorf(status int, code, format string, args ...any) *apiError {
	return &apiError{status: status, Code: code, Message: fmt.Sprintf(format, args...)}
}

// reply is a handler's answer: status with body (nil body: no content).
type reply struct {
	status int
	body   any
}

type handler func(r *http.Request, body []byte) (reply, *apiError)

// handle wraps h with what every endpoint does: read, authenticate, inject
// the op's fault, answer signed.
func (s *Server) handle(op fault.Op, h handler) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
		if err != nil {
			s.writeError(w, errorf(http.StatusBadRequest, "PARAM_ERROR", "unreadable body"))
			return
		}
		if aerr := s.authenticate(r, body); aerr != nil {
			s.writeError(w, aerr)
			return
		}
		if op == fault.OpRefund {
			s.countRefundCall(body)
		}

		switch s.faults.Take(op) {
		case fault.Timeout:
			s.hold(r)
			return
		case fault.Server5xx:
			s.write5xx(w)
			return
		case fault.Business:
			s.writeError(w, businessError(op))
			return
		case fault.Slow:
			select {
			case <-time.After(s.opts.SlowDelay):
			case <-r.Context().Done():
				return
			}
		case fault.TimeoutAfterEffect:
			_, _ = h(r, body)
			s.hold(r)
			return
		}

		rep, aerr := h(r, body)
		if aerr != nil {
			s.writeError(w, aerr)
			return
		}
		s.writeReply(w, rep)
	}
}

// businessError is what FaultBusiness answers: a real business refusal for
// op, never one the adapter may read as "not found" or "try again".
func businessError(op fault.Op) *apiError {
	if op == fault.OpRefund {
		return errorf(http.StatusForbidden, "NOT_ENOUGH", "基本账户余额不足，请充值后重新发起")
	}
	return errorf(http.StatusBadRequest, "INVALID_REQUEST", "emulated business error")
}

// hold keeps the request until its client gives up (or HoldMax), and then
// answers nothing useful: the client has already timed out.
func (s *Server) hold(r *http.Request) {
	select {
	case <-r.Context().Done():
	case <-time.After(s.opts.HoldMax):
	}
}

// authenticate checks the Authorization header as the gateway does:
// WECHATPAY2-SHA256-RSA2048 mchid="",nonce_str="",signature="",timestamp="",serial_no=""
// over method\nurl\ntimestamp\nnonce\nbody\n.
func (s *Server) authenticate(r *http.Request, body []byte) *apiError {
	const scheme = "WECHATPAY2-SHA256-RSA2048 "
	fail := func(msg string) *apiError { return errorf(http.StatusUnauthorized, "SIGN_ERROR", "%s", msg) }
	auth := r.Header.Get("Authorization")
	if !strings.HasPrefix(auth, scheme) {
		return fail("Authorization is not WECHATPAY2-SHA256-RSA2048")
	}
	params := map[string]string{}
	for _, kv := range strings.Split(strings.TrimPrefix(auth, scheme), ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(kv), "=")
		if !ok || len(v) < 2 || v[0] != '"' || v[len(v)-1] != '"' {
			return fail("malformed Authorization")
		}
		if _, dup := params[k]; dup {
			return fail("malformed Authorization")
		}
		params[k] = v[1 : len(v)-1]
	}
	for _, k := range []string{"mchid", "nonce_str", "signature", "timestamp", "serial_no"} {
		if params[k] == "" {
			return fail("Authorization lacks " + k)
		}
	}
	if params["mchid"] != s.opts.MchID {
		return fail("mchid is not this merchant")
	}
	if params["serial_no"] != s.opts.MerchantSerialNo {
		return fail("serial_no is not the merchant certificate's")
	}
	sec, err := strconv.ParseInt(params["timestamp"], 10, 64)
	if err != nil {
		return fail("timestamp is not a number")
	}
	now := s.opts.Now()
	if d := now.Sub(time.Unix(sec, 0)); d > maxClockSkew || d < -maxClockSkew {
		return fail("timestamp too far from now")
	}
	sig, err := base64.StdEncoding.DecodeString(params["signature"])
	if err != nil {
		return fail("signature is not base64")
	}
	msg := r.Method + "\n" + r.RequestURI + "\n" + params["timestamp"] + "\n" + params["nonce_str"] + "\n" + string(body) + "\n"
	sum := sha256.Sum256([]byte(msg))
	if err := rsa.VerifyPKCS1v15(s.opts.MerchantPublicKey, crypto.SHA256, sum[:], sig); err != nil {
		return fail("signature does not verify")
	}

	// A verified request is not accepted twice.
	s.mu.Lock()
	defer s.mu.Unlock()
	for n, at := range s.nonces {
		if now.Sub(at) > 2*maxClockSkew {
			delete(s.nonces, n)
		}
	}
	if _, seen := s.nonces[params["nonce_str"]]; seen {
		return fail("nonce_str already used")
	}
	s.nonces[params["nonce_str"]] = now
	return nil
}

// ---- answers ----

func (s *Server) writeReply(w http.ResponseWriter, rep reply) {
	if rep.body == nil {
		s.writeSigned(w, rep.status, nil)
		return
	}
	b, err := json.Marshal(rep.body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	s.writeSigned(w, rep.status, b)
}

func (s *Server) writeError(w http.ResponseWriter, e *apiError) {
	b, _ := json.Marshal(e)
	s.writeSigned(w, e.status, b)
}

// write5xx alternates between the gateway's own signed SYSTEM_ERROR and an
// unsigned 503 from the load balancer in front of it.
func (s *Server) write5xx(w http.ResponseWriter) {
	s.mu.Lock()
	s.fiveXX++
	odd := s.fiveXX%2 == 1
	s.mu.Unlock()
	if odd {
		s.writeError(w, errorf(http.StatusInternalServerError, "SYSTEM_ERROR", "系统错误"))
		return
	}
	w.Header().Set("Content-Type", "text/html")
	w.WriteHeader(http.StatusServiceUnavailable)
	_, _ = io.WriteString(w, "<html><body>503 Service Temporarily Unavailable</body></html>")
}

// writeSigned answers with the Wechatpay-* headers: an RSA-SHA256 signature
// by the platform key over timestamp\nnonce\nbody\n.
func (s *Server) writeSigned(w http.ResponseWriter, status int, body []byte) {
	s.mu.Lock()
	key, serial := s.answerKey, s.answerID
	s.mu.Unlock()
	if key == nil {
		key = s.opts.PlatformKey
	}
	if serial == "" {
		serial = s.opts.PlatformKeyID
	}
	h := w.Header()
	for k, v := range s.signatureHeaders(key, serial, s.opts.Now(), body) {
		h[k] = v
	}
	h.Set("Request-ID", randomHex(16))
	if body != nil {
		h.Set("Content-Type", "application/json")
	}
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

func (s *Server) signatureHeaders(key *rsa.PrivateKey, serial string, at time.Time, body []byte) http.Header {
	ts := strconv.FormatInt(at.Unix(), 10)
	nonce := strings.ToUpper(randomHex(16))
	h := http.Header{}
	h.Set("Wechatpay-Timestamp", ts)
	h.Set("Wechatpay-Nonce", nonce)
	h.Set("Wechatpay-Signature", sign(key, ts+"\n"+nonce+"\n"+string(body)+"\n"))
	h.Set("Wechatpay-Serial", serial)
	h.Set("Wechatpay-Signature-Type", "WECHATPAY2-SHA256-RSA2048")
	return h
}

func sign(key *rsa.PrivateKey, msg string) string {
	sum := sha256.Sum256([]byte(msg))
	sig, err := rsa.SignPKCS1v15(rand.Reader, key, crypto.SHA256, sum[:])
	if err != nil {
		panic("wechatemu: signing: " + err.Error())
	}
	return base64.StdEncoding.EncodeToString(sig)
}

// ---- keys ----

// GenerateKey makes a 2048-bit RSA key, for a merchant or a forger.
func GenerateKey() (*rsa.PrivateKey, error) { return rsa.GenerateKey(rand.Reader, 2048) }

// PrivateKeyPEM encodes k as PKCS#8 PEM, the form of apiclient_key.pem.
func PrivateKeyPEM(k *rsa.PrivateKey) (string, error) {
	der, err := x509.MarshalPKCS8PrivateKey(k)
	if err != nil {
		return "", err
	}
	return string(pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der})), nil
}

// PublicKeyPEM encodes k as PKIX PEM, the form of WeChat Pay's public key.
func PublicKeyPEM(k *rsa.PublicKey) (string, error) {
	der, err := x509.MarshalPKIXPublicKey(k)
	if err != nil {
		return "", err
	}
	return string(pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der})), nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic("wechatemu: random: " + err.Error())
	}
	return hex.EncodeToString(b)
}

// decodeStrict reads a JSON body into v, refusing unknown fields the way
// the gateway refuses a malformed request.
func decodeStrict(body []byte, v any) *apiError {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return errorf(http.StatusBadRequest, "PARAM_ERROR", "body does not match the API: %v", err)
	}
	return nil
}
