package sandbox

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"time"

	"kami/domain/money"
	"kami/providers"
)

// PageOrder is what the pay page shows of an order.
type PageOrder struct {
	OrderNo   string
	Subject   string
	AmountFen int64
	ExpiresAt time.Time
	Status    string // kami's order status: PENDING, PAID, CLOSED, ...
	// ReturnURL is where the page links back to: the storefront's order
	// view, or kami's own. It comes from kami's configuration, never from
	// the request, so the page cannot be made to send a buyer elsewhere.
	ReturnURL string
}

// ErrOrderNotFound is what a PayPage lookup returns (or wraps) for an order
// that does not exist; the page then answers 404.
var ErrOrderNotFound = errors.New("sandbox: order not found")

// PayPage serves the sandbox's pay page, the URL CreatePayment returns:
//
//	GET  /sandbox/pay/{orderNo}       the order as kami has it now: for a
//	                                  PENDING one the amount, a countdown to
//	                                  its expiry and a Pay button
//	POST /sandbox/pay/{orderNo}       pay: Pay, notify kami with the signed
//	                                  notification, then show the order as it
//	                                  is after kami took it
//	POST /sandbox/pay/{orderNo}/late  for a CLOSED order: simulate a late
//	                                  payment (PayLate), so that a newcomer
//	                                  can watch kami refund it
//
// lookup loads the order from kami; notify delivers a notification as POST
// /webhooks/sandbox would (the server wires it to its webhook handler) and
// returns nil when kami acknowledged it. A POST on a paid trade sends its
// notification again, so a failed delivery can be retried from the page.
// The page pays only a PENDING order before its expiry, as a real gateway
// told the trade's expiry would; a page left open past it turns to
// "expired" by itself.
func (p *Provider) PayPage(
	lookup func(ctx context.Context, orderNo string) (PageOrder, error),
	notify func(ctx context.Context, header http.Header, body []byte) error,
) http.Handler {
	pg := &payPage{p: p, lookup: lookup, notify: notify}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /sandbox/pay/{orderNo}", pg.show)
	// Buyers' browsers send Sec-Fetch-Site; another site cannot pay for them.
	cop := http.NewCrossOriginProtection()
	mux.Handle("POST /sandbox/pay/{orderNo}", cop.Handler(http.HandlerFunc(pg.pay)))
	mux.Handle("POST /sandbox/pay/{orderNo}/late", cop.Handler(http.HandlerFunc(pg.payLate)))
	return mux
}

type payPage struct {
	p      *Provider
	lookup func(ctx context.Context, orderNo string) (PageOrder, error)
	notify func(ctx context.Context, header http.Header, body []byte) error
}

// pageData is what the template shows. Fields left empty are not shown.
type pageData struct {
	Title     string
	Order     *PageOrder
	Amount    string
	Message   string
	Tone      string // "ok", "note" or "err"
	Button    string // the Pay form's button
	Late      bool   // the "simulate a late payment" form
	Countdown bool
	// Watch reloads the page every few seconds while kami is about to
	// change the order (a refund under way, a close due).
	Watch     bool
	ExpiresAt string // RFC 3339, for people
	ExpiresMs int64  // Unix milliseconds, for the script
	Remaining string // the countdown as rendered without script
	Nonce     string
}

func (pg *payPage) order(w http.ResponseWriter, r *http.Request) (PageOrder, bool) {
	orderNo := r.PathValue("orderNo")
	if !validID(orderNo) {
		pg.render(w, http.StatusNotFound, pageData{Title: "No such order", Tone: "err", Message: "There is no order with this number."})
		return PageOrder{}, false
	}
	o, err := pg.lookup(r.Context(), orderNo)
	switch {
	case errors.Is(err, ErrOrderNotFound):
		pg.render(w, http.StatusNotFound, pageData{Title: "No such order", Tone: "err", Message: "There is no order with this number."})
		return PageOrder{}, false
	case err != nil:
		pg.render(w, http.StatusInternalServerError, pageData{Title: "Try again", Tone: "err", Message: "The order could not be loaded."})
		return PageOrder{}, false
	}
	o.OrderNo = orderNo
	return o, true
}

// current loads the order again after kami took a notification, so that
// the page shows what kami made of it; on a lookup failure it keeps o.
func (pg *payPage) current(r *http.Request, o PageOrder) PageOrder {
	if now, err := pg.lookup(r.Context(), o.OrderNo); err == nil {
		now.OrderNo = o.OrderNo
		return now
	}
	return o
}

func (pg *payPage) show(w http.ResponseWriter, r *http.Request) {
	o, ok := pg.order(w, r)
	if !ok {
		return
	}
	pg.render(w, http.StatusOK, pg.view(o))
}

