package domain

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/mail"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
	"unicode"

	"github.com/uptrace/bun"

	kmail "kami/mail"
)

// Codes by email. A paid order whose contact is an email address gets one
// mail_sends row, written in the transaction that marks it paid
// (queueOrderMails), so a crash can neither lose the mail nor invent one.
// A queue worker sends it later through Mailer.Deliver, never the
// payment's own request.
//
// Exactly once, as far as SMTP allows. Each attempt is recorded
// (QUEUED → SENDING, with a deadline) and committed before the message is
// sent, so two workers never send one row at once. A failure before the
// message's end reached the server delivered nothing and is retried with
// backoff; a 5xx that answers the message (MAIL FROM, RCPT TO, DATA, its
// end) is final. An attempt that ended before any message (no
// connection, TLS, or a reply to the greeting, EHLO, STARTTLS or AUTH:
// mail.Error.BeforeMessage) is no answer about this mail but about kami,
// its settings or the server, and every mail gets the same until they are
// fixed: it is counted apart (unreached) and uses none of the mail's
// attempt budget, so such a mail never ends FAILED for it; it waits and
// retries at the backoff's steps, the longest one over and over, until
// the server takes kami. A 5xx there (the server refuses kami itself)
// raises one mail_server_refused alert (Mailer). What SMTP cannot tell is
// an attempt whose whole message was handed over and whose reply was lost
// (a timeout, a reset, a process killed mid-send): the server may have
// accepted it.
// Such an attempt is "uncertain", and a row sends again after at most
// MaxUncertainMail of them: one row puts at most MaxUncertainMail+1
// copies in the buyer's mailbox, all with the same Message-ID (derived from
// the row, so a receiver can tell them apart from a real second mail).
// After MaxUncertainMail+1 uncertain attempts the row is FAILED with an
// alert that says the buyer may well have it. An outcome the database
// would not record (a blip after the server's 250) would make an
// uncertain attempt of a confirmed one: recording it is tried again
// (Mailer.finish) before the row is left to be taken over.

// MailCause says why a mail exists.
type MailCause string

const (
	MailForPayment MailCause = "PAID"   // the order was paid: the one automatic mail per payment
	MailResend     MailCause = "RESEND" // an admin asked for another
)

// MaxUncertainMail is how many uncertain attempts one mail may follow with
// another attempt (see above): a mail reaches its buyer at most
// MaxUncertainMail+1 times.
const MaxUncertainMail = 1

// DefaultMailBackoff is the wait before each retry of a mail that was not
// delivered; after the last step the mail is FAILED. Attempts that reached
// no message are counted apart and never use it up (see mailRetry).
var DefaultMailBackoff = []time.Duration{time.Minute, 5 * time.Minute, 30 * time.Minute, 2 * time.Hour}

// MailOutcome is how one attempt at a mail ended, as
// kami_mail_attempts_total and mail_sends.last_outcome name it.
type MailOutcome string

const (
	MailOutcomeSent    MailOutcome = "sent"
	MailOutcomeNotSent MailOutcome = "not_sent"
	// Not sent: the server refused kami itself, before any message.
	MailOutcomeServerRefused MailOutcome = "server_refused"
	// Not sent: no connection, TLS or a reply other than a 5xx before any
	// message.
	MailOutcomeUnreachable MailOutcome = "unreachable"
	MailOutcomeRefused     MailOutcome = "refused"
	MailOutcomeUncertain   MailOutcome = "uncertain"
)

// MailOutcomes lists every outcome; the schema's CHECK on
// mail_sends.last_outcome repeats it, and an empty one: no attempt ended yet.
var MailOutcomes = []MailOutcome{MailOutcomeSent, MailOutcomeNotSent, MailOutcomeServerRefused, MailOutcomeUnreachable, MailOutcomeRefused, MailOutcomeUncertain}

// mailOutcome names how an attempt ended (sendErr nil: the server accepted
// it; else a *mail.Error, anything else being not sent).
func mailOutcome(sendErr error) MailOutcome {
	var me *kmail.Error
	switch {
	case sendErr == nil:
		return MailOutcomeSent
	case !errors.As(sendErr, &me):
		return MailOutcomeNotSent
	case me.ServerRefused():
		return MailOutcomeServerRefused
	case me.BeforeMessage:
		return MailOutcomeUnreachable
	case me.Outcome == kmail.Refused:
		return MailOutcomeRefused
	case me.Outcome == kmail.Uncertain:
		return MailOutcomeUncertain
	}
	return MailOutcomeNotSent
}

