// Package mailtest runs a real SMTP server (github.com/emersion/go-smtp)
// inside a test process, with STARTTLS under a certificate of its own that
// the test's client trusts, and lets the test say how it answers each
// message: accept, refuse, refuse for now, or take it and never answer.
package mailtest

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"io"
	"math/big"
	"net"
	"net/mail"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/emersion/go-sasl"
	smtp "github.com/emersion/go-smtp"

	kmail "kami/mail"
)

// Answer is how the server answers one message (the n-th DATA it gets,
// counting from 1).
type Answer int

const (
	Accept   Answer = iota // 250: stored and confirmed
	Refuse                 // 554: refused for good
	TryLater               // 451: refused for now, nothing stored
	// Stall stores the message and then never replies to its end: the
	// client's wait for the reply runs out. The message is kept: a real
	// server that stalls like this has it, and so does the buyer.
	Stall
	// StallBeforeData never answers the MAIL command: the client gives up
	// before the message was sent, and nothing is stored.
	StallBeforeData
	// RefuseHostile is a 554 to RCPT TO whose text is what a hostile or
	// broken server may write: the recipient in capitals, a NUL, invalid
	// UTF-8, a terminal escape, a line break.
	RefuseHostile
)

// HostileText is the text of RefuseHostile's reply for recipient to.
func HostileText(to string) string {
	return "<" + strings.ToUpper(to) + "> no\x00such\xff\xfe user \x1b[31mred\x1b[0m\rforged: line\u202e"
}

// Gate is how the server answers a connection before any message.
type Gate int

const (
	Open Gate = iota
	// RefuseHello answers EHLO and HELO with 554: the server will not
	// talk to this client.
	RefuseHello
	// RefuseAuth answers AUTH with 535 5.7.8: the credentials are wrong.
	RefuseAuth
)

// Received is one message the server stored.
type Received struct {
	From, To  string
	MessageID string
	Raw       []byte
}

// Server is a running test SMTP server.
type Server struct {
	Host string
	Port int
	// Roots trusts the server's certificate.
	Roots    *x509.CertPool
	implicit bool

	mu       sync.Mutex
	answer   func(n int) Answer
	gate     func(n int) Gate
	conns    map[*smtp.Conn]Gate
	auths    int // AUTH commands answered
	attempts int // messages (MAIL commands) begun
	got      []Received
	changed  chan struct{} // closed and replaced on every change
	release  chan struct{} // closed at cleanup: stalled sessions end
}

// Start starts a server on 127.0.0.1 that offers STARTTLS and answers the
// n-th message (counting MAIL commands from 1) with answer(n). It stops at
// the test's end.
func Start(t testing.TB, answer func(n int) Answer) *Server {
	t.Helper()
	return start(t, answer, startTLS)
}

// How a server offers TLS.
const (
	startTLS = iota
	implicitTLS
	noTLS
)

// StartImplicit is Start for a server that speaks TLS from the first byte
// (smtps).
func StartImplicit(t testing.TB, answer func(n int) Answer) *Server {
	t.Helper()
	return start(t, answer, implicitTLS)
}

// StartWithoutTLS is Start for a server that offers no TLS at all: a
// client that requires it must not send.
func StartWithoutTLS(t testing.TB, answer func(n int) Answer) *Server {
	t.Helper()
	return start(t, answer, noTLS)
}

func start(t testing.TB, answer func(n int) Answer, mode int) *Server {
	t.Helper()
	cert, roots := selfSigned(t)
	s := &Server{Roots: roots, answer: answer, changed: make(chan struct{}), release: make(chan struct{}),
		gate: func(int) Gate { return Open }, conns: map[*smtp.Conn]Gate{}}
	srv := smtp.NewServer(smtp.BackendFunc(s.newSession))
	srv.Domain = "localhost"
	if mode != noTLS {
		srv.TLSConfig = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	}
	srv.ErrorLog = discardLog{}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if mode == implicitTLS {
		l = tls.NewListener(l, srv.TLSConfig)
	}
	s.implicit = mode == implicitTLS
	addr := l.Addr().(*net.TCPAddr)
	s.Host, s.Port = "127.0.0.1", addr.Port
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() {
		close(s.release)
		_ = srv.Close()
	})
	return s
}

// SetGate makes the server answer its n-th connection (counting from 1,
// from now on: the connections that said EHLO) as gate(n) says, before
// any message.
func (s *Server) SetGate(gate func(n int) Gate) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.gate = gate
	s.conns = map[*smtp.Conn]Gate{}
}

// Auths is how many AUTH commands the server answered, accepted or not.
func (s *Server) Auths() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.auths
}

