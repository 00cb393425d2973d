package domain

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	_ "github.com/jackc/pgx/v5/stdlib" // registers "pgx"
	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect"
	"github.com/uptrace/bun/dialect/mysqldialect"
	"github.com/uptrace/bun/dialect/pgdialect"
	"github.com/uptrace/bun/dialect/sqlitedialect"
	"modernc.org/sqlite"
	sqlite3 "modernc.org/sqlite/lib"
)

// DBOptions tune the connection pool of a server database.
type DBOptions struct {
	MaxOpenConns int // default 20; SQLite always uses one writer connection
	// WrapConnector, if set, wraps the driver's connector, and with it
	// every connection the pool opens: tests put faults between kami and
	// the database with it (a COMMIT whose answer is lost).
	WrapConnector func(driver.Connector) driver.Connector
}

// OpenDB opens the database named by rawURL: "" means an SQLite file in
// dataDir; "sqlite:PATH" (or "file:PATH") an SQLite file;
// "postgres://..." / "postgresql://..." PostgreSQL; "mysql://user:pass@host:port/db"
// MySQL or MariaDB. It pings the database before returning.
func OpenDB(ctx context.Context, rawURL, dataDir string, opts DBOptions) (*bun.DB, error) {
	if opts.MaxOpenConns <= 0 {
		opts.MaxOpenConns = 20
	}
	var (
		sqldb *sql.DB
		db    *bun.DB
		err   error
	)
	switch {
	case rawURL == "" || strings.HasPrefix(rawURL, "sqlite:") || strings.HasPrefix(rawURL, "file:"):
		path := filepath.Join(dataDir, "kami.db")
		if rawURL != "" {
			path = strings.TrimPrefix(strings.TrimPrefix(strings.TrimPrefix(rawURL, "sqlite:"), "file:"), "//")
			if i := strings.IndexByte(path, '?'); i >= 0 {
				path = path[:i]
			}
		}
		if path == "" {
			return nil, fmt.Errorf("KAMI_DATABASE_URL: %q names no SQLite file", rawURL)
		}
		if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
			return nil, fmt.Errorf("KAMI_DATABASE_URL: cannot create the folder of %s: %w", path, err)
		}
		if err := ownerOnly(path); err != nil {
			return nil, fmt.Errorf("KAMI_DATABASE_URL: %w", err)
		}
		// WAL lets readers run beside the writer; busy_timeout waits for
		// the lock instead of failing; _txlock=immediate takes the write lock
		// at BEGIN so two transactions never deadlock upgrading a read lock.
		dsn := "file:" + path + "?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)" +
			"&_pragma=foreign_keys(1)&_pragma=synchronous(NORMAL)&_txlock=immediate"
		sqldb, err = openSQL("sqlite", dsn, opts.WrapConnector)
		if err != nil {
			return nil, fmt.Errorf("KAMI_DATABASE_URL: %w", err)
		}
		// SQLite has one writer; one connection makes that explicit and
		// keeps every transaction serial.
		sqldb.SetMaxOpenConns(1)
		db = bun.NewDB(sqldb, sqlitedialect.New())
	case strings.HasPrefix(rawURL, "postgres://") || strings.HasPrefix(rawURL, "postgresql://"):
		u, err := url.Parse(rawURL)
		if err != nil {
			return nil, fmt.Errorf("KAMI_DATABASE_URL: not a PostgreSQL URL: %v", redactURLError(err))
		}
		// bun writes the arguments into the SQL text itself, so every
		// statement is new to the server: preparing and caching each one
		// (pgx's default) would cost a round trip and fill the cache.
		// "exec" sends a read, or a write with RETURNING, once, unprepared,
		// in one round trip (the extended protocol's unnamed statement, no
		// parameters, one statement per call, as MySQL needs anyway); a
		// write that returns nothing still goes as the simple protocol
		// (pgx sends a call without arguments so whatever the mode). Not
		// "simple_protocol": for every statement that returns rows pgx
		// then lexes the whole text again looking for placeholders, even
		// with no arguments, and copies it; a 500-order batch's statement
		// is tens of kilobytes, and that pass was a tenth of kami's CPU
		// in a close drain.
		// pgx reads the query as libpq does: a '+' is itself, a space is
		// %20. Go's url.Values reads a '+' as a space and writes a space
		// as '+', so a '+' is kept as %2B on the way in and a space goes
		// out as %20 (Encode writes a '+' of a value as %2B).
		u.RawQuery = strings.ReplaceAll(u.RawQuery, "+", "%2B")
		q := u.Query()
		// A close's statements, written with binds, are prepared once per
		// connection and kept (binds.go), unless the URL names a mode
		// (such as exec or simple_protocol behind a pooler that keeps no
		// prepared statements), which they then use too. A pooler the URL
		// does not tell of shows itself by losing a statement: from then
		// on they go unprepared (bindConnector.unprepared).
		bindMode := pgx.QueryExecModeCacheStatement
		if named := q.Get("default_query_exec_mode"); named == "" {
			q.Set("default_query_exec_mode", "exec")
		} else if m, ok := bindModes[named]; ok {
			bindMode = m
		}
		// bun writes a string as '...' with only its quotes doubled, and
		// pgx reads text as UTF-8: with a database's or role's
		// standard_conforming_strings off a backslash in a contact would be
		// an escape, and another client_encoding would store other
		// characters. The session asks for both at its start (a setting
		// of the client's outranks the database's and the role's). The
		// simple protocol refused such sessions; "exec" does not look.
		q.Set("standard_conforming_strings", "on")
		q.Set("client_encoding", "UTF8")
		// No JIT compilation: kami's statements are short and many, and
		// PostgreSQL compiles one whose estimated cost passes a threshold,
		// which a table without statistics (just filled, not yet
		// analyzed) easily does: a close batch's read of its cards, on
		// 100,000 cards, took 160 ms, almost all of it compiling, for a
		// few milliseconds of work. The URL may turn it back on.
		// The URL's own options (-c jit=on) would lose to a parameter of
		// the session's start, which PostgreSQL applies after them.
		if q.Get("jit") == "" && !strings.Contains(q.Get("options"), "jit") {
			q.Set("jit", "off")
		}
		u.RawQuery = strings.ReplaceAll(q.Encode(), "+", "%20")
		sqldb, err = openSQL("pgx", u.String(), func(c driver.Connector) driver.Connector {
			return bindConnector{Connector: c, mode: bindMode, unprepared: new(atomic.Bool)}
		}, opts.WrapConnector)
		if err != nil {
			return nil, fmt.Errorf("KAMI_DATABASE_URL: %w", err)
		}
		sqldb.SetMaxOpenConns(opts.MaxOpenConns)
		sqldb.SetMaxIdleConns(opts.MaxOpenConns)
		db = bun.NewDB(sqldb, pgdialect.New())
	case strings.HasPrefix(rawURL, "mysql://"):
		dsn, err := mysqlDSN(rawURL)
		if err != nil {
			return nil, err
		}
		sqldb, err = openSQL("mysql", dsn, opts.WrapConnector)
		if err != nil {
			return nil, fmt.Errorf("KAMI_DATABASE_URL: %w", err)
		}
		sqldb.SetMaxOpenConns(opts.MaxOpenConns)
		sqldb.SetMaxIdleConns(opts.MaxOpenConns)
		sqldb.SetConnMaxLifetime(time.Hour)
		db = bun.NewDB(sqldb, mysqldialect.New())
	default:
		return nil, fmt.Errorf("KAMI_DATABASE_URL: unknown scheme in %q (use sqlite:PATH, postgres://… or mysql://…)", schemeOf(rawURL))
	}
	pingCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := db.PingContext(pingCtx); err != nil {
		db.Close()
		return nil, fmt.Errorf("KAMI_DATABASE_URL: cannot reach the %s database: %w", db.Dialect().Name(), err)
	}
	return db, nil
}

