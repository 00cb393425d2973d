// Package chaos is kami's fault campaign: a test (go test ./chaos/ -run
// Campaign) that runs several kami processes, built from this repository,
// against PostgreSQL and a Redis of its own, each reached through Toxiproxy
// run in-process, with the Alipay and WeChat Pay gateway emulators and the
// sandbox. Buyers order and pay (some twice, some late, some never), admins
// refund, while a schedule drawn from a seed injects faults: latency, resets
// and stalls on the database and Redis connections, Redis FLUSHALL, gateway
// timeouts (also after the effect), 5xx, slow and refused answers, kill -9
// and restart, and a process whose clock is off. Then everything heals, a
// sweep and a reconciliation run, and the campaign checks the ledger against
// the gateways' own books (see checks_test.go for the list).
//
// Flags: -chaos.seed=N (one campaign with that seed), -chaos.seeds=N (N
// campaigns: the fixed seed, then N-1 random ones), -chaos.duration=3m (the
// faulty phase of each campaign; default 25s), -chaos.skew=3s (the last
// process's clock offset; default drawn from the seed), -chaos.procs,
// -chaos.buyers, -chaos.race (kami built with the race detector),
// -chaos.keep (keep the logs of a passing campaign). Without flags: the
// fixed seed and one random seed, under 3 minutes in all. A failing seed
// prints the command that replays it: the same faults at the same moments
// and the same buyers' choices (the machine's timing differs, so a race may
// need a few runs).
//
// Services: PostgreSQL at KAMI_TEST_POSTGRES_URL (a fresh database is
// created for each campaign and dropped after it) and redis-server on PATH.
// Without KAMI_TEST_POSTGRES_URL the campaign is skipped, unless
// KAMI_TEST_REQUIRE_SERVICES=1, which makes a missing service a failure.
package chaos
