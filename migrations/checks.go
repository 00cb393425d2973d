package migrations

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"

	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect"
)

// Changing what a column may hold, per dialect. The schema repeats the
// allowed statuses in CHECK constraints; a new status means a new CHECK,
// and each database changes one its own way:
//
//   - PostgreSQL names a column's CHECK <table>_<column>_check; it is
//     found in pg_constraint by what it says and dropped, and the new one
//     added under a name of ours, in the migration's transaction.
//   - MySQL 8 names it <table>_chk_<n> and drops it by name; MariaDB keeps
//     a column's CHECK with the column (named after it) and drops it when
//     the column is redefined. Both are handled: the column is redefined,
//     then any CHECK still saying the old thing is dropped by name.
//   - SQLite cannot alter a CHECK at all: the table is rebuilt (see
//     rebuildSQLiteTable).

// checkSpec is one CHECK constraint on one column.
type checkSpec struct {
	table, column string
	columnType    string // the column's type, to redefine it on MySQL
	name          string // the name the new constraint gets
	oldClause     string // a fragment only the old CHECK contains, to find it
	newExpr       string // the new CHECK's expression
}

// replaceCheck swaps the CHECK on spec.column for spec.newExpr on
// PostgreSQL and MySQL/MariaDB. (SQLite rebuilds the table instead.)
func replaceCheck(ctx context.Context, db bun.IDB, spec checkSpec) error {
	switch db.Dialect().Name() {
	case dialect.PG:
		var names []string
		if err := db.NewRaw(`SELECT conname FROM pg_constraint
			WHERE conrelid = ?::regclass AND contype = 'c' AND pg_get_constraintdef(oid) LIKE ?`,
			spec.table, "%"+spec.oldClause+"%").Scan(ctx, &names); err != nil {
			return fmt.Errorf("find the CHECK on %s.%s: %w", spec.table, spec.column, err)
		}
		for _, n := range names {
			if _, err := db.ExecContext(ctx, fmt.Sprintf("ALTER TABLE %s DROP CONSTRAINT %s", spec.table, pgIdent(n))); err != nil {
				return err
			}
		}
		_, err := db.ExecContext(ctx, fmt.Sprintf("ALTER TABLE %s ADD CONSTRAINT %s CHECK (%s)", spec.table, spec.name, spec.newExpr))
		return err
	case dialect.MySQL:
		// MariaDB: redefining the column drops the CHECK it carries.
		if _, err := db.ExecContext(ctx, fmt.Sprintf("ALTER TABLE %s MODIFY %s %s", spec.table, spec.column, spec.columnType)); err != nil {
			return err
		}
		names, err := mysqlChecks(ctx, db, spec.table, spec.oldClause)
		if err != nil {
			return err
		}
		for _, n := range names { // MySQL 8 keeps it as a table constraint
			if _, err := db.ExecContext(ctx, fmt.Sprintf("ALTER TABLE %s DROP CONSTRAINT `%s`", spec.table, n)); err != nil {
				return err
			}
		}
		_, err = db.ExecContext(ctx, fmt.Sprintf("ALTER TABLE %s ADD CONSTRAINT %s CHECK (%s)", spec.table, spec.name, spec.newExpr))
		return err
	}
	return fmt.Errorf("replaceCheck: unsupported dialect %s", db.Dialect().Name())
}

// mysqlChecks names the CHECK constraints of table whose clause contains
// fragment.
func mysqlChecks(ctx context.Context, db bun.IDB, table, fragment string) ([]string, error) {
	var names []string
	err := db.NewRaw(`SELECT c.CONSTRAINT_NAME FROM information_schema.TABLE_CONSTRAINTS t
		JOIN information_schema.CHECK_CONSTRAINTS c
		  ON c.CONSTRAINT_SCHEMA = t.CONSTRAINT_SCHEMA AND c.CONSTRAINT_NAME = t.CONSTRAINT_NAME
		WHERE t.TABLE_SCHEMA = DATABASE() AND t.TABLE_NAME = ? AND t.CONSTRAINT_TYPE = 'CHECK'
		  AND c.CHECK_CLAUSE LIKE ?`, table, "%"+fragment+"%").Scan(ctx, &names)
	return names, err
}

func pgIdent(s string) string { return `"` + strings.ReplaceAll(s, `"`, `""`) + `"` }

// rebuildSQLiteTable replaces table with one made by createSQL (which
// creates "<table>_new"), copying every row with copySQL (an INSERT INTO
// <table>_new ... SELECT ... FROM <table>), as SQLite's documentation
// prescribes for changes ALTER TABLE cannot make. It runs inside the
// caller's transaction, so a failure leaves the old table whole. It keeps
// the table's indexes (their SQL is read back from sqlite_schema) and its
// AUTOINCREMENT sequence, so no id is ever handed out twice. Nothing may
// reference the table by foreign key (nothing references card_stock or
// stock_flow).
func rebuildSQLiteTable(ctx context.Context, tx bun.IDB, table, createSQL, copySQL string) error {
	var indexes []string
	if err := tx.NewRaw(`SELECT sql FROM sqlite_schema WHERE type = 'index' AND tbl_name = ? AND sql IS NOT NULL`,
		table).Scan(ctx, &indexes); err != nil {
		return err
	}
	var seq sql.NullInt64
	err := tx.NewRaw(`SELECT seq FROM sqlite_sequence WHERE name = ?`, table).Scan(ctx, &seq)
	if err != nil && !errors.Is(err, sql.ErrNoRows) {
		return err
	}
	stmts := []string{createSQL, copySQL, "DROP TABLE " + table, "ALTER TABLE " + table + "_new RENAME TO " + table}
	stmts = append(stmts, indexes...)
	for _, s := range stmts {
		if _, err := tx.ExecContext(ctx, s); err != nil {
			return fmt.Errorf("rebuild %s: %w\nin: %s", table, err, s)
		}
	}
	if seq.Valid {
		// The copy set the sequence to the highest id copied; the old one
		// may have been higher (rows rolled back or deleted at the top).
		if _, err := tx.ExecContext(ctx, `UPDATE sqlite_sequence SET seq = MAX(seq, ?) WHERE name = ?`, seq.Int64, table); err != nil {
			return err
		}
	}
	return nil
}

// inMigrationTx runs fn in a transaction where the database can undo DDL
// (SQLite, PostgreSQL): a migration that fails half-way then leaves the
// schema as it found it. MySQL commits each DDL statement by itself, so
// there fn runs on db directly.
func inMigrationTx(ctx context.Context, db *bun.DB, fn func(ctx context.Context, db bun.IDB) error) error {
	if db.Dialect().Name() == dialect.MySQL {
		return fn(ctx, db)
	}
	return db.RunInTx(ctx, nil, func(ctx context.Context, tx bun.Tx) error { return fn(ctx, tx) })
}
