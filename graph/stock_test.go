package graph_test

import (
	"bytes"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/graph"
)

const importFile = `mutation($in: ImportFileInput!) { importCardFile(input: $in) {
	dryRun lines imported refused duplicates refusedLinesTruncated
	refusedByReason { reason count } refusedLines { line reason message }
	batch { id source status supplierNote filename createdBy imported refused duplicates product { id } stock { unsold } } } }`

type importAnswer struct {
	ImportCardFile struct {
		DryRun                               bool
		Lines, Imported, Refused, Duplicates int
		RefusedLinesTruncated                bool
		RefusedByReason                      []struct {
			Reason string
			Count  int
		}
		RefusedLines []struct {
			Line            int
			Reason, Message string
		}
		Batch *struct {
			ID, Source, Status, SupplierNote, CreatedBy string
			Filename                                    *string
			Imported, Refused, Duplicates               int
			Product                                     struct{ ID string }
			Stock                                       struct{ Unsold int }
		}
	}
}

// multipartUpload builds a graphql-multipart-request-spec body: the
// operations, the map, the file, in order.
func multipartUpload(t testing.TB, query string, input map[string]any, filename, content string) (*bytes.Buffer, string) {
	t.Helper()
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	input["file"] = nil
	ops, _ := json.Marshal(map[string]any{"query": query, "variables": map[string]any{"in": input}})
	mw.WriteField("operations", string(ops))
	mw.WriteField("map", `{"0": ["variables.in.file"]}`)
	fw, err := mw.CreateFormFile("0", filename)
	if err != nil {
		t.Fatal(err)
	}
	io.WriteString(fw, content)
	mw.Close()
	return &buf, mw.FormDataContentType()
}

// countingBody counts what the server read of a request body.
type countingBody struct {
	r    io.Reader
	read atomic.Int64
}

func (c *countingBody) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.read.Add(int64(n))
	return n, err
}

func (c *countingBody) Close() error { return nil }

// upload posts a multipart body to the handler and decodes the answer.
func (b *bundle) upload(t testing.TB, who as, body io.Reader, contentType string, length int64) (int, result) {
	t.Helper()
	req := httptest.NewRequest(http.MethodPost, "/graphql", body)
	req.Header.Set("Content-Type", contentType)
	req.ContentLength = length
	if who != anon {
		req.Header.Set("Authorization", string(who))
	}
	rec := httptest.NewRecorder()
	b.handler.ServeHTTP(rec, req)
	var r result
	if err := json.Unmarshal(rec.Body.Bytes(), &struct {
		Data   *json.RawMessage
		Errors *[]gqlError
	}{&r.Data, &r.Errors}); err != nil {
		t.Fatalf("answer %q: %v", rec.Body.String(), err)
	}
	return rec.Code, r
}

func (b *bundle) countCards(t testing.TB) int {
	t.Helper()
	n, err := b.db.NewSelect().Table("card_stock").Count(b.ctx)
	if err != nil {
		t.Fatal(err)
	}
	return int(n)
}

