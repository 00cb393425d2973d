package queue

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"golang.org/x/sync/singleflight"

	"kami/domain"
)

// StockGate is the Redis admission counter in front of the ledger:
// stock:product:{id} holds how many cards of the product may still be taken.
// A missing counter (new product, FLUSHALL, restart) is rebuilt from the
// database's lockable cards by one process at a time, once, however many
// buyers find it missing together.
type StockGate struct {
	rdb  redis.UniversalClient
	keys Keys
	// pipe carries the takes, with whatever else goes to rdb at the time:
	// buyers who arrive together take in one round trip.
	pipe *sharedPipe
	// count returns the lockable cards of products from the database, in
	// one query.
	count func(ctx context.Context, productIDs ...int64) (map[int64]int, error)
	group singleflight.Group
	// rebuilds counts the database counts this process made.
	rebuilds atomic.Int64
	// dirty holds products whose counter may be wrong because a call
	// failed half-way (Redis down during a give-back or take).
	dirtyMu sync.Mutex
	dirty   map[int64]bool
	// takeKeys holds each product's KEYS of takeScript, made once.
	takeKeysMu sync.RWMutex
	takeKeys   map[int64][]string
	// RebuildWait bounds how long a take waits for another process to
	// rebuild a missing counter before reporting the gate unavailable.
	RebuildWait time.Duration
}

var _ domain.StockGate = (*StockGate)(nil)

// NewStockGate returns the gate over rdb, rebuilding counters from ledger.
func NewStockGate(rdb redis.UniversalClient, keys Keys, ledger *domain.Ledger) *StockGate {
	return newStockGate(rdb, keys, ledger.SellableCounts)
}

func newStockGate(rdb redis.UniversalClient, keys Keys, count func(context.Context, ...int64) (map[int64]int, error)) *StockGate {
	return &StockGate{rdb: rdb, keys: keys, pipe: pipeFor(rdb), count: count, RebuildWait: 5 * time.Second}
}

// Rebuilds is how many times this process counted a product's stock in the
// database to rebuild its counter.
func (g *StockGate) Rebuilds() int64 { return g.rebuilds.Load() }

// Take takes qty from the product's counter if that many are left.
func (g *StockGate) Take(ctx context.Context, productID int64, qty int) (bool, error) {
	if qty <= 0 {
		return false, fmt.Errorf("stock take of %d", qty)
	}
	if g.isDirty(productID) {
		// A take or give-back of this process failed while Redis was away:
		// the counter may be off. Drop it at the first take since, so it is
		// rebuilt from the database now rather than at the next sweep.
		if err := g.dropDirty(ctx, productID); err != nil {
			return false, err
		}
	}
	for attempt := 0; ; attempt++ {
		r, err := g.take(ctx, productID, qty, randomToken())
		if err != nil {
			// The take may have happened with its answer lost.
			g.markDirty(productID)
			return false, err
		}
		if r >= 0 {
			return r == 1, nil
		}
		if attempt == 2 {
			return false, fmt.Errorf("stock counter of product %d is still missing after its rebuild", productID)
		}
		if err := g.ensure(ctx, productID); err != nil {
			return false, err
		}
	}
}

// take runs takeScript through the shared pipeline. A pipeline cannot
// fall back from EVALSHA to EVAL on its own: a Redis that does not know
// the script yet (new, restarted, flushed) did not run it, and it is sent
// again alone, as Script.Run does.
//
// op names the take: the same command, sent again by the client, takes
// once.
func (g *StockGate) take(ctx context.Context, productID int64, qty int, op string) (int, error) {
	keys := g.takeKeysOf(productID)
	args := []any{qty, op, stockOpsKeepMS}
	cmd := send(ctx, g.pipe, func(p redis.Pipeliner) *redis.Cmd { return takeScript.EvalSha(ctx, p, keys, args...) })
	if redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
		cmd = takeScript.Run(ctx, g.rdb, keys, args...)
	}
	return cmd.Int()
}

// stockOpsKeep is how long a take or give-back is remembered by its
// operation id: longer than a client goes on resending one command, and
// longer than a copy of it can wait in a blocked server. The operations
// set of a product holds the operations of this window.
const stockOpsKeep = time.Minute

// stockOpsKeepMS is stockOpsKeep as a take's argument, boxed once.
var stockOpsKeepMS any = stockOpsKeep.Milliseconds()

// takeKeysOf returns the KEYS of a take of productID (which the script
// only reads). Only products that exist are taken from (the shop refuses
// an unknown one before the gate), so the cache is as large as the
// catalogue.
func (g *StockGate) takeKeysOf(productID int64) []string {
	g.takeKeysMu.RLock()
	keys, ok := g.takeKeys[productID]
	g.takeKeysMu.RUnlock()
	if ok {
		return keys
	}
	keys = []string{g.keys.Stock(productID), g.keys.StockOps(productID)}
	g.takeKeysMu.Lock()
	defer g.takeKeysMu.Unlock()
	if g.takeKeys == nil {
		g.takeKeys = map[int64][]string{}
	}
	g.takeKeys[productID] = keys
	return keys
}

