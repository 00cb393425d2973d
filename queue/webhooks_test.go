package queue_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/domain/webhook"
	"kami/queue"
	"kami/queue/redistest"
)

// hookReceiver is a webhook endpoint that counts what it got, by event id.
type hookReceiver struct {
	srv *httptest.Server
	mu  sync.Mutex
	ids []string
}

func newHookReceiver(t testing.TB) *hookReceiver {
	r := &hookReceiver{}
	r.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		io.Copy(io.Discard, req.Body)
		r.mu.Lock()
		r.ids = append(r.ids, req.Header.Get("Kami-Event-Id"))
		r.mu.Unlock()
	}))
	t.Cleanup(r.srv.Close)
	return r
}

func (r *hookReceiver) got() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.ids...)
}

// webhooks is the webhook service over the env's ledger with an endpoint
// at r for order.paid (receivers on 127.0.0.1 allowed).
func webhooksTo(t testing.TB, l *domain.Ledger, r *hookReceiver) *domain.Webhooks {
	return webhooksAt(t, l, 5*time.Second, r.srv.URL)
}

// webhooksAt is the webhook service over l whose attempts give up after
// timeout, with one order.paid endpoint per url, created in that order.
func webhooksAt(t testing.TB, l *domain.Ledger, timeout time.Duration, urls ...string) *domain.Webhooks {
	t.Helper()
	h := domain.NewWebhooks(l, domain.WebhookConfig{Timeout: timeout, Guard: webhook.Guard{AllowPrivate: true}}, domain.LogAlerter{Logger: quietLogger()}, quietLogger())
	for _, url := range urls {
		if _, _, err := h.CreateEndpoint(context.Background(), domain.WebhookEndpointInput{URL: &url, Events: []domain.EventType{domain.EventOrderPaid}}, "test"); err != nil {
			t.Fatal(err)
		}
	}
	return h
}

// stallingReceiver is an endpoint that holds every request open until the
// test lets go of it (or the sender gives up), then answers 200.
type stallingReceiver struct {
	srv      *httptest.Server
	release  chan struct{}
	one      chan struct{} // answers one request held
	once     sync.Once
	mu       sync.Mutex
	ids      []string // event ids, in order of arrival
	held     int      // requests being held now
	mostHeld int
}

func newStallingReceiver(t testing.TB) *stallingReceiver {
	r := &stallingReceiver{release: make(chan struct{}), one: make(chan struct{})}
	r.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		io.Copy(io.Discard, req.Body)
		r.mu.Lock()
		r.ids = append(r.ids, req.Header.Get("Kami-Event-Id"))
		r.held++
		r.mostHeld = max(r.mostHeld, r.held)
		r.mu.Unlock()
		select {
		case <-r.release:
		case <-r.one:
		case <-req.Context().Done():
		}
		r.mu.Lock()
		r.held--
		r.mu.Unlock()
	}))
	t.Cleanup(r.srv.Close)
	t.Cleanup(r.letGo) // first: Close waits for the requests it holds
	return r
}

// letGo answers every request held and every one to come.
func (r *stallingReceiver) letGo() { r.once.Do(func() { close(r.release) }) }

// answerOne answers one of the requests held, when there is one.
func (r *stallingReceiver) answerOne() { r.one <- struct{}{} }

// state is the event ids received so far, how many requests are held
// now, and the most ever held at once.
func (r *stallingReceiver) state() (ids []string, held, mostHeld int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.ids...), r.held, r.mostHeld
}

// distinct fails the test unless ids are n different event ids.
func distinct(t testing.TB, who string, ids []string, n int) {
	t.Helper()
	seen := map[string]bool{}
	for _, id := range ids {
		seen[id] = true
	}
	if len(ids) != n || len(seen) != n {
		t.Fatalf("%s received %v, want %d events once each", who, ids, n)
	}
}

// webhookWorkers starts delivery workers that stop when the test ends.
func webhookWorkers(t testing.TB, rs *redistest.Server, keys queue.Keys, h *domain.Webhooks) *queue.WebhookWorkers {
	t.Helper()
	w := queue.NewWebhookWorkers(queue.Config{Lease: 2 * time.Second, RecoverEvery: time.Second, SweepEvery: time.Second}, rs.Client, keys, h, quietLogger())
	startUntilCleanup(t, context.Background(), "webhook workers", w.Start, w.Stop)
	return w
}

// unstartedWebhookWorkers returns delivery workers for tests that drain
// them directly; they are stopped when the test ends, which waits for the
// attempts their drains started (before the database and the receivers
// close).
func unstartedWebhookWorkers(t testing.TB, cfg queue.Config, rdb redis.UniversalClient, keys queue.Keys, h *domain.Webhooks) *queue.WebhookWorkers {
	t.Helper()
	w := queue.NewWebhookWorkers(cfg, rdb, keys, h, quietLogger())
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute) // a deadline for a hang, never a speed
		defer cancel()
		if err := w.Stop(ctx); err != nil {
			t.Errorf("stop webhook workers: %v", err)
		}
	})
	return w
}

