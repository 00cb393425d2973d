package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"kami/providers/sandbox"
)

// client talks to one kami over HTTP keep-alive.
type client struct {
	base       string // http://127.0.0.1:port
	http       *http.Client
	adminToken string
	secret     string // KAMI_SANDBOX_SECRET
}

func newClient(base, adminToken, secret string, conns int) *client {
	tr := &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        conns + 16,
		MaxIdleConnsPerHost: conns + 16,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
		ForceAttemptHTTP2:   false,
	}
	return &client{base: base, http: &http.Client{Transport: tr, Timeout: 30 * time.Second}, adminToken: adminToken, secret: secret}
}

type gqlError struct {
	Message    string `json:"message"`
	Extensions struct {
		Code string `json:"code"`
	} `json:"extensions"`
}

// callError is a failed call: code is extensions.code, HTTP_<status> or
// TRANSPORT, what the error counts group by.
type callError struct {
	code string
	msg  string
}

func (e *callError) Error() string { return e.code + ": " + e.msg }

func errCode(err error) string {
	if ce, ok := err.(*callError); ok {
		return ce.code
	}
	return "TRANSPORT"
}

// graphql runs one operation and decodes data into out.
func (c *client) graphql(ctx context.Context, query string, vars map[string]any, admin bool, out any) error {
	body, err := json.Marshal(map[string]any{"query": query, "variables": vars})
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+"/graphql", bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/graphql-response+json, application/json")
	if admin {
		req.Header.Set("Authorization", "Bearer "+c.adminToken)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return &callError{"TRANSPORT", err.Error()}
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return &callError{"TRANSPORT", err.Error()}
	}
	var r struct {
		Data   json.RawMessage `json:"data"`
		Errors []gqlError      `json:"errors"`
	}
	if err := json.Unmarshal(raw, &r); err != nil {
		return &callError{fmt.Sprintf("HTTP_%d", resp.StatusCode), truncate(string(raw), 200)}
	}
	if len(r.Errors) > 0 {
		code := r.Errors[0].Extensions.Code
		if code == "" {
			code = fmt.Sprintf("HTTP_%d", resp.StatusCode)
		}
		return &callError{code, r.Errors[0].Message}
	}
	if resp.StatusCode != http.StatusOK {
		return &callError{fmt.Sprintf("HTTP_%d", resp.StatusCode), truncate(string(raw), 200)}
	}
	if out != nil {
		return json.Unmarshal(r.Data, out)
	}
	return nil
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}

// pay posts a signed sandbox payment notification for an order, as the
// sandbox gateway would. nil means 200.
func (c *client) pay(ctx context.Context, orderNo, amount string) error {
	header, body := sandbox.Signed(c.secret, payNotification(orderNo, amount))
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+"/webhooks/sandbox", bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header = header
	resp, err := c.http.Do(req)
	if err != nil {
		return &callError{"TRANSPORT", err.Error()}
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return &callError{fmt.Sprintf("HTTP_%d", resp.StatusCode), "webhook refused"}
	}
	return nil
}

// setupProduct creates a product and imports cards codes through the API.
func (c *client) setupProduct(ctx context.Context, name string, cards int) (string, error) {
	var cp struct {
		CreateProduct struct {
			ID string `json:"id"`
		} `json:"createProduct"`
	}
	err := c.graphql(ctx, `mutation($in: CreateProductInput!) { createProduct(input: $in) { id } }`,
		map[string]any{"in": map[string]any{"name": name, "price": "1.00", "description": "kami bench"}}, true, &cp)
	if err != nil {
		return "", fmt.Errorf("createProduct: %w", err)
	}
	id := cp.CreateProduct.ID
	const batch = 10_000 // importCards' limit per call
	for start := 0; start < cards; start += batch {
		codes := make([]string, 0, batch)
		for i := start; i < min(start+batch, cards); i++ {
			codes = append(codes, fmt.Sprintf("%s-%07d", name, i))
		}
		var ic struct {
			ImportCards struct {
				Imported   int `json:"imported"`
				Duplicates int `json:"duplicates"`
			} `json:"importCards"`
		}
		if err := c.graphql(ctx, `mutation($p: ID!, $codes: [String!]!) { importCards(productId: $p, codes: $codes) { imported duplicates } }`,
			map[string]any{"p": id, "codes": codes}, true, &ic); err != nil {
			return "", fmt.Errorf("importCards: %w", err)
		}
		if ic.ImportCards.Imported != len(codes) {
			return "", fmt.Errorf("importCards imported %d of %d codes", ic.ImportCards.Imported, len(codes))
		}
	}
	return id, nil
}

// stats reads kami's stats query; nil when it cannot.
func (c *client) stats(ctx context.Context) *StatsReport {
	var out struct {
		Stats StatsReport `json:"stats"`
	}
	if err := c.graphql(ctx, `{ stats { closeSuccessRate queues { name backlog oldestOverdueSeconds } } }`, nil, true, &out); err != nil {
		return nil
	}
	return &out.Stats
}

// createOrderQuery is what a storefront asks for: the order, the buyer's
// token and how to pay.
const createOrderQuery = `mutation Buy($in: CreateOrderInput!) {
  createOrder(input: $in) {
    order { orderNo status amount expiresAt }
    accessToken
    payment { kind url expiresAt }
  }
}`

type createOrderData struct {
	CreateOrder struct {
		Order struct {
			OrderNo string `json:"orderNo"`
			Status  string `json:"status"`
			Amount  string `json:"amount"`
		} `json:"order"`
		AccessToken string `json:"accessToken"`
	} `json:"createOrder"`
}

