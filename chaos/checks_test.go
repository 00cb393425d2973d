package chaos

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"

	"kami/queue"
)

// The checks, once everything healed, a sweep and the reconciliation ran
// and the refunds settled. Against the gateways' own books:
//
//   - every trade a gateway holds as paid is exactly one of: delivered (its
//     order PAID with that trade and amount, its cards SOLD to it alone),
//     refunded at the gateway for its full amount (and SUCCEEDED in kami),
//     or a refund FAILED in kami with its alert raised;
//   - no gateway refund without a paid trade or unknown to kami; no trade
//     refunded twice; kami never delivered on a trade the gateway does not
//     hold as paid;
//
// and in the ledger:
//
//   - a delivered order holds exactly its quantity of SOLD cards, any other
//     none; no card is LOCKED without a PENDING order; each code a buyer is
//     shown belongs to one order only;
//   - every stock counter in Redis equals the database's sellable count;
//   - `kami audit` is clean;
//
// and, checked earlier: no order PENDING past its time plus one sweep
// (checkNothingPending), none closed before the time its buyer was told
// (watchCloses), every notification acknowledged in the end (notify).

// checkAcknowledged runs after one sweep, before the reconciliation: a
// payment whose notification kami acknowledged has been acted on, the
// order delivered or a refund recorded, without waiting for the
// statements. Paid trades kami was never told of (dropped notifications)
// may be left to the reconciliation; they are counted.
func (c *campaign) checkAcknowledged() {
	orders, refunds, ok := c.readLedger(context.Background())
	if !ok {
		return
	}
	has := map[string]bool{} // provider/trade with a refund row
	for _, r := range refunds {
		has[r.provider+"/"+r.tradeNo] = true
	}
	actedOn := func(prov, orderNo, trade string) bool {
		o := orders[orderNo]
		return has[prov+"/"+trade] || (o != nil && o.tradeNo == trade && o.status != "PENDING" && o.status != "CLOSED")
	}
	for _, tr := range c.paidTrades(refunds) {
		c.mu.Lock()
		o := c.orders[tr.orderNo]
		c.mu.Unlock()
		acked := false
		if tr.provider == "sandbox" {
			c.mu.Lock()
			for _, sp := range c.sandbox {
				if sp.tradeNo == tr.tradeNo {
					acked = sp.acked.Load()
				}
			}
			c.mu.Unlock()
		} else if o != nil {
			o.mu.Lock()
			acked = o.acked
			o.mu.Unlock()
		}
		if actedOn(tr.provider, tr.orderNo, tr.tradeNo) {
			continue
		}
		st := "missing"
		if d := orders[tr.orderNo]; d != nil {
			st = d.status
		}
		if acked {
			c.violation("before the reconciliation: kami acknowledged the payment of %s trade %s (order %s, %d fen), yet the order is %s and no refund exists",
				tr.provider, tr.tradeNo, tr.orderNo, tr.fen, st)
		} else {
			c.figures.leftToStatements++
			c.note("before the reconciliation: %s trade %s (order %s, %s), whose notification was never delivered, is not acted on yet", tr.provider, tr.tradeNo, tr.orderNo, st)
		}
	}
}

// paidTrade is one trade a gateway holds as paid.
type paidTrade struct {
	provider, orderNo, tradeNo string
	fen                        int64
	refunds                    []gwRefund // at the gateway
}

type gwRefund struct {
	refundNo string
	fen      int64
}

type dbOrder struct {
	no, provider, status, tradeNo string
	qty                           int
	amountFen, paidFen            int64
	delivered                     bool
	sold, locked                  int
}

type dbRefund struct {
	no, orderNo, provider, tradeNo, cause, status string
	fen                                           int64
}

