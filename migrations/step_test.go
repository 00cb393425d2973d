package migrations_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/uptrace/bun"
	"github.com/uptrace/bun/migrate"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/migrations"
)

// TestStepCutShortIsNotTakenForDone: a migration step that fails half-way
// (a dropped connection, a kill) is not marked applied, so the next start
// runs it again; where DDL is transactional (PostgreSQL, SQLite) it left
// nothing half-done and the second run completes it.
func TestStepCutShortIsNotTakenForDone(t *testing.T) {
	t.Parallel()
	eachFreshDB(t, 4, func(t *testing.T, k dbtest.Kind, _ string, db *bun.DB) {
		ctx := context.Background()
		cut := true
		up := migrations.Step(func(ctx context.Context, db bun.IDB) error {
			if _, err := db.ExecContext(ctx, `CREATE TABLE half_a (id INTEGER)`); err != nil {
				return err
			}
			if cut {
				return errors.New("connection reset by peer")
			}
			_, err := db.ExecContext(ctx, `CREATE TABLE half_b (id INTEGER)`)
			return err
		})
		ms := migrate.NewMigrations()
		ms.Add(migrate.Migration{Name: "20990101000001_half", Up: func(ctx context.Context, m *migrate.Migrator, _ *migrate.Migration) error {
			return up(ctx, m.DB())
		}})

		if _, err := migrations.MigrateWith(ctx, db, ms); err == nil {
			t.Fatal("a step cut short reported success")
		}
		status, err := migrate.NewMigrator(db, ms).MigrationsWithStatus(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(status.Unapplied()) != 1 {
			t.Fatalf("the step cut short is marked applied: %v", status)
		}
		if k == dbtest.MySQL {
			return // its DDL committed statement by statement; a person finishes it
		}
		if exists(ctx, db, "half_a") {
			t.Fatal("the step cut short left its first table behind")
		}
		cut = false
		applied, err := migrations.MigrateWith(ctx, db, ms)
		if err != nil || len(applied) != 1 {
			t.Fatalf("the step's second run: %v %v", applied, err)
		}
		if !exists(ctx, db, "half_a") || !exists(ctx, db, "half_b") {
			t.Fatal("the second run did not complete the step")
		}
	})
}

func exists(ctx context.Context, db *bun.DB, table string) bool {
	_, err := db.ExecContext(ctx, `SELECT 1 FROM `+table+` WHERE 1 = 0`)
	return err == nil
}

// eachFreshDB runs fn in parallel on a fresh, empty database of every kind,
// opened with a pool of maxConns.
func eachFreshDB(t *testing.T, maxConns int, fn func(t *testing.T, k dbtest.Kind, url string, db *bun.DB)) {
	t.Helper()
	for _, k := range []dbtest.Kind{dbtest.SQLite, dbtest.Postgres, dbtest.MySQL} {
		t.Run(string(k), func(t *testing.T) {
			t.Parallel()
			url := dbtest.URL(t, k)
			db, err := domain.OpenDB(context.Background(), url, t.TempDir(), domain.DBOptions{MaxOpenConns: maxConns})
			if err != nil {
				t.Fatal(err)
			}
			defer db.Close()
			fn(t, k, url, db)
		})
	}
}

// TestStepCommittedIsNeverPending: the connection drops (here: the start's
// context ends) right after a step's COMMIT, before bun's own mark. The
// step marked itself in its transaction, so the next start does not run it
// again (it would fail for ever on "already exists").
func TestStepCommittedIsNeverPending(t *testing.T) {
	t.Parallel()
	eachFreshDB(t, 4, func(t *testing.T, k dbtest.Kind, _ string, db *bun.DB) {
		up := migrations.Step(func(ctx context.Context, db bun.IDB) error {
			_, err := db.ExecContext(ctx, `CREATE TABLE done_a (id INTEGER)`)
			return err
		})
		ctx, cut := context.WithCancel(context.Background())
		ms := migrate.NewMigrations()
		ms.Add(migrate.Migration{Name: "20990101000001_done", Up: func(c context.Context, m *migrate.Migrator, _ *migrate.Migration) error {
			err := up(c, m.DB())
			cut() // the reset lands right after COMMIT
			return err
		}})
		migrations.MigrateWith(ctx, db, ms) //nolint:errcheck // cut short on purpose
		for i := range 2 {
			if applied, err := migrations.MigrateWith(context.Background(), db, ms); err != nil || len(applied) != 0 {
				t.Fatalf("start %d after the cut: applied %v, %v", i+2, applied, err)
			}
		}
		var rows int
		if err := db.QueryRowContext(context.Background(), `SELECT count(*) FROM bun_migrations WHERE name = '20990101000001_done'`).Scan(&rows); err != nil || rows != 1 {
			t.Fatalf("the step is recorded %d times, want once (%v)", rows, err)
		}
	})
}

// TestLockLostStopsTheMigration: the lock's database session is cut while
// its process migrates (a reset, a server-side timeout): the server let the
// lock go and another process may take it, so the process stops before its
// next step instead of migrating beside the other.
func TestLockLostStopsTheMigration(t *testing.T) {
	t.Parallel()
	eachFreshDB(t, 4, func(t *testing.T, k dbtest.Kind, _ string, db *bun.DB) {
		if k == dbtest.SQLite {
			t.Skip("a file lock is lost only with its process")
		}
		ran := 0
		first := migrations.Step(func(ctx context.Context, db bun.IDB) error {
			ran++
			// Cut the lock's session from the outside, as a reset would.
			var q string
			if k == dbtest.Postgres {
				q = `SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' AND classid = 1801547116 AND objid = hashtext(current_schema())::oid`
			} else {
				q = `SELECT IS_USED_LOCK(CONCAT('kami_migrations_', MD5(DATABASE())))`
			}
			if k == dbtest.MySQL {
				var id int64
				if err := db.QueryRowContext(ctx, q).Scan(&id); err != nil {
					return err
				}
				_, err := db.ExecContext(ctx, fmt.Sprintf(`KILL %d`, id))
				return err
			}
			_, err := db.ExecContext(ctx, q)
			return err
		})
		second := migrations.Step(func(ctx context.Context, db bun.IDB) error {
			ran++
			return nil
		})
		ms := migrate.NewMigrations()
		for i, up := range []migrate.MigrationFunc{first, second} {
			ms.Add(migrate.Migration{Name: fmt.Sprintf("2099010100000%d_step", i+1), Up: func(c context.Context, m *migrate.Migrator, _ *migrate.Migration) error {
				return up(c, m.DB())
			}})
		}
		_, err := migrations.MigrateWith(context.Background(), db, ms)
		if err == nil || !strings.Contains(err.Error(), "lock was lost") {
			t.Fatalf("migrate after its lock was lost: %v", err)
		}
		if ran != 1 {
			t.Fatalf("%d steps ran, want 1: the second ran without the lock", ran)
		}
	})
}
