package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"

	"kami/providers/fault"
)

// event is one fault of the schedule.
type event struct {
	At   time.Duration // from the start of the faulty phase
	Kind string
	Proc int           // the process it hits (toxics, kill)
	For  time.Duration // how long it lasts (toxics, kill: until the restart, gateway outages)
	// Toxics: the latency or the timeout in ms. Gateway faults: how many
	// calls (0: until cleared after For).
	N        int64
	Provider string // gateway faults: alipay or wechat
	Op       fault.Op
	Fault    fault.Fault
}

func (e event) String() string {
	s := fmt.Sprintf("%6.1fs %-16s", e.At.Seconds(), e.Kind)
	switch {
	case strings.HasPrefix(e.Kind, "gw-"):
		s += fmt.Sprintf(" %s %s %s n=%d", e.Provider, e.Op, e.Fault, e.N)
		if e.For > 0 {
			s += fmt.Sprintf(" for %s", e.For)
		}
	case e.Kind == "redis-flushall":
	default:
		s += fmt.Sprintf(" p%d for %s", e.Proc, e.For)
		if e.N > 0 {
			s += fmt.Sprintf(" (%d ms)", e.N)
		}
	}
	return s
}

// faultKinds and their weights.
var faultKinds = []struct {
	kind string
	w    int
}{
	{"pg-latency", 10}, {"pg-reset", 6}, {"pg-stall", 6},
	{"redis-latency", 8}, {"redis-reset", 6}, {"redis-stall", 5}, {"redis-flushall", 5},
	{"gw-fault", 24}, {"gw-refund-outage", 4},
	{"kill", 8},
}

// gatewayOps are the gateway calls faults are injected into.
var gatewayOps = []fault.Op{fault.OpCreate, fault.OpRefund, fault.OpQueryRefund, fault.OpQueryPayment, fault.OpClose, fault.OpStatement}

// schedule draws the campaign's faults from its seed: one every 0.7 to
// 2.5 s of the faulty phase.
func schedule(seed int64, dur time.Duration, procs int) []event {
	r := rand.New(rand.NewPCG(uint64(seed), 2))
	total := 0
	for _, k := range faultKinds {
		total += k.w
	}
	ms := func(lo, hi int) time.Duration { return time.Duration(lo+r.IntN(hi-lo+1)) * time.Millisecond }
	var out []event
	for at := ms(500, 1500); at < dur-2*time.Second; at += ms(700, 2500) {
		n := r.IntN(total)
		kind := faultKinds[len(faultKinds)-1].kind
		for _, k := range faultKinds {
			if n < k.w {
				kind = k.kind
				break
			}
			n -= k.w
		}
		ev := event{At: at, Kind: kind, Proc: r.IntN(procs)}
		switch kind {
		case "pg-latency", "redis-latency":
			ev.For, ev.N = ms(1000, 5000), int64(50+r.IntN(700))
		case "pg-reset", "redis-reset":
			ev.For = ms(300, 2000)
		case "pg-stall", "redis-stall":
			// Data stops; the connection closes after N ms, or stays
			// stalled (N = 0) until the toxic goes.
			ev.For, ev.N = ms(1000, 4000), int64([]int{0, 500, 2000}[r.IntN(3)])
		case "kill":
			ev.For = ms(500, 4000)
		case "gw-fault":
			ev.Provider = []string{"alipay", "wechat"}[r.IntN(2)]
			ev.Op = gatewayOps[r.IntN(len(gatewayOps))]
			ev.Fault = []fault.Fault{fault.Timeout, fault.TimeoutAfterEffect, fault.Server5xx, fault.Slow, fault.Business}[r.IntN(5)]
			ev.N = int64(1 + r.IntN(6))
		case "gw-refund-outage":
			// The gateway refuses every refund for a while: refunds walk
			// their backoff to FAILED.
			ev.Provider = []string{"alipay", "wechat"}[r.IntN(2)]
			ev.Op, ev.Fault, ev.For = fault.OpRefund, fault.Business, ms(2000, 6000)
		}
		out = append(out, ev)
	}
	return out
}

// runFaults plays the schedule until the faulty phase ends.
func (c *campaign) runFaults() {
	seq := 0
	for _, ev := range c.sched {
		if !sleepUntil(c.start.Add(ev.At), c.start.Add(c.dur)) {
			return
		}
		seq++
		if c.apply(ev, seq) {
			c.figures.count(c.figures.faults, ev.Kind)
		} else {
			c.note("fault %s skipped: its target was not running, or was the last one running", ev)
		}
	}
}

// sleepUntil sleeps until at; false (at once) if at is past end.
func sleepUntil(at, end time.Time) bool {
	if at.After(end) {
		return false
	}
	time.Sleep(time.Until(at))
	return true
}

// apply injects one fault; false when it could not (its process is down,
// or it is the last one running).
func (c *campaign) apply(ev event, seq int) bool {
	p := c.env.procs[ev.Proc]
	toxic := func(px *toxiproxy.Proxy, typ string, attrs string) bool {
		name := fmt.Sprintf("%s-%d", ev.Kind, seq)
		js := fmt.Sprintf(`{"name": %q, "type": %q, "stream": "downstream", "toxicity": 1, "attributes": {%s}}`, name, typ, attrs)
		if _, err := px.Toxics.AddToxicJson(strings.NewReader(js)); err != nil {
			c.note("toxic %s: %v", name, err)
			return false
		}
		go func() {
			time.Sleep(ev.For)
			px.Toxics.RemoveToxic(context.Background(), name)
		}()
		return true
	}
	switch ev.Kind {
	case "pg-latency":
		return toxic(p.pg, "latency", fmt.Sprintf(`"latency": %d, "jitter": %d`, ev.N, ev.N/4))
	case "redis-latency":
		return toxic(p.redis, "latency", fmt.Sprintf(`"latency": %d, "jitter": %d`, ev.N, ev.N/4))
	case "pg-reset":
		return toxic(p.pg, "reset_peer", `"timeout": 0`)
	case "redis-reset":
		return toxic(p.redis, "reset_peer", `"timeout": 0`)
	case "pg-stall":
		return toxic(p.pg, "timeout", fmt.Sprintf(`"timeout": %d`, ev.N))
	case "redis-stall":
		return toxic(p.redis, "timeout", fmt.Sprintf(`"timeout": %d`, ev.N))
	case "redis-flushall":
		return c.env.rdb.FlushAll(context.Background()).Err() == nil
	case "kill":
		if len(c.env.live()) < 2 || !p.kill() {
			return false
		}
		go func() {
			time.Sleep(ev.For)
			if err := p.startRetrying(30 * time.Second); err != nil {
				c.note("restart of %s after kill -9: %v (started again at the heal)", p.name(), err)
			}
		}()
		return true
	case "gw-fault", "gw-refund-outage":
		inject := c.env.alipay.InjectFault
		if ev.Provider == "wechat" {
			inject = c.env.wechat.InjectFault
		}
		inject(ev.Op, ev.Fault, int(ev.N))
		if ev.N == 0 {
			go func() {
				time.Sleep(ev.For)
				inject(ev.Op, fault.None, 0)
			}()
		}
		return true
	}
	panic("unknown fault " + ev.Kind)
}