// GiveBack returns qty to the product's counter, if the counter exists; a
// missing one is rebuilt from the database, which already counts the cards.
//
// A give-back that fails is sent once more under the same operation id
// before the counter is left to be rebuilt: no take follows a shop's last
// close to drop a dirty counter, so until the next sweep a lost give-back
// leaves its cards refused to buyers. The first copy may have run with
// its answer lost (a connection broken after the send); the operations set
// makes the second a no-op then. One that was never sent (no connection
// to be had: Redis away) is not tried again at once.
func (g *StockGate) GiveBack(ctx context.Context, productID int64, qty int) error {
	if qty <= 0 {
		return nil
	}
	op := randomToken()
	err := g.giveBack(ctx, productID, qty, op)
	if err != nil && ctx.Err() == nil && !unsent(err) {
		err = g.giveBack(ctx, productID, qty, op)
	}
	if err != nil {
		g.markDirty(productID)
	}
	return err
}

// unsent reports whether err says the command never left this process: no
// connection could be had (the dial failed, the pool had none to give).
// Sending it again at once would only wait as long again, on the close
// path, while Redis is away.
func unsent(err error) bool {
	var op *net.OpError
	return errors.Is(err, redis.ErrPoolTimeout) || errors.Is(err, redis.ErrClosed) || (errors.As(err, &op) && op.Op == "dial")
}

// giveBack runs giveBackScript as the operation op: the same command, sent
// again by the client, gives back once.
func (g *StockGate) giveBack(ctx context.Context, productID int64, qty int, op string) error {
	return giveBackScript.Run(ctx, g.rdb, []string{g.keys.Stock(productID), g.keys.StockRebuildLock(productID),
		g.keys.StockRebuildPending(productID), g.keys.StockOps(productID)},
		qty, op, stockOpsKeep.Milliseconds()).Err()
}

func (g *StockGate) markDirty(productID int64) {
	g.dirtyMu.Lock()
	defer g.dirtyMu.Unlock()
	if g.dirty == nil {
		g.dirty = map[int64]bool{}
	}
	g.dirty[productID] = true
}

func (g *StockGate) isDirty(productID int64) bool {
	g.dirtyMu.Lock()
	defer g.dirtyMu.Unlock()
	return g.dirty[productID]
}

// dropDirty deletes a counter this process may have left wrong; the next
// take rebuilds it from the database.
//
// The mark is cleared before the DEL, not after: a call that fails while
// the DEL is under way (its counter rebuilt meanwhile by another take,
// from a count that may miss it) marks the product again, and that mark
// must outlive this drop.
func (g *StockGate) dropDirty(ctx context.Context, productID int64) error {
	g.dirtyMu.Lock()
	delete(g.dirty, productID)
	g.dirtyMu.Unlock()
	if err := g.rdb.Del(ctx, g.keys.Stock(productID)).Err(); err != nil {
		g.markDirty(productID)
		return err
	}
	return nil
}

// ResetDirty drops the counters this process may have left wrong (a take or
// give-back that failed while Redis was away), so they are rebuilt from the
// database once, like lost ones. It reports how many it dropped.
func (g *StockGate) ResetDirty(ctx context.Context) (int, error) {
	g.dirtyMu.Lock()
	ids := make([]int64, 0, len(g.dirty))
	for id := range g.dirty {
		ids = append(ids, id)
	}
	g.dirtyMu.Unlock()
	for i, id := range ids {
		if err := g.dropDirty(ctx, id); err != nil {
			return i, err
		}
	}
	return len(ids), nil
}

// Counter reads a product's counter; ok is false when it is missing.
func (g *StockGate) Counter(ctx context.Context, productID int64) (n int, ok bool, err error) {
	v, err := g.rdb.Get(ctx, g.keys.Stock(productID)).Int()
	if errors.Is(err, redis.Nil) {
		return 0, false, nil
	}
	return v, err == nil, err
}

// Repair rebuilds the product's counter from the database, for the
// reconciliation, through the same rebuild as a missing counter: takes and
// give-backs that happen meanwhile are not lost (see rebuildStartScript).
// It returns the counter's new value.
func (g *StockGate) Repair(ctx context.Context, productID int64) (int, error) {
	return g.rebuild(ctx, productID, true)
}

