package migrations

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect"
)

// lockWait bounds how long a start waits for another process's migrations.
const lockWait = 2 * time.Minute

// lockMigrations takes the lock that lets one process at a time migrate a
// database, and returns its release. The lock dies with its holder: a
// PostgreSQL advisory lock or a MariaDB/MySQL named lock, each held by a
// connection of its own (the session ends when the process does), and a
// file lock beside an SQLite file (the kernel drops it when the process
// dies).
//
// bun's own lock is a row in bun_migration_locks. A process killed while it
// held that row, or whose unlock met a dropped connection, left it there for
// good, and every later start waited two minutes and gave up: kami could not
// start again after one unlucky kill -9 (the fault campaign found it). kami
// never takes bun's row lock; a row left there by an older kami is ignored.
func lockMigrations(ctx context.Context, db *bun.DB) (release func(), err error) {
	switch db.Dialect().Name() {
	case dialect.PG:
		// Keyed by the schema too: several shops (or test schemas) in one
		// database do not wait for each other.
		return lockSession(ctx, db,
			`SELECT CASE WHEN pg_try_advisory_lock(1801547116, hashtext(current_schema())) THEN 1 ELSE 0 END`,
			`SELECT pg_advisory_unlock(1801547116, hashtext(current_schema()))`)
	case dialect.MySQL:
		// Named locks are server-wide: the name carries the database's.
		return lockSession(ctx, db,
			`SELECT COALESCE(GET_LOCK(CONCAT('kami_migrations_', MD5(DATABASE())), 0), 0)`,
			`SELECT RELEASE_LOCK(CONCAT('kami_migrations_', MD5(DATABASE())))`)
	case dialect.SQLite:
		return lockSQLiteFile(ctx, db)
	}
	return nil, fmt.Errorf("migrations: unsupported dialect %s", db.Dialect().Name())
}

// lockSession holds a session-level lock on a connection taken out of the
// pool for the migration's length. try answers 1 when it got the lock.
func lockSession(ctx context.Context, db *bun.DB, try, release string) (func(), error) {
	restore := func() {}
	if db.DB.Stats().MaxOpenConnections == 1 {
		// The lock's connection and the migration's must both fit.
		db.DB.SetMaxOpenConns(2)
		restore = func() { db.DB.SetMaxOpenConns(1) }
	}
	conn, err := db.DB.Conn(ctx)
	if err != nil {
		restore()
		return nil, fmt.Errorf("migrations: lock: %w", err)
	}
	err = retryLock(ctx, func() (bool, error) {
		var got int
		err := conn.QueryRowContext(ctx, try).Scan(&got)
		return got == 1, err
	})
	if err != nil {
		discard(conn)
		restore()
		return nil, err
	}
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		conn.ExecContext(ctx, release) //nolint:errcheck // the session ends just below either way
		discard(conn)
		restore()
	}, nil
}

// discard closes conn's session instead of handing it back to the pool,
// so that a lock it may still hold ends with it.
func discard(conn *sql.Conn) {
	conn.Raw(func(any) error { return driver.ErrBadConn }) //nolint:errcheck // ErrBadConn is the point
	conn.Close()
}

// lockSQLiteFile locks PATH.migrate-lock beside the database file. An
// in-memory database has one process: nothing to lock.
func lockSQLiteFile(ctx context.Context, db *bun.DB) (func(), error) {
	var path string
	if err := db.QueryRowContext(ctx, `SELECT file FROM pragma_database_list WHERE name = 'main'`).Scan(&path); err != nil {
		return nil, fmt.Errorf("migrations: lock: %w", err)
	}
	if path == "" {
		return func() {}, nil
	}
	f, err := os.OpenFile(path+".migrate-lock", os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("migrations: lock: %w", err)
	}
	if err := retryLock(ctx, func() (bool, error) { return tryLockFile(f) }); err != nil {
		f.Close()
		return nil, err
	}
	return func() { f.Close() }, nil // closing the file drops its lock
}

// retryLock tries for the lock until it is free, ctx ends, or lockWait has
// passed.
func retryLock(ctx context.Context, try func() (bool, error)) error {
	deadline := time.Now().Add(lockWait)
	for {
		got, err := try()
		if err != nil {
			return fmt.Errorf("migrations: lock: %w", err)
		}
		if got {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("migrations: another process has held the migration lock for over %s (a kami migrating the same database; it is released when that process ends)", lockWait)
		}
		select {
		case <-ctx.Done():
			return errors.Join(errors.New("migrations: waiting for another process's migration lock"), ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}
