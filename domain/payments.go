package domain

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/uptrace/bun"

	"kami/domain/money"
)

// Payment is a verified payment notification, as the provider reported it.
type Payment struct {
	Provider  string
	NotifyID  string // the provider's notification id; "" falls back to the trade number
	OrderNo   string
	TradeNo   string
	AmountFen int64
	PaidAt    time.Time
	Raw       string // the notification body, kept for disputes
}

// PaymentOutcome is what a payment did.
type PaymentOutcome string

const (
	PaymentDelivered        PaymentOutcome = "DELIVERED"         // PENDING → PAID, cards SOLD
	PaymentDuplicate        PaymentOutcome = "DUPLICATE"         // seen before: nothing changed
	PaymentLateRefund       PaymentOutcome = "LATE_REFUND"       // CLOSED → REFUNDING, refund created
	PaymentLateDelivered    PaymentOutcome = "LATE_DELIVERED"    // CLOSED → PAID with its own cards (KAMI_LATE_PAYMENT=deliver)
	PaymentDuplicateRefunds PaymentOutcome = "DUPLICATE_REFUNDS" // a second trade for a paid order: refunded
)

// PaymentResult reports RecordPayment.
type PaymentResult struct {
	Outcome PaymentOutcome
	Order   *Order
	// Refund is the refund this payment created, if any: the caller
	// schedules it.
	Refund *Refund
	// Mail is the mail of the order's codes this payment queued, if any:
	// the caller schedules it.
	Mail *MailSend
}

// maxOrderNoLen is the order_no column's width.
const maxOrderNoLen = 32

// checkOrderNo refuses an order number that no order can have (empty, or
// longer than the column) before any statement runs: a client's 10 KB
// "order number" costs neither a query nor an echo in the error.
func checkOrderNo(orderNo string) error {
	switch {
	case orderNo == "":
		return Errorf(EBADINPUT, "give an order number")
	case len(orderNo) > maxOrderNoLen:
		return Errorf(EBADINPUT, "an order number has at most %d characters; this one has %d", maxOrderNoLen, len(orderNo))
	}
	return nil
}

// maxRawNotification bounds what is kept of a notification body.
const maxRawNotification = 64 << 10

// RecordPayment applies a verified payment to its order, once:
//   - PENDING: → PAID, its cards LOCKED → SOLD (delivered);
//   - already paid with this trade, or the notification seen before: nothing;
//   - CLOSED: a late payment, refunded (or, with KAMI_LATE_PAYMENT=deliver,
//     delivered if the order's own cards are still free);
//   - paid with another trade: the second payment is refunded.
//
// NOT_FOUND (unknown order), BAD_INPUT (amount or provider does not match:
// nothing is recorded and an alert is raised).
//
// Payments that arrive together are recorded together (see group.Batcher
// and recordPayments); each gets its own outcome.
func (l *Ledger) RecordPayment(ctx context.Context, p Payment) (*PaymentResult, error) {
	if p.OrderNo == "" || p.TradeNo == "" || len(p.TradeNo) > 64 || p.Provider == "" {
		return nil, Errorf(EBADINPUT, "a payment needs an order number, a trade number and a provider")
	}
	if len(p.OrderNo) > maxOrderNoLen {
		// Not echoed: no order has a number this long.
		return nil, Errorf(ENOTFOUND, "no order has a %d-character number", len(p.OrderNo))
	}
	return l.payer.Do(ctx, p)
}

// recordPayments records a batch of payments. The usual payment, for an
// order that is still PENDING, is delivered together with the others like
// it in one transaction of a fixed number of statements. Every other
// payment (late, repeated, second trade), and every usual one should that
// transaction fail for any reason, is recorded alone by recordOne, which
// decides each case; the shared transaction only ever does what recordOne
// would have done for each of its payments.
func (l *Ledger) recordPayments(ctx context.Context, ps []Payment) ([]*PaymentResult, []error) {
	results, errs := make([]*PaymentResult, len(ps)), make([]error, len(ps))
	nos := make([]string, len(ps))
	for i, p := range ps {
		nos[i] = p.OrderNo
	}
	orders, err := l.OrdersByNo(ctx, uniqueSorted(nos))
	if err != nil {
		for i := range errs {
			errs[i] = err
		}
		return results, errs
	}

	var usual, others []int
	inBatch := map[string]bool{}
	for i, p := range ps {
		o, ok := orders[p.OrderNo]
		if !ok {
			errs[i] = Errorf(ENOTFOUND, "order %s not found", p.OrderNo)
			continue
		}
		if alert, refusal := checkPayment(p, *o); refusal != nil {
			results[i], errs[i] = l.refusePayment(ctx, p, o, alert, refusal)
			continue
		}
		if o.Status == OrderPending && !inBatch[p.OrderNo] {
			inBatch[p.OrderNo] = true
			usual = append(usual, i)
		} else {
			others = append(others, i) // after the batch: a repeat then finds its order paid
		}
	}
	if len(usual) > 0 {
		l.pays.batches.Add(1)
		l.pays.calls.Add(int64(len(usual)))
		err := inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
			return l.deliverPaid(ctx, tx, ps, usual, orders, results)
		})
		if err != nil {
			l.pays.split.Add(1)
			for _, i := range usual {
				// Only the shared transaction's answers: a refusal
				// answered above keeps its own.
				results[i] = nil
			}
			others = append(usual, others...)
		}
	}
	for _, i := range others {
		results[i], errs[i] = l.recordOne(ctx, ps[i], *orders[ps[i].OrderNo])
	}
	return results, errs
}

