package domain

import (
	"bufio"
	"bytes"
	"context"
	"database/sql"
	"encoding/csv"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect"
	"github.com/uptrace/bun/dialect/pgdialect"
)

// Imports: every way codes come in (the importCards list, a file upload)
// runs through importCodes, one transaction per batch. Lines are read,
// checked against the product's format rule, sealed and inserted in chunks
// as they arrive, so memory stays bounded by a chunk whatever the file's
// size, and the batch is all or nothing: an import that fails, is
// cancelled or whose process dies leaves no card and no batch (the batch
// row is inserted in the same transaction, so nobody ever sees it half
// done). A dry run does exactly the same work and rolls back.

// Limits of a file import.
const (
	// MaxImportLineBytes is the longest line a file may have. A code is at
	// most MaxCodeBytes; a line far longer is not a file of codes, and the
	// import stops there rather than hold it in memory.
	MaxImportLineBytes = 64 << 10
	// MaxRefusedLines bounds the refused lines an import report lists;
	// the counts by reason are always complete.
	MaxRefusedLines = 1000
	// importChunk is how many codes one round trip checks and inserts.
	importChunk = 1000
)

// ImportFormat is how an import file lays out its codes.
type ImportFormat string

const (
	ImportLines ImportFormat = "LINES" // one code per line
	ImportCSV   ImportFormat = "CSV"   // a header line, the codes in the column the caller names
)

// ImportFile describes a file import.
type ImportFile struct {
	ProductID int64
	Format    ImportFormat
	// CSVColumn names the column that holds the codes (CSV only); it is
	// matched against the header case-insensitively.
	CSVColumn    string
	Filename     string // as the client named it; kept on the batch
	SupplierNote string
	// DryRun checks everything and changes nothing: the report says what
	// the import would do.
	DryRun bool
}

// RefusedLine is one line an import did not take.
type RefusedLine struct {
	Line    int // 1-based line number in the file (CSV: where the record starts)
	Reason  RefusalReason
	Message string
}

// ImportReport says what an import did, or on a dry run would do.
type ImportReport struct {
	DryRun bool
	// Batch is the batch the import made; nil on a dry run.
	Batch *Batch
	// Lines is how many code lines were read (a CSV's header not counted):
	// Imported + Refused + Duplicates.
	Lines      int
	Imported   int
	Refused    int // refused for their form (empty, too long, format, ...)
	Duplicates int // refused as duplicates, in the file or of the product's codes
	ByReason   map[RefusalReason]int
	// RefusedLines lists the first MaxRefusedLines refused lines, in file
	// order; RefusedLinesTruncated is set when there were more.
	RefusedLines          []RefusedLine
	RefusedLinesTruncated bool
}

func (r *ImportReport) refuse(line int, reason RefusalReason, msg string) {
	if r.ByReason == nil {
		r.ByReason = map[RefusalReason]int{}
	}
	r.ByReason[reason]++
	if reason.IsDuplicate() {
		r.Duplicates++
	} else {
		r.Refused++
	}
	// Duplicates of the product's codes are found when their chunk is
	// flushed, after later lines may have been refused: keep the first
	// MaxRefusedLines by line number, sorted when the import ends.
	rl := RefusedLine{Line: line, Reason: reason, Message: msg}
	if len(r.RefusedLines) < MaxRefusedLines {
		r.RefusedLines = append(r.RefusedLines, rl)
		return
	}
	r.RefusedLinesTruncated = true
	last := slices.MaxFunc(r.RefusedLines, byLine)
	if line < last.Line {
		r.RefusedLines[slices.Index(r.RefusedLines, last)] = rl
	}
}

func byLine(a, b RefusedLine) int { return a.Line - b.Line }

