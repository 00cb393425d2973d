package domain_test

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
)

// TestTransitionTable walks every transition from every status on every
// database: the generated UPDATE moves the row exactly when the status is
// one the transition leaves, and the CHECK constraints refuse a status
// outside the table.
func TestTransitionTable(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 1) // and a batch for the cards below
		statuses := map[string][]string{
			"orders":           {"PENDING", "PAID", "REFUNDING", "REFUNDED", "CLOSED"},
			"card_stock":       {"UNSOLD", "LOCKED", "SOLD", "RECYCLED", "WITHDRAWN"},
			"refund_order":     {"PROCESSING", "SUCCEEDED", "FAILED"},
			"card_batch":       {"ACTIVE", "RECALLED"},
			"mail_sends":       {"QUEUED", "SENDING", "SENT", "FAILED"},
			"webhook_delivery": {"PENDING", "DELIVERED", "FAILED", "CANCELLED"},
		}
		for _, tr := range domain.Transitions {
			for _, from := range statuses[tr.Table] {
				key := fmt.Sprintf("%s-%s", strings.ReplaceAll(tr.Name, ".", "-"), from)
				insertRow(t, b, tr.Table, key, from, p.ID)
				n, err := domain.ApplyForTest(b.ctx, db, tr, key)
				if err != nil {
					t.Fatalf("%s from %s: %v", tr.Name, from, err)
				}
				legal := domain.Allowed(tr.Table, from, tr.To) && contains(tr.From, from)
				if (n == 1) != legal {
					t.Errorf("%s from %s: %d rows moved, legal=%v", tr.Name, from, n, legal)
				}
			}
		}
		// The schema repeats the statuses: anything else is refused.
		for table := range statuses {
			if err := tryInsertRow(b, table, "bogus-"+table, "BOGUS", p.ID); err == nil {
				t.Errorf("%s accepted status BOGUS", table)
			}
		}
	})
}

func contains(xs []string, x string) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}

func insertRow(t *testing.T, b *bundle, table, key, status string, productID int64) {
	t.Helper()
	if err := tryInsertRow(b, table, key, status, productID); err != nil {
		t.Fatalf("insert %s %s: %v", table, status, err)
	}
}

func tryInsertRow(b *bundle, table, key, status string, productID int64) error {
	now := b.clock.Now()
	var err error
	switch table {
	case "orders":
		o := &domain.Order{OrderNo: key[:min(len(key), 32)], ProductID: productID, Quantity: 1, UnitPriceFen: 100, AmountFen: 100,
			Contact: "c", Provider: "sandbox", Status: domain.OrderStatus(status), AccessTokenHash: strings.Repeat("0", 64),
			ExpiresAt: now, CreatedAt: now, UpdatedAt: now}
		if status != "PENDING" {
			o.TradeNo = "T" + key
		}
		_, err = b.db.NewInsert().Model(o).Exec(b.ctx)
	case "card_stock":
		var batchID int64
		if err := b.db.NewSelect().Table("card_batch").ColumnExpr("MIN(id)").Where("product_id = ?", productID).Scan(b.ctx, &batchID); err != nil {
			return err
		}
		c := &domain.Card{ProductID: productID, BatchID: batchID, CodeEnc: []byte("x"), Status: domain.CardStatus(status),
			OrderNo: key[:min(len(key), 32)], CreatedAt: now, UpdatedAt: now}
		c.CodeHash = fmt.Sprintf("%064s", strings.ReplaceAll(key, "-", ""))[:64]
		_, err = b.db.NewInsert().Model(c).Exec(b.ctx)
	case "card_batch":
		bt := &domain.Batch{ProductID: productID, Source: domain.BatchFromList, Status: domain.BatchStatus(status),
			SupplierNote: key, Actor: "test", CreatedAt: now, UpdatedAt: now}
		if status == "RECALLED" {
			bt.RecalledAt = now
		}
		_, err = b.db.NewInsert().Model(bt).Exec(b.ctx)
	case "mail_sends":
		m := &domain.MailSend{OrderNo: "o", TradeNo: "t", Cause: domain.MailForPayment, DedupKey: key,
			Status: domain.MailStatus(status), RequestedBy: "test", CreatedAt: now, UpdatedAt: now}
		_, err = b.db.NewInsert().Model(m).Exec(b.ctx)
	case "refund_order":
		r := &domain.Refund{RefundNo: key, OrderNo: "o", Provider: "sandbox", TradeNo: "t", Cause: domain.CauseAdmin,
			AmountFen: 1, PaidFen: 1, Status: domain.RefundStatus(status), CreatedAt: now, UpdatedAt: now}
		_, err = b.db.NewInsert().Model(r).Exec(b.ctx)
	case "webhook_delivery":
		ev := &domain.Event{Type: domain.EventOrderPaid, Subject: "o", OccurredAt: now, Payload: "{}"}
		if _, err := b.db.NewInsert().Model(ev).Exec(b.ctx); err != nil {
			return err
		}
		e := &domain.WebhookEndpoint{URL: "https://example.com", Events: "order.paid", SecretEnc: []byte("x"), CreatedAt: now, UpdatedAt: now}
		if _, err := b.db.NewInsert().Model(e).Exec(b.ctx); err != nil {
			return err
		}
		d := &domain.WebhookDelivery{EventID: ev.ID, EndpointID: e.ID, Status: domain.DeliveryStatus(status), LastError: key, CreatedAt: now, UpdatedAt: now}
		_, err = b.db.NewInsert().Model(d).Exec(b.ctx)
	}
	return err
}

