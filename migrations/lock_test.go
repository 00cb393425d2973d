package migrations_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/uptrace/bun"
	"github.com/uptrace/bun/migrate"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/migrations"
)

// A test binary started with lockHolderEnv set is not a test run: it takes
// the migration lock of the database it names, says "locked" and waits to
// be killed (see lockHolderMain).
const lockHolderEnv = "KAMI_MIGRATIONS_TEST_LOCK_HOLDER"

func TestMain(m *testing.M) {
	if url := os.Getenv(lockHolderEnv); url != "" {
		os.Exit(lockHolderMain(url))
	}
	os.Exit(m.Run())
}

func lockHolderMain(url string) int {
	ctx := context.Background()
	db, err := domain.OpenDB(ctx, url, "", domain.DBOptions{MaxOpenConns: 2})
	if err != nil {
		fmt.Fprintln(os.Stderr, "lock holder:", err)
		return 2
	}
	if _, err := migrations.LockMigrations(ctx, db); err != nil {
		fmt.Fprintln(os.Stderr, "lock holder:", err)
		return 2
	}
	fmt.Println("locked")
	select {} // until killed, holding the lock
}

// TestMigrationLockDiesWithItsHolder: a process killed while it holds the
// migration lock does not keep every later start out, and neither does a
// row an older kami left in bun's own lock table. While the holder lives,
// another process does not migrate.
func TestMigrationLockDiesWithItsHolder(t *testing.T) {
	t.Parallel()
	eachFreshDB(t, 1, func(t *testing.T, _ dbtest.Kind, url string, db *bun.DB) {
		ctx := context.Background()

		// The row bun's lock leaves behind when its holder is killed.
		m := migrate.NewMigrator(db, migrations.Migrations)
		if err := m.Init(ctx); err != nil {
			t.Fatal(err)
		}
		if err := m.Lock(ctx); err != nil {
			t.Fatal(err)
		}

		holder := exec.Command(os.Args[0], "-test.run=^$")
		holder.Env = append(os.Environ(), lockHolderEnv+"="+url)
		holder.Stderr = os.Stderr
		out, err := holder.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := holder.Start(); err != nil {
			t.Fatal(err)
		}
		killed := false
		defer func() {
			if !killed {
				holder.Process.Kill()
				holder.Wait()
			}
		}()
		if line, err := bufio.NewReader(out).ReadString('\n'); strings.TrimSpace(line) != "locked" {
			t.Fatalf("the holder did not take the lock: %q %v", line, err)
		}

		// Held: a migration waits, and gives up when its caller does.
		waitCtx, cancel := context.WithTimeout(ctx, time.Second)
		_, err = migrations.Migrate(waitCtx, db)
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("migrated while another process held the lock, or failed otherwise: %v", err)
		}
		if pending, err := migrations.Pending(ctx, db); err != nil || len(pending) != len(migrations.Migrations.Sorted()) {
			t.Fatalf("pending while the lock was held: %d of %d, %v", len(pending), len(migrations.Migrations.Sorted()), err)
		}

		// kill -9: the lock ends with the process.
		holder.Process.Kill()
		holder.Wait()
		killed = true
		migrateCtx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		applied, err := migrations.Migrate(migrateCtx, db)
		if err != nil {
			t.Fatalf("migrate after the holder was killed: %v", err)
		}
		if len(applied) != len(migrations.Migrations.Sorted()) {
			t.Fatalf("applied %d of %d migrations", len(applied), len(migrations.Migrations.Sorted()))
		}
	})
}
