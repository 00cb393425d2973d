package domain

import (
	"time"

	"github.com/uptrace/bun"
)

// Product is something the shop sells; each unit is one card code.
type Product struct {
	bun.BaseModel `bun:"table:products"`

	ID          int64  `bun:"id,pk,autoincrement"`
	Name        string `bun:"name"`
	Description string `bun:"description"`
	PriceFen    int64  `bun:"price_fen"`
	Active      bool   `bun:"active"`
	// MaxPerOrder caps one order's quantity; 0 means the shop's default.
	MaxPerOrder int `bun:"max_per_order"`
	// CodeRule is the format every imported code must have (empty: any).
	CodeRule
	// LowStockThreshold raises a low_stock alert when the sellable cards
	// fall to it (0: never). LowStockAlerted is set while stock is at or
	// below it, so each crossing alerts once (see lowstock.go).
	LowStockThreshold int       `bun:"low_stock_threshold"`
	LowStockAlerted   bool      `bun:"low_stock_alerted"`
	CreatedAt         time.Time `bun:"created_at"`
	UpdatedAt         time.Time `bun:"updated_at"`
}

// Card is one redeem code. CodeEnc is the code sealed with AES-256-GCM;
// CodeHash is a keyed hash that finds duplicates without decrypting.
type Card struct {
	bun.BaseModel `bun:"table:card_stock"`

	ID        int64      `bun:"id,pk,autoincrement"`
	ProductID int64      `bun:"product_id"`
	CodeEnc   []byte     `bun:"code_enc"`
	CodeHash  string     `bun:"code_hash"`
	BatchID   int64      `bun:"batch_id"` // the supplier batch it was imported with
	Status    CardStatus `bun:"status"`
	// OrderNo is the order that locked the card last; it stays on a
	// RECYCLED card so a late payment can find its own cards again.
	OrderNo   string    `bun:"order_no,nullzero"`
	LockedAt  time.Time `bun:"locked_at,nullzero"`
	SoldAt    time.Time `bun:"sold_at,nullzero"`
	CreatedAt time.Time `bun:"created_at"`
	UpdatedAt time.Time `bun:"updated_at"`
}

// Order is one purchase of Quantity cards of one product.
type Order struct {
	bun.BaseModel `bun:"table:orders"`

	ID             int64       `bun:"id,pk,autoincrement"`
	OrderNo        string      `bun:"order_no"`
	ProductID      int64       `bun:"product_id"`
	Quantity       int         `bun:"quantity"`
	UnitPriceFen   int64       `bun:"unit_price_fen"`
	AmountFen      int64       `bun:"amount_fen"`
	Contact        string      `bun:"contact"`
	ClientAddr     string      `bun:"client_addr"`
	Provider       string      `bun:"provider"`
	Status         OrderStatus `bun:"status"`
	IdempotencyKey string      `bun:"idempotency_key,nullzero"`
	// AccessTokenHash is the SHA-256 of the buyer's access token; the token
	// itself is never stored.
	AccessTokenHash string `bun:"access_token_hash"`
	// TradeNo and PaidFen record the payment the order was paid with, also
	// when that payment came late and is being refunded.
	TradeNo string    `bun:"trade_no,nullzero"`
	PaidFen int64     `bun:"paid_fen"`
	PaidAt  time.Time `bun:"paid_at,nullzero"`
	// DeliveredAt is set when the cards were sold to this order: exactly
	// then it holds Quantity SOLD cards.
	DeliveredAt time.Time `bun:"delivered_at,nullzero"`
	ExpiresAt   time.Time `bun:"expires_at"`
	ClosedAt    time.Time `bun:"closed_at,nullzero"`
	RefundedAt  time.Time `bun:"refunded_at,nullzero"`
	CreatedAt   time.Time `bun:"created_at"`
	UpdatedAt   time.Time `bun:"updated_at"`
}

// RefundCause says why a refund exists; with the order and the payment it
// determines the refund number, so one cause can never make two refunds.
type RefundCause string