func TestImportCards(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 1250, 0)
		res, err := b.ledger.ImportCards(b.ctx, p.ID, []string{"AAAA-1", " AAAA-2 ", "AAAA-1", "AAAA-3"}, "admin")
		if err != nil || res.Imported != 3 || res.Duplicates != 1 {
			t.Fatalf("first import: %+v, %v; want 3 imported, 1 duplicate", res, err)
		}
		res, err = b.ledger.ImportCards(b.ctx, p.ID, []string{"AAAA-2", "AAAA-4"}, "admin")
		if err != nil || res.Imported != 1 || res.Duplicates != 1 {
			t.Fatalf("second import: %+v, %v; want 1 imported, 1 duplicate", res, err)
		}
		// The same code is a different card in another product.
		q := b.product(t, 500, 0)
		if res, err := b.ledger.ImportCards(b.ctx, q.ID, []string{"AAAA-1"}, "admin"); err != nil || res.Imported != 1 {
			t.Fatalf("other product: %+v, %v", res, err)
		}
		// Codes are sealed at rest: the stored bytes do not contain them.
		var cards []domain.Card
		if err := db.NewSelect().Model(&cards).Where("product_id = ?", p.ID).Order("id").Scan(b.ctx); err != nil {
			t.Fatal(err)
		}
		if len(cards) != 4 {
			t.Fatalf("%d cards stored, want 4", len(cards))
		}
		for i, c := range cards {
			if bytes.Contains(c.CodeEnc, []byte("AAAA")) {
				t.Fatalf("card %d stored in the clear", c.ID)
			}
			code, err := b.ledger.Sealer().Open(c.ProductID, c.CodeEnc)
			if want := fmt.Sprintf("AAAA-%d", i+1); err != nil || code != want {
				t.Fatalf("card %d opens to %q, %v; want %q", c.ID, code, err, want)
			}
			if _, err := b.ledger.Sealer().Open(q.ID, c.CodeEnc); err == nil {
				t.Fatalf("card %d opens under another product", c.ID)
			}
		}
		counts, err := b.ledger.StockCounts(b.ctx, p.ID)
		if err != nil || counts[p.ID].Lockable != 4 {
			t.Fatalf("stock %+v, %v; want 4 lockable", counts, err)
		}

		// Bad input writes nothing.
		for name, codes := range map[string][]string{
			"empty list": nil, "blank code": {"OK-1", "   "}, "oversized": {"OK-2", strings.Repeat("x", domain.MaxCodeBytes+1)},
			"control chars": {"OK-3\x00"}, "too many": make([]string, domain.MaxCodesPerCall+1),
		} {
			_, err := b.ledger.ImportCards(b.ctx, p.ID, codes, "admin")
			wantCode(t, err, domain.EBADINPUT)
			_ = name
		}
		_, err = b.ledger.ImportCards(b.ctx, 999999, []string{"X"}, "admin")
		wantCode(t, err, domain.ENOTFOUND)
		if n, _ := db.NewSelect().Table("card_stock").Where("product_id = ?", p.ID).Count(b.ctx); n != 4 {
			t.Fatalf("%d cards after bad imports, want 4", n)
		}
		b.mustAudit(t)
	})
}

func TestPlaceOrder(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{OrderTTL: 15 * time.Minute, MaxQuantity: 5, MaxPendingPerContact: 3, MaxPendingPerAddress: 4})
		p := b.product(t, 1250, 6)

		placed := b.order(t, p, 2)
		o := placed.Order
		if o.Status != domain.OrderPending || o.AmountFen != 2500 || o.Quantity != 2 || len(o.OrderNo) != 20 {
			t.Fatalf("order %+v", o)
		}
		if want := b.clock.Now().Add(15 * time.Minute); !o.ExpiresAt.Equal(want) {
			t.Fatalf("expires %v, want %v", o.ExpiresAt, want)
		}
		if got := b.cardStatuses(t, o.OrderNo); got[domain.CardLocked] != 2 {
			t.Fatalf("cards %v, want 2 LOCKED", got)
		}
		if !domain.TokenMatches(placed.AccessToken, o.AccessTokenHash) || strings.Contains(o.AccessTokenHash, placed.AccessToken) {
			t.Fatal("access token not stored as its hash")
		}
		if _, err := b.ledger.BuyerOrder(b.ctx, o.OrderNo, "wrong"); domain.ErrorCode(err) != domain.ENOTFOUND {
			t.Fatalf("wrong token: %v", err)
		}
		if got, err := b.ledger.BuyerOrder(b.ctx, o.OrderNo, placed.AccessToken); err != nil || got.OrderNo != o.OrderNo {
			t.Fatalf("right token: %v", err)
		}
		if _, err := b.ledger.DeliveredCodes(b.ctx, o); domain.ErrorCode(err) != domain.ECONFLICT {
			t.Fatalf("codes of an unpaid order: %v", err)
		}

		// Idempotency: the same key is the same order and token.
		in := domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: "k@example.com", Provider: "sandbox", IdempotencyKey: "key-1"}
		first, err := b.ledger.PlaceOrder(b.ctx, in)
		if err != nil {
			t.Fatal(err)
		}
		again, err := b.ledger.PlaceOrder(b.ctx, in)
		if err != nil || !again.Replayed || again.Order.OrderNo != first.Order.OrderNo || again.AccessToken != first.AccessToken {
			t.Fatalf("replay: %+v, %v", again, err)
		}
		in.Quantity = 2
		_, err = b.ledger.PlaceOrder(b.ctx, in)
		wantCode(t, err, domain.ECONFLICT)

		// Bad input and sold out change nothing.
		for _, bad := range []domain.PlaceOrderInput{
			{ProductID: p.ID, Quantity: 0, Contact: "a", Provider: "sandbox"},
			{ProductID: p.ID, Quantity: -1, Contact: "a", Provider: "sandbox"},
			{ProductID: p.ID, Quantity: 6, Contact: "a", Provider: "sandbox"},
			{ProductID: p.ID, Quantity: 1, Contact: " ", Provider: "sandbox"},
			{ProductID: p.ID, Quantity: 1, Contact: strings.Repeat("x", 129), Provider: "sandbox"},
			{ProductID: p.ID, Quantity: 1, Contact: "a", Provider: ""},
		} {
			_, err := b.ledger.PlaceOrder(b.ctx, bad)
			wantCode(t, err, domain.EBADINPUT)
		}
		_, err = b.ledger.PlaceOrder(b.ctx, domain.PlaceOrderInput{ProductID: 424242, Quantity: 1, Contact: "a", Provider: "sandbox"})
		wantCode(t, err, domain.ENOTFOUND)
		_, err = b.ledger.PlaceOrder(b.ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 4, Contact: "a", Provider: "sandbox"})
		wantCode(t, err, domain.ESOLDOUT)
		if n, _ := db.NewSelect().Table("orders").Count(b.ctx); n != 2 {
			t.Fatalf("%d orders after refusals, want 2", n)
		}
		inactive := false
		if _, err := b.ledger.UpdateProduct(b.ctx, p.ID, domain.ProductInput{Active: &inactive}, "admin"); err != nil {
			t.Fatal(err)
		}
		_, err = b.ledger.PlaceOrder(b.ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: "a", Provider: "sandbox"})
		wantCode(t, err, domain.ENOTFOUND)
		b.mustAudit(t)
	})
}