// ImportFile imports the codes of a file into a new batch of its product,
// reading r once, as it arrives. Refused lines are reported (line, reason)
// and skipped; the rest are imported as UNSOLD cards of the batch.
// NOT_FOUND (no product), BAD_INPUT (the file is not UTF-8 text, has a
// line over MaxImportLineBytes, no codes at all, a CSV without the named
// column, ...): then nothing is imported. An error reading r (the client
// went away, the upload limit) also imports nothing; it is returned as
// it came, so the caller can tell.
func (l *Ledger) ImportFile(ctx context.Context, in ImportFile, r io.Reader, actor string) (*ImportReport, error) {
	if len(in.SupplierNote) > 255 {
		return nil, Errorf(EBADINPUT, "supplierNote is longer than 255 bytes")
	}
	p, err := l.Product(ctx, in.ProductID)
	if err != nil {
		return nil, err
	}
	rule, err := p.CodeRule.compile()
	if err != nil {
		return nil, err
	}
	var src lineSource
	switch in.Format {
	case ImportLines, "":
		src = newTextLines(r)
	case ImportCSV:
		if src, err = newCSVLines(r, in.CSVColumn); err != nil {
			return nil, err
		}
	default:
		return nil, Errorf(EBADINPUT, "unknown import format %q", in.Format)
	}
	b := &Batch{ProductID: p.ID, Source: BatchFromFile, Filename: cleanFilename(in.Filename), SupplierNote: in.SupplierNote}
	var rep *ImportReport
	err = l.importTx(ctx, p.ID, func(ctx context.Context, tx bun.Tx) error {
		var err error
		rep, err = l.importCodes(ctx, tx, b, rule, src, in.DryRun, actor)
		return err
	})
	if errors.Is(err, errDryRun) {
		return rep, nil
	}
	if err != nil {
		return nil, err
	}
	return rep, nil
}

// importTx runs one import's transaction, once (a streamed file cannot be
// read twice), holding the product's import lock: imports into one
// product take turns. Two imports of overlapping codes would otherwise
// insert the same keys of the unique index in different orders and
// deadlock, failing one; in turn, the second sees the first's codes and
// reports them as duplicates. The lock is the database's own, so a
// process that dies holding it loses it with its connection: PostgreSQL's
// transaction-scoped advisory lock; on MySQL a named lock held by the
// connection (GET_LOCK) and released once the transaction is over;
// SQLite's one writer serialises imports by itself. Orders, payments and
// closes never wait on it.
func (l *Ledger) importTx(ctx context.Context, productID int64, fn func(context.Context, bun.Tx) error) error {
	conn, err := l.db.Conn(ctx)
	if err != nil {
		return err
	}
	defer conn.Close()
	if dialectName(l.db) == dialect.MySQL {
		name := fmt.Sprintf("kami:import:%d", productID)
		var got sql.NullInt64
		// The name is per database (locks are server-wide) and hashed to
		// fit the 64 characters a lock name may have.
		if err := conn.NewRaw("SELECT GET_LOCK(SHA1(CONCAT(DATABASE(), ?)), ?)", name, importLockWait.Seconds()).Scan(ctx, &got); err != nil {
			return err
		}
		if got.Int64 != 1 {
			return Errorf(ECONFLICT, "another import into product %d has been running for over %s; try again later", productID, importLockWait)
		}
		defer conn.ExecContext(context.WithoutCancel(ctx), "DO RELEASE_LOCK(SHA1(CONCAT(DATABASE(), ?)))", name)
	}
	err = conn.RunInTx(ctx, txOptions(l.db), func(ctx context.Context, tx bun.Tx) error {
		if dialectName(tx) == dialect.PG {
			if _, err := tx.ExecContext(ctx, "SELECT pg_advisory_xact_lock(?)", importLockKey(productID)); err != nil {
				return err
			}
		}
		return fn(ctx, tx)
	})
	if err == nil {
		// The pick reads card_for_sale by its key only when PostgreSQL's
		// statistics know how many rows a product has (see pickCards);
		// an import is what changes that most, and the autovacuum's
		// analysis of a table just filled may come minutes later. The
		// import is committed. On the import's own connection: one from
		// the pool could wait for a free one while this one is held.
		analyzeBriefly(context.WithoutCancel(ctx), conn, "card_for_sale")
	}
	return err
}