// payOrder places and pays one order through the ledger and returns it.
func payOrder(t testing.TB, l *domain.Ledger, p *domain.Product, trade string) *domain.Order {
	t.Helper()
	ctx := context.Background()
	placed, err := l.PlaceOrder(ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: "buyer@example.com", Provider: "sandbox"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l.RecordPayment(ctx, domain.Payment{Provider: "sandbox", OrderNo: placed.Order.OrderNo, TradeNo: trade, AmountFen: placed.Order.AmountFen}); err != nil {
		t.Fatal(err)
	}
	return placed.Order
}

// paidOrdersHooked is an env with a receiver behind an order.paid
// endpoint, and one paid order per trade.
func paidOrdersHooked(t testing.TB, db *bun.DB, rs *redistest.Server, trades ...string) (*env, *hookReceiver, *domain.Webhooks) {
	t.Helper()
	e := newEnv(t, db, rs, domain.Config{})
	r := newHookReceiver(t)
	h := webhooksTo(t, e.ledger, r)
	p := e.product(t, len(trades))
	for _, trade := range trades {
		payOrder(t, e.ledger, p, trade)
	}
	return e, r, h
}

func webhookCombos(t *testing.T, fn func(t *testing.T, db *bun.DB, rs *redistest.Server)) {
	for _, c := range []struct {
		dk dbtest.Kind
		rk redistest.Kind
	}{{dbtest.Postgres, redistest.Real}, {dbtest.MySQL, redistest.Real}, {dbtest.SQLite, redistest.Mini}} {
		t.Run(string(c.dk)+"/"+string(c.rk), func(t *testing.T) {
			t.Parallel()
			rs := redistest.Open(t, c.rk)
			fn(t, dbtest.Open(t, c.dk), rs)
		})
	}
}

// TestWebhookWorkersDeliverOnce: the workers deliver each paid order's
// event to a 2xx receiver exactly once, through the delay queue.
func TestWebhookWorkersDeliverOnce(t *testing.T) {
	t.Parallel()
	webhookCombos(t, func(t *testing.T, db *bun.DB, rs *redistest.Server) {
		e, r, h := paidOrdersHooked(t, db, rs, "T1", "T2", "T3")
		webhookWorkers(t, rs, e.keys, h)
		eventually(t, 30*time.Second, "three events delivered", func() bool { return len(r.got()) >= 3 })
		waitDelivered(t, db, 3)
		if got := r.got(); len(got) != 3 || got[0] == got[1] || got[1] == got[2] || got[0] == got[2] {
			t.Fatalf("received %v, want three events once each", got)
		}
	})
}

// waitDelivered waits until n deliveries are DELIVERED and none PENDING.
// It gives up only when no delivery has been recorded for a while (see
// eventually): a backlog of hundreds is sent a lane's worth at a time,
// and on a busy machine under -race (SQLite writing one at a time) that
// alone can take longer than eventually's patience while never stopping.
func waitDelivered(t testing.TB, db *bun.DB, n int) {
	t.Helper()
	counts := func() (delivered, pending int) {
		db.NewSelect().Table("webhook_delivery").ColumnExpr("COUNT(*)").Where("status = ?", domain.DeliveryDelivered).Scan(context.Background(), &delivered)
		db.NewSelect().Table("webhook_delivery").ColumnExpr("COUNT(*)").Where("status = ?", domain.DeliveryPending).Scan(context.Background(), &pending)
		return delivered, pending
	}
	for {
		last, pending := counts()
		if last == n && pending == 0 {
			return
		}
		eventually(t, 30*time.Second, fmt.Sprintf("deliveries recorded DELIVERED (%d of %d so far)", last, n), func() bool {
			delivered, pending := counts()
			return delivered > last || delivered == n && pending == 0
		})
	}
}

// TestWebhookFlushAllLosesNothing: deliveries fanned out and queued, then
// Redis is flushed: the sweeper rebuilds the queue from the database and
// every event is delivered, once.
func TestWebhookFlushAllLosesNothing(t *testing.T) {
	t.Parallel()
	webhookCombos(t, func(t *testing.T, db *bun.DB, rs *redistest.Server) {
		e, r, h := paidOrdersHooked(t, db, rs, "T1", "T2")
		w := unstartedWebhookWorkers(t, queue.Config{Lease: 2 * time.Second}, rs.Client, e.keys, h)
		// Fanned out and queued by a sweep that is not followed by a drain.
		if _, err := w.Sweep(e.ctx); err != nil {
			t.Fatal(err)
		}
		if st, err := w.QueueStats(e.ctx); err != nil || st.Backlog != 2 {
			t.Fatalf("queue before the flush: %+v, %v", st, err)
		}
		// The shared server's other keys belong to other tests: wipe
		// this test's own, as a FLUSHALL would.
		rs.Wipe(t, e.keys.Prefix())
		w.Drain() // nothing on the queue: nothing sent
		if len(r.got()) != 0 {
			t.Fatal("delivered from an empty queue")
		}
		if n, err := w.Sweep(e.ctx); err != nil || n != 2 {
			t.Fatalf("sweep after the flush queued %d, %v; want 2", n, err)
		}
		w.Drain()
		waitDelivered(t, db, 2)
		if got := r.got(); len(got) != 2 || got[0] == got[1] {
			t.Fatalf("received %v", got)
		}
	})
}

// stalledDrainable is a stalling endpoint for order.paid (attempts time
// out after an hour), a product of cards cards with paid of them sold and
// paid, and workers over them that are not started (drained by the test).
func stalledDrainable(t *testing.T, e *env, cards, paid int) (*stallingReceiver, *domain.Product, *queue.WebhookWorkers) {
	t.Helper()
	stalled := newStallingReceiver(t)
	h := webhooksAt(t, e.ledger, time.Hour, stalled.srv.URL)
	p := e.product(t, cards)
	for i := range paid {
		payOrder(t, e.ledger, p, fmt.Sprintf("T%d", i))
	}
	w := unstartedWebhookWorkers(t, queue.Config{Lease: time.Minute}, e.redis.Client, e.keys, h)
	t.Cleanup(stalled.letGo) // before the workers stop: they wait for the requests it holds
	return stalled, p, w
}

// TestWebhookStopEndsWhatADrainStarted: workers never started, drained
// directly (a one-off run, a test), are stopped like started ones: Stop
// returns only once the attempts the drain started have ended (here its
// context has ended, so it cancels them first), and no drain after it
// starts another. Before, Stop did nothing for workers never started, and
// their senders ran on after it.
func TestWebhookStopEndsWhatADrainStarted(t *testing.T) {
	t.Parallel()
	webhookCombos(t, func(t *testing.T, db *bun.DB, rs *redistest.Server) {
		e := newEnv(t, db, rs, domain.Config{})
		stalled, p, w := stalledDrainable(t, e, 2, 1)
		w.Drain()
		eventually(t, 30*time.Second, "the attempt held by the endpoint", func() bool {
			_, held, _ := stalled.state()
			return held == 1
		})
		ctx, cancel := context.WithCancel(e.ctx)
		cancel()
		if err := w.Stop(ctx); !errors.Is(err, context.Canceled) {
			t.Errorf("Stop with its context ended: %v, want it to cancel the attempt in flight", err)
		}
		if n := w.Stats().InFlight; n != 0 {
			t.Fatalf("%d attempts still running after Stop returned", n)
		}
		payOrder(t, e.ledger, p, "after-the-stop")
		w.Drain()
		if st := w.Stats(); st.InFlight != 0 || st.Attempts != 1 {
			t.Fatalf("a drain after Stop: %+v, want nothing started", st)
		}
	})
}

// TestWebhookSenderEndingAsTheClaimLoopStopsIsNotLost: one sender, two
// due deliveries. The drain starts the first; its sender ends exactly as
// the claim loop stops for want of a sender (held at each point where it
// stops: the round that found no free sender, the loop that found no
// request to go round again). Either the loop sees the sender that ended
// or that sender claims again: the second delivery is started before the
// drain returns, not left due until the next tick. Before, a sender that
// ended after the round had found no free sender but before it said so
// (more) did not claim, and the second delivery was left due.
func TestWebhookSenderEndingAsTheClaimLoopStopsIsNotLost(t *testing.T) {
	t.Parallel()
	for _, point := range []string{"no-free-sender", "claim-loop-done"} {
		t.Run(point, func(t *testing.T) {
			t.Parallel()
			webhookCombos(t, func(t *testing.T, db *bun.DB, rs *redistest.Server) {
				e := newEnv(t, db, rs, domain.Config{})
				stalled, _, w := stalledDrainable(t, e, 2, 2)
				w.Parallel = 1
				held, resume, ended := make(chan struct{}), make(chan struct{}), make(chan struct{}, 2)
				var first atomic.Bool
				w.SetHook(func(at string) {
					switch {
					case at == point && first.CompareAndSwap(false, true):
						close(held)
						<-resume
					case at == "sender-done":
						ended <- struct{}{}
					}
				})
				drained := make(chan struct{})
				go func() { defer close(drained); w.Drain() }()
				<-held          // the first delivery's sender started, the loop stopping
				stalled.letGo() // its attempt ends now,
				<-ended         // and its sender with it,
				close(resume)   // before the loop stops
				<-drained
				if st, err := w.QueueStats(e.ctx); err != nil || st.Due != 0 {
					t.Fatalf("after the drain: %+v, %v; want the second delivery started, none due", st, err)
				}
				<-ended
				distinct(t, "the endpoint", func() []string { ids, _, _ := stalled.state(); return ids }(), 2)
			})
		})
	}
}

// TestWebhookSurvivesKill9: a process records a payment (its event
// committed with it) and is killed with SIGKILL before anything is
// delivered; the workers of another process deliver the event once.
func TestWebhookSurvivesKill9(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		dk dbtest.Kind
		rk redistest.Kind
	}{{dbtest.Postgres, redistest.Real}, {dbtest.MySQL, redistest.Real}} {
		t.Run(string(c.dk), func(t *testing.T) {
			t.Parallel()
			pe := newProcEnv(t, c.dk, c.rk)
			r := newHookReceiver(t)
			h := webhooksTo(t, pe.ledger, r)
			name, price := "Key", int64(500)
			p, err := pe.ledger.CreateProduct(context.Background(), domain.ProductInput{Name: &name, PriceFen: &price}, "test")
			if err != nil {
				t.Fatal(err)
			}
			if _, err := pe.ledger.ImportCards(context.Background(), p.ID, []string{"K-1"}, "test"); err != nil {
				t.Fatal(err)
			}
			placed, err := pe.ledger.PlaceOrder(context.Background(), domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: "b@example.com", Provider: "sandbox"})
			if err != nil {
				t.Fatal(err)
			}
			victim := startChildEnv(t, []string{"KAMI_QW_ORDER=" + placed.Order.OrderNo}, "pay-and-hang", pe.dbURL, pe.rs.URL, pe.keys.Prefix(), time.Second, 1)
			victim.line(t, "paid", 30*time.Second)
			victim.kill9(t)
			if len(r.got()) != 0 {
				t.Fatal("delivered before the kill")
			}
			webhookWorkers(t, pe.rs, pe.keys, h)
			waitDelivered(t, pe.db, 1)
			if got := r.got(); len(got) != 1 {
				t.Fatalf("received %v, want the one event once", got)
			}
		})
	}
}

