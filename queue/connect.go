package queue

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// Connect opens the Redis named by rawURL (KAMI_REDIS_URL) and pings it:
//   - "": an in-process Redis (miniredis) on 127.0.0.1, so kami runs with
//     nothing installed; its data lives as long as the process;
//   - redis://… or rediss://…: one server (go-redis ParseURL options);
//   - "host:port,host:port,…": a Redis Cluster; one "host:port": one server.
//
// A single server that turns out to be a node of a Redis Cluster (INFO
// cluster says cluster_enabled:1) is used as a cluster: its node is the seed
// from which the client learns the others. Used as one server, it would
// answer MOVED to every key of the slots it does not hold.
//
// The returned func closes the client (and the in-process server).
// An unreachable Redis is an error that names the address, never a password.
func Connect(ctx context.Context, rawURL string) (redis.UniversalClient, func() error, error) {
	rawURL = strings.TrimSpace(rawURL)
	var (
		rdb  redis.UniversalClient
		one  *redis.Options // the options of a single server, when rdb is one
		addr string
		stop = func() error { return nil }
	)
	switch {
	case rawURL == "":
		m := miniredis.NewMiniRedis()
		if err := m.StartAddr("127.0.0.1:0"); err != nil {
			return nil, nil, fmt.Errorf("KAMI_REDIS_URL: cannot start the in-process Redis: %w", err)
		}
		addr = m.Addr()
		// No read or write deadlines: the in-process Redis cannot be cut
		// off from the process, so a deadline could only turn a busy
		// machine (a slow scheduler, not a lost server) into errors.
		rdb = redis.NewClient(withTimeouts(&redis.Options{Addr: addr, ReadTimeout: -1, WriteTimeout: -1}))
		stopExpiring := expireAsTimePasses(m, time.Second)
		stop = func() error { stopExpiring(); m.Close(); return nil }
	case strings.HasPrefix(rawURL, "redis://") || strings.HasPrefix(rawURL, "rediss://") || strings.HasPrefix(rawURL, "unix://"):
		opts, err := redis.ParseURL(rawURL)
		if err != nil {
			return nil, nil, fmt.Errorf("KAMI_REDIS_URL: not a Redis URL: %v", redactURL(rawURL, err))
		}
		addr, one = opts.Addr, withTimeouts(opts)
	case strings.Contains(rawURL, "://"):
		return nil, nil, fmt.Errorf("KAMI_REDIS_URL: unknown scheme %q (use redis://, rediss:// or host:port,host:port for a cluster)", rawURL[:strings.Index(rawURL, "://")])
	default:
		var addrs []string
		for _, a := range strings.Split(rawURL, ",") {
			if a = strings.TrimSpace(a); a != "" {
				addrs = append(addrs, a)
			}
		}
		addr = strings.Join(addrs, ",")
		if len(addrs) == 1 {
			one = withTimeouts(&redis.Options{Addr: addrs[0]})
		} else {
			rdb = newClusterClient(&redis.ClusterOptions{Addrs: addrs})
		}
	}
	if one != nil {
		// Asked on database 0: a cluster node refuses a SELECT of any other.
		probe := *one
		probe.DB = 0
		isNode, err := clusterNode(ctx, &probe)
		switch {
		case err != nil:
			return nil, nil, fmt.Errorf("KAMI_REDIS_URL: cannot reach Redis at %s: %w", addr, err)
		case isNode && one.DB != 0:
			return nil, nil, fmt.Errorf("KAMI_REDIS_URL: %s is a Redis Cluster node, and a cluster has only database 0 (the URL names %d)", addr, one.DB)
		case isNode:
			rdb = newClusterClient(clusterOptions(one))
		default:
			rdb = redis.NewClient(one)
		}
	}
	closeAll := func() error {
		if c, ok := rdb.(*redis.ClusterClient); ok {
			clusterFailures.Delete(c)
		}
		return errors.Join(rdb.Close(), stop())
	}
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := rdb.Ping(pctx).Err(); err != nil {
		closeAll()
		return nil, nil, fmt.Errorf("KAMI_REDIS_URL: cannot reach Redis at %s: %w", addr, err)
	}
	return rdb, closeAll, nil
}

