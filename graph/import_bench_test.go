package graph_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/graph"
)

// BenchmarkImportFile uploads a file of codes over HTTP to importCardFile
// on PostgreSQL, as curl does: the whole path (multipart transport,
// resolver, the ledger's streamed import in one transaction). The client
// writes the file as it sends it, so what the process holds is the
// server's share. It reports the seconds per upload, codes per second and
// the peak of the Go heap in use while the upload ran (sampled every 5 ms
// from runtime.MemStats), for 100,000 codes and for 400,000: the peak
// does not grow with the file. The baseline, in the same run, is the same
// 100,000 codes through importCards, the list form (ten calls of 10,000
// codes, each held in memory whole).
//
//	go test -run '^$' -bench ImportFile -benchtime 1x -timeout 20m ./graph/
func BenchmarkImportFile(b *testing.B) {
	bd := setup(b, options{kind: dbtest.Postgres, mod: func(c *graph.Config) { c.MaxUploadBytes = 64 << 20 }})
	srv := httptest.NewServer(bd.handler)
	b.Cleanup(srv.Close)

	b.Run("list-baseline/codes=100000", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			p := newBenchProduct(b, bd)
			peak, elapsed := measure(func() {
				for start := 0; start < 100_000; start += domain.MaxCodesPerCall {
					codes := make([]string, domain.MaxCodesPerCall)
					for j := range codes {
						codes[j] = benchCode(start + j)
					}
					if _, err := bd.shop.ImportCards(bd.ctx, p, codes, "bench"); err != nil {
						b.Fatal(err)
					}
				}
			})
			report(b, 100_000, elapsed, peak)
		}
	})
	for _, n := range []int{100_000, 400_000} {
		b.Run(fmt.Sprintf("upload/codes=%d", n), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				p := newBenchProduct(b, bd)
				var imported int
				peak, elapsed := measure(func() { imported = uploadCodes(b, srv.URL, p, n) })
				if imported != n {
					b.Fatalf("imported %d of %d", imported, n)
				}
				report(b, n, elapsed, peak)
			}
		})
	}
}

func newBenchProduct(b *testing.B, bd *bundle) int64 {
	name, price := "Bench", int64(100)
	p, err := bd.ledger.CreateProduct(bd.ctx, domain.ProductInput{Name: &name, PriceFen: &price}, "bench")
	if err != nil {
		b.Fatal(err)
	}
	return p.ID
}

// benchCode is a 19-character code like the ones shops sell.
func benchCode(i int) string {
	return fmt.Sprintf("BNCH-%04d-%04d-%04d", i/100_000_000, i/10_000%10_000, i%10_000)
}

func report(b *testing.B, n int, elapsed time.Duration, peak uint64) {
	b.ReportMetric(elapsed.Seconds(), "s/import")
	b.ReportMetric(float64(n)/elapsed.Seconds(), "codes/s")
	b.ReportMetric(float64(peak)/(1<<20), "peak-heap-MiB")
}

// measure runs f and returns how long it took and the highest HeapInuse
// seen while it ran.
func measure(f func()) (peak uint64, elapsed time.Duration) {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	peak = ms.HeapInuse
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				runtime.ReadMemStats(&ms)
				peak = max(peak, ms.HeapInuse)
			}
		}
	}()
	start := time.Now()
	f()
	elapsed = time.Since(start)
	close(stop)
	wg.Wait()
	return peak, elapsed
}

// uploadCodes streams a multipart upload of n codes and returns how many
// the server imported.
func uploadCodes(b *testing.B, base string, productID int64, n int) int {
	pr, pw := io.Pipe()
	mw := multipart.NewWriter(pw)
	go func() {
		ops, _ := json.Marshal(map[string]any{
			"query":     `mutation($in: ImportFileInput!) { importCardFile(input: $in) { imported refused duplicates } }`,
			"variables": map[string]any{"in": map[string]any{"productId": fmt.Sprint(productID), "file": nil}},
		})
		mw.WriteField("operations", string(ops))
		mw.WriteField("map", `{"0": ["variables.in.file"]}`)
		fw, _ := mw.CreateFormFile("0", "codes.txt")
		buf := make([]byte, 0, 64<<10)
		for i := 0; i < n; i++ {
			buf = append(buf, benchCode(i)...)
			buf = append(buf, '\n')
			if len(buf) > 60<<10 {
				fw.Write(buf)
				buf = buf[:0]
			}
		}
		fw.Write(buf)
		pw.CloseWithError(mw.Close())
	}()
	req, _ := http.NewRequestWithContext(context.Background(), http.MethodPost, base+"/graphql", pr)
	req.Header.Set("Content-Type", mw.FormDataContentType())
	req.Header.Set("Authorization", string(admin))
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		b.Fatal(err)
	}
	defer res.Body.Close()
	var out struct {
		Data   struct{ ImportCardFile struct{ Imported int } }
		Errors []gqlError
	}
	raw, _ := io.ReadAll(res.Body)
	if err := json.Unmarshal(raw, &out); err != nil || len(out.Errors) > 0 {
		b.Fatalf("upload answered %d %s", res.StatusCode, strings.TrimSpace(string(raw)))
	}
	return out.Data.ImportCardFile.Imported
}
