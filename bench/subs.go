package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/coder/websocket"
	"github.com/coder/websocket/wsjson"

	"kami/domain"
)

// SubscriptionsReport is the server's memory with open orderStatusChanged
// subscriptions on pending orders, perConn to a WebSocket
// (graphql-transport-ws), as an admin.
type SubscriptionsReport struct {
	Open           int     `json:"open"`
	Connections    int     `json:"connections"`
	RSSBeforeMiB   float64 `json:"rss_before_mib"`
	RSSOpenMiB     float64 `json:"rss_open_mib"`
	MiBPerThousand float64 `json:"mib_per_1000"`
	// The Go heap and goroutine stacks in use right after a collection
	// the server runs for the asking (when the bench started it): what
	// the subscriptions hold, where VmRSS also moves with when the
	// collector last ran and what the runtime has not yet given back (it
	// varied from -0.05 to 44 MiB per 1,000 between runs).
	HeapBeforeMiB      float64 `json:"heap_before_mib,omitempty"`
	HeapOpenMiB        float64 `json:"heap_open_mib,omitempty"`
	HeapMiBPerThousand float64 `json:"heap_mib_per_1000,omitempty"`
}

type wsMessage struct {
	ID      string         `json:"id,omitempty"`
	Type    string         `json:"type"`
	Payload map[string]any `json:"payload,omitempty"`
}

// openSubscriptions subscribes to each order, perConn subscriptions to a
// WebSocket, and waits for each one's first event (the order's current
// status). The returned func closes every connection.
func openSubscriptions(ctx context.Context, base, adminToken string, orderNos []string, perConn int) (func(), int, error) {
	var conns []*websocket.Conn
	closeAll := func() {
		for _, c := range conns {
			c.Close(websocket.StatusNormalClosure, "")
		}
	}
	wsURL := "ws" + strings.TrimPrefix(base, "http") + "/graphql"
	const query = `subscription($n: String!) { orderStatusChanged(orderNo: $n) { status } }`
	for start := 0; start < len(orderNos); start += perConn {
		c, _, err := websocket.Dial(ctx, wsURL, &websocket.DialOptions{Subprotocols: []string{"graphql-transport-ws"}})
		if err != nil {
			closeAll()
			return nil, 0, err
		}
		conns = append(conns, c)
		if err := wsjson.Write(ctx, c, wsMessage{Type: "connection_init", Payload: map[string]any{"Authorization": "Bearer " + adminToken}}); err != nil {
			closeAll()
			return nil, 0, err
		}
		part := orderNos[start:min(start+perConn, len(orderNos))]
		for i, no := range part {
			sub := wsMessage{ID: fmt.Sprint(i), Type: "subscribe", Payload: map[string]any{"query": query, "variables": map[string]any{"n": no}}}
			if err := wsjson.Write(ctx, c, sub); err != nil {
				closeAll()
				return nil, 0, err
			}
		}
		for first := 0; first < len(part); {
			var m wsMessage
			rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			err := wsjson.Read(rctx, c, &m)
			cancel()
			if err != nil {
				closeAll()
				return nil, 0, fmt.Errorf("reading the subscriptions' first events: %w", err)
			}
			switch m.Type {
			case "next":
				first++
			case "error", "complete":
				closeAll()
				return nil, 0, fmt.Errorf("subscription %s: %s %v", m.ID, m.Type, m.Payload)
			case "ping":
				wsjson.Write(ctx, c, wsMessage{Type: "pong"})
			}
		}
		// From here on, only keep-alives arrive: answer them.
		go func() {
			for {
				var m wsMessage
				if err := wsjson.Read(context.Background(), c, &m); err != nil {
					return
				}
				if m.Type == "ping" {
					wsjson.Write(context.Background(), c, wsMessage{Type: "pong"})
				}
			}
		}()
	}
	return closeAll, len(conns), nil
}

