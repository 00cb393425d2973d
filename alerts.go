package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"kami/domain"
)

// alerter raises the alerts that need a person now (a refund that gave up,
// a ledger inconsistency, an amount mismatch, stragglers found by the
// reconciliation): an error-level log line with structured fields, and,
// when KAMI_ALERT_WEBHOOK is set, a post to a chat webhook. Posting never
// blocks the work that raised the alert: alerts wait in a bounded queue and
// a background sender retries each a few times.
type alerter struct {
	log     *slog.Logger
	url     string
	format  string // wecom, dingtalk, slack or generic
	client  *http.Client
	shop    string
	counted func(kind string)

	queue   chan domain.Alert
	done    chan struct{}
	mu      sync.Mutex // guards closed, dropped and sending on queue
	closed  bool
	dropped int64
	backoff []time.Duration
}

// alertQueueSize bounds alerts waiting to be posted; past it new ones are
// logged and counted but not posted (an alert storm must not eat memory).
const alertQueueSize = 256

func newAlerter(log *slog.Logger, webhook, shop string, counted func(string)) *alerter {
	a := &alerter{log: log, url: webhook, format: alertFormat(webhook), shop: shop, counted: counted,
		client:  &http.Client{Timeout: 5 * time.Second},
		queue:   make(chan domain.Alert, alertQueueSize),
		done:    make(chan struct{}),
		backoff: []time.Duration{time.Second, 5 * time.Second, 30 * time.Second},
	}
	if webhook == "" {
		close(a.done)
		return a
	}
	go a.send()
	return a
}

// alertFormat picks the body a webhook accepts from its host: WeCom and
// DingTalk robots take {"msgtype":"text","text":{"content":...}}, Slack
// takes {"text":...}; anything else gets Slack's form plus the fields.
func alertFormat(webhook string) string {
	u, err := url.Parse(webhook)
	if err != nil {
		return "generic"
	}
	switch host := u.Hostname(); {
	case strings.HasSuffix(host, "qyapi.weixin.qq.com"):
		return "wecom"
	case strings.HasSuffix(host, "dingtalk.com"):
		return "dingtalk"
	case strings.HasSuffix(host, "slack.com"):
		return "slack"
	}
	return "generic"
}

func (a *alerter) Alert(ctx context.Context, al domain.Alert) {
	a.log.ErrorContext(ctx, "alert: "+al.Message, "alert", al.Kind, "subject", al.Subject)
	if a.counted != nil {
		a.counted(al.Kind)
	}
	if a.url == "" {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return
	}
	select {
	case a.queue <- al:
	default:
		a.dropped++
		a.log.WarnContext(ctx, "alert webhook queue full; alert logged only", "alert", al.Kind)
	}
}

func (a *alerter) body(al domain.Alert) ([]byte, error) {
	text := fmt.Sprintf("[kami %s] %s %s: %s", a.shop, al.Kind, al.Subject, al.Message)
	switch a.format {
	case "wecom", "dingtalk":
		return json.Marshal(map[string]any{"msgtype": "text", "text": map[string]string{"content": text}})
	case "slack":
		return json.Marshal(map[string]string{"text": text})
	default:
		return json.Marshal(map[string]any{"text": text, "kind": al.Kind, "subject": al.Subject, "message": al.Message, "shop": a.shop})
	}
}

// send posts queued alerts until Close, retrying each on failure.
func (a *alerter) send() {
	defer close(a.done)
	for al := range a.queue {
		body, err := a.body(al)
		if err != nil {
			continue
		}
		for attempt := 0; ; attempt++ {
			err := a.post(body)
			if err == nil {
				break
			}
			if attempt >= len(a.backoff) {
				a.log.Error("alert webhook failed; gave up", "alert", al.Kind, "err", err)
				break
			}
			time.Sleep(a.backoff[attempt])
		}
	}
}

func (a *alerter) post(body []byte) error {
	res, err := a.client.Post(a.url, "application/json", bytes.NewReader(body))
	if err != nil {
		return err
	}
	res.Body.Close()
	if res.StatusCode >= 300 {
		return fmt.Errorf("webhook answered %s", res.Status)
	}
	return nil
}

// Close stops taking alerts and waits (until ctx ends) for the queued ones
// to be posted.
func (a *alerter) Close(ctx context.Context) error {
	a.mu.Lock()
	if !a.closed && a.url != "" {
		close(a.queue)
	}
	a.closed = true
	a.mu.Unlock()
	select {
	case <-a.done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("alerts not all posted: %w", ctx.Err())
	}
}
