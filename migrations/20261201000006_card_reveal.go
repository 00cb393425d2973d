package migrations

func init() { Migrations.MustRegister(run(cardRevealUp), run(cardRevealDown)) }

// card_reveal records every time card codes left kami: the
// buyer's order query, a subscription event, an admin's code read, an
// export, and later a mail. One row per reveal of an order's
// codes (order_no set, card_id NULL: the order's SOLD cards), one row per
// card for reveals of single cards (admin code reads, exports: card_id set,
// order_no the order it belongs to, if any). So "who saw this order's
// codes" is one indexed read by order_no, and "who saw this card" one by
// card_id plus the reveals of the order it was sold to.
//
// channel and viewer carry no CHECK: they are not states that move, and
// new channels come (mail). card_id has no foreign key: its check would
// share-lock the cards an export records, and a buyer placing an order
// skips locked cards.
const cardRevealUp = `
CREATE TABLE card_reveal (
	id {{ID}},
	channel VARCHAR(16) NOT NULL,
	viewer VARCHAR(16) NOT NULL,
	actor VARCHAR(64) NOT NULL,
	client_addr VARCHAR(64) NOT NULL,
	order_no VARCHAR(32) NULL,
	card_id BIGINT NULL,
	codes INTEGER NOT NULL CHECK (codes >= 0),
	ref VARCHAR(64) NOT NULL,
	created_at {{TS}} NOT NULL
) {{TABLE}};
CREATE INDEX card_reveal_order ON card_reveal (order_no, id);
CREATE INDEX card_reveal_card ON card_reveal (card_id, id);
`

const cardRevealDown = `
DROP TABLE card_reveal;
`
