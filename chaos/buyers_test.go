package chaos

import (
	"fmt"
	"math/rand/v2"
	"net/http"
	"time"

	"kami/providers/sandbox"
)

// The buyers: each places orders one after another while the faulty phase
// lasts; each order then lives its fate in a goroutine of its own. Every
// choice is drawn from the buyer's own generator, seeded from the
// campaign's seed, so a seed replays the same choices.

// fates and their weights (in 100ths).
var fates = []struct {
	name string
	w    int
}{
	{"pay", 38},         // pays within its time
	{"pay-dropped", 7},  // pays, but the gateway's notification never arrives
	{"pay-twice", 10},   // the notification arrives twice at once (and again later); sandbox: two trades
	{"pay-late", 12},    // pays after the order closed
	{"pay-at-close", 6}, // pays just as the order falls due
	{"cancel", 8},       // cancels
	{"abandon", 19},     // never pays
}

func pickFate(r *rand.Rand) string {
	n := r.IntN(100)
	for _, f := range fates {
		if n < f.w {
			return f.name
		}
		n -= f.w
	}
	return "abandon"
}

func (c *campaign) buyer(b int) {
	r := rand.New(rand.NewPCG(uint64(c.seed), uint64(1000+b)))
	for i := 0; c.placing.Load(); i++ {
		c.placeOne(r, fmt.Sprintf("buyer%d-%d@chaos.example", b, i))
		time.Sleep(time.Duration(250+r.IntN(700)) * time.Millisecond)
	}
}

// placeOne places one order (trying again with the same idempotency key
// when the answer is lost or refused for a passing reason) and starts its
// fate.
func (c *campaign) placeOne(r *rand.Rand, contact string) {
	total := 0
	for _, p := range c.products {
		total += p.weight
	}
	n := r.IntN(total)
	var prod product
	for _, p := range c.products {
		if n < p.weight {
			prod = p
			break
		}
		n -= p.weight
	}
	qty := 1
	if prod.maxQty > 1 && r.IntN(4) == 0 {
		qty = 2 + r.IntN(prod.maxQty-1)
	}
	provider := []string{"alipay", "alipay", "wechat", "wechat", "sandbox"}[r.IntN(5)]
	fate := pickFate(r)
	if fate == "pay-dropped" && provider == "sandbox" {
		// The sandbox's gateway is the campaign: a notification it never
		// sends is a payment nobody could ever learn of.
		fate = "pay"
	}
	adminRefund := r.IntN(100) < 15
	twice := r.IntN(5) == 0
	delay := time.Duration(200+r.IntN(int(orderTTL/time.Millisecond)*6/10)) * time.Millisecond
	key := fmt.Sprintf("chaos-%d-%s", c.seed, randomHex(8))
	procPick := r.Uint64()

	var out struct {
		CreateOrder struct {
			Order struct {
				OrderNo   string `json:"orderNo"`
				Status    string `json:"status"`
				Amount    string `json:"amount"`
				ExpiresAt string `json:"expiresAt"`
			} `json:"order"`
			AccessToken string `json:"accessToken"`
		} `json:"createOrder"`
	}
	for attempt := 0; attempt < 3; attempt++ {
		live := c.env.live()
		if len(live) == 0 {
			time.Sleep(500 * time.Millisecond)
			continue
		}
		p := live[int((procPick+uint64(attempt))%uint64(len(live)))]
		c.figures.createTries.Add(1)
		code, err := c.gql(p, false, `mutation($in: CreateOrderInput!) { createOrder(input: $in) { order { orderNo status amount expiresAt } accessToken } }`,
			map[string]any{"in": map[string]any{"productId": prod.id, "quantity": qty, "contact": contact, "provider": provider, "idempotencyKey": key}}, &out)
		if code == "" {
			break
		}
		c.figures.count(c.figures.createErrors, code)
		c.figures.figuresMu.Lock()
		if c.figures.createErrorText[code] == "" {
			c.figures.createErrorText[code] = fmt.Sprintf("%s: %v", p.name(), err)
		}
		c.figures.figuresMu.Unlock()
		switch code {
		case "TRANSPORT", "UNAVAILABLE", "INTERNAL":
			time.Sleep(300 * time.Millisecond)
			continue
		}
		return // SOLD_OUT, LIMIT_EXCEEDED…: the buyer goes away
	}
	co := out.CreateOrder
	if co.Order.OrderNo == "" {
		return
	}
	if co.Order.Status != "PENDING" {
		// A retry answered with an order the first try's failure had
		// already cancelled: the buyer is shown a payment for it.
		c.violation("createOrder answered order %s, which is already %s, with a payment to make (a retry with the same idempotency key after the first try failed)",
			co.Order.OrderNo, co.Order.Status)
		return
	}
	exp, err := time.Parse(time.RFC3339Nano, co.Order.ExpiresAt)
	if err != nil {
		c.violation("order %s: expiresAt %q: %v", co.Order.OrderNo, co.Order.ExpiresAt, err)
		return
	}
	fen, err := parseFen(co.Order.Amount)
	if err != nil || fen != prod.priceFen*int64(qty) {
		c.violation("order %s: amount %q, want %d fen", co.Order.OrderNo, co.Order.Amount, prod.priceFen*int64(qty))
		return
	}
	o := &order{no: co.Order.OrderNo, token: co.AccessToken, provider: provider, productID: prod.id, qty: qty,
		amountFen: fen, expiresAt: exp, fate: fate}
	c.mu.Lock()
	if c.orders[o.no] != nil {
		c.mu.Unlock()
		return // the same order again (an idempotent retry answered twice)
	}
	c.orders[o.no] = o
	c.mu.Unlock()
	c.figures.orders.Add(1)
	c.figures.count(c.figures.fates, fate)
	c.buyers.Add(1)
	go func() {
		defer c.buyers.Done()
		if fate == "retry-bad-method" {
			c.retryBadMethod(o, prod, contact, key)
		}
		c.live(o, delay, adminRefund, twice)
	}()
}

