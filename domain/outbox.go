package domain

import (
	"context"
	"encoding/json"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect"

	"kami/domain/money"
)

// The outbox. Every event a seller's systems may hear of is a row of
// events, written by recordEvents inside the very transaction that makes
// the change it reports: committed together, a crash can neither lose an
// event nor invent one. Delivery (webhooks.go) reads the table later and
// never from the request's path.
//
// The payload is the object as the GraphQL API shows it to an admin, with
// the same field names and forms (money as "12.50", times in RFC 3339),
// its related objects by id. It never holds a card code: an endpoint that
// is to receive codes gets them added when its delivery is sent.

// EventType names an event.
type EventType string

const (
	EventOrderPaid     EventType = "order.paid"     // PENDING (or CLOSED, delivering late) → PAID
	EventOrderClosed   EventType = "order.closed"   // PENDING → CLOSED
	EventOrderRefunded EventType = "order.refunded" // REFUNDING → REFUNDED
	EventRefundFailed  EventType = "refund.failed"  // a refund gave up: needs a person
	EventStockLow      EventType = "stock.low"      // a product's sellable cards fell to its threshold
	// EventReconciliationDifference is a difference the statement
	// reconciliation found (settled or for a person); one already reported
	// by an earlier run is not sent again.
	EventReconciliationDifference EventType = "reconciliation.difference"
)

// EventTypes lists every event type.
var EventTypes = []EventType{EventOrderPaid, EventOrderClosed, EventOrderRefunded, EventRefundFailed, EventStockLow, EventReconciliationDifference}

// Event is one row of the outbox.
type Event struct {
	bun.BaseModel `bun:"table:events"`

	ID         int64     `bun:"id,pk,autoincrement"`
	Type       EventType `bun:"type"`
	Subject    string    `bun:"subject"` // the order, refund, product or statement difference it is about
	OccurredAt time.Time `bun:"occurred_at"`
	Payload    string    `bun:"payload"` // JSON: the object
	FannedOut  bool      `bun:"fanned_out"`
}

// outboxOff is set only by the benchmarks (export_test.go), for their
// figure without the outbox: no event is built nor written.
var outboxOff atomic.Bool

// recordEvents writes events into the caller's transaction: with its
// INSERT (eventsInsert) sent among a batch's writes (writeAll), the one
// way an event enters the outbox.
func recordEvents(ctx context.Context, tx bun.IDB, now time.Time, evs ...Event) error {
	if len(evs) == 0 || outboxOff.Load() {
		return nil
	}
	_, err := eventsInsert(tx, nil, now, evs).Exec(ctx)
	return err
}

// bornFannedOut is an event's fanned_out as it is written: true when no
// webhook endpoint is enabled, read by the INSERT itself. The dispatcher
// would find no endpoint to make a delivery for, and would only mark the
// event fanned out: an UPDATE of every event (a new row version, with
// entries in the events' indexes), a tenth of a close's work in the
// database, in a shop that has no webhooks. An endpoint receives the
// events whose INSERT saw it enabled and committed (the statement's
// snapshot, READ COMMITTED): one created or enabled after that statement
// began and before its transaction commits misses that transaction's
// events; an admin's redelivery sends them.
const bornFannedOut = "NOT EXISTS (SELECT 1 FROM webhook_endpoint WHERE deleted_at IS NULL AND enabled = TRUE)"

// eventsInsert is recordEvents' INSERT of at least one event, built and
// not run: the payment batch sends it with its other writes (writeAll).
func eventsInsert(tx bun.IDB, b *binds, now time.Time, evs []Event) writeQuery {
	for i := range evs {
		evs[i].ID, evs[i].OccurredAt, evs[i].FannedOut = 0, now, false
		evs[i].Subject = truncate(evs[i].Subject, 64)
	}
	if (len(evs) > 1 || b != nil) && dialectName(tx) == dialect.PG {
		// A batch's events as one array per column, as flowInsert does;
		// ids are given in the arrays' order. RETURNING 1 as writeAll
		// counts.
		types, subjects, payloads := make([]string, len(evs)), make([]string, len(evs)), make([]string, len(evs))
		for i, e := range evs {
			types[i], subjects[i], payloads[i] = string(e.Type), e.Subject, e.Payload
		}
		return tx.NewRaw(`INSERT INTO events (type, subject, occurred_at, payload, fanned_out)
			SELECT t.type, t.subject, ?, t.payload, `+bornFannedOut+`
			FROM unnest(?::text[], ?::text[], ?::text[]) WITH ORDINALITY AS t(type, subject, payload, n) ORDER BY t.n
			RETURNING 1`,
			b.value(now), b.array(types), b.array(subjects), b.array(payloads))
	}
	return tx.NewInsert().Model(&evs).Value("fanned_out", bornFannedOut).Returning("NULL")
}

// newEvent builds an event about subject with object as its payload.
func newEvent(t EventType, subject string, object any) Event {
	if outboxOff.Load() {
		return Event{}
	}
	if o, ok := object.(OrderObject); ok {
		if b, ok := o.appendJSON(make([]byte, 0, 512)); ok {
			return Event{Type: t, Subject: subject, Payload: string(b)}
		}
	}
	b, err := json.Marshal(object)
	if err != nil {
		// Only plain structs of strings, numbers and times are marshalled.
		panic("outbox: " + err.Error())
	}
	return Event{Type: t, Subject: subject, Payload: string(b)}
}