// checkPayment finds a payment that does not match its order: the money
// or the provider is not what the order asked for. It returns the alert to
// raise and the refusal, or nils.
func checkPayment(p Payment, o Order) (*Alert, error) {
	if o.Provider != p.Provider {
		return &Alert{Kind: "provider_mismatch", Subject: p.OrderNo,
				Message: fmt.Sprintf("payment through %s for an order placed with %s", p.Provider, o.Provider)},
			Errorf(EBADINPUT, "order %s is not paid through %s", p.OrderNo, p.Provider)
	}
	if p.AmountFen != o.AmountFen {
		return &Alert{Kind: "amount_mismatch", Subject: p.OrderNo,
				Message: fmt.Sprintf("%s reported %s paid for an order of %s (trade %s)", p.Provider, money.Format(p.AmountFen), money.Format(o.AmountFen), p.TradeNo)},
			Errorf(EBADINPUT, "amount %s does not match order %s", money.Format(p.AmountFen), p.OrderNo)
	}
	return nil, nil
}

// refusePayment records a signed notification that does not match its
// order as refused (result REFUSED), so that it is refused and alerted
// once: the gateway is told no the first time, and its redeliveries of the
// same notification are acknowledged as seen before, without another
// alert. It is never delivered; the person the alert reaches decides.
func (l *Ledger) refusePayment(ctx context.Context, p Payment, o *Order, alert *Alert, refusal error) (*PaymentResult, error) {
	note := paymentNotification(p, l.now())
	note.Result = "REFUSED"
	err := inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
		return recordNotification(ctx, tx, note.ReceivedAt, note)
	})
	switch {
	case errors.Is(err, errSeenBefore):
		return &PaymentResult{Outcome: PaymentDuplicate, Order: o}, nil
	case err != nil:
		return nil, err // not recorded: the redelivery tries again
	}
	l.alerts.Alert(ctx, *alert)
	return nil, refusal
}

// errNotUsual rolls back a shared delivery that met something unusual (an
// order no longer PENDING, cards not where they should be): its payments
// are then recorded one by one, and each finds its own outcome.
var errNotUsual = errors.New("a payment of the batch is not the usual case")