// live plays an order's fate.
func (c *campaign) live(o *order, delay time.Duration, adminRefund, twice bool) {
	switch o.fate {
	case "pay", "pay-dropped", "pay-twice", "retry-bad-method":
		time.Sleep(delay)
		c.pay(o, o.fate == "pay-dropped", o.fate == "pay-twice")
	case "pay-at-close":
		time.Sleep(time.Until(o.expiresAt.Add(-time.Duration(rand.IntN(400)) * time.Millisecond)))
		c.pay(o, false, false)
	case "pay-late":
		if c.waitClosed(o) {
			c.pay(o, false, false)
		}
		return
	case "cancel":
		time.Sleep(delay / 2)
		o.mu.Lock()
		o.cancelSent = true
		o.mu.Unlock()
		if p := c.pick(nil); p != nil {
			c.gql(p, false, `mutation($o: String!, $t: String!) { cancelOrder(orderNo: $o, accessToken: $t) { status } }`,
				map[string]any{"o": o.no, "t": o.token}, nil)
		}
		return
	default:
		return
	}
	if adminRefund {
		c.refund(o, twice)
	}
}

// pay makes the buyer pay at the order's gateway and the gateway notify
// kami (unless the notification is lost). twice: the notification comes
// twice at once and once more later; with the sandbox, a second trade pays
// the same order.
func (c *campaign) pay(o *order, dropped, twice bool) {
	o.mu.Lock()
	o.paidAttempts++
	o.mu.Unlock()
	var h http.Header
	var body []byte
	var err error
	switch o.provider {
	case "alipay":
		h, body, err = c.env.alipay.Pay(o.no, o.amountFen)
	case "wechat":
		h, body, err = c.env.wechat.Pay(o.no, o.amountFen)
	case "sandbox":
		c.paySandbox(o)
		if twice {
			c.paySandbox(o)
		}
		return
	}
	if err != nil {
		c.violation("the %s gateway refused to take the payment of %s: %v", o.provider, o.no, err)
		return
	}
	if dropped {
		return
	}
	acked := func() {
		o.mu.Lock()
		o.acked = true
		o.mu.Unlock()
	}
	c.notify(o.provider, h, body, acked)
	if twice {
		c.notify(o.provider, h, body, acked)
		time.Sleep(2 * time.Second)
		c.notify(o.provider, h, body, acked)
	}
}

// retryBadMethod: the buyer's client retries createOrder with the same
// idempotency key but a payment method the provider does not offer. The
// retry is refused; the buyer's live order must stay as it was.
func (c *campaign) retryBadMethod(o *order, prod product, contact, key string) {
	p := c.pick(nil)
	if p == nil {
		return
	}
	code, _ := c.gql(p, false, `mutation($in: CreateOrderInput!) { createOrder(input: $in) { order { orderNo } } }`,
		map[string]any{"in": map[string]any{"productId": prod.id, "quantity": o.qty, "contact": contact, "provider": o.provider,
			"idempotencyKey": key, "method": "bogus"}}, nil)
	if code == "" {
		c.violation("order %s: a retry with payment method \"bogus\" was accepted", o.no)
	}
	if st := c.status(o); st == "CLOSED" && time.Now().Before(o.expiresAt) {
		o.mu.Lock()
		o.closedByRetry = true
		o.mu.Unlock()
		c.violation("order %s: a retry of createOrder with a bad payment method (refused: %s) closed the buyer's live order", o.no, code)
	}
}

// paySandbox is one sandbox payment, with a trade number of its own.
func (c *campaign) paySandbox(o *order) {
	sp := &sandboxPayment{orderNo: o.no, tradeNo: fmt.Sprintf("SBC%d%06d", c.seed%100000, c.sbSeq.Add(1)), fen: o.amountFen}
	c.mu.Lock()
	c.sandbox = append(c.sandbox, sp)
	c.mu.Unlock()
	h, body := sandbox.Signed(sandboxSecret, sandbox.PaymentNotification(o.no, sp.tradeNo, o.amountFen, time.Now()))
	c.notify("sandbox", h, body, func() { sp.acked.Store(true) })
}

