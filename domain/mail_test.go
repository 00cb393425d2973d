package domain_test

import (
	"context"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/mail"
	"kami/mail/mailtest"
)

// mailBackoff is the tests' wait between attempts; the test clock moves
// past it.
var mailBackoff = []time.Duration{time.Minute, time.Minute, time.Minute}

// mailSetup is a ledger with mail on, a test SMTP server answering with
// answer, and a Mailer sending to it with each SMTP step bounded by
// timeout.
func mailSetup(t *testing.T, db *bun.DB, answer func(n int) mailtest.Answer, timeout time.Duration) (*bundle, *mailtest.Server, *domain.Mailer) {
	t.Helper()
	b := setup(t, db, domain.Config{Mail: true, MailBackoff: mailBackoff})
	srv := mailtest.Start(t, answer)
	return b, srv, mailer(t, b, srv.Config("Test Shop", timeout))
}

// mailer is a Mailer for b's ledger sending as cfg says.
func mailer(t *testing.T, b *bundle, cfg mail.Config) *domain.Mailer {
	t.Helper()
	s, err := mail.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return &domain.Mailer{Ledger: b.ledger, Sender: s}
}

func always(a mailtest.Answer) func(int) mailtest.Answer {
	return func(int) mailtest.Answer { return a }
}

// firstThen answers the first message with first and every later one
// with Accept.
func firstThen(first mailtest.Answer) func(int) mailtest.Answer {
	return func(n int) mailtest.Answer {
		if n == 1 {
			return first
		}
		return mailtest.Accept
	}
}

// paidWithMail places and pays an order of 2 and returns the mail its
// payment queued.
func paidWithMail(t *testing.T, b *bundle) (*domain.Order, *domain.MailSend) {
	t.Helper()
	p := b.product(t, 500, 2)
	o := b.order(t, p, 2)
	res := b.pay(t, o.Order, "T"+o.Order.OrderNo, "")
	if res.Mail == nil || res.Mail.Status != domain.MailQueued || res.Mail.ID == 0 {
		t.Fatalf("payment queued mail %+v, want a QUEUED row", res.Mail)
	}
	return res.Order, res.Mail
}

func deliver(t *testing.T, b *bundle, m *domain.Mailer, id int64) *domain.MailSend {
	t.Helper()
	row, err := m.Deliver(b.ctx, id)
	if err != nil {
		t.Fatalf("Deliver: %v", err)
	}
	return row
}

// messageIDs counts the copies the server stored, by Message-ID.
func messageIDs(srv *mailtest.Server) map[string]int {
	out := map[string]int{}
	for _, r := range srv.Received() {
		out[r.MessageID]++
	}
	return out
}

func TestPaymentQueuesMailOnlyForEmailContacts(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{Mail: true})
		p := b.product(t, 500, 4)
		var orders []*domain.PlacedOrder
		for _, contact := range []string{"a@example.com", "13800138000", "b@example.com"} {
			o, err := b.ledger.PlaceOrder(b.ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: contact, Provider: "sandbox"})
			if err != nil {
				t.Fatal(err)
			}
			orders = append(orders, o)
		}
		// The first two together, as the batcher records them; the third alone.
		var ps []domain.Payment
		for _, o := range orders[:2] {
			ps = append(ps, domain.Payment{Provider: "sandbox", OrderNo: o.Order.OrderNo, TradeNo: "T" + o.Order.OrderNo, AmountFen: o.Order.AmountFen})
		}
		rs, errs := b.ledger.RecordPaymentsForTest(b.ctx, ps)
		for i := range rs {
			if errs[i] != nil || rs[i].Outcome != domain.PaymentDelivered {
				t.Fatalf("payment %d: %+v, %v", i, rs[i], errs[i])
			}
		}
		if rs[0].Mail == nil || rs[1].Mail != nil {
			t.Fatalf("batch: mails %+v, %+v; want one for the email contact only", rs[0].Mail, rs[1].Mail)
		}
		res := b.pay(t, orders[2].Order, "T"+orders[2].Order.OrderNo, "")
		if res.Mail == nil || res.Mail.OrderNo != orders[2].Order.OrderNo || res.Mail.Cause != domain.MailForPayment {
			t.Fatalf("single payment: mail %+v", res.Mail)
		}
		// A redelivered notification queues nothing more.
		if again := b.pay(t, orders[2].Order, "T"+orders[2].Order.OrderNo, ""); again.Mail != nil {
			t.Fatalf("a repeated payment queued mail %+v", again.Mail)
		}
		n, err := db.NewSelect().Table("mail_sends").Count(b.ctx)
		if err != nil || n != 2 {
			t.Fatalf("%d mail rows (%v), want 2", n, err)
		}
	})
	t.Run("mail off", func(t *testing.T) {
		b := setup(t, dbtest.Open(t, dbtest.SQLite), domain.Config{})
		p := b.product(t, 500, 1)
		o := b.order(t, p, 1)
		if res := b.pay(t, o.Order, "T1", ""); res.Mail != nil {
			t.Fatalf("mail off, yet a mail was queued: %+v", res.Mail)
		}
	})
}

