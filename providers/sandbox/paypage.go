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
}

// ErrOrderNotFound is what a PayPage lookup returns (or wraps) for an order
// that does not exist; the page then answers 404.
var ErrOrderNotFound = errors.New("sandbox: order not found")

// PayPage serves the sandbox's pay page, the URL CreatePayment returns:
//
//	GET  /sandbox/pay/{orderNo}  the product, the amount, a countdown to the
//	                             expiry and a Pay button
//	POST /sandbox/pay/{orderNo}  pay: Pay, then notify with the signed
//	                             notification, then the result
//
// lookup loads the order from kami; notify delivers a notification as POST
// /webhooks/sandbox would (the server wires it to its webhook handler) and
// returns nil when kami acknowledged it. A POST on a paid trade sends its
// notification again, so a failed delivery can be retried from the page. An
// order past its expiry or no longer PENDING can still be paid unless kami
// closed the trade with ClosePayment: that is how to try a late payment by
// hand.
func (p *Provider) PayPage(
	lookup func(ctx context.Context, orderNo string) (PageOrder, error),
	notify func(ctx context.Context, header http.Header, body []byte) error,
) http.Handler {
	pg := &payPage{p: p, lookup: lookup, notify: notify}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /sandbox/pay/{orderNo}", pg.show)
	// Buyers' browsers send Sec-Fetch-Site; another site cannot pay for them.
	mux.Handle("POST /sandbox/pay/{orderNo}", http.NewCrossOriginProtection().Handler(http.HandlerFunc(pg.pay)))
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
	Button    string
	Countdown bool
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

func (pg *payPage) show(w http.ResponseWriter, r *http.Request) {
	o, ok := pg.order(w, r)
	if !ok {
		return
	}
	d := pg.data(o, "Pay")
	switch pg.p.tradeState(o.OrderNo) {
	case providers.TradePaid:
		d.Title, d.Tone, d.Countdown = "Paid", "ok", false
		d.Message = "This order was paid at the sandbox."
		d.Button = "Send the notification again"
	case providers.TradeClosed:
		d.Title, d.Tone, d.Countdown, d.Button = "Closed", "err", false, ""
		d.Message = "The shop closed this trade: it can no longer be paid."
	default:
		if o.Status != "PENDING" || !pg.p.now().Before(o.ExpiresAt) {
			d.Tone = "note"
			d.Message = "This order is " + o.Status + " or past its expiry: paying now is a late payment, which the shop should refund."
		}
	}
	pg.render(w, http.StatusOK, d)
}

func (pg *payPage) pay(w http.ResponseWriter, r *http.Request) {
	o, ok := pg.order(w, r)
	if !ok {
		return
	}
	d := pg.data(o, "")
	d.Countdown = false
	header, body, err := pg.p.Pay(o.OrderNo, o.AmountFen)
	switch {
	case errors.Is(err, ErrTradeClosed):
		d.Title, d.Tone, d.Message = "Closed", "err", "The shop closed this trade: it can no longer be paid."
		pg.render(w, http.StatusConflict, d)
		return
	case err != nil:
		d.Title, d.Tone, d.Message = "Cannot pay", "err", "The sandbox cannot pay this order (its amount is out of range)."
		pg.render(w, http.StatusUnprocessableEntity, d)
		return
	}
	if err := pg.notify(r.Context(), header, body); err != nil {
		// The error is kami's own; the buyer's page does not show it.
		d.Title, d.Tone, d.Button = "Not delivered", "err", "Send the notification again"
		d.Message = "Paid at the sandbox, but the shop did not accept the notification."
		pg.render(w, http.StatusBadGateway, d)
		return
	}
	d.Title, d.Tone, d.Message = "Paid", "ok", "Paid. The shop accepted the notification."
	pg.render(w, http.StatusOK, d)
}

func (pg *payPage) data(o PageOrder, title string) pageData {
	amount := money.Format(o.AmountFen)
	remaining := max(o.ExpiresAt.Sub(pg.p.now()), 0).Round(time.Second)
	return pageData{
		Title:     title,
		Order:     &o,
		Amount:    amount,
		Button:    "Pay ¥" + amount,
		Countdown: !o.ExpiresAt.IsZero(),
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
	h.Set("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; script-src 'nonce-"+d.Nonce+"'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
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
body { font: 16px/1.5 system-ui, sans-serif; max-width: 28rem; margin: 3rem auto; padding: 0 1rem; color: #222; }
.box { border: 1px solid #ddd; border-radius: 8px; padding: 1.5rem; }
.amount { font-size: 2rem; font-weight: 600; margin: .5rem 0; }
.ok { color: #070; } .note { color: #a60; } .err { color: #b00; }
button { font-size: 1.1rem; padding: .6rem 1.5rem; cursor: pointer; }
small, .meta { color: #777; }
</style>
</head>
<body>
<div class="box">
<p><small>kami sandbox · no real money moves</small></p>
<h1>{{.Title}}</h1>
{{with .Order}}<p>{{.Subject}}</p>
<p class="amount">¥{{$.Amount}}</p>
<p class="meta">Order <code>{{.OrderNo}}</code> · {{.Status}}</p>
{{end}}{{if .Message}}<p class="{{.Tone}}">{{.Message}}</p>
{{end}}{{if .Countdown}}<p>Expires in <strong id="countdown" data-expires="{{.ExpiresMs}}">{{.Remaining}}</strong> <small>({{.ExpiresAt}})</small></p>
{{end}}{{if .Button}}<form method="post"><button type="submit">{{.Button}}</button></form>
{{end}}</div>
{{if .Countdown}}<script nonce="{{.Nonce}}">
(function () {
  var el = document.getElementById("countdown");
  var end = Number(el.dataset.expires);
  function tick() {
    var s = Math.max(0, Math.round((end - Date.now()) / 1000));
    el.textContent = s > 0 ? Math.floor(s / 60) + ":" + String(s % 60).padStart(2, "0") : "expired";
    if (s > 0) setTimeout(tick, 1000);
  }
  tick();
})();
</script>
{{end}}</body>
</html>
`))
