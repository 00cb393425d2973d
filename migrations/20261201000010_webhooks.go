package migrations

func init() { Migrations.MustRegister(run(webhooksUp), run(webhooksDown)) }

// The outbox and the signed outgoing webhooks.
//
// events is the outbox: one row per business event, written in the same
// transaction as the ledger change it reports, so a crash can neither lose
// one nor invent one. payload is the object as an admin sees it in
// GraphQL (never a card code). fanned_out says whether the dispatcher has
// made its deliveries; the (fanned_out, id) index is its scan.
//
// webhook_endpoint is a seller's receiver: the events it wants (a
// comma-separated list), its secret sealed with the card key (and, while
// a rotation runs, the previous one and when it stops being valid).
// deleted_at hides a deleted endpoint; its deliveries stay for the log.
//
// webhook_delivery is one event for one endpoint, unique per pair: its
// status, attempts, when the next attempt is due, and what the last one
// got back.
const webhooksUp = `
CREATE TABLE events (
	id {{ID}},
	type VARCHAR(32) NOT NULL,
	subject VARCHAR(64) NOT NULL,
	occurred_at {{TS}} NOT NULL,
	payload {{BIGTEXT}} NOT NULL,
	fanned_out {{BOOL}} NOT NULL
) {{TABLE}};
CREATE INDEX events_fan_out ON events (fanned_out, id);
CREATE INDEX events_subject ON events (subject, id);

CREATE TABLE webhook_endpoint (
	id {{ID}},
	url VARCHAR(2048) NOT NULL,
	description VARCHAR(255) NOT NULL,
	events VARCHAR(512) NOT NULL,
	enabled {{BOOL}} NOT NULL,
	receives_codes {{BOOL}} NOT NULL,
	secret_enc {{BLOB}} NOT NULL,
	prev_secret_enc {{BLOB}} NULL,
	prev_secret_until {{TS}} NULL,
	deleted_at {{TS}} NULL,
	created_at {{TS}} NOT NULL,
	updated_at {{TS}} NOT NULL
) {{TABLE}};

CREATE TABLE webhook_delivery (
	id {{ID}},
	event_id BIGINT NOT NULL,
	endpoint_id BIGINT NOT NULL,
	status VARCHAR(16) NOT NULL CHECK (status IN ('PENDING','DELIVERED','FAILED','CANCELLED')),
	attempts INTEGER NOT NULL CHECK (attempts >= 0),
	next_attempt_at {{TS}} NULL,
	last_attempt_at {{TS}} NULL,
	last_status INTEGER NOT NULL,
	last_latency_ms INTEGER NOT NULL,
	last_error VARCHAR(255) NOT NULL,
	response_snippet VARCHAR(512) NOT NULL,
	created_at {{TS}} NOT NULL,
	updated_at {{TS}} NOT NULL,
	delivered_at {{TS}} NULL,
	FOREIGN KEY (event_id) REFERENCES events (id),
	FOREIGN KEY (endpoint_id) REFERENCES webhook_endpoint (id)
) {{TABLE}};
CREATE UNIQUE INDEX webhook_delivery_pair ON webhook_delivery (endpoint_id, event_id);
CREATE INDEX webhook_delivery_due ON webhook_delivery (status, next_attempt_at);
CREATE INDEX webhook_delivery_age ON webhook_delivery (status, created_at);
CREATE INDEX webhook_delivery_event ON webhook_delivery (event_id);
`

const webhooksDown = `
DROP TABLE webhook_delivery;
DROP TABLE webhook_endpoint;
DROP TABLE events;
`
