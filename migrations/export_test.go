package migrations

// For the tests of the migration lock and of steps cut short.
var (
	LockMigrations = lockMigrations
	MigrateWith    = migrateWith
	Step           = step
)