// stalledWorkers pays n orders, each an event for every endpoint at urls,
// and starts delivery workers whose attempts time out long after the test:
// only the receiver ends a stalled request. It lets stalled go before the
// workers stop (Stop waits for the attempts in flight).
func stalledWorkers(t *testing.T, e *env, stalled *stallingReceiver, n int, urls ...string) *queue.WebhookWorkers {
	t.Helper()
	h := webhooksAt(t, e.ledger, time.Hour, urls...)
	p := e.product(t, n)
	for i := range n {
		payOrder(t, e.ledger, p, fmt.Sprintf("T%d", i))
	}
	w := webhookWorkers(t, e.redis, e.keys, h)
	t.Cleanup(stalled.letGo)
	return w
}

// TestWebhookStalledEndpointDoesNotDelayOthers: one endpoint holds every
// request open (as a receiver that hangs until the attempt's timeout
// does) and another answers at once. The healthy endpoint receives every
// event while the stalled one still holds its requests, the stalled one
// never holds more than its lane's senders, and once it answers it
// receives every event too.
func TestWebhookStalledEndpointDoesNotDelayOthers(t *testing.T) {
	t.Parallel()
	webhookCombos(t, func(t *testing.T, db *bun.DB, rs *redistest.Server) {
		e := newEnv(t, db, rs, domain.Config{})
		stalled, healthy := newStallingReceiver(t), newHookReceiver(t)
		const n = 16
		w := stalledWorkers(t, e, stalled, n, stalled.srv.URL, healthy.srv.URL)
		eventually(t, 30*time.Second, "the healthy endpoint received every event while the stalled one holds requests", func() bool {
			_, held, _ := stalled.state()
			return len(healthy.got()) >= n && held > 0
		})
		ids, held, most := stalled.state()
		if held != len(ids) {
			t.Fatalf("the stalled endpoint holds %d of the %d requests it received; want all of them", held, len(ids))
		}
		if most > w.PerEndpoint {
			t.Fatalf("the stalled endpoint held %d requests at once; its lane has %d senders", most, w.PerEndpoint)
		}
		stalled.letGo()
		waitDelivered(t, db, 2*n)
		ids, _, most = stalled.state()
		distinct(t, "the stalled endpoint", ids, n)
		distinct(t, "the healthy endpoint", healthy.got(), n)
		if most > w.PerEndpoint {
			t.Fatalf("the stalled endpoint held %d requests at once; its lane has %d senders", most, w.PerEndpoint)
		}
	})
}