func (c *campaign) check() {
	ctx := context.Background()
	orders, refunds, ok := c.readLedger(ctx)
	if !ok {
		return
	}
	refundByNo := map[string]*dbRefund{}
	refundsOfTrade := map[string][]*dbRefund{} // provider/trade → refunds
	for _, r := range refunds {
		refundByNo[r.no] = r
		refundsOfTrade[r.provider+"/"+r.tradeNo] = append(refundsOfTrade[r.provider+"/"+r.tradeNo], r)
	}

	trades := c.paidTrades(refunds)
	tradeByNo := map[string]*paidTrade{}
	for _, tr := range trades {
		tradeByNo[tr.provider+"/"+tr.tradeNo] = tr
		c.figures.trades++
		c.figures.tradesFen += tr.fen
		c.checkTrade(tr, orders[tr.orderNo], refundsOfTrade[tr.provider+"/"+tr.tradeNo])
	}

	// kami never delivers, nor refunds, a payment the gateway does not
	// hold.
	for _, o := range orders {
		if o.tradeNo == "" {
			continue
		}
		tr := tradeByNo[o.provider+"/"+o.tradeNo]
		switch {
		case tr == nil:
			c.violation("order %s is %s with %s trade %s, which the gateway does not hold as paid", o.no, o.status, o.provider, o.tradeNo)
		case tr.orderNo != o.no || tr.fen != o.paidFen:
			c.violation("order %s records trade %s for %d fen; the gateway has it for order %s, %d fen", o.no, o.tradeNo, o.paidFen, tr.orderNo, tr.fen)
		}
	}
	for _, r := range refunds {
		if r.status == "SUCCEEDED" && tradeByNo[r.provider+"/"+r.tradeNo] == nil {
			c.violation("refund %s (%s) SUCCEEDED in kami for %s trade %s, which the gateway does not hold as paid", r.no, r.cause, r.provider, r.tradeNo)
		}
	}
	c.checkGatewayRefunds(refundByNo)
	c.checkCards(ctx, orders)
	c.checkCodes(orders)
	c.checkCounters(ctx, "after the reconciliation")
	if out, err := c.env.kami("audit"); err != nil {
		c.violation("kami audit: %v:\n%s", err, strings.TrimSpace(out))
	}
}

// bookTrade and bookRefund are a gateway's records, the same for both
// gateways.
type bookTrade struct {
	provider, orderNo, tradeNo string
	fen                        int64
	paid                       bool
}

type bookRefund struct {
	provider, refundNo, orderNo string
	fen                         int64
	held                        bool // the money left (WeChat: SUCCESS or PROCESSING)
}

// books reads the Alipay and WeChat emulators' books.
func (c *campaign) books() ([]bookTrade, []bookRefund) {
	var trades []bookTrade
	var refunds []bookRefund
	ab := c.env.alipay.Book()
	for _, t := range ab.Trades {
		trades = append(trades, bookTrade{"alipay", t.OutTradeNo, t.TradeNo, t.TotalFen, t.Paid()})
	}
	for _, r := range ab.Refunds {
		refunds = append(refunds, bookRefund{"alipay", r.OutRequestNo, r.OutTradeNo, r.Fen, true})
	}
	wb := c.env.wechat.Book()
	for _, t := range wb.Trades {
		trades = append(trades, bookTrade{"wechat", t.OutTradeNo, t.TransactionID, t.TotalFen, t.Paid()})
	}
	for _, r := range wb.Refunds {
		refunds = append(refunds, bookRefund{"wechat", r.OutRefundNo, r.OutTradeNo, r.Fen, r.Status == "SUCCESS" || r.Status == "PROCESSING"})
	}
	return trades, refunds
}

// paidTrades collects the paid trades of the Alipay and WeChat books and
// the campaign's sandbox book. The sandbox's refunds are kami's SUCCEEDED
// refunds of its trades: the sandbox refunds on trust, in the process that
// asked, and forgets on restart.
func (c *campaign) paidTrades(refunds []*dbRefund) []*paidTrade {
	var out []*paidTrade
	byOrder := map[string]*paidTrade{}
	trades, gwRefunds := c.books()
	for _, t := range trades {
		if t.paid {
			tr := &paidTrade{provider: t.provider, orderNo: t.orderNo, tradeNo: t.tradeNo, fen: t.fen}
			byOrder[t.provider+"/"+t.orderNo] = tr
			out = append(out, tr)
		}
	}
	for _, r := range gwRefunds {
		if tr := byOrder[r.provider+"/"+r.orderNo]; tr != nil && r.held {
			tr.refunds = append(tr.refunds, gwRefund{r.refundNo, r.fen})
		}
	}
	c.mu.Lock()
	sb := append([]*sandboxPayment(nil), c.sandbox...)
	c.mu.Unlock()
	sbTrades := map[string]*paidTrade{}
	for _, p := range sb {
		tr := &paidTrade{provider: "sandbox", orderNo: p.orderNo, tradeNo: p.tradeNo, fen: p.fen}
		sbTrades[p.tradeNo] = tr
		out = append(out, tr)
	}
	for _, r := range refunds {
		if tr := sbTrades[r.tradeNo]; tr != nil && r.provider == "sandbox" && r.status == "SUCCEEDED" {
			tr.refunds = append(tr.refunds, gwRefund{r.no, r.fen})
		}
	}
	return out
}

