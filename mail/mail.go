// Package mail sends a paid order's codes to its buyer by email, over SMTP
// (github.com/wneessen/go-mail). It knows the server, the sender and the
// message; when to send, how often to try and what was sent is the
// ledger's business (domain/mail.go).
//
// A failed send says which of three things happened (see Outcome), since
// that decides what a retry may do: nothing was delivered, the server
// refused this message for good, or the server may have the message (the
// final reply to the message's end was lost). A refusal before any message
// (a 5xx to EHLO or AUTH: bad credentials, an address the server blocks)
// is not the message's: it is NotSent, and Error.ServerRefused tells it
// apart, since every other mail gets the same answer until the settings or
// the server are fixed.
package mail

import (
	"context"
	"crypto/tls"
	"embed"
	"errors"
	"fmt"
	htmltemplate "html/template"
	"net/mail"
	"net/textproto"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	texttemplate "text/template"
	"time"
	"unicode"
	"unicode/utf8"

	gomail "github.com/wneessen/go-mail"
)

// Server is an SMTP server as KAMI_SMTP_URL names it.
type Server struct {
	Host string
	Port int
	// Implicit is TLS from the first byte (smtps://, port 465 by
	// default); otherwise STARTTLS is required (smtp://, port 587): the
	// codes never cross the network in the clear.
	Implicit           bool
	Username, Password string
}

// ParseServer reads KAMI_SMTP_URL: smtp://user:pass@host:587 (STARTTLS,
// required) or smtps://user:pass@host:465 (implicit TLS). The user and
// password are optional; nothing else may be in the URL.
func ParseServer(raw string) (Server, error) {
	u, err := url.Parse(strings.TrimSpace(raw))
	if err != nil {
		return Server{}, errors.New("want a URL like smtp://user:pass@host:587 or smtps://user:pass@host:465")
	}
	var s Server
	switch u.Scheme {
	case "smtp":
		s.Port = 587
	case "smtps":
		s.Implicit, s.Port = true, 465
	default:
		return Server{}, errors.New("want smtp:// (STARTTLS) or smtps:// (implicit TLS)")
	}
	if u.Hostname() == "" {
		return Server{}, errors.New("the URL names no host")
	}
	if u.Path != "" && u.Path != "/" || u.RawQuery != "" || u.Fragment != "" {
		return Server{}, errors.New("want only scheme, user, password, host and port")
	}
	s.Host = u.Hostname()
	if p := u.Port(); p != "" {
		if s.Port, err = strconv.Atoi(p); err != nil || s.Port < 1 || s.Port > 65535 {
			return Server{}, errors.New("the port is not a number from 1 to 65535")
		}
	}
	if u.User != nil {
		s.Username = u.User.Username()
		s.Password, _ = u.User.Password()
	}
	return s, nil
}

// ParseFrom reads KAMI_MAIL_FROM: an address, optionally with a name
// ("Shop <codes@example.com>").
func ParseFrom(raw string) (*mail.Address, error) {
	a, err := mail.ParseAddress(strings.TrimSpace(raw))
	if err != nil {
		return nil, errors.New("want an address like codes@example.com or Shop <codes@example.com>")
	}
	return a, nil
}

// CheckShopName refuses a shop name that cannot stand in a subject line.
func CheckShopName(name string) error {
	if strings.TrimSpace(name) == "" || len(name) > 100 {
		return errors.New("want 1 to 100 bytes")
	}
	if strings.IndexFunc(name, unicode.IsControl) >= 0 {
		return errors.New("no control characters (line breaks) in a shop name")
	}
	return nil
}

// Config is what a Sender needs.
type Config struct {
	Server   Server
	From     *mail.Address
	ShopName string
	// Timeout bounds each step of the conversation with the server
	// (connect, each command, the message and its reply); default 30s.
	Timeout time.Duration
	// TLS, if set, is the TLS configuration to use (its ServerName is
	// filled in); nil: the system's roots. Tests give a pool that trusts
	// their own server's certificate: TLS is never skipped.
	TLS *tls.Config
}

// Sender sends order mails through one SMTP server. It is safe for
// concurrent use: each Send is its own connection.
type Sender struct {
	cfg Config
}

// New returns a Sender for cfg.
func New(cfg Config) (*Sender, error) {
	if cfg.Server.Host == "" || cfg.From == nil {
		return nil, errors.New("mail: a server and a From address are needed")
	}
	if err := CheckShopName(cfg.ShopName); err != nil {
		return nil, fmt.Errorf("mail: shop name: %w", err)
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 30 * time.Second
	}
	tc := &tls.Config{MinVersion: tls.VersionTLS12}
	if cfg.TLS != nil {
		tc = cfg.TLS.Clone()
	}
	tc.ServerName = cfg.Server.Host
	cfg.TLS = tc
	return &Sender{cfg: cfg}, nil
}

// Timeout is the longest one step of a send may take; a whole send takes
// at most a few of them (see AttemptBudget).
func (s *Sender) Timeout() time.Duration { return s.cfg.Timeout }

