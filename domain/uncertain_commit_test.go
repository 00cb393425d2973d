package domain_test

import (
	"context"
	"database/sql/driver"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
)

// lostCommits is a fault between kami and the database: while armed, the
// next COMMIT either goes through and then its answer is lost (applied),
// or is rolled back and reported failed the same way (not applied). Either
// way kami sees the same error, as when a connection resets after COMMIT
// was sent.
type lostCommits struct {
	armed   atomic.Int32 // how many commits to fail
	applied bool         // whether a failed commit was applied
	// cut, when set, closes the connection itself: before the COMMIT is
	// sent (not applied: the server rolls the transaction back when it
	// sees the connection go) or right after it is answered (applied).
	// The pool then drops the connection, as after a real reset.
	cut bool
	// lookups is how many reads after a failed commit fail the same way
	// (the database still out of reach).
	lookups   int32
	readsDown atomic.Int32
	// late, when set, makes an armed commit's answer lost at once while
	// the COMMIT itself reaches the server only once late is closed (the
	// server still finishing it when kami looks up the batch). The
	// connection's server session id (idQuery's answer) is sent on held
	// first, and committed is closed once the real COMMIT is done.
	late      chan struct{}
	release   func() // closes late once
	idQuery   string
	held      chan int64
	committed chan struct{}
}

// take uses up one of n's armed faults, if any is left.
func take(n *atomic.Int32) bool {
	if n.Add(-1) < 0 {
		n.Add(1)
		return false
	}
	return true
}

var errConnReset = errors.New("read tcp 127.0.0.1:40000->127.0.0.1:5432: read: connection reset by peer")

func (l *lostCommits) wrap(c driver.Connector) driver.Connector {
	return connWrapper{c, func(conn driver.Conn) driver.Conn { return &faultConn{passConn: passConn{conn}, l: l} }}
}

// connWrapper wraps every connection its connector opens.
type connWrapper struct {
	driver.Connector
	wrap func(driver.Conn) driver.Conn
}

func (c connWrapper) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return c.wrap(conn), nil
}

// passConn passes to the driver's connection what database/sql asks of
// a connection besides the driver.Conn methods.
type passConn struct{ driver.Conn }

func (c passConn) CheckNamedValue(nv *driver.NamedValue) error {
	if ch, ok := c.Conn.(driver.NamedValueChecker); ok {
		return ch.CheckNamedValue(nv)
	}
	return driver.ErrSkip
}

func (c *faultConn) ResetSession(ctx context.Context) error {
	if c.cut.Load() {
		return driver.ErrBadConn
	}
	return c.passConn.ResetSession(ctx)
}

func (c passConn) ResetSession(ctx context.Context) error {
	if r, ok := c.Conn.(driver.SessionResetter); ok {
		return r.ResetSession(ctx)
	}
	return nil
}

// faultConn passes everything to the driver's connection; only its
// transactions' commits can fail.
type faultConn struct {
	passConn
	l       *lostCommits
	holding atomic.Bool // a late COMMIT is under way: the pool must not use or close it
	cut     atomic.Bool // closed by the fault: the pool must drop it
}

func (c *faultConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	tx, err := c.Conn.(driver.ConnBeginTx).BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return &faultTx{Tx: tx, l: c.l, c: c}, nil
}

func (c *faultConn) ExecContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Result, error) {
	if e, ok := c.Conn.(driver.ExecerContext); ok {
		return e.ExecContext(ctx, q, args)
	}
	return nil, driver.ErrSkip
}

func (c *faultConn) QueryContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Rows, error) {
	if take(&c.l.readsDown) {
		return nil, errConnReset
	}
	if e, ok := c.Conn.(driver.QueryerContext); ok {
		return e.QueryContext(ctx, q, args)
	}
	return nil, driver.ErrSkip
}

func (c *faultConn) PrepareContext(ctx context.Context, q string) (driver.Stmt, error) {
	if p, ok := c.Conn.(driver.ConnPrepareContext); ok {
		return p.PrepareContext(ctx, q)
	}
	return c.Conn.Prepare(q)
}

