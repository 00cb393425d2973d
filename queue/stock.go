package queue

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
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
	// count returns the lockable cards of a product from the database.
	count func(ctx context.Context, productID int64) (int, error)
	group singleflight.Group
	// rebuilds counts the database counts this process made.
	rebuilds atomic.Int64
	// dirty holds products whose counter may be wrong because a call
	// failed half-way (Redis down during a give-back or take).
	dirtyMu sync.Mutex
	dirty   map[int64]bool
	// RebuildWait bounds how long a take waits for another process to
	// rebuild a missing counter before reporting the gate unavailable.
	RebuildWait time.Duration
}

var _ domain.StockGate = (*StockGate)(nil)

// NewStockGate returns the gate over rdb, rebuilding counters from ledger.
func NewStockGate(rdb redis.UniversalClient, keys Keys, ledger *domain.Ledger) *StockGate {
	return newStockGate(rdb, keys, func(ctx context.Context, id int64) (int, error) {
		cs, err := ledger.StockCounts(ctx, id)
		if err != nil {
			return 0, err
		}
		return cs[id].Lockable, nil
	})
}

func newStockGate(rdb redis.UniversalClient, keys Keys, count func(context.Context, int64) (int, error)) *StockGate {
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
	key := g.keys.Stock(productID)
	if g.isDirty(productID) {
		// A take or give-back of this process failed while Redis was away:
		// the counter may be off. Drop it at the first take since, so it is
		// rebuilt from the database now rather than at the next sweep.
		if err := g.dropDirty(ctx, productID); err != nil {
			return false, err
		}
	}
	for attempt := 0; ; attempt++ {
		r, err := g.take(ctx, key, qty)
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
func (g *StockGate) take(ctx context.Context, key string, qty int) (int, error) {
	keys := []string{key}
	cmd := send(ctx, g.pipe, func(p redis.Pipeliner) *redis.Cmd { return takeScript.EvalSha(ctx, p, keys, qty) })
	if redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
		cmd = takeScript.Run(ctx, g.rdb, keys, qty)
	}
	return cmd.Int()
}

// GiveBack returns qty to the product's counter, if the counter exists; a
// missing one is rebuilt from the database, which already counts the cards.
func (g *StockGate) GiveBack(ctx context.Context, productID int64, qty int) error {
	if qty <= 0 {
		return nil
	}
	err := giveBackScript.Run(ctx, g.rdb, []string{g.keys.Stock(productID), g.keys.StockRebuildLock(productID),
		g.keys.StockRebuildPending(productID)}, qty).Err()
	if err != nil {
		g.markDirty(productID)
	}
	return err
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
func (g *StockGate) dropDirty(ctx context.Context, productID int64) error {
	if err := g.rdb.Del(ctx, g.keys.Stock(productID)).Err(); err != nil {
		return err
	}
	g.dirtyMu.Lock()
	delete(g.dirty, productID)
	g.dirtyMu.Unlock()
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

// Repair sets the product's counter from the database, for the
// reconciliation. An order in flight while it runs can leave the counter off
// by its quantity until the next repair; the card lock in the ledger is the
// real gate either way.
func (g *StockGate) Repair(ctx context.Context, productID int64) (int, error) {
	n, err := g.count(ctx, productID)
	if err != nil {
		return 0, err
	}
	g.rebuilds.Add(1)
	return n, g.rdb.Set(ctx, g.keys.Stock(productID), n, 0).Err()
}

// EnsureMissing rebuilds the counters of ids that are missing and reports
// how many it rebuilt (the sweeper's pass after a Redis loss).
func (g *StockGate) EnsureMissing(ctx context.Context, ids []int64) (int, error) {
	if len(ids) == 0 {
		return 0, nil
	}
	pipe := g.rdb.Pipeline()
	exists := make([]*redis.IntCmd, len(ids))
	for i, id := range ids {
		exists[i] = pipe.Exists(ctx, g.keys.Stock(id))
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return 0, err
	}
	n := 0
	for i, id := range ids {
		if exists[i].Val() == 0 {
			if err := g.ensure(ctx, id); err != nil {
				return n, err
			}
			n++
		}
	}
	return n, nil
}

// ensure sees to it that the product's counter exists. In this process one
// caller per product does the work (singleflight); across processes one
// holds the rebuild lock and counts, the others wait for the counter to
// appear. The counter is written with SET NX, so a counter that appeared
// meanwhile is never overwritten.
func (g *StockGate) ensure(ctx context.Context, productID int64) error {
	_, err, _ := g.group.Do(strconv.FormatInt(productID, 10), func() (any, error) {
		return nil, g.rebuild(context.WithoutCancel(ctx), productID)
	})
	return err
}

func (g *StockGate) rebuild(ctx context.Context, productID int64) error {
	key, lock := g.keys.Stock(productID), g.keys.StockRebuildLock(productID)
	token := randomToken()
	deadline := time.Now().Add(g.RebuildWait)
	for {
		n, err := g.rdb.Exists(ctx, key).Result()
		if err != nil {
			return err
		}
		if n == 1 {
			return nil
		}
		got, err := g.rdb.SetNX(ctx, lock, token, 10*time.Second).Result()
		if err != nil {
			return err
		}
		if got {
			defer unlockScript.Run(ctx, g.rdb, []string{lock}, token)
			// Another process may have finished the rebuild between our
			// look and our lock.
			if n, err := g.rdb.Exists(ctx, key).Result(); err != nil || n == 1 {
				return err
			}
			// Give-backs kept aside before our count are in it; only those
			// from now on are added to it.
			pending := g.keys.StockRebuildPending(productID)
			if err := g.rdb.Del(ctx, pending).Err(); err != nil {
				return err
			}
			cnt, err := g.count(ctx, productID)
			if err != nil {
				return fmt.Errorf("count stock of product %d: %w", productID, err)
			}
			g.rebuilds.Add(1)
			return rebuildSetScript.Run(ctx, g.rdb, []string{key, pending}, cnt).Err()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("stock counter of product %d: another process holds its rebuild for over %s", productID, g.RebuildWait)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func randomToken() string {
	b := make([]byte, 12)
	rand.Read(b)
	return hex.EncodeToString(b)
}