// importLockWait bounds how long an import waits for another into the
// same product (MySQL; PostgreSQL waits as long as the request lives).
const importLockWait = time.Minute

// importLockKey is the product's import lock among PostgreSQL's advisory
// locks: "kami" in the high half, the product in the low one.
func importLockKey(productID int64) int64 { return 0x6b616d69<<32 | productID&0xffffffff }

// errDryRun rolls back a dry run's transaction.
var errDryRun = errors.New("dry run: rolled back")

// importCodes reads every line of src into batch b (inserted here) in tx.
// It returns errDryRun, with the report, to roll a dry run back.
func (l *Ledger) importCodes(ctx context.Context, tx bun.Tx, b *Batch, rule *compiledRule, src lineSource, dryRun bool, actor string) (*ImportReport, error) {
	now := l.now()
	b.Status, b.Actor, b.CreatedAt, b.UpdatedAt = BatchActive, actorOr(actor), now, now
	if _, err := tx.NewInsert().Model(b).Exec(ctx); err != nil {
		return nil, err
	}
	rep := &ImportReport{DryRun: dryRun, ByReason: map[RefusalReason]int{}}
	chunk := newPendingCodes()
	for {
		line, text, err := src.next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, err
		}
		rep.Lines++
		code := strings.TrimSpace(text)
		if reason, msg := rule.check(code); reason != "" {
			rep.refuse(line, reason, msg)
			continue
		}
		h := l.sealer.CodeHash(b.ProductID, code)
		if first, ok := chunk.lineOf[h]; ok {
			rep.refuse(line, RefusedDuplicateInFile, fmt.Sprintf("the same code as line %d", first))
			continue
		}
		chunk.add(line, code, h)
		if chunk.len() == importChunk {
			if err := l.flushImport(ctx, tx, b, chunk, rep, now); err != nil {
				return nil, err
			}
		}
	}
	if err := l.flushImport(ctx, tx, b, chunk, rep, now); err != nil {
		return nil, err
	}
	if rep.Lines == 0 {
		return nil, Errorf(EBADINPUT, "the file has no codes")
	}
	slices.SortFunc(rep.RefusedLines, byLine)
	b.Imported, b.Refused, b.Duplicates = rep.Imported, rep.Refused, rep.Duplicates
	if _, err := tx.NewUpdate().Model(b).Column("imported", "refused", "duplicates").WherePK().Exec(ctx); err != nil {
		return nil, err
	}
	if rep.Imported > 0 {
		if err := writeFlow(ctx, tx, now, StockFlow{ProductID: b.ProductID, ChangeType: FlowImport, Quantity: rep.Imported}); err != nil {
			return nil, err
		}
	}
	if dryRun {
		return rep, errDryRun
	}
	if err := audit(ctx, tx, now, actor, "cards.import", fmt.Sprint(b.ProductID),
		fmt.Sprintf("batch=%d source=%s imported=%d refused=%d duplicates=%d", b.ID, b.Source, rep.Imported, rep.Refused, rep.Duplicates)); err != nil {
		return nil, err
	}
	rep.Batch = b
	return rep, nil
}

// pendingCodes holds the codes read since the last flush, by hash, with
// the line each came from.
type pendingCodes struct {
	lines  []int
	codes  []string
	hashes []string
	lineOf map[string]int
}

func newPendingCodes() *pendingCodes {
	return &pendingCodes{lineOf: make(map[string]int, importChunk)}
}

func (c *pendingCodes) add(line int, code, hash string) {
	c.lines, c.codes, c.hashes = append(c.lines, line), append(c.codes, code), append(c.hashes, hash)
	c.lineOf[hash] = line
}

func (c *pendingCodes) len() int { return len(c.codes) }

func (c *pendingCodes) reset() {
	c.lines, c.codes, c.hashes = c.lines[:0], c.codes[:0], c.hashes[:0]
	clear(c.lineOf)
}