// OrderObject is an order as an admin sees it in GraphQL.
type OrderObject struct {
	OrderNo    string      `json:"orderNo"`
	Status     OrderStatus `json:"status"`
	ProductID  string      `json:"productId"`
	Quantity   int         `json:"quantity"`
	Amount     string      `json:"amount"`
	Contact    string      `json:"contact"`
	Provider   string      `json:"provider"`
	ExpiresAt  time.Time   `json:"expiresAt"`
	CreatedAt  time.Time   `json:"createdAt"`
	PaidAt     *time.Time  `json:"paidAt"`
	ClosedAt   *time.Time  `json:"closedAt"`
	RefundedAt *time.Time  `json:"refundedAt"`
	TradeNo    *string     `json:"tradeNo"`
	// Cards is set only at delivery, for an endpoint marked to receive
	// codes; never in the outbox.
	Cards []string `json:"cards,omitempty"`
	// CodesWithheld says why an endpoint marked to receive codes got
	// none: the order is no longer PAID ("order is REFUNDED").
	CodesWithheld string `json:"codesWithheld,omitempty"`
}

func orderObject(o *Order) OrderObject {
	return OrderObject{OrderNo: o.OrderNo, Status: o.Status, ProductID: strconv.FormatInt(o.ProductID, 10), Quantity: o.Quantity,
		Amount: money.Format(o.AmountFen), Contact: o.Contact, Provider: o.Provider, ExpiresAt: o.ExpiresAt, CreatedAt: o.CreatedAt,
		PaidAt: timeOrNil(o.PaidAt), ClosedAt: timeOrNil(o.ClosedAt), RefundedAt: timeOrNil(o.RefundedAt), TradeNo: stringOrNil(o.TradeNo)}
}

func orderEvent(t EventType, o *Order) Event { return newEvent(t, o.OrderNo, orderObject(o)) }

// RefundObject is a refund as an admin sees it, with its order.
type RefundObject struct {
	RefundNo    string       `json:"refundNo"`
	Order       OrderObject  `json:"order"`
	Status      RefundStatus `json:"status"`
	Cause       RefundCause  `json:"cause"`
	Amount      string       `json:"amount"`
	Reason      string       `json:"reason"`
	RetryCount  int          `json:"retryCount"`
	LastError   *string      `json:"lastError"`
	NextRetryAt *time.Time   `json:"nextRetryAt"`
	CreatedAt   time.Time    `json:"createdAt"`
}

func refundEvent(t EventType, r *Refund, o *Order) Event {
	return newEvent(t, r.RefundNo, RefundObject{RefundNo: r.RefundNo, Order: orderObject(o), Status: r.Status, Cause: r.Cause,
		Amount: money.Format(r.AmountFen), Reason: r.Reason, RetryCount: r.RetryCount, LastError: stringOrNil(r.LastError),
		NextRetryAt: timeOrNil(r.NextRetryAt), CreatedAt: r.CreatedAt})
}

// StockLowObject is a product whose sellable stock fell to its threshold.
type StockLowObject struct {
	ProductID         string `json:"productId"`
	Name              string `json:"name"`
	Stock             int    `json:"stock"`
	LowStockThreshold int    `json:"lowStockThreshold"`
}

func stockLowEvent(ls LowStock) Event {
	id := strconv.FormatInt(ls.ProductID, 10)
	return newEvent(EventStockLow, id, StockLowObject{ProductID: id, Name: ls.Name, Stock: ls.Sellable, LowStockThreshold: ls.Threshold})
}

// DifferenceObject is a statement difference as an admin sees it.
type DifferenceObject struct {
	ID            string         `json:"id"`
	RunID         string         `json:"runId"`
	Provider      string         `json:"provider"`
	Date          string         `json:"date"`
	Kind          DifferenceKind `json:"kind"`
	OrderNo       *string        `json:"orderNo"`
	TradeNo       *string        `json:"tradeNo"`
	RefundNo      *string        `json:"refundNo"`
	GatewayAmount *string        `json:"gatewayAmount"`
	KamiAmount    *string        `json:"kamiAmount"`
	Action        SettleAction   `json:"action"`
	NeedsPerson   bool           `json:"needsPerson"`
	Detail        string         `json:"detail"`
	CreatedAt     time.Time      `json:"createdAt"`
}

func differenceEvent(d *StatementDifference) Event {
	amount := func(fen int64) *string {
		if fen == 0 {
			return nil
		}
		s := money.Format(fen)
		return &s
	}
	return newEvent(EventReconciliationDifference, truncate(d.Subject, 64), DifferenceObject{
		ID: strconv.FormatInt(d.ID, 10), RunID: strconv.FormatInt(d.RunID, 10), Provider: d.Provider, Date: d.BillDate, Kind: d.Kind,
		OrderNo: stringOrNil(d.OrderNo), TradeNo: stringOrNil(d.TradeNo), RefundNo: stringOrNil(d.RefundNo),
		GatewayAmount: amount(d.GatewayFen), KamiAmount: amount(d.KamiFen), Action: d.Action, NeedsPerson: d.NeedsPerson,
		Detail: d.Detail, CreatedAt: d.CreatedAt})
}

func timeOrNil(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	return &t
}

func stringOrNil(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// differenceEvents are the events of a run's differences: each one, but
// those an earlier run reported already.
func differenceEvents(diffs []StatementDifference) []Event {
	var evs []Event
	for i := range diffs {
		if diffs[i].Action != ActAlreadyReported {
			evs = append(evs, differenceEvent(&diffs[i]))
		}
	}
	return evs
}