// checkTrade: a paid trade is delivered, refunded in full, or its refund
// FAILED with an alert; exactly one.
func (c *campaign) checkTrade(tr *paidTrade, o *dbOrder, refunds []*dbRefund) {
	what := fmt.Sprintf("%s trade %s (order %s, %d fen)", tr.provider, tr.tradeNo, tr.orderNo, tr.fen)
	if len(tr.refunds) > 1 {
		c.violation("%s refunded %d times at the gateway: %v", what, len(tr.refunds), tr.refunds)
	}
	var refunded int64
	for _, r := range tr.refunds {
		refunded += r.fen
	}
	if o == nil {
		c.violation("%s: kami has no such order", what)
		return
	}
	delivered := o.status == "PAID" && o.tradeNo == tr.tradeNo && o.paidFen == tr.fen && o.sold == o.qty
	switch {
	case refunded == tr.fen:
		c.figures.refunded++
		for _, g := range tr.refunds {
			var mine *dbRefund
			for _, r := range refunds {
				if r.no == g.refundNo {
					mine = r
				}
			}
			if mine == nil || mine.status != "SUCCEEDED" {
				st := "no refund row"
				if mine != nil {
					st = "refund " + mine.no + " " + mine.status
				}
				c.violation("%s was refunded at the gateway (%s), but kami has %s", what, g.refundNo, st)
			}
		}
		if o.status == "PAID" && o.tradeNo == tr.tradeNo {
			c.violation("%s was refunded at the gateway, and its order is still PAID", what)
		}
	case refunded > 0:
		c.violation("%s refunded only %d fen of %d at the gateway", what, refunded, tr.fen)
	case delivered:
		c.figures.delivered++
	default:
		for _, r := range refunds {
			if r.status == "FAILED" && r.orderNo == tr.orderNo {
				if c.env.alerts.has("refund_failed", r.no, r.orderNo) {
					c.figures.failedAlerted++
				} else {
					c.violation("%s: its refund %s FAILED and no refund_failed alert was raised", what, r.no)
				}
				return
			}
		}
		var rs []string
		for _, r := range refunds {
			rs = append(rs, fmt.Sprintf("%s %s %s %d fen", r.no, r.cause, r.status, r.fen))
		}
		c.violation("%s is neither delivered nor refunded: order %s, trade %q, paid %d fen, %d/%d cards SOLD, refunds of the trade %v",
			what, o.status, o.tradeNo, o.paidFen, o.sold, o.qty, rs)
	}
}

// checkGatewayRefunds: every refund at a gateway is of a paid trade, and
// kami knows it (kami made it).
func (c *campaign) checkGatewayRefunds(refundByNo map[string]*dbRefund) {
	trades, refunds := c.books()
	paid := map[string]bool{}
	for _, t := range trades {
		paid[t.provider+"/"+t.orderNo] = t.paid
	}
	for _, r := range refunds {
		c.figures.gwRefunds++
		c.figures.gwRefundsFen += r.fen
		if !paid[r.provider+"/"+r.orderNo] {
			c.violation("%s refund %s of order %s, whose trade was never paid", r.provider, r.refundNo, r.orderNo)
		}
		if refundByNo[r.refundNo] == nil {
			c.violation("%s refund %s of order %s (%d fen), which kami never made", r.provider, r.refundNo, r.orderNo, r.fen)
		}
	}
}

// checkCards: a delivered order holds exactly its quantity of SOLD cards
// and any other none; no card is LOCKED without a PENDING order.
func (c *campaign) checkCards(ctx context.Context, orders map[string]*dbOrder) {
	for _, o := range orders {
		want := 0
		if o.delivered {
			want = o.qty
		}
		if o.sold != want {
			c.violation("order %s (%s, delivered %v) holds %d SOLD cards, want %d", o.no, o.status, o.delivered, o.sold, want)
		}
	}
	rows, err := c.env.db.QueryContext(ctx, `SELECT c.id, COALESCE(c.order_no, ''), COALESCE(o.status, '')
		FROM card_stock c LEFT JOIN orders o ON o.order_no = c.order_no
		WHERE c.status = 'LOCKED' AND (o.status IS NULL OR o.status <> 'PENDING')`)
	if err != nil {
		c.violation("read LOCKED cards: %v", err)
		return
	}
	defer rows.Close()
	for rows.Next() {
		var id int64
		var no, st string
		rows.Scan(&id, &no, &st)
		c.violation("card %d is LOCKED by order %q, which is %q", id, no, st)
	}
}

