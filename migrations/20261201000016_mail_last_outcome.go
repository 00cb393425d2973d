package migrations

func init() { Migrations.MustRegister(run(mailLastOutcomeUp), run(mailLastOutcomeDown)) }

// mail_sends.last_outcome is how a mail's last attempt ended, as the
// kami_mail_attempts_total outcomes name it (empty before any attempt
// ended). A mail still QUEUED or SENDING whose last attempt was
// unreachable waits on the SMTP server, not on its backoff: the
// kami_mail_waiting gauge counts them, so an alert holds for as long as
// they wait, however far apart their attempts are. A row open when this
// runs stays empty until its next attempt ends.
const mailLastOutcomeUp = `
ALTER TABLE mail_sends ADD COLUMN last_outcome VARCHAR(16) NOT NULL DEFAULT ''
	CHECK (last_outcome IN ('','sent','not_sent','server_refused','unreachable','refused','uncertain'));
`

const mailLastOutcomeDown = `
ALTER TABLE mail_sends DROP COLUMN last_outcome;
`