// flushImport checks a chunk against every code the product has or ever
// had (the transaction sees the rows this batch inserted already, so a
// code repeated far apart in the file is found here), and inserts the
// rest. Cards are never deleted, so the unique (product_id, code_hash)
// index holds every code ever imported, sold ones included. No other
// import into the product runs meanwhile (importTx), so nothing can slip
// in between the look and the insert.
func (l *Ledger) flushImport(ctx context.Context, tx bun.Tx, b *Batch, c *pendingCodes, rep *ImportReport, at time.Time) error {
	if c.len() == 0 {
		return nil
	}
	defer c.reset()
	known, err := knownCodes(ctx, tx, b.ProductID, c.hashes)
	if err != nil {
		return err
	}
	sealed := make([][]byte, 0, c.len())
	hashes := make([]string, 0, c.len())
	for i, h := range c.hashes {
		if batch, ok := known[h]; ok {
			if batch == b.ID {
				rep.refuse(c.lines[i], RefusedDuplicateInFile, "the same code as an earlier line")
			} else {
				rep.refuse(c.lines[i], RefusedDuplicate, "the product already has or had this code")
			}
			continue
		}
		sealed = append(sealed, l.sealer.Seal(b.ProductID, c.codes[i]))
		hashes = append(hashes, h)
	}
	if err := insertCards(ctx, tx, b, sealed, hashes, at); err != nil {
		return err
	}
	rep.Imported += len(hashes)
	return nil
}

// knownCodes returns, of the given code hashes, those the product has,
// with the batch that brought each.
func knownCodes(ctx context.Context, db bun.IDB, productID int64, hashes []string) (map[string]int64, error) {
	var rows []struct {
		CodeHash string `bun:"code_hash"`
		BatchID  int64  `bun:"batch_id"`
	}
	var err error
	if dialectName(db) == dialect.PG {
		// One probe of the unique (product_id, code_hash) index per code.
		// Asked as "product_id = ? AND code_hash = ANY(...)", PostgreSQL
		// plans from statistics of before the import, in which the product
		// has few cards, and scans every card the import has inserted so
		// far through the product's other index, once per chunk: 1,000
		// codes took 40 to 150 ms after 50,000 of them, and the import
		// grew quadratic. Looked up by the whole unique key, 3.6 ms. The
		// hashes go as one array (see insertCards) of the column's type:
		// compared as text, the index could not serve.
		err = db.NewRaw(`SELECT k.code_hash, k.batch_id FROM (
			SELECT h.hash AS code_hash, (SELECT c.batch_id FROM card_stock c WHERE c.product_id = ? AND c.code_hash = h.hash) AS batch_id
			FROM unnest(?::char(64)[]) AS h(hash)) AS k WHERE k.batch_id IS NOT NULL`, productID, pgdialect.Array(hashes)).Scan(ctx, &rows)
	} else {
		err = db.NewSelect().Table("card_stock").Column("code_hash", "batch_id").
			Where("product_id = ?", productID).Where("code_hash IN (?)", bun.List(hashes)).Scan(ctx, &rows)
	}
	if err != nil {
		return nil, err
	}
	out := make(map[string]int64, len(rows))
	for _, r := range rows {
		out[r.CodeHash] = r.BatchID
	}
	return out, nil
}

