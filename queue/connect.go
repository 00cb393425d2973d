package queue

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
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
// The returned func closes the client (and the in-process server).
// An unreachable Redis is an error that names the address, never a password.
func Connect(ctx context.Context, rawURL string) (redis.UniversalClient, func() error, error) {
	rawURL = strings.TrimSpace(rawURL)
	var (
		rdb  redis.UniversalClient
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
		stop = func() error { m.Close(); return nil }
	case strings.HasPrefix(rawURL, "redis://") || strings.HasPrefix(rawURL, "rediss://") || strings.HasPrefix(rawURL, "unix://"):
		opts, err := redis.ParseURL(rawURL)
		if err != nil {
			return nil, nil, fmt.Errorf("KAMI_REDIS_URL: not a Redis URL: %v", redactURL(rawURL, err))
		}
		addr = opts.Addr
		rdb = redis.NewClient(withTimeouts(opts))
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
		u := &redis.UniversalOptions{Addrs: addrs, DialTimeout: 2 * time.Second,
			ReadTimeout: 2 * time.Second, WriteTimeout: 2 * time.Second, MaxRetries: noRetries}
		if len(addrs) > 1 {
			u.IsClusterMode = true
		}
		rdb = redis.NewUniversalClient(u)
	}
	closeAll := func() error { return errors.Join(rdb.Close(), stop()) }
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := rdb.Ping(pctx).Err(); err != nil {
		closeAll()
		return nil, nil, fmt.Errorf("KAMI_REDIS_URL: cannot reach Redis at %s: %w", addr, err)
	}
	return rdb, closeAll, nil
}

// withTimeouts keeps a Redis outage from stalling callers for long: the
// stock gate must refuse quickly, the workers back off and retry. It also
// turns off go-redis's retries (see noRetries).
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