// Check compares the counters of ids with the database and rebuilds each
// one that is missing or disagrees with it, in either direction: the
// sweeper's pass. A counter goes wrong for good when a process dies
// between a database commit and its counter call (a close and its
// give-back, a take and its order), when Redis loses a write in a
// failover, or when a late delivery takes from a counter rebuilt just
// before; the card lock keeps every sale right meanwhile, but a low
// counter refuses buyers while cards are free.
//
// An order in flight while Check compares (taken, not yet in the
// database) also looks like a disagreement; rebuilding such a counter is
// harmless, since the rebuild loses no take or give-back. What a rebuild
// cannot see is an operation in flight across its own count: an order
// taken before it and committed after it, or a close committed before it
// and given back after it, leaves the counter too high by that quantity,
// which the next sweep finds. Too high is the safe side: the database
// refuses the sale the counter admits.
//
// It reports how many missing counters it rebuilt and how many wrong ones
// it repaired, and the errors of the products it could not check, joined:
// a failed product does not keep the others from being checked.
func (g *StockGate) Check(ctx context.Context, ids []int64) (rebuilt, repaired int, err error) {
	if len(ids) == 0 {
		return 0, 0, nil
	}
	pipe := g.rdb.Pipeline()
	gets := make([]*redis.StringCmd, len(ids))
	for i, id := range ids {
		gets[i] = pipe.Get(ctx, g.keys.Stock(id))
	}
	// Each GET is judged by its own error below: in a cluster one shard
	// failing (its master dying) fails only the products it holds.
	pipe.Exec(ctx)
	counts, err := g.count(ctx, ids...)
	if err != nil {
		return 0, 0, fmt.Errorf("count stock: %w", err)
	}
	// One product's failure (another process holding its rebuild lock
	// longer than RebuildWait, a count that failed) does not stop the
	// others: their wrong counters would wait a whole sweep for it.
	var errs []error
	for i, id := range ids {
		v, err := gets[i].Int()
		switch {
		case errors.Is(err, redis.Nil):
			if err := g.ensure(ctx, id); err != nil {
				errs = append(errs, err)
				continue
			}
			rebuilt++
		case err != nil:
			errs = append(errs, fmt.Errorf("stock counter of product %d: %w", id, err))
		case v != counts[id]:
			if _, err := g.Repair(ctx, id); err != nil {
				errs = append(errs, err)
				continue
			}
			repaired++
		}
	}
	return rebuilt, repaired, errors.Join(errs...)
}

// ensure sees to it that the product's counter exists. In this process one
// caller per product does the work (singleflight); across processes one
// holds the rebuild lock and counts, the others wait for the counter to
// appear. A counter that appeared meanwhile is never overwritten.
func (g *StockGate) ensure(ctx context.Context, productID int64) error {
	_, err, _ := g.group.Do(strconv.FormatInt(productID, 10), func() (any, error) {
		_, err := g.rebuild(context.WithoutCancel(ctx), productID, false)
		return nil, err
	})
	return err
}

// rebuild sets the product's counter from the database, in one process at
// a time (the rebuild lock). Without repair it rebuilds only a missing
// counter; with repair an existing one too. While it counts, the counter is
// missing: takes wait for it, and give-backs are kept aside and added to
// the count, so none made meanwhile is lost whichever side of the count
// its database commit fell. When another process holds the lock, rebuild
// waits for that one's counter instead. It returns the counter's value.
func (g *StockGate) rebuild(ctx context.Context, productID int64, repair bool) (int, error) {
	key, lock, pending := g.keys.Stock(productID), g.keys.StockRebuildLock(productID), g.keys.StockRebuildPending(productID)
	keys := []string{key, lock, pending}
	token := randomToken()
	deadline := time.Now().Add(g.RebuildWait)
	for {
		started, err := rebuildStartScript.Run(ctx, g.rdb, keys, token, rebuildLockTTL.Milliseconds(), boolArg(repair)).Int()
		if err != nil {
			return 0, err
		}
		switch started {
		case 2: // the counter exists
			n, _, err := g.Counter(ctx, productID)
			return n, err
		case 1:
			defer unlockScript.Run(ctx, g.rdb, []string{lock}, token)
			cnt, err := g.count(ctx, productID)
			if err != nil {
				return 0, fmt.Errorf("count stock of product %d: %w", productID, err)
			}
			g.rebuilds.Add(1)
			n, err := rebuildSetScript.Run(ctx, g.rdb, []string{key, pending, lock}, cnt[productID], token).Int()
			if err == nil && n == -2 {
				err = fmt.Errorf("stock counter of product %d: the rebuild lock expired while counting; the next take rebuilds it", productID)
			}
			return n, err
		}
		// Another process is rebuilding it from the database now: that
		// rebuild is as good as ours.
		repair = false
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("stock counter of product %d: another process holds its rebuild for over %s", productID, g.RebuildWait)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// rebuildLockTTL bounds how long a rebuild that died holds the others up.
const rebuildLockTTL = 10 * time.Second

func boolArg(b bool) int {
	if b {
		return 1
	}
	return 0
}

func randomToken() string {
	var b [12]byte
	var h [24]byte
	rand.Read(b[:])
	hex.Encode(h[:], b[:])
	return string(h[:])
}