// TestUploadImport: a file import over HTTP as curl sends it, on every
// database: a dry run answers what would happen and changes nothing, the
// import makes the batch, a CSV without the named column is refused; and
// the transport refuses a stranger, a wrong token and an oversized upload
// before reading the body, an upload that runs past the limit while
// streaming, and parts out of order, importing nothing.
func TestUploadImport(t *testing.T) {
	t.Parallel()
	for _, k := range []dbtest.Kind{dbtest.SQLite, dbtest.Postgres, dbtest.MySQL} {
		t.Run(string(k), func(t *testing.T) {
			t.Parallel()
			b := setup(t, options{kind: k, mod: func(c *graph.Config) { c.MaxUploadBytes = 64 << 10; c.MaxBodyBytes = 8 << 10 }})
			id := b.product(t, "1.00", 1) // CODE-<id>-000
			b.do(t, admin, `mutation($id: ID!) { updateProduct(id: $id, input: {codePattern: "CODE-[0-9]+-[0-9]{3}"}) { id } }`,
				map[string]any{"id": id}).decode(t, &struct{}{})
			file := "\xEF\xBB\xBF" + codeOf(id, 1) + "\r\n" + codeOf(id, 2) + "\r\n\r\n" + codeOf(id, 0) + "\r\nnot-a-code\r\n" + codeOf(id, 1) + "\r\n"
			input := func(dry bool) map[string]any {
				return map[string]any{"productId": id, "dryRun": dry, "supplierNote": "ACME, invoice 7"}
			}

			before := b.countCards(t)
			body, ct := multipartUpload(t, importFile, input(true), "codes.txt", file)
			status, res := b.upload(t, admin, body, ct, int64(body.Len()))
			var dry importAnswer
			res.decode(t, &dry)
			if status != 200 || !dry.ImportCardFile.DryRun || dry.ImportCardFile.Batch != nil || dry.ImportCardFile.Imported != 2 ||
				dry.ImportCardFile.Lines != 6 || b.countCards(t) != before {
				t.Fatalf("dry run: %d %+v (cards %d, before %d)", status, dry, b.countCards(t), before)
			}
			body, ct = multipartUpload(t, importFile, input(false), "codes.txt", file)
			status, res = b.upload(t, admin, body, ct, int64(body.Len()))
			var done importAnswer
			res.decode(t, &done)
			got := done.ImportCardFile
			var lines []string
			for _, l := range got.RefusedLines {
				lines = append(lines, fmt.Sprintf("%d:%s", l.Line, l.Reason))
			}
			if status != 200 || got.Imported != 2 || got.Refused != 2 || got.Duplicates != 2 ||
				strings.Join(lines, " ") != "3:EMPTY 4:DUPLICATE_EXISTING 5:FORMAT 6:DUPLICATE_IN_FILE" {
				t.Fatalf("import: %d %+v", status, got)
			}
			if bt := got.Batch; bt == nil || bt.Source != "FILE" || bt.Status != "ACTIVE" || bt.SupplierNote != "ACME, invoice 7" ||
				bt.Filename == nil || *bt.Filename != "codes.txt" || bt.CreatedBy != "admin" || bt.Imported != 2 || bt.Product.ID != id || bt.Stock.Unsold != 2 {
				t.Fatalf("batch %+v", got.Batch)
			}
			if dry.ImportCardFile.Imported != got.Imported || len(dry.ImportCardFile.RefusedLines) != len(got.RefusedLines) {
				t.Fatalf("the dry run said %+v, the import did %+v", dry.ImportCardFile, got)
			}

			// CSV: the named column, or a clear error.
			csvFile := "n,Code\n1," + codeOf(id, 3) + "\n"
			body, ct = multipartUpload(t, importFile, map[string]any{"productId": id, "format": "CSV", "csvColumn": "code"}, "codes.csv", csvFile)
			_, res = b.upload(t, admin, body, ct, int64(body.Len()))
			res.decode(t, &done)
			if done.ImportCardFile.Imported != 1 {
				t.Fatalf("CSV import %+v", done)
			}
			body, ct = multipartUpload(t, importFile, map[string]any{"productId": id, "format": "CSV", "csvColumn": "serial"}, "codes.csv", csvFile)
			_, res = b.upload(t, admin, body, ct, int64(body.Len()))
			if e := res.wantCode(t, domain.EBADINPUT); !strings.Contains(e.Message, `no column "serial"`) {
				t.Fatalf("missing column: %q", e.Message)
			}

			// Refused before a byte of the body is read.
			cards := b.countCards(t)
			big := strings.Repeat(codeOf(id, 9)+"\n", 100_000)
			for _, tc := range []struct {
				name   string
				who    as
				length int64
				status int
				code   string
			}{
				{"no token", anon, 1 << 30, 401, domain.EUNAUTH},
				{"wrong token", "Bearer nope", 1 << 30, 401, domain.EUNAUTH},
				{"declared too large", admin, 1 << 30, 413, "PAYLOAD_TOO_LARGE"},
			} {
				body, ct := multipartUpload(t, importFile, input(false), "big.txt", big)
				cb := &countingBody{r: body}
				status, res := b.upload(t, tc.who, cb, ct, tc.length)
				if status != tc.status || len(res.Errors) != 1 || res.Errors[0].Extensions.Code != tc.code || cb.read.Load() != 0 {
					t.Errorf("%s: %d %+v after reading %d bytes; want %d %s before reading", tc.name, status, res.Errors, cb.read.Load(), tc.status, tc.code)
				}
			}
			// No length given (chunked): it stops at the limit, imports nothing.
			body, ct = multipartUpload(t, importFile, input(false), "big.txt", big)
			cb := &countingBody{r: body}
			status, res = b.upload(t, admin, cb, ct, -1)
			if status != 413 || len(res.Errors) != 1 || res.Errors[0].Extensions.Code != "PAYLOAD_TOO_LARGE" || cb.read.Load() > 80<<10 {
				t.Errorf("streamed past the limit: %d %+v after %d bytes", status, res.Errors, cb.read.Load())
			}
			// Parts out of order, two files, a query: refused.
			for name, build := range map[string]func() (*bytes.Buffer, string){
				"map first": func() (*bytes.Buffer, string) {
					var buf bytes.Buffer
					mw := multipart.NewWriter(&buf)
					mw.WriteField("map", `{"0": ["variables.in.file"]}`)
					mw.WriteField("operations", `{"query": "mutation { __typename }"}`)
					mw.Close()
					return &buf, mw.FormDataContentType()
				},
				"two files": func() (*bytes.Buffer, string) {
					var buf bytes.Buffer
					mw := multipart.NewWriter(&buf)
					mw.WriteField("operations", `{"query": "mutation { __typename }", "variables": {"a": null, "b": null}}`)
					mw.WriteField("map", `{"0": ["variables.a"], "1": ["variables.b"]}`)
					mw.Close()
					return &buf, mw.FormDataContentType()
				},
			} {
				body, ct := build()
				if status, res := b.upload(t, admin, body, ct, int64(body.Len())); status != 400 || len(res.Errors) != 1 || res.Errors[0].Extensions.Code != "BAD_REQUEST" {
					t.Errorf("%s: %d %+v", name, status, res.Errors)
				}
			}
			// (No query takes an Upload, so a query can only fail validation.)
			body, ct = multipartUpload(t, `query($in: ImportFileInput!) { __typename }`, input(false), "q.txt", "X\n")
			if _, res := b.upload(t, admin, body, ct, int64(body.Len())); len(res.Errors) != 1 || res.Errors[0].Extensions.Code != "GRAPHQL_VALIDATION_FAILED" {
				t.Errorf("a query as upload: %+v", res.Errors)
			}
			if b.countCards(t) != cards {
				t.Fatalf("refused uploads imported %d cards", b.countCards(t)-cards)
			}
			// JSON requests keep their own, smaller limit.
			codes := make([]string, 1000)
			for i := range codes {
				codes[i] = codeOf(id, 100+i)
			}
			req := httptest.NewRequest(http.MethodPost, "/graphql", strings.NewReader(body2(`mutation($p: ID!, $c: [String!]!) { importCards(productId: $p, codes: $c) { imported } }`,
				map[string]any{"p": id, "c": codes})))
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Authorization", string(admin))
			rec := httptest.NewRecorder()
			b.handler.ServeHTTP(rec, req)
			if rec.Code != 413 {
				t.Fatalf("a JSON body over MaxBodyBytes: %d, want 413", rec.Code)
			}
		})
	}
}

