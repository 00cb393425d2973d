package mail_test

import (
	"context"
	"errors"
	"io"
	"mime"
	"mime/multipart"
	"net"
	netmail "net/mail"
	"strings"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"

	"kami/mail"
	"kami/mail/mailtest"
)

func sender(t *testing.T, srv *mailtest.Server, timeout time.Duration) *mail.Sender {
	t.Helper()
	s, err := mail.New(srv.Config("卡密小店 <Shop>", timeout))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func message() mail.Message {
	return mail.Message{To: "buyer@example.com", MessageID: "kami-mail-1.2026120100000001", OrderNo: "2026120100000001",
		Product: `<script>alert("x")</script> & 礼品卡`, Quantity: 2, Codes: []string{"CODE-<1>", "CODE-2&"}}
}

// parts returns the text and HTML parts of a received message.
func parts(t *testing.T, raw []byte) (text, html string) {
	t.Helper()
	m, err := netmail.ReadMessage(strings.NewReader(string(raw)))
	if err != nil {
		t.Fatal(err)
	}
	_, params, err := mime.ParseMediaType(m.Header.Get("Content-Type"))
	if err != nil {
		t.Fatal(err)
	}
	r := multipart.NewReader(m.Body, params["boundary"])
	for {
		p, err := r.NextPart() // decodes quoted-printable
		if errors.Is(err, io.EOF) {
			return text, html
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(p)
		if err != nil {
			t.Fatal(err)
		}
		if strings.HasPrefix(p.Header.Get("Content-Type"), "text/html") {
			html = string(b)
		} else {
			text = string(b)
		}
	}
}

func TestSendDeliversCodesInTextAndEscapedHTML(t *testing.T) {
	t.Parallel()
	srv := mailtest.Start(t, func(int) mailtest.Answer { return mailtest.Accept })
	if err := sender(t, srv, 10*time.Second).Send(context.Background(), message()); err != nil {
		t.Fatal(err)
	}
	got := srv.Received()
	if len(got) != 1 {
		t.Fatalf("server stored %d messages, want 1", len(got))
	}
	if got[0].To != "buyer@example.com" || got[0].MessageID != "<kami-mail-1.2026120100000001@shop.example>" {
		t.Fatalf("to %q, Message-ID %q", got[0].To, got[0].MessageID)
	}
	text, html := parts(t, got[0].Raw)
	for _, want := range []string{"CODE-<1>", "CODE-2&", "2026120100000001", `<script>alert("x")</script> & 礼品卡`, "卡密小店 <Shop>", "卡密如下", "Your codes"} {
		if !strings.Contains(text, want) {
			t.Errorf("text part lacks %q:\n%s", want, text)
		}
	}
	for _, want := range []string{"CODE-&lt;1&gt;", "CODE-2&amp;", "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt; &amp; 礼品卡", "卡密小店 &lt;Shop&gt;", "卡密如下", "Your codes"} {
		if !strings.Contains(html, want) {
			t.Errorf("HTML part lacks %q:\n%s", want, html)
		}
	}
	if strings.Contains(html, "<script>") || strings.Contains(html, "CODE-<1>") {
		t.Errorf("HTML part holds unescaped seller input:\n%s", html)
	}
}

func TestSendOutcomes(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		answer mailtest.Answer
		want   mail.Outcome
		stored int
	}{
		{"refused for good", mailtest.Refuse, mail.Refused, 0},
		{"refused for now", mailtest.TryLater, mail.NotSent, 0},
		{"stalled before the message", mailtest.StallBeforeData, mail.NotSent, 0},
		{"stalled after the message", mailtest.Stall, mail.Uncertain, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := mailtest.Start(t, func(int) mailtest.Answer { return tc.answer })
			err := sender(t, srv, time.Second).Send(context.Background(), message())
			var me *mail.Error
			if !errors.As(err, &me) || me.Outcome != tc.want {
				t.Fatalf("Send = %v, want outcome %v", err, tc.want)
			}
			if strings.Contains(me.Error(), "buyer@example.com") || strings.Contains(me.Error(), "CODE-") {
				t.Fatalf("error text names the buyer or a code: %v", me)
			}
			if n := len(srv.Received()); n != tc.stored {
				t.Fatalf("server stored %d messages, want %d", n, tc.stored)
			}
		})
	}
}

func TestSendImplicitTLS(t *testing.T) {
	t.Parallel()
	srv := mailtest.StartImplicit(t, func(int) mailtest.Answer { return mailtest.Accept })
	if err := sender(t, srv, 10*time.Second).Send(context.Background(), message()); err != nil {
		t.Fatal(err)
	}
	if n := len(srv.Received()); n != 1 {
		t.Fatalf("server stored %d messages, want 1", n)
	}
}

func TestSendRequiresTLS(t *testing.T) {
	t.Parallel()
	srv := mailtest.Start(t, func(int) mailtest.Answer { return mailtest.Accept })
	cfg := srv.Config("Shop", 5*time.Second)
	cfg.TLS = nil // the system's roots do not trust the test server
	s, err := mail.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	var me *mail.Error
	if err := s.Send(context.Background(), message()); !errors.As(err, &me) || me.Outcome != mail.NotSent {
		t.Fatalf("Send to an untrusted server = %v, want not sent", err)
	}
	if srv.Attempts() != 0 {
		t.Fatal("a message was begun over an untrusted connection")
	}
	plain := mailtest.StartWithoutTLS(t, func(int) mailtest.Answer { return mailtest.Accept })
	if err := sender(t, plain, 5*time.Second).Send(context.Background(), message()); !errors.As(err, &me) || me.Outcome != mail.NotSent {
		t.Fatalf("Send to a server without STARTTLS = %v, want not sent", err)
	}
	if plain.Attempts() != 0 {
		t.Fatal("a message was begun in the clear")
	}
}