// TestPlaceOrderBatch: orders that arrive together are decided together,
// each on its own: one transaction places the good ones and refuses the
// rest with their own error, first come first served for the last cards
// and the caps, and leaves the ledger as if they had come one by one.
func TestPlaceOrderBatch(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{MaxQuantity: 5, MaxPendingPerContact: 2})
		a := b.product(t, 100, 3)
		c := b.product(t, 700, 10)
		off := b.product(t, 100, 2)
		inactive := false
		if _, err := b.ledger.UpdateProduct(b.ctx, off.ID, domain.ProductInput{Active: &inactive}, "admin"); err != nil {
			t.Fatal(err)
		}
		earlier, err := b.ledger.PlaceOrder(b.ctx, domain.PlaceOrderInput{ProductID: c.ID, Quantity: 1, Contact: "keyed", Provider: "sandbox", IdempotencyKey: "k-1"})
		if err != nil {
			t.Fatal(err)
		}
		in := func(product *domain.Product, qty int, contact, key string) domain.PlaceOrderInput {
			return domain.PlaceOrderInput{ProductID: product.ID, Quantity: qty, Contact: contact, Provider: "sandbox", IdempotencyKey: key}
		}
		batch := []domain.PlaceOrderInput{
			in(a, 2, "first", ""),  // 0: placed, 1 card of a left
			in(a, 2, "second", ""), // 1: SOLD_OUT, only 1 left
			in(a, 1, "third", ""),  // 2: placed, the last card of a
			in(c, 6, "big", ""),    // 3: over MaxQuantity
			in(off, 1, "late", ""), // 4: not on sale
			{ProductID: 424242, Quantity: 1, Contact: "x", Provider: "sandbox"}, // 5: no such product
			in(c, 1, "hoarder", ""),  // 6: placed
			in(c, 1, "hoarder", ""),  // 7: placed, the contact's second
			in(c, 1, "hoarder", ""),  // 8: LIMIT_EXCEEDED, counted within the batch
			in(c, 1, "keyed", "k-1"), // 9: the earlier order, replayed
			in(c, 2, "keyed", "k-1"), // 10: CONFLICT, the key was used for another order
			in(c, 3, "multi", "k-2"), // 11: placed with a new key
		}
		before := b.ledger.PlaceStats()
		placed, errs := b.ledger.PlaceBatchForTest(b.ctx, batch)
		if st := b.ledger.PlaceStats(); st.Batches != before.Batches+1 || st.Calls != before.Calls+int64(len(batch)) || st.Split != before.Split {
			t.Errorf("place stats %+v (before %+v): want the batch placed in one shared transaction", st, before)
		}
		wantErr := map[int]string{1: domain.ESOLDOUT, 3: domain.EBADINPUT, 4: domain.ENOTFOUND, 5: domain.ENOTFOUND, 8: domain.ELIMIT, 10: domain.ECONFLICT}
		orderNos := map[string]bool{}
		for i := range batch {
			if code, refused := wantErr[i]; refused {
				if domain.ErrorCode(errs[i]) != code || placed[i] != nil {
					t.Errorf("order %d: %+v, %v; want %s", i, placed[i], errs[i], code)
				}
				continue
			}
			if errs[i] != nil {
				t.Fatalf("order %d: %v", i, errs[i])
			}
			o := placed[i].Order
			if i == 9 {
				if !placed[i].Replayed || o.OrderNo != earlier.Order.OrderNo {
					t.Errorf("order 9: %+v, want the replay of %s", o, earlier.Order.OrderNo)
				}
				continue
			}
			if placed[i].Replayed || o.Quantity != batch[i].Quantity || o.Contact != batch[i].Contact || o.ProductID != batch[i].ProductID {
				t.Errorf("order %d: %+v for %+v", i, o, batch[i])
			}
			if want := placed[i].Product.PriceFen * int64(batch[i].Quantity); o.AmountFen != want {
				t.Errorf("order %d: amount %d, want %d", i, o.AmountFen, want)
			}
			if got := b.cardStatuses(t, o.OrderNo); got[domain.CardLocked] != batch[i].Quantity || len(got) != 1 {
				t.Errorf("order %d: cards %v, want %d LOCKED", i, got, batch[i].Quantity)
			}
			if !domain.TokenMatches(placed[i].AccessToken, o.AccessTokenHash) {
				t.Errorf("order %d: the access token does not match the stored hash", i)
			}
			if orderNos[o.OrderNo] {
				t.Errorf("order number %s given twice", o.OrderNo)
			}
			orderNos[o.OrderNo] = true
		}
		if n, _ := db.NewSelect().Table("orders").Count(b.ctx); n != 1+5 {
			t.Fatalf("%d orders, want 6 (1 earlier + 5 placed)", n)
		}
		counts, err := b.ledger.StockCounts(b.ctx, a.ID, c.ID)
		if err != nil {
			t.Fatal(err)
		}
		if got := counts[a.ID]; got.Locked != 3 || got.Lockable != 0 {
			t.Errorf("product a: %+v, want 3 locked, none left", got)
		}
		if got := counts[c.ID]; got.Locked != 1+1+1+3 || got.Lockable != 4 {
			t.Errorf("product c: %+v, want 6 locked, 4 left", got)
		}
		b.mustAudit(t)

		// One new key twice in a batch: one order, and the second call
		// gets it back, in the same transaction.
		twice, errs := b.ledger.PlaceBatchForTest(b.ctx, []domain.PlaceOrderInput{in(c, 1, "again", "k-3"), in(c, 1, "again", "k-3")})
		if errs[0] != nil || errs[1] != nil || twice[0].Order.OrderNo != twice[1].Order.OrderNo || twice[0].Replayed == twice[1].Replayed {
			t.Fatalf("one key twice: %+v %+v, %v %v", twice[0], twice[1], errs[0], errs[1])
		}
		if st := b.ledger.PlaceStats(); st.Split != before.Split {
			t.Errorf("place stats %+v: want the second batch placed whole, not split", st)
		}
		b.mustAudit(t)
	})
}