func TestMailDeliversCodesOnceAndRecordsTheReveal(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b, srv, m := mailSetup(t, db, always(mailtest.Accept), 10*time.Second)
		o, queued := paidWithMail(t, b)
		row := deliver(t, b, m, queued.ID)
		if row.Status != domain.MailSent || row.Attempts != 1 || row.SentAt.IsZero() {
			t.Fatalf("after delivery: %+v", row)
		}
		// Delivered mails are done: asking again sends nothing.
		if again := deliver(t, b, m, queued.ID); again.Status != domain.MailSent {
			t.Fatalf("second Deliver: %+v", again)
		}
		got := srv.Received()
		if len(got) != 1 || got[0].To != o.Contact {
			t.Fatalf("server got %d messages (%+v), want 1 to %s", len(got), got, o.Contact)
		}
		codes, err := b.ledger.DeliveredCodes(b.ctx, o)
		if err != nil || len(codes) != 2 {
			t.Fatal(codes, err)
		}
		for _, c := range codes {
			if !strings.Contains(string(got[0].Raw), c) {
				t.Errorf("mail lacks code %s", c)
			}
		}
		page, err := b.ledger.ListReveals(b.ctx, o.OrderNo, 0, 0, 10)
		if err != nil || len(page.Reveals) != 1 {
			t.Fatalf("reveals %+v, %v; want one", page, err)
		}
		if r := page.Reveals[0]; r.Channel != domain.RevealMail || r.Actor != "mail" || r.Viewer != domain.ViewerBuyer || r.Codes != 2 {
			t.Fatalf("reveal %+v", r)
		}
	})
}

func TestMailRefusedFailsWithAlert(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b, srv, m := mailSetup(t, db, always(mailtest.Refuse), 10*time.Second)
		_, queued := paidWithMail(t, b)
		row := deliver(t, b, m, queued.ID)
		if row.Status != domain.MailFailed || !strings.Contains(row.LastError, "554") || row.Attempts != 1 {
			t.Fatalf("after a 554: %+v", row)
		}
		if b.alerts.count("mail_failed") != 1 {
			t.Fatalf("alerts %v, want one mail_failed", b.alerts.kinds())
		}
		b.clock.Advance(time.Hour)
		deliver(t, b, m, queued.ID)
		if srv.Attempts() != 1 || b.alerts.count("mail_failed") != 1 {
			t.Fatalf("a failed mail was tried again: %d attempts, alerts %v", srv.Attempts(), b.alerts.kinds())
		}
	})
}

func TestMailRetriesWithBackoffThenFails(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b, srv, m := mailSetup(t, db, always(mailtest.TryLater), 10*time.Second)
		_, queued := paidWithMail(t, b)
		for i := 1; i <= len(mailBackoff); i++ {
			row := deliver(t, b, m, queued.ID)
			if row.Status != domain.MailQueued || row.Attempts != i || !strings.Contains(row.LastError, "451") {
				t.Fatalf("attempt %d: %+v", i, row)
			}
			// Not due before its backoff.
			if again := deliver(t, b, m, queued.ID); again.Attempts != i {
				t.Fatalf("attempt %d ran again before its backoff: %+v", i, again)
			}
			b.clock.Advance(mailBackoff[i-1])
		}
		row := deliver(t, b, m, queued.ID)
		if row.Status != domain.MailFailed || b.alerts.count("mail_failed") != 1 || srv.Attempts() != len(mailBackoff)+1 {
			t.Fatalf("after the backoff: %+v, alerts %v, %d attempts", row, b.alerts.kinds(), srv.Attempts())
		}
		if len(srv.Received()) != 0 {
			t.Fatal("a refused message was stored")
		}
	})
}