// MailActor is the actor of the reveal a mail records.
const MailActor = "mail"

// MailSend is one mail_sends row.
type MailSend struct {
	bun.BaseModel `bun:"table:mail_sends"`

	ID       int64      `bun:"id,pk,autoincrement"`
	OrderNo  string     `bun:"order_no"`
	TradeNo  string     `bun:"trade_no"` // the payment it is for
	Cause    MailCause  `bun:"cause"`
	DedupKey string     `bun:"dedup_key"`
	Status   MailStatus `bun:"status"`
	Attempts int        `bun:"attempts"`
	// Uncertain counts the attempts whose outcome the server did not
	// confirm either way.
	Uncertain int `bun:"uncertain"`
	// Unreached counts the attempts that ended before any message (see
	// mail.Error.BeforeMessage): they use none of the attempt budget,
	// which Attempts - Unreached count against.
	Unreached int `bun:"unreached"`
	// LastOutcome is how the last attempt that ended did (empty before any):
	// while the mail is QUEUED or SENDING, MailOutcomeUnreachable means it
	// waits on the SMTP server (WaitingMails).
	LastOutcome MailOutcome `bun:"last_outcome"`
	// NextDueAt: when a QUEUED mail is due; for a SENDING one, the
	// attempt's deadline (past it, its process died). The database's clock.
	NextDueAt   time.Time `bun:"next_due_at,nullzero"`
	LastError   string    `bun:"last_error"`
	SentAt      time.Time `bun:"sent_at,nullzero"`
	RequestedBy string    `bun:"requested_by"`
	CreatedAt   time.Time `bun:"created_at"`
	UpdatedAt   time.Time `bun:"updated_at"`
}

// MessageID is the left part of the mail's Message-ID: the same for every
// attempt at this row, different for every row.
func (m *MailSend) MessageID() string {
	return "kami-mail-" + strconv.FormatInt(m.ID, 10) + "." + m.OrderNo
}

// EmailContact reports whether a (normalized) contact is an email address
// kami mails codes to: a plain address at a domain name with a dot and a
// top-level domain of letters. A contact is the buyer's input, and a mail
// is sent by kami's own SMTP server: an IP literal (a@[10.0.0.5]), a bare
// or single-label host (root@localhost, a@127.0.0.1, postmaster@b) or
// source routing in the local part (a%b.com@relay, a!b@relay) would let a
// buyer aim that server at the shop's own network or have it relay
// elsewhere. Such contacts stay valid contacts; they are simply not mailed.
func EmailContact(contact string) bool {
	a, err := mail.ParseAddress(contact)
	if err != nil || a.Name != "" || a.Address != contact {
		return false
	}
	at := strings.LastIndexByte(contact, '@')
	local, domain := contact[:at], contact[at+1:]
	if strings.ContainsAny(local, "%!") {
		return false
	}
	labels := strings.Split(domain, ".")
	if len(labels) < 2 {
		return false
	}
	for _, label := range labels {
		if label == "" || strings.HasPrefix(label, "-") || strings.HasSuffix(label, "-") ||
			strings.IndexFunc(label, func(r rune) bool { return r != '-' && !unicode.IsLetter(r) && !unicode.IsDigit(r) }) >= 0 {
			return false
		}
	}
	tld := labels[len(labels)-1]
	return strings.HasPrefix(tld, "xn--") || strings.IndexFunc(tld, func(r rune) bool { return !unicode.IsLetter(r) }) < 0
}