func TestPendingCaps(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{MaxPendingPerContact: 2, MaxPendingPerAddress: 3})
		p := b.product(t, 100, 10)
		place := func(contact, addr string) error {
			_, err := b.ledger.PlaceOrder(b.ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: contact, Provider: "sandbox", ClientAddr: addr})
			return err
		}
		for i := 0; i < 2; i++ {
			if err := place("hoarder", "10.0.0.1"); err != nil {
				t.Fatal(err)
			}
		}
		wantCode(t, place("hoarder", "10.0.0.9"), domain.ELIMIT)
		if err := place("other", "10.0.0.1"); err != nil {
			t.Fatal(err)
		}
		wantCode(t, place("third", "10.0.0.1"), domain.ELIMIT)
		b.mustAudit(t)
	})
}

func TestPayAndDeliver(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 990, 3)
		o := b.order(t, p, 2).Order

		res := b.pay(t, o, "T-1", "N-1")
		if res.Outcome != domain.PaymentDelivered || res.Order.Status != domain.OrderPaid || res.Order.TradeNo != "T-1" || res.Order.DeliveredAt.IsZero() {
			t.Fatalf("pay: %+v %+v", res, res.Order)
		}
		if got := b.cardStatuses(t, o.OrderNo); got[domain.CardSold] != 2 || len(got) != 1 {
			t.Fatalf("cards %v, want 2 SOLD", got)
		}
		codes, err := b.ledger.DeliveredCodes(b.ctx, res.Order)
		if err != nil || len(codes) != 2 || codes[0] != codeFor(p.ID, 0) || codes[1] != codeFor(p.ID, 1) {
			t.Fatalf("codes %v, %v", codes, err)
		}
		// The same notification again, and the same trade under another
		// notification id: nothing changes.
		for _, nid := range []string{"N-1", "N-2"} {
			if res := b.pay(t, o, "T-1", nid); res.Outcome != domain.PaymentDuplicate || res.Order.Status != domain.OrderPaid {
				t.Fatalf("duplicate %s: %+v", nid, res)
			}
		}
		// Wrong amount, wrong provider, unknown order: refused, nothing
		// changed; the first two are recorded as refused (see
		// TestWrongAmountRefusedOnceAlertedOnce).
		_, err = b.ledger.RecordPayment(b.ctx, domain.Payment{Provider: "sandbox", NotifyID: "N-9", OrderNo: o.OrderNo, TradeNo: "T-9", AmountFen: 1})
		wantCode(t, err, domain.EBADINPUT)
		if b.alerts.count("amount_mismatch") != 1 {
			t.Fatalf("alerts %v, want one amount_mismatch", b.alerts.kinds())
		}
		_, err = b.ledger.RecordPayment(b.ctx, domain.Payment{Provider: "alipay", NotifyID: "N-8", OrderNo: o.OrderNo, TradeNo: "T-8", AmountFen: o.AmountFen})
		wantCode(t, err, domain.EBADINPUT)
		_, err = b.ledger.RecordPayment(b.ctx, domain.Payment{Provider: "sandbox", NotifyID: "N-7", OrderNo: "00000000000000000000", TradeNo: "T-7", AmountFen: 990})
		wantCode(t, err, domain.ENOTFOUND)
		_, err = b.ledger.RecordPayment(b.ctx, domain.Payment{Provider: "sandbox", NotifyID: "N-6", OrderNo: strings.Repeat("9", 10_000), TradeNo: "T-6", AmountFen: 990})
		wantCode(t, err, domain.ENOTFOUND)
		if strings.Contains(err.Error(), "99999999999999999999999999999999") {
			t.Fatalf("an oversized order number was echoed: %.80s", err)
		}
		if n, _ := db.NewSelect().Table("payment_notification").Where("result <> ?", "REFUSED").Count(b.ctx); n != 2 {
			t.Fatalf("%d notifications recorded, want 2 (N-1, N-2)", n)
		}
		// A second trade paying the same order is money owed back.
		res = b.pay(t, o, "T-2", "N-3")
		if res.Outcome != domain.PaymentDuplicateRefunds || res.Refund == nil || res.Refund.Cause != domain.CauseDuplicatePayment || res.Order.Status != domain.OrderPaid {
			t.Fatalf("second trade: %+v", res)
		}
		b.mustAudit(t)
	})
}