// TestMailAcceptedOnTheSecondTry: a server that refuses for now, or that
// stalls before the message is sent, and accepts the next attempt: one
// copy arrives.
func TestMailAcceptedOnTheSecondTry(t *testing.T) {
	t.Parallel()
	for name, first := range map[string]mailtest.Answer{"4xx": mailtest.TryLater, "timeout before the message": mailtest.StallBeforeData} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			dbtest.Each(t, func(t *testing.T, db *bun.DB) {
				b, srv, m := mailSetup(t, db, firstThen(first), time.Second)
				_, queued := paidWithMail(t, b)
				if row := deliver(t, b, m, queued.ID); row.Status != domain.MailQueued || row.Uncertain != 0 {
					t.Fatalf("first attempt: %+v", row)
				}
				b.clock.Advance(mailBackoff[0])
				if row := deliver(t, b, m, queued.ID); row.Status != domain.MailSent || row.Attempts != 2 {
					t.Fatalf("second attempt: %+v", row)
				}
				if n := len(srv.Received()); n != 1 {
					t.Fatalf("%d copies arrived, want 1", n)
				}
			})
		})
	}
}

// TestMailUncertainAttemptBound: the server takes the whole message and
// never answers its end. The buyer has it after the first attempt, which
// kami cannot know; kami sends again once (MaxUncertainMail), with the
// same Message-ID, and then gives up with an alert: at most
// MaxUncertainMail+1 copies, one Message-ID, and nothing more after.
func TestMailUncertainAttemptBound(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b, srv, m := mailSetup(t, db, always(mailtest.Stall), time.Second)
		_, queued := paidWithMail(t, b)
		row := deliver(t, b, m, queued.ID)
		if row.Status != domain.MailQueued || row.Uncertain != 1 || len(srv.Received()) != 1 {
			t.Fatalf("first attempt: %+v, %d stored", row, len(srv.Received()))
		}
		b.clock.Advance(mailBackoff[0])
		row = deliver(t, b, m, queued.ID)
		if row.Status != domain.MailFailed || row.Uncertain != 2 || b.alerts.count("mail_failed") != 1 {
			t.Fatalf("second attempt: %+v, alerts %v", row, b.alerts.kinds())
		}
		for range 3 {
			b.clock.Advance(time.Hour)
			deliver(t, b, m, queued.ID)
		}
		ids := messageIDs(srv)
		if len(srv.Received()) != domain.MaxUncertainMail+1 || len(ids) != 1 || srv.Attempts() != domain.MaxUncertainMail+1 {
			t.Fatalf("copies %d (Message-IDs %v), attempts %d; want %d copies of one Message-ID",
				len(srv.Received()), ids, srv.Attempts(), domain.MaxUncertainMail+1)
		}
	})
}

// TestMailUncertainThenAccepted: the first attempt's reply is lost, the
// second is confirmed: two copies with one Message-ID (the documented
// bound), SENT, nothing more.
func TestMailUncertainThenAccepted(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b, srv, m := mailSetup(t, db, firstThen(mailtest.Stall), time.Second)
		_, queued := paidWithMail(t, b)
		deliver(t, b, m, queued.ID)
		b.clock.Advance(mailBackoff[0])
		if row := deliver(t, b, m, queued.ID); row.Status != domain.MailSent || row.Uncertain != 1 {
			t.Fatalf("second attempt: %+v", row)
		}
		b.clock.Advance(time.Hour)
		deliver(t, b, m, queued.ID)
		if ids := messageIDs(srv); len(srv.Received()) != 2 || len(ids) != 1 {
			t.Fatalf("copies %d, Message-IDs %v; want 2 copies of one", len(srv.Received()), ids)
		}
	})
}

// TestMailDeadAttemptTakenOver: a process that began an attempt and died
// (its deadline passed with the row SENDING) may have sent it: the next
// attempt counts it uncertain, and a second dead attempt ends the mail.
func TestMailDeadAttemptTakenOver(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b, srv, m := mailSetup(t, db, always(mailtest.Accept), 10*time.Second)
		_, queued := paidWithMail(t, b)
		// The dead process's attempt: begun, never finished.
		begun, err := b.ledger.BeginMailAttempt(b.ctx, queued.ID, time.Minute)
		if err != nil || begun.Attempt == nil {
			t.Fatal(begun, err)
		}
		// Under way: nobody else may start one.
		if row := deliver(t, b, m, queued.ID); row.Status != domain.MailSending || row.Attempts != 1 || srv.Attempts() != 0 {
			t.Fatalf("during the attempt: %+v", row)
		}
		b.clock.Advance(time.Minute + time.Second)
		if row := deliver(t, b, m, queued.ID); row.Status != domain.MailSent || row.Uncertain != 1 || row.Attempts != 2 {
			t.Fatalf("after the dead attempt: %+v", row)
		}
		// A second mail whose two attempts both die: FAILED, alerted.
		_, second := paidWithMail(t, b)
		for range 2 {
			if begun, err := b.ledger.BeginMailAttempt(b.ctx, second.ID, time.Minute); err != nil || begun.Attempt == nil {
				t.Fatal(begun, err)
			}
			b.clock.Advance(2 * time.Minute)
		}
		if row := deliver(t, b, m, second.ID); row.Status != domain.MailFailed || b.alerts.count("mail_failed") != 1 {
			t.Fatalf("after two dead attempts: %+v, alerts %v", row, b.alerts.kinds())
		}
	})
}