// openSQL opens the pool of the registered driver name at dsn, its
// connector wrapped by each of wraps that is set, the first innermost.
func openSQL(name, dsn string, wraps ...func(driver.Connector) driver.Connector) (*sql.DB, error) {
	db, err := sql.Open(name, dsn)
	if err != nil || !slices.ContainsFunc(wraps, func(w func(driver.Connector) driver.Connector) bool { return w != nil }) {
		return db, err
	}
	d := db.Driver()
	db.Close()
	var c driver.Connector = dsnConnector{dsn: dsn, driver: d}
	if dc, ok := d.(driver.DriverContext); ok {
		if c, err = dc.OpenConnector(dsn); err != nil {
			return nil, err
		}
	}
	for _, wrap := range wraps {
		if wrap != nil {
			c = wrap(c)
		}
	}
	return sql.OpenDB(c), nil
}

// dsnConnector is the connector of a driver that has no OpenConnector.
type dsnConnector struct {
	dsn    string
	driver driver.Driver
}

func (c dsnConnector) Connect(context.Context) (driver.Conn, error) { return c.driver.Open(c.dsn) }
func (c dsnConnector) Driver() driver.Driver                        { return c.driver }

// ownerOnly creates the SQLite file readable and writable by its owner
// only (0600), and takes the others' rights away from the file and its
// -wal and -shm files where an older start left them: they hold the
// buyers' contacts. SQLite gives the -wal and -shm files it creates the
// rights of the database file.
func ownerOnly(path string) error {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("cannot open %s: %w", path, err)
	}
	f.Close()
	for _, p := range []string{path, path + "-wal", path + "-shm"} {
		info, err := os.Stat(p)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return err
		}
		if perm := info.Mode().Perm(); perm&0o077 != 0 {
			if err := os.Chmod(p, perm&^0o077); err != nil {
				return fmt.Errorf("cannot make %s private to its owner: %w", p, err)
			}
		}
	}
	return nil
}