func (c *faultConn) IsValid() bool {
	if c.holding.Load() || c.cut.Load() {
		return false
	}
	if v, ok := c.Conn.(driver.Validator); ok {
		return v.IsValid()
	}
	return true
}

// Close leaves a connection whose late COMMIT is under way to the
// goroutine sending it, which closes it once done; one the fault cut is
// closed already.
func (c *faultConn) Close() error {
	if c.holding.Load() || c.cut.Load() {
		return nil
	}
	return c.Conn.Close()
}

type faultTx struct {
	driver.Tx
	l *lostCommits
	c *faultConn
}

func (t *faultTx) Commit() error {
	if !take(&t.l.armed) {
		return t.Tx.Commit()
	}
	if t.l.late != nil {
		return t.commitLate()
	}
	t.l.readsDown.Store(t.l.lookups)
	if t.l.cut {
		if t.l.applied {
			if err := t.Tx.Commit(); err != nil {
				return err
			}
		}
		t.c.cut.Store(true)
		_ = t.c.Conn.Close()
		return errConnReset
	}
	if !t.l.applied {
		_ = t.Tx.Rollback()
		return errConnReset
	}
	if err := t.Tx.Commit(); err != nil {
		return err
	}
	return errConnReset
}

// commitLate answers the COMMIT with a reset at once and sends it to the
// server once l.late is closed.
func (t *faultTx) commitLate() error {
	id, err := t.c.sessionID(t.l.idQuery)
	if err != nil {
		return err
	}
	t.c.holding.Store(true)
	go func() {
		<-t.l.late
		_ = t.Tx.Commit()
		_ = t.c.Conn.Close()
		close(t.l.committed)
	}()
	t.l.held <- id
	return errConnReset
}

// sessionID asks the server for the connection's session id with q.
func (c *faultConn) sessionID(q string) (int64, error) {
	rows, err := c.Conn.(driver.QueryerContext).QueryContext(context.Background(), q, nil)
	if err != nil {
		return 0, err
	}
	defer rows.Close()
	v := make([]driver.Value, 1)
	if err := rows.Next(v); err != nil {
		return 0, err
	}
	if b, ok := v[0].([]byte); ok {
		return strconv.ParseInt(string(b), 10, 64)
	}
	id, ok := v[0].(int64)
	if !ok {
		return 0, fmt.Errorf("session id %T", v[0])
	}
	return id, nil
}

// eachWithLostCommits runs fn on every database kind, its connections
// passing through a lostCommits (disarmed).
func eachWithLostCommits(t *testing.T, fn func(t *testing.T, db *bun.DB, lost *lostCommits)) {
	for _, k := range []dbtest.Kind{dbtest.SQLite, dbtest.Postgres, dbtest.MySQL} {
		t.Run(string(k), func(t *testing.T) {
			t.Parallel()
			lost := &lostCommits{}
			fn(t, dbtest.OpenWith(t, k, domain.DBOptions{WrapConnector: lost.wrap}), lost)
		})
	}
}

