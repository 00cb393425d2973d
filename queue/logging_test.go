package queue_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"kami/domain/domaintest"
	"kami/queue"
)

// TestRedisLogsGoThroughSlog: go-redis's own line about a failed dial
// comes out as one JSON line of kami's logger, not as go-redis's plain
// text on stderr. Not parallel: go-redis has one logger per process.
func TestRedisLogsGoThroughSlog(t *testing.T) {
	var out domaintest.LogBuffer
	queue.RouteRedisLogs(slog.New(slog.NewJSONHandler(&out, nil)))
	t.Cleanup(func() { redis.SetLogger(discardLogger{}) }) // as TestMain set it

	// A port nobody listens on: the dial fails at once.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	rdb := redis.NewClient(&redis.Options{Addr: addr, DialerRetries: 1, MaxRetries: -1, DialTimeout: time.Second})
	defer rdb.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	if err := rdb.Ping(ctx).Err(); err == nil {
		t.Fatal("ping to a closed port succeeded")
	}

	var found bool
	for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		var rec struct {
			Level, Msg, Component string
		}
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Fatalf("not a JSON log line: %q", line)
		}
		if strings.Contains(rec.Msg, "failed to dial") {
			found = true
			if rec.Level != "WARN" || rec.Component != "redis" || strings.HasPrefix(rec.Msg, "redis: ") {
				t.Errorf("go-redis line %+v", rec)
			}
		}
	}
	if !found {
		t.Fatalf("no go-redis dial failure in kami's log: %q", out.String())
	}
}
