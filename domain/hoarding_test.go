package domain_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/uptrace/bun"

	"kami/domain"
	"kami/domain/dbtest"
	"kami/providers"
	"kami/providers/sandbox"
)

func TestNormalizeContact(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"buyer@example.com":    "buyer@example.com",
		"  Buyer@Example.COM ": "buyer@example.com",
		"ｂｕｙｅｒ＠ｅｘａｍｐｌｅ．ｃｏｍ":                      "buyer@example.com", // full-width, as Chinese IMEs type it
		"buy\u200ber@exa\u00admple.com":          "buyer@example.com", // zero-width space, soft hyphen
		"bu yer@example.com\t":                   "buyer@example.com",
		"a+tag@example.com":                      "a+tag@example.com", // a real, other address
		"+86 138-0013-8000":                      "13800138000",
		"(0086) 13800138000":                     "13800138000",
		"8613800138000":                          "13800138000",
		"１３８ ００１３ ８０００":                          "13800138000",
		"13800138000":                            "13800138000",
		"+1 (415) 555-0100":                      "+14155550100",
		"010-6552-9988":                          "01065529988",
		"QQ 12345678":                            "qq12345678",
		"12345678":                               "12345678",
		"Weixin_ID":                              "weixin_id",
		"İstanbul@example.com":                   "istanbul@example.com",
		"\u212a\u212b@example.com":               "kå@example.com", // Kelvin and Ångström signs
		"1.2":                                    "1.2",
		"\ufeff\u2060":                           "",
		strings.Repeat("x", 10) + "\u3000" + "y": "xxxxxxxxxxy", // ideographic space
	} {
		if got := domain.NormalizeContact(in); got != want {
			t.Errorf("NormalizeContact(%q) = %q, want %q", in, got, want)
		}
	}
}

// FuzzNormalizeContact: normalizing is idempotent and never yields white
// space or invalid UTF-8.
func FuzzNormalizeContact(f *testing.F) {
	for _, s := range []string{"Buyer@Example.com", "＋８６ １３８", "İı\u0307ǅ", "ﬃ\u212a", "0086-(1)"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if !utf8.ValidString(s) {
			return
		}
		once := domain.NormalizeContact(s)
		if twice := domain.NormalizeContact(once); twice != once {
			t.Fatalf("%q → %q → %q", s, once, twice)
		}
		if strings.ContainsFunc(once, func(r rune) bool { return r == ' ' || r == '\t' || r == '\n' || r == '\u3000' }) {
			t.Fatalf("%q → %q has white space", s, once)
		}
	})
}