// TestUncertainCommitPlacesOnce: when the answer to a batch's COMMIT is
// lost, the orders it wrote answer their callers (each exactly once, each
// holding its own cards), nothing is placed a second time, and a batch
// that was not written is placed again. Batches of one and of several,
// with and without idempotency keys.
func TestUncertainCommitPlacesOnce(t *testing.T) {
	t.Parallel()
	eachWithLostCommits(t, func(t *testing.T, db *bun.DB, lost *lostCommits) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 20)
		batch := func(contacts ...string) []domain.PlaceOrderInput {
			ins := make([]domain.PlaceOrderInput, len(contacts))
			for i, c := range contacts {
				ins[i] = orderInput(p, c)
			}
			return ins
		}
		for _, c := range []struct {
			name    string
			applied bool
			ins     []domain.PlaceOrderInput
		}{ // (the look-up itself failing: TestUncertainCommitUnknown)
			{"applied batch", true, batch("a1@example.com", "a2@example.com", "a3@example.com")},
			{"applied batch with a key", true, func() []domain.PlaceOrderInput {
				ins := batch("k1@example.com", "k2@example.com")
				ins[1].IdempotencyKey = "key-applied"
				return ins
			}()},
			{"applied single order", true, batch("s1@example.com")},
			{"lost batch", false, batch("l1@example.com", "l2@example.com", "l3@example.com")},
			{"lost single order", false, batch("ls@example.com")},
		} {
			before := b.orderCount(t)
			lost.applied = c.applied
			lost.armed.Store(1)
			placed, errs := b.ledger.PlaceBatchForTest(b.ctx, c.ins)
			if lost.armed.Load() != 0 {
				t.Fatalf("%s: the commit fault did not fire", c.name)
			}
			seen := map[string]bool{}
			for i := range c.ins {
				if errs[i] != nil || placed[i] == nil {
					t.Fatalf("%s: order %d: %v, %v; want it placed", c.name, i, placed[i], errs[i])
				}
				no := placed[i].Order.OrderNo
				if seen[no] {
					t.Fatalf("%s: two callers got order %s", c.name, no)
				}
				seen[no] = true
				o, err := b.ledger.Order(b.ctx, no)
				if err != nil || o.Status != domain.OrderPending || o.Contact != c.ins[i].Contact {
					t.Fatalf("%s: order %s in the database: %+v, %v", c.name, no, o, err)
				}
				if got := b.cardStatuses(t, no); got[domain.CardLocked] != 1 {
					t.Fatalf("%s: order %s holds %v", c.name, no, got)
				}
			}
			if n := b.orderCount(t) - before; n != len(c.ins) {
				t.Fatalf("%s: %d orders written for %d callers", c.name, n, len(c.ins))
			}
		}
		b.mustAudit(t)
	})
}

// TestSameKeyTwiceInOneBatch: two requests with one new idempotency key in
// the same batch make one order, which both get; the batch is not split.
// A third under that key for a different order is a CONFLICT.
func TestSameKeyTwiceInOneBatch(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 10)
		ins := []domain.PlaceOrderInput{orderInput(p, "twice@example.com"), orderInput(p, "other@example.com"),
			orderInput(p, "twice@example.com"), orderInput(p, "twice@example.com")}
		ins[0].IdempotencyKey, ins[2].IdempotencyKey, ins[3].IdempotencyKey = "same", "same", "same"
		ins[3].Quantity = 2
		placed, errs := b.ledger.PlaceBatchForTest(b.ctx, ins)
		for i := range 3 {
			if errs[i] != nil {
				t.Fatalf("order %d: %v", i, errs[i])
			}
		}
		if placed[0].Order.OrderNo != placed[2].Order.OrderNo || placed[0].AccessToken != placed[2].AccessToken {
			t.Fatalf("one key, two orders: %s and %s", placed[0].Order.OrderNo, placed[2].Order.OrderNo)
		}
		if placed[0].Replayed || !placed[2].Replayed {
			t.Fatalf("replayed: %v, %v; want the second only", placed[0].Replayed, placed[2].Replayed)
		}
		wantCode(t, errs[3], domain.ECONFLICT)
		if s := b.ledger.PlaceStats().Split; s != 0 {
			t.Fatalf("%d batches split, want none", s)
		}
		if n := b.orderCount(t); n != 2 {
			t.Fatalf("%d orders, want 2", n)
		}
		b.mustAudit(t)
	})
}

// TestUncertainCommitUnknown: when the look-up after a lost COMMIT answer
// fails too, nothing is placed again (it might place twice): every caller
// of the batch gets UNAVAILABLE, an alert is raised, and what was written
// is an unpaid order like any other, holding its own cards.
func TestUncertainCommitUnknown(t *testing.T) {
	t.Parallel()
	eachWithLostCommits(t, func(t *testing.T, db *bun.DB, lost *lostCommits) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 5)
		ins := []domain.PlaceOrderInput{orderInput(p, "u1@example.com"), orderInput(p, "u2@example.com")}
		lost.applied, lost.lookups = true, 1
		lost.armed.Store(1)
		placed, errs := b.ledger.PlaceBatchForTest(b.ctx, ins)
		if lost.armed.Load() != 0 || lost.readsDown.Load() != 0 {
			t.Fatalf("the faults did not fire: %d commits, %d reads left", lost.armed.Load(), lost.readsDown.Load())
		}
		for i := range ins {
			if placed[i] != nil || domain.ErrorCode(errs[i]) != domain.EUNAVAILABLE {
				t.Fatalf("order %d: %v, %v; want UNAVAILABLE", i, placed[i], errs[i])
			}
		}
		if n := b.alerts.count("uncertain_commit"); n != 1 {
			t.Fatalf("%d uncertain_commit alerts, want 1", n)
		}
		if n := b.orderCount(t); n != len(ins) {
			t.Fatalf("%d orders, want the %d written once", n, len(ins))
		}
		b.mustAudit(t)
	})
}