func TestParseServer(t *testing.T) {
	t.Parallel()
	for raw, want := range map[string]mail.Server{
		"smtp://user:pa%40ss@mail.example.com:2587": {Host: "mail.example.com", Port: 2587, Username: "user", Password: "pa@ss"},
		"smtp://mail.example.com":                   {Host: "mail.example.com", Port: 587},
		"smtps://u:p@mail.example.com":              {Host: "mail.example.com", Port: 465, Implicit: true, Username: "u", Password: "p"},
	} {
		got, err := mail.ParseServer(raw)
		if err != nil || got != want {
			t.Errorf("ParseServer(%q) = %+v, %v; want %+v", raw, got, err, want)
		}
	}
	for _, raw := range []string{"http://mail.example.com", "smtp://", "smtp://h:0", "smtp://h:99999", "smtp://h/path", "smtp://h?insecure=1", "mail.example.com"} {
		if _, err := mail.ParseServer(raw); err == nil {
			t.Errorf("ParseServer(%q) accepted", raw)
		}
	}
	if err := mail.CheckShopName("a\r\nBcc: x@example.com"); err == nil {
		t.Error("a shop name with a line break was accepted")
	}
}

// TestSendRefusalBeforeMessageIsNotSent: a 5xx to EHLO or to AUTH (a wrong
// password) refuses kami, not the buyer's mail: nothing was sent, the
// send is NotSent (tried again later) and says the server refused.
func TestSendRefusalBeforeMessageIsNotSent(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		gate mailtest.Gate
		code int
	}{"EHLO 554": {mailtest.RefuseHello, 554}, "AUTH 535": {mailtest.RefuseAuth, 535}} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			srv := mailtest.Start(t, func(int) mailtest.Answer { return mailtest.Accept })
			srv.SetGate(func(int) mailtest.Gate { return tc.gate })
			cfg := srv.Config("Shop", 10*time.Second)
			cfg.Server.Username, cfg.Server.Password = "kami", "old password"
			s, err := mail.New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			err = s.Send(context.Background(), message())
			var me *mail.Error
			if !errors.As(err, &me) || me.Outcome != mail.NotSent || !me.ServerRefused() || me.Code != tc.code {
				t.Fatalf("Send = %#v, want not sent, refused by the server with %d", err, tc.code)
			}
			if srv.Attempts() != 0 || len(srv.Received()) != 0 {
				t.Fatal("a message was begun")
			}
			if tc.gate == mailtest.RefuseAuth && srv.Auths() != 1 {
				t.Fatalf("%d AUTH commands, want 1", srv.Auths())
			}
		})
	}
	t.Run("greeting 554", func(t *testing.T) {
		t.Parallel()
		// go-smtp always greets with 220: a listener that says 554 and
		// hangs up, as a server refusing the client's address does.
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = l.Close() })
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				_, _ = io.WriteString(c, "554 5.7.1 no SMTP service here\r\n")
				_ = c.Close()
			}
		}()
		s, err := mail.New(mail.Config{Server: mail.Server{Host: "127.0.0.1", Port: l.Addr().(*net.TCPAddr).Port},
			From: &netmail.Address{Address: "codes@shop.example"}, ShopName: "Shop", Timeout: 10 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		var me *mail.Error
		if err := s.Send(context.Background(), message()); !errors.As(err, &me) || me.Outcome != mail.NotSent || !me.ServerRefused() || me.Code != 554 {
			t.Fatalf("Send = %#v, want not sent, refused by the server with 554", err)
		}
	})
	t.Run("a refusal of the message is not the server's", func(t *testing.T) {
		t.Parallel()
		srv := mailtest.Start(t, func(int) mailtest.Answer { return mailtest.Refuse })
		var me *mail.Error
		if err := sender(t, srv, 10*time.Second).Send(context.Background(), message()); !errors.As(err, &me) || me.Outcome != mail.Refused || me.ServerRefused() {
			t.Fatalf("Send = %#v, want refused, not by the server", err)
		}
	})
}

// TestSendCleansServerText: a hostile server's reply (NUL, invalid UTF-8,
// escapes, the recipient in capitals) becomes printable UTF-8 without the
// buyer's address, fit to store and log.
func TestSendCleansServerText(t *testing.T) {
	t.Parallel()
	srv := mailtest.Start(t, func(int) mailtest.Answer { return mailtest.RefuseHostile })
	m := message()
	m.To = "Buyer@Example.com"
	err := sender(t, srv, 10*time.Second).Send(context.Background(), m)
	var me *mail.Error
	if !errors.As(err, &me) || me.Outcome != mail.Refused || me.Code != 554 {
		t.Fatalf("Send = %#v, want refused with 554", err)
	}
	d := me.Detail
	if !utf8.ValidString(d) || strings.ContainsFunc(d, func(r rune) bool { return unicode.IsControl(r) || unicode.Is(unicode.Cf, r) }) {
		t.Fatalf("detail %q holds invalid UTF-8 or control characters", d)
	}
	if strings.Contains(strings.ToLower(d), "buyer@example.com") || !strings.Contains(d, "<buyer>") || !strings.Contains(d, "red") {
		t.Fatalf("detail %q: want the server's words, the buyer's address redacted", d)
	}
}