// deliverPaid records the payments ps[at...] of orders read as PENDING, as
// recordPayment's usual case does for one: the notifications, the orders
// PENDING → PAID and their cards LOCKED → SOLD, the journal. The orders'
// rows are locked in order_no order (transitionLocked), as the
// close path locks them.
func (l *Ledger) deliverPaid(ctx context.Context, tx bun.Tx, ps []Payment, at []int, orders map[string]*Order, results []*PaymentResult) error {
	now := l.now()
	var (
		notes  = make([]Notification, 0, len(at))
		nos    = make([]string, 0, len(at))
		flows  = make([]StockFlow, 0, len(at))
		cards  int64
		trade  = make([]any, 0, 2*len(at)) // CASE arms: order number, then its value
		fen    = make([]any, 0, 2*len(at))
		t      = make([]any, 0, 2*len(at))
		paid   = make([]*Order, 0, len(at))
		events = make([]Event, 0, len(at))
	)
	for _, i := range at {
		p, o := ps[i], *orders[ps[i].OrderNo]
		notes = append(notes, paymentNotification(p, now))
		nos = append(nos, p.OrderNo)
		flows = append(flows, StockFlow{ProductID: o.ProductID, OrderNo: o.OrderNo, ChangeType: FlowSell, Quantity: o.Quantity})
		cards += int64(o.Quantity)
		trade = append(trade, p.OrderNo, p.TradeNo)
		fen = append(fen, p.OrderNo, p.AmountFen)
		t = append(t, p.OrderNo, paidAt(p, now))
		o.Status, o.TradeNo, o.PaidFen, o.PaidAt, o.DeliveredAt, o.UpdatedAt = OrderPaid, p.TradeNo, p.AmountFen, paidAt(p, now), now, now
		paid = append(paid, &o)
		events = append(events, orderEvent(EventOrderPaid, &o))
	}
	byOrderNo := func(column, param string) string {
		return column + " = CASE order_no" + strings.Repeat(" WHEN ? THEN "+param, len(at)) + " END"
	}
	// One round trip on PostgreSQL (writeAll); the counts are checked
	// before the COMMIT, so a batch that met anything unusual is rolled
	// back whole.
	writes := []writeQuery{
		tx.NewInsert().Model(&notes),
		transitionLocked(tx, nil, OrderPay, now, byOrderNos(nos), nil, []column{
			col(byOrderNo("trade_no", "?"), trade...), col(byOrderNo("paid_fen", "?"), fen...), col(byOrderNo("paid_at", timeParam(tx)), t...),
			col("delivered_at = ?", now)}),
		transitionLocked(tx, nil, CardSell, now, byOrderNos(nos), nil, []column{col("sold_at = ?", now)}),
		flowInsert(tx, nil, now, flows),
		leavePending(tx, nil, nos),
	}
	if !outboxOff.Load() {
		writes = append(writes, eventsInsert(tx, nil, now, events))
	}
	n, err := writeAll(ctx, tx, writes...)
	if err != nil {
		if isUniqueViolation(err) {
			return errNotUsual // a notification seen before (nothing else written here is unique)
		}
		return err
	}
	if n[1] != int64(len(at)) {
		return errNotUsual // an order closed (or paid) since it was read
	}
	if n[2] != cards {
		return errNotUsual // recordOne finds which order, and says INCONSISTENT
	}
	for k, i := range at {
		results[i] = &PaymentResult{Outcome: PaymentDelivered, Order: paid[k]}
	}
	mails, err := l.queueOrderMails(ctx, tx, now, paid...)
	if err != nil {
		return err
	}
	for _, i := range at {
		results[i].Mail = mails[ps[i].OrderNo]
	}
	return nil
}

// paidAt is when the provider says p was paid, as the database keeps it;
// now when it does not say.
func paidAt(p Payment, now time.Time) time.Time {
	if p.PaidAt.IsZero() {
		return now
	}
	return p.PaidAt.UTC().Truncate(time.Microsecond)
}

// paymentNotification is the row that records p once: its dedup key is the
// provider's notification id, or the trade when there is none.
func paymentNotification(p Payment, now time.Time) Notification {
	dedup := p.NotifyID
	if dedup == "" {
		dedup = "trade:" + p.TradeNo
	}
	return Notification{Provider: p.Provider, DedupKey: truncate(dedup, 128), Kind: "PAYMENT",
		OrderNo: p.OrderNo, TradeNo: p.TradeNo, AmountFen: p.AmountFen, Raw: truncate(p.Raw, maxRawNotification),
		Result: "RECEIVED", ReceivedAt: now}
}

// recordOne records one payment in a transaction of its own; o is its
// order as read before.
func (l *Ledger) recordOne(ctx context.Context, p Payment, o Order) (*PaymentResult, error) {
	var res *PaymentResult
	var alerts []Alert
	err := inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
		var err error
		res, alerts, err = l.recordPayment(ctx, tx, p, o)
		return err
	})
	for _, a := range alerts {
		l.alerts.Alert(ctx, a)
	}
	if errors.Is(err, errSeenBefore) {
		// A redelivery: it changed nothing; answer with the order as it is.
		o, err := l.Order(ctx, p.OrderNo)
		if err != nil {
			return nil, err
		}
		return &PaymentResult{Outcome: PaymentDuplicate, Order: o}, nil
	}
	if err != nil {
		return nil, err
	}
	return res, nil
}