// TestMailOneSenderAtATime: many workers (each its own Mailer, as
// separate processes would be) deliver the same mail at once; one
// message is sent.
func TestMailOneSenderAtATime(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b, srv, m := mailSetup(t, db, always(mailtest.Accept), 10*time.Second)
		rounds := 10
		if db.Dialect().Name().String() == "sqlite" {
			rounds = 3
		}
		for round := range rounds {
			_, queued := paidWithMail(t, b)
			var wg sync.WaitGroup
			errs := make(chan error, 8)
			for range 8 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					other := &domain.Mailer{Ledger: b.ledger, Sender: m.Sender}
					if _, err := other.Deliver(context.Background(), queued.ID); err != nil && !retryable(err) {
						errs <- err
					}
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Fatalf("round %d: %v", round, err)
			}
			if n := len(srv.Received()); n != round+1 {
				t.Fatalf("round %d: the server has %d messages, want %d", round, n, round+1)
			}
		}
	})
}

// retryable: a database's refusal under contention (a deadlock, a busy
// SQLite) leaves the mail to its lease; it is not a second send.
func retryable(err error) bool {
	s := err.Error()
	return strings.Contains(s, "deadlock") || strings.Contains(s, "busy") || strings.Contains(s, "locked")
}

// TestMailNotSentForARefundedOrder: an admin refunded the order before its
// mail went out: the codes are not mailed, and the mail says why.
func TestMailNotSentForARefundedOrder(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b, srv, m := mailSetup(t, db, always(mailtest.Accept), 10*time.Second)
		o, queued := paidWithMail(t, b)
		if _, err := b.ledger.RequestRefund(b.ctx, o.OrderNo, "", "admin"); err != nil {
			t.Fatal(err)
		}
		row := deliver(t, b, m, queued.ID)
		if row.Status != domain.MailFailed || !strings.Contains(row.LastError, "REFUNDING") || srv.Attempts() != 0 {
			t.Fatalf("mail of a refunded order: %+v, %d attempts at the server", row, srv.Attempts())
		}
		page, err := b.ledger.ListReveals(b.ctx, o.OrderNo, 0, 0, 10)
		if err != nil || len(page.Reveals) != 0 {
			t.Fatalf("reveals %+v, %v; want none", page, err)
		}
	})
}

// TestEmailContact: only an address at a domain name (a dot, a top-level
// domain of letters) is mailed; IP literals, bare hosts and source routes
// in the local part are contacts kami keeps but does not mail.
func TestEmailContact(t *testing.T) {
	t.Parallel()
	for contact, want := range map[string]bool{
		"buyer@example.com":           true,
		"a.b+tag@mail.example.co.uk":  true,
		"buyer@例子.中国":                 true,
		"buyer@example.xn--fiqs8s":    true,
		"buyer@sub-domain.example.cn": true,
		"a@[10.0.0.5]":                false,
		"a@[ipv6:::1]":                false,
		"root@localhost":              false,
		"a@127.0.0.1":                 false,
		"a@10.0.0.5":                  false,
		"postmaster@b":                false,
		"a%b.com@relay.example":       false,
		"a!b@relay.example":           false,
		"a@example.c0m":               false,
		"a@-example.com":              false,
		"a@example..com":              false,
		"a@example.com.":              false,
		"13800138000":                 false,
		"Buyer <buyer@example.com>":   false,
	} {
		if got := domain.EmailContact(contact); got != want {
			t.Errorf("EmailContact(%q) = %v, want %v", contact, got, want)
		}
	}
}