// queueOrderMails writes, inside the transaction that delivers the given
// orders, the mail of each whose contact is an email address, when mail is
// on. It returns the rows written by order number.
func (l *Ledger) queueOrderMails(ctx context.Context, tx bun.Tx, now time.Time, orders ...*Order) (map[string]*MailSend, error) {
	if !l.cfg.Mail {
		return nil, nil
	}
	var rows []MailSend
	due := l.DBTime()
	for _, o := range orders {
		if !EmailContact(o.Contact) {
			continue
		}
		sum := sha256.Sum256([]byte(o.Provider + "\x00" + o.TradeNo))
		rows = append(rows, MailSend{OrderNo: o.OrderNo, TradeNo: o.TradeNo, Cause: MailForPayment,
			DedupKey: "paid:" + o.OrderNo + ":" + hex.EncodeToString(sum[:8]), Status: MailQueued,
			NextDueAt: due, RequestedBy: "system", CreatedAt: now, UpdatedAt: now})
	}
	if len(rows) == 0 {
		return nil, nil
	}
	if _, err := tx.NewInsert().Model(&rows).Exec(ctx); err != nil {
		return nil, err
	}
	// Read back for their ids: a multi-row insert does not return them on
	// every database.
	keys := make([]string, len(rows))
	for i := range rows {
		keys[i] = rows[i].DedupKey
	}
	var stored []MailSend
	if err := tx.NewSelect().Model(&stored).Where("dedup_key IN (?)", bun.List(keys)).Scan(ctx); err != nil {
		return nil, err
	}
	out := make(map[string]*MailSend, len(stored))
	for i := range stored {
		out[stored[i].OrderNo] = &stored[i]
	}
	return out, nil
}

func whereMailID(id int64) func(*bun.UpdateQuery) *bun.UpdateQuery {
	return func(q *bun.UpdateQuery) *bun.UpdateQuery { return q.Where("id = ?", id) }
}

func mailIn(ctx context.Context, db bun.IDB, id int64) (*MailSend, error) {
	var m MailSend
	if err := db.NewSelect().Model(&m).Where("id = ?", id).Scan(ctx); err != nil {
		return nil, notFound(err, "mail %d not found", id)
	}
	return &m, nil
}

// Mail returns one mail row. NOT_FOUND.
func (l *Ledger) Mail(ctx context.Context, id int64) (*MailSend, error) { return mailIn(ctx, l.db, id) }

// OrderMails lists an order's mails, newest first. NOT_FOUND for no such
// order.
func (l *Ledger) OrderMails(ctx context.Context, orderNo string) ([]MailSend, error) {
	if _, err := l.Order(ctx, orderNo); err != nil {
		return nil, err
	}
	var ms []MailSend
	err := l.db.NewSelect().Model(&ms).Where("order_no = ?", orderNo).OrderExpr("id DESC").Limit(100).Scan(ctx)
	return ms, err
}

// openMails are the statuses of a mail not sent yet: waiting for an
// attempt, or in one.
var openMails = []MailStatus{MailQueued, MailSending}

// OpenMails lists mails QUEUED or SENDING, by due time, for the sweeper
// that rebuilds the mail queue.
func (l *Ledger) OpenMails(ctx context.Context, limit int) ([]MailSend, error) {
	var ms []MailSend
	err := l.db.NewSelect().Model(&ms).Column("id", "status", "next_due_at").
		Where("status IN (?)", bun.List(openMails)).
		OrderExpr("next_due_at, id").Limit(int64(limit)).Scan(ctx)
	return ms, err
}

// WaitingMails counts the mails not sent yet (QUEUED, or SENDING an
// attempt) by how their last attempt ended (empty for none yet). Those whose
// last attempt was unreachable or server_refused wait on the SMTP server,
// at backoff steps that may be hours apart; a SENDING one keeps its last
// outcome until the attempt under way ends, so the figure does not dip
// while it is tried again.
func (l *Ledger) WaitingMails(ctx context.Context) (map[MailOutcome]int64, error) {
	var rows []struct {
		LastOutcome MailOutcome `bun:"last_outcome"`
		N           int64       `bun:"n"`
	}
	err := l.db.NewSelect().Model((*MailSend)(nil)).ColumnExpr("last_outcome, COUNT(*) AS n").
		Where("status IN (?)", bun.List(openMails)).GroupExpr("last_outcome").Scan(ctx, &rows)
	if err != nil {
		return nil, err
	}
	out := make(map[MailOutcome]int64, len(rows))
	for _, r := range rows {
		out[r.LastOutcome] = r.N
	}
	return out, nil
}

