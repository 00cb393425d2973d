package main

import (
	"context"
	"fmt"
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
func measureSubscriptions(ctx context.Context, ledger *domain.Ledger, base, adminToken, runID string, n, conc, pid int, prof *profiler) (*SubscriptionsReport, error) {
	d, _, err := runDirect(ctx, ledger, runID, n, conc, cpuProbe{}, nil)
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