// checkCodes asks, as each buyer of a PAID order, for its codes: each
// buyer sees its quantity, and no code is shown in two orders.
func (c *campaign) checkCodes(orders map[string]*dbOrder) {
	c.mu.Lock()
	var mine []*order
	for no, o := range c.orders {
		if d := orders[no]; d != nil && d.status == "PAID" {
			mine = append(mine, o)
		}
	}
	c.mu.Unlock()
	var mu sync.Mutex
	seen := map[string]string{} // code → order
	work := make(chan *order)
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for o := range work {
				var out struct {
					Order *struct{ Cards []string } `json:"order"`
				}
				p := c.pick(nil)
				if p == nil {
					c.violation("no process runs to show order %s its codes", o.no)
					continue
				}
				if code, err := c.gql(p, false, `query($o: String!, $t: String) { order(orderNo: $o, accessToken: $t) { cards } }`,
					map[string]any{"o": o.no, "t": o.token}, &out); code != "" || out.Order == nil {
					c.violation("the buyer of PAID order %s cannot see it: %v", o.no, err)
					continue
				}
				mu.Lock()
				c.figures.buyersOK++
				c.figures.deliveredCodes += len(out.Order.Cards)
				if len(out.Order.Cards) != o.qty {
					c.violation("the buyer of PAID order %s sees %d codes, want %d", o.no, len(out.Order.Cards), o.qty)
				}
				for _, code := range out.Order.Cards {
					if other, dup := seen[code]; dup {
						c.violation("a code is shown to the buyers of two orders, %s and %s", other, o.no)
					}
					seen[code] = o.no
				}
				mu.Unlock()
			}
		}()
	}
	for _, o := range mine {
		work <- o
	}
	close(work)
	wg.Wait()
}

// checkCounters: every stock counter equals the database's sellable count
// (UNSOLD and RECYCLED cards). A missing counter is rebuilt on its next
// use, so it is noted, not counted wrong.
//
// It runs twice: after one sweep, before the reconciliation (which sets
// every counter from the database, and would hide a sweep that did not
// repair one), and at the end.
func (c *campaign) checkCounters(ctx context.Context, stage string) {
	keys := queue.NewKeys(c.env.prefix)
	for _, p := range c.products {
		id, _ := strconv.ParseInt(p.id, 10, 64)
		var sellable int64
		if err := c.env.db.QueryRowContext(ctx, `SELECT COUNT(*) FROM card_stock WHERE product_id = $1 AND status IN ('UNSOLD', 'RECYCLED')`, id).Scan(&sellable); err != nil {
			c.violation("count product %d's cards: %v", id, err)
			continue
		}
		v, err := c.env.rdb.Get(ctx, keys.Stock(id)).Int64()
		switch {
		case err == redis.Nil:
			c.note("%s, product %d's stock counter is missing (rebuilt on its next order); the database has %d sellable", stage, id, sellable)
		case err != nil:
			c.violation("%s, read product %d's stock counter: %v", stage, id, err)
		case v != sellable:
			c.violation("%s, product %d's stock counter says %d, the database has %d sellable cards", stage, id, v, sellable)
		default:
			c.figures.counters++
		}
	}
}

// readLedger reads the orders and the refunds; a failure is a violation
// (the database answers once everything healed).
func (c *campaign) readLedger(ctx context.Context) (map[string]*dbOrder, []*dbRefund, bool) {
	orders, err := c.readOrders(ctx)
	if err != nil {
		c.violation("read the orders: %v", err)
		return nil, nil, false
	}
	refunds, err := c.readRefunds(ctx)
	if err != nil {
		c.violation("read the refunds: %v", err)
		return nil, nil, false
	}
	return orders, refunds, true
}

func (c *campaign) readOrders(ctx context.Context) (map[string]*dbOrder, error) {
	rows, err := c.env.db.QueryContext(ctx, `SELECT order_no, provider, status, COALESCE(trade_no, ''), quantity, amount_fen, paid_fen, delivered_at IS NOT NULL FROM orders`)
	if err != nil {
		return nil, err
	}
	out := map[string]*dbOrder{}
	for rows.Next() {
		o := &dbOrder{}
		if err := rows.Scan(&o.no, &o.provider, &o.status, &o.tradeNo, &o.qty, &o.amountFen, &o.paidFen, &o.delivered); err != nil {
			rows.Close()
			return nil, err
		}
		out[o.no] = o
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, err
	}
	cards, err := c.env.db.QueryContext(ctx, `SELECT order_no, status, COUNT(*) FROM card_stock WHERE order_no IS NOT NULL GROUP BY order_no, status`)
	if err != nil {
		return nil, err
	}
	defer cards.Close()
	for cards.Next() {
		var no, st string
		var n int
		if err := cards.Scan(&no, &st, &n); err != nil {
			return nil, err
		}
		if o := out[no]; o != nil {
			switch st {
			case "SOLD":
				o.sold += n
			case "LOCKED":
				o.locked += n
			}
		}
	}
	return out, cards.Err()
}

func (c *campaign) readRefunds(ctx context.Context) ([]*dbRefund, error) {
	rows, err := c.env.db.QueryContext(ctx, `SELECT refund_no, order_no, provider, trade_no, cause, status, amount_fen FROM refund_order`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []*dbRefund
	for rows.Next() {
		r := &dbRefund{}
		var trade sql.NullString
		if err := rows.Scan(&r.no, &r.orderNo, &r.provider, &trade, &r.cause, &r.status, &r.fen); err != nil {
			return nil, err
		}
		r.tradeNo = trade.String
		out = append(out, r)
	}
	return out, rows.Err()
}