// TestMailServerRefusalIsRetried: the SMTP server refuses kami's AUTH
// (535: a password being rotated) for the first two connections. The
// mails wait (QUEUED, not FAILED), one mail_server_refused alert is
// raised for both and no mail_failed, and once the server takes the
// password each is sent, one copy each. A later refusal alerts again.
func TestMailServerRefusalIsRetried(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b, srv, _ := mailSetup(t, db, always(mailtest.Accept), 10*time.Second)
		srv.SetGate(func(n int) mailtest.Gate {
			if n <= 2 {
				return mailtest.RefuseAuth
			}
			return mailtest.Open
		})
		cfg := srv.Config("Test Shop", 10*time.Second)
		cfg.Server.Username, cfg.Server.Password = "kami", "rotating"
		m := mailer(t, b, cfg)
		outcomes := &mailOutcomes{}
		m.Observer = outcomes
		_, first := paidWithMail(t, b)
		_, second := paidWithMail(t, b)
		for _, q := range []*domain.MailSend{first, second} {
			row := deliver(t, b, m, q.ID)
			if row.Status != domain.MailQueued || row.Attempts != 1 || !strings.Contains(row.LastError, "535") {
				t.Fatalf("after AUTH 535: %+v", row)
			}
		}
		if b.alerts.count("mail_server_refused") != 1 || b.alerts.count("mail_failed") != 0 || srv.Auths() != 2 {
			t.Fatalf("alerts %v, %d AUTH; want one mail_server_refused for two refusals", b.alerts.kinds(), srv.Auths())
		}
		b.clock.Advance(mailBackoff[0])
		for _, q := range []*domain.MailSend{first, second} {
			if row := deliver(t, b, m, q.ID); row.Status != domain.MailSent || row.Attempts != 2 {
				t.Fatalf("once AUTH works: %+v", row)
			}
		}
		if ids := messageIDs(srv); len(srv.Received()) != 2 || len(ids) != 2 {
			t.Fatalf("%d copies, Message-IDs %v; want one copy of each mail", len(srv.Received()), ids)
		}
		if got := strings.Join(outcomes.get(), " "); got != "server_refused server_refused sent sent" {
			t.Fatalf("outcomes observed: %s", got)
		}
		srv.SetGate(func(int) mailtest.Gate { return mailtest.RefuseHello })
		_, third := paidWithMail(t, b)
		if row := deliver(t, b, m, third.ID); row.Status != domain.MailQueued || b.alerts.count("mail_server_refused") != 2 {
			t.Fatalf("a new refusal: %+v, alerts %v", row, b.alerts.kinds())
		}
	})
}

// TestMailHostileServerTextIsStored: a refusal whose text holds a NUL,
// invalid UTF-8, escapes and the buyer's address in capitals is stored
// (every database takes it) without any of them.
func TestMailHostileServerTextIsStored(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b, _, m := mailSetup(t, db, always(mailtest.RefuseHostile), 10*time.Second)
		o, queued := paidWithMail(t, b)
		row := deliver(t, b, m, queued.ID)
		if row.Status != domain.MailFailed || !strings.Contains(row.LastError, "554") || !strings.Contains(row.LastError, "<buyer>") {
			t.Fatalf("after a hostile 554: %+v", row)
		}
		if strings.Contains(strings.ToLower(row.LastError), o.Contact) || strings.ContainsFunc(row.LastError, func(r rune) bool { return r < ' ' || r == 0x7f || r == 0x202e }) {
			t.Fatalf("stored error %q holds the buyer's address or control characters", row.LastError)
		}
	})
}

// TestMailOutcomeRecordRetried: the server accepted the mail and the
// first record of it fails (the COMMIT's answer lost, applied or not):
// the record is tried again, the mail is SENT, and nothing sends it a
// second time past its deadline.
func TestMailOutcomeRecordRetried(t *testing.T) {
	t.Parallel()
	eachWithLostCommits(t, func(t *testing.T, db *bun.DB, lost *lostCommits) {
		for _, applied := range []bool{false, true} {
			b := setup(t, db, domain.Config{Mail: true, MailBackoff: mailBackoff})
			// The next COMMIT after the server begins the message is the
			// outcome's record.
			srv := mailtest.Start(t, func(int) mailtest.Answer {
				lost.applied = applied
				lost.armed.Store(1)
				return mailtest.Accept
			})
			m := mailer(t, b, srv.Config("Test Shop", 10*time.Second))
			_, queued := paidWithMail(t, b)
			row := deliver(t, b, m, queued.ID)
			if lost.armed.Load() != 0 {
				t.Fatal("the commit fault did not fire")
			}
			if row.Status != domain.MailSent || row.Attempts != 1 {
				t.Fatalf("applied %v: after a failed record: %+v", applied, row)
			}
			b.clock.Advance(time.Hour)
			deliver(t, b, m, queued.ID)
			if n := len(srv.Received()); n != 1 {
				t.Fatalf("applied %v: %d copies, want 1", applied, n)
			}
		}
	})
}

// mailOutcomes records the outcomes a Mailer reports.
type mailOutcomes struct {
	mu  sync.Mutex
	out []string
}