// newSession starts a session at EHLO (or HELO, after a refused EHLO: the
// same connection, answered the same way).
func (s *Server) newSession(c *smtp.Conn) (smtp.Session, error) {
	s.mu.Lock()
	g, ok := s.conns[c]
	if !ok {
		g = s.gate(len(s.conns) + 1)
		s.conns[c] = g
	}
	s.mu.Unlock()
	if g == RefuseHello {
		return nil, &smtp.SMTPError{Code: 554, EnhancedCode: smtp.EnhancedCode{5, 7, 1}, Message: "no service for you"}
	}
	return &session{s: s, gate: g}, nil
}

// Config is a mail.Config that sends to s over STARTTLS, trusting its
// certificate, with each step bounded by timeout.
func (s *Server) Config(shop string, timeout time.Duration) kmail.Config {
	from, _ := mail.ParseAddress("Test Shop <codes@shop.example>")
	return kmail.Config{Server: kmail.Server{Host: s.Host, Port: s.Port, Implicit: s.implicit}, From: from, ShopName: shop,
		Timeout: timeout, TLS: &tls.Config{RootCAs: s.Roots, MinVersion: tls.VersionTLS12}}
}

// URL is KAMI_SMTP_URL for s.
func (s *Server) URL() string {
	scheme := "smtp://"
	if s.implicit {
		scheme = "smtps://"
	}
	return scheme + net.JoinHostPort(s.Host, strconv.Itoa(s.Port))
}

// Received returns the messages stored so far.
func (s *Server) Received() []Received {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Received(nil), s.got...)
}

// Attempts is how many messages were begun (MAIL commands).
func (s *Server) Attempts() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.attempts
}

// Changed returns a channel closed at the next message begun or stored.
func (s *Server) Changed() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.changed
}

func (s *Server) note(f func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f()
	close(s.changed)
	s.changed = make(chan struct{})
}

type session struct {
	s      *Server
	gate   Gate
	from   string
	to     string
	answer Answer
}

func (x *session) Reset()        {}
func (x *session) Logout() error { return nil }

// AuthMechanisms offers PLAIN (over TLS only, as go-smtp requires); a
// client without credentials does not use it.
func (x *session) AuthMechanisms() []string { return []string{sasl.Plain} }

// Auth accepts any credentials unless the connection's gate refuses them.
func (x *session) Auth(string) (sasl.Server, error) {
	return sasl.NewPlainServer(func(_, _, _ string) error {
		x.s.note(func() { x.s.auths++ })
		if x.gate == RefuseAuth {
			return &smtp.SMTPError{Code: 535, EnhancedCode: smtp.EnhancedCode{5, 7, 8}, Message: "authentication credentials invalid"}
		}
		return nil
	}), nil
}

func (x *session) Mail(from string, _ *smtp.MailOptions) error {
	x.s.note(func() {
		x.s.attempts++
		x.answer = x.s.answer(x.s.attempts)
	})
	x.from = from
	if x.answer == StallBeforeData {
		<-x.s.release
		return errors.New("released")
	}
	return nil
}

func (x *session) Rcpt(to string, _ *smtp.RcptOptions) error {
	x.to = to
	if x.answer == RefuseHostile {
		return &smtp.SMTPError{Code: 554, EnhancedCode: smtp.EnhancedCode{5, 1, 1}, Message: HostileText(to)}
	}
	return nil
}

func (x *session) Data(r io.Reader) error {
	raw, err := io.ReadAll(r)
	if err != nil {
		return err
	}
	switch x.answer {
	case Refuse:
		// Real servers name the recipient they refuse.
		return &smtp.SMTPError{Code: 554, EnhancedCode: smtp.EnhancedCode{5, 7, 1}, Message: "<" + x.to + ">: refused by the test server"}
	case TryLater:
		return &smtp.SMTPError{Code: 451, EnhancedCode: smtp.EnhancedCode{4, 3, 0}, Message: "try again later"}
	}
	msg, err := mail.ReadMessage(bytes.NewReader(raw))
	id := ""
	if err == nil {
		id = msg.Header.Get("Message-Id")
	}
	x.s.note(func() { x.s.got = append(x.s.got, Received{From: x.from, To: x.to, MessageID: id, Raw: raw}) })
	if x.answer == Stall {
		<-x.s.release
	}
	return nil
}

// selfSigned makes a certificate for 127.0.0.1 and a pool that trusts it.
func selfSigned(t testing.TB) (tls.Certificate, *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kami mail test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, DNSNames: []string{"localhost"},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IsCA: true, BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(leaf)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, pool
}

type discardLog struct{}

func (discardLog) Printf(string, ...any) {}
func (discardLog) Println(...any)        {}