// waitClosed polls the order as its buyer until it is CLOSED; false if it
// never closes while the campaign waits.
func (c *campaign) waitClosed(o *order) bool {
	deadline := o.expiresAt.Add(sweepEvery + 2*queueLease + 40*time.Second)
	for time.Now().Before(deadline) {
		if st := c.status(o); st == "CLOSED" {
			return true
		} else if st != "" && st != "PENDING" {
			c.violation("order %s, never paid, is %s", o.no, st)
			return false
		}
		select {
		case <-c.ctx.Done():
			return false
		case <-time.After(500 * time.Millisecond):
		}
	}
	return false
}

// status is the order's status as its buyer sees it ("" when no answer).
func (c *campaign) status(o *order) string {
	p := c.pick(nil)
	if p == nil {
		return ""
	}
	var out struct {
		Order *struct{ Status string } `json:"order"`
	}
	if code, _ := c.gql(p, false, `query($o: String!, $t: String) { order(orderNo: $o, accessToken: $t) { status } }`,
		map[string]any{"o": o.no, "t": o.token}, &out); code != "" || out.Order == nil {
		return ""
	}
	return out.Order.Status
}

// refund is an admin refunding a paid order, once it is PAID; twice: the
// admin presses the button on two processes at once.
func (c *campaign) refund(o *order, twice bool) {
	deadline := time.Now().Add(15 * time.Second)
	for c.status(o) != "PAID" {
		if time.Now().After(deadline) {
			return
		}
		time.Sleep(500 * time.Millisecond)
	}
	o.mu.Lock()
	o.refundAsked = true
	o.mu.Unlock()
	n := 1
	if twice {
		n = 2
	}
	done := make(chan struct{}, n)
	for range n {
		go func() {
			defer func() { done <- struct{}{} }()
			if p := c.pick(nil); p != nil {
				c.figures.adminRefunds.Add(1)
				c.gql(p, true, `mutation($o: String!) { refundOrder(orderNo: $o, reason: "chaos: buyer asked") { refundNo status } }`,
					map[string]any{"o": o.no}, nil)
			}
		}()
	}
	for range n {
		<-done
	}
}

// watchCloses polls the database every 200 ms for orders that have become
// CLOSED, and notes when the campaign first saw each (see checkEarly). It
// returns the function that stops it.
func (c *campaign) watchCloses() func() {
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			case <-time.After(200 * time.Millisecond):
			}
			rows, err := c.env.db.Query(`SELECT order_no FROM orders WHERE status = 'CLOSED'`)
			if err != nil {
				continue
			}
			now := time.Now()
			for rows.Next() {
				var no string
				if rows.Scan(&no) != nil {
					continue
				}
				c.mu.Lock()
				o := c.orders[no]
				c.mu.Unlock()
				if o == nil {
					continue
				}
				o.mu.Lock()
				if o.closedSeen.IsZero() {
					o.closedSeen = now
					c.figures.closedSeen++
				}
				o.mu.Unlock()
			}
			rows.Close()
		}
	}()
	return func() { close(stop); <-done }
}

// checkEarly: an order seen CLOSED before the expiresAt its buyer was
// told, without the buyer cancelling, was closed early. The message names
// the process that closed it (from its log) and that process's clock.
func (c *campaign) checkEarly() {
	closers := c.env.closers()
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, o := range c.orders {
		o.mu.Lock()
		seen, exp, excused := o.closedSeen, o.expiresAt, o.cancelSent || o.closedByRetry || o.fate == "retry-bad-method"
		o.mu.Unlock()
		if seen.IsZero() || !seen.Before(exp) || excused {
			continue
		}
		c.figures.closedEarly++
		by := closers[o.no]
		for _, p := range c.env.procs {
			if p.name() == by && p.skew != 0 {
				by += fmt.Sprintf(" (clock %+v)", p.skew)
			}
		}
		c.violations = append(c.violations, violation{format: "order closed early by %s",
			msg: fmt.Sprintf("order %s closed early: seen CLOSED %s before the expiresAt its buyer was told, closed by %s",
				o.no, exp.Sub(seen).Round(time.Millisecond), by), group: "order closed early by " + by})
	}
}

// checkNothingPending: no order is PENDING once its time and one sweep (and
// a lease, for a claim a killed process held) have passed. It runs once the
// last order's time and that grace have passed, and no sooner than the
// pre-close circuit breaker's cooldown after the heal.
func (c *campaign) checkNothingPending(grace time.Duration) {
	rows, err := c.env.db.Query(`SELECT order_no, provider, expires_at FROM orders WHERE status = 'PENDING' ORDER BY expires_at`)
	if err != nil {
		c.violation("read PENDING orders: %v", err)
		return
	}
	defer rows.Close()
	now := time.Now()
	for rows.Next() {
		var no, prov string
		var exp time.Time
		if err := rows.Scan(&no, &prov, &exp); err != nil {
			c.violation("read PENDING orders: %v", err)
			return
		}
		if exp.Add(grace).Before(now) {
			c.violation("order %s (%s) still PENDING %s after its expires_at (one sweep, lease and recovery: %s)", no, prov, now.Sub(exp).Round(time.Second), grace)
		}
	}
}
