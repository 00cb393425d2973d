package migrations_test

import (
	"context"
	"testing"

	"github.com/uptrace/bun"
	"github.com/uptrace/bun/migrate"

	"kami/domain/dbtest"
	"kami/migrations"
)

// TestUpDownUp applies every migration (dbtest.Each did), rolls them all
// back one group at a time, and applies them again, on every database.
func TestUpDownUp(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		ctx := context.Background()
		pending, err := migrations.Pending(ctx, db)
		if err != nil || len(pending) != 0 {
			t.Fatalf("pending after migrate: %v %v", pending, err)
		}
		m := migrate.NewMigrator(db, migrations.Migrations)
		for {
			group, err := m.Rollback(ctx)
			if err != nil {
				t.Fatalf("rollback: %v", err)
			}
			if group.IsZero() {
				break
			}
		}
		if pending, _ := migrations.Pending(ctx, db); len(pending) != len(migrations.Migrations.Sorted()) {
			t.Fatalf("after rollback %d pending, want all", len(pending))
		}
		applied, err := migrations.Migrate(ctx, db)
		if err != nil || len(applied) != len(migrations.Migrations.Sorted()) {
			t.Fatalf("migrate again: %v %v", applied, err)
		}
		if applied2, err := migrations.Migrate(ctx, db); err != nil || len(applied2) != 0 {
			t.Fatalf("a second migrate applied %v, %v", applied2, err)
		}
	})
}
