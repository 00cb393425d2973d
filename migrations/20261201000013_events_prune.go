package migrations

import (
	"context"

	"github.com/uptrace/bun"
)

// The webhook sweeper prunes events fanned out before KAMI_WEBHOOK_KEEP
// every sweep: by (fanned_out, occurred_at) it reads only the old ones,
// not every event of the kept window.
func init() {
	Migrations.MustRegister(run(`CREATE INDEX events_prune ON events (fanned_out, occurred_at);`), step(func(ctx context.Context, db bun.IDB) error {
		return dropIndex(ctx, db, "events", "events_prune")
	}))
}
