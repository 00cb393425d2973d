package domain_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
)

// stockState is what an import may change: a test compares it before and
// after a refused or dry-run import.
type stockState struct{ cards, batches, flows, audits int }

func (b *bundle) stockState(t testing.TB) stockState {
	t.Helper()
	var s stockState
	for table, dst := range map[string]*int{"card_stock": &s.cards, "card_batch": &s.batches, "stock_flow": &s.flows, "audit_log": &s.audits} {
		n, err := b.db.NewSelect().Table(table).Count(b.ctx)
		if err != nil {
			t.Fatal(err)
		}
		*dst = int(n)
	}
	return s
}

func (b *bundle) importFile(t testing.TB, in domain.ImportFile, content string) (*domain.ImportReport, error) {
	t.Helper()
	return b.ledger.ImportFile(b.ctx, in, strings.NewReader(content), "admin")
}

// refusals is a report's refused lines as "line:REASON".
func refusals(rep *domain.ImportReport) []string {
	var out []string
	for _, r := range rep.RefusedLines {
		out = append(out, fmt.Sprintf("%d:%s", r.Line, r.Reason))
	}
	return out
}

// TestImportFile: one file with every kind of line a real file has (a
// BOM, CRLF and LF, blanks, spaces around codes, duplicates near and far
// apart, codes the product has or had, sold ones included, control
// characters, an overlong code, codes that break the product's rule).
// Every good code is imported once into one new batch, every other line
// is refused with its number and reason, and the dry run of the same file
// reports exactly the same and changes nothing.
func TestImportFile(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 0)
		rule := `[A-Z0-9]{4}(-[A-Z0-9]{4}){3}`
		if _, err := b.ledger.UpdateProduct(b.ctx, p.ID, domain.ProductInput{CodePattern: &rule, CodeMaxLen: ptr(19)}, "admin"); err != nil {
			t.Fatal(err)
		}
		// The product already has two codes; one of them is sold.
		if _, err := b.ledger.ImportCards(b.ctx, p.ID, []string{"OLD1-AAAA-BBBB-CCCC", "OLD2-AAAA-BBBB-CCCC"}, "admin"); err != nil {
			t.Fatal(err)
		}
		o := b.order(t, p, 2)
		b.pay(t, o.Order, "T1", "N1")

		var f strings.Builder
		f.WriteString("\xEF\xBB\xBF")
		want := map[int]domain.RefusalReason{}
		line := 0
		add := func(s string, reason domain.RefusalReason) {
			line++
			f.WriteString(s)
			if reason != "" {
				want[line] = reason
			}
		}
		add("ABCD-EFGH-JKLM-NPQR\r\n", "")                                          // 1
		add("  WXYZ-1234-5678-9ABC  \n", "")                                        // 2: trimmed
		add("\n", domain.RefusedEmpty)                                              // 3
		add("   \r\n", domain.RefusedEmpty)                                         // 4
		add("ABCD-EFGH-JKLM-NPQR\n", domain.RefusedDuplicateInFile)                 // 5: as line 1
		add("OLD1-AAAA-BBBB-CCCC\n", domain.RefusedDuplicate)                       // 6: sold already
		add("OLD2-AAAA-BBBB-CCCC\n", domain.RefusedDuplicate)                       // 7: in stock
		add("abcd-efgh-jklm-npqr\n", domain.RefusedFormat)                          // 8: lower case
		add("ABCD-EFGH-JKLM\n", domain.RefusedFormat)                               // 9
		add("ABCD-EFGH-JKLM-NPQRS\n", domain.RefusedTooLong)                        // 10: 20 > 19
		add("ABCD\tEFGH-JKLM-NPQR\n", domain.RefusedControl)                        // 11
		add(strings.Repeat("X", domain.MaxCodeBytes+1)+"\n", domain.RefusedTooLong) // 12
		for i := 0; i < 2500; i++ {                                                 // more than two chunks of good codes
			add(fmt.Sprintf("G%03d-%04d-AAAA-BBBB\n", i/1000, i%1000), "")
		}
		add("G000-0003-AAAA-BBBB\n", domain.RefusedDuplicateInFile) // two chunks after its first line
		add("ZZZZ-ZZZZ-ZZZZ-ZZZZ", "")                              // the last line has no newline
		file := f.String()
		wantImported := line - len(want)

		before := b.stockState(t)
		dry, err := b.importFile(t, domain.ImportFile{ProductID: p.ID, DryRun: true, Filename: "codes.txt"}, file)
		if err != nil {
			t.Fatalf("dry run: %v", err)
		}
		if after := b.stockState(t); after != before {
			t.Fatalf("the dry run changed %+v into %+v", before, after)
		}
		if !dry.DryRun || dry.Batch != nil {
			t.Fatalf("dry run report %+v", dry)
		}

		rep, err := b.importFile(t, domain.ImportFile{ProductID: p.ID, Filename: "codes.txt", SupplierNote: "supplier A, invoice 17"}, file)
		if err != nil {
			t.Fatalf("import: %v", err)
		}
		for _, r := range []*domain.ImportReport{dry, rep} {
			if r.Lines != line || r.Imported != wantImported || r.Refused+r.Duplicates != len(want) {
				t.Fatalf("report: %d lines, %d imported, %d refused, %d duplicates; want %d, %d, %d in all",
					r.Lines, r.Imported, r.Refused, r.Duplicates, line, wantImported, len(want))
			}
			if len(r.RefusedLines) != len(want) {
				t.Fatalf("refused lines %v, want %v", refusals(r), want)
			}
			for _, rl := range r.RefusedLines {
				if want[rl.Line] != rl.Reason || rl.Message == "" {
					t.Errorf("line %d refused as %s (%q), want %s", rl.Line, rl.Reason, rl.Message, want[rl.Line])
				}
				if strings.Contains(rl.Message, "ABCD") || strings.Contains(rl.Message, "OLD") {
					t.Errorf("a refusal repeats the code: %q", rl.Message)
				}
			}
			if r.Duplicates != 4 || r.ByReason[domain.RefusedEmpty] != 2 || r.ByReason[domain.RefusedTooLong] != 2 {
				t.Errorf("by reason %v, %d duplicates", r.ByReason, r.Duplicates)
			}
		}
		bt := rep.Batch
		if bt == nil || bt.Imported != wantImported || bt.Refused != rep.Refused || bt.Duplicates != 4 ||
			bt.Source != domain.BatchFromFile || bt.Filename != "codes.txt" || bt.SupplierNote != "supplier A, invoice 17" ||
			bt.Actor != "admin" || bt.Status != domain.BatchActive {
			t.Fatalf("batch %+v", bt)
		}
		// Every imported card is in the batch, sealed, and opens to its code.
		var cards []domain.Card
		if err := db.NewSelect().Model(&cards).Where("batch_id = ?", bt.ID).Order("id").Scan(b.ctx); err != nil {
			t.Fatal(err)
		}
		if len(cards) != wantImported {
			t.Fatalf("%d cards in the batch, want %d", len(cards), wantImported)
		}
		for i, wantCode := range map[int]string{0: "ABCD-EFGH-JKLM-NPQR", 1: "WXYZ-1234-5678-9ABC", len(cards) - 1: "ZZZZ-ZZZZ-ZZZZ-ZZZZ"} {
			if code, err := b.ledger.CardCode(&cards[i]); err != nil || code != wantCode {
				t.Errorf("card %d opens to %q, %v; want %q", i, code, err, wantCode)
			}
		}
		counts, _ := b.ledger.StockCounts(b.ctx, p.ID)
		if counts[p.ID].Lockable != wantImported {
			t.Errorf("lockable %d, want %d", counts[p.ID].Lockable, wantImported)
		}
		// The same file again: every line is now a duplicate of the
		// product's (the far repeat too: its first line is a chunk away).
		again, err := b.importFile(t, domain.ImportFile{ProductID: p.ID}, file)
		if err != nil || again.Imported != 0 || again.ByReason[domain.RefusedDuplicate] != wantImported+3 {
			t.Fatalf("second import: %+v, %v", again, err)
		}
		b.mustAudit(t)
	})
}

