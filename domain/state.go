package domain

import "slices"

// OrderStatus is the state of an order. See the transition table below.
type OrderStatus string

const (
	OrderPending   OrderStatus = "PENDING"
	OrderPaid      OrderStatus = "PAID"
	OrderRefunding OrderStatus = "REFUNDING"
	OrderRefunded  OrderStatus = "REFUNDED"
	OrderClosed    OrderStatus = "CLOSED"
)

// OrderStatuses lists every order status; the schema's CHECK repeats it.
var OrderStatuses = []OrderStatus{OrderPending, OrderPaid, OrderRefunding, OrderRefunded, OrderClosed}

// Final reports whether no transition leaves s.
func (s OrderStatus) Final() bool { return s == OrderRefunded }

// CardStatus is the state of one card code.
type CardStatus string

const (
	CardUnsold   CardStatus = "UNSOLD"
	CardLocked   CardStatus = "LOCKED"
	CardSold     CardStatus = "SOLD"
	CardRecycled CardStatus = "RECYCLED"
	// CardWithdrawn is a card taken off sale for good: its supplier batch
	// was recalled. Nothing leaves it.
	CardWithdrawn CardStatus = "WITHDRAWN"
)

// CardStatuses lists every card status; the schema's CHECK repeats it.
var CardStatuses = []CardStatus{CardUnsold, CardLocked, CardSold, CardRecycled, CardWithdrawn}

// BatchStatus is the state of a supplier batch of cards (card_batch).
type BatchStatus string

const (
	BatchActive   BatchStatus = "ACTIVE"
	BatchRecalled BatchStatus = "RECALLED" // the supplier said its codes are bad
)

// BatchStatuses lists every batch status; the schema's CHECK repeats it.
var BatchStatuses = []BatchStatus{BatchActive, BatchRecalled}

// RefundStatus is the state of a refund_order row.
type RefundStatus string

const (
	RefundProcessing RefundStatus = "PROCESSING"
	RefundSucceeded  RefundStatus = "SUCCEEDED"
	RefundFailed     RefundStatus = "FAILED"
)

// RefundStatuses lists every refund status; the schema's CHECK repeats it.
var RefundStatuses = []RefundStatus{RefundProcessing, RefundSucceeded, RefundFailed}

// MailStatus is the state of a mail_sends row: one mail of an order's
// codes to its buyer (see mail.go).
type MailStatus string

const (
	MailQueued  MailStatus = "QUEUED"  // waiting for its next attempt (next_due_at)
	MailSending MailStatus = "SENDING" // an attempt is under way (until next_due_at)
	MailSent    MailStatus = "SENT"    // the server accepted it
	MailFailed  MailStatus = "FAILED"  // given up: last_error says why
)

// MailStatuses lists every mail status; the schema's CHECK repeats it.
var MailStatuses = []MailStatus{MailQueued, MailSending, MailSent, MailFailed}

// DeliveryStatus is the state of one webhook delivery (webhook_delivery).
type DeliveryStatus string

const (
	DeliveryPending   DeliveryStatus = "PENDING"   // to be sent, or being sent
	DeliveryDelivered DeliveryStatus = "DELIVERED" // the endpoint answered 2xx
	DeliveryFailed    DeliveryStatus = "FAILED"    // the retries ran out: alerted
	DeliveryCancelled DeliveryStatus = "CANCELLED" // its endpoint was disabled or deleted before it was sent
)

// DeliveryStatuses lists every delivery status; the schema's CHECK repeats it.
var DeliveryStatuses = []DeliveryStatus{DeliveryPending, DeliveryDelivered, DeliveryFailed, DeliveryCancelled}

// Tables whose status column the transitions move.
const (
	tableMails      = "mail_sends"
	tableDeliveries = "webhook_delivery"
	tableOrders     = "orders"
	tableCards      = "card_stock"
	tableRefunds    = "refund_order"
	tableBatches    = "card_batch"
)

// Transition is one legal move of a status column. The SQL that applies it
// is built from it (see apply.go): UPDATE <table> SET status=<To> WHERE
// <key> AND status IN (<From>...), with the rows affected checked. Nothing
// else in kami writes a status.
type Transition struct {
	Name  string
	Table string
	From  []string
	To    string
}

func orderMove(name string, from []OrderStatus, to OrderStatus) Transition {
	return Transition{Name: name, Table: tableOrders, From: strs(from), To: string(to)}
}

func cardMove(name string, from []CardStatus, to CardStatus) Transition {
	return Transition{Name: name, Table: tableCards, From: strs(from), To: string(to)}
}

func batchMove(name string, from []BatchStatus, to BatchStatus) Transition {
	return Transition{Name: name, Table: tableBatches, From: strs(from), To: string(to)}
}

func refundMove(name string, from []RefundStatus, to RefundStatus) Transition {
	return Transition{Name: name, Table: tableRefunds, From: strs(from), To: string(to)}
}

func mailMove(name string, from []MailStatus, to MailStatus) Transition {
	return Transition{Name: name, Table: tableMails, From: strs(from), To: string(to)}
}

func deliveryMove(name string, from []DeliveryStatus, to DeliveryStatus) Transition {
	return Transition{Name: name, Table: tableDeliveries, From: strs(from), To: string(to)}
}