func body2(query string, vars map[string]any) string {
	raw, _ := json.Marshal(map[string]any{"query": query, "variables": vars})
	return string(raw)
}

// TestRecallAPI: batches are listed, a batch's cards and state counts are
// read, a recall withdraws its unsold cards and answers the orders its
// codes went to; a second recall is CONFLICT.
func TestRecallAPI(t *testing.T) {
	t.Parallel()
	for _, k := range []dbtest.Kind{dbtest.SQLite, dbtest.Postgres, dbtest.MySQL} {
		t.Run(string(k), func(t *testing.T) {
			t.Parallel()
			b := setup(t, options{kind: k})
			id := b.product(t, "1.00", 3)
			o := b.order(t, id, 1, "buyer@example.com")
			b.pay(t, o.Order.OrderNo, "T-1")

			var list struct {
				Batches struct {
					Edges []struct {
						Node struct {
							ID, Source string
							Stock      struct{ Unsold, Sold int }
						}
					}
				}
			}
			b.do(t, admin, `query($p: ID) { batches(productId: $p) { edges { node { id source stock { unsold sold } } } } }`,
				map[string]any{"p": id}).decode(t, &list)
			if len(list.Batches.Edges) != 1 || list.Batches.Edges[0].Node.Source != "LIST" || list.Batches.Edges[0].Node.Stock.Unsold != 2 {
				t.Fatalf("batches %+v", list)
			}
			batch := list.Batches.Edges[0].Node.ID
			b.do(t, anon, `{ batches { edges { node { id } } } }`, nil).wantCode(t, domain.EUNAUTH)
			b.do(t, anon, `mutation($b: ID!) { recallBatch(id: $b, reason: "x") { withdrawn } }`, map[string]any{"b": batch}).wantCode(t, domain.EUNAUTH)

			const recall = `mutation($b: ID!) { recallBatch(id: $b, reason: "supplier says redeemed") {
				withdrawn locked sold batch { status recallReason recalledAt stock { unsold sold withdrawn }
				orders { edges { node { orderNo status } } } } } }`
			var rec struct {
				RecallBatch struct {
					Withdrawn, Locked, Sold int
					Batch                   struct {
						Status, RecallReason, RecalledAt string
						Stock                            struct{ Unsold, Sold, Withdrawn int }
						Orders                           struct {
							Edges []struct {
								Node struct{ OrderNo, Status string }
							}
						}
					}
				}
			}
			b.do(t, admin, recall, map[string]any{"b": batch}).decode(t, &rec)
			r := rec.RecallBatch
			if r.Withdrawn != 2 || r.Locked != 0 || r.Sold != 1 || r.Batch.Status != "RECALLED" || r.Batch.RecalledAt == "" ||
				r.Batch.Stock.Withdrawn != 2 || len(r.Batch.Orders.Edges) != 1 || r.Batch.Orders.Edges[0].Node.OrderNo != o.Order.OrderNo {
				t.Fatalf("recall %+v", r)
			}
			b.do(t, admin, recall, map[string]any{"b": batch}).wantCode(t, domain.ECONFLICT)

			var cards struct {
				Cards struct {
					Edges []struct {
						Node struct {
							Status string
							Batch  struct{ ID string }
						}
					}
				}
			}
			b.do(t, admin, `query($b: ID) { cards(batchId: $b, status: WITHDRAWN) { edges { node { status batch { id } } } } }`,
				map[string]any{"b": batch}).decode(t, &cards)
			if len(cards.Cards.Edges) != 2 || cards.Cards.Edges[0].Node.Batch.ID != batch {
				t.Fatalf("withdrawn cards of the batch %+v", cards)
			}
			var stats struct {
				Stats struct {
					Stock []struct{ Lockable, Withdrawn int }
				}
				Product struct{ Stock int }
			}
			b.do(t, admin, `query($p: ID!) { stats { stock { lockable withdrawn } } product(id: $p) { stock } }`, map[string]any{"p": id}).decode(t, &stats)
			if stats.Stats.Stock[0].Lockable != 0 || stats.Stats.Stock[0].Withdrawn != 2 || stats.Product.Stock != 0 {
				t.Fatalf("stock after the recall %+v", stats)
			}
			// A refund of the order that got a bad code goes as before.
			b.do(t, admin, `mutation($no: String!) { refundOrder(orderNo: $no, reason: "recalled batch") { status } }`,
				map[string]any{"no": o.Order.OrderNo}).decode(t, &struct{}{})
			// The rule and the threshold are the seller's: a buyer cannot read them.
			var seen struct {
				Product struct {
					CodeRule          *struct{ Pattern *string }
					LowStockThreshold *int
				}
			}
			b.do(t, admin, `query($id: ID!) { product(id: $id) { codeRule { pattern } lowStockThreshold } }`, map[string]any{"id": id}).decode(t, &seen)
			if seen.Product.CodeRule == nil || seen.Product.LowStockThreshold == nil {
				t.Fatalf("admin view %+v", seen)
			}
			b.do(t, anon, `query($id: ID!) { product(id: $id) { codeRule { pattern } } }`, map[string]any{"id": id}).wantCode(t, domain.EFORBIDDEN)
			// Rules: a pattern that is not a regular expression is refused.
			b.do(t, admin, `mutation($id: ID!) { updateProduct(id: $id, input: {codePattern: "[A-Z"}) { id } }`,
				map[string]any{"id": id}).wantCode(t, domain.EBADINPUT)
		})
	}
}