// TestImportCSV: codes from the column the caller names (case and spaces
// aside), with quoting, a BOM and CRLF; a short record is an empty code.
func TestImportCSV(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 0)
		file := "\xEF\xBB\xBFserial, Card Code ,note\r\n" +
			"1,\"K-1,with comma\",first\r\n" +
			"2,K-2,\"a note\nover two lines\"\r\n" +
			"3\r\n" +
			"4,\"K-1,with comma\",again\r\n" +
			"5,K-5,\"last\"\r\n"
		rep, err := b.importFile(t, domain.ImportFile{ProductID: p.ID, Format: domain.ImportCSV, CSVColumn: "card code"}, file)
		if err != nil {
			t.Fatal(err)
		}
		if rep.Imported != 3 || strings.Join(refusals(rep), " ") != "5:EMPTY 6:DUPLICATE_IN_FILE" {
			t.Fatalf("report %+v, refused %v; want 3 imported, line 5 empty, line 6 a duplicate", rep, refusals(rep))
		}
		var cards []domain.Card
		if err := db.NewSelect().Model(&cards).Where("batch_id = ?", rep.Batch.ID).Order("id").Scan(b.ctx); err != nil {
			t.Fatal(err)
		}
		var codes []string
		for i := range cards {
			c, _ := b.ledger.CardCode(&cards[i])
			codes = append(codes, c)
		}
		if strings.Join(codes, "|") != "K-1,with comma|K-2|K-5" {
			t.Fatalf("codes %q", codes)
		}

		// No such column: refused before anything is read further.
		before := b.stockState(t)
		_, err = b.importFile(t, domain.ImportFile{ProductID: p.ID, Format: domain.ImportCSV, CSVColumn: "code"}, file)
		wantCode(t, err, domain.EBADINPUT)
		if !strings.Contains(domain.ErrorMessage(err), `no column "code"`) || !strings.Contains(domain.ErrorMessage(err), "Card Code") {
			t.Errorf("message %q should name the column and the header", domain.ErrorMessage(err))
		}
		for name, bad := range map[string]domain.ImportFile{
			"no column named": {ProductID: p.ID, Format: domain.ImportCSV},
			"unknown format":  {ProductID: p.ID, Format: "XLSX"},
		} {
			_, err := b.importFile(t, bad, file)
			if domain.ErrorCode(err) != domain.EBADINPUT {
				t.Errorf("%s: %v, want BAD_INPUT", name, err)
			}
		}
		// An unclosed quote would swallow the rest of the file as one
		// field: it stops at the line limit.
		swallow := "code\nA\n\"B" + strings.Repeat("x", domain.MaxImportLineBytes+10) + "\nC\n"
		_, err = b.importFile(t, domain.ImportFile{ProductID: p.ID, Format: domain.ImportCSV, CSVColumn: "code"}, swallow)
		wantCode(t, err, domain.EBADINPUT)
		_, err = b.importFile(t, domain.ImportFile{ProductID: p.ID, Format: domain.ImportCSV, CSVColumn: "code"}, "")
		wantCode(t, err, domain.EBADINPUT)
		if after := b.stockState(t); after != before {
			t.Fatalf("refused CSV imports changed %+v into %+v", before, after)
		}
	})
}