func TestAddressKey(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"203.0.113.7":            "203.0.113.7",
		"::ffff:203.0.113.7":     "203.0.113.7",
		"2001:db8:1:2:3:4:5:6":   "2001:db8:1:2::/64",
		"2001:db8:1:2:ffff::1":   "2001:db8:1:2::/64", // the same household
		"fe80::1%eth0":           "fe80::/64",
		"2001:db8:1:2::/64":      "2001:db8:1:2::/64", // already a key
		"not an address":         "not an address",
		strings.Repeat("z", 100): strings.Repeat("z", 64),
		"":                       "",
	} {
		if got := domain.AddressKey(in); got != want {
			t.Errorf("AddressKey(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestLockedQuantityCaps: the cards one contact and one address hold in
// unpaid orders are capped, counted across earlier orders and within one
// batch, and contacts are counted in their normalized form.
func TestLockedQuantityCaps(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{MaxQuantity: 100, MaxLockedPerContact: 10, MaxLockedPerAddress: 25})
		p := b.product(t, 100, 60)
		in := func(qty int, contact, addr string) domain.PlaceOrderInput {
			return domain.PlaceOrderInput{ProductID: p.ID, Quantity: qty, Contact: contact, Provider: "sandbox", ClientAddr: addr}
		}
		place := func(in domain.PlaceOrderInput) error {
			_, err := b.ledger.PlaceOrder(b.ctx, in)
			return err
		}
		if err := place(in(6, "hoarder@example.com", "203.0.113.1")); err != nil {
			t.Fatal(err)
		}
		// The same contact in other clothes: 6 + 5 > 10.
		wantCode(t, place(in(5, " HOARDER@Example.com", "203.0.113.2")), domain.ELIMIT)
		wantCode(t, place(in(5, "ｈｏａｒｄｅｒ＠ｅｘａｍｐｌｅ．ｃｏｍ", "203.0.113.2")), domain.ELIMIT)
		if err := place(in(4, "Hoarder@example.com", "203.0.113.2")); err != nil {
			t.Fatalf("up to the cap: %v", err)
		}
		// One order larger than the cap is refused whatever is held.
		wantCode(t, place(in(11, "new@example.com", "203.0.113.3")), domain.ELIMIT)

		// Per address, within one batch: 25 cards from one /64.
		batch := []domain.PlaceOrderInput{
			in(10, "a@example.com", "2001:db8:0:1::1"),
			in(10, "b@example.com", "2001:db8:0:1::2"),
			in(6, "c@example.com", "2001:db8:0:1::3"),  // 26 > 25
			in(5, "d@example.com", "2001:db8:0:1::4"),  // 25
			in(10, "e@example.com", "2001:db8:0:2::1"), // another /64
		}
		_, errs := b.ledger.PlaceBatchForTest(b.ctx, batch)
		for i, want := range []string{"", "", domain.ELIMIT, "", ""} {
			if got := domain.ErrorCode(errs[i]); errs[i] != nil && got != want || errs[i] == nil && want != "" {
				t.Errorf("batch order %d: %v, want %q", i, errs[i], want)
			}
		}
		var contacts []string
		if err := db.NewSelect().Table("orders").Column("contact").Where("contact LIKE ?", "hoarder%").Scan(b.ctx, &contacts); err != nil {
			t.Fatal(err)
		}
		if len(contacts) != 2 || contacts[0] != "hoarder@example.com" || contacts[1] != "hoarder@example.com" {
			t.Errorf("stored contacts %q, want both normalized", contacts)
		}
		var addrs []string
		if err := db.NewSelect().Table("orders").ColumnExpr("DISTINCT client_addr").Where("client_addr LIKE ?", "2001:%").Scan(b.ctx, &addrs); err != nil {
			t.Fatal(err)
		}
		if len(addrs) != 2 {
			t.Errorf("stored IPv6 addresses %q, want the two /64s", addrs)
		}
		b.mustAudit(t)
	})
}

// TestIdempotencyKeyIsScopedToTheAddress: a key replays its order, token
// included, only to the address that placed it; from anywhere else it is
// another key, and the raw key is not stored.
func TestIdempotencyKeyIsScopedToTheAddress(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 100, 5)
		in := domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: "victim@example.com", Provider: "sandbox",
			IdempotencyKey: "checkout-1", ClientAddr: "198.51.100.10"}
		first, err := b.ledger.PlaceOrder(b.ctx, in)
		if err != nil {
			t.Fatal(err)
		}
		retry, err := b.ledger.PlaceOrder(b.ctx, in)
		if err != nil || !retry.Replayed || retry.AccessToken != first.AccessToken {
			t.Fatalf("retry from the same address: %+v, %v", retry, err)
		}
		// The same contact written differently is the same order.
		in.Contact = "Victim@Example.com"
		if retry, err := b.ledger.PlaceOrder(b.ctx, in); err != nil || !retry.Replayed {
			t.Fatalf("retry with the contact in capitals: %+v, %v", retry, err)
		}
		thief := in
		thief.ClientAddr = "192.0.2.66"
		stolen, err := b.ledger.PlaceOrder(b.ctx, thief)
		if err != nil {
			t.Fatal(err)
		}
		if stolen.Replayed || stolen.Order.OrderNo == first.Order.OrderNo || stolen.AccessToken == first.AccessToken {
			t.Fatalf("the same key from another address got %+v: the first order's token", stolen)
		}
		if n, _ := db.NewSelect().Table("orders").Where("idempotency_key = ?", "checkout-1").Count(b.ctx); n != 0 {
			t.Errorf("%d orders store the raw key", n)
		}
	})
}

