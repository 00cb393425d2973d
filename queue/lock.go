package queue

import (
	"context"
	"time"

	"github.com/redis/go-redis/v9"

	"kami/domain"
)

// Locker hands out Redis locks: SET NX with an expiry, released only by the
// holder (compare-and-delete), so a lock that outlived its holder's expiry
// and went to another process is never released by the first.
type Locker struct {
	rdb  redis.UniversalClient
	keys Keys
}

var _ domain.Locker = (*Locker)(nil)

// NewLocker returns a Locker over rdb.
func NewLocker(rdb redis.UniversalClient, keys Keys) *Locker { return &Locker{rdb: rdb, keys: keys} }

// TryLock takes the lock name for ttl if nobody holds it.
func (l *Locker) TryLock(ctx context.Context, name string, ttl time.Duration) (func(), bool, error) {
	key, token := l.keys.Lock(name), randomToken()
	ok, err := l.rdb.SetNX(ctx, key, token, ttl).Result()
	if err != nil || !ok {
		return nil, false, err
	}
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		unlockScript.Run(ctx, l.rdb, []string{key}, token)
	}, true, nil
}