// failingReader serves content, then fails with err.
type failingReader struct {
	r   io.Reader
	err error
}

func (f *failingReader) Read(p []byte) (int, error) {
	n, err := f.r.Read(p)
	if err == io.EOF {
		return n, f.err
	}
	return n, err
}

// TestImportBadFiles: a file that is not text, one with a line of 10 MB, an
// empty one, and one whose upload breaks off after thousands of codes
// (some already inserted): each gets a clear error and changes nothing, no
// card and no batch.
func TestImportBadFiles(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 3)
		many := func(n int) string {
			var s strings.Builder
			for i := 0; i < n; i++ {
				fmt.Fprintf(&s, "BULK-%06d\n", i)
			}
			return s.String()
		}
		before := b.stockState(t)
		for name, tc := range map[string]struct {
			content string
			code    string
			msg     string
		}{
			"NUL bytes":       {many(10) + "PNG\x00\x00\x1a\n", domain.EBADINPUT, "line 11 has a NUL byte"},
			"not UTF-8":       {many(1500) + "caf\xe9\n", domain.EBADINPUT, "line 1501 is not valid UTF-8"},
			"UTF-16":          {"\xff\xfeA\x00B\x00", domain.EBADINPUT, "NUL"},
			"a 10 MB line":    {many(2500) + strings.Repeat("Z", 10<<20) + "\n", domain.EBADINPUT, "line 2501 is longer than 64 KiB"},
			"no lines":        {"", domain.EBADINPUT, "no codes"},
			"unknown product": {"", domain.ENOTFOUND, ""},
		} {
			in := domain.ImportFile{ProductID: p.ID}
			if name == "unknown product" {
				in.ProductID = 999999
			}
			_, err := b.importFile(t, in, tc.content)
			if domain.ErrorCode(err) != tc.code || !strings.Contains(domain.ErrorMessage(err), tc.msg) {
				t.Errorf("%s: %v; want %s mentioning %q", name, err, tc.code, tc.msg)
			}
		}
		// The upload breaks off after 2,500 codes: two chunks were inserted
		// in the transaction, which rolls back.
		cut := errors.New("connection reset by peer")
		_, err := b.ledger.ImportFile(b.ctx, domain.ImportFile{ProductID: p.ID}, &failingReader{strings.NewReader(many(2500)), cut}, "admin")
		if !errors.Is(err, cut) {
			t.Fatalf("broken upload: %v, want the read error", err)
		}
		// The client goes away (its request's context ends) half-way.
		ctx, cancel := context.WithCancel(b.ctx)
		_, err = b.ledger.ImportFile(ctx, domain.ImportFile{ProductID: p.ID}, &cancellingReader{r: strings.NewReader(many(5000)), after: 2500 * 12, cancel: cancel}, "admin")
		if err == nil {
			t.Fatal("an import whose client went away succeeded")
		}
		if after := b.stockState(t); after != before {
			t.Fatalf("refused imports changed %+v into %+v", before, after)
		}
		// Nothing was left behind that blocks the same codes now.
		rep, err := b.importFile(t, domain.ImportFile{ProductID: p.ID}, many(2500))
		if err != nil || rep.Imported != 2500 {
			t.Fatalf("import after the failures: %+v, %v", rep, err)
		}
		b.mustAudit(t)
	})
}

