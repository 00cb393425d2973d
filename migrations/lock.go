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
func lockMigrations(ctx context.Context, db *bun.DB) (*lease, error) {
	switch db.Dialect().Name() {
	case dialect.PG:
		// Keyed by the schema too: several shops (or test schemas) in one
		// database do not wait for each other. The keepalives make the
		// server notice a holder whose host or network went away within
		// a minute, not the system's two hours.
		return lockSession(ctx, db, sessionLock{
			setup: []string{`SET tcp_keepalives_idle = 30`, `SET tcp_keepalives_interval = 10`, `SET tcp_keepalives_count = 3`},
			try:   `SELECT CASE WHEN pg_try_advisory_lock(1801547116, hashtext(current_schema())) THEN 1 ELSE 0 END`,
			held: `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND pid = pg_backend_pid()
				AND classid = 1801547116 AND objid = hashtext(current_schema())::oid AND objsubid = 2`,
			release: `SELECT pg_advisory_unlock(1801547116, hashtext(current_schema()))`,
		})
	case dialect.MySQL:
		// Named locks are server-wide: the name carries the database's.
		return lockSession(ctx, db, sessionLock{
			try:     `SELECT COALESCE(GET_LOCK(CONCAT('kami_migrations_', MD5(DATABASE())), 0), 0)`,
			held:    `SELECT COALESCE(IS_USED_LOCK(CONCAT('kami_migrations_', MD5(DATABASE()))) = CONNECTION_ID(), 0)`,
			release: `SELECT RELEASE_LOCK(CONCAT('kami_migrations_', MD5(DATABASE())))`,
		})
	case dialect.SQLite:
		return lockSQLiteFile(ctx, db)
	}
	return nil, fmt.Errorf("migrations: unsupported dialect %s", db.Dialect().Name())
}

// lease is the migration lock while it is held.
type lease struct {
	// held reports an error when the lock is no longer this process's: its
	// session was cut (a reset, a server-side timeout, a terminated
	// backend) and the server let it go, so another process may be
	// migrating now. Migrate asks before each step.
	held    func(ctx context.Context) error
	release func()
}

// sessionLock is the SQL of a session-level lock: try and held answer 1
// when the lock is (now) this session's.
type sessionLock struct {
	setup              []string
	try, held, release string
}

// lockSession holds a session-level lock on a connection taken out of the
// pool for the migration's length.
func lockSession(ctx context.Context, db *bun.DB, sl sessionLock) (*lease, error) {
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
	yes := func(ctx context.Context, q string) (bool, error) {
		var got int
		err := conn.QueryRowContext(ctx, q).Scan(&got)
		return got == 1, err
	}
	for _, q := range sl.setup {
		if _, err = conn.ExecContext(ctx, q); err != nil {
			break
		}
	}
	if err == nil {
		err = retryLock(ctx, func() (bool, error) { return yes(ctx, sl.try) })
	}
	if err != nil {
		discard(conn)
		restore()
		return nil, err
	}
	return &lease{
		held: func(ctx context.Context) error {
			if ok, err := yes(ctx, sl.held); !ok || err != nil {
				return errors.Join(errors.New("migrations: the migration lock was lost (its database session ended); stopped before the next step"), err)
			}
			return nil
		},
		release: func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			conn.ExecContext(ctx, sl.release) //nolint:errcheck // the session ends just below either way
			discard(conn)
			restore()
		},
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
func lockSQLiteFile(ctx context.Context, db *bun.DB) (*lease, error) {
	var path string
	if err := db.QueryRowContext(ctx, `SELECT file FROM pragma_database_list WHERE name = 'main'`).Scan(&path); err != nil {
		return nil, fmt.Errorf("migrations: lock: %w", err)
	}
	kept := func(context.Context) error { return nil } // a file lock is lost only with its process
	if path == "" {
		return &lease{held: kept, release: func() {}}, nil
	}
	f, err := os.OpenFile(path+".migrate-lock", os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("migrations: lock: %w", err)
	}
	if err := retryLock(ctx, func() (bool, error) { return tryLockFile(f) }); err != nil {
		f.Close()
		return nil, err
	}
	return &lease{held: kept, release: func() { f.Close() }}, nil // closing the file drops its lock
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
