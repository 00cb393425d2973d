package main

import (
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/domain/domaintest"
	"kami/mail/mailtest"
	"kami/providers/sandbox"
	"kami/queue/redistest"
)

func TestMailSettings(t *testing.T) {
	t.Parallel()
	c, err := loadConfig(env{}.get)
	if err != nil || c.Mail != nil {
		t.Fatalf("no KAMI_SMTP_URL: mail %+v, %v; want off", c.Mail, err)
	}
	c, err = loadConfig(env{"KAMI_SMTP_URL": "smtps://u:p@mail.example.com", "KAMI_MAIL_FROM": "Shop <codes@example.com>", "KAMI_SHOP_NAME": "小店"}.get)
	if err != nil || c.Mail == nil || !c.Mail.Server.Implicit || c.Mail.Server.Port != 465 || c.Mail.From.Address != "codes@example.com" || c.Mail.ShopName != "小店" || c.Mail.Timeout != 30*time.Second {
		t.Fatalf("mail settings %+v, %v", c.Mail, err)
	}
	for _, tc := range []struct {
		e    env
		name string
	}{
		{env{"KAMI_SMTP_URL": "smtp://mail.example.com"}, "KAMI_MAIL_FROM"},
		{env{"KAMI_SMTP_URL": "http://mail.example.com", "KAMI_MAIL_FROM": "codes@example.com"}, "KAMI_SMTP_URL"},
		{env{"KAMI_SMTP_URL": "smtp://mail.example.com", "KAMI_MAIL_FROM": "not an address"}, "KAMI_MAIL_FROM"},
		{env{"KAMI_SHOP_NAME": "a\nb"}, "KAMI_SHOP_NAME"},
		{env{"KAMI_SMTP_URL": "smtp://mail.example.com", "KAMI_MAIL_FROM": "codes@example.com", "KAMI_SMTP_TIMEOUT": "forever"}, "KAMI_SMTP_TIMEOUT"},
	} {
		if _, err := loadConfig(tc.e.get); err == nil || !strings.Contains(err.Error(), tc.name) {
			t.Errorf("%v: error %v does not name %s", tc.e, err, tc.name)
		}
	}
}

