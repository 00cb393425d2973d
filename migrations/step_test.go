package migrations_test

import (
	"context"
	"errors"
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