// insertCards inserts a chunk of new UNSOLD cards of batch b, in order.
// On PostgreSQL the two columns that vary go as two arrays: a statement
// with a thousand rows of literals spends most of its time being parsed
// and planned (65 ms of planning for 1,000 rows, against 20 ms to insert
// them), an unnest of two arrays almost none.
func insertCards(ctx context.Context, tx bun.Tx, b *Batch, sealed [][]byte, hashes []string, at time.Time) error {
	if len(hashes) == 0 {
		return nil
	}
	if dialectName(tx) == dialect.PG {
		encs := make([]string, len(sealed))
		for i, e := range sealed {
			encs[i] = hex.EncodeToString(e)
		}
		_, err := tx.ExecContext(ctx, `WITH card AS (INSERT INTO card_stock (product_id, batch_id, code_enc, code_hash, status, created_at, updated_at)
			SELECT ?, ?, decode(t.enc, 'hex'), t.hash, ?, ?, ? FROM unnest(?::text[], ?::text[]) AS t(enc, hash) RETURNING product_id, id)
			INSERT INTO card_for_sale (product_id, card_id) SELECT product_id, id FROM card`,
			b.ProductID, b.ID, CardUnsold, at, at, pgdialect.Array(encs), pgdialect.Array(hashes))
		return err
	}
	cards := make([]Card, len(hashes))
	for i := range cards {
		cards[i] = Card{ProductID: b.ProductID, BatchID: b.ID, CodeEnc: sealed[i], CodeHash: hashes[i], Status: CardUnsold, CreatedAt: at, UpdatedAt: at}
	}
	if _, err := tx.NewInsert().Model(&cards).Returning("NULL").Exec(ctx); err != nil {
		return err
	}
	// On sale: found again by their (product_id, code_hash) key.
	_, err := tx.ExecContext(ctx, `INSERT INTO card_for_sale (product_id, card_id)
		SELECT product_id, id FROM card_stock WHERE product_id = ? AND code_hash IN (?)`, b.ProductID, bun.List(hashes))
	return err
}

func actorOr(actor string) string {
	if actor == "" {
		return "system"
	}
	return truncate(actor, 64)
}

// cleanFilename keeps what a client called its file, printable and short.
func cleanFilename(name string) string {
	name = strings.Map(func(r rune) rune {
		if isControl(r) || r == utf8.RuneError {
			return -1
		}
		return r
	}, strings.ToValidUTF8(name, ""))
	for len(name) > 255 {
		_, size := utf8.DecodeLastRuneInString(name)
		name = name[:len(name)-size]
	}
	return name
}

// --- reading lines ------------------------------------------------------------

// lineSource yields the code lines of an import: the line number and the
// raw text (not yet trimmed). io.EOF ends it; any other error stops the
// import, nothing imported.
type lineSource interface {
	next() (line int, text string, err error)
}

var utf8BOM = []byte{0xEF, 0xBB, 0xBF}

// notText is the error for a file that is not UTF-8 text.
func notText(line int, what string) error {
	return Errorf(EBADINPUT, "line %d %s: the file must be UTF-8 text (one code per line, or CSV)", line, what)
}

func lineTooLong(line int) error {
	return Errorf(EBADINPUT, "line %d is longer than %d KiB: this is not a file of codes", line, MaxImportLineBytes>>10)
}

// textLines reads one code per line, LF or CRLF, UTF-8 with or without a
// BOM, holding one line at a time (at most MaxImportLineBytes).
type textLines struct {
	r    *bufio.Reader
	line int
}

func newTextLines(r io.Reader) *textLines {
	return &textLines{r: bufio.NewReaderSize(r, MaxImportLineBytes)}
}

func (t *textLines) next() (int, string, error) {
	raw, err := t.r.ReadSlice('\n')
	switch {
	case errors.Is(err, bufio.ErrBufferFull):
		return 0, "", lineTooLong(t.line + 1)
	case err == io.EOF && len(raw) == 0:
		return 0, "", io.EOF
	case err != nil && err != io.EOF:
		return 0, "", err
	}
	t.line++
	if t.line == 1 {
		raw = bytes.TrimPrefix(raw, utf8BOM)
	}
	raw = bytes.TrimSuffix(bytes.TrimSuffix(raw, []byte("\n")), []byte("\r"))
	if err := checkText(t.line, raw); err != nil {
		return 0, "", err
	}
	return t.line, string(raw), nil
}

func checkText(line int, raw []byte) error {
	if bytes.IndexByte(raw, 0) >= 0 {
		return notText(line, "has a NUL byte")
	}
	if !utf8.Valid(raw) {
		return notText(line, "is not valid UTF-8")
	}
	return nil
}

// csvLines reads the named column of a CSV file. The header is read when
// it is made, so a missing column is refused before anything else.
type csvLines struct {
	r        *csv.Reader
	column   int
	lastLine int // where the last record read started
}