// expireAsTimePasses tells the in-process Redis every interval how much
// time passed, so that it expires keys as Redis does: miniredis, made for
// tests, expires them only when told (FastForward). Left alone it would
// keep every key with a TTL for the life of the process once nothing
// touched it again (a product's operations set after its last sale, a
// lock, a kept-aside give-back). The returned func stops it.
func expireAsTimePasses(m *miniredis.Miniredis, interval time.Duration) (stop func()) {
	done, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		ticker := time.NewTicker(interval)
		defer ticker.Stop()
		last := time.Now()
		for {
			select {
			case <-done:
				return
			case now := <-ticker.C:
				m.FastForward(now.Sub(last))
				last = now
			}
		}
	}()
	return func() { close(done); <-stopped }
}

// clusterNode reports whether the server of o is a Redis Cluster
// node (INFO cluster: cluster_enabled:1). A server that does not know
// INFO cluster (an old or a partial implementation) answers with an error
// or without the line, which means no.
func clusterNode(ctx context.Context, o *redis.Options) (bool, error) {
	c := redis.NewClient(o)
	defer c.Close()
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := c.Ping(ctx).Err(); err != nil {
		return false, err
	}
	info, err := c.Info(ctx, "cluster").Result()
	if err != nil {
		var rerr redis.Error
		if errors.As(err, &rerr) {
			return false, nil
		}
		return false, err
	}
	return strings.Contains(info, "cluster_enabled:1"), nil
}

// clusterOptions are the options of a cluster client seeded by the single
// server of o, with o's credentials, TLS and timeouts.
func clusterOptions(o *redis.Options) *redis.ClusterOptions {
	return &redis.ClusterOptions{Addrs: []string{o.Addr}, Username: o.Username, Password: o.Password,
		TLSConfig: o.TLSConfig, DialTimeout: o.DialTimeout, ReadTimeout: o.ReadTimeout,
		WriteTimeout: o.WriteTimeout, MaxRetries: o.MaxRetries, DialerRetries: o.DialerRetries, PoolSize: o.PoolSize}
}

// clusterReloadEvery is how often the cluster client reloads the cluster's
// layout (which master holds which slots) while it is used. go-redis's
// default, a minute, kept kami refusing orders for most of a minute after
// a failover had finished: a dead master answers no MOVED that would make
// the client look again.
var clusterReloadEvery = time.Second

// newClusterClient is the cluster client kami uses: kami's timeouts and no
// retries of its own, the layout reloaded every clusterReloadEvery and at
// once when a command fails in a way that says the layout may have changed
// (see layoutMayHaveChanged).
func newClusterClient(o *redis.ClusterOptions) *redis.ClusterClient {
	t := withTimeouts(&redis.Options{DialTimeout: o.DialTimeout, ReadTimeout: o.ReadTimeout,
		WriteTimeout: o.WriteTimeout, MaxRetries: o.MaxRetries, DialerRetries: o.DialerRetries})
	o.DialTimeout, o.ReadTimeout, o.WriteTimeout, o.MaxRetries = t.DialTimeout, t.ReadTimeout, t.WriteTimeout, t.MaxRetries
	o.DialerRetries = t.DialerRetries
	o.ClusterStateReloadInterval = clusterReloadEvery
	c := redis.NewClusterClient(o)
	n := new(atomic.Int64)
	clusterFailures.Store(c, n)
	c.AddHook(reloadOnFailure{c, n})
	return c
}

// clusterFailures counts, for each cluster client newClusterClient made,
// the commands and pipelines that failed as a failover makes them fail.
var clusterFailures sync.Map // *redis.ClusterClient → *atomic.Int64

// failuresOf is how many commands of rdb failed as a failover makes them
// fail (see layoutMayHaveChanged); 0 for a client that is not a cluster
// client of newClusterClient.
func failuresOf(rdb redis.UniversalClient) int64 {
	c, ok := rdb.(*redis.ClusterClient)
	if !ok {
		return 0
	}
	if n, ok := clusterFailures.Load(c); ok {
		return n.(*atomic.Int64).Load()
	}
	return 0
}