// mysqlDSN turns mysql://user:pass@host:port/db?x=y into go-sql-driver's
// form, with the settings kami relies on: times parsed as UTC and stored as
// UTC, strict mode, utf8mb4.
func mysqlDSN(rawURL string) (string, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "", fmt.Errorf("KAMI_DATABASE_URL: not a MySQL URL: %v", redactURLError(err))
	}
	dbName := strings.TrimPrefix(u.Path, "/")
	if u.Host == "" || dbName == "" {
		return "", errors.New("KAMI_DATABASE_URL: a MySQL URL needs a host and a database: mysql://user:pass@host:3306/kami")
	}
	cfg := mysql.NewConfig()
	cfg.User = u.User.Username()
	cfg.Passwd, _ = u.User.Password()
	cfg.Net = "tcp"
	cfg.Addr = u.Host
	if !strings.Contains(u.Host, ":") {
		cfg.Addr += ":3306"
	}
	cfg.DBName = dbName
	cfg.ParseTime = true
	cfg.Loc = time.UTC
	cfg.Params = map[string]string{
		"time_zone": "'+00:00'",
		"sql_mode":  "'STRICT_ALL_TABLES,NO_ENGINE_SUBSTITUTION'",
	}
	for k, vs := range u.Query() {
		if len(vs) > 0 {
			cfg.Params[k] = vs[0]
		}
	}
	return cfg.FormatDSN(), nil
}

func schemeOf(raw string) string {
	if i := strings.Index(raw, "://"); i >= 0 {
		return raw[:i]
	}
	if i := strings.IndexByte(raw, ':'); i >= 0 {
		return raw[:i]
	}
	return raw
}

// redactURLError keeps a password out of a url.Parse error.
func redactURLError(err error) string {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err.Error()
	}
	return "malformed"
}

// dialectName is "sqlite", "pg" or "mysql".
func dialectName(db bun.IDB) dialect.Name { return db.Dialect().Name() }

// analyzeBriefly has PostgreSQL analyze table now, through db (elsewhere
// it does nothing): a few milliseconds, a sample of its rows (about 60
// ms at 100,000 PENDING orders). Its failure only leaves the analysis to
// the autovacuum, which may come minutes later. It never waits for the
// table's lock (SKIP_LOCKED): one held by a VACUUM, another ANALYZE or a
// CREATE INDEX might be held for hours, and an ANALYZE that waited on an
// autovacuum's past deadlock_timeout would have PostgreSQL cancel that
// autovacuum, of a table that churns. lock_timeout bounds the rest (the
// catalog's locks).
func analyzeBriefly(ctx context.Context, db bun.IDB, table string) {
	if dialectName(db) != dialect.PG {
		return
	}
	_ = db.RunInTx(ctx, nil, func(ctx context.Context, tx bun.Tx) error {
		if _, err := tx.ExecContext(ctx, "SET LOCAL lock_timeout = '1s'"); err != nil {
			return err
		}
		_, err := tx.ExecContext(ctx, "ANALYZE (SKIP_LOCKED) ?", bun.Ident(table))
		return err
	})
}

// forUpdate locks the selected rows where the database can; SQLite needs no
// row lock because its one writer runs transactions one at a time.
func forUpdate(q *bun.SelectQuery) *bun.SelectQuery {
	if dialectName(q.DB()) == dialect.SQLite {
		return q
	}
	return q.For("UPDATE")
}

// forUpdateSkipLocked locks rows nobody else holds, skipping the held ones,
// so concurrent buyers take different cards instead of queueing on one.
// PostgreSQL, MySQL 8 and MariaDB 10.6+ have SKIP LOCKED.
func forUpdateSkipLocked(q *bun.SelectQuery) *bun.SelectQuery {
	if dialectName(q.DB()) == dialect.SQLite {
		return q
	}
	return q.For("UPDATE SKIP LOCKED")
}

// shareLock is the clause that ends a SELECT to share-lock its rows until
// the transaction ends: others may read and share-lock them too, but not
// update them. SQLite needs none (one writer).
func shareLock(db bun.IDB) string {
	switch dialectName(db) {
	case dialect.PG:
		return "FOR SHARE"
	case dialect.MySQL:
		return "LOCK IN SHARE MODE" // MariaDB has no FOR SHARE
	}
	return ""
}