func newCSVLines(r io.Reader, column string) (*csvLines, error) {
	column = strings.TrimSpace(column)
	if column == "" || len(column) > 200 {
		return nil, Errorf(EBADINPUT, "csvColumn must name the column that holds the codes")
	}
	br := bufio.NewReader(r)
	if bom, _ := br.Peek(len(utf8BOM)); bytes.Equal(bom, utf8BOM) {
		br.Discard(len(utf8BOM))
	}
	g := &recordGuard{r: br}
	c := &csvLines{r: csv.NewReader(g)}
	g.csv = c.r
	c.r.FieldsPerRecord = -1
	c.r.ReuseRecord = true
	header, err := c.read()
	if err == io.EOF {
		return nil, Errorf(EBADINPUT, "the CSV file is empty: it needs a header line naming column %q", column)
	}
	if err != nil {
		return nil, err
	}
	c.column = -1
	names := make([]string, 0, min(len(header), 20))
	for i, h := range header {
		h = strings.TrimSpace(h)
		if strings.EqualFold(h, column) {
			c.column = i
			break
		}
		if len(names) < cap(names) {
			names = append(names, truncateRunes(h, 40))
		}
	}
	if c.column < 0 {
		return nil, Errorf(EBADINPUT, "the CSV has no column %q; its header has %d columns: %s",
			column, len(header), strings.Join(names, ", "))
	}
	return c, nil
}

// read reads one record, checked as text.
func (c *csvLines) read() ([]string, error) {
	rec, err := c.r.Read()
	var pe *csv.ParseError
	switch {
	case errors.Is(err, errRecordTooLong):
		return nil, lineTooLong(c.lastLine + 1)
	case errors.As(err, &pe):
		return nil, Errorf(EBADINPUT, "line %d is not valid CSV: %v", pe.Line, pe.Err)
	case err != nil:
		return nil, err
	}
	c.lastLine, _ = c.r.FieldPos(0)
	for i, f := range rec {
		if err := checkText(0, []byte(f)); err != nil {
			line, _ := c.r.FieldPos(i)
			return nil, checkText(line, []byte(f))
		}
	}
	return rec, nil
}

func (c *csvLines) next() (int, string, error) {
	rec, err := c.read()
	if err != nil {
		return 0, "", err
	}
	if c.column >= len(rec) {
		return c.lastLine, "", nil // an empty code: refused as EMPTY
	}
	line, _ := c.r.FieldPos(c.column)
	return line, rec[c.column], nil
}

// errRecordTooLong stops a CSV record that grows past MaxImportLineBytes
// (an unclosed quote swallowing the file), before csv.Reader holds it all.
var errRecordTooLong = errors.New("csv record too long")

// recordGuard feeds a csv.Reader and refuses to hand it more than
// MaxImportLineBytes past the end of the last record it returned.
type recordGuard struct {
	r    io.Reader
	csv  *csv.Reader
	read int64
}

func (g *recordGuard) Read(p []byte) (int, error) {
	if g.read-g.csv.InputOffset() > MaxImportLineBytes {
		return 0, errRecordTooLong
	}
	n, err := g.r.Read(p)
	g.read += int64(n)
	return n, err
}

func truncateRunes(s string, n int) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	return string([]rune(s)[:n]) + "…"
}

// --- the list form ------------------------------------------------------------

// sliceLines yields a list of codes as lines 1..n.
type sliceLines struct {
	codes []string
	i     int
}

func (s *sliceLines) next() (int, string, error) {
	if s.i == len(s.codes) {
		return 0, "", io.EOF
	}
	s.i++
	return s.i, s.codes[s.i-1], nil
}

// ImportFile imports a file through the ledger and tells the stock gate
// and the low-stock alert of the new cards (a dry run changes nothing).
func (s *Shop) ImportFile(ctx context.Context, in ImportFile, r io.Reader, actor string) (*ImportReport, error) {
	rep, err := s.Ledger.ImportFile(ctx, in, r, actor)
	if err != nil {
		return nil, err
	}
	if !rep.DryRun {
		s.imported(ctx, in.ProductID, rep.Imported)
	}
	return rep, nil
}