// ResendOrderMail queues another mail of a delivered order's codes for an
// admin: a new row, with its own Message-ID. NOT_FOUND, CONFLICT (not
// delivered, or the contact is no email address), UNAVAILABLE (mail is
// off).
func (l *Ledger) ResendOrderMail(ctx context.Context, orderNo, actor string) (*MailSend, error) {
	if err := checkOrderNo(orderNo); err != nil {
		return nil, err
	}
	if !l.cfg.Mail {
		return nil, Errorf(EUNAVAILABLE, "mail is off: set KAMI_SMTP_URL and KAMI_MAIL_FROM")
	}
	var m *MailSend
	err := inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
		now := l.now()
		o, err := orderIn(ctx, tx, orderNo)
		if err != nil {
			return err
		}
		if o.Status != OrderPaid {
			return Errorf(ECONFLICT, "order %s is %s; only a PAID order's codes are mailed", orderNo, o.Status)
		}
		if !EmailContact(o.Contact) {
			return Errorf(ECONFLICT, "order %s's contact is not an email address", orderNo)
		}
		var nonce [8]byte
		_, _ = rand.Read(nonce[:])
		m = &MailSend{OrderNo: o.OrderNo, TradeNo: o.TradeNo, Cause: MailResend, DedupKey: "resend:" + o.OrderNo + ":" + hex.EncodeToString(nonce[:]),
			Status: MailQueued, NextDueAt: l.DBTime(), RequestedBy: actorOr(actor), CreatedAt: now, UpdatedAt: now}
		if _, err := tx.NewInsert().Model(m).Exec(ctx); err != nil {
			return err
		}
		if m, err = mailByKey(ctx, tx, m.DedupKey); err != nil {
			return err
		}
		return audit(ctx, tx, now, actor, "order.resend_mail", orderNo, fmt.Sprint(m.ID))
	})
	if err != nil {
		return nil, err
	}
	return m, nil
}

func mailByKey(ctx context.Context, db bun.IDB, key string) (*MailSend, error) {
	var m MailSend
	if err := db.NewSelect().Model(&m).Where("dedup_key = ?", key).Scan(ctx); err != nil {
		return nil, err
	}
	return &m, nil
}

// MailAttempt is an attempt BeginMailAttempt started: the row (SENDING,
// Attempts already counting this one) and what to send.
type MailAttempt struct {
	Mail    MailSend
	To      string
	Product string
	Order   Order
}

// MailBegin is what BeginMailAttempt did.
type MailBegin struct {
	Attempt *MailAttempt // the attempt begun; nil when there is nothing to do now
	Mail    *MailSend    // the row as it is now
	GaveUp  bool         // this call moved the row to FAILED
}