// recordPayment applies p to o, the order as read before the transaction:
// its quantity, product and amount never change, its status is re-checked
// by every conditional update here.
func (l *Ledger) recordPayment(ctx context.Context, tx bun.Tx, p Payment, o Order) (*PaymentResult, []Alert, error) {
	now := l.now()
	paid := paidAt(p, now)
	if err := recordNotification(ctx, tx, now, paymentNotification(p, now)); err != nil {
		return nil, nil, err
	}
	paidCols := []column{col("trade_no = ?", p.TradeNo), col("paid_fen = ?", p.AmountFen), col("paid_at = ?", paid)}

	// The usual case: the order still holds its cards.
	n, err := apply(ctx, tx, OrderPay, now, whereOrderNo(p.OrderNo), append(paidCols, col("delivered_at = ?", now))...)
	if err != nil {
		return nil, nil, err
	}
	if n == 1 {
		o.Status, o.TradeNo, o.PaidFen, o.PaidAt, o.DeliveredAt, o.UpdatedAt = OrderPaid, p.TradeNo, p.AmountFen, paid, now, now
		if _, err := leavePending(tx, nil, []string{o.OrderNo}).Exec(ctx); err != nil {
			return nil, nil, err
		}
		if err := l.sellLocked(ctx, tx, &o, now); err != nil {
			return nil, nil, err
		}
		mails, err := l.queueOrderMails(ctx, tx, now, &o)
		if err != nil {
			return nil, nil, err
		}
		if err := recordEvents(ctx, tx, now, orderEvent(EventOrderPaid, &o)); err != nil {
			return nil, nil, err
		}
		return &PaymentResult{Outcome: PaymentDelivered, Order: &o, Mail: mails[o.OrderNo]}, nil, nil
	}
	cur, err := orderIn(ctx, tx, p.OrderNo)
	if err != nil {
		return nil, nil, err
	}
	o = *cur

	switch {
	case o.Status == OrderPending:
		// Only a database without row locks gets here; run again.
		return nil, nil, errRetry
	case o.TradeNo == p.TradeNo:
		// The same payment under another notification id.
		return &PaymentResult{Outcome: PaymentDuplicate, Order: &o}, nil, nil
	case o.Status == OrderClosed:
		if l.cfg.LatePayment == LateDeliver {
			delivered, err := l.deliverLate(ctx, tx, &o, now, paidCols)
			if err != nil {
				return nil, nil, err
			}
			if delivered {
				cur, err := orderIn(ctx, tx, p.OrderNo)
				if err != nil {
					return nil, nil, err
				}
				mails, err := l.queueOrderMails(ctx, tx, now, cur)
				if err != nil {
					return nil, nil, err
				}
				if err := recordEvents(ctx, tx, now, orderEvent(EventOrderPaid, cur)); err != nil {
					return nil, nil, err
				}
				return &PaymentResult{Outcome: PaymentLateDelivered, Order: cur, Mail: mails[cur.OrderNo]}, nil, nil
			}
		}
		n, err := apply(ctx, tx, OrderLateRefund, now, whereOrderNo(p.OrderNo), paidCols...)
		if err != nil {
			return nil, nil, err
		}
		if n != 1 {
			return nil, nil, errRetry
		}
		r, err := l.createRefund(ctx, tx, now, &o, p.Provider, p.TradeNo, p.AmountFen, CauseLatePayment, "paid after the order was closed")
		if err != nil {
			return nil, nil, err
		}
		cur, err := orderIn(ctx, tx, p.OrderNo)
		return &PaymentResult{Outcome: PaymentLateRefund, Order: cur, Refund: r}, nil, err
	default:
		// Paid (or refunding) with another trade: this money is owed back.
		r, err := l.createRefund(ctx, tx, now, &o, p.Provider, p.TradeNo, p.AmountFen, CauseDuplicatePayment, "a second payment for an order already paid")
		if err != nil {
			return nil, nil, err
		}
		return &PaymentResult{Outcome: PaymentDuplicateRefunds, Order: &o, Refund: r},
			[]Alert{{Kind: "duplicate_payment", Subject: o.OrderNo, Message: fmt.Sprintf("trade %s paid an order already paid by %s; refunding", p.TradeNo, o.TradeNo)}}, nil
	}
}

// sellLocked moves the order's LOCKED cards to SOLD; it must find exactly
// Quantity of them, or the transaction fails and nothing is delivered.
func (l *Ledger) sellLocked(ctx context.Context, tx bun.Tx, o *Order, now time.Time) error {
	n, err := apply(ctx, tx, CardSell, now, whereOrderNo(o.OrderNo), col("sold_at = ?", now))
	if err != nil {
		return err
	}
	if n != int64(o.Quantity) {
		return Errorf(EINCONSISTENT, "order %s holds %d locked cards, want %d", o.OrderNo, n, o.Quantity)
	}
	return writeFlow(ctx, tx, now, StockFlow{ProductID: o.ProductID, OrderNo: o.OrderNo, ChangeType: FlowSell, Quantity: o.Quantity})
}