// shouldPay spreads the paid share evenly over the orders: order i pays
// when floor((i+1)·share) passes floor(i·share), so exactly
// floor(n·share) of the first n orders pay.
func shouldPay(i int, share float64) bool {
	return int(float64(i+1)*share) > int(float64(i)*share)
}

// loadResult is the place phase's raw measurements.
type loadResult struct {
	start       time.Time
	wall        time.Duration
	placed      []time.Duration
	doneAt      []time.Duration // when each placed order's answer came, since the start
	placeErrors map[string]int
	paid        []time.Duration
	paySent     int
	payErrors   map[string]int
	firstError  string
}

// runLoad places n orders from conc workers, each a storefront newWorker
// makes; each pays its order right after when shouldPay says so.
func runLoad(ctx context.Context, newWorker func() (storefront, error), n, conc int, share float64) loadResult {
	var next atomic.Int64
	type workerOut struct {
		placed, paid       []time.Duration
		doneAt             []time.Duration // since start, per placed order
		placeErrs, payErrs map[string]int
		paySent            int
		firstErr           string
	}
	outs := make([]workerOut, conc)
	var wg sync.WaitGroup
	start := time.Now()
	for w := 0; w < conc; w++ {
		wg.Add(1)
		go func(out *workerOut) {
			defer wg.Done()
			out.placeErrs, out.payErrs = map[string]int{}, map[string]int{}
			out.placed = make([]time.Duration, 0, n/conc+1)
			sf, err := newWorker()
			if err != nil {
				out.firstErr = err.Error()
				return
			}
			defer sf.close()
			for ctx.Err() == nil {
				i := int(next.Add(1)) - 1
				if i >= n {
					return
				}
				t0 := time.Now()
				orderNo, amount, err := sf.createOrder(ctx, i)
				d := time.Since(t0)
				if err != nil {
					out.placeErrs[errCode(err)]++
					if out.firstErr == "" {
						out.firstErr = err.Error()
					}
					continue
				}
				out.placed = append(out.placed, d)
				out.doneAt = append(out.doneAt, time.Since(start))
				if !shouldPay(i, share) {
					continue
				}
				out.paySent++
				t0 = time.Now()
				err = sf.pay(ctx, orderNo, amount)
				d = time.Since(t0)
				if err != nil {
					out.payErrs[errCode(err)]++
					if out.firstErr == "" {
						out.firstErr = "payment: " + err.Error()
					}
					continue
				}
				out.paid = append(out.paid, d)
			}
		}(&outs[w])
	}
	wg.Wait()
	res := loadResult{start: start, wall: time.Since(start), placeErrors: map[string]int{}, payErrors: map[string]int{}}
	for _, o := range outs {
		res.placed = append(res.placed, o.placed...)
		res.doneAt = append(res.doneAt, o.doneAt...)
		res.paid = append(res.paid, o.paid...)
		res.paySent += o.paySent
		for k, v := range o.placeErrs {
			res.placeErrors[k] += v
		}
		for k, v := range o.payErrs {
			res.payErrors[k] += v
		}
		if res.firstError == "" {
			res.firstError = o.firstErr
		}
	}
	if ctx.Err() != nil {
		res.placeErrors["NOT_SENT_TIMEOUT"] = n - len(res.placed) - sum(res.placeErrors)
	}
	return res
}

func sum(m map[string]int) int {
	t := 0
	for _, v := range m {
		t += v
	}
	return t
}

// metrics reads the server's /metrics as text; "" when it cannot.
func (c *client) metrics(ctx context.Context) string {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.base+"/metrics", nil)
	if err != nil {
		return ""
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil || resp.StatusCode != http.StatusOK {
		return ""
	}
	return string(raw)
}

// gcPercent is the server's garbage collector target (GOGC), from the
// go_gc_gogc_percent of its /metrics; 0 when unknown.
func (c *client) gcPercent(ctx context.Context) int {
	for _, line := range strings.Split(c.metrics(ctx), "\n") {
		if v, ok := strings.CutPrefix(line, "go_gc_gogc_percent "); ok {
			if f, err := strconv.ParseFloat(strings.TrimSpace(v), 64); err == nil && f > 0 {
				return int(f)
			}
		}
	}
	return 0
}

// groupCounters reads the ledger's group-commit counters from the server's
// /metrics (kami_group_{batches,calls,split}_total by kind); nil when it
// cannot, the report then leaves them out.
func (c *client) groupCounters(ctx context.Context) map[string]GroupReport {
	raw := c.metrics(ctx)
	if raw == "" {
		return nil
	}
	out := map[string]GroupReport{}
	for _, line := range strings.Split(raw, "\n") {
		var field *int64
		name, rest, ok := strings.Cut(line, `{kind="`)
		if !ok {
			continue
		}
		kind, value, ok := strings.Cut(rest, `"} `)
		if !ok {
			continue
		}
		g := out[kind]
		switch name {
		case "kami_group_batches_total":
			field = &g.Batches
		case "kami_group_calls_total":
			field = &g.Calls
		case "kami_group_split_total":
			field = &g.Split
		default:
			continue
		}
		f, err := strconv.ParseFloat(strings.TrimSpace(value), 64)
		if err != nil {
			continue
		}
		*field = int64(f)
		out[kind] = g
	}
	return out
}

// groupsSince is what the counters counted between before and after.
func groupsSince(before, after map[string]GroupReport) map[string]GroupReport {
	if before == nil || after == nil {
		return nil
	}
	out := map[string]GroupReport{}
	for k, a := range after {
		b := before[k]
		out[k] = GroupReport{Batches: a.Batches - b.Batches, Calls: a.Calls - b.Calls, Split: a.Split - b.Split}
	}
	return out
}