// AttemptBudget is the longest one Send can take: the connection, the
// greeting, EHLO, STARTTLS, AUTH, MAIL, RCPT, DATA, the message and its
// reply, each bounded by Timeout. An attempt still unfinished after it
// died with its process.
func (s *Sender) AttemptBudget() time.Duration { return 12 * s.cfg.Timeout }

// MessageIDDomain is the domain of the Message-IDs this sender writes: its
// From address's.
func (s *Sender) MessageIDDomain() string {
	_, domain, _ := strings.Cut(s.cfg.From.Address, "@")
	return domain
}

// Message is one order's codes for its buyer.
type Message struct {
	To string
	// MessageID is the Message-ID's left part (no brackets, no domain):
	// the same for every attempt at the same mail, so that a receiver that
	// got two copies (an attempt whose outcome was lost, then its retry)
	// can tell they are one.
	MessageID string
	OrderNo   string
	Product   string
	Quantity  int
	Codes     []string
}

// Outcome is what a failed send did.
type Outcome int

const (
	// NotSent: nothing was delivered (no connection, a 4xx, a 5xx before
	// any message, the link lost before the message was complete); trying
	// again is safe.
	NotSent Outcome = iota
	// Refused: the server refused this message for good (a 5xx to MAIL
	// FROM, RCPT TO, DATA or the message's end); trying again gets the
	// same answer.
	Refused
	// Uncertain: the whole message was handed over and the server's reply
	// to it was lost (a timeout, a reset). The server may have accepted it:
	// trying again may deliver a second copy.
	Uncertain
)

func (o Outcome) String() string {
	switch o {
	case Refused:
		return "refused"
	case Uncertain:
		return "uncertain"
	}
	return "not sent"
}

// Error is a failed send. Its text names the step and the server's answer,
// never the recipient or the message.
type Error struct {
	Outcome Outcome
	Code    int    // the server's reply code, 0 when there was none
	Detail  string // the step and the server's reply, bounded and printable
	// BeforeMessage: the failure came before any message was begun, while
	// connecting (TCP, TLS, the greeting, EHLO, STARTTLS, AUTH).
	BeforeMessage bool
}

func (e *Error) Error() string { return e.Outcome.String() + ": " + e.Detail }

// ServerRefused reports whether the server refused kami itself (a 5xx
// before any message: wrong credentials, a sender it blocks) rather than
// this message. Such a send is NotSent: it is no answer about the buyer's
// mail, and it ends when the settings or the server are fixed.
func (e *Error) ServerRefused() bool { return e.BeforeMessage && e.Code >= 500 }

// Send delivers m. It returns nil once the server accepted the message,
// or an *Error.
func (s *Sender) Send(ctx context.Context, m Message) error {
	msg, err := s.compose(m)
	if err != nil {
		return &Error{Outcome: Refused, Detail: "compose: " + err.Error()}
	}
	c, err := s.client()
	if err != nil {
		return &Error{Outcome: NotSent, Detail: "client: " + err.Error()}
	}
	conn, err := c.DialToSMTPClientWithContext(ctx)
	if err != nil {
		return dialError(err, m.To)
	}
	sendErr := c.SendWithSMTPClient(conn, msg)
	// The connection's QUIT is not part of the delivery: an error there
	// changes nothing about a message the server accepted.
	_ = c.CloseWithSMTPClient(conn)
	if msg.IsDelivered() {
		return nil // accepted; a failed RSET or QUIT after it does not matter
	}
	if sendErr == nil {
		return &Error{Outcome: NotSent, Detail: "the server did not confirm the message"}
	}
	return sendError(sendErr, m.To)
}

// client returns a go-mail client for one send.
func (s *Sender) client() (*gomail.Client, error) {
	srv := s.cfg.Server
	opts := []gomail.Option{gomail.WithPort(srv.Port), gomail.WithTimeout(s.cfg.Timeout),
		gomail.WithTLSConfig(s.cfg.TLS), gomail.WithHELO(s.MessageIDDomain())}
	if srv.Implicit {
		opts = append(opts, gomail.WithSSL())
	} else {
		opts = append(opts, gomail.WithTLSPolicy(gomail.TLSMandatory))
	}
	if srv.Username != "" {
		opts = append(opts, gomail.WithSMTPAuth(gomail.SMTPAuthAutoDiscover),
			gomail.WithUsername(srv.Username), gomail.WithPassword(srv.Password))
	}
	return gomail.NewClient(srv.Host, opts...)
}

// dialError is a failure before any message was begun: the connection,
// TLS, the greeting, EHLO, STARTTLS or AUTH. Nothing was sent, whatever
// the code: a 5xx there answers kami (its credentials, its address), not
// this message, and is NotSent (see Error.ServerRefused).
func dialError(err error, to string) error {
	return &Error{Outcome: NotSent, Code: replyCode(err), BeforeMessage: true, Detail: clean("connect: "+err.Error(), to)}
}

