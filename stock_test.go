package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"strings"
	"testing"

	"kami/domain"
	"kami/domain/dbtest"
)

// uploadFile sends a file import to the server the way curl -F does.
func (ta *testApp) uploadFile(t *testing.T, token string, productID int64, dryRun bool, content string) (int, string) {
	t.Helper()
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	ops, _ := json.Marshal(map[string]any{
		"query":     `mutation($in: ImportFileInput!) { importCardFile(input: $in) { dryRun imported refused duplicates batch { id } } }`,
		"variables": map[string]any{"in": map[string]any{"productId": fmt.Sprint(productID), "dryRun": dryRun, "file": nil}},
	})
	mw.WriteField("operations", string(ops))
	mw.WriteField("map", `{"0": ["variables.in.file"]}`)
	fw, _ := mw.CreateFormFile("0", "codes.txt")
	io.WriteString(fw, content)
	mw.Close()
	return ta.post(t, "/graphql", http.Header{"Content-Type": {mw.FormDataContentType()}, "Authorization": {"Bearer " + token}}, buf.Bytes())
}

// TestStockThroughTheServer: the wired server takes a file import within
// KAMI_MAX_UPLOAD_BYTES and refuses one over it, serves the export to the
// admin only, raises the low-stock alert through its alerter, and its
// audit stays clean after a recall, on every database.
func TestStockThroughTheServer(t *testing.T) {
	t.Parallel()
	for _, k := range []dbtest.Kind{dbtest.SQLite, dbtest.Postgres, dbtest.MySQL} {
		t.Run(string(k), func(t *testing.T) {
			t.Parallel()
			ta := newTestApp(t, k, env{"KAMI_MAX_UPLOAD_BYTES": "4KiB"})
			p := ta.product(t, 100)
			if status, body := ta.uploadFile(t, testAdminToken, p.ID, true, "A-1\nA-2\nA-3\n"); status != 200 || !strings.Contains(body, `"dryRun":true,"imported":3`) {
				t.Fatalf("dry run: %d %s", status, body)
			}
			status, body := ta.uploadFile(t, testAdminToken, p.ID, false, "A-1\nA-2\nA-3\n")
			if status != 200 || !strings.Contains(body, `"imported":3`) {
				t.Fatalf("import: %d %s", status, body)
			}
			if status, body := ta.uploadFile(t, testAdminToken, p.ID, false, strings.Repeat("B-123456789\n", 500)); status != 413 || !strings.Contains(body, "PAYLOAD_TOO_LARGE") {
				t.Fatalf("an upload over KAMI_MAX_UPLOAD_BYTES: %d %s", status, body)
			}
			if status, _ := ta.uploadFile(t, "wrong", p.ID, false, "C-1\n"); status != 401 {
				t.Fatalf("an upload with a wrong token: %d", status)
			}

			// The buyer takes stock to the threshold: the alerter hears it.
			threshold := 2
			if _, err := ta.ledger.UpdateProduct(t.Context(), p.ID, domain.ProductInput{LowStockThreshold: &threshold}, "admin"); err != nil {
				t.Fatal(err)
			}
			if _, err := ta.shop.PlaceOrder(t.Context(), domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: "b", Provider: "sandbox"}, "", ""); err != nil {
				t.Fatal(err)
			}
			res, err := http.Get(ta.srv.URL + "/metrics")
			if err != nil {
				t.Fatal(err)
			}
			metrics, _ := io.ReadAll(res.Body)
			res.Body.Close()
			for _, want := range []string{`kami_alerts_total{kind="low_stock"} 1`, fmt.Sprintf(`kami_stock_sellable{product="%d"} 2`, p.ID),
				fmt.Sprintf(`kami_stock_low{product="%d"} 1`, p.ID), "kami_stock_up 1"} {
				if !strings.Contains(string(metrics), want) {
					t.Errorf("/metrics lacks %s", want)
				}
			}

			req, _ := http.NewRequest(http.MethodGet, ta.srv.URL+"/export/cards?product="+fmt.Sprint(p.ID), nil)
			if res, err := http.DefaultClient.Do(req); err != nil || res.StatusCode != 401 {
				t.Fatalf("export without the token: %v %v", res, err)
			}
			req.Header.Set("Authorization", "Bearer "+testAdminToken)
			res, err = http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			csv, _ := io.ReadAll(res.Body)
			res.Body.Close()
			if res.StatusCode != 200 || strings.Count(string(csv), "\n") != 4 || !strings.Contains(string(csv), ",A-3\n") {
				t.Fatalf("export: %d %q", res.StatusCode, csv)
			}

			page, err := ta.ledger.ListBatches(t.Context(), p.ID, 0, 10)
			if err != nil || len(page.Batches) != 1 {
				t.Fatalf("batches %+v %v", page, err)
			}
			if _, err := ta.shop.RecallBatch(t.Context(), page.Batches[0].ID, "bad supplier", "admin"); err != nil {
				t.Fatal(err)
			}
			if vs, err := ta.ledger.Audit(t.Context()); err != nil || len(vs) != 0 {
				t.Fatalf("audit after the recall: %v %v", vs, err)
			}
		})
	}
}
