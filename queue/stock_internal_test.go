package queue

import (
	"context"
	"testing"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// TestGiveBackDuringRebuild: cards freed after a rebuild counted the
// database, given back while the counter is still missing, are not lost:
// the rebuild adds them. (Found as a flaky SOLD_OUT on a product whose
// counter was rebuilt while its cards were being imported.)
func TestGiveBackDuringRebuild(t *testing.T) {
	t.Parallel()
	m := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { rdb.Close() })
	ctx := context.Background()
	counting, release := make(chan struct{}), make(chan struct{})
	g := newStockGate(rdb, NewKeys("t:"), func(ctx context.Context, productID int64) (int, error) {
		close(counting)
		<-release
		return 0, nil // the import below commits after this count
	})
	done := make(chan error, 1)
	go func() { done <- g.ensure(ctx, 7) }()
	<-counting
	if err := g.GiveBack(ctx, 7, 3); err != nil { // the import's give-back: the counter is missing
		t.Fatal(err)
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if n, ok, err := g.Counter(ctx, 7); err != nil || !ok || n != 3 {
		t.Fatalf("counter %d %v %v after the rebuild, want 3 (the cards given back while it counted)", n, ok, err)
	}
	// A give-back to a missing counter with no rebuild running is dropped:
	// the next rebuild counts those cards in the database.
	if err := g.GiveBack(ctx, 8, 2); err != nil {
		t.Fatal(err)
	}
	if m.Exists(NewKeys("t:").StockRebuildPending(8)) || m.Exists(NewKeys("t:").Stock(8)) {
		t.Fatal("a give-back with no rebuild running left a key behind")
	}
}