// sendError classifies go-mail's SendError. A 5xx is a refusal of this
// message only where it answers the message: MAIL FROM, RCPT TO, DATA or
// the message's end. Only the end of the message (closing the DATA
// writer: the final "." and its reply) can leave the server holding a
// message without kami knowing: a lost reply there is Uncertain. Every
// other failure is NotSent.
func sendError(err error, to string) *Error {
	var se *gomail.SendError
	if !errors.As(err, &se) {
		return &Error{Outcome: NotSent, Detail: clean(err.Error(), to)}
	}
	code := se.ErrorCode()
	detail := se.Reason.String()
	if text := serverText(err); text != "" {
		detail += ": " + text // the server's reply, its code first
	} else if code != 0 {
		detail += ": " + strconv.Itoa(code)
	}
	e := &Error{Outcome: NotSent, Code: code, Detail: clean(detail, to)}
	switch {
	case code >= 500 && answersMessage(se.Reason):
		e.Outcome = Refused
	case code >= 400:
		e.Outcome = NotSent
	case se.Reason == gomail.ErrSMTPDataClose:
		e.Outcome = Uncertain
	}
	return e
}

// answersMessage reports whether a step's reply is the server's answer
// about this message (its sender, its recipient, its content).
func answersMessage(r gomail.SendErrReason) bool {
	switch r {
	case gomail.ErrSMTPMailFrom, gomail.ErrSMTPRcptTo, gomail.ErrSMTPData, gomail.ErrSMTPDataClose:
		return true
	}
	return false
}

// replyCode is the server's reply code in a failure to connect (the
// greeting, EHLO, STARTTLS, AUTH), or 0 when the server did not answer.
func replyCode(err error) int {
	var te *textproto.Error
	if errors.As(err, &te) {
		return te.Code
	}
	return 0
}

// serverText is the server's own words from a SendError, without the
// recipients go-mail adds to its text (a buyer's address is not an error
// detail).
func serverText(err error) string {
	var se *gomail.SendError
	if !errors.As(err, &se) {
		return ""
	}
	text := err.Error()
	if i := strings.Index(text, ", affected recipient"); i >= 0 {
		text = text[:i]
	}
	if i := strings.Index(text, ", affected message ID"); i >= 0 {
		text = text[:i]
	}
	if _, after, ok := strings.Cut(text, ": "); ok {
		return after
	}
	return ""
}

// clean makes an error detail fit to log and store (last_error): the
// server's reply is whatever a hostile or broken server wrote. The
// recipient's address, in any case (a server may echo it in capitals), is
// replaced by "<buyer>"; invalid UTF-8, NUL and every other control or
// format character are dropped (line breaks and tabs become spaces), since
// a database refuses a NUL or invalid UTF-8 in text and a control
// character can forge a log line; and it is cut to 400 bytes at a
// character boundary.
func clean(s, to string) string {
	s = strings.Map(func(r rune) rune {
		switch {
		case r == '\n' || r == '\r' || r == '\t':
			return ' '
		case r == utf8.RuneError || unicode.In(r, unicode.Cc, unicode.Cf, unicode.Zl, unicode.Zp):
			return -1
		}
		return r
	}, s)
	// After the characters are dropped: none can split the address.
	if to != "" {
		s = regexp.MustCompile(`(?i)`+regexp.QuoteMeta(to)).ReplaceAllLiteralString(s, "<buyer>")
	}
	if len(s) > 400 {
		cut := 400
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut]
	}
	return s
}

// compose builds the message: a text part and an HTML alternative, both in
// Chinese and English.
func (s *Sender) compose(m Message) (*gomail.Msg, error) {
	text, html, err := render(s.cfg.ShopName, m)
	if err != nil {
		return nil, err
	}
	msg := gomail.NewMsg()
	msg.FromMailAddress(s.cfg.From)
	if err := msg.To(m.To); err != nil {
		return nil, errors.New("the buyer's address is not a mail address")
	}
	msg.SetMessageIDWithValue(m.MessageID + "@" + s.MessageIDDomain())
	msg.SetDate()
	msg.SetBulk()
	msg.Subject(fmt.Sprintf("[%s] 订单 %s 的卡密 / Your codes for order %s", s.cfg.ShopName, m.OrderNo, m.OrderNo))
	msg.SetBodyString(gomail.TypeTextPlain, text)
	msg.AddAlternativeString(gomail.TypeTextHTML, html)
	return msg, nil
}

//go:embed templates/*.tmpl
var templateFiles embed.FS

var (
	textTemplate = texttemplate.Must(texttemplate.ParseFS(templateFiles, "templates/codes.txt.tmpl"))
	// html/template escapes every value by its context: a product name is
	// the seller's input, a code the supplier's.
	htmlTemplate = htmltemplate.Must(htmltemplate.ParseFS(templateFiles, "templates/codes.html.tmpl"))
)

// view is what the templates see.
type view struct {
	Shop, OrderNo, Product string
	Quantity               int
	Codes                  []string
}

// render fills both templates for m.
func render(shop string, m Message) (text, html string, err error) {
	v := view{Shop: shop, OrderNo: m.OrderNo, Product: m.Product, Quantity: m.Quantity, Codes: m.Codes}
	var tb, hb strings.Builder
	if err := textTemplate.Execute(&tb, v); err != nil {
		return "", "", err
	}
	if err := htmlTemplate.Execute(&hb, v); err != nil {
		return "", "", err
	}
	return tb.String(), hb.String(), nil
}
