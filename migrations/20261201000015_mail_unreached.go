package migrations

func init() { Migrations.MustRegister(run(mailUnreachedUp), run(mailUnreachedDown)) }

// mail_sends.unreached counts a mail's attempts that ended before any
// message: kami could not connect (TCP, TLS) or the server refused kami
// itself (a reply to the greeting, EHLO, STARTTLS or AUTH). Such an
// attempt is no answer about the mail, so it uses none of the mail's
// attempt budget (attempts - unreached attempts reached a message);
// attempts still counts every attempt, the guard that makes a second
// report of one attempt change nothing.
const mailUnreachedUp = `
ALTER TABLE mail_sends ADD COLUMN unreached INTEGER NOT NULL DEFAULT 0 CHECK (unreached >= 0);
`

const mailUnreachedDown = `
ALTER TABLE mail_sends DROP COLUMN unreached;
`