const (
	CauseLatePayment      RefundCause = "LATE_PAYMENT"      // paid after the order was closed
	CauseDuplicatePayment RefundCause = "DUPLICATE_PAYMENT" // a second trade paid an order already paid
	CauseAdmin            RefundCause = "ADMIN"             // an admin refunded a delivered order
)

// RefundCauses lists every cause; the schema's CHECK repeats it.
var RefundCauses = []RefundCause{CauseLatePayment, CauseDuplicatePayment, CauseAdmin}

// Refund is a refund_order row: money kami owes back through a provider.
type Refund struct {
	bun.BaseModel `bun:"table:refund_order"`

	ID        int64        `bun:"id,pk,autoincrement"`
	RefundNo  string       `bun:"refund_no"`
	OrderNo   string       `bun:"order_no"`
	Provider  string       `bun:"provider"`
	TradeNo   string       `bun:"trade_no"`
	Cause     RefundCause  `bun:"cause"`
	AmountFen int64        `bun:"amount_fen"`
	PaidFen   int64        `bun:"paid_fen"`
	Reason    string       `bun:"reason"`
	Status    RefundStatus `bun:"status"`
	// RetryCount is the number of failed attempts so far.
	RetryCount       int       `bun:"retry_count"`
	NextRetryAt      time.Time `bun:"next_retry_at,nullzero"`
	LastError        string    `bun:"last_error"`
	ProviderRefundID string    `bun:"provider_refund_id,nullzero"`
	CreatedAt        time.Time `bun:"created_at"`
	UpdatedAt        time.Time `bun:"updated_at"`
	FinishedAt       time.Time `bun:"finished_at,nullzero"`
}

// FlowType is a stock_flow change type.
type FlowType int

const (
	FlowLock   FlowType = 1 // cards locked by a new order
	FlowSell   FlowType = 2 // locked cards sold to their paid order
	FlowReturn FlowType = 3 // locked cards given back when their order closed
	// FlowRefundReturn is reserved: kami never puts a card back on sale
	// after a refund, since a SOLD card's code has been shown. The value is
	// kept so the numbering matches the article's.
	FlowRefundReturn FlowType = 4
	FlowImport       FlowType = 5 // cards imported by the seller
	FlowWithdraw     FlowType = 6 // lockable cards of a recalled batch taken off sale
	// FlowWithdrawLocked is a recalled batch's card withdrawn when the order
	// that held it closed, instead of going back on sale.
	FlowWithdrawLocked FlowType = 7
)

// StockFlow is one entry of the stock journal. Summed per product it must
// match the card counts (see Audit).
type StockFlow struct {
	bun.BaseModel `bun:"table:stock_flow"`

	ID         int64     `bun:"id,pk,autoincrement"`
	ProductID  int64     `bun:"product_id"`
	OrderNo    string    `bun:"order_no,nullzero"`
	ChangeType FlowType  `bun:"change_type"`
	Quantity   int       `bun:"quantity"`
	CreatedAt  time.Time `bun:"created_at"`
}

// Notification is a verified payment or refund notification, recorded once
// per (provider, dedup key).
type Notification struct {
	bun.BaseModel `bun:"table:payment_notification"`

	ID         int64     `bun:"id,pk,autoincrement"`
	Provider   string    `bun:"provider"`
	DedupKey   string    `bun:"dedup_key"`
	Kind       string    `bun:"kind"`
	OrderNo    string    `bun:"order_no"`
	TradeNo    string    `bun:"trade_no,nullzero"`
	RefundNo   string    `bun:"refund_no,nullzero"`
	AmountFen  int64     `bun:"amount_fen"`
	Raw        string    `bun:"raw"`
	Result     string    `bun:"result"`
	ReceivedAt time.Time `bun:"received_at"`
}

// AuditEntry records one admin action.
type AuditEntry struct {
	bun.BaseModel `bun:"table:audit_log"`

	ID        int64     `bun:"id,pk,autoincrement"`
	Actor     string    `bun:"actor"`
	Action    string    `bun:"action"`
	Target    string    `bun:"target"`
	Detail    string    `bun:"detail"`
	CreatedAt time.Time `bun:"created_at"`
}