func TestCloseAndRecycle(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{OrderTTL: 15 * time.Minute})
		p := b.product(t, 100, 2)
		placed := b.order(t, p, 2)
		o := placed.Order

		rs, err := b.ledger.CloseOrders(b.ctx, []string{o.OrderNo, "missing"}, domain.CloseTimeout)
		if err != nil || len(rs) != 2 {
			t.Fatalf("close before due: %v %v", rs, err)
		}
		if byNo(rs, o.OrderNo).Outcome != domain.CloseNotDue || byNo(rs, "missing").Outcome != domain.CloseMissing {
			t.Fatalf("close before due: %+v", rs)
		}
		_, err = b.ledger.PlaceOrder(b.ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: "x", Provider: "sandbox"})
		wantCode(t, err, domain.ESOLDOUT)

		b.clock.Advance(15 * time.Minute)
		rs, err = b.ledger.CloseOrders(b.ctx, []string{o.OrderNo}, domain.CloseTimeout)
		if err != nil || rs[0].Outcome != domain.Closed || rs[0].Released != 2 || rs[0].ProductID != p.ID || rs[0].Inconsistent {
			t.Fatalf("close when due: %+v %v", rs, err)
		}
		if got := b.cardStatuses(t, o.OrderNo); got[domain.CardRecycled] != 2 {
			t.Fatalf("cards %v, want 2 RECYCLED", got)
		}
		// Twice is harmless.
		rs, err = b.ledger.CloseOrders(b.ctx, []string{o.OrderNo}, domain.CloseTimeout)
		if err != nil || rs[0].Outcome != domain.CloseSkipped || rs[0].Status != domain.OrderClosed {
			t.Fatalf("second close: %+v %v", rs, err)
		}
		// Recycled cards are on sale again.
		again := b.order(t, p, 2).Order
		if got := b.cardStatuses(t, again.OrderNo); got[domain.CardLocked] != 2 {
			t.Fatalf("relocked %v", got)
		}
		// A buyer cancels: closed now, before its time.
		_, err = b.ledger.CancelOrder(b.ctx, again.OrderNo, "not the token")
		wantCode(t, err, domain.ENOTFOUND)
		r, err := b.ledger.CancelOrder(b.ctx, again.OrderNo, b.ledger.Sealer().AccessToken(again.OrderNo))
		if err != nil || r.Outcome != domain.Closed || r.Released != 2 {
			t.Fatalf("cancel: %+v %v", r, err)
		}
		_, err = b.ledger.CancelOrder(b.ctx, again.OrderNo, b.ledger.Sealer().AccessToken(again.OrderNo))
		wantCode(t, err, domain.ECONFLICT)
		// A paid order is never closed.
		paid := b.order(t, p, 1).Order
		b.pay(t, paid, "T-P", "N-P")
		b.clock.Advance(time.Hour)
		rs, _ = b.ledger.CloseOrders(b.ctx, []string{paid.OrderNo}, domain.CloseTimeout)
		if rs[0].Outcome != domain.CloseSkipped || rs[0].Status != domain.OrderPaid {
			t.Fatalf("close of a paid order: %+v", rs)
		}
		b.mustAudit(t)
		if len(b.alerts.kinds()) != 0 {
			t.Fatalf("alerts %v", b.alerts.kinds())
		}
	})
}

func TestCloseWithoutLockedCardsAlerts(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 1)
		o := b.order(t, p, 1).Order
		// Damage: the order's card vanished from under it.
		if _, err := db.NewUpdate().Table("card_stock").Set("status = ?", domain.CardUnsold).Where("order_no = ?", o.OrderNo).Exec(b.ctx); err != nil {
			t.Fatal(err)
		}
		b.clock.Advance(time.Hour)
		rs, err := b.ledger.CloseOrders(b.ctx, []string{o.OrderNo}, domain.CloseTimeout)
		if err != nil || rs[0].Outcome != domain.Closed || !rs[0].Inconsistent || rs[0].Released != 0 {
			t.Fatalf("close: %+v %v", rs, err)
		}
		if b.alerts.count("inconsistency") != 1 {
			t.Fatalf("alerts %v, want one inconsistency", b.alerts.kinds())
		}
	})
}

func byNo(rs []domain.CloseResult, no string) domain.CloseResult {
	for _, r := range rs {
		if r.OrderNo == no {
			return r
		}
	}
	return domain.CloseResult{}
}

