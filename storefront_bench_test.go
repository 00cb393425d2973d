package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/providers/sandbox"
	"kami/queue/redistest"
)

// BenchmarkStorefrontCPU measures what kami itself spends on a shop's
// busiest requests, through its own HTTP server on PostgreSQL and Redis:
// createOrder over GraphQL (the query go run ./bench sends) and, after
// every other order, the sandbox's signed payment notification, from 64
// buyers at once so that orders and payments are batched as under load.
// The buyers are a few lines of raw HTTP/1.1 on kept-alive connections,
// so the process's CPU is nearly all kami's: cpu-µs/order is that CPU
// (user and system) per order placed, payments included, B/op and
// allocs/op are kami's allocations per order, and orders/batch and
// payments/batch the ledger's mean batch sizes. Compare two builds by
// running their test binaries in turns (the machine is shared):
//
//	KAMI_TEST_REQUIRE_SERVICES=1 go test -run '^$' -bench StorefrontCPU -benchtime 5000x -count 5 .
func BenchmarkStorefrontCPU(b *testing.B) {
	for _, pay := range []bool{false, true} {
		name := "orders"
		if pay {
			name = "orders+payments"
		}
		b.Run(name, func(b *testing.B) { benchStorefront(b, pay) })
	}
}

func benchStorefront(b *testing.B, pay bool) {
	r := redistest.Open(b, redistest.Real)
	e := env{"KAMI_DATA_DIR": b.TempDir(), "KAMI_DATABASE_URL": dbtest.URL(b, dbtest.Postgres), "KAMI_SANDBOX_SECRET": "test-secret",
		"KAMI_PUBLIC_URL": "http://kami.test", "KAMI_ADMIN_TOKEN": testAdminToken, "KAMI_REDIS_URL": r.URL, "KAMI_REDIS_PREFIX": r.Prefix(b),
		"KAMI_ORDER_TTL": "1h", "KAMI_MAX_PENDING_PER_CONTACT": "0", "KAMI_MAX_PENDING_PER_ADDRESS": "0",
		"KAMI_MAX_LOCKED_PER_CONTACT": "0", "KAMI_MAX_LOCKED_PER_ADDRESS": "0", "KAMI_LOG_LEVEL": "warn"}
	cfg, err := loadConfig(e.get)
	if err != nil {
		b.Fatal(err)
	}
	a, err := newApp(b.Context(), cfg, newLogger(cfg, io.Discard))
	if err != nil {
		b.Fatal(err)
	}
	defer a.Close(context.Background())
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	srv := &http.Server{Handler: a.handler, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute}
	go srv.Serve(ln)
	defer srv.Close()

	name := "Bench"
	price := int64(100)
	p, err := a.ledger.CreateProduct(b.Context(), domain.ProductInput{Name: &name, PriceFen: &price}, "bench")
	if err != nil {
		b.Fatal(err)
	}
	codes := make([]string, b.N)
	for i := range codes {
		codes[i] = fmt.Sprintf("BENCH-%08d", i)
	}
	for start := 0; start < len(codes); start += 10_000 {
		if _, err := a.shop.ImportCards(b.Context(), p.ID, codes[start:min(start+10_000, len(codes))], "bench"); err != nil {
			b.Fatal(err)
		}
	}

	const buyers = 64
	conns := make([]*rawConn, buyers)
	for i := range conns {
		if conns[i], err = dialRaw(ln.Addr().String()); err != nil {
			b.Fatal(err)
		}
		defer conns[i].Close()
	}
	query, _ := json.Marshal(`mutation Buy($in: CreateOrderInput!) {
  createOrder(input: $in) {
    order { orderNo status amount expiresAt }
    accessToken
    payment { kind url expiresAt }
  }
}`)
	var (
		next   atomic.Int64
		failed atomic.Value
		wg     sync.WaitGroup
	)
	b.ReportAllocs()
	b.ResetTimer()
	places0, pays0 := a.ledger.PlaceStats(), a.ledger.PayStats()
	cpu0 := processCPU()
	for _, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= b.N || failed.Load() != nil {
					return
				}
				body := fmt.Appendf(nil, `{"query":%s,"variables":{"in":{"productId":"%d","quantity":1,"contact":"buyer-%d@bench.test","provider":"sandbox"}}}`,
					query, p.ID, i)
				status, answer, err := c.post("/graphql", body, "Content-Type: application/json\r\nAccept: application/graphql-response+json, application/json\r\n")
				var out struct {
					Data struct {
						CreateOrder struct {
							Order struct{ OrderNo, Amount string }
						}
					}
				}
				if err == nil && (status != http.StatusOK || json.Unmarshal(answer, &out) != nil || out.Data.CreateOrder.Order.OrderNo == "") {
					err = fmt.Errorf("createOrder: %d %s", status, answer)
				}
				if err == nil && pay && i%2 == 0 {
					o := out.Data.CreateOrder.Order
					h, nb := sandbox.Signed("test-secret", sandbox.Notification{OrderNo: o.OrderNo, TradeNo: "BT" + o.OrderNo, Amount: o.Amount,
						PaidAt: time.Now().UTC().Format(time.RFC3339)})
					status, answer, err = c.post("/webhooks/sandbox", nb, sandbox.SignatureHeader+": "+h.Get(sandbox.SignatureHeader)+"\r\n")
					if err == nil && status != http.StatusOK {
						err = fmt.Errorf("payment: %d %s", status, answer)
					}
				}
				if err != nil {
					failed.CompareAndSwap(nil, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	cpu := processCPU() - cpu0
	b.StopTimer()
	if err, _ := failed.Load().(error); err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64(cpu.Microseconds())/float64(b.N), "cpu-µs/order")
	// The mean batch sizes, which the CPU per order depends on: a batch's
	// statements are paid once for all of its orders.
	places, pays := a.ledger.PlaceStats(), a.ledger.PayStats()
	if n := places.Batches - places0.Batches; n > 0 {
		b.ReportMetric(float64(places.Calls-places0.Calls)/float64(n), "orders/batch")
	}
	if n := pays.Batches - pays0.Batches; n > 0 {
		b.ReportMetric(float64(pays.Calls-pays0.Calls)/float64(n), "payments/batch")
	}
}

// processCPU is the user and system CPU this process has used.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// rawConn is a kept-alive HTTP/1.1 connection that costs its process
// little: a request is one write, its answer read with one buffer.
type rawConn struct {
	net.Conn
	r   *bufio.Reader
	buf []byte
}

func dialRaw(addr string) (*rawConn, error) {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return nil, err
	}
	return &rawConn{Conn: c, r: bufio.NewReaderSize(c, 16<<10)}, nil
}

