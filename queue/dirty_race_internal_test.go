package queue

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"
)

// TestDirtyMarkDuringDropIsKept: a give-back that fails (both copies)
// while another goroutine drops the product's dirty counter, after the
// drop's DEL and a rebuild that counted before the give-back's close
// committed, must leave the counter marked: it is low by the give-back.
// Before, dropDirty cleared the mark after its DEL, erasing the new one.
func TestDirtyMarkDuringDropIsKept(t *testing.T) {
	_, rdb := miniClient(t)
	ctx := context.Background()
	keys := NewKeys("t:")
	db := 10 // the database's free cards
	g := newStockGate(rdb, keys, func(ctx context.Context, ids ...int64) (map[int64]int, error) {
		return map[int64]int{7: db}, nil
	})
	if err := rdb.Set(ctx, keys.Stock(7), 4, 0).Err(); err != nil { // wrong: left by a failed call
		t.Fatal(err)
	}
	g.markDirty(7)
	fired := false
	rdb.AddHook(hook{process: func(next redis.ProcessHook) redis.ProcessHook {
		return func(ctx context.Context, cmd redis.Cmder) error {
			err := next(ctx, cmd)
			if cmd.Name() == "del" && !fired {
				fired = true
				// Another goroutine's take rebuilds the dropped counter
				// from the database (10)...
				if _, err := g.rebuild(ctx, 7, false); err != nil {
					t.Error(err)
				}
				// ...a close of 3 cards commits after that count, and its
				// give-back fails twice: the counter is low by 3.
				db += 3
				g.markDirty(7)
			}
			return err
		}
	}})
	if _, err := g.ResetDirty(ctx); err != nil {
		t.Fatal(err)
	}
	if !fired {
		t.Fatal("the dirty counter was never deleted: the race this test stages did not happen")
	}
	n, _, _ := g.Counter(ctx, 7)
	if n < db && !g.isDirty(7) {
		t.Fatalf("counter %d below the database's %d and not marked for a rebuild (the mark of the failed give-back was erased)", n, db)
	}
}