// TestUncertainCommitStillUnderWay: when the answer to a batch's COMMIT is
// lost while the server is still finishing it (or has not read it yet),
// the look-up waits for the batch's transaction to end instead of reading
// "not written" and placing the batch a second time: one set of orders,
// each caller answered with its own, no order left PENDING with nobody to
// pay it. The COMMIT reaches the server only once the look-up is waiting
// on it (the server says so), or, had it not waited, once it has read the
// orders. PostgreSQL and MariaDB: SQLite's one connection is the batch's
// until its COMMIT is done, so no look-up can run beside it.
//
// The wait is seen as the server reports it at the moment asked: on
// PostgreSQL pg_blocking_pids, on MariaDB/MySQL SHOW ENGINE INNODB STATUS
// (see innodbWaitsOn), never information_schema.innodb_lock_waits,
// whose rows can be older than the wait.
func TestUncertainCommitStillUnderWay(t *testing.T) {
	t.Parallel()
	eachWithHeldCommit(t, "card_stock", func(t *testing.T, waited waitedFunc, db *bun.DB, lost *lostCommits) {
		read := &readHook{}
		b := setup(t, db.WithQueryHook(read), domain.Config{})
		p := b.product(t, 100, 10)
		ins := []domain.PlaceOrderInput{orderInput(p, "w1@example.com"), orderInput(p, "w2@example.com"), orderInput(p, "w3@example.com")}
		ins[1].IdempotencyKey = "key-late"
		id, answers := startHeldPlace(t, b, lost, ins)
		read.watch.Store(true)
		waitFor(t, "the look-up waiting on the batch, or done reading", func() bool {
			if read.done.Load() {
				return true
			}
			w, err := waited(b.ctx, db, id)
			if err != nil {
				t.Fatal(err)
			}
			return w
		})
		lost.release()
		a := receive(t, "the batch's answer", answers)
		receive(t, "the late COMMIT", lost.committed)
		seen := map[string]bool{}
		for i := range ins {
			if a.errs[i] != nil || a.placed[i] == nil {
				t.Fatalf("order %d: %v, %v; want it placed", i, a.placed[i], a.errs[i])
			}
			no := a.placed[i].Order.OrderNo
			if seen[no] {
				t.Fatalf("two callers got order %s", no)
			}
			seen[no] = true
			o, err := b.ledger.Order(b.ctx, no)
			if err != nil || o.Status != domain.OrderPending || o.Contact != ins[i].Contact {
				t.Fatalf("order %s in the database: %+v, %v", no, o, err)
			}
			if got := b.cardStatuses(t, no); got[domain.CardLocked] != 1 {
				t.Fatalf("order %s holds %v", no, got)
			}
		}
		if n := b.orderCount(t); n != len(ins) {
			t.Fatalf("%d orders for %d callers: the batch was placed again beside the one committed late", n, len(ins))
		}
		b.mustAudit(t)
	})
}