// view is the page of an order as kami and the sandbox gateway have it now.
func (pg *payPage) view(o PageOrder) pageData {
	d := pg.data(o)
	paidHere := pg.p.tradeState(o.OrderNo) == providers.TradePaid
	switch o.Status {
	case "PAID":
		d.Title, d.Tone = "Paid", "ok"
		d.Message = "Paid. The shop has delivered the order: its codes are on the order's page."
	case "REFUNDING":
		d.Title, d.Tone, d.Watch = "Refunding", "note", true
		d.Message = "The shop is refunding this payment; this page follows it until it is refunded."
	case "REFUNDED":
		d.Title, d.Tone = "Refunded", "ok"
		d.Message = "The payment was refunded in full."
	case "CLOSED":
		d.Title, d.Tone = "Closed", "err"
		d.Message = "This order closed unpaid: its codes went back on sale and it can no longer be paid."
		d.Late = !paidHere
	case "PENDING":
		switch {
		case paidHere:
			// Paid at the gateway, not yet taken by kami: its
			// notification failed; sending it again is how to retry.
			d.Title, d.Tone, d.Button = "Paid, not confirmed", "note", "Send the notification again"
			d.Message = "Paid at the sandbox, but the shop has not confirmed it yet."
		case pg.p.tradeState(o.OrderNo) == providers.TradeClosed:
			d.Title, d.Tone, d.Watch = "Closed", "err", true
			d.Message = "The shop closed this trade: it can no longer be paid."
		case !pg.p.now().Before(o.ExpiresAt):
			d.Title, d.Tone, d.Watch = "Expired", "err", true
			d.Message = "This order expired: it can no longer be paid. The shop closes it in a moment."
		default:
			d.Title, d.Countdown, d.Button = "Pay", true, "Pay ¥"+d.Amount
		}
	default:
		d.Title, d.Tone = o.Status, "note"
	}
	return d
}

func (pg *payPage) pay(w http.ResponseWriter, r *http.Request) {
	o, ok := pg.order(w, r)
	if !ok {
		return
	}
	paidHere := pg.p.tradeState(o.OrderNo) == providers.TradePaid
	if !paidHere && (o.Status != "PENDING" || !pg.p.now().Before(o.ExpiresAt)) {
		// What a gateway told the trade's expiry does; a late payment is
		// the separate, labelled action of a CLOSED order's page.
		d := pg.view(o)
		d.Message = "This order can no longer be paid. " + d.Message
		pg.render(w, http.StatusConflict, d)
		return
	}
	header, body, err := pg.p.Pay(o.OrderNo, o.AmountFen)
	switch {
	case errors.Is(err, ErrTradeClosed):
		d := pg.view(o)
		d.Title, d.Tone, d.Message, d.Button, d.Countdown = "Closed", "err", "The shop closed this trade: it can no longer be paid.", "", false
		pg.render(w, http.StatusConflict, d)
		return
	case err != nil:
		d := pg.view(o)
		d.Title, d.Tone, d.Message, d.Button, d.Countdown = "Cannot pay", "err", "The sandbox cannot pay this order (its amount is out of range).", "", false
		pg.render(w, http.StatusUnprocessableEntity, d)
		return
	}
	pg.deliver(w, r, o, header, body, "Paid. The shop accepted the notification.")
}

// payLate pays a CLOSED order at the gateway as if the buyer's payment had
// crossed the shop's close, and notifies kami, which refunds it.
func (pg *payPage) payLate(w http.ResponseWriter, r *http.Request) {
	o, ok := pg.order(w, r)
	if !ok {
		return
	}
	if o.Status != "CLOSED" {
		d := pg.view(o)
		d.Tone, d.Message = "err", "Only a closed order can be paid late; this one is "+o.Status+"."
		pg.render(w, http.StatusConflict, d)
		return
	}
	header, body, err := pg.p.PayLate(o.OrderNo, o.AmountFen)
	if err != nil {
		d := pg.view(o)
		d.Tone, d.Message, d.Late = "err", "The sandbox cannot pay this order (its amount is out of range).", false
		pg.render(w, http.StatusUnprocessableEntity, d)
		return
	}
	pg.deliver(w, r, o, header, body, "Late payment sent: the shop took it and, as for any payment to a closed order, refunds it.")
}

// deliver hands kami the signed notification and shows the order as kami
// has it afterwards.
func (pg *payPage) deliver(w http.ResponseWriter, r *http.Request, o PageOrder, header http.Header, body []byte, accepted string) {
	if err := pg.notify(r.Context(), header, body); err != nil {
		// The error is kami's own; the buyer's page does not show it.
		d := pg.view(o)
		d.Title, d.Tone, d.Button, d.Countdown, d.Late = "Not delivered", "err", "Send the notification again", false, false
		d.Message = "Paid at the sandbox, but the shop did not accept the notification."
		pg.render(w, http.StatusBadGateway, d)
		return
	}
	d := pg.view(pg.current(r, o))
	d.Message = accepted + " " + d.Message
	pg.render(w, http.StatusOK, d)
}