// TestRecordPaymentBatch: payments that arrive together get the outcome
// each would get alone. The usual ones share a transaction; the others (a
// late payment, a repeat in the same batch, a second trade, a mismatch)
// take the one-by-one path; and when the shared transaction meets a
// surprise, its payments are recorded one by one too, so a poisoned
// notification fails only itself.
func TestRecordPaymentBatch(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 300, 20)
		order := func(qty int) *domain.Order { return b.order(t, p, qty).Order }
		closed, paid := order(1), order(1)
		b.pay(t, paid, "T-PAID", "N-PAID")
		b.clock.Advance(time.Hour)
		if _, err := b.ledger.CloseOrders(b.ctx, []string{closed.OrderNo}, domain.CloseTimeout); err != nil {
			t.Fatal(err)
		}
		b.clock.Advance(-time.Hour)
		one, two, three := order(1), order(2), order(3)
		pay := func(o *domain.Order, trade, notify string) domain.Payment {
			return domain.Payment{Provider: o.Provider, NotifyID: notify, OrderNo: o.OrderNo, TradeNo: trade, AmountFen: o.AmountFen, Raw: "{}"}
		}
		wrong := pay(three, "T-WRONG", "N-WRONG")
		wrong.AmountFen = 1
		batch := []domain.Payment{
			pay(one, "T-1", "N-1"),          // 0: delivered
			pay(two, "T-2", "N-2"),          // 1: delivered
			pay(one, "T-1", "N-1"),          // 2: the same notification again: duplicate
			pay(closed, "T-LATE", "N-LATE"), // 3: late: refunded
			pay(paid, "T-AGAIN", "N-AGAIN"), // 4: a second trade: refunded
			wrong,                           // 5: amount mismatch: refused
			{Provider: "sandbox", NotifyID: "N-X", OrderNo: "00000000000000000000", TradeNo: "T-X", AmountFen: 300}, // 6: unknown
			pay(three, "T-3", "N-3"), // 7: delivered
		}
		before := b.ledger.PayStats()
		res, errs := b.ledger.RecordPaymentsForTest(b.ctx, batch)
		if st := b.ledger.PayStats(); st.Batches != before.Batches+1 || st.Calls != before.Calls+3 || st.Split != before.Split {
			t.Errorf("pay stats %+v (before %+v): want the 3 usual payments delivered in one shared transaction", st, before)
		}
		want := []domain.PaymentOutcome{domain.PaymentDelivered, domain.PaymentDelivered, domain.PaymentDuplicate,
			domain.PaymentLateRefund, domain.PaymentDuplicateRefunds, "", "", domain.PaymentDelivered}
		wantErr := map[int]string{5: domain.EBADINPUT, 6: domain.ENOTFOUND}
		for i := range batch {
			if code, refused := wantErr[i]; refused {
				if domain.ErrorCode(errs[i]) != code || res[i] != nil {
					t.Errorf("payment %d: %+v, %v; want %s", i, res[i], errs[i], code)
				}
				continue
			}
			if errs[i] != nil || res[i].Outcome != want[i] || res[i].Order.OrderNo != batch[i].OrderNo {
				t.Errorf("payment %d: %+v, %v; want %s", i, res[i], errs[i], want[i])
			}
		}
		for _, o := range []*domain.Order{one, two, three} {
			got, _ := b.ledger.Order(b.ctx, o.OrderNo)
			if got.Status != domain.OrderPaid || got.PaidFen != o.AmountFen || got.DeliveredAt.IsZero() {
				t.Errorf("order %s: %+v, want PAID and delivered", o.OrderNo, got)
			}
			if cards := b.cardStatuses(t, o.OrderNo); cards[domain.CardSold] != o.Quantity || len(cards) != 1 {
				t.Errorf("order %s: cards %v, want %d SOLD", o.OrderNo, cards, o.Quantity)
			}
		}
		if b.alerts.count("amount_mismatch") != 1 {
			t.Errorf("alerts %v, want one amount_mismatch", b.alerts.kinds())
		}
		if n, _ := db.NewSelect().Table("refund_order").Count(b.ctx); n != 2 {
			t.Errorf("%d refunds, want 2 (late, second trade)", n)
		}
		b.mustAudit(t)

		// A notification id seen before, now on another order that is
		// still PENDING, fails the shared insert: the batch is recorded one
		// by one, the good payment is delivered and the replayed id
		// changes nothing.
		four, five := order(1), order(1)
		res, errs = b.ledger.RecordPaymentsForTest(b.ctx, []domain.Payment{pay(four, "T-4", "N-4"), pay(five, "T-5", "N-1")})
		if errs[0] != nil || res[0].Outcome != domain.PaymentDelivered || errs[1] != nil || res[1].Outcome != domain.PaymentDuplicate || res[1].Order.Status != domain.OrderPending {
			t.Fatalf("poisoned batch: %+v %v, %+v %v", res[0], errs[0], res[1], errs[1])
		}
		if st := b.ledger.PayStats(); st.Split != before.Split+1 {
			t.Errorf("pay stats %+v: want the poisoned batch split", st)
		}
		if cards := b.cardStatuses(t, five.OrderNo); cards[domain.CardLocked] != 1 {
			t.Fatalf("the replayed id moved cards: %v", cards)
		}
		b.mustAudit(t)
	})
}