// deliverLate re-locks a closed order's own recycled cards and delivers
// them, if every one of them is still free. It reports false (and changes
// nothing) otherwise.
//
// The cards are taken off sale as a pick takes them: their rows of
// card_for_sale are locked first (a pick holding one is waited for, and
// then the row is gone), then the cards, still RECYCLED and still the
// order's (else the transaction runs again, and finds them gone). Locking
// the cards first would deadlock with a pick, which holds the row and
// then updates the card.
func (l *Ledger) deliverLate(ctx context.Context, tx bun.Tx, o *Order, now time.Time, paidCols []column) (bool, error) {
	var ids []int64
	if err := tx.NewSelect().Table("card_stock").Column("id").
		Where("order_no = ?", o.OrderNo).Where("status = ?", CardRecycled).OrderExpr("id").Scan(ctx, &ids); err != nil {
		return false, err
	}
	if len(ids) != o.Quantity {
		return false, nil
	}
	if held, err := lockForSale(ctx, tx, o.ProductID, ids); err != nil || len(held) != len(ids) {
		return false, err
	}
	if _, err := takeOffSale(tx, o.ProductID, ids).Exec(ctx); err != nil {
		return false, err
	}
	// Still this order's: read without a lock, a card may have been
	// picked by another order and recycled again by its close since.
	stillOurs := func(q *bun.UpdateQuery) *bun.UpdateQuery { return whereIDs(ids)(q).Where("order_no = ?", o.OrderNo) }
	if n, err := apply(ctx, tx, CardLock, now, stillOurs, col("locked_at = ?", now)); err != nil || n != int64(len(ids)) {
		if err == nil {
			err = errRetry
		}
		return false, err
	}
	if err := writeFlow(ctx, tx, now, StockFlow{ProductID: o.ProductID, OrderNo: o.OrderNo, ChangeType: FlowLock, Quantity: o.Quantity}); err != nil {
		return false, err
	}
	if n, err := apply(ctx, tx, OrderLateDeliver, now, whereOrderNo(o.OrderNo), append(paidCols, col("delivered_at = ?", now))...); err != nil || n != 1 {
		if err == nil {
			err = errRetry
		}
		return false, err
	}
	return true, l.sellLocked(ctx, tx, o, now)
}

// refundNumber derives a refund's number from its cause, so that one cause
// can never make two refunds: one late (or duplicate) payment, identified by
// its provider and trade, is one refund; an admin refund is one per order.
// At most 40 characters of [A-Z0-9-], valid for every gateway.
func refundNumber(cause RefundCause, orderNo, provider, tradeNo string) string {
	switch cause {
	case CauseAdmin:
		return "RA" + orderNo
	default:
		sum := sha256.Sum256([]byte(provider + "\x00" + tradeNo))
		prefix := "RL"
		if cause == CauseDuplicatePayment {
			prefix = "RD"
		}
		return prefix + orderNo + "-" + hex.EncodeToString(sum[:6])
	}
}

// createRefund inserts the refund row for a cause, or returns the one that
// exists: the unique refund_no makes a second insert for the same cause
// impossible.
func (l *Ledger) createRefund(ctx context.Context, tx bun.Tx, now time.Time, o *Order, provider, tradeNo string, amount int64, cause RefundCause, reason string) (*Refund, error) {
	// A refund's due times (next_retry_at) are the database's clock, as
	// the refund queue claims them (see DBTime).
	r := &Refund{
		RefundNo: refundNumber(cause, o.OrderNo, provider, tradeNo), OrderNo: o.OrderNo, Provider: provider,
		TradeNo: tradeNo, Cause: cause, AmountFen: amount, PaidFen: amount, Reason: truncate(reason, 255),
		Status: RefundProcessing, NextRetryAt: l.DBTime(), CreatedAt: now, UpdatedAt: now,
	}
	exists, err := tx.NewSelect().Model((*Refund)(nil)).Where("refund_no = ?", r.RefundNo).Exists(ctx)
	if err != nil {
		return nil, err
	}
	if exists {
		return refundIn(ctx, tx, r.RefundNo)
	}
	if _, err := tx.NewInsert().Model(r).Exec(ctx); err != nil {
		if isUniqueViolation(err) {
			return nil, errRetry // another transaction created it; read it next time round
		}
		return nil, err
	}
	return r, nil
}

// errSeenBefore aborts the transaction of a notification recorded before:
// a redelivery changes nothing.
var errSeenBefore = errors.New("notification seen before")

// recordNotification stores a notification once. A redelivery hits the
// unique (provider, dedup_key) index and gets errSeenBefore, which rolls the
// transaction back: nothing it would have done happens twice. A concurrent
// delivery of the same notification waits on the index entry of the first
// and then fails the same way.
func recordNotification(ctx context.Context, tx bun.Tx, now time.Time, n Notification) error {
	n.ReceivedAt = now
	n.Raw = truncate(n.Raw, maxRawNotification)
	n.DedupKey = truncate(n.DedupKey, 128)
	if _, err := tx.NewInsert().Model(&n).Exec(ctx); err != nil {
		if isUniqueViolation(err) {
			return errSeenBefore
		}
		return err
	}
	return nil
}

func orderIn(ctx context.Context, db bun.IDB, orderNo string) (*Order, error) {
	var o Order
	if err := db.NewSelect().Model(&o).Where("order_no = ?", orderNo).Scan(ctx); err != nil {
		return nil, notFound(err, "order %s not found", orderNo)
	}
	return &o, nil
}

func refundIn(ctx context.Context, db bun.IDB, refundNo string) (*Refund, error) {
	var r Refund
	if err := db.NewSelect().Model(&r).Where("refund_no = ?", refundNo).Scan(ctx); err != nil {
		return nil, notFound(err, "refund %s not found", refundNo)
	}
	return &r, nil
}