// TestWrongAmountRefusedOnceAlertedOnce: a signed notification whose amount
// does not match is refused and alerted the first time; its redeliveries
// are acknowledged without another alert, and it is never delivered.
func TestWrongAmountRefusedOnceAlertedOnce(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{})
		p := b.product(t, 1250, 2)
		o := b.order(t, p, 1).Order
		wrong := domain.Payment{Provider: "sandbox", NotifyID: "N-W", OrderNo: o.OrderNo, TradeNo: "T-W", AmountFen: 1, PaidAt: time.Now()}
		_, err := b.ledger.RecordPayment(b.ctx, wrong)
		wantCode(t, err, domain.EBADINPUT)
		for range 3 {
			res, err := b.ledger.RecordPayment(b.ctx, wrong)
			if err != nil || res.Outcome != domain.PaymentDuplicate || res.Order.Status != domain.OrderPending {
				t.Fatalf("redelivery: %+v, %v; want acknowledged, nothing changed", res, err)
			}
		}
		if n := b.alerts.count("amount_mismatch"); n != 1 {
			t.Errorf("%d amount_mismatch alerts, want 1", n)
		}
		var results []string
		if err := db.NewSelect().Table("payment_notification").Column("result").Where("order_no = ?", o.OrderNo).Scan(b.ctx, &results); err != nil {
			t.Fatal(err)
		}
		if len(results) != 1 || results[0] != "REFUSED" {
			t.Errorf("notifications %v, want one REFUSED", results)
		}
		got, _ := b.ledger.Order(b.ctx, o.OrderNo)
		if got.Status != domain.OrderPending || got.PaidFen != 0 || b.cardStatuses(t, o.OrderNo)[domain.CardLocked] != 1 {
			t.Errorf("order after a wrong amount: %+v", got)
		}
		// The right payment still delivers.
		if res := b.pay(t, o, "T-R", "N-R"); res.Outcome != domain.PaymentDelivered {
			t.Fatalf("the right payment: %+v", res)
		}
		b.mustAudit(t)
	})
}

func TestOrderStatuses(t *testing.T) {
	t.Parallel()
	b := setup(t, dbtest.Open(t, dbtest.SQLite), domain.Config{})
	p := b.product(t, 100, 2)
	o1, o2 := b.order(t, p, 1).Order, b.order(t, p, 1).Order
	b.pay(t, o2, "T-2", "N-2")
	got, err := b.ledger.OrderStatuses(b.ctx, []string{o1.OrderNo, o2.OrderNo, "nope"})
	if err != nil || len(got) != 2 || got[o1.OrderNo] != domain.OrderPending || got[o2.OrderNo] != domain.OrderPaid {
		t.Fatalf("statuses %v, %v", got, err)
	}
}

// hookGate is an in-memory stock gate that runs next, once, after the Take
// it is armed for has been decided: a way to have another order arrive
// while that one is in flight, between its admission and the ledger's
// answer, without timing.
type hookGate struct {
	memGate
	next func()
}

func (g *hookGate) Take(ctx context.Context, productID int64, qty int) (bool, error) {
	ok, err := g.memGate.Take(ctx, productID, qty)
	if next := g.next; next != nil {
		g.next = nil
		next()
	}
	return ok, err
}

// hookedShop is a shop on b's ledger with the sandbox and a hookGate
// holding n admissions of the product.
func hookedShop(t *testing.T, b *bundle, productID int64, n int) (*domain.Shop, *hookGate) {
	t.Helper()
	sb, err := sandbox.New(sandbox.Config{Secret: "hoarding-test", BaseURL: "http://shop.test"})
	if err != nil {
		t.Fatal(err)
	}
	gate := &hookGate{memGate: memGate{n: map[int64]int{productID: n}}}
	return &domain.Shop{Ledger: b.ledger, Providers: providers.NewRegistry(sb), Gate: gate}, gate
}