// BeginMailAttempt starts an attempt at mail id if it is due: QUEUED and
// due, or SENDING past its deadline (a process died mid-attempt: counted
// as uncertain). In one transaction, before anything is sent: the row →
// SENDING with a deadline of budget, and the reveal of the order's codes
// (channel MAIL, actor "mail"). Nothing to do now (sent, failed, not due,
// another attempt under way, or given up here: the order is no longer
// paid, or a dead attempt was the uncertain one too many) leaves Attempt
// nil. NOT_FOUND.
func (l *Ledger) BeginMailAttempt(ctx context.Context, id int64, budget time.Duration) (MailBegin, error) {
	var at *MailAttempt
	var cur *MailSend
	var alert *Alert
	err := inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
		at, alert = nil, nil
		var err error
		if cur, err = mailIn(ctx, tx, id); err != nil {
			return err
		}
		now, due := l.now(), l.DBTime()
		m := *cur
		byAttempt := func(q *bun.UpdateQuery) *bun.UpdateQuery {
			return whereMailID(id)(q).Where("attempts = ?", m.Attempts)
		}
		var t Transition
		uncertain := m.Uncertain
		counts := []column{}
		switch {
		case m.Status == MailQueued && !m.NextDueAt.After(due):
			t = MailBeginAttempt
		case m.Status == MailSending && m.NextDueAt.Before(due):
			// Its process died after it began: the server may have it.
			t, uncertain = MailTakeOver, uncertain+1
			counts = append(counts, col("last_outcome = ?", MailOutcomeUncertain))
		default:
			return nil // done, not due, or under way elsewhere
		}
		counts = append(counts, col("uncertain = ?", uncertain))
		o, err := orderIn(ctx, tx, m.OrderNo)
		if err != nil {
			return err
		}
		var reason string
		switch {
		case o.Status != OrderPaid:
			reason = fmt.Sprintf("order is %s; its codes are no longer mailed", o.Status)
		case uncertain > MaxUncertainMail:
			reason = fmt.Sprintf("an attempt's process ended mid-send, after %d uncertain attempts: the buyer may have the mail; not sent again", m.Uncertain)
		}
		if reason != "" {
			n, err := apply(ctx, tx, MailGiveUp, now, byAttempt, append(counts, col("last_error = ?", reason), col("next_due_at = NULL"))...)
			if err != nil {
				return err
			}
			if n == 1 {
				alert = &Alert{Kind: "mail_failed", Subject: m.OrderNo, Message: fmt.Sprintf("mail %d: %s", id, reason)}
			}
			cur, err = mailIn(ctx, tx, id)
			return err
		}
		n, err := apply(ctx, tx, t, now, byAttempt, append(counts, col("attempts = ?", m.Attempts+1), col("next_due_at = ?", due.Add(budget)))...)
		if err != nil {
			return err
		}
		if n == 0 { // another worker began it first
			cur, err = mailIn(ctx, tx, id)
			return err
		}
		p, err := productsByID(ctx, tx, []int64{o.ProductID})
		if err != nil {
			return err
		}
		// Recorded before the codes leave, as every reveal is.
		if err := recordReveals(ctx, tx, now, []Reveal{{Channel: RevealMail, Viewer: ViewerBuyer, Actor: MailActor,
			OrderNo: o.OrderNo, Codes: o.Quantity, Ref: "mail:" + strconv.FormatInt(id, 10)}}); err != nil {
			return err
		}
		m.Status, m.Attempts, m.Uncertain, m.NextDueAt = MailSending, m.Attempts+1, uncertain, due.Add(budget)
		if uncertain > m.Uncertain { // taken over
			m.LastOutcome = MailOutcomeUncertain
		}
		at = &MailAttempt{Mail: m, To: o.Contact, Order: *o}
		if prod := p[o.ProductID]; prod != nil {
			at.Product = prod.Name
		}
		return nil
	})
	if err != nil {
		return MailBegin{}, err
	}
	if alert != nil {
		l.alerts.Alert(ctx, *alert)
	}
	if at != nil {
		return MailBegin{Attempt: at, Mail: &at.Mail}, nil
	}
	return MailBegin{Mail: cur, GaveUp: alert != nil}, nil
}

// FinishMailAttempt records how attempt number attempt of mail id ended
// (sendErr nil: the server accepted it; else a *mail.Error): SENT; or
// QUEUED again after the next step of the backoff; or FAILED with the last
// error and an alert (a refusal, the backoff used up by attempts that
// reached a message, or a second uncertain attempt). An attempt that ended
// before any message never fails the mail (see mailRetry). A second report
// of the same attempt changes nothing.
func (l *Ledger) FinishMailAttempt(ctx context.Context, id int64, attempt int, sendErr error) (*MailSend, error) {
	var cur *MailSend
	var alert *Alert
	err := inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
		alert = nil
		m, err := mailIn(ctx, tx, id)
		if err != nil {
			return err
		}
		now := l.now()
		// The attempt under way: a report of an attempt already recorded
		// (the row QUEUED again after it) matches no row, even for
		// MailGiveUp, which may also move a QUEUED row.
		byAttempt := func(q *bun.UpdateQuery) *bun.UpdateQuery {
			return whereMailID(id)(q).Where("attempts = ?", attempt).Where("status = ?", MailSending)
		}
		if sendErr == nil {
			if _, err := apply(ctx, tx, MailDone, now, byAttempt, col("sent_at = ?", now), col("next_due_at = NULL"), col("last_outcome = ?", MailOutcomeSent)); err != nil {
				return err
			}
			cur, err = mailIn(ctx, tx, id)
			return err
		}
		out, detail := kmail.NotSent, sendErr.Error()
		var me *kmail.Error
		if errors.As(sendErr, &me) {
			out, detail = me.Outcome, me.Error()
		}
		detail = truncate(detail, 512)
		uncertain, unreached := m.Uncertain, m.Unreached
		switch {
		case out == kmail.Uncertain:
			uncertain++
		case me != nil && me.BeforeMessage:
			unreached++
		}
		wait, usedUp := l.mailRetry(attempt, unreached, me != nil && me.BeforeMessage)
		var reason string
		switch {
		case out == kmail.Refused:
			reason = "refused by the mail server"
		case uncertain > MaxUncertainMail:
			reason = fmt.Sprintf("%d attempts handed the whole message over and heard no reply: the buyer may well have it; not sent again", uncertain)
		case usedUp:
			reason = fmt.Sprintf("not delivered after %d attempts", attempt-unreached)
		}
		counts := []column{col("uncertain = ?", uncertain), col("unreached = ?", unreached), col("last_error = ?", detail),
			col("last_outcome = ?", mailOutcome(sendErr))}
		if reason != "" {
			n, err := apply(ctx, tx, MailGiveUp, now, byAttempt, append(counts, col("next_due_at = NULL"))...)
			if err != nil {
				return err
			}
			if n == 1 {
				alert = &Alert{Kind: "mail_failed", Subject: m.OrderNo, Message: fmt.Sprintf("mail %d %s: %s; send it again with resendOrderMail", id, reason, detail)}
			}
		} else {
			if _, err := apply(ctx, tx, MailRetry, now, byAttempt, append(counts, col("next_due_at = ?", l.DBTime().Add(wait)))...); err != nil {
				return err
			}
		}
		cur, err = mailIn(ctx, tx, id)
		return err
	})
	if err != nil {
		return nil, err
	}
	if alert != nil {
		l.alerts.Alert(ctx, *alert)
	}
	return cur, nil
}