// truncate bounds a text kami stores to n bytes, as StoredText does: a
// byte cut could split a character (MySQL refuses the row) and a NUL from
// outside (a gateway's or a receiver's error) fails the statement on every
// database, which would leave the record it belongs to unwritable.
func truncate(s string, n int) string { return StoredText(s, n) }

// --- refunds --------------------------------------------------------------

// Refund returns one refund. NOT_FOUND.
func (l *Ledger) Refund(ctx context.Context, refundNo string) (*Refund, error) {
	return refundIn(ctx, l.db, refundNo)
}

// RequestRefund refunds a delivered order in full for an admin: PAID →
// REFUNDING with one refund row. Its cards stay SOLD. NOT_FOUND, CONFLICT
// (not PAID), BAD_INPUT (reason too long).
func (l *Ledger) RequestRefund(ctx context.Context, orderNo, reason, actor string) (*Refund, error) {
	if err := checkOrderNo(orderNo); err != nil {
		return nil, err
	}
	if len(reason) > 255 {
		return nil, Errorf(EBADINPUT, "reason is longer than 255 bytes")
	}
	if reason == "" {
		reason = "refunded by an admin"
	}
	var r *Refund
	err := inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
		now := l.now()
		o, err := orderIn(ctx, tx, orderNo)
		if err != nil {
			return err
		}
		n, err := apply(ctx, tx, OrderAdminRefund, now, whereOrderNo(orderNo))
		if err != nil {
			return err
		}
		if n != 1 {
			return Errorf(ECONFLICT, "order %s is %s; only a PAID order can be refunded", orderNo, o.Status)
		}
		if r, err = l.createRefund(ctx, tx, now, o, o.Provider, o.TradeNo, o.PaidFen, CauseAdmin, reason); err != nil {
			return err
		}
		return audit(ctx, tx, now, actor, "order.refund", orderNo, reason)
	})
	if err != nil {
		return nil, err
	}
	return r, nil
}

// RefundSucceeded records that the provider refunded: the refund →
// SUCCEEDED (also from FAILED: a late confirmation is still the truth) and
// its order REFUNDING → REFUNDED. It reports whether anything changed; a
// second confirmation changes nothing.
func (l *Ledger) RefundSucceeded(ctx context.Context, refundNo, providerRefundID string) (*Refund, bool, error) {
	var r *Refund
	var changed bool
	var alerts []Alert
	err := inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
		var err error
		r, changed, alerts, err = l.refundSucceeded(ctx, tx, refundNo, providerRefundID)
		return err
	})
	for _, a := range alerts {
		l.alerts.Alert(ctx, a)
	}
	return r, changed, err
}

func (l *Ledger) refundSucceeded(ctx context.Context, tx bun.Tx, refundNo, providerRefundID string) (*Refund, bool, []Alert, error) {
	now := l.now()
	cols := []column{col("finished_at = ?", now), col("next_retry_at = NULL")}
	if providerRefundID != "" {
		cols = append(cols, col("provider_refund_id = ?", truncate(providerRefundID, 64)))
	}
	n, err := apply(ctx, tx, RefundSucceed, now, whereRefundNo(refundNo), cols...)
	if err != nil {
		return nil, false, nil, err
	}
	r, err := refundIn(ctx, tx, refundNo)
	if err != nil || n == 0 {
		return r, false, nil, err
	}
	var alerts []Alert
	if r.Cause != CauseDuplicatePayment {
		m, err := apply(ctx, tx, OrderRefundDone, now, whereOrderNo(r.OrderNo), col("refunded_at = ?", now))
		if err != nil {
			return nil, false, nil, err
		}
		if m != 1 {
			alerts = append(alerts, Alert{Kind: "inconsistency", Subject: r.OrderNo,
				Message: fmt.Sprintf("refund %s succeeded but its order was not REFUNDING", refundNo)})
		} else {
			o, err := orderIn(ctx, tx, r.OrderNo)
			if err != nil {
				return nil, false, nil, err
			}
			if err := recordEvents(ctx, tx, now, orderEvent(EventOrderRefunded, o)); err != nil {
				return nil, false, nil, err
			}
		}
	}
	return r, true, alerts, nil
}

// RefundAttemptFailed records a failed refund attempt number attempt
// (Refund.RetryCount as the caller read it) with the gateway's detail. The
// refund stays PROCESSING with next_retry_at after the next backoff step,
// or, when the backoff is used up, becomes FAILED with an alert. A second
// report of the same attempt changes nothing.
func (l *Ledger) RefundAttemptFailed(ctx context.Context, refundNo string, attempt int, detail string) (*Refund, error) {
	return l.refundAttemptMissed(ctx, refundNo, attempt, detail, false)
}