// waitLaneFull waits until the stalled endpoint holds its lane's senders
// and the rest of its n deliveries wait on the queue: not due, not leased.
// It returns how many of them are left leased instead, by attempts that
// failed with an error of kami's (a database error on a busy machine):
// such a delivery waits for its lease to end, and the workers' clock here
// is the test's, which does not move on its own.
func waitLaneFull(t *testing.T, e *env, w *queue.WebhookWorkers, stalled *stallingReceiver, n int) (stuck int) {
	t.Helper()
	k := w.PerEndpoint
	eventually(t, 30*time.Second, "the lane's senders held, the rest queued for later", func() bool {
		_, held, _ := stalled.state()
		st, err := w.QueueStats(e.ctx)
		stuck = int(st.Leased) - k
		return err == nil && held == k && st.Due == 0 && st.Backlog+st.Leased == int64(n) &&
			stuck >= 0 && int64(stuck) <= w.Stats().Errors
	})
	return stuck
}

// endLeases moves the test's clock past the workers' lease, so that a
// delivery left leased by a failed attempt is put back and sent. The
// deliveries in flight meanwhile are put back too, claimed again and
// found sent or not due: the database decides every attempt.
func endLeases(e *env) { e.clock.Advance(3 * time.Second) }

// queuedAs reports whether the webhook queue holds backlog members, leased
// of them, none due.
func queuedAs(e *env, w *queue.WebhookWorkers, backlog, leased int64) bool {
	st, err := w.QueueStats(e.ctx)
	return err == nil && st.Backlog == backlog && st.Leased == leased && st.Due == 0
}