// cancellingReader cancels its import's context once it has served after
// bytes, as a client hanging up does, and then fails as the request body
// would.
type cancellingReader struct {
	r      io.Reader
	after  int
	served int
	cancel func()
}

func (c *cancellingReader) Read(p []byte) (int, error) {
	if c.served >= c.after {
		c.cancel()
		return 0, context.Canceled
	}
	n, err := c.r.Read(p[:min(len(p), c.after-c.served)])
	c.served += n
	return n, err
}

// TestImportRefusalsBounded: a file of 3,000 bad lines lists the first
// MaxRefusedLines of them and counts them all.
func TestImportRefusalsBounded(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 0)
		rep, err := b.importFile(t, domain.ImportFile{ProductID: p.ID, DryRun: true}, strings.Repeat("\n", 3000)+"ONE-GOOD\n")
		if err != nil {
			t.Fatal(err)
		}
		if rep.Refused != 3000 || rep.ByReason[domain.RefusedEmpty] != 3000 || len(rep.RefusedLines) != domain.MaxRefusedLines ||
			!rep.RefusedLinesTruncated || rep.Imported != 1 || rep.RefusedLines[domain.MaxRefusedLines-1].Line != domain.MaxRefusedLines {
			t.Fatalf("report: %d refused, %d listed, truncated %v, %d imported",
				rep.Refused, len(rep.RefusedLines), rep.RefusedLinesTruncated, rep.Imported)
		}
	})
}

// TestImportRaceSameCodes: two imports of overlapping files into one
// product at once. Each code ends up in exactly one card, the two reports
// add up to the union, and neither import fails (no deadlock: imports
// into one product take turns).
func TestImportRaceSameCodes(t *testing.T) {
	t.Parallel()
	dbtest.Servers(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		for round := 0; round < 10; round++ {
			p := b.product(t, 100, 0)
			file := func(from, to, step int) string {
				var s strings.Builder
				for i := from; i != to; i += step {
					fmt.Fprintf(&s, "R%d-%05d\n", round, i)
				}
				return s.String()
			}
			// 1,500 codes in common, in opposite orders: without the import
			// lock the two transactions would wait on each other's keys.
			files := []string{file(0, 3000, 1), file(4499, 1499, -1)}
			reps := make([]*domain.ImportReport, 2)
			errs := make([]error, 2)
			var wg sync.WaitGroup
			start := make(chan struct{})
			for i := range files {
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					reps[i], errs[i] = b.importFile(t, domain.ImportFile{ProductID: p.ID}, files[i])
				}()
			}
			close(start)
			wg.Wait()
			for i, err := range errs {
				if err != nil {
					t.Fatalf("round %d import %d: %v", round, i, err)
				}
			}
			if got := reps[0].Imported + reps[1].Imported; got != 4500 {
				t.Fatalf("round %d: imported %d + %d, want 4500 in all", round, reps[0].Imported, reps[1].Imported)
			}
			if got := reps[0].Duplicates + reps[1].Duplicates; got != 1500 {
				t.Fatalf("round %d: %d + %d duplicates, want 1500", round, reps[0].Duplicates, reps[1].Duplicates)
			}
			counts, _ := b.ledger.StockCounts(b.ctx, p.ID)
			if counts[p.ID].Lockable != 4500 {
				t.Fatalf("round %d: %d cards, want 4500", round, counts[p.ID].Lockable)
			}
		}
		b.mustAudit(t)
	})
}

