package graph_test

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/domain/domaintest"
	"kami/mail"
	"kami/mail/mailtest"
)

const orderMails = `query($no: String!) { orderMails(orderNo: $no) {
	id orderNo cause status attempts uncertainAttempts unreachedAttempts lastError nextAttemptAt sentAt requestedBy createdAt } }`

const resendOrderMail = `mutation($no: String!) { resendOrderMail(orderNo: $no) { id cause status requestedBy } }`

type mailAnswer struct {
	ID, OrderNo, Cause, Status                     string
	Attempts, UncertainAttempts, UnreachedAttempts int
	LastError                                      *string
	NextAttemptAt, SentAt                          *string
	RequestedBy                                    string
}

// mailer sends to a test SMTP server answering with answer.
func mailer(t *testing.T, b *bundle, answer mailtest.Answer) (*domain.Mailer, *mailtest.Server) {
	t.Helper()
	srv := mailtest.Start(t, func(int) mailtest.Answer { return answer })
	return mailerTo(t, b, srv), srv
}

// mailerTo sends to srv.
func mailerTo(t *testing.T, b *bundle, srv *mailtest.Server) *domain.Mailer {
	t.Helper()
	s, err := mail.New(srv.Config("Test Shop", 10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	return &domain.Mailer{Ledger: b.ledger, Sender: s, Log: quietLogger()}
}

func (b *bundle) mails(t *testing.T, orderNo string) []mailAnswer {
	t.Helper()
	var got struct{ OrderMails []mailAnswer }
	b.do(t, admin, orderMails, map[string]any{"no": orderNo}).decode(t, &got)
	return got.OrderMails
}

func TestOrderMailsAndResend(t *testing.T) {
	t.Parallel()
	b := setup(t, options{kind: dbtest.Postgres, ledger: domain.Config{Mail: true}})
	m, srv := mailer(t, b, mailtest.Accept)
	p := b.product(t, "5.00", 3)
	o := b.order(t, p, 1, "buyer@example.com")
	no := o.Order.OrderNo
	if got := b.mails(t, no); len(got) != 0 {
		t.Fatalf("mails before payment: %+v", got)
	}
	b.pay(t, no, "SB-1")
	got := b.mails(t, no)
	if len(got) != 1 || got[0].Status != "QUEUED" || got[0].Cause != "PAID" || got[0].NextAttemptAt == nil || got[0].SentAt != nil || got[0].RequestedBy != "system" {
		t.Fatalf("after payment: %+v", got)
	}
	id := mustID(t, got[0].ID)
	if _, err := m.Deliver(b.ctx, id); err != nil {
		t.Fatal(err)
	}
	if got = b.mails(t, no); got[0].Status != "SENT" || got[0].Attempts != 1 || got[0].SentAt == nil || got[0].LastError != nil || got[0].NextAttemptAt != nil {
		t.Fatalf("after delivery: %+v", got)
	}

	var resent struct{ ResendOrderMail mailAnswer }
	b.do(t, admin, resendOrderMail, map[string]any{"no": no}).decode(t, &resent)
	if r := resent.ResendOrderMail; r.Cause != "RESEND" || r.Status != "QUEUED" || r.RequestedBy != "admin" {
		t.Fatalf("resend: %+v", r)
	}
	if _, err := m.Deliver(b.ctx, mustID(t, resent.ResendOrderMail.ID)); err != nil {
		t.Fatal(err)
	}
	if got = b.mails(t, no); len(got) != 2 || got[0].Cause != "RESEND" || got[0].Status != "SENT" {
		t.Fatalf("after the resend: %+v", got)
	}
	rcv := srv.Received()
	if len(rcv) != 2 || rcv[0].MessageID == rcv[1].MessageID {
		t.Fatalf("server got %d messages (%+v); want 2 with their own Message-IDs", len(rcv), rcv)
	}
	var reveals struct {
		Reveals struct {
			Edges []struct {
				Node struct{ Channel, Actor string }
			}
		}
	}
	b.do(t, admin, `query($no: String!) { reveals(orderNo: $no) { edges { node { channel actor } } } }`, map[string]any{"no": no}).decode(t, &reveals)
	mailReveals := 0
	for _, e := range reveals.Reveals.Edges {
		if e.Node.Channel == "MAIL" && e.Node.Actor == "mail" {
			mailReveals++
		}
	}
	if mailReveals != 2 {
		t.Fatalf("reveals %+v, want 2 by mail", reveals)
	}

	// Admins only; a pending order, or one whose contact is no address,
	// is not mailed.
	b.do(t, anon, orderMails, map[string]any{"no": no}).wantCode(t, domain.EUNAUTH)
	b.do(t, anon, resendOrderMail, map[string]any{"no": no}).wantCode(t, domain.EUNAUTH)
	pending := b.order(t, p, 1, "other@example.com")
	b.do(t, admin, resendOrderMail, map[string]any{"no": pending.Order.OrderNo}).wantCode(t, domain.ECONFLICT)
	phone := b.order(t, p, 1, "13800138000")
	b.pay(t, phone.Order.OrderNo, "SB-2")
	b.do(t, admin, resendOrderMail, map[string]any{"no": phone.Order.OrderNo}).wantCode(t, domain.ECONFLICT)
	b.do(t, admin, orderMails, map[string]any{"no": "26120100000000000000"}).wantCode(t, domain.ENOTFOUND)
}

func TestOrderMailFailureShown(t *testing.T) {
	t.Parallel()
	b := setup(t, options{kind: dbtest.Postgres, ledger: domain.Config{Mail: true}})
	m, _ := mailer(t, b, mailtest.Refuse)
	p := b.product(t, "5.00", 1)
	o := b.order(t, p, 1, "buyer@example.com")
	b.pay(t, o.Order.OrderNo, "SB-1")
	got := b.mails(t, o.Order.OrderNo)
	if _, err := m.Deliver(b.ctx, mustID(t, got[0].ID)); err != nil {
		t.Fatal(err)
	}
	got = b.mails(t, o.Order.OrderNo)
	if got[0].Status != "FAILED" || got[0].LastError == nil || !strings.Contains(*got[0].LastError, "554") || got[0].Attempts != 1 {
		t.Fatalf("after a refusal: %+v", got)
	}
}

// TestOrderMailShowsUnreachedAttempts: attempts that reached no server kami
// could use (it offers no STARTTLS) are shown apart from the attempts at
// the message, so an admin sees that the mail still waits though its
// attempts outnumber the backoff's steps; once the server takes it, SENT,
// with the count kept.
func TestOrderMailShowsUnreachedAttempts(t *testing.T) {
	t.Parallel()
	b := setup(t, options{kind: dbtest.Postgres, ledger: domain.Config{Mail: true, MailBackoff: []time.Duration{time.Minute}}})
	clock := domaintest.NewClock(time.Now().UTC().Truncate(time.Second))
	b.ledger.Now = clock.Now
	m := mailerTo(t, b, mailtest.StartWithoutTLS(t, func(int) mailtest.Answer { return mailtest.Accept }))
	p := b.product(t, "5.00", 1)
	o := b.order(t, p, 1, "buyer@example.com")
	b.pay(t, o.Order.OrderNo, "SB-1")
	id := mustID(t, b.mails(t, o.Order.OrderNo)[0].ID)
	for i := 1; i <= 3; i++ {
		if _, err := m.Deliver(b.ctx, id); err != nil {
			t.Fatal(err)
		}
		got := b.mails(t, o.Order.OrderNo)[0]
		if got.Status != "QUEUED" || got.Attempts != i || got.UnreachedAttempts != i || got.UncertainAttempts != 0 || got.LastError == nil || got.NextAttemptAt == nil {
			t.Fatalf("after unreached attempt %d: %+v", i, got)
		}
		clock.Advance(time.Minute)
	}
	good, _ := mailer(t, b, mailtest.Accept)
	m.Sender = good.Sender
	if _, err := m.Deliver(b.ctx, id); err != nil {
		t.Fatal(err)
	}
	if got := b.mails(t, o.Order.OrderNo)[0]; got.Status != "SENT" || got.Attempts != 4 || got.UnreachedAttempts != 3 {
		t.Fatalf("once the server takes it: %+v", got)
	}
}

func TestResendOrderMailWhenMailIsOff(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	p := b.product(t, "5.00", 1)
	o := b.order(t, p, 1, "buyer@example.com")
	b.pay(t, o.Order.OrderNo, "SB-1")
	b.do(t, admin, resendOrderMail, map[string]any{"no": o.Order.OrderNo}).wantCode(t, domain.EUNAVAILABLE)
}

func mustID(t *testing.T, id string) int64 {
	t.Helper()
	n, err := strconv.ParseInt(id, 10, 64)
	if err != nil {
		t.Fatalf("id %q: %v", id, err)
	}
	return n
}