// post sends body to path with the extra header lines (each ending in
// CRLF) and returns the answer's status and body.
func (c *rawConn) post(path string, body []byte, header string) (int, []byte, error) {
	c.buf = fmt.Appendf(c.buf[:0], "POST %s HTTP/1.1\r\nHost: kami.test\r\n%sContent-Length: %d\r\n\r\n", path, header, len(body))
	c.buf = append(c.buf, body...)
	if _, err := c.Write(c.buf); err != nil {
		return 0, nil, err
	}
	status, length := 0, -1
	for {
		line, err := c.r.ReadSlice('\n')
		if err != nil {
			return 0, nil, err
		}
		s := string(line[:len(line)-2])
		switch {
		case s == "":
			if length < 0 {
				return 0, nil, fmt.Errorf("no Content-Length in the answer (status %d)", status)
			}
			answer := make([]byte, length)
			_, err := io.ReadFull(c.r, answer)
			return status, answer, err
		case status == 0:
			if len(s) < 12 {
				return 0, nil, fmt.Errorf("bad status line %q", s)
			}
			status, _ = strconv.Atoi(s[9:12])
		case len(s) > 16 && (s[:16] == "Content-Length: " || s[:16] == "content-length: "):
			length, _ = strconv.Atoi(s[16:])
		}
	}
}