// TestWebhookBusyEndpointLosesNothing: the deliveries of an endpoint whose
// lane is full wait on the queue (not due, not leased, not in memory only),
// a FLUSHALL meanwhile loses none of them, and once the endpoint answers
// again every one is delivered, once.
func TestWebhookBusyEndpointLosesNothing(t *testing.T) {
	t.Parallel()
	webhookCombos(t, func(t *testing.T, db *bun.DB, rs *redistest.Server) {
		e := newEnv(t, db, rs, domain.Config{})
		stalled := newStallingReceiver(t)
		const n = 10
		w := stalledWorkers(t, e, stalled, n, stalled.srv.URL)
		k := w.PerEndpoint
		waitLaneFull(t, e, w, stalled, n)
		rs.Wipe(t, e.keys.Prefix())
		// The sweeper queues every PENDING delivery again (the ones held
		// at their attempt's end), the drain parks those it cannot send.
		eventually(t, 30*time.Second, "every delivery queued again after the flush", func() bool { return queuedAs(e, w, n, 0) })
		stalled.letGo()
		waitDelivered(t, db, n)
		ids, _, most := stalled.state()
		distinct(t, "the endpoint", ids, n)
		if most > k {
			t.Fatalf("the endpoint held %d requests at once; its lane has %d senders", most, k)
		}
	})
}

// TestWebhookBusyEndpointBacklogIsSpread: a hanging endpoint's parked
// deliveries are spread over the timeouts it needs to send them, at most
// a lane's worth per timeout, instead of all coming due together every
// timeout to be claimed, looked up and parked again ahead of every other
// endpoint's deliveries.
func TestWebhookBusyEndpointBacklogIsSpread(t *testing.T) {
	t.Parallel()
	webhookCombos(t, func(t *testing.T, db *bun.DB, rs *redistest.Server) {
		e := newEnv(t, db, rs, domain.Config{})
		stalled := newStallingReceiver(t)
		const n = 24
		w := stalledWorkers(t, e, stalled, n, stalled.srv.URL)
		k := w.PerEndpoint
		stuck := waitLaneFull(t, e, w, stalled, n)
		q := queue.WebhookQueue(rs.Client, e.keys)
		zs, err := rs.Client.ZRangeWithScores(e.ctx, q.Key(), 0, -1).Result()
		if err != nil {
			t.Fatal(err)
		}
		if len(zs) != n-k-stuck {
			t.Fatalf("%d deliveries parked, want %d (%d left leased by failed attempts)", len(zs), n-k-stuck, stuck)
		}
		// The timeout here is an hour: no half hour may hold more than a
		// lane's worth, failed attempts or not (a failed attempt's sender
		// ends and makes a parked delivery due; those parked after it go
		// behind the rest).
		for i, z := range zs {
			within := 0
			for _, o := range zs[i:] {
				if o.Score < z.Score+float64((30*time.Minute).Milliseconds()) {
					within++
				}
			}
			if within > k {
				t.Fatalf("%d parked deliveries come due within half an hour of each other; a lane sends %d per timeout", within, k)
			}
		}
		stalled.letGo()
		if stuck > 0 {
			endLeases(e)
		}
		waitDelivered(t, db, n)
		ids, _, _ := stalled.state()
		distinct(t, "the endpoint", ids, n)
	})
}