// The transition table: every state change kami makes, and only these.
var (
	// A buyer's payment lands while the order still holds its cards.
	OrderPay = orderMove("order.pay", []OrderStatus{OrderPending}, OrderPaid)
	// The order's time ran out (or its buyer cancelled): cards go back.
	OrderClose = orderMove("order.close", []OrderStatus{OrderPending}, OrderClosed)
	// A payment for a closed order: it is refunded, never delivered by default.
	OrderLateRefund = orderMove("order.late_refund", []OrderStatus{OrderClosed}, OrderRefunding)
	// KAMI_LATE_PAYMENT=deliver: a closed order whose own cards are still
	// free is delivered after all.
	OrderLateDeliver = orderMove("order.late_deliver", []OrderStatus{OrderClosed}, OrderPaid)
	// An admin refunds a delivered order; its cards stay SOLD (they were shown).
	OrderAdminRefund = orderMove("order.admin_refund", []OrderStatus{OrderPaid}, OrderRefunding)
	// The provider confirmed the refund.
	OrderRefundDone = orderMove("order.refunded", []OrderStatus{OrderRefunding}, OrderRefunded)

	CardLock    = cardMove("card.lock", []CardStatus{CardUnsold, CardRecycled}, CardLocked)
	CardSell    = cardMove("card.sell", []CardStatus{CardLocked}, CardSold)
	CardRecycle = cardMove("card.recycle", []CardStatus{CardLocked}, CardRecycled)
	// A recalled batch's cards leave sale at once...
	CardWithdraw = cardMove("card.withdraw", []CardStatus{CardUnsold, CardRecycled}, CardWithdrawn)
	// ...and a locked one when its order closes, instead of being recycled.
	// A SOLD card stays SOLD: its code was shown (the order is refunded).
	CardWithdrawLocked = cardMove("card.withdraw_locked", []CardStatus{CardLocked}, CardWithdrawn)

	// A supplier batch is recalled once.
	BatchRecall = batchMove("batch.recall", []BatchStatus{BatchActive}, BatchRecalled)

	RefundSucceed = refundMove("refund.succeed", []RefundStatus{RefundProcessing, RefundFailed}, RefundSucceeded)
	RefundGiveUp  = refundMove("refund.give_up", []RefundStatus{RefundProcessing}, RefundFailed)
	RefundRetry   = refundMove("refund.retry", []RefundStatus{RefundFailed}, RefundProcessing)
	// A failed attempt that will be tried again stays PROCESSING; it is a
	// transition so that its update is guarded like every other.
	RefundAttempt = refundMove("refund.attempt", []RefundStatus{RefundProcessing}, RefundProcessing)
	// The provider accepted the refund and is still processing it (a
	// WeChat refund to a bank card takes days): not a failure, polled on
	// the slow schedule, never given up on.
	RefundAwait = refundMove("refund.await", []RefundStatus{RefundProcessing}, RefundProcessing)

	// An attempt begins: recorded (and committed) before the message is
	// sent, so no two attempts run at once.
	MailBeginAttempt = mailMove("mail.attempt", []MailStatus{MailQueued}, MailSending)
	// An attempt whose process died (its deadline passed) is taken over:
	// the server may have its message, so it counts as uncertain.
	MailTakeOver = mailMove("mail.take_over", []MailStatus{MailSending}, MailSending)
	MailDone     = mailMove("mail.sent", []MailStatus{MailSending}, MailSent)
	// The attempt did not deliver (or may not have): try again later.
	MailRetry = mailMove("mail.retry", []MailStatus{MailSending}, MailQueued)
	// Refused for good, out of attempts, or the order no longer paid.
	MailGiveUp = mailMove("mail.give_up", []MailStatus{MailQueued, MailSending}, MailFailed)
)

// Webhook deliveries. An attempt is taken before it is sent (attempts
// + 1 and the next due time pushed past the request's timeout, guarded by
// the attempt count and the due time): of two workers holding the same
// delivery, one sends it.
var (
	DeliveryAttempt = deliveryMove("delivery.attempt", []DeliveryStatus{DeliveryPending}, DeliveryPending)
	DeliveryDeliver = deliveryMove("delivery.deliver", []DeliveryStatus{DeliveryPending}, DeliveryDelivered)
	DeliveryGiveUp  = deliveryMove("delivery.give_up", []DeliveryStatus{DeliveryPending}, DeliveryFailed)
	DeliveryCancel  = deliveryMove("delivery.cancel", []DeliveryStatus{DeliveryPending}, DeliveryCancelled)
	// An admin sends an event again: a fresh round of attempts.
	DeliveryResend = deliveryMove("delivery.resend", []DeliveryStatus{DeliveryDelivered, DeliveryFailed, DeliveryCancelled}, DeliveryPending)
)

// Transitions is the whole table, for tests and documentation.
var Transitions = []Transition{
	OrderPay, OrderClose, OrderLateRefund, OrderLateDeliver, OrderAdminRefund, OrderRefundDone,
	CardLock, CardSell, CardRecycle, CardWithdraw, CardWithdrawLocked,
	BatchRecall,
	RefundSucceed, RefundGiveUp, RefundRetry, RefundAttempt, RefundAwait,
	MailBeginAttempt, MailTakeOver, MailDone, MailRetry, MailGiveUp,
	DeliveryAttempt, DeliveryDeliver, DeliveryGiveUp, DeliveryCancel, DeliveryResend,
}

// Allowed reports whether some transition moves table's status from → to.
func Allowed(table, from, to string) bool {
	for _, t := range Transitions {
		if t.Table == table && t.To == to && slices.Contains(t.From, from) {
			return true
		}
	}
	return false
}

func strs[S ~string](xs []S) []string {
	out := make([]string, len(xs))
	for i, x := range xs {
		out[i] = string(x)
	}
	return out
}