// RefundUnconfirmed records refund attempt number attempt whose outcome is
// unknown: the refund call got no answer (the gateway may have made it),
// or the look at a refund sent before went unanswered. Within the backoff
// it counts as RefundAttemptFailed does. Past it, the refund does not
// become FAILED, which would say no money moved when it may have: it stays
// PROCESSING and is asked about on the slow poll, and the first attempt
// past the backoff raises refund_unconfirmed, once. A day of that is the
// nightly reconciliation's stale refund.
func (l *Ledger) RefundUnconfirmed(ctx context.Context, refundNo string, attempt int, detail string) (*Refund, error) {
	return l.refundAttemptMissed(ctx, refundNo, attempt, detail, true)
}

// refundAttemptMissed records a refund attempt that did not refund: a
// refusal (unknown false) or an attempt whose outcome is unknown.
func (l *Ledger) refundAttemptMissed(ctx context.Context, refundNo string, attempt int, detail string, unknown bool) (*Refund, error) {
	var r *Refund
	var alert *Alert
	err := inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
		alert = nil
		now := l.now()
		detail := truncate(detail, 512)
		failures := attempt + 1
		var n int64
		var err error
		byAttempt := func(q *bun.UpdateQuery) *bun.UpdateQuery {
			return whereRefundNo(refundNo)(q).Where("retry_count = ?", attempt)
		}
		gaveUp := false
		switch {
		case failures <= len(l.cfg.RefundBackoff):
			_, err = apply(ctx, tx, RefundAttempt, now, byAttempt,
				col("retry_count = ?", failures), col("last_error = ?", detail),
				col("next_retry_at = ?", l.DBTime().Add(l.cfg.RefundBackoff[failures-1])))
		case unknown:
			n, err = apply(ctx, tx, RefundAttempt, now, byAttempt,
				col("retry_count = ?", failures), col("last_error = ?", detail),
				col("next_retry_at = ?", l.DBTime().Add(l.refundPoll())))
			if n == 1 && failures == len(l.cfg.RefundBackoff)+1 {
				alert = &Alert{Kind: "refund_unconfirmed", Subject: refundNo,
					Message: fmt.Sprintf("the gateway has not said whether it made this refund after %d attempts (%s); it may have: kami keeps asking every %s and does not refund it again meanwhile", failures, detail, l.refundPoll())}
			}
		default:
			n, err = apply(ctx, tx, RefundGiveUp, now, byAttempt,
				col("retry_count = ?", failures), col("last_error = ?", detail), col("next_retry_at = NULL"), col("finished_at = ?", now))
			if n == 1 {
				gaveUp = true
				alert = &Alert{Kind: "refund_failed", Subject: refundNo,
					Message: fmt.Sprintf("gave up after %d attempts: %s; retry it with retryRefund", failures, detail)}
			}
		}
		if err != nil {
			return err
		}
		if r, err = refundIn(ctx, tx, refundNo); err != nil || !gaveUp {
			return err
		}
		o, err := orderIn(ctx, tx, r.OrderNo)
		if err != nil {
			return err
		}
		return recordEvents(ctx, tx, now, refundEvent(EventRefundFailed, r, o))
	})
	if err != nil {
		return nil, err
	}
	if alert != nil {
		l.alerts.Alert(ctx, *alert)
	}
	return r, nil
}

// RefundAwaiting records that the provider accepted refund attempt number
// attempt (0-based, as RefundAttemptFailed) and is still processing it:
// the refund stays PROCESSING, the attempt is not counted as failed, and the
// next look is a query at the provider after the slow poll (the longest
// step of KAMI_REFUND_BACKOFF). providerRefundID, when the provider gave
// one, is kept; it also tells the next attempt that a refund was sent, so
// it asks before refunding again. A refund that stays like this for a day
// is reported by the nightly reconciliation (StaleRefunds).
func (l *Ledger) RefundAwaiting(ctx context.Context, refundNo string, attempt int, providerRefundID, detail string) (*Refund, error) {
	var r *Refund
	err := inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
		now := l.now()
		sets := []column{col("last_error = ?", truncate(detail, 512)), col("next_retry_at = ?", l.DBTime().Add(l.refundPoll()))}
		if providerRefundID != "" {
			sets = append(sets, col("provider_refund_id = ?", truncate(providerRefundID, 64)))
		}
		if _, err := apply(ctx, tx, RefundAwait, now, func(q *bun.UpdateQuery) *bun.UpdateQuery {
			return whereRefundNo(refundNo)(q).Where("retry_count = ?", attempt)
		}, sets...); err != nil {
			return err
		}
		var err error
		r, err = refundIn(ctx, tx, refundNo)
		return err
	})
	return r, err
}