func (l *Ledger) mailBackoff() []time.Duration {
	if len(l.cfg.MailBackoff) == 0 {
		return DefaultMailBackoff
	}
	return l.cfg.MailBackoff
}

// mailRetry is the rule for a mail's failed attempt number attempt, of
// which unreached (this one included) ended before any message: the wait
// before the next attempt, and whether the backoff is used up (the mail
// is FAILED). Only attempts that reached a message count against the
// backoff, step by step; beforeMessage, this attempt reached none: it
// waits the step its number among those says, the longest step once past
// the last, and never uses the backoff up.
func (l *Ledger) mailRetry(attempt, unreached int, beforeMessage bool) (wait time.Duration, usedUp bool) {
	bo := l.mailBackoff()
	n := attempt - unreached
	if beforeMessage {
		n = unreached
	}
	if n > len(bo) {
		return bo[len(bo)-1], !beforeMessage
	}
	return bo[n-1], false
}

// MailSender sends one mail (mail.Sender).
type MailSender interface {
	Send(ctx context.Context, m kmail.Message) error
	// AttemptBudget is the longest one Send can take.
	AttemptBudget() time.Duration
}

// MailScheduler puts a mail on the mail queue (queue.MailWorker). Losing a
// schedule is not fatal: the mail sweeper rebuilds it from the database.
type MailScheduler interface {
	ScheduleMail(ctx context.Context, id int64, due time.Time) error
}

// MailObserver hears each attempt's outcome (metrics).
type MailObserver interface {
	// MailAttempted: one of MailOutcomes. server_refused and unreachable
	// attempts use none of a mail's attempt budget.
	MailAttempted(outcome string)
	MailFailed()
}

// Mailer sends queued mails: the flow around one attempt.
type Mailer struct {
	Ledger   *Ledger
	Sender   MailSender
	Log      *slog.Logger
	Observer MailObserver

	// refused: the last attempt that got an answer about kami itself was
	// the SMTP server refusing it (see mail.Error.ServerRefused); the
	// mail_server_refused alert is raised once, when this turns true.
	refused atomic.Bool
}

// FinishTries is how many times Deliver tries to record an attempt's
// outcome before it leaves the row to be taken over past its deadline
// (which sends the mail again); the waits between them grow from
// finishFirstWait, a few seconds in all.
const (
	FinishTries     = 6
	finishFirstWait = 100 * time.Millisecond
)

