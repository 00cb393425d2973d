package migrations

func init() { Migrations.MustRegister(run(webhookResendsUp), run(webhookResendsDown)) }

// webhook_delivery.resends counts the rounds an admin started with
// redeliverWebhookEvent: each sets attempts back to 0, and only resends
// goes up. An attempt is taken and recorded under (resends, attempts), so
// a worker that outlived its attempt cannot overwrite a newer round's
// record, which attempts alone, reset by the resend, could not tell.
const webhookResendsUp = `
ALTER TABLE webhook_delivery ADD COLUMN resends INTEGER NOT NULL DEFAULT 0 CHECK (resends >= 0);
`

const webhookResendsDown = `
ALTER TABLE webhook_delivery DROP COLUMN resends;
`