func TestLatePaymentRefunds(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 1)
		o := b.order(t, p, 1).Order
		b.clock.Advance(time.Hour)
		if _, err := b.ledger.CloseOrders(b.ctx, []string{o.OrderNo}, domain.CloseTimeout); err != nil {
			t.Fatal(err)
		}
		res := b.pay(t, o, "T-LATE", "N-1")
		if res.Outcome != domain.PaymentLateRefund || res.Refund == nil || res.Order.Status != domain.OrderRefunding || res.Order.TradeNo != "T-LATE" {
			t.Fatalf("late payment: %+v", res)
		}
		if res.Refund.Status != domain.RefundProcessing || res.Refund.AmountFen != o.AmountFen || res.Refund.Cause != domain.CauseLatePayment {
			t.Fatalf("refund %+v", res.Refund)
		}
		// Redelivered, or with another notification id: still one refund.
		for _, nid := range []string{"N-1", "N-2"} {
			if r := b.pay(t, o, "T-LATE", nid); r.Outcome != domain.PaymentDuplicate {
				t.Fatalf("again %s: %+v", nid, r)
			}
		}
		if n, _ := db.NewSelect().Table("refund_order").Count(b.ctx); n != 1 {
			t.Fatalf("%d refunds, want 1", n)
		}
		if got := b.cardStatuses(t, o.OrderNo); got[domain.CardRecycled] != 1 {
			t.Fatalf("cards %v: a late payment must not take cards back", got)
		}
		r, changed, err := b.ledger.RefundSucceeded(b.ctx, res.Refund.RefundNo, "P-1")
		if err != nil || !changed || r.Status != domain.RefundSucceeded {
			t.Fatalf("succeeded: %+v %v %v", r, changed, err)
		}
		if _, changed, _ := b.ledger.RefundSucceeded(b.ctx, res.Refund.RefundNo, "P-1"); changed {
			t.Fatal("second confirmation changed something")
		}
		if got, _ := b.ledger.Order(b.ctx, o.OrderNo); got.Status != domain.OrderRefunded || got.RefundedAt.IsZero() {
			t.Fatalf("order %+v, want REFUNDED", got)
		}
		b.mustAudit(t)
	})
}

func TestLatePaymentDeliverPolicy(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{LatePayment: domain.LateDeliver})
		p := b.product(t, 100, 1)
		first := b.order(t, p, 1).Order
		b.clock.Advance(time.Hour)
		b.ledger.CloseOrders(b.ctx, []string{first.OrderNo}, domain.CloseTimeout)
		// Its card is still free: delivered after all.
		res := b.pay(t, first, "T-1", "N-1")
		if res.Outcome != domain.PaymentLateDelivered || res.Order.Status != domain.OrderPaid || res.Order.DeliveredAt.IsZero() {
			t.Fatalf("late deliver: %+v", res)
		}
		if got := b.cardStatuses(t, first.OrderNo); got[domain.CardSold] != 1 {
			t.Fatalf("cards %v", got)
		}

		q := b.product(t, 100, 1)
		second := b.order(t, q, 1).Order
		b.clock.Advance(time.Hour)
		b.ledger.CloseOrders(b.ctx, []string{second.OrderNo}, domain.CloseTimeout)
		third := b.order(t, q, 1).Order // takes the recycled card
		res = b.pay(t, second, "T-2", "N-2")
		if res.Outcome != domain.PaymentLateRefund || res.Refund == nil {
			t.Fatalf("card taken: %+v, want a refund", res)
		}
		if got := b.cardStatuses(t, third.OrderNo); got[domain.CardLocked] != 1 {
			t.Fatalf("the third order lost its card: %v", got)
		}
		b.mustAudit(t)
	})
}

func TestRefundRetriesAndAdminRefund(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		backoff := []time.Duration{time.Minute, 5 * time.Minute}
		b := setup(t, db, domain.Config{RefundBackoff: backoff})
		p := b.product(t, 100, 2)
		o := b.order(t, p, 1).Order
		b.pay(t, o, "T-1", "N-1")

		_, err := b.ledger.RequestRefund(b.ctx, "nope", "", "admin")
		wantCode(t, err, domain.ENOTFOUND)
		r, err := b.ledger.RequestRefund(b.ctx, o.OrderNo, "buyer asked", "admin")
		if err != nil || r.Cause != domain.CauseAdmin || r.AmountFen != o.AmountFen || r.TradeNo != "T-1" {
			t.Fatalf("refund: %+v %v", r, err)
		}
		_, err = b.ledger.RequestRefund(b.ctx, o.OrderNo, "again", "admin")
		wantCode(t, err, domain.ECONFLICT)
		pending := b.order(t, p, 1).Order
		_, err = b.ledger.RequestRefund(b.ctx, pending.OrderNo, "", "admin")
		wantCode(t, err, domain.ECONFLICT)

		// Attempts walk the backoff; a stale report changes nothing.
		now := b.clock.Now()
		r, err = b.ledger.RefundAttemptFailed(b.ctx, r.RefundNo, 0, "timeout")
		if err != nil || r.Status != domain.RefundProcessing || r.RetryCount != 1 || !r.NextRetryAt.Equal(now.Add(time.Minute)) || r.LastError != "timeout" {
			t.Fatalf("attempt 1: %+v %v", r, err)
		}
		if r2, _ := b.ledger.RefundAttemptFailed(b.ctx, r.RefundNo, 0, "timeout"); r2.RetryCount != 1 {
			t.Fatalf("stale attempt counted: %+v", r2)
		}
		due, _ := b.ledger.DueRefunds(b.ctx, now.Add(30*time.Second), 10)
		if len(due) != 0 {
			t.Fatalf("due too early: %v", due)
		}
		due, _ = b.ledger.DueRefunds(b.ctx, now.Add(time.Minute), 10)
		if len(due) != 1 {
			t.Fatalf("not due after the backoff: %v", due)
		}
		r, _ = b.ledger.RefundAttemptFailed(b.ctx, r.RefundNo, 1, "HTTP 503")
		if r.Status != domain.RefundProcessing || !r.NextRetryAt.Equal(now.Add(5*time.Minute)) {
			t.Fatalf("attempt 2: %+v", r)
		}
		r, _ = b.ledger.RefundAttemptFailed(b.ctx, r.RefundNo, 2, "SYSTEM_ERROR")
		if r.Status != domain.RefundFailed || r.RetryCount != 3 || b.alerts.count("refund_failed") != 1 {
			t.Fatalf("gave up: %+v alerts %v", r, b.alerts.kinds())
		}
		r, err = b.ledger.RetryRefund(b.ctx, r.RefundNo, "admin")
		if err != nil || r.Status != domain.RefundProcessing || r.RetryCount != 0 {
			t.Fatalf("retry: %+v %v", r, err)
		}
		_, err = b.ledger.RetryRefund(b.ctx, r.RefundNo, "admin")
		wantCode(t, err, domain.ECONFLICT)
		_, changed, err := b.ledger.RefundSucceeded(b.ctx, r.RefundNo, "")
		if err != nil || !changed {
			t.Fatal(err)
		}
		got, _ := b.ledger.Order(b.ctx, o.OrderNo)
		if got.Status != domain.OrderRefunded {
			t.Fatalf("order %s", got.Status)
		}
		// The refunded order's cards stay SOLD: their codes were shown.
		if cs := b.cardStatuses(t, o.OrderNo); cs[domain.CardSold] != 1 {
			t.Fatalf("cards %v", cs)
		}
		var entries []domain.AuditEntry
		db.NewSelect().Model(&entries).Where("action IN (?)", bun.List([]string{"order.refund", "refund.retry"})).Scan(b.ctx)
		if len(entries) != 2 {
			t.Fatalf("audit log %+v", entries)
		}
		b.mustAudit(t)
	})
}

