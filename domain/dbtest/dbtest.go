// Package dbtest gives tests a fresh, migrated database of every kind kami
// supports: SQLite always, PostgreSQL and MySQL/MariaDB where they answer.
//
// The servers are found at KAMI_TEST_POSTGRES_URL and KAMI_TEST_MYSQL_URL,
// defaulting to this project's machines (127.0.0.1, databases "test");
// set either to "off" to leave it out. A server that does not answer is
// skipped with a note, unless KAMI_TEST_REQUIRE_SERVICES=1 (as in CI), which
// makes it a failure. Each test gets its own PostgreSQL schema or MySQL
// database, dropped when it ends, so tests run in parallel.
package dbtest

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/migrations"
)

// Kind names a database kind.
type Kind string

const (
	SQLite   Kind = "sqlite"
	Postgres Kind = "postgres"
	MySQL    Kind = "mysql"
)

// Server URLs, from the environment or this machine's defaults.
func PostgresURL() string {
	return envOr("KAMI_TEST_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
}

func MySQLURL() string { return envOr("KAMI_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test") }

// Required reports whether missing services fail tests (CI) instead of
// skipping them.
func Required() bool { return os.Getenv("KAMI_TEST_REQUIRE_SERVICES") == "1" }

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

// Each runs fn once per database kind as a parallel subtest, with a fresh
// migrated database.
func Each(t *testing.T, fn func(t *testing.T, db *bun.DB)) {
	t.Helper()
	for _, k := range []Kind{SQLite, Postgres, MySQL} {
		t.Run(string(k), func(t *testing.T) {
			t.Parallel()
			fn(t, Open(t, k))
		})
	}
}

// Servers runs fn for the server databases only (PostgreSQL and MySQL): the
// race tests, where SQLite's single writer would prove nothing.
func Servers(t *testing.T, fn func(t *testing.T, db *bun.DB)) {
	t.Helper()
	for _, k := range []Kind{Postgres, MySQL} {
		t.Run(string(k), func(t *testing.T) {
			t.Parallel()
			fn(t, Open(t, k))
		})
	}
}

// Open returns a fresh migrated database of kind k, closed and dropped when
// the test ends; it skips (or fails, when Required) if k's server is not
// reachable.
func Open(t testing.TB, k Kind) *bun.DB {
	t.Helper()
	return OpenWith(t, k, domain.DBOptions{})
}

// OpenWith is Open with opts (MaxOpenConns defaults to 40), for tests
// that wrap the driver's connections to inject faults.
func OpenWith(t testing.TB, k Kind, opts domain.DBOptions) *bun.DB {
	t.Helper()
	if opts.MaxOpenConns == 0 {
		opts.MaxOpenConns = 40
	}
	url := URL(t, k)
	db, err := domain.OpenDB(context.Background(), url, t.TempDir(), opts)
	if err != nil {
		t.Fatalf("open %s: %v", k, err)
	}
	t.Cleanup(func() { db.Close() })
	if _, err := migrations.Migrate(context.Background(), db); err != nil {
		t.Fatalf("migrate %s: %v", k, err)
	}
	return db
}

// URL creates a fresh empty database (or schema) of kind k and returns the
// KAMI_DATABASE_URL that names it; it is dropped when the test ends.
func URL(t testing.TB, k Kind) string {
	t.Helper()
	name := "kt_" + randomHex(6)
	switch k {
	case SQLite:
		return "sqlite:" + filepath.Join(t.TempDir(), "kami.db")
	case Postgres:
		admin := server(t, k, PostgresURL())
		mustExec(t, admin, "CREATE SCHEMA "+name)
		t.Cleanup(func() { admin.Exec("DROP SCHEMA " + name + " CASCADE") })
		return withQuery(PostgresURL(), "search_path", name)
	case MySQL:
		admin := server(t, k, MySQLURL())
		mustExec(t, admin, "CREATE DATABASE "+name)
		t.Cleanup(func() { admin.Exec("DROP DATABASE " + name) })
		u, _ := url.Parse(MySQLURL())
		u.Path = "/" + name
		return u.String()
	}
	t.Fatalf("unknown database kind %q", k)
	return ""
}

var (
	serversMu sync.Mutex
	servers   = map[Kind]*sql.DB{}
	down      = map[Kind]string{}
)

// server returns a shared admin connection to k's server, skipping the
// test when it is off or unreachable.
func server(t testing.TB, k Kind, rawURL string) *sql.DB {
	t.Helper()
	if rawURL == "off" {
		t.Skipf("%s tests are off", k)
	}
	serversMu.Lock()
	defer serversMu.Unlock()
	if db := servers[k]; db != nil {
		return db
	}
	if why := down[k]; why != "" {
		unreachable(t, k, why)
	}
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatalf("%s test URL: %v", k, err)
	}
	if c, err := net.DialTimeout("tcp", u.Host, time.Second); err != nil {
		down[k] = err.Error()
		unreachable(t, k, down[k])
	} else {
		c.Close()
	}
	db, err := domain.OpenDB(context.Background(), rawURL, "", domain.DBOptions{MaxOpenConns: 4})
	if err != nil {
		down[k] = err.Error()
		unreachable(t, k, down[k])
	}
	servers[k] = db.DB
	return db.DB
}

func unreachable(t testing.TB, k Kind, why string) {
	t.Helper()
	if Required() {
		t.Fatalf("%s is required (KAMI_TEST_REQUIRE_SERVICES=1) but unreachable: %s", k, why)
	}
	t.Skipf("%s unreachable, skipped: %s", k, why)
}

func mustExec(t testing.TB, db *sql.DB, q string) {
	t.Helper()
	if _, err := db.Exec(q); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
}

func withQuery(raw, k, v string) string {
	u, _ := url.Parse(raw)
	q := u.Query()
	q.Set(k, v)
	u.RawQuery = q.Encode()
	return u.String()
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return strings.ToLower(hex.EncodeToString(b))
}
