package queue_test

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/mail"
	"kami/mail/mailtest"
	"kami/queue"
	"kami/queue/redistest"
)

// mailWorker starts a mail worker sending to srv; it stops when the test
// ends.
func (e *env) mailWorker(t *testing.T, srv *mailtest.Server) *queue.MailWorker {
	t.Helper()
	s, err := mail.New(srv.Config("Test Shop", 10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	m := &domain.Mailer{Ledger: e.ledger, Sender: s, Log: quietLogger()}
	w := queue.NewMailWorker(queue.Config{Lease: 2 * time.Second, RecoverEvery: time.Second, SweepEvery: time.Second},
		e.redis.Client, e.keys, m, quietLogger())
	startUntilCleanup(t, e.ctx, "mail worker", w.Start, w.Stop)
	return w
}

// payAll pays every order through the shop.
func (e *env) payAll(t *testing.T, nos []string) {
	t.Helper()
	for _, no := range nos {
		o, err := e.ledger.Order(e.ctx, no)
		if err != nil {
			t.Fatal(err)
		}
		res, err := e.shop.RecordPayment(e.ctx, domain.Payment{Provider: "sandbox", OrderNo: no, TradeNo: "T" + no, AmountFen: o.AmountFen})
		if err != nil || res.Mail == nil {
			t.Fatalf("pay %s: %+v, %v", no, res, err)
		}
	}
}

func sentMails(t *testing.T, db *bun.DB) int {
	t.Helper()
	n, err := db.NewSelect().Table("mail_sends").Where("status = ?", domain.MailSent).Count(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return int(n)
}

// mailCombos: PostgreSQL with the real Redis, SQLite with the in-process one.
func mailCombos(t *testing.T, fn func(t *testing.T, db *bun.DB, rs *redistest.Server)) {
	for _, c := range []struct {
		dk dbtest.Kind
		rk redistest.Kind
	}{{dbtest.Postgres, redistest.Real}, {dbtest.SQLite, redistest.Mini}} {
		t.Run(string(c.dk)+"/"+string(c.rk), func(t *testing.T) {
			t.Parallel()
			fn(t, dbtest.Open(t, c.dk), redistest.Open(t, c.rk))
		})
	}
}

// TestMailSurvivesFlush: paid orders' mails were scheduled, then Redis lost
// everything before a worker ran. The sweeper rebuilds the queue from the
// database: every mail arrives, once.
func TestMailSurvivesFlush(t *testing.T) {
	t.Parallel()
	mailCombos(t, func(t *testing.T, db *bun.DB, rs *redistest.Server) {
		e := newEnv(t, db, rs, domain.Config{Mail: true})
		srv := mailtest.Start(t, func(int) mailtest.Answer { return mailtest.Accept })
		e.shop.MailQueue = queue.NewMailScheduler(rs.Client, e.keys)
		p := e.product(t, 20)
		nos := e.place(t, p, 20)
		e.payAll(t, nos)
		if n, err := rs.Client.ZCard(e.ctx, e.keys.MailQueue()).Result(); err != nil || n != 20 {
			t.Fatalf("mail queue holds %d (%v), want 20", n, err)
		}
		rs.Wipe(t, e.keys.Prefix())
		w := e.mailWorker(t, srv)
		eventually(t, 30*time.Second, "every mail sent", func() bool { return sentMails(t, db) == 20 })
		if got := len(srv.Received()); got != 20 {
			t.Fatalf("the server has %d messages, want 20", got)
		}
		ids := map[string]bool{}
		for _, r := range srv.Received() {
			ids[r.MessageID] = true
		}
		if len(ids) != 20 {
			t.Fatalf("%d distinct Message-IDs, want 20", len(ids))
		}
		if w.Stats().Swept < 20 {
			t.Fatalf("the sweeper restored %d schedules, want 20", w.Stats().Swept)
		}
	})
}

// TestMailTwoWorkers: two processes' workers share the queue; each mail is
// sent once.
func TestMailTwoWorkers(t *testing.T) {
	t.Parallel()
	mailCombos(t, func(t *testing.T, db *bun.DB, rs *redistest.Server) {
		e := newEnv(t, db, rs, domain.Config{Mail: true})
		srv := mailtest.Start(t, func(int) mailtest.Answer { return mailtest.Accept })
		e.mailWorker(t, srv)
		second := e.mailWorker(t, srv)
		e.shop.MailQueue = queue.NewMailScheduler(rs.Client, e.keys)
		p := e.product(t, 30)
		e.payAll(t, e.place(t, p, 30))
		eventually(t, 30*time.Second, "every mail sent", func() bool { return sentMails(t, db) == 30 })
		// Let the other worker's sweep and drains run over the finished mails.
		if _, err := second.Sweep(e.ctx); err != nil {
			t.Fatal(err)
		}
		second.Drain()
		if got := len(srv.Received()); got != 30 {
			t.Fatalf("the server has %d messages, want 30", got)
		}
	})
}

// TestMailWaitsOutARefusingServer: the SMTP server refuses kami (554 to
// EHLO) on more attempts than the backoff has steps, then lets it in. The
// worker puts the mail back at each next due time; it never ends FAILED,
// and once the server answers it is sent, one copy.
func TestMailWaitsOutARefusingServer(t *testing.T) {
	t.Parallel()
	mailCombos(t, func(t *testing.T, db *bun.DB, rs *redistest.Server) {
		backoff := []time.Duration{time.Minute, 2 * time.Minute}
		e := newEnv(t, db, rs, domain.Config{Mail: true, MailBackoff: backoff})
		srv := mailtest.Start(t, func(int) mailtest.Answer { return mailtest.Accept })
		refusals := len(backoff) + 2
		srv.SetGate(func(n int) mailtest.Gate {
			if n <= refusals {
				return mailtest.RefuseHello
			}
			return mailtest.Open
		})
		e.shop.MailQueue = queue.NewMailScheduler(rs.Client, e.keys)
		e.mailWorker(t, srv)
		p := e.product(t, 1)
		no := e.place(t, p, 1)[0]
		o, err := e.ledger.Order(e.ctx, no)
		if err != nil {
			t.Fatal(err)
		}
		res, err := e.shop.RecordPayment(e.ctx, domain.Payment{Provider: "sandbox", OrderNo: no, TradeNo: "T" + no, AmountFen: o.AmountFen})
		if err != nil || res.Mail == nil {
			t.Fatalf("pay: %+v, %v", res, err)
		}
		id := res.Mail.ID
		for i := 1; i <= refusals; i++ {
			var row *domain.MailSend
			eventually(t, 30*time.Second, "the next refused attempt recorded and the mail back on the queue", func() bool {
				row, err = e.ledger.Mail(e.ctx, id)
				if err != nil || row.Attempts < i || row.Status == domain.MailSending {
					return false
				}
				score, err := rs.Client.ZScore(e.ctx, e.keys.MailQueue(), strconv.FormatInt(id, 10)).Result()
				return row.Status != domain.MailQueued || err == nil && int64(score) == row.NextDueAt.UnixMilli()
			})
			if row.Status != domain.MailQueued || row.Attempts != i || !strings.Contains(row.LastError, "554") {
				t.Fatalf("refusal %d: %+v", i, row)
			}
			e.clock.Advance(backoff[len(backoff)-1])
		}
		eventually(t, 30*time.Second, "the mail sent once the server lets kami in", func() bool { return sentMails(t, db) == 1 })
		if row, err := e.ledger.Mail(e.ctx, id); err != nil || row.Attempts != refusals+1 || len(srv.Received()) != 1 {
			t.Fatalf("sent: %+v, %v, %d copies", row, err, len(srv.Received()))
		}
	})
}
