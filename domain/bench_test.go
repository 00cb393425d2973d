package domain_test

import (
	"fmt"
	"os"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"kami/domain"
	"kami/domain/dbtest"
)

// Benchmarks of the ledger's two hot transactions on PostgreSQL (MySQL with
// -kind=mysql is left out for brevity; dbtest picks the server):
//
//	go test -run '^$' -bench 'PlaceOrder|RecordPayment|CloseOrders' -benchtime 5000x ./domain/
//
// Both report orders/s over the whole run, with parallel callers (the
// number of goroutines is GOMAXPROCS × -cpu's parallelism, here 8 per core).

func benchLedger(b *testing.B, cards int) (*bundle, *domain.Product) {
	db := dbtest.Open(b, dbtest.Postgres)
	bd := setup(b, db, domain.Config{MaxPendingPerContact: 0, MaxPendingPerAddress: 0})
	bd.meter = &benchMeter{}
	p := bd.product(b, 100, 0)
	for start := 0; start < cards; start += domain.MaxCodesPerCall {
		codes := make([]string, 0, domain.MaxCodesPerCall)
		for i := start; i < min(start+domain.MaxCodesPerCall, cards); i++ {
			codes = append(codes, codeFor(p.ID, i))
		}
		if _, err := bd.ledger.ImportCards(bd.ctx, p.ID, codes, "bench"); err != nil {
			b.Fatal(err)
		}
	}
	return bd, p
}

// outboxVariants runs bench twice, with the outbox (every event built and
// written in its transaction, as in production) and without it, one after
// the other: the outbox's cost measured in one run, on the same machine
// load. -count repeats the pair.
func outboxVariants(b *testing.B, bench func(b *testing.B)) {
	for _, on := range []bool{true, false} {
		b.Run(map[bool]string{true: "outbox", false: "no-outbox"}[on], func(b *testing.B) {
			domain.SetOutboxForTest(on)
			defer domain.SetOutboxForTest(true)
			bench(b)
		})
	}
}

// BenchmarkPlaceOrder places orders from parallel callers. A placement
// writes no event (unless it takes a product below its low-stock
// threshold, which the bench's has none of): the no-outbox variant is the
// noise floor of the comparison.
func BenchmarkPlaceOrder(b *testing.B) { outboxVariants(b, benchPlaceOrder) }

func benchPlaceOrder(b *testing.B) {
	bd, p := benchLedger(b, b.N+100)
	var i atomic.Int64
	b.SetParallelism(benchParallelism())
	measured := bd.meter.start(b, bd)
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			n := i.Add(1)
			if _, err := bd.ledger.PlaceOrder(bd.ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1,
				Contact: fmt.Sprintf("bench-%d", n), Provider: "sandbox"}); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "orders/s")
	measured()
}

// BenchmarkRecordPayment pays placed orders from parallel callers, as
// gateways' notifications arrive: the group commit's usual case, which
// also writes each payment's order.paid event to the outbox (one INSERT
// per batch).
func BenchmarkRecordPayment(b *testing.B) { outboxVariants(b, benchRecordPayment) }

func benchRecordPayment(b *testing.B) {
	bd, p := benchLedger(b, b.N)
	orders := make([]*domain.Order, b.N)
	for i := range orders {
		placed, err := bd.ledger.PlaceOrder(bd.ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: "c", Provider: "sandbox"})
		if err != nil {
			b.Fatal(err)
		}
		orders[i] = placed.Order
	}
	var next atomic.Int64
	b.SetParallelism(benchParallelism())
	measured := bd.meter.start(b, bd)
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			o := orders[next.Add(1)-1]
			res, err := bd.ledger.RecordPayment(bd.ctx, domain.Payment{Provider: "sandbox", OrderNo: o.OrderNo,
				TradeNo: "T" + o.OrderNo, AmountFen: o.AmountFen})
			if err != nil || res.Outcome != domain.PaymentDelivered {
				b.Errorf("%s: %v, %v", o.OrderNo, res, err)
				return
			}
		}
	})
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "payments/s")
	measured()
}

// BenchmarkCloseOrders closes due orders in the close worker's batches
// (-batch sizes 1 and 500).
func BenchmarkCloseOrders(b *testing.B) {
	for _, batch := range []int{1, 500} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) { outboxVariants(b, func(b *testing.B) { benchCloseOrders(b, batch) }) })
	}
}

// benchCloseOrders closes b.N due orders batch at a time.
func benchCloseOrders(b *testing.B, batch int) {
	bd, p := benchLedger(b, b.N)
	nos := make([]string, b.N)
	for i := range nos {
		placed, err := bd.ledger.PlaceOrder(bd.ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: "c", Provider: "sandbox"})
		if err != nil {
			b.Fatal(err)
		}
		nos[i] = placed.Order.OrderNo
	}
	bd.clock.Advance(time.Hour)
	var next atomic.Int64
	b.SetParallelism(2)
	measured := bd.meter.start(b, bd)
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			// Each Next is one order; a goroutine closes a batch
			// when it has taken batch orders' worth of iterations.
			from := int(next.Add(1)) - 1
			if from%batch != 0 {
				continue
			}
			to := min(from+batch, len(nos))
			rs, err := bd.ledger.CloseOrders(bd.ctx, nos[from:to], domain.CloseTimeout)
			if err != nil {
				b.Error(err)
				return
			}
			for _, r := range rs {
				if r.Outcome != domain.Closed {
					b.Errorf("%s: %s", r.OrderNo, r.Outcome)
				}
			}
		}
	})
	b.StopTimer()
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "closes/s")
	measured()
	bd.mustAudit(b)
}

// benchMeter measures, beside a benchmark's throughput, a figure a busy
// machine does not move: how many bytes each operation adds to the tables
// (db-B/op). (The outbox's share of statement time cannot be told apart:
// on PostgreSQL a payment batch's event INSERT is one part of the batch's
// single write statement.)
type benchMeter struct{}

// start starts measuring; what it returns reports the figure.
func (m *benchMeter) start(b *testing.B, bd *bundle) func() {
	size := func() int64 {
		var n int64
		if err := bd.db.NewRaw(`SELECT COALESCE(SUM(pg_total_relation_size(c.oid)), 0) FROM pg_class c
			JOIN pg_namespace ns ON ns.oid = c.relnamespace WHERE c.relkind = 'r' AND ns.nspname = current_schema()`).Scan(bd.ctx, &n); err != nil {
			b.Fatal(err)
		}
		return n
	}
	before := size()
	return func() { b.ReportMetric(float64(size()-before)/float64(b.N), "db-B/op") }
}

// benchParallelism is goroutines per GOMAXPROCS for the parallel
// benchmarks: KAMI_BENCH_PARALLELISM, default 8.
func benchParallelism() int {
	if n, err := strconv.Atoi(os.Getenv("KAMI_BENCH_PARALLELISM")); err == nil && n > 0 {
		return n
	}
	return 8
}