func TestRefundEvents(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 1)
		o := b.order(t, p, 1).Order
		b.clock.Advance(time.Hour)
		b.ledger.CloseOrders(b.ctx, []string{o.OrderNo}, domain.CloseTimeout)
		ref := b.pay(t, o, "T-1", "N-1").Refund

		_, _, err := b.ledger.RecordRefundEvent(b.ctx, domain.RefundEvent{Provider: "sandbox", NotifyID: "RN-0", RefundNo: "RL-unknown", Succeeded: true})
		wantCode(t, err, domain.ENOTFOUND)
		r, changed, err := b.ledger.RecordRefundEvent(b.ctx, domain.RefundEvent{Provider: "sandbox", NotifyID: "RN-1", RefundNo: ref.RefundNo, Succeeded: false, Detail: "bank card closed"})
		if err != nil || !changed || r.RetryCount != 1 || r.Status != domain.RefundProcessing {
			t.Fatalf("failure event: %+v %v %v", r, changed, err)
		}
		if r, changed, _ := b.ledger.RecordRefundEvent(b.ctx, domain.RefundEvent{Provider: "sandbox", NotifyID: "RN-1", RefundNo: ref.RefundNo}); changed || r.RetryCount != 1 {
			t.Fatalf("redelivered failure counted again: %+v", r)
		}
		r, changed, err = b.ledger.RecordRefundEvent(b.ctx, domain.RefundEvent{Provider: "sandbox", NotifyID: "RN-2", RefundNo: ref.RefundNo, Succeeded: true})
		if err != nil || !changed || r.Status != domain.RefundSucceeded {
			t.Fatalf("success event: %+v %v %v", r, changed, err)
		}
		b.mustAudit(t)
	})
}

func TestAuditFindsDamage(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 4)
		paid := b.order(t, p, 1).Order
		b.pay(t, paid, "T-1", "N-1")
		pending := b.order(t, p, 1).Order
		b.mustAudit(t)

		// A paid order loses its sold card to the shelf; a pending order's
		// card is sold without payment; a refund is doubled.
		exec := func(q string, args ...any) {
			t.Helper()
			if _, err := db.ExecContext(b.ctx, q, args...); err != nil {
				t.Fatalf("%s: %v", q, err)
			}
		}
		exec("UPDATE card_stock SET status = 'UNSOLD' WHERE order_no = ?", paid.OrderNo)
		exec("UPDATE card_stock SET status = 'SOLD' WHERE order_no = ?", pending.OrderNo)
		now := b.clock.Now()
		for _, no := range []string{"R-1", "R-2"} {
			db.NewInsert().Model(&domain.Refund{RefundNo: no, OrderNo: paid.OrderNo, Provider: "sandbox", TradeNo: "T-1",
				Cause: domain.CauseLatePayment, AmountFen: 100, PaidFen: 100, Status: domain.RefundProcessing, CreatedAt: now, UpdatedAt: now}).Exec(b.ctx)
		}
		vs, err := b.ledger.Audit(b.ctx)
		if err != nil {
			t.Fatal(err)
		}
		rules := map[string]bool{}
		for _, v := range vs {
			rules[v.Rule] = true
		}
		for _, want := range []string{"delivered_card_count", "pending_card_count", "sold_without_delivery", "refund_per_payment", "stock_flow"} {
			if !rules[want] {
				t.Errorf("audit missed %s; found %v", want, vs)
			}
		}
	})
}

func TestBadDatabaseURL(t *testing.T) {
	t.Parallel()
	for _, u := range []string{"oracle://x", "mysql://", "mysql://host", "postgres://%zz"} {
		if _, err := domain.OpenDB(t.Context(), u, t.TempDir(), domain.DBOptions{}); err == nil || !strings.Contains(err.Error(), "KAMI_DATABASE_URL") {
			t.Errorf("OpenDB(%q) = %v, want an error naming KAMI_DATABASE_URL", u, err)
		}
	}
}