func (pg *payPage) data(o PageOrder) pageData {
	amount := money.Format(o.AmountFen)
	remaining := max(o.ExpiresAt.Sub(pg.p.now()), 0).Round(time.Second)
	return pageData{
		Order:     &o,
		Amount:    amount,
		ExpiresAt: o.ExpiresAt.Format(time.RFC3339),
		ExpiresMs: o.ExpiresAt.UnixMilli(),
		Remaining: fmt.Sprintf("%d:%02d", int(remaining.Minutes()), int(remaining.Seconds())%60),
	}
}

func (pg *payPage) render(w http.ResponseWriter, status int, d pageData) {
	nonce := make([]byte, 16)
	_, _ = rand.Read(nonce) // crypto/rand.Read never fails
	d.Nonce = base64.StdEncoding.EncodeToString(nonce)
	var buf bytes.Buffer
	if err := pageTemplate.Execute(&buf, d); err != nil {
		http.Error(w, "page error", http.StatusInternalServerError)
		return
	}
	h := w.Header()
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Cache-Control", "no-store")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "no-referrer")
	h.Set("Content-Security-Policy", "default-src 'none'; img-src 'self'; style-src 'unsafe-inline'; script-src 'nonce-"+d.Nonce+"'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
	w.WriteHeader(status)
	_, _ = w.Write(buf.Bytes())
}

var pageTemplate = template.Must(template.New("pay").Parse(`<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{{.Title}} · kami sandbox</title>
<style>
body { font: 16px/1.5 system-ui, sans-serif; max-width: 30rem; margin: 3rem auto; padding: 0 1rem; color: #222; }
.box { border: 1px solid #ddd; border-radius: 8px; padding: 1.5rem; }
.amount { font-size: 2rem; font-weight: 600; margin: .5rem 0; }
.ok { color: #070; } .note { color: #a60; } .err { color: #b00; }
button { font-size: 1.1rem; padding: .6rem 1.5rem; cursor: pointer; }
.late { margin-top: 1.5rem; padding: 1rem; border: 2px dashed #a60; border-radius: 8px; background: #fffaf0; }
.late button { font-size: 1rem; }
small, .meta { color: #777; }
</style>
</head>
<body>
<div class="box">
<p><small>kami sandbox · no real money moves</small></p>
<h1 id="title">{{.Title}}</h1>
{{with .Order}}<p>{{.Subject}}</p>
<p class="amount">¥{{$.Amount}}</p>
<p class="meta">Order <code>{{.OrderNo}}</code> · <strong id="status">{{.Status}}</strong></p>
{{end}}{{if .Message}}<p id="message" class="{{.Tone}}">{{.Message}}</p>
{{end}}{{if .Countdown}}<p id="expiry">Expires in <strong id="countdown" data-expires="{{.ExpiresMs}}">{{.Remaining}}</strong> <small>({{.ExpiresAt}})</small></p>
{{end}}{{if .Button}}<form id="pay" method="post"><button type="submit">{{.Button}}</button></form>
{{end}}{{if .Late}}<form class="late" method="post" action="{{.Order.OrderNo}}/late">
<p><strong>Sandbox only: simulate a late payment.</strong> Pretend the buyer's payment went
through at the gateway just as the shop closed the order, and send the shop its signed
notification. The shop refunds it: this page then follows the order from REFUNDING to
REFUNDED.</p>
<button type="submit">Simulate a late payment of ¥{{.Amount}}</button>
</form>
{{end}}{{with .Order}}{{if .ReturnURL}}<p><a id="back" href="{{.ReturnURL}}">Back to the order</a></p>
{{end}}{{end}}</div>
{{if or .Countdown .Watch}}<script nonce="{{.Nonce}}">
(function () {
  var el = document.getElementById("countdown");
  if (!el) {
    // kami is about to change this order: look again every few seconds,
    // for two minutes at most.
    var left = Number(sessionStorage.getItem("kami-watch") || "40");
    if (left > 0) {
      sessionStorage.setItem("kami-watch", String(left - 1));
      setTimeout(function () { location.reload(); }, 3000);
    }
    return;
  }
  sessionStorage.removeItem("kami-watch");
  var end = Number(el.dataset.expires);
  function tick() {
    var s = Math.max(0, Math.round((end - Date.now()) / 1000));
    el.textContent = s > 0 ? Math.floor(s / 60) + ":" + String(s % 60).padStart(2, "0") : "expired";
    if (s > 0) {
      setTimeout(tick, 1000);
      return;
    }
    // Expired while the page was open: it can no longer be paid. Say so
    // now, then show what the shop made of it.
    document.getElementById("title").textContent = "Expired";
    document.title = "Expired · kami sandbox";
    var form = document.getElementById("pay");
    if (form) form.remove();
    var expiry = document.getElementById("expiry");
    expiry.className = "err";
    expiry.textContent = "This order expired: it can no longer be paid.";
    setTimeout(function () { location.reload(); }, 3000);
  }
  tick();
})();
</script>
{{end}}</body>
</html>
`))
