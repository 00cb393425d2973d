// Package queue is kami's Redis side: the delay queues that schedule order
// closes and refund retries, the stock admission counters, the order event
// stream, and the workers that drain the queues into the ledger.
//
// Redis only schedules; the database decides. Anything here may be lost
// (FLUSHALL, restart, failover) and is rebuilt from the database by the
// sweeper without losing or doubling an effect.
package queue

import (
	"os"
	"strconv"
	"strings"
)

// DefaultPrefix is KAMI_REDIS_PREFIX's default.
const DefaultPrefix = "kami:"

// Keys names every Redis key kami uses. All names are built here, under one
// prefix, so two shops on one Redis never mix. Keys a script touches together
// share a hash tag ({...}), so they sit in one slot and the scripts run on
// Redis Cluster.
type Keys struct {
	prefix string
}

// NewKeys returns the key names under prefix ("" means DefaultPrefix). The
// prefix must not contain braces: they would move the hash tag.
func NewKeys(prefix string) Keys {
	if prefix == "" {
		prefix = DefaultPrefix
	}
	prefix = strings.NewReplacer("{", "", "}", "").Replace(prefix)
	return Keys{prefix: prefix}
}

// KeysFromEnv reads KAMI_REDIS_PREFIX.
func KeysFromEnv() Keys { return NewKeys(os.Getenv("KAMI_REDIS_PREFIX")) }

// Prefix is the prefix every key starts with.
func (k Keys) Prefix() string { return k.prefix }

// CloseQueue is the ZSET of orders to close, scored by due time (unix ms).
func (k Keys) CloseQueue() string { return k.prefix + "{delay:close:order}" }

// CloseLease holds claimed close tasks, scored by lease deadline (unix ms).
func (k Keys) CloseLease() string { return k.CloseQueue() + ":lease" }

// RefundQueue is the ZSET of refunds to attempt, scored by due time.
func (k Keys) RefundQueue() string { return k.prefix + "{delay:refund:retry}" }

// RefundLease holds claimed refund tasks.
func (k Keys) RefundLease() string { return k.RefundQueue() + ":lease" }

// MailQueue is the ZSET of order mails to attempt (mail_sends ids),
// scored by due time.
func (k Keys) MailQueue() string { return k.prefix + "{delay:mail:send}" }

// MailLease holds claimed mail tasks.
func (k Keys) MailLease() string { return k.MailQueue() + ":lease" }

// MailSweepLock keeps the mail sweeper to one process per interval.
func (k Keys) MailSweepLock() string { return k.Lock("sweep:mail") }

// WebhookQueue is the ZSET of webhook deliveries to attempt (their ids),
// scored by due time.
func (k Keys) WebhookQueue() string { return k.prefix + "{delay:webhook}" }

// WebhookLease holds claimed webhook deliveries.
func (k Keys) WebhookLease() string { return k.WebhookQueue() + ":lease" }

// WebhookSweepLock keeps the webhook sweeper to one process per interval.
func (k Keys) WebhookSweepLock() string { return k.Lock("sweep:webhooks") }

// Stock is the admission counter of a product: how many cards may still be
// sold. The product id is the hash tag.
func (k Keys) Stock(productID int64) string {
	return k.prefix + "stock:product:{" + strconv.FormatInt(productID, 10) + "}"
}

// StockRebuildLock is held by the one process rebuilding a missing counter.
func (k Keys) StockRebuildLock(productID int64) string { return k.Stock(productID) + ":rebuild" }

// StockRebuildPending holds what was given back to a missing counter while
// its rebuild was counting the database.
func (k Keys) StockRebuildPending(productID int64) string { return k.Stock(productID) + ":pending" }

// StockOps records the takes and give-backs of a product's counter by
// operation id, so that one sent twice counts once (see takeScript).
func (k Keys) StockOps(productID int64) string { return k.Stock(productID) + ":ops" }

// SweepLock keeps the sweeper to one process per interval.
func (k Keys) SweepLock() string { return k.Lock("sweep") }

// OrderChannel is the pub/sub channel of one order's status changes.
func (k Keys) OrderChannel(orderNo string) string { return k.prefix + "order:{" + orderNo + "}" }

// OrderChannelPattern matches every OrderChannel of this prefix, for the
// one PSUBSCRIBE a process holds for all its subscribers. Glob characters
// in the prefix match only themselves.
func (k Keys) OrderChannelPattern() string {
	return globEscaper.Replace(k.prefix) + "order:{*}"
}

var globEscaper = strings.NewReplacer(`\`, `\\`, "*", `\*`, "?", `\?`, "[", `\[`, "]", `\]`)

// OrderNoOf is the order number of an OrderChannel; false for any other
// channel.
func (k Keys) OrderNoOf(channel string) (string, bool) {
	rest, ok := strings.CutPrefix(channel, k.prefix+"order:{")
	if !ok {
		return "", false
	}
	no, ok := strings.CutSuffix(rest, "}")
	return no, ok && no != ""
}

// Lock is a named lock that one process holds at a time (the
// reconciliation's, say).
func (k Keys) Lock(name string) string { return k.prefix + "lock:" + name }
