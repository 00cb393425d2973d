package domain_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/domain/domaintest"
	"kami/migrations"
)

// A test binary started with importerEnv set is not a test run: it is an
// importing process that its test kills half-way (see importerMain).
const importerEnv = "KAMI_DOMAIN_TEST_IMPORTER"

func TestMain(m *testing.M) {
	if os.Getenv(importerEnv) != "" {
		os.Exit(importerMain())
	}
	os.Exit(m.Run())
}

// killAfterChunks is how many chunks of cards the importer inserts before
// it stops reading and waits to be killed.
const killAfterChunks = 5

// importerMain imports an endless file of codes into the product
// KAMI_DT_PRODUCT of the database KAMI_DT_DB. After its fifth insert of
// cards it prints "inserted" and its upload stalls, holding the
// transaction open, until the parent kills the process.
func importerMain() int {
	ctx := context.Background()
	db, err := domain.OpenDB(ctx, os.Getenv("KAMI_DT_DB"), "", domain.DBOptions{MaxOpenConns: 4})
	if err != nil {
		fmt.Fprintln(os.Stderr, "importer:", err)
		return 2
	}
	var inserts atomic.Int64
	db = db.WithQueryHook(insertWatcher{func() {
		if inserts.Add(1) == killAfterChunks {
			fmt.Println("inserted")
		}
	}})
	sealer, _ := domain.NewSealer(domaintest.Key())
	ledger := domain.NewLedger(db, sealer, domain.Config{}, nil)
	productID, _ := strconv.ParseInt(os.Getenv("KAMI_DT_PRODUCT"), 10, 64)
	_, err = ledger.ImportFile(ctx, domain.ImportFile{ProductID: productID}, &stallingCodes{stallAfter: killAfterChunks*1000 + 500}, "admin")
	fmt.Fprintln(os.Stderr, "importer: the import ended:", err)
	return 3
}

// insertWatcher calls inserted after each INSERT into card_stock.
type insertWatcher struct{ inserted func() }

func (w insertWatcher) BeforeQuery(ctx context.Context, _ *bun.QueryEvent) context.Context {
	return ctx
}
func (w insertWatcher) AfterQuery(_ context.Context, ev *bun.QueryEvent) {
	// "INSERT INTO card_stock" quoted as the dialect quotes; on PostgreSQL
	// inside "WITH card AS (…)".
	if _, into, ok := strings.Cut(ev.Query[:min(len(ev.Query), 60)], "INSERT INTO "); ev.Err == nil && ok && strings.Contains(into[:min(len(into), 12)], "card_stock") {
		w.inserted()
	}
}

// stallingCodes serves "KILL-0000001\n"... and blocks forever after
// stallAfter lines, as an upload whose client stopped sending does.
type stallingCodes struct {
	stallAfter int
	served     int
	pending    []byte
}

func (s *stallingCodes) Read(p []byte) (int, error) {
	for len(s.pending) < len(p) && s.served < s.stallAfter {
		s.served++
		s.pending = fmt.Appendf(s.pending, "KILL-%07d\n", s.served)
	}
	if len(s.pending) == 0 {
		select {} // the client stalls; the process is killed here
	}
	n := copy(p, s.pending)
	s.pending = s.pending[n:]
	return n, nil
}

// TestImportKilled: a process is killed (SIGKILL, no goodbye) in the
// middle of a file import, with 5,000 cards of the batch already inserted
// in its transaction. Neither the batch nor any of its cards ever becomes
// visible, before or after the kill, and the same codes import cleanly
// afterwards: nothing half-done is left behind, not even a lock.
func TestImportKilled(t *testing.T) {
	t.Parallel()
	for _, k := range []dbtest.Kind{dbtest.SQLite, dbtest.Postgres, dbtest.MySQL} {
		t.Run(string(k), func(t *testing.T) {
			t.Parallel()
			url := dbtest.URL(t, k)
			db, err := domain.OpenDB(context.Background(), url, t.TempDir(), domain.DBOptions{MaxOpenConns: 4})
			if err != nil {
				t.Fatal(err)
			}
			defer db.Close()
			if _, err := migrations.Migrate(context.Background(), db); err != nil {
				t.Fatal(err)
			}
			b := setup(t, db, domain.Config{})
			p := b.product(t, 100, 0)
			before := b.stockState(t)

			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), importerEnv+"=1", "KAMI_DT_DB="+url, fmt.Sprintf("KAMI_DT_PRODUCT=%d", p.ID))
			out, err := cmd.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			cmd.Stderr = os.Stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			defer cmd.Process.Kill()
			lines := make(chan string, 1)
			go func() {
				sc := bufio.NewScanner(out)
				for sc.Scan() {
					lines <- sc.Text()
				}
				close(lines)
				io.Copy(io.Discard, out)
			}()
			select {
			case l, ok := <-lines:
				if !ok || l != "inserted" {
					t.Fatalf("importer said %q", l)
				}
			case <-time.After(2 * time.Minute):
				t.Fatal("the importer did not insert its chunks within 2 minutes")
			}
			if now := b.stockState(t); now != before {
				t.Fatalf("an import in flight is visible: %+v, before %+v", now, before)
			}
			if err := cmd.Process.Kill(); err != nil { // SIGKILL
				t.Fatal(err)
			}
			cmd.Wait()
			if now := b.stockState(t); now != before {
				t.Fatalf("a killed import left %+v, before %+v", now, before)
			}
			// The same codes import now (the server has rolled back the dead
			// transaction, or does so while this import waits for its lock).
			ctx, cancel := context.WithTimeout(b.ctx, time.Minute)
			defer cancel()
			rep, err := b.ledger.ImportFile(ctx, domain.ImportFile{ProductID: p.ID}, io.LimitReader(&stallingCodes{stallAfter: 6000}, 6000*13), "admin")
			if err != nil || rep.Imported != 6000 {
				t.Fatalf("import after the kill: %+v, %v", rep, err)
			}
			b.mustAudit(t)
		})
	}
}
