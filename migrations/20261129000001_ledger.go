package migrations

func init() { Migrations.MustRegister(run(ledgerUp), run(ledgerDown)) }

const ledgerUp = `
CREATE TABLE products (
	id {{ID}},
	name VARCHAR(200) NOT NULL,
	description {{TEXT}} NOT NULL,
	price_fen BIGINT NOT NULL CHECK (price_fen > 0 AND price_fen <= 10000000000),
	active {{BOOL}} NOT NULL,
	max_per_order INTEGER NOT NULL CHECK (max_per_order >= 0),
	created_at {{TS}} NOT NULL,
	updated_at {{TS}} NOT NULL
) {{TABLE}};

CREATE TABLE card_stock (
	id {{ID}},
	product_id BIGINT NOT NULL,
	code_enc {{BLOB}} NOT NULL,
	code_hash CHAR(64) NOT NULL,
	status VARCHAR(16) NOT NULL CHECK (status IN ('UNSOLD','LOCKED','SOLD','RECYCLED')),
	order_no VARCHAR(32) NULL,
	locked_at {{TS}} NULL,
	sold_at {{TS}} NULL,
	created_at {{TS}} NOT NULL,
	updated_at {{TS}} NOT NULL,
	CHECK (status NOT IN ('LOCKED','SOLD') OR order_no IS NOT NULL),
	FOREIGN KEY (product_id) REFERENCES products (id)
) {{TABLE}};
CREATE UNIQUE INDEX card_stock_product_code ON card_stock (product_id, code_hash);
CREATE INDEX card_stock_lockable ON card_stock (product_id, status, id);
CREATE INDEX card_stock_order ON card_stock (order_no, status);

CREATE TABLE orders (
	id {{ID}},
	order_no VARCHAR(32) NOT NULL,
	product_id BIGINT NOT NULL,
	quantity INTEGER NOT NULL CHECK (quantity > 0),
	unit_price_fen BIGINT NOT NULL CHECK (unit_price_fen > 0),
	amount_fen BIGINT NOT NULL CHECK (amount_fen > 0),
	contact VARCHAR(128) NOT NULL,
	client_addr VARCHAR(64) NOT NULL,
	provider VARCHAR(16) NOT NULL,
	status VARCHAR(16) NOT NULL CHECK (status IN ('PENDING','PAID','REFUNDING','REFUNDED','CLOSED')),
	idempotency_key VARCHAR(64) NULL,
	access_token_hash CHAR(64) NOT NULL,
	trade_no VARCHAR(64) NULL,
	paid_fen BIGINT NOT NULL CHECK (paid_fen >= 0),
	paid_at {{TS}} NULL,
	delivered_at {{TS}} NULL,
	expires_at {{TS}} NOT NULL,
	closed_at {{TS}} NULL,
	refunded_at {{TS}} NULL,
	created_at {{TS}} NOT NULL,
	updated_at {{TS}} NOT NULL,
	CHECK (status <> 'PENDING' OR trade_no IS NULL),
	FOREIGN KEY (product_id) REFERENCES products (id)
) {{TABLE}};
CREATE UNIQUE INDEX orders_order_no ON orders (order_no);
CREATE UNIQUE INDEX orders_idempotency_key ON orders (idempotency_key);
CREATE INDEX orders_status_expires ON orders (status, expires_at);
CREATE INDEX orders_status_created ON orders (status, created_at);
CREATE INDEX orders_contact_status ON orders (contact, status);
CREATE INDEX orders_addr_status ON orders (client_addr, status);
CREATE INDEX orders_product_created ON orders (product_id, created_at);

CREATE TABLE refund_order (
	id {{ID}},
	refund_no VARCHAR(64) NOT NULL,
	order_no VARCHAR(32) NOT NULL,
	provider VARCHAR(16) NOT NULL,
	trade_no VARCHAR(64) NOT NULL,
	cause VARCHAR(24) NOT NULL CHECK (cause IN ('LATE_PAYMENT','DUPLICATE_PAYMENT','ADMIN')),
	amount_fen BIGINT NOT NULL CHECK (amount_fen > 0),
	paid_fen BIGINT NOT NULL CHECK (paid_fen > 0),
	reason VARCHAR(255) NOT NULL,
	status VARCHAR(16) NOT NULL CHECK (status IN ('PROCESSING','SUCCEEDED','FAILED')),
	retry_count INTEGER NOT NULL CHECK (retry_count >= 0),
	next_retry_at {{TS}} NULL,
	last_error VARCHAR(512) NOT NULL,
	provider_refund_id VARCHAR(64) NULL,
	created_at {{TS}} NOT NULL,
	updated_at {{TS}} NOT NULL,
	finished_at {{TS}} NULL,
	CHECK (amount_fen <= paid_fen)
) {{TABLE}};
CREATE UNIQUE INDEX refund_order_refund_no ON refund_order (refund_no);
CREATE INDEX refund_order_status_retry ON refund_order (status, next_retry_at);
CREATE INDEX refund_order_status_created ON refund_order (status, created_at);
CREATE INDEX refund_order_order_no ON refund_order (order_no);

CREATE TABLE stock_flow (
	id {{ID}},
	product_id BIGINT NOT NULL,
	order_no VARCHAR(32) NULL,
	change_type SMALLINT NOT NULL CHECK (change_type IN (1, 2, 3, 4, 5)),
	quantity INTEGER NOT NULL CHECK (quantity > 0),
	created_at {{TS}} NOT NULL,
	FOREIGN KEY (product_id) REFERENCES products (id)
) {{TABLE}};
CREATE INDEX stock_flow_product_type ON stock_flow (product_id, change_type);
CREATE INDEX stock_flow_order_no ON stock_flow (order_no);

CREATE TABLE payment_notification (
	id {{ID}},
	provider VARCHAR(16) NOT NULL,
	dedup_key VARCHAR(128) NOT NULL,
	kind VARCHAR(24) NOT NULL,
	order_no VARCHAR(32) NOT NULL,
	trade_no VARCHAR(64) NULL,
	refund_no VARCHAR(64) NULL,
	amount_fen BIGINT NOT NULL,
	raw {{BIGTEXT}} NOT NULL,
	result VARCHAR(24) NOT NULL,
	received_at {{TS}} NOT NULL
) {{TABLE}};
CREATE UNIQUE INDEX payment_notification_dedup ON payment_notification (provider, dedup_key);
CREATE INDEX payment_notification_order_no ON payment_notification (order_no);

CREATE TABLE audit_log (
	id {{ID}},
	actor VARCHAR(64) NOT NULL,
	action VARCHAR(64) NOT NULL,
	target VARCHAR(128) NOT NULL,
	detail {{TEXT}} NOT NULL,
	created_at {{TS}} NOT NULL
) {{TABLE}};
CREATE INDEX audit_log_created ON audit_log (created_at);
`

const ledgerDown = `
DROP TABLE audit_log;
DROP TABLE payment_notification;
DROP TABLE stock_flow;
DROP TABLE refund_order;
DROP TABLE orders;
DROP TABLE card_stock;
DROP TABLE products;
`
