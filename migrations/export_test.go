package migrations

// LockMigrations is lockMigrations, for the tests of its holder dying.
var LockMigrations = lockMigrations