// TestWebhookBacklogStaysSpreadWhenAParkedOneIsHurried: an attempt of a
// hanging endpoint's full lane ends; its sender makes the first parked
// delivery due and sends it. Deliveries parked after that go behind the
// ones still parked, a lane's worth per timeout: before, the lane counted
// one parked delivery fewer, so the next was parked in a timeout that
// already held a lane's worth (one more per sender freed so).
func TestWebhookBacklogStaysSpreadWhenAParkedOneIsHurried(t *testing.T) {
	t.Parallel()
	webhookCombos(t, func(t *testing.T, db *bun.DB, rs *redistest.Server) {
		e := newEnv(t, db, rs, domain.Config{})
		const k = 4 // the lane's senders (PerEndpoint's default)
		stalled, p, w := stalledDrainable(t, e, 4*k, 3*k)
		if w.PerEndpoint != k {
			t.Fatalf("PerEndpoint %d, want %d", w.PerEndpoint, k)
		}
		w.Drain() // k sent and held, 2k parked: k for each of the next two timeouts
		q := queue.WebhookQueue(rs.Client, e.keys)
		queued := func() []redis.Z {
			zs, err := rs.Client.ZRangeWithScores(e.ctx, q.Key(), 0, -1).Result()
			if err != nil {
				t.Fatal(err)
			}
			return zs
		}
		eventually(t, 30*time.Second, "the lane's senders held, the rest parked", func() bool {
			_, held, _ := stalled.state()
			return held == k && len(queued()) == 2*k
		})
		// One attempt ends; its sender makes the first parked delivery due
		// and the loop sends it: the lane full again, 2k-1 parked.
		stalled.answerOne()
		eventually(t, 30*time.Second, "the first parked delivery sent", func() bool {
			_, held, _ := stalled.state()
			st, err := w.QueueStats(e.ctx)
			return err == nil && held == k && st.Due == 0 && st.Backlog == int64(2*k-1)
		})
		before := map[string]bool{}
		last := 0.0
		for _, z := range queued() {
			before[z.Member.(string)] = true
			last = max(last, z.Score)
		}
		// k more events: their deliveries are parked behind the others.
		for i := range k {
			payOrder(t, e.ledger, p, fmt.Sprintf("later-%d", i))
		}
		w.Drain()
		zs := queued()
		if len(zs) != 3*k-1 {
			t.Fatalf("%d parked, want %d", len(zs), 3*k-1)
		}
		at := map[float64]int{}
		for _, z := range zs {
			at[z.Score]++
			if !before[z.Member.(string)] && z.Score <= last {
				t.Errorf("delivery %s parked until %v, not behind the ones parked before it (the last until %v)", z.Member, fromMS(z.Score), fromMS(last))
			}
		}
		for score, n := range at {
			if n > k {
				t.Errorf("%d deliveries parked until %v; a lane sends %d per timeout", n, fromMS(score), k)
			}
		}
	})
}

// fromMS is a queue score as a time.
func fromMS(ms float64) time.Time { return time.UnixMilli(int64(ms)).UTC() }

// TestWebhookSweepReadsEveryPage: after a FLUSHALL the sweeper puts every
// pending delivery back, however many there are, page by page: one
// bounded read (oldest first) would leave the newer ones, which a hanging
// endpoint's backlog can keep out for good, off the queue.
func TestWebhookSweepReadsEveryPage(t *testing.T) {
	t.Parallel()
	webhookCombos(t, func(t *testing.T, db *bun.DB, rs *redistest.Server) {
		e := newEnv(t, db, rs, domain.Config{})
		r := newHookReceiver(t)
		h := webhooksAt(t, e.ledger, time.Minute, r.srv.URL)
		p := e.product(t, 5)
		for i := range 5 {
			payOrder(t, e.ledger, p, fmt.Sprintf("T%d", i))
		}
		w := unstartedWebhookWorkers(t, queue.Config{Lease: 2 * time.Second}, rs.Client, e.keys, h)
		w.SweepPage = 2
		if _, err := w.Sweep(e.ctx); err != nil { // fans out and queues
			t.Fatal(err)
		}
		rs.Wipe(t, e.keys.Prefix())
		if n, err := w.Sweep(e.ctx); err != nil || n != 5 {
			t.Fatalf("the sweep after the flush queued %d, %v; want all 5", n, err)
		}
		w.Drain()
		waitDelivered(t, db, 5)
		distinct(t, "the endpoint", r.got(), 5)
	})
}

// scriptCounter counts the Lua scripts a client runs with key as their
// first key, and which of them are claims: a claim is the one script on a
// delay queue that takes three arguments, the second a count rather than a
// time in milliseconds.
type scriptCounter struct {
	key             string
	scripts, claims atomic.Int64
	firstClaim      atomic.Int64 // unix ns
}

func (c *scriptCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *scriptCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.count(cmd)
		return next(ctx, cmd)
	}
}

func (c *scriptCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			c.count(cmd)
		}
		return next(ctx, cmds)
	}
}

// count counts cmd if it runs a script on c.key (EVALSHA: a script run
// falls back to EVAL only after a NOSCRIPT, so each run counts once).
func (c *scriptCounter) count(cmd redis.Cmder) {
	args := cmd.Args()
	if !strings.EqualFold(cmd.Name(), "evalsha") || len(args) < 4 || fmt.Sprint(args[3]) != c.key {
		return
	}
	c.scripts.Add(1)
	if n, err := strconv.ParseInt(fmt.Sprint(args[len(args)-2]), 10, 64); err == nil && len(args) == 8 && fmt.Sprint(args[2]) == "2" && n < 1e9 {
		if c.claims.Add(1) == 1 {
			c.firstClaim.Store(time.Now().UnixNano())
		}
	}
}