// TestCodeRules: a rule is checked when it is set: a pattern that is not a
// regular expression, one too long, an empty length range are refused and
// change nothing; the list import holds codes to the rule too.
func TestCodeRules(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 0)
		for name, in := range map[string]domain.ProductInput{
			"not a regexp":    {CodePattern: ptr(`[A-Z`)},
			"backreference":   {CodePattern: ptr(`(a)\1`)}, // RE2 has none: no catastrophic backtracking
			"too long":        {CodePattern: ptr(strings.Repeat("a", domain.MaxPatternBytes+1))},
			"empty range":     {CodeMinLen: ptr(10), CodeMaxLen: ptr(5)},
			"negative":        {CodeMinLen: ptr(-1)},
			"over the limit":  {CodeMaxLen: ptr(domain.MaxCodeBytes + 1)},
			"threshold below": {LowStockThreshold: ptr(-1)},
		} {
			_, err := b.ledger.UpdateProduct(b.ctx, p.ID, in, "admin")
			if domain.ErrorCode(err) != domain.EBADINPUT {
				t.Errorf("%s: %v, want BAD_INPUT", name, err)
			}
		}
		name := "Keys"
		if _, err := b.ledger.CreateProduct(b.ctx, domain.ProductInput{Name: &name, PriceFen: ptr(int64(100)), CodePattern: ptr(`(`)}, "admin"); domain.ErrorCode(err) != domain.EBADINPUT {
			t.Errorf("create with a bad pattern: %v", err)
		}
		got, _ := b.ledger.Product(b.ctx, p.ID)
		if !got.CodeRule.IsZero() {
			t.Fatalf("refused rules changed the product: %+v", got.CodeRule)
		}
		// The pattern is anchored: a code that only contains a match is refused.
		got, err := b.ledger.UpdateProduct(b.ctx, p.ID, domain.ProductInput{CodePattern: ptr(`[0-9]{4}`), CodeMinLen: ptr(4)}, "admin")
		if err != nil || got.CodeRule.Pattern != `[0-9]{4}` || got.CodeRule.MinLen != 4 {
			t.Fatalf("set rule: %+v, %v", got, err)
		}
		if _, err := b.ledger.ImportCards(b.ctx, p.ID, []string{"1234", "x12345"}, "admin"); domain.ErrorCode(err) != domain.EBADINPUT ||
			!strings.Contains(domain.ErrorMessage(err), "code #2") || !strings.Contains(domain.ErrorMessage(err), "FORMAT") {
			t.Fatalf("list import breaking the rule: %v", err)
		}
		if res, err := b.ledger.ImportCards(b.ctx, p.ID, []string{"1234", "5678"}, "admin"); err != nil || res.Imported != 2 || res.Batch == nil {
			t.Fatalf("list import: %+v, %v", res, err)
		}
		b.mustAudit(t)
	})
}

// TestImportDoesNotWaitToAnalyze: an import's ANALYZE of card_for_sale,
// after it committed, is a courtesy to the pick's plan; a session holding
// a lock that conflicts with it (a VACUUM, an anti-wraparound autovacuum,
// another ANALYZE, a CREATE INDEX) must not keep the import from
// answering, and the caller cannot cancel it. Unhindered, an import
// leaves the table analyzed.
func TestImportDoesNotWaitToAnalyze(t *testing.T) {
	t.Parallel()
	db := dbtest.Open(t, dbtest.Postgres)
	b := setup(t, db, domain.Config{})
	p := b.product(t, 100, 1)
	var rows float64 // -1 until the table is first analyzed (or vacuumed)
	if err := db.QueryRowContext(b.ctx, "SELECT reltuples FROM pg_class WHERE oid = 'card_for_sale'::regclass").Scan(&rows); err != nil || rows != 1 {
		t.Fatalf("card_for_sale after an import of one card: %v rows in its statistics (%v), want 1", rows, err)
	}
	holder, err := db.BeginTx(b.ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback()
	if _, err := holder.ExecContext(b.ctx, "LOCK TABLE card_for_sale IN SHARE UPDATE EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := b.ledger.ImportCards(b.ctx, p.ID, []string{codeFor(p.ID, 99)}, "test")
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(20 * time.Second):
		t.Error("the import waited for a lock on card_for_sale after it committed")
		holder.Rollback()
		<-done
	}
}