// TestUncertainCommitLookupLocksOnlyItsCards: while the look-up after a
// lost COMMIT answer waits for the batch's transaction to end, it holds
// share locks on the batch's own cards only, so the cards of another
// product can still be placed. MariaDB plans the look-up's IN list over a
// small table as a scan of the covering index card_stock_lockable
// (product_id, status, id) unless told to read the primary key; so
// planned, it share-locks every card it passes before the first of the
// batch's, here all of an older product's (its entries come first), and
// a place, which skips locked cards, answers SOLD_OUT for them. Seen
// without waiting: placing skips the locked cards instead of waiting for
// them. SQLite has no look-up beside the batch (its one connection is the
// batch's until its COMMIT is done).
func TestUncertainCommitLookupLocksOnlyItsCards(t *testing.T) {
	t.Parallel()
	eachWithHeldCommit(t, "card_stock", func(t *testing.T, waited waitedFunc, db *bun.DB, lost *lostCommits) {
		b := setup(t, db, domain.Config{})
		other := b.product(t, 100, 4) // created first: its cards come first in card_stock_lockable
		p := b.product(t, 100, 10)
		ins := []domain.PlaceOrderInput{orderInput(p, "h1@example.com"), orderInput(p, "h2@example.com"), orderInput(p, "h3@example.com")}
		id, answers := startHeldPlace(t, b, lost, ins)
		waitFor(t, "the look-up waiting on the batch", func() bool {
			w, err := waited(b.ctx, db, id)
			if err != nil {
				t.Fatal(err)
			}
			return w
		})
		probe := orderInput(other, "other@example.com")
		probe.Quantity = 4
		placed, errs := b.ledger.PlaceBatchForTest(b.ctx, []domain.PlaceOrderInput{probe})
		if errs[0] != nil || placed[0] == nil {
			t.Errorf("placing all of another product's cards while the look-up waits: %v; want them placed (the look-up locked them)", errs[0])
		}
		lost.release()
		a := receive(t, "the batch's answer", answers)
		for i := range ins {
			if a.errs[i] != nil || a.placed[i] == nil {
				t.Fatalf("order %d: %v, %v; want it placed", i, a.placed[i], a.errs[i])
			}
		}
		receive(t, "the late COMMIT", lost.committed)
		if n := b.orderCount(t); n != len(ins)+1 {
			t.Fatalf("%d orders, want %d", n, len(ins)+1)
		}
		b.mustAudit(t)
	})
}

// eachWithHeldCommit runs fn on each server database, its connections
// passing through a lostCommits that holds an armed COMMIT back (late)
// until lost.release; waited reports whether a session waits for a row
// lock of table ("": any) that the held session's transaction holds.
func eachWithHeldCommit(t *testing.T, table string, fn func(t *testing.T, waited waitedFunc, db *bun.DB, lost *lostCommits)) {
	for _, c := range sessionProbes {
		t.Run(string(c.kind), func(t *testing.T) {
			t.Parallel()
			lost := &lostCommits{late: make(chan struct{}), idQuery: c.idQuery,
				held: make(chan int64, 1), committed: make(chan struct{})}
			lost.release = sync.OnceFunc(func() { close(lost.late) })
			fn(t, c.waited(table), dbtest.OpenWith(t, c.kind, domain.DBOptions{WrapConnector: lost.wrap}), lost)
		})
	}
}

// startHeld arms lost to hold the next COMMIT back, runs batch beside the
// test, and returns the held session's id once its COMMIT is held, and
// where batch's answer comes. A test that fails after that still sends
// the COMMIT, and waits for it, before its database is dropped: left
// open, the held transaction would keep its tables' metadata locks, and
// dropping the database (and every later query of information_schema on
// the server) would wait for it forever.
func startHeld[T any](t *testing.T, lost *lostCommits, batch func() T) (int64, <-chan T) {
	t.Helper()
	answers := make(chan T, 1)
	lost.armed.Store(1)
	go func() { answers <- batch() }()
	id := receive(t, "the lost COMMIT", lost.held)
	t.Cleanup(func() {
		lost.release()
		receive(t, "the late COMMIT", lost.committed)
	})
	return id, answers
}

// placeAnswer is what a place batch answers its callers.
type placeAnswer struct {
	placed []*domain.PlacedOrder
	errs   []error
}

// startHeldPlace places ins as one batch beside the test, its COMMIT held
// back (startHeld).
func startHeldPlace(t *testing.T, b *bundle, lost *lostCommits, ins []domain.PlaceOrderInput) (int64, <-chan placeAnswer) {
	t.Helper()
	return startHeld(t, lost, func() placeAnswer {
		placed, errs := b.ledger.PlaceBatchForTest(b.ctx, ins)
		return placeAnswer{placed, errs}
	})
}