// dueBacklog is n deliveries to a hanging endpoint, all due at once (a
// burst of events while it hangs), and after them one event's deliveries
// to it and to endpoints made after the burst, queued for workers that are
// not started and whose Redis client counts the scripts they run on the
// webhook queue.
type dueBacklog struct {
	w       *queue.WebhookWorkers
	stalled *stallingReceiver
	scripts *scriptCounter
}

func newDueBacklog(t testing.TB, e *env, n int, after ...string) *dueBacklog {
	t.Helper()
	d := &dueBacklog{stalled: newStallingReceiver(t), scripts: &scriptCounter{key: e.keys.WebhookQueue()}}
	h := webhooksAt(t, e.ledger, time.Hour, d.stalled.srv.URL)
	burst := make([]domain.Event, n)
	for i := range burst {
		burst[i] = domain.Event{Type: domain.EventOrderPaid, Subject: fmt.Sprintf("burst-%d", i), OccurredAt: e.clock.Now(), Payload: "{}"}
	}
	for start := 0; start < n; start += 1000 {
		part := burst[start:min(start+1000, n)]
		if _, err := e.db.NewInsert().Model(&part).Exec(e.ctx); err != nil {
			t.Fatal(err)
		}
	}
	client := e.redis.NewClient(t)
	client.AddHook(d.scripts)
	d.w = unstartedWebhookWorkers(t, queue.Config{Lease: time.Minute, RecoverEvery: time.Minute, SweepEvery: time.Hour}, client, e.keys, h)
	// Before the workers stop: they wait for the requests it holds.
	t.Cleanup(d.stalled.letGo)
	if _, err := d.w.Sweep(e.ctx); err != nil { // fans the burst out and queues it
		t.Fatal(err)
	}
	e.clock.Advance(time.Second)
	for _, url := range after {
		if _, _, err := h.CreateEndpoint(e.ctx, domain.WebhookEndpointInput{URL: &url, Events: []domain.EventType{domain.EventOrderPaid}}, "test"); err != nil {
			t.Fatal(err)
		}
	}
	payOrder(t, e.ledger, e.product(t, 1), "after-the-burst")
	if _, err := d.w.Sweep(e.ctx); err != nil { // its event, to every endpoint
		t.Fatal(err)
	}
	e.clock.Advance(time.Second)
	return d
}

// TestWebhookDueBacklogIsWalkedInFewClaims: a hanging endpoint's backlog,
// all due at once, stands before one delivery to a healthy endpoint. The
// claims past it park the backlog many at a time (parking needs no
// sender), so the healthy delivery is claimed and sent within
// ceil(backlog/walk) and a few claims, each with one script to put back
// what it parked, instead of one claim per free sender's worth of the
// backlog. Once the hanging endpoint answers, every delivery is delivered
// once.
func TestWebhookDueBacklogIsWalkedInFewClaims(t *testing.T) {
	t.Parallel()
	webhookCombos(t, func(t *testing.T, db *bun.DB, rs *redistest.Server) {
		e := newEnv(t, db, rs, domain.Config{})
		// Within what the lane remembers (1,000 parked), so that its
		// senders alone bring the whole backlog back once it answers.
		const n = 600
		const walk = 500 // what a claim after one that parked most takes (queue's walkClaim)
		healthy := newHookReceiver(t)
		d := newDueBacklog(t, e, n, healthy.srv.URL)
		before := d.scripts.scripts.Load()
		d.w.Drain() // claims until nothing is due: one round, no tick
		scripts, claims := d.scripts.scripts.Load()-before, d.scripts.claims.Load()
		t.Logf("%d due deliveries of a hanging endpoint walked in %d claims, %d scripts on the queue", n, claims, scripts)
		if most := 2 * ((n+walk-1)/walk + 4); scripts > int64(most) {
			t.Fatalf("the walk past %d due deliveries of a hanging endpoint ran %d scripts on the queue (%d claims); want at most %d", n, scripts, claims, most)
		}
		eventually(t, 30*time.Second, "the healthy endpoint received its event", func() bool { return len(healthy.got()) == 1 })
		_, held, _ := d.stalled.state()
		if held > d.w.PerEndpoint {
			t.Fatalf("the hanging endpoint holds %d requests; its lane has %d senders", held, d.w.PerEndpoint)
		}
		d.stalled.letGo()
		waitDelivered(t, db, n+2)
		ids, _, most := d.stalled.state()
		distinct(t, "the hanging endpoint", ids, n+1)
		distinct(t, "the healthy endpoint", healthy.got(), 1)
		if most > d.w.PerEndpoint {
			t.Fatalf("the hanging endpoint held %d requests at once; its lane has %d senders", most, d.w.PerEndpoint)
		}
	})
}

