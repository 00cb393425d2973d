package queue

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"
)

// Eviction is a Redis server that drops keys when it is full: it has a
// maxmemory and a maxmemory-policy other than noeviction.
//
// kami keeps nothing in Redis that the database cannot rebuild, but an
// evicted key still costs something until it is rebuilt: a close queue or
// a stock counter dropped (allkeys-* policies) means closes wait for the
// sweeper and orders wait for a rebuild; a lock dropped (any policy: locks
// expire) lets a second process in; a stock operations set dropped (any
// policy: they expire) lets a take a cluster client resent count twice,
// leaving the counter low until the reconciliation repairs it.
type Eviction struct {
	Addr      string // host:port of the server (a cluster's master)
	Policy    string // maxmemory-policy
	MaxMemory int64  // bytes
}

// Evictions reads maxmemory and maxmemory-policy from the server behind
// rdb, or from every master of a cluster, and returns those that evict,
// by address. An error means a server did not answer CONFIG GET (a
// managed Redis may refuse it); what the others answered is returned
// with it.
func Evictions(ctx context.Context, rdb redis.UniversalClient) ([]Eviction, error) {
	var (
		mu  sync.Mutex
		out []Eviction
	)
	check := func(ctx context.Context, c *redis.Client) error {
		e, evicts, err := evictionOf(ctx, c)
		if err != nil || !evicts {
			return err
		}
		mu.Lock()
		out = append(out, e)
		mu.Unlock()
		return nil
	}
	var err error
	switch c := rdb.(type) {
	case *redis.ClusterClient:
		err = c.ForEachMaster(ctx, check)
	case *redis.Client:
		err = check(ctx, c)
	default:
		err = fmt.Errorf("a %T: cannot read its servers' settings", rdb)
	}
	slices.SortFunc(out, func(a, b Eviction) int { return strings.Compare(a.Addr, b.Addr) })
	return out, err
}

// evictionOf reads one server's settings; evicts reports whether it drops
// keys when full.
func evictionOf(ctx context.Context, c *redis.Client) (e Eviction, evicts bool, err error) {
	e.Addr = c.Options().Addr
	conf, err := c.ConfigGet(ctx, "maxmemory*").Result()
	if err != nil {
		return e, false, fmt.Errorf("CONFIG GET maxmemory* on %s: %w", e.Addr, err)
	}
	e.Policy = conf["maxmemory-policy"]
	if e.MaxMemory, err = strconv.ParseInt(conf["maxmemory"], 10, 64); err != nil || e.Policy == "" {
		return e, false, fmt.Errorf("CONFIG GET maxmemory* on %s: no maxmemory and maxmemory-policy in %v", e.Addr, conf)
	}
	return e, e.MaxMemory > 0 && e.Policy != "noeviction", nil
}
