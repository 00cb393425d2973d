package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"kami/domain"
	"kami/domain/dbtest"
)

// TestPayPageInBrowser leaves a sandbox pay page open in headless Chromium
// past its order's expiry: it turns to "expired" by itself, follows the
// order until kami closes it, then a click on "simulate a late payment"
// shows kami refunding the payment, to REFUNDED, without another click.
func TestPayPageInBrowser(t *testing.T) {
	t.Parallel()
	chromiumPath(t) // skip (or fail in CI) before starting anything
	ta := newTestApp(t, dbtest.SQLite, nil)
	if err := ta.start(t.Context()); err != nil { // workers: closes and refunds
		t.Fatal(err)
	}
	p := ta.product(t, 800, "LATE-CODE-1", "LATE-CODE-2", "LATE-CODE-3", "LATE-CODE-4")

	b := launchChromium(t, func(string, string, json.RawMessage) {}, "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1")
	ctx, cancel := context.WithTimeout(t.Context(), 4*time.Minute)
	defer cancel()
	pg, err := b.newPage(ctx)
	if err != nil {
		t.Fatal(err)
	}
	state := func() (title, status string, hasPay, hasLate bool) {
		var s struct {
			Title, Status   string
			HasPay, HasLate bool
		}
		pg.eval(ctx, `({title: document.getElementById('title')?.textContent || '', status: document.getElementById('status')?.textContent || '',
			hasPay: !!document.getElementById('pay'), hasLate: !!document.querySelector('form.late')})`, &s)
		return s.Title, s.Status, s.HasPay, s.HasLate
	}
	wait := func(what string, cond func(title, status string, hasPay, hasLate bool) bool) {
		t.Helper()
		var seen string
		waitFor(t, time.Minute, what, func() bool {
			title, status, hasPay, hasLate := state()
			seen = title + " " + status
			return cond(title, status, hasPay, hasLate)
		}, func() string { return seen })
	}

	// An order that expires a few seconds after its page is open. Should
	// the page take longer than that to load, a new order gets twice the
	// time: the test waits on what the page shows, never on a speed.
	var orderNo string
	for margin := 5 * time.Second; orderNo == ""; margin *= 2 {
		if margin > 2*time.Minute {
			t.Fatal("the pay page never loaded before its order expired")
		}
		co, err := ta.shop.PlaceOrder(ctx, domain.PlaceOrderInput{ProductID: p.ID, Quantity: 1, Contact: "late@example.com", Provider: "sandbox"}, "", "127.0.0.1")
		if err != nil {
			t.Fatal(err)
		}
		due := time.Now().UTC().Add(margin)
		for _, table := range []string{"orders", "pending_order"} {
			if _, err := ta.db.NewUpdate().Table(table).Set("expires_at = ?", due).Where("order_no = ?", co.Order.OrderNo).Exec(ctx); err != nil {
				t.Fatal(err)
			}
		}
		if err := ta.shop.Scheduler.ScheduleClose(ctx, co.Order.OrderNo, due); err != nil {
			t.Fatal(err)
		}
		// The pay URL names KAMI_PUBLIC_URL; the page itself is on the test server.
		if err := pg.navigate(ctx, ta.srv.URL+"/sandbox/pay/"+co.Order.OrderNo); err != nil {
			t.Fatal(err)
		}
		var title string
		wait("the pay page loads", func(t, _ string, _, _ bool) bool { title = t; return t != "" })
		if title == "Pay" {
			orderNo = co.Order.OrderNo
		}
	}
	if _, status, hasPay, _ := state(); status != "PENDING" || !hasPay {
		t.Fatalf("the page of a PENDING order: %s, Pay button %v", status, hasPay)
	}
	wait("the page turns to expired by itself", func(title, _ string, hasPay, _ bool) bool { return title == "Expired" && !hasPay })
	wait("the page shows kami's close, with the late-payment action", func(_, status string, hasPay, hasLate bool) bool {
		return status == "CLOSED" && hasLate && !hasPay
	})
	var back string
	if err := pg.eval(ctx, `document.getElementById('back').getAttribute('href')`, &back); err != nil || back != "http://kami.test/?orderNo="+orderNo {
		t.Errorf("the way back is %q (%v)", back, err)
	}
	if err := pg.eval(ctx, `document.querySelector('form.late button').click(), true`, nil); err != nil {
		t.Fatal(err)
	}
	wait("the page follows the refund to REFUNDED", func(_, status string, _, _ bool) bool { return status == "REFUNDED" })

	o, err := ta.ledger.Order(ctx, orderNo)
	if err != nil || o.Status != domain.OrderRefunded || o.PaidFen != 800 {
		t.Fatalf("order after the late payment: %+v %v", o, err)
	}
	var page string
	pg.eval(ctx, `document.body.innerText`, &page)
	if strings.Contains(page, "LATE-CODE-1") {
		t.Error("the pay page shows a card code")
	}
}
