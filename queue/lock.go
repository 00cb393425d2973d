package queue

import (
	"context"
	"time"

	"github.com/redis/go-redis/v9"

	"kami/domain"
)

// Locker hands out Redis locks: set if free, with an expiry, released only
// by the holder (compare-and-delete), so a lock that outlived its holder's
// expiry and went to another process is never released by the first.
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
	ok, err := l.tryLock(ctx, key, token, ttl)
	if err != nil || !ok {
		return nil, false, err
	}
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		unlockScript.Run(ctx, l.rdb, []string{key}, token)
	}, true, nil
}

// tryLock takes key for ttl under token if it is free, or reports it taken
// when it already holds token (an earlier copy of this command took it).
func (l *Locker) tryLock(ctx context.Context, key, token string, ttl time.Duration) (bool, error) {
	n, err := tryLockScript.Run(ctx, l.rdb, []string{key}, token, max(ttl.Milliseconds(), 1)).Int()
	return n == 1, err
}

// sweepLock takes the lock key for ttl if it is free or its holder's time
// ran out by now (see lockScript): a sweep runs in one process per ttl.
func sweepLock(ctx context.Context, rdb redis.UniversalClient, key string, now time.Time, ttl time.Duration) (bool, error) {
	got, err := lockScript.Run(ctx, rdb, []string{key}, now.UnixMilli(), now.Add(ttl).UnixMilli(), ttl.Milliseconds(), randomToken()).Int()
	return got == 1, err
}