// TestRevealsAPI: the buyer's order query, a subscription event with the
// codes and an admin's code read are each recorded before the codes
// leave, with who and from where; admins read the record per order and
// per card. A reveal that cannot be recorded withholds the codes.
func TestRevealsAPI(t *testing.T) {
	t.Parallel()
	for _, k := range []dbtest.Kind{dbtest.SQLite, dbtest.Postgres, dbtest.MySQL} {
		t.Run(string(k), func(t *testing.T) {
			t.Parallel()
			b := setup(t, options{kind: k, mod: func(c *graph.Config) {
				c.ClientAddr = func(r *http.Request) string { return r.Header.Get("X-Test-Addr") }
			}})
			srv := httptest.NewServer(b.handler)
			t.Cleanup(srv.Close)
			id := b.product(t, "1.00", 2)
			o := b.order(t, id, 1, "buyer@example.com")

			// The subscription's PAID event carries the codes.
			c := dialWS(t, srv, transportWS, nil)
			defer c.close()
			c.subscribe("1", watch, map[string]any{"no": o.Order.OrderNo, "t": o.AccessToken})
			if s := c.nextStatus("1"); s != "PENDING" {
				t.Fatalf("first event %s", s)
			}
			b.pay(t, o.Order.OrderNo, "T-1")
			if ev, _ := c.next("1"); len(ev.Data.OrderStatusChanged.Cards) != 1 {
				t.Fatalf("PAID event %+v", ev)
			}
			const buyerRead = `query($no: String!, $t: String) { order(orderNo: $no, accessToken: $t) { cards } }`
			res := post(t, srv, appJSON, appJSON, body(buyerRead, map[string]any{"no": o.Order.OrderNo, "t": o.AccessToken}), "X-Test-Addr", "198.51.100.4")
			if len(res.Errors) > 0 || !strings.Contains(string(res.Data), codeOf(id, 0)) {
				t.Fatalf("buyer read %+v", res)
			}
			var card struct {
				Cards struct {
					Edges []struct {
						Node struct{ ID, Code, Status string }
					}
				}
			}
			b.do(t, admin, `{ cards(status: SOLD) { edges { node { id code status } } } }`, nil).decode(t, &card)
			cardID := card.Cards.Edges[0].Node.ID

			const history = `query($no: String, $card: ID) { reveals(orderNo: $no, cardId: $card) { edges { node {
				channel viewer actor clientAddress orderNo cardId codes } } } }`
			type reveal struct {
				Channel, Viewer, Actor, ClientAddress string
				OrderNo, CardID                       *string
				Codes                                 int
			}
			var perOrder, perCard struct {
				Reveals struct{ Edges []struct{ Node reveal } }
			}
			b.do(t, admin, history, map[string]any{"no": o.Order.OrderNo}).decode(t, &perOrder)
			var got []string
			for _, e := range perOrder.Reveals.Edges {
				got = append(got, e.Node.Channel+"/"+e.Node.Viewer+"/"+e.Node.ClientAddress)
			}
			// Newest first: the admin's code read, the buyer's query, the event.
			if strings.Join(got, " ") != "ADMIN_CODE/ADMIN/ ORDER/BUYER/198.51.100.4 SUBSCRIPTION/BUYER/" {
				t.Fatalf("order history %v", got)
			}
			b.do(t, admin, history, map[string]any{"card": cardID}).decode(t, &perCard)
			if len(perCard.Reveals.Edges) != 3 || perCard.Reveals.Edges[0].Node.CardID == nil || *perCard.Reveals.Edges[0].Node.CardID != cardID {
				t.Fatalf("card history %+v", perCard)
			}
			b.do(t, anon, history, map[string]any{"no": o.Order.OrderNo}).wantCode(t, domain.EUNAUTH)
			b.do(t, admin, history, nil).wantCode(t, domain.EBADINPUT)

			// No record, no codes.
			if _, err := b.db.ExecContext(b.ctx, "DROP TABLE card_reveal"); err != nil {
				t.Fatal(err)
			}
			res = post(t, srv, appJSON, appJSON, body(buyerRead, map[string]any{"no": o.Order.OrderNo, "t": o.AccessToken}))
			if len(res.Errors) != 1 || res.Errors[0].Extensions.Code != domain.EUNAVAILABLE || strings.Contains(string(res.Data), codeOf(id, 0)) {
				t.Fatalf("read without a reveal record: %+v", res)
			}
		})
	}
}