// TestWebhookWalkPutsBackWhatNoSenderTakes: a claim walking a hanging
// endpoint's backlog takes more deliveries than there are free senders;
// those whose lane has room but found no sender go back on the queue due
// as they were (neither leased nor parked for later), and are sent as
// senders free, each once.
func TestWebhookWalkPutsBackWhatNoSenderTakes(t *testing.T) {
	t.Parallel()
	webhookCombos(t, func(t *testing.T, db *bun.DB, rs *redistest.Server) {
		e := newEnv(t, db, rs, domain.Config{})
		others := []*stallingReceiver{newStallingReceiver(t), newStallingReceiver(t), newStallingReceiver(t)}
		const n = 40
		d := newDueBacklog(t, e, n, others[0].srv.URL, others[1].srv.URL, others[2].srv.URL)
		k := d.w.PerEndpoint
		d.w.Parallel = k + 1 // the hanging lane's senders and one more
		q := queue.WebhookQueue(rs.Client, e.keys)
		queued := func() map[string]float64 {
			zs, err := rs.Client.ZRangeWithScores(e.ctx, q.Key(), 0, -1).Result()
			if err != nil {
				t.Fatal(err)
			}
			m := map[string]float64{}
			for _, z := range zs {
				m[z.Member.(string)] = z.Score
			}
			return m
		}
		before := queued()
		d.w.Drain()
		// The hanging lane's k and one other endpoint's delivery are being
		// sent; the rest of the backlog is parked; the two other endpoints'
		// deliveries wait due, at their own time.
		st, err := d.w.QueueStats(e.ctx)
		if err != nil || st.Leased != int64(k+1) || st.Due != 2 || st.Backlog != int64(n+1-k+2) {
			t.Fatalf("after the walk: %+v, %v; want %d leased, 2 due, %d queued", st, err, k+1, n+1-k+2)
		}
		now := float64(e.clock.Now().UnixMilli())
		due := 0
		for m, score := range queued() {
			if score <= now {
				due++
				if score != before[m] {
					t.Fatalf("delivery %s put back due at %v; it was due at %v", m, score, before[m])
				}
			}
		}
		if due != 2 {
			t.Fatalf("%d deliveries due after the walk, want 2", due)
		}
		d.stalled.letGo()
		for _, o := range others {
			o.letGo()
		}
		waitDelivered(t, db, n+1+len(others))
		ids, _, most := d.stalled.state()
		distinct(t, "the hanging endpoint", ids, n+1)
		if most > k {
			t.Fatalf("the hanging endpoint held %d requests at once; its lane has %d senders", most, k)
		}
		for _, o := range others {
			ids, _, _ := o.state()
			distinct(t, "another endpoint", ids, 1)
		}
	})
}

// BenchmarkWebhookDueBacklogWalk: started workers (the drain every second)
// against KAMI_BENCH_WALK_N (default 20,000) due deliveries of a hanging
// endpoint and one to a healthy endpoint due after them: the time and the
// claims until the healthy one is sent, from the start (the first drain
// waits for the next whole second) and from the first claim. PostgreSQL
// and the real Redis; one macro run:
//
//	go test ./queue/ -run '^$' -bench WebhookDueBacklogWalk -benchtime=1x
func BenchmarkWebhookDueBacklogWalk(b *testing.B) {
	n := envInt("KAMI_BENCH_WALK_N", 20_000)
	for range b.N {
		b.StopTimer()
		rs := redistest.Open(b, redistest.Real)
		e := newEnv(b, dbtest.Open(b, dbtest.Postgres), rs, domain.Config{})
		healthy := newHookReceiver(b)
		d := newDueBacklog(b, e, n, healthy.srv.URL)
		// The burst comes while kami runs: no sweeper pass at start reads
		// the backlog again beside the walk.
		if err := rs.Client.Set(e.ctx, e.keys.WebhookSweepLock(), fmt.Sprintf("%d:bench", time.Now().Add(time.Hour).UnixMilli()), time.Hour).Err(); err != nil {
			b.Fatal(err)
		}
		before := d.scripts.scripts.Load()
		b.StartTimer()
		start := time.Now()
		if err := d.w.Start(e.ctx); err != nil {
			b.Fatal(err)
		}
		for len(healthy.got()) == 0 {
			if time.Since(start) > 10*time.Minute {
				b.Fatal("the healthy endpoint's delivery was not sent within 10 minutes")
			}
			time.Sleep(time.Millisecond)
		}
		took := time.Since(start)
		walked := time.Since(time.Unix(0, d.scripts.firstClaim.Load()))
		b.StopTimer()
		scripts, claims := d.scripts.scripts.Load()-before, d.scripts.claims.Load()
		d.stalled.letGo()
		d.w.Stop(e.ctx)
		b.ReportMetric(took.Seconds(), "s/healthy-sent")
		b.ReportMetric(walked.Seconds(), "s/from-first-claim")
		b.ReportMetric(float64(claims), "claims")
		b.ReportMetric(float64(scripts), "scripts")
	}
}
