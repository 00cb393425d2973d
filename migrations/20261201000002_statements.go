package migrations

import (
	"context"

	"github.com/uptrace/bun"
)

func init() {
	Migrations.MustRegister(run(statementsUp), step(func(ctx context.Context, db bun.IDB) error {
		if err := dropIndex(ctx, db, "refund_order", "refund_order_status_finished"); err != nil {
			return err
		}
		return execAll(ctx, db, statementsDown)
	}))
}

// The statement reconciliation's record: one statement_run per statement
// reconciled (source STATEMENT: the gateway's statement of one day) or per
// check of recent trades by query (source QUERY), each with the
// differences it found and what it did about them. A run is written once,
// when it ends, with its differences, in one transaction.
//
// refund_order gets the (status, finished_at) index the reconciliation
// scans for the refunds kami saw succeed on a day.
const statementsUp = `
CREATE TABLE statement_run (
	id {{ID}},
	provider VARCHAR(16) NOT NULL,
	bill_date CHAR(10) NOT NULL,
	source VARCHAR(16) NOT NULL CHECK (source IN ('STATEMENT','QUERY')),
	status VARCHAR(16) NOT NULL CHECK (status IN ('DONE','NOT_READY','FAILED')),
	started_at {{TS}} NOT NULL,
	finished_at {{TS}} NOT NULL,
	trades INTEGER NOT NULL CHECK (trades >= 0),
	refunds INTEGER NOT NULL CHECK (refunds >= 0),
	trade_fen BIGINT NOT NULL,
	refund_fen BIGINT NOT NULL,
	matched INTEGER NOT NULL CHECK (matched >= 0),
	differences INTEGER NOT NULL CHECK (differences >= 0),
	settled INTEGER NOT NULL CHECK (settled >= 0),
	needs_person INTEGER NOT NULL CHECK (needs_person >= 0),
	error VARCHAR(512) NOT NULL
) {{TABLE}};
CREATE INDEX statement_run_started ON statement_run (started_at, id);
CREATE INDEX statement_run_day ON statement_run (provider, bill_date, source, status);

CREATE TABLE statement_difference (
	id {{ID}},
	run_id BIGINT NOT NULL,
	provider VARCHAR(16) NOT NULL,
	bill_date CHAR(10) NOT NULL,
	kind VARCHAR(32) NOT NULL CHECK (kind IN ('PAID_PENDING','PAID_CLOSED','PAID_TWICE','PAID_UNKNOWN_ORDER',
		'AMOUNT_MISMATCH','REFUND_UNKNOWN','REFUND_AMOUNT_MISMATCH','REFUND_UNCONFIRMED','REFUND_MISSING','PAYMENT_MISSING')),
	subject VARCHAR(64) NOT NULL,
	order_no VARCHAR(64) NOT NULL,
	trade_no VARCHAR(64) NOT NULL,
	refund_no VARCHAR(64) NOT NULL,
	gateway_fen BIGINT NOT NULL CHECK (gateway_fen >= 0),
	kami_fen BIGINT NOT NULL CHECK (kami_fen >= 0),
	action VARCHAR(24) NOT NULL CHECK (action IN ('DELIVERED','LATE_REFUND','LATE_DELIVERED','DUPLICATE_REFUND',
		'REFUND_CONFIRMED','ALERTED','ALREADY_REPORTED','FAILED','NONE')),
	needs_person {{BOOL}} NOT NULL,
	detail VARCHAR(512) NOT NULL,
	created_at {{TS}} NOT NULL,
	FOREIGN KEY (run_id) REFERENCES statement_run (id)
) {{TABLE}};
CREATE INDEX statement_difference_run ON statement_difference (run_id, id);
CREATE INDEX statement_difference_created ON statement_difference (created_at, id);
CREATE INDEX statement_difference_person ON statement_difference (needs_person, created_at, id);
CREATE INDEX statement_difference_subject ON statement_difference (provider, subject, kind);

CREATE INDEX refund_order_status_finished ON refund_order (status, finished_at);
`

const statementsDown = `
DROP TABLE statement_difference;
DROP TABLE statement_run;
`
