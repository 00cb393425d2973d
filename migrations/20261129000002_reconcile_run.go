package migrations

func init() { Migrations.MustRegister(run(reconcileRunUp), run(reconcileRunDown)) }

// reconcile_run keeps one row per nightly reconciliation, for admins.
const reconcileRunUp = `
CREATE TABLE reconcile_run (
	id {{ID}},
	started_at {{TS}} NOT NULL,
	finished_at {{TS}} NOT NULL,
	closed_stragglers INTEGER NOT NULL,
	stale_refunds INTEGER NOT NULL,
	rescheduled INTEGER NOT NULL,
	counters_repaired INTEGER NOT NULL,
	violations INTEGER NOT NULL,
	summary {{TEXT}} NOT NULL,
	error VARCHAR(512) NOT NULL
) {{TABLE}};
CREATE INDEX reconcile_run_started ON reconcile_run (started_at);
`

const reconcileRunDown = `
DROP TABLE reconcile_run;
`
