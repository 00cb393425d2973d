package migrations_test

import (
	"context"
	"testing"
	"time"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/domain/domaintest"
	"kami/migrations"
)

// TestPendingOrderMigrationBesideAPlacement: on PostgreSQL the
// pending_order migration runs while a placement is under way, one that
// has read orders and writes to it after the migration began. Both
// finish: the migration waits for the placement, whose write goes first.
// With a lock that lets the placement's read by (SHARE) and is raised
// later (by the DROP INDEX), the two deadlocked and one was aborted.
func TestPendingOrderMigrationBesideAPlacement(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, err := domain.OpenDB(ctx, dbtest.URL(t, dbtest.Postgres), t.TempDir(), domain.DBOptions{MaxOpenConns: 8})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	migrateTo(t, db, "20261201000016_mail_last_outcome")
	placement, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer placement.Rollback()
	if _, err := placement.ExecContext(ctx, "SELECT COUNT(*) FROM orders"); err != nil {
		t.Fatal(err)
	}
	migrated := make(chan error, 1)
	go func() {
		_, err := migrations.Migrate(ctx, db)
		migrated <- err
	}()
	// The migration waits for a lock on orders the placement holds.
	domaintest.Eventually(t, time.Minute, "the migration waiting for the placement's lock on orders", func() bool {
		select {
		case err := <-migrated:
			t.Fatalf("the migration ended (%v) while a placement held orders", err)
		default:
		}
		var waiting int
		if err := db.QueryRowContext(ctx, `SELECT COUNT(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
			WHERE c.relname = 'orders' AND c.relnamespace = current_schema()::regnamespace AND NOT l.granted`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		return waiting > 0
	})
	if _, err := placement.ExecContext(ctx, "UPDATE orders SET status = status WHERE id = -1"); err != nil {
		t.Fatalf("the placement's write: %v", err)
	}
	if err := placement.Commit(); err != nil {
		t.Fatalf("the placement's commit: %v", err)
	}
	if err := <-migrated; err != nil {
		t.Fatalf("the migration: %v", err)
	}
}