func (o *mailOutcomes) MailAttempted(outcome string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.out = append(o.out, outcome)
}

func (o *mailOutcomes) MailFailed() {}

func (o *mailOutcomes) get() []string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]string(nil), o.out...)
}

// stepsBackoff is a backoff whose steps differ, so a test can tell which
// one a wait used.
var stepsBackoff = []time.Duration{time.Minute, 2 * time.Minute, 3 * time.Minute}

// refusingSetup is mailSetup with stepsBackoff and a Mailer that logs in
// (the test server then asks for AUTH), its server answering each message
// with answer and each connection before any message with gate.
func refusingSetup(t *testing.T, db *bun.DB, gate func(int) mailtest.Gate, answer func(int) mailtest.Answer) (*bundle, *mailtest.Server, *domain.Mailer, *mailOutcomes) {
	t.Helper()
	b := setup(t, db, domain.Config{Mail: true, MailBackoff: stepsBackoff})
	srv := mailtest.Start(t, answer)
	srv.SetGate(gate)
	cfg := srv.Config("Test Shop", 10*time.Second)
	cfg.Server.Username, cfg.Server.Password = "kami", "secret"
	m := mailer(t, b, cfg)
	outcomes := &mailOutcomes{}
	m.Observer = outcomes
	return b, srv, m, outcomes
}

// refuseFirst has the server refuse kami's AUTH (535) on its first n
// connections and let every later one in.
func refuseFirst(n int) func(int) mailtest.Gate {
	return func(c int) mailtest.Gate {
		if c <= n {
			return mailtest.RefuseAuth
		}
		return mailtest.Open
	}
}

// waitOut makes the mail's next attempt due: it is not due a second
// before step (an attempt then reaches no server), and is at step.
func waitOut(t *testing.T, b *bundle, m *domain.Mailer, srv *mailtest.Server, id int64, step time.Duration) {
	t.Helper()
	auths := srv.Auths()
	b.clock.Advance(step - time.Second)
	if row := deliver(t, b, m, id); srv.Auths() != auths || row.Status != domain.MailQueued {
		t.Fatalf("tried before its wait of %v: %+v", step, row)
	}
	b.clock.Advance(time.Second)
}

// TestMailServerRefusalOutlastsTheBackoff: the SMTP server refuses kami's
// AUTH on more attempts than the backoff has steps (a password wrong for
// hours), then takes it. Those attempts reached no message: the mail is
// never FAILED and raises no mail_failed, it waits the backoff's steps and
// then the longest one over and over, and once the server takes kami it
// is SENT, one copy. One mail_server_refused alert for the whole episode.
func TestMailServerRefusalOutlastsTheBackoff(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		refusals := len(stepsBackoff) + 3
		b, srv, m, outcomes := refusingSetup(t, db, refuseFirst(refusals), always(mailtest.Accept))
		_, queued := paidWithMail(t, b)
		for i := 1; i <= refusals; i++ {
			row := deliver(t, b, m, queued.ID)
			if row.Status != domain.MailQueued || row.Attempts != i || !strings.Contains(row.LastError, "535") || srv.Auths() != i {
				t.Fatalf("refusal %d: %+v, %d AUTH", i, row, srv.Auths())
			}
			waitOut(t, b, m, srv, queued.ID, stepsBackoff[min(i, len(stepsBackoff))-1])
		}
		row := deliver(t, b, m, queued.ID)
		if row.Status != domain.MailSent || row.Attempts != refusals+1 || len(srv.Received()) != 1 {
			t.Fatalf("once the server takes kami: %+v, %d copies", row, len(srv.Received()))
		}
		if b.alerts.count("mail_failed") != 0 || b.alerts.count("mail_server_refused") != 1 {
			t.Fatalf("alerts %v; want one mail_server_refused and no mail_failed", b.alerts.kinds())
		}
		want := strings.TrimSpace(strings.Repeat("server_refused ", refusals) + "sent")
		if got := strings.Join(outcomes.get(), " "); got != want {
			t.Fatalf("outcomes observed: %s, want %s", got, want)
		}
		b.clock.Advance(time.Hour)
		deliver(t, b, m, queued.ID)
		if n := len(srv.Received()); n != 1 {
			t.Fatalf("%d copies, want 1", n)
		}
	})
}