// refundPoll is how long a refund the provider is still processing waits
// before it is asked about again: the longest step of the backoff.
func (l *Ledger) refundPoll() time.Duration {
	if len(l.cfg.RefundBackoff) == 0 {
		return 30 * time.Minute
	}
	return slices.Max(l.cfg.RefundBackoff)
}

// RetryRefund restarts a FAILED refund for an admin: → PROCESSING, due now,
// with a fresh backoff. NOT_FOUND, CONFLICT (not FAILED).
func (l *Ledger) RetryRefund(ctx context.Context, refundNo, actor string) (*Refund, error) {
	var r *Refund
	err := inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
		now := l.now()
		cur, err := refundIn(ctx, tx, refundNo)
		if err != nil {
			return err
		}
		n, err := apply(ctx, tx, RefundRetry, now, whereRefundNo(refundNo),
			col("retry_count = 0"), col("next_retry_at = ?", l.DBTime()), col("finished_at = NULL"))
		if err != nil {
			return err
		}
		if n != 1 {
			return Errorf(ECONFLICT, "refund %s is %s; only a FAILED refund can be retried", refundNo, cur.Status)
		}
		if r, err = refundIn(ctx, tx, refundNo); err != nil {
			return err
		}
		return audit(ctx, tx, now, actor, "refund.retry", refundNo, "")
	})
	if err != nil {
		return nil, err
	}
	return r, nil
}

// RefundEvent is a verified refund notification.
type RefundEvent struct {
	Provider         string
	NotifyID         string
	RefundNo         string
	Succeeded        bool // false: the gateway reports the refund failed
	ProviderRefundID string
	Detail           string
	Raw              string
}

// RecordRefundEvent applies a refund notification once. NOT_FOUND for a
// refund kami never made.
func (l *Ledger) RecordRefundEvent(ctx context.Context, ev RefundEvent) (*Refund, bool, error) {
	r, err := l.Refund(ctx, ev.RefundNo)
	if err != nil {
		return nil, false, err
	}
	if r.Provider != ev.Provider {
		return nil, false, Errorf(EBADINPUT, "refund %s was not made through %s", ev.RefundNo, ev.Provider)
	}
	dedup := ev.NotifyID
	if dedup == "" {
		dedup = fmt.Sprintf("refund:%s:%t", ev.RefundNo, ev.Succeeded)
	}
	var changed bool
	var alerts []Alert
	err = inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
		changed, alerts = false, nil
		if err := recordNotification(ctx, tx, l.now(), Notification{Provider: ev.Provider, DedupKey: dedup, Kind: "REFUND",
			OrderNo: r.OrderNo, TradeNo: r.TradeNo, RefundNo: r.RefundNo, AmountFen: r.AmountFen, Raw: ev.Raw, Result: "RECEIVED"}); err != nil {
			return err
		}
		var err error
		if ev.Succeeded {
			r, changed, alerts, err = l.refundSucceeded(ctx, tx, ev.RefundNo, ev.ProviderRefundID)
		}
		return err
	})
	for _, a := range alerts {
		l.alerts.Alert(ctx, a)
	}
	if errors.Is(err, errSeenBefore) {
		cur, err := l.Refund(ctx, ev.RefundNo)
		return cur, false, err
	}
	if err != nil {
		return nil, false, err
	}
	if !ev.Succeeded {
		// A failure report is one more failed attempt; the retry path
		// queries the gateway before trying again.
		cur, err := l.Refund(ctx, ev.RefundNo)
		if err != nil {
			return nil, false, err
		}
		if cur.Status == RefundProcessing {
			r, err = l.RefundAttemptFailed(ctx, ev.RefundNo, cur.RetryCount, "gateway reported the refund failed: "+ev.Detail)
			return r, err == nil, err
		}
		return cur, false, nil
	}
	return r, changed, nil
}

// DueRefunds lists PROCESSING refunds whose next attempt is due, oldest
// first, from the (status, next_retry_at) index.
func (l *Ledger) DueRefunds(ctx context.Context, now time.Time, limit int) ([]Refund, error) {
	var rs []Refund
	err := l.db.NewSelect().Model(&rs).Where("status = ?", RefundProcessing).
		Where("next_retry_at <= ?", now.UTC()).OrderExpr("next_retry_at, id").Limit(int64(limit)).Scan(ctx)
	return rs, err
}

// StaleRefunds lists refunds still PROCESSING that were created before t.
func (l *Ledger) StaleRefunds(ctx context.Context, before time.Time, limit int) ([]Refund, error) {
	var rs []Refund
	err := l.db.NewSelect().Model(&rs).Where("status = ?", RefundProcessing).
		Where("created_at < ?", before.UTC()).OrderExpr("created_at, id").Limit(int64(limit)).Scan(ctx)
	return rs, err
}