// waitedFunc reports whether a session of db waits for a row lock the
// session id's open transaction holds.
type waitedFunc func(ctx context.Context, db *bun.DB, id int64) (bool, error)

// sessionProbes ask each server for a connection's session id and see a
// session wait on another, as the server reports it at the moment asked:
// on PostgreSQL pg_blocking_pids, on MariaDB/MySQL SHOW ENGINE INNODB
// STATUS (see innodbWaitsOn).
var sessionProbes = []struct {
	kind    dbtest.Kind
	idQuery string
	waited  func(table string) waitedFunc
}{
	{dbtest.Postgres, "SELECT pg_backend_pid()", func(string) waitedFunc {
		return func(ctx context.Context, db *bun.DB, id int64) (bool, error) {
			var n int
			err := db.NewRaw("SELECT COUNT(*) FROM pg_stat_activity WHERE ?::int = ANY(pg_blocking_pids(pid))", id).Scan(ctx, &n)
			return n > 0, err
		}
	}},
	{dbtest.MySQL, "SELECT CONNECTION_ID()", innodbWaitsOn},
}

// innodbWaitsOn reports whether a transaction waits for a row lock of
// table in db's database while the session id has a transaction open: in
// these tests only that session's batch holds locks there, so the waiter
// waits on it.
//
// It reads SHOW ENGINE INNODB STATUS, which InnoDB prints from its lock
// tables when asked. information_schema.innodb_trx, innodb_locks and
// innodb_lock_waits are not: InnoDB copies them into a cache it refills
// only once no client of the server has read them for 100ms
// (CACHE_MIN_IDLE_TIME_NS and trx_i_s_cache_end_read in trx0i_s.cc), so
// polled faster, here or by any other client, they keep showing the rows
// of a read taken before the look-up began to wait; on MariaDB 10.11
// about one run in five never saw the wait that way.
func innodbWaitsOn(table string) waitedFunc {
	return func(ctx context.Context, db *bun.DB, id int64) (bool, error) {
		var database, typ, name, status string
		if err := db.QueryRowContext(ctx, "SELECT DATABASE()").Scan(&database); err != nil {
			return false, err
		}
		if err := db.QueryRowContext(ctx, "SHOW ENGINE INNODB STATUS").Scan(&typ, &name, &status); err != nil {
			return false, err
		}
		return innodbStatusWaits(status, database, table, id), nil
	}
}

// innodbStatusWaits reads an InnoDB status: whether the session id has a
// transaction open and another transaction waits for a record lock of
// database.table (any table of database, table ""). Each transaction is a "---TRANSACTION" section
// naming its session ("MariaDB thread id N," or "MySQL thread id N,"); a
// waiting one holds the lock it waits for after "TRX HAS BEEN WAITING".
func innodbStatusWaits(status, database, table string, id int64) bool {
	holder := regexp.MustCompile(`\b(MariaDB|MySQL) thread id ` + strconv.FormatInt(id, 10) + `,`)
	of := "of table `" + database + "`.`" + table + "`"
	if table == "" {
		of = "of table `" + database + "`."
	}
	held, waits := false, false
	for _, trx := range strings.Split(status, "\n---TRANSACTION ")[1:] {
		if holder.MatchString(trx) && strings.Contains(trx, ", ACTIVE ") {
			held = true
		}
		if _, lock, ok := strings.Cut(trx, "FOR THIS LOCK TO BE GRANTED:\nRECORD LOCKS "); ok {
			line, _, _ := strings.Cut(lock, "\n")
			waits = waits || strings.Contains(line, of)
		}
	}
	return held && waits
}

// readHook, once watching, notes when a read of the orders table has been
// answered.
type readHook struct {
	watch, done atomic.Bool
}

func (h *readHook) BeforeQuery(ctx context.Context, _ *bun.QueryEvent) context.Context { return ctx }

func (h *readHook) AfterQuery(_ context.Context, e *bun.QueryEvent) {
	if h.watch.Load() && strings.HasPrefix(e.Query, "SELECT") && strings.Contains(e.Query, "orders") {
		h.done.Store(true)
	}
}