// TestCappedAddressCannotHoldTheGate: the stock gate admits an order
// before the ledger counts the caps, so an address already holding all the
// cards it may lock had every order it sent admitted, and refused only
// once the ledger answered. While those orders were in flight their
// admissions held the stock: one client at its cap, sending orders in
// parallel, left every other buyer SOLD_OUT with cards free. What an
// address holds in flight is now capped by its caps too, so it never
// holds more than one cap's worth of admissions beyond its orders.
func TestCappedAddressCannotHoldTheGate(t *testing.T) {
	t.Parallel()
	dbtest.Each(t, func(t *testing.T, db *bun.DB) {
		b := setup(t, db, domain.Config{MaxQuantity: 100, MaxLockedPerAddress: 2, MaxPendingPerAddress: 2})
		p := b.product(t, 100, 6)
		shop, gate := hookedShop(t, b, p.ID, 6)
		contacts := 0
		order := func(qty int, addr string) error {
			contacts++
			_, err := shop.PlaceOrder(b.ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: qty,
				Contact: fmt.Sprintf("buyer%d@example.com", contacts), Provider: "sandbox", ClientAddr: addr}, "", addr)
			return err
		}
		const hoarder = "203.0.113.9"
		if err := order(2, hoarder); err != nil {
			t.Fatalf("the hoarder's first order, up to its cap: %v", err)
		}
		// The hoarder sends four more orders of one card, each arriving
		// while the ones before are in flight; then a buyer orders one.
		var buyerErr error
		var refused int
		var hold func(k int)
		hold = func(k int) {
			if k == 0 {
				buyerErr = order(1, "198.51.100.1")
				return
			}
			gate.next = func() { hold(k - 1) }
			if err := order(1, hoarder); domain.ErrorCode(err) == domain.ELIMIT {
				refused++
			} else {
				t.Errorf("a hoarder at its cap: %v, want LIMIT_EXCEEDED", err)
			}
			if gate.next != nil { // refused before the gate
				gate.next = nil
				hold(k - 1)
			}
		}
		hold(4)
		if buyerErr != nil {
			t.Errorf("a buyer while the hoarder's orders were in flight, 4 cards free: %v", buyerErr)
		}
		if refused != 4 {
			t.Errorf("%d of the hoarder's 4 orders refused", refused)
		}
		if n := gate.count(p.ID); n != 3 {
			t.Errorf("gate holds %d admissions, want 3 (6 less the hoarder's 2 and the buyer's 1)", n)
		}
	})
}

// TestAPanicGivesItsPlaceInFlightBack: an order whose placing panics (the
// server recovers and answers INTERNAL) leaves its address's orders in
// flight as they were; a place kept would refuse that address, at a cap
// of one order, for the life of the process.
func TestAPanicGivesItsPlaceInFlightBack(t *testing.T) {
	t.Parallel()
	db := dbtest.Open(t, dbtest.SQLite)
	b := setup(t, db, domain.Config{MaxQuantity: 100, MaxPendingPerAddress: 1})
	p := b.product(t, 100, 2)
	shop, gate := hookedShop(t, b, p.ID, 2)
	const addr = "203.0.113.7"
	order := func(contact string) (err error) {
		defer func() {
			if r := recover(); r != nil {
				err = fmt.Errorf("panic: %v", r)
			}
		}()
		_, err = shop.PlaceOrder(b.ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1,
			Contact: contact, Provider: "sandbox", ClientAddr: addr}, "", addr)
		return err
	}
	gate.next = func() { panic("the gate broke") }
	if err := order("first@example.com"); err == nil || !strings.HasPrefix(err.Error(), "panic: ") {
		t.Fatalf("the order whose gate panicked: %v", err)
	}
	// The panicked order placed nothing; to its address a second order is
	// its first in flight and its first pending.
	if err := order("second@example.com"); err != nil {
		t.Fatalf("the address's next order after a panic: %v, want it placed", err)
	}
}
