package domain

import (
	"context"
	"database/sql/driver"
	"errors"
	"strconv"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect/pgdialect"
)

// Bind parameters for the close's statements on PostgreSQL.
//
// bun writes every argument into a statement's text (see OpenDB). A close
// batch of 500 orders so sends its order numbers, card places, journal and
// events (their payloads are most of it) as array literals: about 250 KB
// of text a batch, which PostgreSQL lexes, parses, analyzes (reading each
// array literal) and plans anew every time. In a drain that was a ninth of
// the machine's CPU. Written with binds instead, a close's statements have
// the same text for every batch: pgx prepares each once per connection and
// keeps it (QueryExecModeCacheStatement), PostgreSQL parses and analyzes
// it once and reuses its plan, and the values travel beside the text, the
// arrays in PostgreSQL's binary form, with nothing to escape.
//
// bun still builds and runs the statement (its hooks see the text, with
// $1, $2, … in place of the values); the values ride in the statement's
// context (withBinds), and bindConn, the connection pgx's pool hands out,
// sends them.

// binds collects a statement's parameter values in the order of their
// placeholders. A nil *binds writes each value into the text, as bun does
// (the other databases; PostgreSQL statements built without binds).
type binds struct{ values []any }

// value is v as a parameter: its placeholder ($n), or v itself when b is
// nil. An SQL expression (bun.Safe, such as CURRENT_TIMESTAMP) is part of
// the text either way.
func (b *binds) value(v any) any {
	if _, expr := v.(bun.Safe); b == nil || expr {
		return v
	}
	b.values = append(b.values, v)
	return bun.Safe("$" + strconv.Itoa(len(b.values)))
}

// array is a slice as an array parameter: its placeholder, or its
// literal when b is nil.
func (b *binds) array(v any) any {
	if b == nil {
		return pgdialect.Array(v)
	}
	return b.value(v)
}

type bindsKey struct{}

// withBinds is ctx carrying b's values to the statement run with it; ctx
// itself when b is nil. The values are read when the statement is sent:
// those added after this call (a statement built after its context, as
// in writeAll(withBinds(ctx, b), tx, flowInsert(tx, b, …))) go too.
func withBinds(ctx context.Context, b *binds) context.Context {
	if b == nil {
		return ctx
	}
	return context.WithValue(ctx, bindsKey{}, b)
}

// bindConnector hands out bindConns: pgx's connections, which send a
// statement's binds.
type bindConnector struct {
	driver.Connector
	mode pgx.QueryExecMode // how a statement with binds is sent
	// unprepared is set once the server lost a statement pgx prepared
	// on this connection, or had one of its name already (preparedLost):
	// a pooler in transaction mode (PgBouncer) hands each transaction
	// another server connection. From then on the pool's statements with
	// binds go unprepared (exec), as they must there.
	unprepared *atomic.Bool
}

func (c bindConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	if pc, ok := conn.(*stdlib.Conn); ok {
		// A URL may turn pgx's caches off (statement_cache_capacity=0,
		// as behind a pooler in transaction mode) without naming a mode:
		// pgx then refuses the cached modes, and every close would fail.
		// The statement then goes unprepared, as exec sends it.
		mode, config := c.mode, pc.Conn().Config()
		if mode == pgx.QueryExecModeCacheStatement && config.StatementCacheCapacity == 0 ||
			mode == pgx.QueryExecModeCacheDescribe && config.DescriptionCacheCapacity == 0 {
			mode = pgx.QueryExecModeExec
		}
		return &bindConn{Conn: pc, mode: mode, unprepared: c.unprepared}, nil
	}
	return conn, nil
}

// bindConn is pgx's connection (every method of it), which sends the
// binds a statement's context carries as its parameters. bun passes none
// of its own: it writes them into the text.
type bindConn struct {
	*stdlib.Conn
	mode       pgx.QueryExecMode
	unprepared *atomic.Bool // bindConnector's
}

func (c *bindConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	withArgs := c.withArgs(ctx, args)
	rows, err := c.Conn.QueryContext(ctx, query, withArgs)
	if c.again(err, args, withArgs) {
		return c.Conn.QueryContext(ctx, query, withArgs)
	}
	return rows, err
}

func (c *bindConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	withArgs := c.withArgs(ctx, args)
	res, err := c.Conn.ExecContext(ctx, query, withArgs)
	if c.again(err, args, withArgs) {
		return c.Conn.ExecContext(ctx, query, withArgs)
	}
	return res, err
}

// again reports a statement sent with binds that PostgreSQL refused
// because it was prepared before a migration changed the type of a
// column it returns (planChanged), or because the server connection
// lost it or had another of its name (preparedLost, a pooler: the pool's
// statements then go unprepared), outside a transaction: pgx has dropped
// it from its cache, and sent again it is prepared anew (or goes
// unprepared). In a transaction, which the refusal aborted, the
// transaction runs again instead (isRetryable).
func (c *bindConn) again(err error, args, withArgs []driver.NamedValue) bool {
	if len(withArgs) == len(args) {
		return false
	}
	lost := preparedLost(err)
	if lost && withArgs[0].Value == pgx.QueryExecModeCacheStatement {
		c.unprepared.Store(true)
		withArgs[0].Value = pgx.QueryExecModeExec
	}
	return (lost || planChanged(err)) && c.Conn.Conn().PgConn().TxStatus() == 'I'
}

// preparedLost reports PostgreSQL refusing a prepared statement it does
// not have (26000), or the preparing of one whose name it has (42P05).
func preparedLost(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "26000" || pgErr.Code == "42P05")
}

// planChanged reports PostgreSQL refusing a statement prepared before a
// column it returns changed type (a migration, a newer process's in a
// rolling upgrade). pgx drops the statement from its cache on any error,
// so the connection prepares it anew the next time it runs.
func planChanged(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "0A000" && pgErr.Message == "cached plan must not change result type"
}

// withArgs is args, or, when there are none and ctx carries binds, the
// send mode and the binds' values.
func (c *bindConn) withArgs(ctx context.Context, args []driver.NamedValue) []driver.NamedValue {
	b, ok := ctx.Value(bindsKey{}).(*binds)
	if !ok || len(b.values) == 0 || len(args) > 0 {
		return args
	}
	out := make([]driver.NamedValue, 0, 1+len(b.values))
	mode := c.mode
	if mode == pgx.QueryExecModeCacheStatement && c.unprepared.Load() {
		mode = pgx.QueryExecModeExec
	}
	out = append(out, driver.NamedValue{Ordinal: 1, Value: mode})
	for i, v := range b.values {
		out = append(out, driver.NamedValue{Ordinal: i + 2, Value: v})
	}
	return out
}

// bindModes are pgx's names of its send modes (default_query_exec_mode).
var bindModes = map[string]pgx.QueryExecMode{
	"cache_statement": pgx.QueryExecModeCacheStatement,
	"cache_describe":  pgx.QueryExecModeCacheDescribe,
	"describe_exec":   pgx.QueryExecModeDescribeExec,
	"exec":            pgx.QueryExecModeExec,
	"simple_protocol": pgx.QueryExecModeSimpleProtocol,
}
