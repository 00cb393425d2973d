package domain_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/url"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect/pgdialect"

	"kami/domain"
	"kami/domain/dbtest"
)

// openPG opens a fresh PostgreSQL schema through domain.OpenDB with the
// extra URL parameters extra (a query exec mode, a session setting a
// server, database or role may carry).
func openPG(t *testing.T, extra map[string]string) *bun.DB {
	t.Helper()
	u, err := url.Parse(dbtest.URL(t, dbtest.Postgres))
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	for k, v := range extra {
		q.Set(k, v)
	}
	u.RawQuery = q.Encode()
	db, err := domain.OpenDB(context.Background(), u.String(), t.TempDir(), domain.DBOptions{MaxOpenConns: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

// scanned is a row of every kind of value kami reads back.
type scanned struct {
	TS    time.Time  `bun:"ts"`
	NullT *time.Time `bun:"null_t"`
	B     []byte     `bun:"b"`
	Yes   bool       `bun:"yes"`
	Big   int64      `bun:"big"`
	Small int32      `bun:"small"`
	Num   string     `bun:"num"`
	Text  string     `bun:"text"`
	Null  *string    `bun:"null_s"`
	Arr   []string   `bun:"arr,array"`
	F     float64    `bun:"f"`
}

// TestPGExecModeScansAsSimpleProtocol: the values kami reads come back the
// same whether pgx runs the statement in the simple protocol or as the
// extended protocol's unnamed statement (both ask for text results).
func TestPGExecModeScansAsSimpleProtocol(t *testing.T) {
	t.Parallel()
	const q = `SELECT CAST(? AS TIMESTAMPTZ) AS ts, CAST(NULL AS TIMESTAMPTZ) AS null_t, CAST(? AS BYTEA) AS b,
		? AS yes, CAST(? AS BIGINT) AS big, CAST(? AS INTEGER) AS small, CAST('12345678901234.5678' AS NUMERIC(20,4)) AS num,
		? AS text, CAST(NULL AS TEXT) AS null_s, ARRAY['a', 'b,c', 'd"e', NULL]::text[] AS arr, CAST(0.1 AS DOUBLE PRECISION) AS f`
	ts := time.Date(2026, 12, 2, 14, 3, 4, 123456000, time.UTC)
	args := []any{ts, []byte{0, 1, 0xfe, '\'', '\\'}, true, int64(-1) << 62, int32(-7), "卡密 'quoted' \\ back\\slash"}
	var got [2]scanned
	for i, mode := range []string{"simple_protocol", "exec"} {
		db := openPG(t, map[string]string{"default_query_exec_mode": mode})
		if err := db.NewRaw(q, args...).Scan(context.Background(), &got[i]); err != nil {
			t.Fatalf("%s: %v", mode, err)
		}
		if !got[i].TS.Equal(ts) || got[i].B[4] != '\\' || got[i].Text != args[5] || got[i].Big != int64(-1)<<62 {
			t.Errorf("%s: scanned %+v", mode, got[i])
		}
	}
	if !reflect.DeepEqual(got[0], got[1]) {
		t.Errorf("simple protocol scanned %+v\nexec scanned            %+v", got[0], got[1])
	}
}

// TestPGBindsScanAsExec: a statement written with binds (a close's, see
// binds.go), prepared once per connection, comes back with the values of
// the same statement with its values in its text, run unprepared: times
// in the same zone (a closed order's times are written into its event as
// they are read), bytes, numbers, text and arrays alike.
func TestPGBindsScanAsExec(t *testing.T) {
	t.Parallel()
	const q = `SELECT CAST(? AS TIMESTAMPTZ) AS ts, CAST(NULL AS TIMESTAMPTZ) AS null_t, CAST(? AS BYTEA) AS b,
		CAST(? AS BOOLEAN) AS yes, CAST(? AS BIGINT) AS big, CAST(? AS INTEGER) AS small, CAST('12345678901234.5678' AS NUMERIC(20,4)) AS num,
		CAST(? AS TEXT) AS text, CAST(NULL AS TEXT) AS null_s, CAST(? AS TEXT[]) AS arr, CAST(0.1 AS DOUBLE PRECISION) AS f`
	ts := time.Date(2026, 12, 2, 14, 3, 4, 123456000, time.UTC)
	args := []any{ts, []byte{0, 1, 0xfe, '\'', '\\'}, true, int64(-1) << 62, int32(-7), "卡密 'quoted' \\ back\\slash",
		[]string{"a", "b,c", `d"e`, "{f}"}}
	ctx := context.Background()
	db := openPG(t, nil)
	var literal, bound scanned
	literalArgs := append([]any(nil), args...)
	literalArgs[6] = pgdialect.Array(args[6])
	if err := db.NewRaw(q, literalArgs...).Scan(ctx, &literal); err != nil {
		t.Fatal(err)
	}
	for i := range 3 { // past the first runs: PostgreSQL plans a prepared statement anew for its first five
		var b domain.BindsForTest
		placeholders := make([]any, len(args))
		for j, a := range args {
			placeholders[j] = b.Value(a)
		}
		if err := db.NewRaw(q, placeholders...).Scan(b.Context(ctx), &bound); err != nil {
			t.Fatalf("run %d: %v", i, err)
		}
		if !reflect.DeepEqual(literal, bound) {
			t.Fatalf("run %d: in the text scanned %+v\nwith binds scanned  %+v", i, literal, bound)
		}
	}
}

// TestPGOneStatementPerQuery records what the exec mode refuses: a read
// (or a write with RETURNING) of several statements in one call. A write
// without arguments still goes as the simple protocol (pgx's Exec does
// so whatever the mode), so several statements there still run.
func TestPGOneStatementPerQuery(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := openPG(t, nil)
	if _, err := db.ExecContext(ctx, "SELECT 1; SELECT 2"); err != nil {
		t.Errorf("two statements through Exec: %v", err)
	}
	var n int
	err := db.NewRaw("SELECT 1; SELECT 2").Scan(ctx, &n)
	if err == nil || !strings.Contains(err.Error(), "42601") {
		t.Errorf("two statements through a query: %v (n=%d), want 42601", err, n)
	}
}

// TestPGSessionSettingsBunNeeds: bun writes every string into the SQL text
// as '...' with only its quotes doubled, and pgx reads every text as
// UTF-8; both hold only with standard_conforming_strings on and
// client_encoding UTF8. A role (or database) set otherwise must not turn
// a backslash in a contact into an escape, nor store a name as another
// encoding's characters. The simple protocol refused such sessions
// outright; the exec mode does not look, so kami's sessions ask for both.
func TestPGSessionSettingsBunNeeds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin, err := domain.OpenDB(ctx, dbtest.PostgresURL(), "", domain.DBOptions{MaxOpenConns: 1})
	if err != nil {
		if dbtest.Required() {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	t.Cleanup(func() { admin.Close() })
	for _, mode := range []string{"simple_protocol", ""} {
		for _, setting := range []string{"standard_conforming_strings = off", "client_encoding = 'GBK'"} {
			b := make([]byte, 6)
			rand.Read(b)
			role := "kt_role_" + hex.EncodeToString(b)
			if _, err := admin.ExecContext(ctx, "CREATE ROLE "+role+" LOGIN"); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { admin.ExecContext(context.Background(), "DROP ROLE "+role) })
			if _, err := admin.ExecContext(ctx, "ALTER ROLE "+role+" SET "+setting); err != nil {
				t.Fatal(err)
			}
			u, _ := url.Parse(dbtest.PostgresURL())
			u.User = url.User(role)
			q := u.Query()
			if mode != "" {
				q.Set("default_query_exec_mode", mode)
			}
			u.RawQuery = q.Encode()
			db, err := domain.OpenDB(ctx, u.String(), "", domain.DBOptions{MaxOpenConns: 1})
			if err != nil {
				t.Fatal(err)
			}
			s := `C:\new\table 卡密`
			var got struct {
				S string `bun:"s"`
				N int    `bun:"n"`
			}
			err = db.NewRaw("SELECT ? AS s, char_length(?) AS n", s, s).Scan(ctx, &got)
			db.Close()
			if err != nil {
				// Refusing to work at all is safe too (the simple protocol did).
				t.Logf("mode %q, role with %s: refused: %v", mode, setting, err)
				continue
			}
			if got.S != s || got.N != len([]rune(s)) {
				t.Errorf("mode %q, role with %s: SELECT %q read back %q, %d characters", mode, setting, s, got.S, got.N)
			}
		}
	}
}

// TestPGSessionsCompileNoPlan: kami's PostgreSQL sessions have JIT
// compilation off unless the URL asks for it: a close batch's read of its
// cards on a table not yet analyzed passed the cost at which PostgreSQL
// compiles, and spent 160 ms compiling a few milliseconds of work, every
// batch of a 100,000-order drain.
func TestPGSessionsCompileNoPlan(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, c := range []struct{ jit, want string }{{"", "off"}, {"on", "on"}} {
		u, _ := url.Parse(dbtest.PostgresURL())
		if c.jit != "" {
			q := u.Query()
			q.Set("jit", c.jit)
			u.RawQuery = q.Encode()
		}
		db, err := domain.OpenDB(ctx, u.String(), "", domain.DBOptions{MaxOpenConns: 1})
		if err != nil {
			if dbtest.Required() {
				t.Fatal(err)
			}
			t.Skip(err)
		}
		var jit string
		err = db.QueryRowContext(ctx, "SHOW jit").Scan(&jit)
		db.Close()
		if err != nil || jit != c.want {
			t.Errorf("URL with jit=%q: jit is %q (%v), want %q", c.jit, jit, err, c.want)
		}
	}
}

// TestPGURLKeepsItsParameters: OpenDB adds its settings to the URL's query
// and writes it again; the parameters it was given reach PostgreSQL as
// libpq (and pgx) read them: a space is %20, a '+' is itself (not a
// space), and the options a URL sets for the session apply, jit too.
func TestPGURLKeepsItsParameters(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	u, _ := url.Parse(dbtest.PostgresURL())
	u.RawQuery += "&application_name=kami%20shop+1&options=-c%20work_mem%3D5MB%20-c%20jit%3Don"
	db, err := domain.OpenDB(ctx, u.String(), "", domain.DBOptions{MaxOpenConns: 1})
	if err != nil {
		if dbtest.Required() {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	defer db.Close()
	for setting, want := range map[string]string{"application_name": "kami shop+1", "work_mem": "5MB", "jit": "on"} {
		var got string
		if err := db.QueryRowContext(ctx, "SHOW "+setting).Scan(&got); err != nil || got != want {
			t.Errorf("%s is %q (%v), want %q", setting, got, err, want)
		}
	}
}
