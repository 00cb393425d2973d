// Package redistest gives tests a Redis of each kind kami runs on: an
// in-process miniredis always, and the real Redis at KAMI_TEST_REDIS_URL
// (default redis://127.0.0.1:6379/0; "off" leaves it out). A real Redis
// that does not answer is skipped with a note, unless
// KAMI_TEST_REQUIRE_SERVICES=1 (as in CI), which makes it a failure, as in
// domain/dbtest.
//
// The real Redis is shared with other tests and other packages: every test
// works under its own key prefix (Prefix) and never flushes the server.
package redistest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// Kind names a Redis kind.
type Kind string

const (
	Mini Kind = "miniredis"
	Real Kind = "redis"
	// RealCluster is a Redis Cluster of the test's own (StartCluster).
	RealCluster Kind = "cluster"
)

// URL is the real Redis to test against.
func URL() string {
	if v := os.Getenv("KAMI_TEST_REDIS_URL"); v != "" {
		return v
	}
	return "redis://127.0.0.1:6379/0"
}

// Server is one Redis a test runs against.
type Server struct {
	Kind Kind
	// URL is a redis:// URL other processes can connect with.
	URL string
	// Mini is the in-process server (nil for the real one).
	Mini *miniredis.Miniredis
	// Cluster is the test's own cluster (nil for the other kinds); its URL
	// is the node list kami takes for a cluster.
	Cluster *Cluster
	Client  redis.UniversalClient
}

// Each runs fn once per Redis kind as a parallel subtest.
func Each(t *testing.T, fn func(t *testing.T, s *Server)) {
	t.Helper()
	for _, k := range []Kind{Mini, Real} {
		t.Run(string(k), func(t *testing.T) {
			t.Parallel()
			fn(t, Open(t, k))
		})
	}
}

// Open returns a Redis of kind k for the test, skipping (or failing) when
// the real one is off or unreachable.
func Open(t testing.TB, k Kind) *Server {
	t.Helper()
	switch k {
	case Mini:
		m := miniredis.NewMiniRedis()
		if err := m.StartAddr("127.0.0.1:0"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(m.Close)
		s := &Server{Kind: Mini, URL: patient("redis://" + m.Addr() + "/0"), Mini: m}
		s.Client = s.NewClient(t)
		return s
	case Real:
		s := &Server{Kind: Real, URL: patient(real(t))}
		s.Client = s.NewClient(t)
		return s
	case RealCluster:
		return StartCluster(t).Server(t)
	}
	t.Fatalf("unknown Redis kind %q", k)
	return nil
}

var (
	realOnce sync.Once
	realDown string
)

func real(t testing.TB) string {
	t.Helper()
	u := URL()
	if u == "off" {
		t.Skip("real Redis tests are off (KAMI_TEST_REDIS_URL=off)")
	}
	realOnce.Do(func() {
		opts, err := redis.ParseURL(u)
		if err != nil {
			realDown = err.Error()
			return
		}
		c := redis.NewClient(opts)
		defer c.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		if err := c.Ping(ctx).Err(); err != nil {
			realDown = err.Error()
		}
	})
	if realDown != "" {
		if os.Getenv("KAMI_TEST_REQUIRE_SERVICES") == "1" {
			t.Fatalf("Redis is required (KAMI_TEST_REQUIRE_SERVICES=1) but unreachable at %s: %s", u, realDown)
		}
		t.Skipf("Redis unreachable at %s, skipped: %s", u, realDown)
	}
	return u
}

// patient adds to a Redis URL the timeouts of a test client (see
// NewClient), for the servers and worker processes a test starts with it:
// no read or write deadlines, a long wait for a pooled connection, a
// bounded dial. Timeouts the URL names already are kept.
func patient(u string) string {
	sep := "?"
	if strings.Contains(u, "?") {
		sep = "&"
	}
	for _, kv := range []string{"dial_timeout=10s", "read_timeout=-1", "write_timeout=-1", "pool_timeout=5m"} {
		if !strings.Contains(u, strings.Split(kv, "=")[0]+"=") {
			u += sep + kv
			sep = "&"
		}
	}
	return u
}

// NewClient opens another client to the server (another "process"),
// closed when the test ends.
func (s *Server) NewClient(t testing.TB) redis.UniversalClient {
	t.Helper()
	if s.Cluster != nil {
		return s.Cluster.NewClient(t)
	}
	opts, err := redis.ParseURL(s.URL)
	if err != nil {
		t.Fatal(err)
	}
	// No go-redis retries, as queue.Connect sets them: a retried stock
	// script could count twice. No read or write deadlines and a long
	// wait for a pooled connection: on a busy machine under -race an
	// in-process miniredis can take seconds to answer a thousand
	// goroutines, and a test must not fail because the machine is slow.
	// A Redis that is gone still fails at once (connection refused or
	// reset); the dial keeps a bound for a stopped one.
	opts.DialTimeout, opts.ReadTimeout, opts.WriteTimeout, opts.MaxRetries = 10*time.Second, -1, -1, -1
	opts.PoolTimeout = 5 * time.Minute
	c := redis.NewClient(opts)
	t.Cleanup(func() { c.Close() })
	return c
}

// Prefix returns a key prefix of the test's own, and on the real Redis
// deletes every key under it when the test ends.
func (s *Server) Prefix(t testing.TB) string {
	t.Helper()
	b := make([]byte, 6)
	rand.Read(b)
	p := "kt:" + hex.EncodeToString(b) + ":"
	if s.Kind == Real {
		t.Cleanup(func() { s.deletePrefix(context.Background(), p) })
	}
	return p
}

// Wipe loses everything Redis holds for the test, as FLUSHALL would. On
// miniredis it is FLUSHALL; the real Redis is shared with other tests, so
// there it deletes every key under the test's prefix instead.
func (s *Server) Wipe(t testing.TB, prefix string) {
	t.Helper()
	if s.Mini != nil {
		s.Mini.FlushAll()
		return
	}
	if s.Cluster != nil {
		// The test's own: nobody else's keys to keep.
		err := s.Client.(*redis.ClusterClient).ForEachMaster(context.Background(), func(ctx context.Context, c *redis.Client) error {
			return c.FlushAll(ctx).Err()
		})
		if err != nil {
			t.Fatalf("wipe the cluster: %v", err)
		}
		return
	}
	if err := s.deletePrefix(context.Background(), prefix); err != nil {
		t.Fatalf("wipe %s*: %v", prefix, err)
	}
}

func (s *Server) deletePrefix(ctx context.Context, prefix string) error {
	iter := s.Client.Scan(ctx, 0, prefix+"*", 1000).Iterator()
	var batch []string
	for iter.Next(ctx) {
		batch = append(batch, iter.Val())
		if len(batch) == 500 {
			if err := s.Client.Unlink(ctx, batch...).Err(); err != nil {
				return err
			}
			batch = batch[:0]
		}
	}
	if len(batch) > 0 {
		if err := s.Client.Unlink(ctx, batch...).Err(); err != nil {
			return err
		}
	}
	return iter.Err()
}
