// Package alipayemu is an Alipay open-API gateway in a box, for tests. It is
// strict where the real gateway is strict, because it is what proves the
// alipay adapter right: every request must carry the configured app_id and a
// valid RSA2 signature by the app's key, every answer is signed with the
// emulator's own "Alipay" key the way Alipay signs (the text of the
// xxx_response object), and business failures come back in Alipay's form
// (code 40004, sub_code ACQ.*).
//
// It keeps trades by out_trade_no and refunds by out_request_no, injects
// faults per operation (see fault.Fault and the extra faults below),
// and builds the asynchronous notifications the gateway would post: genuine,
// forged (signed by another key) and naming another app.
//
// Serve it with httptest.NewServer(srv) and point the adapter's Gateway at
// the server's URL.
package alipayemu

import (
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"sync"
	"time"

	"kami/providers/fault"
)

// Faults beyond package fault's, for the adapter's own tests.
const (
	// FaultSystemError answers a signed ACQ.SYSTEM_ERROR (code 40004):
	// Alipay's "try again", the outcome unknown.
	FaultSystemError fault.Fault = "system-error"
	// FaultUnknownError answers code 20000, sub_code isp.unknow-error.
	FaultUnknownError fault.Fault = "unknown-error"
	// FaultBadSignature does the work and answers success signed with a
	// key that is not the gateway's.
	FaultBadSignature fault.Fault = "bad-signature"
	// FaultGarbage answers HTTP 200 with a body that is not Alipay JSON.
	FaultGarbage fault.Fault = "garbage"
)

// DefaultAppID is the app id an emulator serves when Options.AppID is empty.
const DefaultAppID = "2021000000000001"

// OtherAppID is the app id of notifications built by OtherApp.
const OtherAppID = "2021000000009999"

// SellerID is the seller_id (the merchant's Alipay user id) of every
// notification the emulator sends.
const SellerID = "2088101106499364"

// Options configure an emulator. Zero values give working defaults.
type Options struct {
	AppID string
	// AppPublicKey verifies requests. Nil: the emulator makes an app key
	// pair and hands the private half out through AppPrivateKeyPEM.
	AppPublicKey *rsa.PublicKey
	// GatewayKey signs answers and notifications. Nil: generated.
	GatewayKey *rsa.PrivateKey
	// ForgeKey signs forgeries (Forge, FaultBadSignature); it must not be
	// GatewayKey. Nil: generated on first use.
	ForgeKey *rsa.PrivateKey
	// Hold is how long a timeout fault keeps a request when the client
	// does not give up first. Default 10s.
	Hold time.Duration
	// Slow is the delay of FaultSlow. Default 200ms.
	Slow time.Duration
	// Now is the gateway's clock. Default time.Now.
	Now func() time.Time
	// EarlyStatements publishes a day's bill as soon as it is asked for,
	// with the books so far, instead of once the day is over (see
	// statement.go): tests then need not wait for tomorrow.
	EarlyStatements bool
	// RefundProcessing makes new refunds slow, as a refund to a bank card
	// is: the refund call accepts them with fund_change "N" (no money moved
	// yet) and the refund query does not list them (no refund_status
	// REFUND_SUCCESS) until FinishRefund.
	RefundProcessing bool
}

// Server is the emulated gateway. It is an http.Handler; all its methods
// are safe for concurrent use.
type Server struct {
	appID      string
	appPub     *rsa.PublicKey
	appPrivPEM string
	key        *rsa.PrivateKey
	hold, slow time.Duration
	now        func() time.Time
	early      bool // Options.EarlyStatements
	slowRefund bool // Options.RefundProcessing

	forgeOnce sync.Once
	forgeKey  *rsa.PrivateKey

	faults fault.Table // injected faults, by op

	mu      sync.Mutex
	seq     int64
	trades  map[string]*trade  // by out_trade_no
	byNo    map[string]*trade  // by trade_no
	refunds map[string]*refund // by out_request_no
	calls   map[string]int     // refund calls by out_request_no
	methods map[string]int     // verified requests by method
	// billLinks are the bill download addresses handed out, by token.
	billLinks map[string]billLink
}

type trade struct {
	outTradeNo, tradeNo, subject string
	totalFen, refundedFen        int64
	status                       string
	created, paidAt              time.Time
	expire                       time.Time // zero: none
	qrCode                       string
	payNotice                    []byte // the payment notification, resent as is
	closed                       bool   // closed before payment
}

type refund struct {
	outRequestNo string
	trade        *trade
	fen          int64
	at           time.Time
	notifyID     string
	refundedTill int64 // trade's refunded total right after this refund
	processing   bool  // accepted, not finished (Options.RefundProcessing)
}

// Trade states, as Alipay names them.
const (
	statusWait     = "WAIT_BUYER_PAY"
	statusSuccess  = "TRADE_SUCCESS"
	statusFinished = "TRADE_FINISHED"
	statusClosed   = "TRADE_CLOSED"
)