// TestExportHTTP: GET /export/cards streams the selected cards as CSV to
// an admin, recording every code as revealed; anyone else, a bad filter,
// get a clear error and no code.
func TestExportHTTP(t *testing.T) {
	t.Parallel()
	for _, k := range []dbtest.Kind{dbtest.SQLite, dbtest.Postgres, dbtest.MySQL} {
		t.Run(string(k), func(t *testing.T) {
			t.Parallel()
			b := setup(t, options{kind: k})
			srv := httptest.NewServer(graph.NewExportHandler(graph.Config{Shop: b.shop, Ledger: b.ledger, AdminToken: adminToken, Logger: quietLogger()}))
			t.Cleanup(srv.Close)
			id := b.product(t, "1.00", 1200)
			other := b.product(t, "2.00", 3)
			o := b.order(t, id, 2, "buyer@example.com")
			b.pay(t, o.Order.OrderNo, "T-1")

			get := func(who as, query string) *http.Response {
				req, _ := http.NewRequest(http.MethodGet, srv.URL+graph.ExportPath+"?"+query, nil)
				if who != anon {
					req.Header.Set("Authorization", string(who))
				}
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { resp.Body.Close() })
				return resp
			}
			for _, tc := range []struct {
				who    as
				query  string
				status int
			}{{anon, "", 401}, {"Bearer nope", "", 401}, {admin, "status=GONE", 400}, {admin, "product=x", 400}} {
				if resp := get(tc.who, tc.query); resp.StatusCode != tc.status {
					t.Errorf("%q %q: %d, want %d", tc.who, tc.query, resp.StatusCode, tc.status)
				}
			}
			if n, _ := b.db.NewSelect().Table("card_reveal").Count(b.ctx); n != 0 {
				t.Fatalf("refused exports recorded %d reveals", n)
			}

			resp := get(admin, "product="+id)
			if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/csv; charset=utf-8" ||
				!strings.HasPrefix(resp.Header.Get("Content-Disposition"), "attachment") {
				t.Fatalf("export: %d %v", resp.StatusCode, resp.Header)
			}
			rows, err := csv.NewReader(resp.Body).ReadAll()
			if err != nil {
				t.Fatal(err)
			}
			if len(rows) != 1201 || strings.Join(rows[0], ",") != "card_id,product_id,product,batch_id,status,order_no,imported_at,locked_at,sold_at,code" {
				t.Fatalf("%d rows, header %v", len(rows), rows[0])
			}
			sold := 0
			for i, r := range rows[1:] {
				if r[1] != id || r[9] != codeOf(id, i) {
					t.Fatalf("row %d: %v", i, r)
				}
				if r[4] == "SOLD" {
					sold++
					if r[5] != o.Order.OrderNo || r[8] == "" {
						t.Fatalf("sold row %v", r)
					}
				}
			}
			if sold != 2 {
				t.Fatalf("%d sold rows, want 2", sold)
			}
			if n, _ := b.db.NewSelect().Table("card_reveal").Where("channel = 'EXPORT'").Count(b.ctx); n != 1200 {
				t.Fatalf("%d export reveals recorded, want 1200", n)
			}
			resp = get(admin, "product="+other+"&status=unsold,SOLD")
			rows, _ = csv.NewReader(resp.Body).ReadAll()
			if len(rows) != 4 {
				t.Fatalf("filtered export: %d rows", len(rows))
			}
			resp = get(admin, "product="+other+"&status=WITHDRAWN")
			rows, _ = csv.NewReader(resp.Body).ReadAll()
			if resp.StatusCode != 200 || len(rows) != 1 {
				t.Fatalf("empty export: %d, %d rows", resp.StatusCode, len(rows))
			}
		})
	}
}