// TestMailBudgetCountsOnlyAttemptsThatReachedAMessage: after AUTH
// refusals, a server that answers every message 451 still gets the whole
// backoff of attempts at the message, no more: refusals before any message
// neither use it up nor stretch it.
func TestMailBudgetCountsOnlyAttemptsThatReachedAMessage(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		refusals := 2
		b, srv, m, _ := refusingSetup(t, db, refuseFirst(refusals), always(mailtest.TryLater))
		_, queued := paidWithMail(t, b)
		for i := 1; i <= refusals; i++ {
			if row := deliver(t, b, m, queued.ID); row.Status != domain.MailQueued || !strings.Contains(row.LastError, "535") {
				t.Fatalf("refusal %d: %+v", i, row)
			}
			waitOut(t, b, m, srv, queued.ID, stepsBackoff[i-1])
		}
		// The attempts at the message wait the backoff from its first step.
		for i := 1; i <= len(stepsBackoff); i++ {
			row := deliver(t, b, m, queued.ID)
			if row.Status != domain.MailQueued || !strings.Contains(row.LastError, "451") || srv.Attempts() != i {
				t.Fatalf("attempt %d at the message: %+v", i, row)
			}
			waitOut(t, b, m, srv, queued.ID, stepsBackoff[i-1])
		}
		row := deliver(t, b, m, queued.ID)
		if row.Status != domain.MailFailed || row.Attempts != refusals+len(stepsBackoff)+1 || srv.Attempts() != len(stepsBackoff)+1 ||
			b.alerts.count("mail_failed") != 1 {
			t.Fatalf("after the backoff: %+v, %d attempts at the message, alerts %v", row, srv.Attempts(), b.alerts.kinds())
		}
	})
}

// unreachableSetup is a ledger with stepsBackoff and a Mailer sending to
// plain, a server that offers no STARTTLS, which kami requires (every
// attempt ends before any message), and good, a server that would take
// the mails once the settings name it.
func unreachableSetup(t *testing.T, db *bun.DB) (b *bundle, plain, good *mailtest.Server, m *domain.Mailer) {
	t.Helper()
	b = setup(t, db, domain.Config{Mail: true, MailBackoff: stepsBackoff})
	plain = mailtest.StartWithoutTLS(t, always(mailtest.Accept))
	good = mailtest.Start(t, always(mailtest.Accept))
	return b, plain, good, mailer(t, b, plain.Config("Test Shop", 10*time.Second))
}

// TestMailUnreachableServerOutlastsTheBackoff: the shop's SMTP settings
// name a server kami cannot use (it offers no STARTTLS, which kami
// requires) for more attempts than the backoff has steps. No message was
// ever begun: the mail waits, never FAILED, each attempt observed as
// unreachable, and once the settings are fixed it is sent, one copy.
func TestMailUnreachableServerOutlastsTheBackoff(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b, plain, good, m := unreachableSetup(t, db)
		outcomes := &mailOutcomes{}
		m.Observer = outcomes
		_, queued := paidWithMail(t, b)
		for i := 1; i <= len(stepsBackoff)+2; i++ {
			row := deliver(t, b, m, queued.ID)
			if row.Status != domain.MailQueued || row.Attempts != i || row.LastError == "" {
				t.Fatalf("attempt %d without TLS: %+v", i, row)
			}
			b.clock.Advance(stepsBackoff[len(stepsBackoff)-1])
		}
		if plain.Attempts() != 0 || len(b.alerts.kinds()) != 0 {
			t.Fatalf("%d messages begun without TLS, alerts %v", plain.Attempts(), b.alerts.kinds())
		}
		m.Sender = mailer(t, b, good.Config("Test Shop", 10*time.Second)).Sender // the settings fixed
		if row := deliver(t, b, m, queued.ID); row.Status != domain.MailSent || len(good.Received()) != 1 {
			t.Fatalf("once the settings are fixed: %+v, %d copies", row, len(good.Received()))
		}
		want := strings.TrimSpace(strings.Repeat("unreachable ", len(stepsBackoff)+2) + "sent")
		if got := strings.Join(outcomes.get(), " "); got != want {
			t.Fatalf("outcomes observed: %s, want %s", got, want)
		}
	})
}

// TestMailSecondReportOfARefusalChangesNothing: an attempt the server
// refused before any message, reported twice (a record retried after its
// commit went through unheard), is counted once.
func TestMailSecondReportOfARefusalChangesNothing(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b, _, m, _ := refusingSetup(t, db, refuseFirst(1), always(mailtest.Accept))
		_, queued := paidWithMail(t, b)
		row := deliver(t, b, m, queued.ID)
		again, err := b.ledger.FinishMailAttempt(b.ctx, queued.ID, row.Attempts,
			&mail.Error{Outcome: mail.NotSent, Code: 535, BeforeMessage: true, Detail: "auth: 535 again"})
		if err != nil || !reflect.DeepEqual(again, row) {
			t.Fatalf("second report: %+v, %v; want %+v", again, err, row)
		}
	})
}

