package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"net/url"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"kami/domain"
)

// isLoopbackHost accepts localhost and loopback addresses only: the tool
// must never load a machine other than this one.
func isLoopbackHost(host string) bool {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.Trim(host, "[]")
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// checkLoopbackURL refuses a URL whose host is not loopback. SQLite URLs
// (no host) pass. what names the flag in the message.
func checkLoopbackURL(what, raw string) error {
	if raw == "" || strings.HasPrefix(raw, "sqlite:") || strings.HasPrefix(raw, "file:") {
		return nil
	}
	u, err := url.Parse(raw)
	if err != nil {
		return fmt.Errorf("%s: not a URL", what)
	}
	if u.Host == "" {
		return fmt.Errorf("%s: names no host", what)
	}
	if !isLoopbackHost(u.Host) {
		return fmt.Errorf("%s: %s is not a loopback address; the bench only talks to this machine", what, u.Hostname())
	}
	return nil
}

// checkLoopbackRedis checks KAMI_REDIS_URL's forms: a URL, or host:port
// addresses separated by commas (a cluster).
func checkLoopbackRedis(raw string) error {
	if strings.Contains(raw, "://") {
		return checkLoopbackURL("-redis", raw)
	}
	for _, addr := range strings.Split(raw, ",") {
		if !isLoopbackHost(strings.TrimSpace(addr)) {
			return fmt.Errorf("-redis: %s is not a loopback address; the bench only talks to this machine", addr)
		}
	}
	return nil
}

// describeDB names a database URL without its password.
func describeDB(raw string) string {
	u, err := url.Parse(raw)
	if err != nil || u.Scheme == "" || u.Host == "" {
		return raw
	}
	if u.User != nil && u.User.Username() != "" {
		u.User = url.User(u.User.Username())
	} else {
		u.User = nil
	}
	u.RawQuery = ""
	return u.String()
}

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

// freshPostgres creates a new database on the server adminURL names and
// returns its URL and a function that drops it.
func freshPostgres(ctx context.Context, adminURL string) (dbURL, name string, drop func() error, err error) {
	u, err := url.Parse(adminURL)
	if err != nil {
		return "", "", nil, fmt.Errorf("-pg: %v", err)
	}
	admin, err := domain.OpenDB(ctx, adminURL, "", domain.DBOptions{MaxOpenConns: 2})
	if err != nil {
		return "", "", nil, fmt.Errorf("-pg: %w", err)
	}
	name = fmt.Sprintf("kami_bench_%s_%s", time.Now().UTC().Format("20060102_150405"), randomHex(3))
	if _, err := admin.ExecContext(ctx, "CREATE DATABASE "+name); err != nil {
		admin.Close()
		return "", "", nil, fmt.Errorf("creating database %s: %w", name, err)
	}
	u.Path = "/" + name
	q := u.Query()
	if q.Get("sslmode") == "" {
		q.Set("sslmode", "disable")
	}
	u.RawQuery = q.Encode()
	drop = func() error {
		defer admin.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := admin.ExecContext(ctx, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)"); err != nil {
			// Before PostgreSQL 13 there is no FORCE.
			if _, err2 := admin.ExecContext(ctx, "DROP DATABASE IF EXISTS "+name); err2 != nil {
				return fmt.Errorf("dropping database %s: %w", name, err)
			}
		}
		return nil
	}
	return u.String(), name, drop, nil
}

// redisClient opens the Redis of -redis: a URL, or cluster nodes
// separated by commas.
func redisClient(redisURL string) (redis.UniversalClient, error) {
	if strings.Contains(redisURL, "://") {
		opt, err := redis.ParseURL(redisURL)
		if err != nil {
			return nil, err
		}
		return redis.NewClient(opt), nil
	}
	return redis.NewUniversalClient(&redis.UniversalOptions{Addrs: strings.Split(redisURL, ",")}), nil
}

// dropRedisPrefix deletes the keys this run's server made under prefix.
func dropRedisPrefix(redisURL, prefix string) error {
	rdb, err := redisClient(redisURL)
	if err != nil {
		return err
	}
	defer rdb.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	del := func(ctx context.Context, c *redis.Client) error {
		iter := c.Scan(ctx, 0, prefix+"*", 1000).Iterator()
		for iter.Next(ctx) {
			if err := c.Del(ctx, iter.Val()).Err(); err != nil {
				return err
			}
		}
		return iter.Err()
	}
	if cc, ok := rdb.(*redis.ClusterClient); ok {
		return cc.ForEachMaster(ctx, del)
	}
	return del(ctx, rdb.(*redis.Client))
}

// dbNameOf is the database a server URL names ("" for SQLite).
func dbNameOf(raw string) string {
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" {
		return ""
	}
	return strings.TrimPrefix(u.Path, "/")
}