// shareLockIDs reads columns of table's rows whose id is in ids, in id
// order, share-locking them (shareLock) until the transaction ends, or
// the statement when there is none. On MySQL/MariaDB it reads them by the
// primary key, each id a look-up: left to choose, MariaDB plans an IN list
// that is a large share of a small table as a scan of the whole table or
// of an index that covers the columns (card_stock_by_batch holds every
// card's id), and a locking scan share-locks every row it passes and the
// gaps between them (next-key locks): the cards of other products, which
// then could not be placed, imported or paid while it waits
// (TestUncertainCommitLookupLocksOnlyItsCards). A primary key look-up
// locks the rows named and no gap.
func shareLockIDs(db bun.IDB, table string, ids []int64, columns ...string) *bun.RawQuery {
	index := ""
	if dialectName(db) == dialect.MySQL {
		index = " FORCE INDEX (PRIMARY)"
	}
	return db.NewRaw("SELECT ? FROM ?"+index+" WHERE id IN (?) ORDER BY id "+shareLock(db),
		bun.Safe(strings.Join(columns, ", ")), bun.Ident(table), bun.List(ids))
}

// timeParam is a placeholder for a time inside an expression (a CASE arm),
// where the database cannot infer the column's type from the literal bun
// writes: PostgreSQL would take it for text.
func timeParam(db bun.IDB) string {
	switch dialectName(db) {
	case dialect.PG:
		return "CAST(? AS TIMESTAMPTZ)"
	case dialect.MySQL:
		return "CAST(? AS DATETIME(6))"
	}
	return "?"
}

// isUniqueViolation reports a unique or primary key violation.
func isUniqueViolation(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code == "23505"
	}
	var myErr *mysql.MySQLError
	if errors.As(err, &myErr) {
		return myErr.Number == 1062
	}
	var sqErr *sqlite.Error
	if errors.As(err, &sqErr) {
		c := sqErr.Code()
		return c == sqlite3.SQLITE_CONSTRAINT_UNIQUE || c == sqlite3.SQLITE_CONSTRAINT_PRIMARYKEY
	}
	return false
}

// isRetryable reports errors after which the whole transaction may simply
// run again: deadlocks, serialization failures, lock timeouts, a busy SQLite,
// a statement prepared before a migration changed what it returns
// (planChanged: prepared anew the next time), one a pooler's server
// connection lost or already had (preparedLost: sent unprepared from then
// on, binds.go).
func isRetryable(err error) bool {
	if errors.Is(err, errRetry) || planChanged(err) || preparedLost(err) {
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code == "40001" || pgErr.Code == "40P01" || pgErr.Code == "55P03"
	}
	var myErr *mysql.MySQLError
	if errors.As(err, &myErr) {
		return myErr.Number == 1213 || myErr.Number == 1205
	}
	var sqErr *sqlite.Error
	if errors.As(err, &sqErr) {
		c := sqErr.Code() & 0xff
		return c == sqlite3.SQLITE_BUSY || c == sqlite3.SQLITE_LOCKED
	}
	return false
}

// errRetry is returned inside a transaction that saw the world change
// under it in a way its locks should have prevented; the transaction runs
// again from the start.
var errRetry = errors.New("transaction raced; retrying")

// txOptions are the isolation every ledger transaction uses. READ COMMITTED
// on the servers: every state change is a conditional update that re-checks
// its row under the row lock, and MySQL's default REPEATABLE READ would add
// gap locks that only cause deadlocks here.
func txOptions(db bun.IDB) *sql.TxOptions {
	if dialectName(db) == dialect.SQLite {
		return nil
	}
	return &sql.TxOptions{Isolation: sql.LevelReadCommitted}
}

// snapshotTx runs fn, which only reads, in one consistent snapshot of the
// database: every query in it sees the same committed state. On PostgreSQL
// and MySQL/MariaDB that is a READ ONLY transaction at REPEATABLE READ (the
// snapshot is taken at its first read and kept to the end); on SQLite any
// transaction is one, and with its one connection no write runs beside it.
func snapshotTx(ctx context.Context, db *bun.DB, fn func(ctx context.Context, tx bun.Tx) error) error {
	var opts *sql.TxOptions
	if dialectName(db) != dialect.SQLite {
		opts = &sql.TxOptions{Isolation: sql.LevelRepeatableRead, ReadOnly: true}
	}
	return db.RunInTx(ctx, opts, fn)
}

// maxTxAttempts bounds how often a transaction is retried after a deadlock.
const maxTxAttempts = 8

// inTx runs fn in a transaction, again after a retryable failure. fn must
// have no effect outside the transaction.
func inTx(ctx context.Context, db *bun.DB, fn func(ctx context.Context, tx bun.Tx) error) error {
	var err error
	for attempt := 0; attempt < maxTxAttempts; attempt++ {
		err = db.RunInTx(ctx, txOptions(db), fn)
		if err == nil || !isRetryable(err) || ctx.Err() != nil {
			return err
		}
		// A short, growing pause lets the transaction that won go first.
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Duration(attempt+1) * 2 * time.Millisecond):
		}
	}
	return err
}