// TestPaidOrderMailedOnce runs the whole server with KAMI_SMTP_URL set on
// PostgreSQL and the machine's Redis: a sandbox payment over HTTP queues the
// mail, the mail worker sends it to the test SMTP server once with the
// codes, the reveal is recorded, /metrics counts it, and no log line holds
// a code or the buyer's address.
func TestPaidOrderMailedOnce(t *testing.T) {
	t.Parallel()
	srv := mailtest.Start(t, func(int) mailtest.Answer { return mailtest.Accept })
	rs := redistest.Open(t, redistest.Real)
	var logs domaintest.LogBuffer
	ta := newTestAppLogging(t, dbtest.Postgres, env{"KAMI_SMTP_URL": srv.URL(), "KAMI_MAIL_FROM": "codes@shop.example",
		"KAMI_SHOP_NAME": "Test Shop", "KAMI_REDIS_URL": rs.URL, "KAMI_REDIS_PREFIX": rs.Prefix(t)},
		func(c *Config) { c.Mail.TLS = srv.Config("", 0).TLS }, &logs)
	if err := ta.start(t.Context()); err != nil {
		t.Fatal(err)
	}
	p := ta.product(t, 1250, "SECRET-MAIL-A", "SECRET-MAIL-B")
	const contact = "mailbuyer@example.com"
	co, err := ta.shop.PlaceOrder(t.Context(), domain.PlaceOrderInput{ProductID: p.ID, Quantity: 2, Contact: contact, Provider: "sandbox"}, "", "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	h, b := sandbox.Signed("test-secret", sandbox.PaymentNotification(co.Order.OrderNo, "SB-MAIL", co.Order.AmountFen, time.Now()))
	if status, body := ta.post(t, "/webhooks/sandbox", h, b); status != 200 {
		t.Fatalf("pay: %d %s", status, body)
	}
	domaintest.Eventually(t, 30*time.Second, "the mail sent", func() bool {
		ms, err := ta.ledger.OrderMails(t.Context(), co.Order.OrderNo)
		return err == nil && len(ms) == 1 && ms[0].Status == domain.MailSent
	})
	got := srv.Received()
	if len(got) != 1 || got[0].To != contact {
		t.Fatalf("the server has %d messages (%+v), want 1 to the buyer", len(got), got)
	}
	for _, code := range []string{"SECRET-MAIL-A", "SECRET-MAIL-B"} {
		if !strings.Contains(string(got[0].Raw), code) {
			t.Errorf("the mail lacks %s", code)
		}
	}
	page, err := ta.ledger.ListReveals(t.Context(), co.Order.OrderNo, 0, 0, 10)
	if err != nil || len(page.Reveals) != 1 || page.Reveals[0].Channel != domain.RevealMail || page.Reveals[0].Actor != "mail" {
		t.Fatalf("reveals %+v, %v", page, err)
	}
	// The attempt is counted once its outcome is recorded, just after the
	// row reads SENT: wait for the count, not for the row.
	var metricsText []byte
	domaintest.Eventually(t, 30*time.Second, "/metrics counts the mail sent", func() bool {
		res, err := http.Get(ta.srv.URL + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		metricsText, _ = io.ReadAll(res.Body)
		res.Body.Close()
		return strings.Contains(string(metricsText), `kami_mail_attempts_total{outcome="sent"} 1`)
	})
	if !strings.Contains(string(metricsText), `kami_queue_backlog{queue="mail"}`) {
		t.Errorf("/metrics lacks the mail queue's backlog")
	}
	if !strings.Contains(string(metricsText), `kami_mail_waiting{last_outcome="unreachable"} 0`) {
		t.Errorf("/metrics does not say that no mail waits on an unreachable server")
	}
	if !strings.Contains(logs.String(), "order mail attempt") {
		t.Fatal("the attempt was not logged")
	}
	for _, line := range strings.Split(logs.String(), "\n") {
		for _, secret := range []string{"SECRET-MAIL", contact} {
			if strings.Contains(line, secret) {
				t.Errorf("a log line holds %s: %s", secret, line)
			}
		}
	}
}

// TestMailWaitingOnUnreachableServerExported runs the whole server with
// KAMI_SMTP_URL naming a server kami cannot use (it offers no STARTTLS):
// the paid order's mail waits, and /metrics says so in
// kami_mail_waiting{last_outcome="unreachable"}, the gauge the
// KamiMailServerUnreachable alert reads.
func TestMailWaitingOnUnreachableServerExported(t *testing.T) {
	t.Parallel()
	srv := mailtest.StartWithoutTLS(t, func(int) mailtest.Answer { return mailtest.Accept })
	rs := redistest.Open(t, redistest.Real)
	ta := newTestAppLogging(t, dbtest.Postgres, env{"KAMI_SMTP_URL": srv.URL(), "KAMI_MAIL_FROM": "codes@shop.example",
		"KAMI_SHOP_NAME": "Test Shop", "KAMI_REDIS_URL": rs.URL, "KAMI_REDIS_PREFIX": rs.Prefix(t)}, nil, &domaintest.LogBuffer{})
	if err := ta.start(t.Context()); err != nil {
		t.Fatal(err)
	}
	co := ta.placeFor(t, ta.product(t, 1250, "SECRET-MAIL-C"), "waiting@example.com")
	ta.paySandbox(t, co.Order, "SB-WAIT")
	domaintest.Eventually(t, 30*time.Second, "/metrics counts the mail waiting on an unreachable server", func() bool {
		return strings.Contains(ta.metricsText(t), `kami_mail_waiting{last_outcome="unreachable"} 1`)
	})
	ms, err := ta.ledger.OrderMails(t.Context(), co.Order.OrderNo)
	if err != nil || len(ms) != 1 || ms[0].Status == domain.MailSent || ms[0].Status == domain.MailFailed || ms[0].Unreached < 1 || srv.Attempts() != 0 {
		t.Fatalf("mails %+v, %v, %d messages begun; want one waiting, unreached", ms, err, srv.Attempts())
	}
}