// reloadOnFailure asks the cluster client to reload the layout after a
// command or pipeline that failed as a failover makes commands fail. The
// reload runs in the background, at most once per 200 ms (go-redis's
// LazyReload), so a burst of failures costs one CLUSTER SLOTS.
type reloadOnFailure struct {
	c        *redis.ClusterClient
	failures *atomic.Int64
}

func (h reloadOnFailure) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h reloadOnFailure) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if layoutMayHaveChanged(ctx, err) {
			h.failures.Add(1)
			h.c.ReloadState(ctx)
		}
		return err
	}
}

func (h reloadOnFailure) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		for _, cmd := range cmds {
			if layoutMayHaveChanged(ctx, cmd.Err()) {
				h.failures.Add(1)
				h.c.ReloadState(ctx)
				break
			}
		}
		return err
	}
}

// layoutMayHaveChanged: a connection that failed (refused, reset, timed
// out: a master that died), or a node saying the cluster is down or the
// slot is moving, may mean another node holds the slot now. An answer of
// Redis to the command itself (a script's error, a missing key) does not;
// nor does the caller giving up (its ctx ended).
//
// A dial that timed out (a master gone without a trace, its packets
// dropped) is a connection that failed, though its error matches
// context.DeadlineExceeded as the caller's own deadline does.
func layoutMayHaveChanged(ctx context.Context, err error) bool {
	if err == nil || errors.Is(err, redis.Nil) {
		return false
	}
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "dial" && op.Timeout() {
		return ctx.Err() == nil
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var rerr redis.Error
	if errors.As(err, &rerr) {
		for _, p := range []string{"CLUSTERDOWN", "TRYAGAIN", "MASTERDOWN", "READONLY", "LOADING"} {
			if redis.HasErrorPrefix(err, p) {
				return true
			}
		}
		return false
	}
	return true
}

// withTimeouts keeps a Redis outage from stalling callers for long: the
// stock gate must refuse quickly, the workers back off and retry. It also
// turns off go-redis's retries (see noRetries), and its dial retries: by
// default a connection that cannot be made is tried five times, 100 ms
// apart, so a Redis whose packets are dropped held a buyer for five dial
// timeouts (about ten seconds) before the order could be refused. One
// dial fails within one DialTimeout; the next call dials again. Once
// PoolSize dials of a pool have failed (counted since its last background
// probe succeeded: a dial that succeeds in between does not reset the
// count), the pool answers every call that needs a new connection at once
// with the last dial error, while idle connections still serve, and
// probes in the background: one dial (up to DialTimeout), then a second's
// pause, until Redis answers. The pipeline pool has its own count, of
// PipelinePoolSize (10), and so has each node of a cluster.
func withTimeouts(o *redis.Options) *redis.Options {
	if o.DialTimeout == 0 {
		o.DialTimeout = 2 * time.Second
	}
	if o.ReadTimeout == 0 {
		o.ReadTimeout = 2 * time.Second
	}
	if o.WriteTimeout == 0 {
		o.WriteTimeout = 2 * time.Second
	}
	if o.MaxRetries == 0 {
		o.MaxRetries = noRetries
	}
	if o.DialerRetries == 0 {
		o.DialerRetries = 1 // one attempt
	}
	return o
}

// noRetries turns go-redis's own retries off: every caller handles a
// failed call instead (the gate marks the counter for a rebuild, workers
// back off and try again, claims come back after their lease). A Redis
// Cluster client still sends a command again after a timeout or a
// redirect; the stock scripts count each operation once (see takeScript),
// so such a copy is harmless.
const noRetries = -1

// redactURL describes a URL parse failure without the URL's password.
func redactURL(raw string, err error) string {
	if u, perr := url.Parse(raw); perr == nil && u.User != nil {
		if _, has := u.User.Password(); has {
			return strings.ReplaceAll(err.Error(), u.User.String(), u.User.Username()+":xxxxx")
		}
	}
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err.Error()
	}
	return err.Error()
}
