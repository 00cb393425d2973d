package queue_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/domaintest"
	"kami/queue"
)

// A test binary started with workerEnv set is not a test run: it is a
// worker process of a test, which its parent drives through the KAMI_QW_*
// variables, its stdin (closed: stop) and its stdout (one status line per
// event).
const workerEnv = "KAMI_QUEUE_TEST_WORKER"

func workerMain() int {
	ctx := context.Background()
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "worker:", err)
		return 2
	}
	db, err := domain.OpenDB(ctx, os.Getenv("KAMI_QW_DB"), "", domain.DBOptions{MaxOpenConns: 8})
	if err != nil {
		return fail(err)
	}
	defer db.Close()
	rdb, closeRedis, err := queue.Connect(ctx, os.Getenv("KAMI_QW_REDIS"))
	if err != nil {
		return fail(err)
	}
	defer closeRedis()
	keys := queue.NewKeys(os.Getenv("KAMI_QW_PREFIX"))
	lease, _ := time.ParseDuration(os.Getenv("KAMI_QW_LEASE"))
	batch, _ := strconv.Atoi(os.Getenv("KAMI_QW_BATCH"))
	switch os.Getenv(workerEnv) {
	case "claim-and-hang":
		// Claim a batch and start closing it, then hang holding the rows
		// until the parent kills the process.
		c, err := queue.CloseQueue(rdb, keys).Claim(ctx, time.Now(), batch, lease)
		if err != nil {
			return fail(err)
		}
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return fail(err)
		}
		if len(c.Members) > 0 {
			if _, err := tx.NewUpdate().Table("orders").Set("updated_at = ?", time.Now().UTC()).
				Where("order_no IN (?)", bun.List(c.Members)).Exec(ctx); err != nil {
				return fail(err)
			}
		}
		fmt.Printf("claimed %d\n", len(c.Members))
		select {}
	case "pay-and-hang":
		// Record a payment (its outbox event committed with it), then hang
		// until the parent kills the process: nothing is delivered.
		sealer, err := domain.NewSealer(domaintest.Key())
		if err != nil {
			return fail(err)
		}
		ledger := domain.NewLedger(db, sealer, domain.Config{}, domain.LogAlerter{Logger: quietLogger()})
		o, err := ledger.Order(ctx, os.Getenv("KAMI_QW_ORDER"))
		if err != nil {
			return fail(err)
		}
		if _, err := ledger.RecordPayment(ctx, domain.Payment{Provider: o.Provider, OrderNo: o.OrderNo, TradeNo: "T-" + o.OrderNo, AmountFen: o.AmountFen}); err != nil {
			return fail(err)
		}
		fmt.Println("paid")
		select {}
	case "work":
		sealer, err := domain.NewSealer(domaintest.Key())
		if err != nil {
			return fail(err)
		}
		ledger := domain.NewLedger(db, sealer, domain.Config{}, domain.LogAlerter{Logger: quietLogger()})
		shop := &domain.Shop{Ledger: ledger, Gate: queue.NewStockGate(rdb, keys, ledger),
			Scheduler: queue.NewScheduler(rdb, keys), Events: queue.NewEvents(rdb, keys, quietLogger()), Log: quietLogger()}
		w := queue.NewWorkers(queue.Config{Lease: lease, CloseBatch: batch, RecoverEvery: time.Second, SweepEvery: time.Second},
			rdb, keys, shop, ledger, quietLogger())
		if err := w.Start(ctx); err != nil {
			return fail(err)
		}
		fmt.Println("ready")
		io.Copy(io.Discard, os.Stdin)
		sctx, cancel := context.WithTimeout(ctx, 2*time.Minute) // finishing the batch in hand, on a busy machine
		defer cancel()
		if err := w.Stop(sctx); err != nil {
			return fail(err)
		}
		fmt.Printf("closed %d\n", w.Stats().Closed)
		return 0
	}
	return fail(fmt.Errorf("unknown worker mode %q", os.Getenv(workerEnv)))
}

// child is a worker process started by a test.
type child struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	lines chan string
}

func startChild(t *testing.T, mode, dbURL, redisURL, prefix string, lease time.Duration, batch int) *child {
	t.Helper()
	return startChildEnv(t, nil, mode, dbURL, redisURL, prefix, lease, batch)
}

// startChildEnv is startChild with more variables for the child.
func startChildEnv(t *testing.T, env []string, mode, dbURL, redisURL, prefix string, lease time.Duration, batch int) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(append(os.Environ(), env...), workerEnv+"="+mode, "KAMI_QW_DB="+dbURL, "KAMI_QW_REDIS="+redisURL,
		"KAMI_QW_PREFIX="+prefix, "KAMI_QW_LEASE="+lease.String(), "KAMI_QW_BATCH="+strconv.Itoa(batch))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &child{cmd: cmd, stdin: stdin, lines: make(chan string, 16)}
	go func() {
		defer close(c.lines)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			c.lines <- sc.Text()
		}
	}()
	t.Cleanup(func() {
		if c.cmd.ProcessState == nil {
			c.cmd.Process.Kill()
			c.cmd.Wait()
		}
	})
	return c
}

// line waits for the child's next status line starting with prefix and
// returns the rest.
func (c *child) line(t *testing.T, prefix string, within time.Duration) string {
	t.Helper()
	timeout := time.After(max(within, domaintest.MinPatience)) // a deadline for giving up, never a speed
	for {
		select {
		case l, ok := <-c.lines:
			if !ok {
				t.Fatalf("worker process ended before %q", prefix)
			}
			if rest, found := strings.CutPrefix(l, prefix); found {
				return strings.TrimSpace(rest)
			}
		case <-timeout:
			t.Fatalf("worker process said no %q within %s", prefix, within)
		}
	}
}

// stop closes the child's stdin, waits for it to end cleanly and returns
// how many orders it closed.
func (c *child) stop(t *testing.T) int {
	t.Helper()
	c.stdin.Close()
	n, err := strconv.Atoi(c.line(t, "closed ", 20*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.cmd.Wait(); err != nil {
		t.Fatalf("worker process: %v", err)
	}
	return n
}

func (c *child) kill9(t *testing.T) {
	t.Helper()
	if err := c.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	c.cmd.Wait()
}
