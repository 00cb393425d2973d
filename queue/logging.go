package queue

import (
	"context"
	"fmt"
	"log/slog"
	"strings"

	"github.com/redis/go-redis/v9"
)

// RouteRedisLogs sends go-redis's own log lines ("connection pool: failed
// to dial after 1 attempts", cluster and sentinel notes) through logger,
// so they take KAMI_LOG_FORMAT and KAMI_LOG_LEVEL like every other line,
// instead of go-redis's plain lines on stderr. go-redis keeps one logger
// per process: the last call wins.
func RouteRedisLogs(logger *slog.Logger) {
	redis.SetLogger(redisLogger{logger.With("component", "redis")})
}

// redisLogger adapts slog to go-redis's Printf-style logger. go-redis logs
// only what went wrong or out of the ordinary, so every line is a warning.
type redisLogger struct{ l *slog.Logger }

func (r redisLogger) Printf(ctx context.Context, format string, v ...any) {
	if !r.l.Enabled(ctx, slog.LevelWarn) {
		return
	}
	msg := strings.TrimSpace(fmt.Sprintf(format, v...))
	r.l.WarnContext(ctx, strings.TrimPrefix(msg, "redis: "))
}