// TestMailSecondReportOfAnUncertainAttemptChangesNothing: the report of an
// uncertain attempt is recorded (QUEUED again, one uncertain attempt), and
// a second report of that same attempt (Deliver records it again when the
// first's answer is lost) changes nothing: the row is not counted a
// second uncertain attempt and given up, and no mail_failed alert is
// raised for a mail that may still be sent once more.
func TestMailSecondReportOfAnUncertainAttemptChangesNothing(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b, _, m := mailSetup(t, db, always(mailtest.Stall), time.Second)
		_, queued := paidWithMail(t, b)
		row := deliver(t, b, m, queued.ID)
		if row.Status != domain.MailQueued || row.Uncertain != 1 {
			t.Fatalf("first attempt: %+v", row)
		}
		again, err := b.ledger.FinishMailAttempt(b.ctx, queued.ID, row.Attempts,
			&mail.Error{Outcome: mail.Uncertain, Detail: "data close: no reply"})
		if err != nil || !reflect.DeepEqual(again, row) {
			t.Fatalf("second report: %+v, %v; want %+v", again, err, row)
		}
		if n := b.alerts.count("mail_failed"); n != 0 {
			t.Fatalf("%d mail_failed alerts after a second report of one attempt, want 0", n)
		}
	})
}

// TestWaitingMailsCountThoseOnAnUnreachableServer: a mail whose attempts
// reach no server (no STARTTLS) counts as waiting on an unreachable
// server after each of them, past the backoff's last step and through the
// next attempt (SENDING, before it ends), so a gauge of it never dips
// while the mail waits; once sent it is counted no more, and neither is a
// mail that ends FAILED (its order refunded) after such attempts.
func TestWaitingMailsCountThoseOnAnUnreachableServer(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b, _, good, m := unreachableSetup(t, db)
		waiting := func(want map[domain.MailOutcome]int64) {
			t.Helper()
			got, err := b.ledger.WaitingMails(b.ctx)
			if err != nil {
				t.Fatal(err)
			}
			for k, n := range got {
				if n == 0 {
					delete(got, k)
				}
			}
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("waiting mails %v, want %v", got, want)
			}
		}
		waiting(map[domain.MailOutcome]int64{})
		_, queued := paidWithMail(t, b)
		refunded, other := paidWithMail(t, b)
		waiting(map[domain.MailOutcome]int64{"": 2})
		unreachable := map[domain.MailOutcome]int64{domain.MailOutcomeUnreachable: 2}
		for i := 1; i <= len(stepsBackoff)+2; i++ {
			for _, id := range []int64{queued.ID, other.ID} {
				if row := deliver(t, b, m, id); row.Status != domain.MailQueued || row.LastOutcome != domain.MailOutcomeUnreachable || row.Unreached != i {
					t.Fatalf("attempt %d without TLS: %+v", i, row)
				}
			}
			waiting(unreachable)
			b.clock.Advance(stepsBackoff[len(stepsBackoff)-1])
		}
		// The attempt under way still waits on the server.
		begun, err := b.ledger.BeginMailAttempt(b.ctx, queued.ID, time.Minute)
		if err != nil || begun.Attempt == nil {
			t.Fatalf("begin: %+v, %v", begun, err)
		}
		waiting(unreachable)
		if _, err := b.ledger.FinishMailAttempt(b.ctx, queued.ID, begun.Attempt.Mail.Attempts,
			&mail.Error{Outcome: mail.NotSent, BeforeMessage: true, Detail: "dial: connection refused"}); err != nil {
			t.Fatal(err)
		}
		waiting(unreachable)

		b.clock.Advance(stepsBackoff[len(stepsBackoff)-1])
		m.Sender = mailer(t, b, good.Config("Test Shop", 10*time.Second)).Sender // the server back
		if row := deliver(t, b, m, queued.ID); row.Status != domain.MailSent || row.LastOutcome != domain.MailOutcomeSent {
			t.Fatalf("once the server is back: %+v", row)
		}
		waiting(map[domain.MailOutcome]int64{domain.MailOutcomeUnreachable: 1})
		if _, err := b.ledger.RequestRefund(b.ctx, refunded.OrderNo, "", "admin"); err != nil {
			t.Fatal(err)
		}
		if row := deliver(t, b, m, other.ID); row.Status != domain.MailFailed {
			t.Fatalf("mail of the refunded order: %+v", row)
		}
		waiting(map[domain.MailOutcome]int64{})
	})
}