// Deliver makes one attempt at mail id if it is due, and returns the row
// as it is after it: QUEUED with its next due time, SENDING under another
// attempt until its deadline, or SENT or FAILED. NOT_FOUND.
func (m *Mailer) Deliver(ctx context.Context, id int64) (*MailSend, error) {
	b, err := m.Ledger.BeginMailAttempt(ctx, id, m.Sender.AttemptBudget())
	if err != nil {
		return nil, err
	}
	if b.GaveUp && m.Observer != nil {
		m.Observer.MailFailed()
	}
	at := b.Attempt
	if at == nil {
		return b.Mail, nil
	}
	var sendErr error
	talked := false // the server was asked (not: the codes could not be read)
	codes, err := m.Ledger.SoldCodes(ctx, []string{at.Order.OrderNo})
	if err != nil {
		// Nothing was sent: this attempt ends as not sent, not as one
		// whose deadline passes and that counts as uncertain.
		sendErr = &kmail.Error{Outcome: kmail.NotSent, Detail: "the codes could not be read"}
		m.log().WarnContext(ctx, "order mail: reading the codes failed", "mail", id, "order", at.Order.OrderNo, "err", err)
	} else {
		msg := kmail.Message{To: at.To, MessageID: at.Mail.MessageID(), OrderNo: at.Order.OrderNo, Product: at.Product,
			Quantity: at.Order.Quantity, Codes: codes[at.Order.OrderNo]}
		sendCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), m.Sender.AttemptBudget())
		sendErr, talked = m.Sender.Send(sendCtx, msg), true
		cancel()
	}
	res, err := m.finish(ctx, id, at.Mail.Attempts, sendErr)
	outcome := mailOutcome(sendErr)
	var me *kmail.Error
	errors.As(sendErr, &me)
	if talked {
		m.noteServer(ctx, sendErr, me)
	}
	m.log().InfoContext(ctx, "order mail attempt", "mail", id, "order", at.Order.OrderNo, "attempt", at.Mail.Attempts,
		"outcome", outcome, "err", mailErrText(sendErr))
	if m.Observer != nil {
		m.Observer.MailAttempted(string(outcome))
		if err == nil && res.Status == MailFailed {
			m.Observer.MailFailed()
		}
	}
	return res, err
}

// finish records how an attempt ended. If the server took the message, a
// record that fails leaves the row SENDING, and past its deadline another
// attempt takes it over and mails the buyer again: a failed record (a
// database blip) is tried again, FinishTries times at most, unless ctx
// ends (the worker stops) or the ledger gives a definite answer (an
// *Error). Each try is its own transaction, and a second record of one
// attempt changes nothing, so a try whose commit went through unheard is
// harmless.
func (m *Mailer) finish(ctx context.Context, id int64, attempt int, sendErr error) (*MailSend, error) {
	wait := finishFirstWait
	for try := 1; ; try++ {
		res, err := m.Ledger.FinishMailAttempt(context.WithoutCancel(ctx), id, attempt, sendErr)
		var de *Error
		if err == nil || try == FinishTries || errors.As(err, &de) {
			return res, err
		}
		m.log().WarnContext(ctx, "order mail: recording the attempt failed; trying again", "mail", id, "attempt", attempt, "try", try, "err", err)
		select {
		case <-ctx.Done():
			return nil, err
		case <-time.After(wait):
		}
		wait *= 2
	}
}

// noteServer raises one mail_server_refused alert when the SMTP server
// starts refusing kami itself (a 5xx before any message: wrong
// credentials, a blocked sender), rather than a mail_failed per order:
// those mails are not failed, they wait with backoff for the settings or
// the server to be fixed. Once an attempt gets as far as a message the
// refusal is over, and the next one alerts again.
func (m *Mailer) noteServer(ctx context.Context, sendErr error, me *kmail.Error) {
	switch {
	case me != nil && me.ServerRefused():
		if m.refused.CompareAndSwap(false, true) {
			m.Ledger.alerts.Alert(ctx, Alert{Kind: "mail_server_refused", Subject: "smtp",
				Message: "the SMTP server refuses kami before any message (" + me.Detail + "): check KAMI_SMTP_URL's user and password and the server; order mails wait and are retried with backoff"})
		}
	case sendErr == nil || me != nil && !me.BeforeMessage:
		m.refused.Store(false)
	}
}

// mailErrText is a send error's text for the log, "" for none.
func mailErrText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

func (m *Mailer) log() *slog.Logger {
	if m.Log != nil {
		return m.Log
	}
	return slog.Default()
}

// ResendOrderMail queues another mail of a PAID order's codes for an admin
// and schedules it. Errors as Ledger.ResendOrderMail.
func (s *Shop) ResendOrderMail(ctx context.Context, orderNo, actor string) (*MailSend, error) {
	m, err := s.Ledger.ResendOrderMail(ctx, orderNo, actor)
	if err != nil {
		return nil, err
	}
	s.ScheduleMail(ctx, m)
	return m, nil
}
