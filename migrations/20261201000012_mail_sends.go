package migrations

func init() { Migrations.MustRegister(run(mailSendsUp), run(mailSendsDown)) }

// mail_sends: one row per mail of an order's codes to its buyer. A paid
// order whose contact is an email address gets one (cause PAID, written in
// the transaction that marks it paid); an admin's resend is another
// (cause RESEND). dedup_key makes the paid one once per order and payment.
//
// status moves QUEUED → SENDING (an attempt, committed before the message
// is sent) → SENT, or back to QUEUED for a retry, or FAILED. next_due_at
// is when a QUEUED row is due, and for a SENDING row the attempt's
// deadline: past it, its process died. uncertain counts the attempts
// whose end the server may have accepted without kami hearing its reply;
// a row sends again after at most one of them.
const mailSendsUp = `
CREATE TABLE mail_sends (
	id {{ID}},
	order_no VARCHAR(32) NOT NULL,
	trade_no VARCHAR(64) NOT NULL,
	cause VARCHAR(16) NOT NULL CHECK (cause IN ('PAID','RESEND')),
	dedup_key VARCHAR(128) NOT NULL,
	status VARCHAR(16) NOT NULL CHECK (status IN ('QUEUED','SENDING','SENT','FAILED')),
	attempts INTEGER NOT NULL CHECK (attempts >= 0),
	uncertain INTEGER NOT NULL CHECK (uncertain >= 0),
	next_due_at {{TS}} NULL,
	last_error VARCHAR(512) NOT NULL,
	sent_at {{TS}} NULL,
	requested_by VARCHAR(64) NOT NULL,
	created_at {{TS}} NOT NULL,
	updated_at {{TS}} NOT NULL
) {{TABLE}};
CREATE UNIQUE INDEX mail_sends_dedup ON mail_sends (dedup_key);
CREATE INDEX mail_sends_order ON mail_sends (order_no, id);
CREATE INDEX mail_sends_due ON mail_sends (status, next_due_at);
`

const mailSendsDown = `
DROP TABLE mail_sends;
`