// New makes an emulator. Generating keys is the only thing that can fail.
func New(opts Options) (*Server, error) {
	s := &Server{
		appID:      opts.AppID,
		appPub:     opts.AppPublicKey,
		key:        opts.GatewayKey,
		forgeKey:   opts.ForgeKey,
		hold:       opts.Hold,
		slow:       opts.Slow,
		now:        opts.Now,
		early:      opts.EarlyStatements,
		slowRefund: opts.RefundProcessing,
		trades:     map[string]*trade{},
		byNo:       map[string]*trade{},
		refunds:    map[string]*refund{},
		calls:      map[string]int{},
		methods:    map[string]int{},
	}
	if s.appID == "" {
		s.appID = DefaultAppID
	}
	if s.hold <= 0 {
		s.hold = 10 * time.Second
	}
	if s.slow <= 0 {
		s.slow = 200 * time.Millisecond
	}
	if s.now == nil {
		s.now = time.Now
	}
	var err error
	if s.key == nil {
		if s.key, err = rsa.GenerateKey(rand.Reader, 2048); err != nil {
			return nil, fmt.Errorf("alipayemu: gateway key: %w", err)
		}
	}
	if s.forgeKey != nil && s.forgeKey.Equal(s.key) {
		return nil, fmt.Errorf("alipayemu: ForgeKey is the gateway key")
	}
	if s.appPub == nil {
		appKey, err := rsa.GenerateKey(rand.Reader, 2048)
		if err != nil {
			return nil, fmt.Errorf("alipayemu: app key: %w", err)
		}
		s.appPub = &appKey.PublicKey
		s.appPrivPEM = string(pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(appKey)}))
	}
	return s, nil
}

// AppID is the app id the emulator serves.
func (s *Server) AppID() string { return s.appID }

// PublicKeyPEM is the gateway's ("Alipay's") public key, PKIX PEM: what the
// adapter's AlipayPublicKey must be.
func (s *Server) PublicKeyPEM() string {
	der, err := x509.MarshalPKIXPublicKey(&s.key.PublicKey)
	if err != nil {
		panic(err) // an RSA key always marshals
	}
	return string(pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der}))
}

// AppPrivateKeyPEM is the app key the emulator made when Options gave no
// AppPublicKey; empty otherwise.
func (s *Server) AppPrivateKeyPEM() string { return s.appPrivPEM }

// InjectFault makes the next n calls of op fail with f; n <= 0 until it is
// cleared with fault.None.
func (s *Server) InjectFault(op fault.Op, f fault.Fault, n int) {
	s.faults.Inject(op, f, n)
}

// Refunded is what the emulator refunded under refundNo and how many
// verified refund calls named it (faulted ones included).
func (s *Server) Refunded(refundNo string) (fen int64, calls int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if rf, ok := s.refunds[refundNo]; ok {
		fen = rf.fen
	}
	return fen, s.calls[refundNo]
}

// FinishRefund finishes a refund left processing (Options.RefundProcessing):
// from now on the refund query lists it as REFUND_SUCCESS.
func (s *Server) FinishRefund(refundNo string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	rf, ok := s.refunds[refundNo]
	if !ok {
		return fmt.Errorf("alipayemu: no refund %q", refundNo)
	}
	rf.processing = false
	return nil
}

// Calls is how many verified requests named method (e.g. "alipay.trade.query").
func (s *Server) Calls(method string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.methods[method]
}

// TradeView is a trade as the emulator holds it.
type TradeView struct {
	OutTradeNo, TradeNo, Status string
	TotalFen, RefundedFen       int64
	PaidAt, Expire              time.Time
}

// Trade reports the trade for orderNo.
func (s *Server) Trade(orderNo string) (TradeView, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	t, ok := s.trades[orderNo]
	if !ok {
		return TradeView{}, false
	}
	s.expireLocked(t)
	return TradeView{OutTradeNo: t.outTradeNo, TradeNo: t.tradeNo, Status: t.status,
		TotalFen: t.totalFen, RefundedFen: t.refundedFen, PaidAt: t.paidAt, Expire: t.expire}, true
}

// newTradeLocked creates and records a trade.
func (s *Server) newTradeLocked(outTradeNo, subject string, fen int64) *trade {
	s.seq++
	now := s.now()
	t := &trade{
		outTradeNo: outTradeNo,
		tradeNo:    fmt.Sprintf("%s22001%011d", now.In(beijing).Format("20060102"), s.seq),
		subject:    subject,
		totalFen:   fen,
		status:     statusWait,
		created:    now,
	}
	s.trades[outTradeNo] = t
	s.byNo[t.tradeNo] = t
	return t
}

// expireLocked closes an unpaid trade whose time_expire has passed, as the
// gateway does.
func (s *Server) expireLocked(t *trade) {
	if t.status == statusWait && !t.expire.IsZero() && s.now().After(t.expire) {
		t.status, t.closed = statusClosed, true
	}
}

func randomID(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err) // crypto/rand does not fail
	}
	return hex.EncodeToString(b)
}

// beijing is the gateway's zone; China has no DST, so a fixed zone is exact.
var beijing = time.FixedZone("CST", 8*3600)

const alipayTime = "2006-01-02 15:04:05"