// measureSubscriptions places n orders directly through ledger (whose
// orders stay pending long enough) from conc workers, opens a subscription
// on each, 20 to a connection (the default per-connection cap), and
// reports the server's resident memory before and with them. With prof,
// the server's heap is saved while they are open.
func measureSubscriptions(ctx context.Context, ledger *domain.Ledger, base, adminToken, runID string, n, conc, pid int, pprofBase string, prof *profiler) (*SubscriptionsReport, error) {
	d, _, err := runDirect(ctx, ledger, runID, n, conc, cpuProbe{}, nil, false)
	if err != nil {
		return nil, err
	}
	if d.OK != n {
		return nil, fmt.Errorf("placed %d of %d orders to subscribe to: %v", d.OK, n, d.Errors)
	}
	var orderNos []string
	if err := ledger.DB().NewSelect().Table("orders").Column("order_no").
		Where("product_id = (SELECT id FROM products WHERE name = ?)", "bench-direct-"+runID).Where("status = ?", domain.OrderPending).
		OrderExpr("order_no").Limit(int64(n)).Scan(ctx, &orderNos); err != nil {
		return nil, err
	}
	rep := &SubscriptionsReport{}
	var heapBefore, heapOpen uint64
	if pprofBase != "" {
		if heapBefore, err = heapAfterGC(ctx, pprofBase); err != nil {
			return nil, err
		}
	}
	before, err := procStatusKiB(pid, "VmRSS")
	if err != nil {
		return nil, err
	}
	closeAll, conns, err := openSubscriptions(ctx, base, adminToken, orderNos, 20)
	if err != nil {
		return nil, err
	}
	defer closeAll()
	after, err := procStatusKiB(pid, "VmRSS")
	if err != nil {
		return nil, err
	}
	if pprofBase != "" {
		if heapOpen, err = heapAfterGC(ctx, pprofBase); err != nil {
			return nil, err
		}
		rep.HeapBeforeMiB, rep.HeapOpenMiB = float64(heapBefore)/(1<<20), float64(heapOpen)/(1<<20)
		rep.HeapMiBPerThousand = (rep.HeapOpenMiB - rep.HeapBeforeMiB) / float64(max(1, len(orderNos))) * 1000
	}
	if prof != nil {
		if err := prof.fetch(ctx, "heap", "heap-subscriptions.pprof"); err != nil {
			return nil, err
		}
	}
	rep.Open, rep.Connections = len(orderNos), conns
	rep.RSSBeforeMiB, rep.RSSOpenMiB = float64(before)/1024, float64(after)/1024
	rep.MiBPerThousand = (rep.RSSOpenMiB - rep.RSSBeforeMiB) / float64(max(1, rep.Open)) * 1000
	return rep, nil
}

// heapAfterGC is the server's Go memory in use, its heap (HeapAlloc) and
// its goroutines' stacks (StackInuse: a subscription's goroutines are a
// good part of what it holds), right after a collection:
// /debug/pprof/heap?gc=1 runs one before it writes the profile, and with
// debug=1 the runtime's memory statistics, read after it, end the text.
func heapAfterGC(ctx context.Context, pprofBase string) (uint64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, pprofBase+"/debug/pprof/heap?gc=1&debug=1", nil)
	if err != nil {
		return 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return 0, err
	}
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("heap profile: HTTP %d", resp.StatusCode)
	}
	return goMemoryOf(string(body))
}

// goMemoryOf reads "# HeapAlloc = <bytes>" and "# Stack = <in use> /
// <from the system>" from a heap profile's text, and adds the two.
func goMemoryOf(text string) (uint64, error) {
	var heap, stack string
	for _, line := range strings.Split(text, "\n") {
		if v, ok := strings.CutPrefix(line, "# HeapAlloc = "); ok {
			heap = strings.TrimSpace(v)
		}
		if v, ok := strings.CutPrefix(line, "# Stack = "); ok {
			stack, _, _ = strings.Cut(v, " /")
		}
	}
	h, err := strconv.ParseUint(heap, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("heap profile: HeapAlloc %q: %w", heap, err)
	}
	st, err := strconv.ParseUint(strings.TrimSpace(stack), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("heap profile: Stack %q: %w", stack, err)
	}
	return h + st, nil
}
