package domain

import (
	"bytes"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect"
	"github.com/uptrace/bun/dialect/pgdialect"

	"kami/domain/webhook"
)

// Signed outgoing webhooks. The outbox (outbox.go) holds the events; the
// dispatcher (FanOut) turns each into one delivery per endpoint that wants
// it, and the delivery queue's workers send them (Deliver) until the
// endpoint answers 2xx or the retries run out. Every step is a
// conditional update of the delivery's row, so two workers, or two
// processes, holding the same delivery send it once as "the" attempt
// (a receiver may still see an event twice: a 2xx whose record was lost is
// sent again; receivers deduplicate by event id).

// WebhookEndpoint is a seller's receiver.
type WebhookEndpoint struct {
	bun.BaseModel `bun:"table:webhook_endpoint"`

	ID          int64  `bun:"id,pk,autoincrement"`
	URL         string `bun:"url"`
	Description string `bun:"description"`
	// Events is the comma-separated list of event types it wants.
	Events        string `bun:"events"`
	Enabled       bool   `bun:"enabled"`
	ReceivesCodes bool   `bun:"receives_codes"`
	// SecretEnc is the signing secret sealed with the card key;
	// PrevSecretEnc the one before a rotation, valid until PrevSecretUntil.
	SecretEnc       []byte    `bun:"secret_enc"`
	PrevSecretEnc   []byte    `bun:"prev_secret_enc"`
	PrevSecretUntil time.Time `bun:"prev_secret_until,nullzero"`
	DeletedAt       time.Time `bun:"deleted_at,nullzero"`
	CreatedAt       time.Time `bun:"created_at"`
	UpdatedAt       time.Time `bun:"updated_at"`
}

// EventTypes is the list of event types the endpoint wants.
func (e *WebhookEndpoint) EventTypes() []EventType {
	var out []EventType
	for _, s := range strings.Split(e.Events, ",") {
		if s != "" {
			out = append(out, EventType(s))
		}
	}
	return out
}

func (e *WebhookEndpoint) wants(t EventType) bool {
	return e.Enabled && e.DeletedAt.IsZero() && slices.Contains(e.EventTypes(), t)
}

// WebhookDelivery is one event for one endpoint.
type WebhookDelivery struct {
	bun.BaseModel `bun:"table:webhook_delivery"`

	ID         int64          `bun:"id,pk,autoincrement"`
	EventID    int64          `bun:"event_id"`
	EndpointID int64          `bun:"endpoint_id"`
	Status     DeliveryStatus `bun:"status"`
	// Attempts counts the attempts of this round (a resend starts a new one).
	Attempts int `bun:"attempts"`
	// Resends counts the rounds a resend started; it only goes up. An
	// attempt is taken and recorded under (Resends, Attempts).
	Resends       int       `bun:"resends"`
	NextAttemptAt time.Time `bun:"next_attempt_at,nullzero"`
	LastAttemptAt time.Time `bun:"last_attempt_at,nullzero"`
	LastStatus    int       `bun:"last_status"`     // the HTTP status of the last answer; 0: none
	LastLatencyMS int       `bun:"last_latency_ms"` // how long the last attempt took
	LastError     string    `bun:"last_error"`      // why the last attempt failed, when it got no answer
	// ResponseSnippet is the start of the last answer's body.
	ResponseSnippet string    `bun:"response_snippet"`
	CreatedAt       time.Time `bun:"created_at"`
	UpdatedAt       time.Time `bun:"updated_at"`
	DeliveredAt     time.Time `bun:"delivered_at,nullzero"`

	Event *Event `bun:"-"` // set by Deliveries
}

// WebhookConfig tunes deliveries. Zero values take the defaults.
type WebhookConfig struct {
	Timeout     time.Duration // one attempt's limit (KAMI_WEBHOOK_TIMEOUT); default 10s
	BackoffBase time.Duration // wait after the first failed attempt, doubling after each; default 30s
	BackoffMax  time.Duration // the longest wait between attempts; default 6h
	RetryFor    time.Duration // how long a delivery is retried before it is FAILED (KAMI_WEBHOOK_RETRY_FOR); default 72h
	// RotationGrace is how long a rotated-out secret still signs; default 24h.
	RotationGrace time.Duration
	// Keep is how long the delivery log keeps a delivery that ended, and
	// the outbox an event no delivery needs any more (KAMI_WEBHOOK_KEEP);
	// default 30 days.
	Keep  time.Duration
	Guard webhook.Guard
}

func (c WebhookConfig) withDefaults() WebhookConfig {
	defD := func(v *time.Duration, d time.Duration) {
		if *v <= 0 {
			*v = d
		}
	}
	defD(&c.Timeout, 10*time.Second)
	defD(&c.BackoffBase, 30*time.Second)
	defD(&c.BackoffMax, 6*time.Hour)
	defD(&c.RetryFor, 72*time.Hour)
	defD(&c.RotationGrace, 24*time.Hour)
	defD(&c.Keep, 30*24*time.Hour)
	return c
}

// backoff is the wait after failed attempt n (1-based): BackoffBase
// doubling, at most BackoffMax.
func (c WebhookConfig) backoff(n int) time.Duration {
	d := c.BackoffBase
	for i := 1; i < n && d < c.BackoffMax; i++ {
		d *= 2
	}
	return min(d, c.BackoffMax)
}

// MaxAttempts is how many attempts fit in RetryFor: after the last one
// fails the delivery is FAILED.
func (c WebhookConfig) MaxAttempts() int {
	c = c.withDefaults()
	n, total := 1, time.Duration(0)
	for {
		total += c.backoff(n)
		if total > c.RetryFor {
			return n
		}
		n++
	}
}

// DeliveryOutcome is what one attempt came to, for metrics.
type DeliveryOutcome string

const (
	OutcomeDelivered DeliveryOutcome = "delivered" // 2xx
	OutcomeRetry     DeliveryOutcome = "retry"     // failed; another attempt is scheduled
	OutcomeFailed    DeliveryOutcome = "failed"    // failed, and it was the last
	OutcomeCancelled DeliveryOutcome = "cancelled" // its endpoint is disabled or deleted
)

// Webhooks manages endpoints and sends deliveries.
type Webhooks struct {
	Ledger *Ledger
	Config WebhookConfig
	// Client sends deliveries; nil: Config.Guard's client (every dial
	// checked). Tests set their own only to reach what the guard refuses.
	Client *http.Client
	Alerts Alerter
	Log    *slog.Logger
	// OnAttempt hears every attempt's outcome and latency (metrics).
	OnAttempt func(DeliveryOutcome, time.Duration)
	// Schedule, if set, puts deliveries on the delivery queue at once (the
	// queue's workers set it); without it, or when it fails, the sweeper
	// queues them from the database.
	Schedule func(context.Context, []DeliveryDue) error
}

// NewWebhooks returns the webhook service over l.
func NewWebhooks(l *Ledger, cfg WebhookConfig, alerts Alerter, log *slog.Logger) *Webhooks {
	cfg = cfg.withDefaults()
	if alerts == nil {
		alerts = l.alerts
	}
	if log == nil {
		log = slog.Default()
	}
	return &Webhooks{Ledger: l, Config: cfg, Client: cfg.Guard.Client(cfg.Timeout), Alerts: alerts, Log: log}
}

// --- endpoints -------------------------------------------------------------

// WebhookEndpointInput is what an admin sets on an endpoint; nil leaves a
// field as it is (on create: URL and Events are required, Enabled
// defaults to true).
type WebhookEndpointInput struct {
	URL           *string
	Description   *string
	Events        []EventType
	Enabled       *bool
	ReceivesCodes *bool
}

// newWebhookSecret is a fresh signing secret: 32 random bytes.
func newWebhookSecret() string {
	b := make([]byte, 32)
	rand.Read(b)
	return "whsec_" + base64.RawURLEncoding.EncodeToString(b)
}

func (h *Webhooks) check(ctx context.Context, e *WebhookEndpoint, in WebhookEndpointInput) error {
	if in.URL != nil {
		u := strings.TrimSpace(*in.URL)
		if len(u) > 2048 {
			return Errorf(EBADINPUT, "an endpoint URL has at most 2048 characters")
		}
		if err := h.Config.Guard.CheckURL(ctx, u); err != nil {
			return Errorf(EBADINPUT, "%s", strings.TrimPrefix(err.Error(), "webhook endpoint refused: "))
		}
		e.URL = u
	}
	if in.Description != nil {
		if len(*in.Description) > 255 {
			return Errorf(EBADINPUT, "a description has at most 255 bytes")
		}
		if err := checkBuyerText("a description", *in.Description); err != nil {
			return err
		}
		e.Description = *in.Description
	}
	if in.Events != nil {
		if len(in.Events) == 0 {
			return Errorf(EBADINPUT, "name at least one event")
		}
		var names []string
		for _, t := range in.Events {
			if !slices.Contains(EventTypes, t) {
				return Errorf(EBADINPUT, "unknown event %q", truncate(string(t), 64))
			}
			if !slices.Contains(names, string(t)) {
				names = append(names, string(t))
			}
		}
		e.Events = strings.Join(names, ",")
	}
	if in.Enabled != nil {
		e.Enabled = *in.Enabled
	}
	if in.ReceivesCodes != nil {
		e.ReceivesCodes = *in.ReceivesCodes
	}
	if e.ReceivesCodes && !secureURL(e.URL) {
		return Errorf(EBADINPUT, "an endpoint that receives codes needs an https URL")
	}
	return nil
}

// CreateEndpoint adds an endpoint and returns it with its secret, which is
// shown this once. BAD_INPUT (a URL the guard refuses, unknown events).
func (h *Webhooks) CreateEndpoint(ctx context.Context, in WebhookEndpointInput, actor string) (*WebhookEndpoint, string, error) {
	if in.URL == nil || in.Events == nil {
		return nil, "", Errorf(EBADINPUT, "an endpoint needs a URL and its events")
	}
	l := h.Ledger
	now := l.now()
	e := &WebhookEndpoint{Enabled: true, CreatedAt: now, UpdatedAt: now}
	if err := h.check(ctx, e, in); err != nil {
		return nil, "", err
	}
	secret := newWebhookSecret()
	e.SecretEnc = l.sealer.SealWebhookSecret(secret)
	err := inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
		e.ID = 0
		if _, err := tx.NewInsert().Model(e).Exec(ctx); err != nil {
			return err
		}
		return audit(ctx, tx, now, actor, "webhook.create", strconv.FormatInt(e.ID, 10), e.URL)
	})
	if err != nil {
		return nil, "", err
	}
	return e, secret, nil
}

// UpdateEndpoint changes an endpoint. NOT_FOUND, BAD_INPUT.
func (h *Webhooks) UpdateEndpoint(ctx context.Context, id int64, in WebhookEndpointInput, actor string) (*WebhookEndpoint, error) {
	return h.changeEndpoint(ctx, id, actor, "webhook.update", func(e *WebhookEndpoint, now time.Time) (string, error) {
		old := *e
		if err := h.check(ctx, e, in); err != nil {
			return "", err
		}
		return fmt.Sprintf("url %s -> %s; events %s -> %s; receivesCodes %t -> %t; enabled %t -> %t",
			old.URL, e.URL, old.Events, e.Events, old.ReceivesCodes, e.ReceivesCodes, old.Enabled, e.Enabled), nil
	})
}

// RotateSecret gives an endpoint a new secret, returned this once; the
// old one keeps signing beside it for RotationGrace. NOT_FOUND.
func (h *Webhooks) RotateSecret(ctx context.Context, id int64, actor string) (*WebhookEndpoint, string, error) {
	var secret string
	e, err := h.changeEndpoint(ctx, id, actor, "webhook.rotate", func(e *WebhookEndpoint, now time.Time) (string, error) {
		secret = newWebhookSecret()
		// The grace is judged by the database's clock, the one every
		// process shares (secrets, PreviousSecretUntil).
		e.PrevSecretEnc, e.PrevSecretUntil = e.SecretEnc, h.Ledger.DBTime().Add(h.Config.RotationGrace)
		e.SecretEnc = h.Ledger.sealer.SealWebhookSecret(secret)
		return "", nil
	})
	return e, secret, err
}

// DeleteEndpoint removes an endpoint: it is no longer listed nor sent to
// (its pending deliveries are cancelled when they come up); its deliveries
// stay in the log. NOT_FOUND.
func (h *Webhooks) DeleteEndpoint(ctx context.Context, id int64, actor string) (*WebhookEndpoint, error) {
	return h.changeEndpoint(ctx, id, actor, "webhook.delete", func(e *WebhookEndpoint, now time.Time) (string, error) {
		e.Enabled, e.DeletedAt = false, now
		return "", nil
	})
}

// changeEndpoint reads an endpoint under its row lock, lets change edit
// it, and writes it back with an audit entry.
func (h *Webhooks) changeEndpoint(ctx context.Context, id int64, actor, action string, change func(*WebhookEndpoint, time.Time) (string, error)) (*WebhookEndpoint, error) {
	l := h.Ledger
	var e WebhookEndpoint
	err := inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
		now := l.now()
		if err := forUpdate(tx.NewSelect().Model(&e).Where("id = ?", id).Where("deleted_at IS NULL")).Scan(ctx); err != nil {
			return notFound(err, "webhook endpoint %d not found", id)
		}
		detail, err := change(&e, now)
		if err != nil {
			return err
		}
		e.UpdatedAt = now
		if _, err := tx.NewUpdate().Model(&e).WherePK().Exec(ctx); err != nil {
			return err
		}
		return audit(ctx, tx, now, actor, action, strconv.FormatInt(id, 10), detail)
	})
	if err != nil {
		return nil, err
	}
	return &e, nil
}

// Endpoints lists the endpoints that are not deleted, oldest first.
func (h *Webhooks) Endpoints(ctx context.Context) ([]WebhookEndpoint, error) {
	var es []WebhookEndpoint
	err := h.Ledger.db.NewSelect().Model(&es).Where("deleted_at IS NULL").Order("id").Scan(ctx)
	return es, err
}

// Endpoint returns one endpoint that is not deleted. NOT_FOUND.
func (h *Webhooks) Endpoint(ctx context.Context, id int64) (*WebhookEndpoint, error) {
	var e WebhookEndpoint
	if err := h.Ledger.db.NewSelect().Model(&e).Where("id = ?", id).Where("deleted_at IS NULL").Scan(ctx); err != nil {
		return nil, notFound(err, "webhook endpoint %d not found", id)
	}
	return &e, nil
}

// DeliveryPage is one page of an endpoint's deliveries, newest first.
type DeliveryPage struct {
	Deliveries []WebhookDelivery
	HasNext    bool
}

// Deliveries pages through an endpoint's delivery log, newest first, each
// with its event. NOT_FOUND, BAD_INPUT (page size).
func (h *Webhooks) Deliveries(ctx context.Context, endpointID, afterID int64, limit int) (*DeliveryPage, error) {
	limit, err := clampLimit(limit)
	if err != nil {
		return nil, err
	}
	db := h.Ledger.db
	if exists, err := db.NewSelect().Model((*WebhookEndpoint)(nil)).Where("id = ?", endpointID).Exists(ctx); err != nil || !exists {
		return nil, notFound(errors.Join(err, errNoEndpoint), "webhook endpoint %d not found", endpointID)
	}
	var ds []WebhookDelivery
	hasNext, err := idPage(ctx, db.NewSelect().Model(&ds).Where("endpoint_id = ?", endpointID), &ds, afterID, limit)
	if err != nil {
		return nil, err
	}
	if len(ds) > 0 {
		ids := make([]int64, len(ds))
		for i, d := range ds {
			ids[i] = d.EventID
		}
		var evs []Event
		if err := db.NewSelect().Model(&evs).Where("id IN (?)", bun.List(ids)).Scan(ctx); err != nil {
			return nil, err
		}
		byID := make(map[int64]*Event, len(evs))
		for i := range evs {
			byID[evs[i].ID] = &evs[i]
		}
		for i := range ds {
			ds[i].Event = byID[ds[i].EventID]
		}
	}
	return &DeliveryPage{Deliveries: ds, HasNext: hasNext}, nil
}

var errNoEndpoint = errors.New("no such endpoint")

// Redeliver sends an event again to one endpoint (endpointID > 0) or to
// every enabled endpoint that wants it: a delivery that ended (delivered,
// failed, cancelled) starts a new round of attempts, due now, one still
// PENDING is left to its schedule; an endpoint that never had it (added
// since) gets it. It returns the deliveries. NOT_FOUND (no such event),
// CONFLICT (the endpoint is disabled or does not want this event, or the
// event's first deliveries are not made yet).
func (h *Webhooks) Redeliver(ctx context.Context, eventID, endpointID int64, actor string) ([]WebhookDelivery, error) {
	l := h.Ledger
	var out []WebhookDelivery
	err := inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
		out = nil
		now, due := l.now(), l.DBTime()
		var ev Event
		if err := tx.NewSelect().Model(&ev).Where("id = ?", eventID).Scan(ctx); err != nil {
			return notFound(err, "event %d not found", eventID)
		}
		if !ev.FannedOut {
			// Its first deliveries are still to be made (by FanOut, which
			// would then find this one in its way).
			return Errorf(ECONFLICT, "event %d is being sent for the first time", eventID)
		}
		var es []WebhookEndpoint
		q := tx.NewSelect().Model(&es).Where("deleted_at IS NULL").Where("enabled = ?", true)
		if endpointID > 0 {
			q = q.Where("id = ?", endpointID)
		}
		if err := q.Order("id").Scan(ctx); err != nil {
			return err
		}
		for _, e := range es {
			if !e.wants(ev.Type) {
				continue
			}
			var d WebhookDelivery
			err := tx.NewSelect().Model(&d).Where("endpoint_id = ?", e.ID).Where("event_id = ?", ev.ID).Scan(ctx)
			switch {
			case err == nil:
				if _, err := apply(ctx, tx, DeliveryResend, now, func(q *bun.UpdateQuery) *bun.UpdateQuery { return q.Where("id = ?", d.ID) },
					col("resends = resends + 1"), col("attempts = 0"), col("next_attempt_at = ?", due), col("delivered_at = NULL")); err != nil {
					return err
				}
			case errors.Is(err, sql.ErrNoRows):
				d = newDelivery(ev.ID, e.ID, now, due)
				if _, err := tx.NewInsert().Model(&d).Exec(ctx); err != nil {
					return err
				}
			default:
				return err
			}
			if err := tx.NewSelect().Model(&d).WherePK().Scan(ctx); err != nil {
				return err
			}
			out = append(out, d)
		}
		if len(out) == 0 {
			if endpointID > 0 {
				return Errorf(ECONFLICT, "endpoint %d is not enabled or does not want %s", endpointID, ev.Type)
			}
			return Errorf(ECONFLICT, "no enabled endpoint wants %s", ev.Type)
		}
		return audit(ctx, tx, now, actor, "webhook.redeliver", strconv.FormatInt(eventID, 10), "")
	})
	if err == nil && h.Schedule != nil {
		due := make([]DeliveryDue, len(out))
		for i, d := range out {
			due[i] = DeliveryDue{ID: d.ID, Due: d.NextAttemptAt}
		}
		if err := h.Schedule(ctx, due); err != nil {
			h.Log.WarnContext(ctx, "redelivery not queued; the sweeper will queue it", "event", eventID, "err", err)
		}
	}
	return out, err
}

func newDelivery(eventID, endpointID int64, now, due time.Time) WebhookDelivery {
	return WebhookDelivery{EventID: eventID, EndpointID: endpointID, Status: DeliveryPending, NextAttemptAt: due, CreatedAt: now, UpdatedAt: now}
}

// --- dispatch --------------------------------------------------------------

// DeliveryDue is a delivery to put on the delivery queue.
type DeliveryDue struct {
	ID  int64
	Due time.Time
}

// FanOut takes up to limit events not fanned out yet, oldest first, and
// makes one delivery per enabled endpoint that wants each, in one
// transaction: of two processes fanning out at once, each event is taken
// by one (the rows are locked, SKIP LOCKED). It returns the new
// deliveries and how many events it took.
func (h *Webhooks) FanOut(ctx context.Context, limit int) ([]DeliveryDue, int, error) {
	l := h.Ledger
	var out []DeliveryDue
	var taken int
	err := inTx(ctx, l.db, func(ctx context.Context, tx bun.Tx) error {
		out, taken = nil, 0
		var evs []Event
		if err := forUpdateSkipLocked(tx.NewSelect().Model(&evs).Column("id", "type").
			Where("fanned_out = ?", false).Order("id").Limit(int64(limit))).Scan(ctx); err != nil {
			return err
		}
		if len(evs) == 0 {
			return nil
		}
		ids := make([]int64, len(evs))
		for i, ev := range evs {
			ids[i] = ev.ID
		}
		n, err := tx.NewUpdate().Model((*Event)(nil)).Set("fanned_out = ?", true).
			Where("id IN (?)", bun.List(ids)).Where("fanned_out = ?", false).Exec(ctx)
		if err != nil {
			return err
		}
		if m, err := n.RowsAffected(); err != nil || m != int64(len(ids)) {
			return errors.Join(err, errRetry) // another process took some first (SQLite has no row locks to skip)
		}
		var es []WebhookEndpoint
		if err := tx.NewSelect().Model(&es).Where("deleted_at IS NULL").Where("enabled = ?", true).Order("id").Scan(ctx); err != nil {
			return err
		}
		now, due := l.now(), l.DBTime()
		var ds []WebhookDelivery
		for _, ev := range evs {
			for _, e := range es {
				if e.wants(ev.Type) {
					ds = append(ds, newDelivery(ev.ID, e.ID, now, due))
				}
			}
		}
		taken = len(evs)
		for start := 0; start < len(ds); start += 500 {
			part := ds[start:min(start+500, len(ds))]
			if _, err := tx.NewInsert().Model(&part).Exec(ctx); err != nil {
				return err
			}
		}
		if len(ds) == 0 {
			return nil
		}
		if dialectName(tx) != dialect.MySQL {
			// PostgreSQL and SQLite return the new rows' ids (RETURNING),
			// which bun has set in ds. Read back by their events instead,
			// on PostgreSQL with statistics from before a receiver went
			// down (deliveries all DELIVERED), the planner read every
			// PENDING delivery, the backlog, for each page of events.
			for _, d := range ds {
				out = append(out, DeliveryDue{ID: d.ID, Due: d.NextAttemptAt})
			}
			return nil
		}
		// The ids, read back: MySQL does not return a bulk insert's.
		var rows []WebhookDelivery
		if err := tx.NewSelect().Model(&rows).Column("id", "next_attempt_at").
			Where("event_id IN (?)", bun.List(ids)).Where("status = ?", DeliveryPending).Scan(ctx); err != nil {
			return err
		}
		for _, d := range rows {
			out = append(out, DeliveryDue{ID: d.ID, Due: d.NextAttemptAt})
		}
		return nil
	})
	return out, taken, err
}

// Prune keeps the outbox and the delivery log from growing without end:
// it deletes deliveries that ended (delivered, failed, cancelled) and saw
// no change for Keep, then events fanned out more than Keep ago that no
// delivery refers to any more (an event no endpoint wanted, or whose
// deliveries were pruned). A PENDING delivery and its event are never
// deleted; each statement checks its condition again, so a delivery sent
// again meanwhile stays. At most limit rows of each kind per call: the
// sweeper calls it every sweep.
func (h *Webhooks) Prune(ctx context.Context, limit int) (deliveries, events int, err error) {
	db := h.Ledger.db
	cutoff := h.Ledger.DBTime().Add(-h.Config.withDefaults().Keep)
	ended := []DeliveryStatus{DeliveryDelivered, DeliveryFailed, DeliveryCancelled}
	var ids []int64
	if err := db.NewSelect().Model((*WebhookDelivery)(nil)).Column("id").
		Where("status IN (?)", bun.List(ended)).Where("created_at < ?", cutoff).Where("updated_at < ?", cutoff).
		Order("id").Limit(int64(limit)).Scan(ctx, &ids); err != nil {
		return 0, 0, err
	}
	if len(ids) > 0 {
		res, err := db.NewDelete().Model((*WebhookDelivery)(nil)).Where("id IN (?)", bun.List(ids)).
			Where("status IN (?)", bun.List(ended)).Where("updated_at < ?", cutoff).Exec(ctx)
		if err != nil {
			return 0, 0, err
		}
		n, _ := res.RowsAffected()
		deliveries = int(n)
	}
	const unreferenced = "NOT EXISTS (SELECT 1 FROM webhook_delivery d WHERE d.event_id = events.id)"
	ids = ids[:0]
	if err := db.NewSelect().TableExpr("events").Column("id").
		Where("fanned_out = ?", true).Where("occurred_at < ?", cutoff).Where(unreferenced).
		Order("id").Limit(int64(limit)).Scan(ctx, &ids); err != nil {
		return deliveries, 0, err
	}
	if len(ids) > 0 {
		res, err := db.NewDelete().TableExpr("events").Where("id IN (?)", bun.List(ids)).Where(unreferenced).Exec(ctx)
		if err != nil {
			return deliveries, 0, err
		}
		n, _ := res.RowsAffected()
		events = int(n)
	}
	return deliveries, events, nil
}

// DueDeliveries lists PENDING deliveries due by before, oldest due first,
// from the (status, next_attempt_at) index: what the sweeper puts back on
// the queue after Redis lost it. after, if not nil, is the last one of the
// previous page: the page starts past it.
func (h *Webhooks) DueDeliveries(ctx context.Context, before time.Time, after *DeliveryDue, limit int) ([]DeliveryDue, error) {
	var rows []WebhookDelivery
	q := h.Ledger.db.NewSelect().Model(&rows).Column("id", "next_attempt_at").Where("status = ?", DeliveryPending).
		Where("next_attempt_at <= ?", before.UTC())
	if after != nil {
		q = q.Where("(next_attempt_at > ? OR (next_attempt_at = ? AND id > ?))", after.Due.UTC(), after.Due.UTC(), after.ID)
	}
	if err := q.OrderExpr("next_attempt_at, id").Limit(int64(limit)).Scan(ctx); err != nil {
		return nil, err
	}
	out := make([]DeliveryDue, len(rows))
	for i, d := range rows {
		out[i] = DeliveryDue{ID: d.ID, Due: d.NextAttemptAt}
	}
	return out, nil
}

// DeliveryEndpoints maps each of the deliveries ids that exists to its
// endpoint: the delivery workers give each endpoint a lane of its own.
func (h *Webhooks) DeliveryEndpoints(ctx context.Context, ids []int64) (map[int64]int64, error) {
	out := make(map[int64]int64, len(ids))
	if len(ids) == 0 {
		return out, nil
	}
	var rows []WebhookDelivery
	db := h.Ledger.db
	var q *bun.SelectQuery
	if dialectName(db) == dialect.PG {
		// One probe of the key each (OFFSET 0 keeps the probe a
		// subquery): a claim that walks a lane's backlog names 500, and
		// asked "id IN (…500…)" with statistics of a moment the table
		// held a few deliveries, the planner read all of them.
		q = db.NewSelect().ColumnExpr("d.id, d.endpoint_id").TableExpr(`unnest(?::bigint[]) AS u(v) CROSS JOIN LATERAL
			(SELECT id, endpoint_id FROM webhook_delivery WHERE id = u.v OFFSET 0) AS d`, pgdialect.Array(ids))
	} else {
		q = db.NewSelect().Model((*WebhookDelivery)(nil)).Column("id", "endpoint_id").Where("id IN (?)", bun.List(ids))
	}
	if err := q.Scan(ctx, &rows); err != nil {
		return nil, err
	}
	for _, d := range rows {
		out[d.ID] = d.EndpointID
	}
	return out, nil
}

// Backlog is what waits to be delivered.
type Backlog struct {
	Events      int64     // events not fanned out yet
	Pending     int64     // deliveries PENDING
	OldestSince time.Time // when the oldest undelivered event occurred; zero: none
}

// Backlog counts what waits, from the fan-out and age indexes.
func (h *Webhooks) Backlog(ctx context.Context) (Backlog, error) {
	db := h.Ledger.db
	var b Backlog
	var oldestEvent, oldestDelivery []time.Time
	if err := db.NewSelect().Model((*Event)(nil)).ColumnExpr("COUNT(*)").Where("fanned_out = ?", false).Scan(ctx, &b.Events); err != nil {
		return b, err
	}
	if err := db.NewSelect().Model((*WebhookDelivery)(nil)).ColumnExpr("COUNT(*)").Where("status = ?", DeliveryPending).Scan(ctx, &b.Pending); err != nil {
		return b, err
	}
	if err := db.NewSelect().Model((*Event)(nil)).Column("occurred_at").Where("fanned_out = ?", false).Order("id").Limit(1).Scan(ctx, &oldestEvent); err != nil {
		return b, err
	}
	if err := db.NewSelect().Model((*WebhookDelivery)(nil)).Column("created_at").Where("status = ?", DeliveryPending).
		Order("created_at").Limit(1).Scan(ctx, &oldestDelivery); err != nil {
		return b, err
	}
	for _, t := range append(oldestEvent, oldestDelivery...) {
		if b.OldestSince.IsZero() || t.Before(b.OldestSince) {
			b.OldestSince = t
		}
	}
	return b, nil
}

// --- delivery --------------------------------------------------------------

// maxSnippet bounds what is kept of an answer's body.
const maxSnippet = 512

// Deliver makes one attempt at a delivery, if it is PENDING and due, and
// returns the delivery as it is afterwards: the caller puts a PENDING one
// back on the queue at NextAttemptAt. NOT_FOUND.
func (h *Webhooks) Deliver(ctx context.Context, id int64) (*WebhookDelivery, error) {
	l := h.Ledger
	d, err := h.delivery(ctx, id)
	if err != nil || d.Status != DeliveryPending {
		return d, err
	}
	due := l.DBTime()
	if d.NextAttemptAt.After(due) {
		return d, nil // not due (claimed early, or another worker holds its attempt)
	}
	var e WebhookEndpoint
	if err := l.db.NewSelect().Model(&e).Where("id = ?", d.EndpointID).Scan(ctx); err != nil {
		return nil, err
	}
	if !e.Enabled || !e.DeletedAt.IsZero() {
		if _, err := applyAlone(ctx, l.db, DeliveryCancel, l.now(), whereAttempt(d, d.Attempts)); err != nil {
			return nil, err
		}
		h.observe(OutcomeCancelled, 0)
		return h.delivery(ctx, id)
	}
	// Take the attempt: the one worker whose update moves the count sends.
	// Until it reports, the delivery is not due (a crash brings it back
	// once the attempt's time is up).
	attempt := d.Attempts + 1
	n, err := applyAlone(ctx, l.db, DeliveryAttempt, l.now(), func(q *bun.UpdateQuery) *bun.UpdateQuery {
		return whereAttempt(d, d.Attempts)(q).Where("next_attempt_at <= ?", due)
	}, col("attempts = ?", attempt), col("last_attempt_at = ?", l.now()), col("next_attempt_at = ?", due.Add(2*h.Config.Timeout+time.Minute)))
	if err != nil {
		return nil, err
	}
	if n == 0 {
		return h.delivery(ctx, id) // another worker took it
	}
	status, latency, snippet, sendErr := h.send(ctx, d, &e)
	return h.record(ctx, d, &e, attempt, status, latency, snippet, sendErr)
}

// applyAlone is apply in a transaction of its own, as inTx runs it: at
// READ COMMITTED, and again when the database made it a deadlock's victim.
// Alone, at MariaDB's default REPEATABLE READ, the attempt's update scans
// the (status, next_attempt_at) index with next-key locks and deadlocks
// with another delivery's update; the victim's attempt was left taken but
// unrecorded (a sent delivery sent again once its attempt's time is up).
func applyAlone(ctx context.Context, db *bun.DB, t Transition, now time.Time, key func(*bun.UpdateQuery) *bun.UpdateQuery, cols ...column) (int64, error) {
	var n int64
	err := inTx(ctx, db, func(ctx context.Context, tx bun.Tx) error {
		var err error
		n, err = apply(ctx, tx, t, now, key, cols...)
		return err
	})
	return n, err
}

func (h *Webhooks) delivery(ctx context.Context, id int64) (*WebhookDelivery, error) {
	var d WebhookDelivery
	if err := h.Ledger.db.NewSelect().Model(&d).Where("id = ?", id).Scan(ctx); err != nil {
		return nil, notFound(err, "webhook delivery %d not found", id)
	}
	return &d, nil
}

// whereAttempt keys an update on d's round (as it was read) and attempts:
// the round keeps a worker whose attempt outlived a resend from matching
// the new round's attempt of the same number.
func whereAttempt(d *WebhookDelivery, attempts int) func(*bun.UpdateQuery) *bun.UpdateQuery {
	return func(q *bun.UpdateQuery) *bun.UpdateQuery {
		return q.Where("id = ?", d.ID).Where("resends = ?", d.Resends).Where("attempts = ?", attempts)
	}
}

// body is what is posted for an event.
type body struct {
	ID         string          `json:"id"`
	Type       EventType       `json:"type"`
	OccurredAt time.Time       `json:"occurredAt"`
	Data       json.RawMessage `json:"data"`
}

// send posts the delivery's event to e once. For an endpoint marked to
// receive codes, an order.paid event gets the order's codes here, after
// their reveal is recorded; they are never written anywhere else.
func (h *Webhooks) send(ctx context.Context, d *WebhookDelivery, e *WebhookEndpoint) (status int, latency time.Duration, snippet string, err error) {
	l := h.Ledger
	var ev Event
	if err := l.db.NewSelect().Model(&ev).Where("id = ?", d.EventID).Scan(ctx); err != nil {
		return 0, 0, "", fmt.Errorf("reading the event: %w", err)
	}
	data, carried := json.RawMessage(ev.Payload), false
	if e.ReceivesCodes && ev.Type == EventOrderPaid {
		if data, carried, err = h.withCodes(ctx, ev, e); err != nil {
			return 0, 0, "", err
		}
	}
	b, err := json.Marshal(body{ID: strconv.FormatInt(ev.ID, 10), Type: ev.Type, OccurredAt: ev.OccurredAt, Data: data})
	if err != nil {
		return 0, 0, "", err
	}
	secrets, err := h.secrets(e)
	if err != nil {
		return 0, 0, "", err
	}
	ctx, cancel := context.WithTimeout(ctx, h.Config.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.URL, bytes.NewReader(b))
	if err != nil {
		return 0, 0, "", err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", "kami-webhooks/1")
	req.Header.Set(webhook.EventIDHeader, strconv.FormatInt(ev.ID, 10))
	req.Header.Set(webhook.EventTypeHeader, string(ev.Type))
	req.Header.Set(webhook.SignatureHeader, webhook.Sign(time.Now(), b, secrets...))
	start := time.Now()
	resp, err := h.Client.Do(req)
	if err != nil {
		return 0, time.Since(start), "", err
	}
	defer resp.Body.Close()
	head, _ := io.ReadAll(io.LimitReader(resp.Body, maxSnippet))
	io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10)) // so the connection can be reused
	if carried {
		// A receiver may echo the request, codes included: what it
		// answered is not kept, where every admin would read it.
		return resp.StatusCode, time.Since(start), snippetWithheld, nil
	}
	return resp.StatusCode, time.Since(start), StoredText(string(head), maxSnippet), nil
}

// snippetWithheld stands for the answer to a delivery that carried codes.
const snippetWithheld = "(not kept: this delivery carried card codes)"

// secrets are the endpoint's signing secrets: the current one, and the
// one before a rotation while it is still valid.
func (h *Webhooks) secrets(e *WebhookEndpoint) ([]string, error) {
	s := h.Ledger.sealer
	cur, err := s.OpenWebhookSecret(e.SecretEnc)
	if err != nil {
		return nil, err
	}
	out := []string{cur}
	if _, ok := h.PreviousSecretUntil(e); ok {
		prev, err := s.OpenWebhookSecret(e.PrevSecretEnc)
		if err != nil {
			return nil, err
		}
		out = append(out, prev)
	}
	return out, nil
}

// PreviousSecretUntil is until when e's rotated-out secret still signs,
// and whether it still does, by the database's clock.
func (h *Webhooks) PreviousSecretUntil(e *WebhookEndpoint) (time.Time, bool) {
	if len(e.PrevSecretEnc) == 0 || !e.PrevSecretUntil.After(h.Ledger.DBTime()) {
		return time.Time{}, false
	}
	return e.PrevSecretUntil, true
}

// RevealWebhook: an order's codes posted to a webhook endpoint marked to
// receive them.
const RevealWebhook RevealChannel = "WEBHOOK"

// ViewerEndpoint is a seller's webhook endpoint.
const ViewerEndpoint RevealViewer = "ENDPOINT"

// withCodes is an order.paid payload with the order's codes, recorded as
// a reveal to the endpoint first, and true. An order that is no longer
// PAID and delivered (refunded since, or being refunded: a retry or a
// redelivery can come days later) gets no codes: its payload says why in
// CodesWithheld, no reveal is recorded, and it returns false.
func (h *Webhooks) withCodes(ctx context.Context, ev Event, e *WebhookEndpoint) (json.RawMessage, bool, error) {
	l := h.Ledger
	var o OrderObject
	if err := json.Unmarshal([]byte(ev.Payload), &o); err != nil {
		return nil, false, err
	}
	order, err := l.Order(ctx, o.OrderNo)
	if err != nil {
		return nil, false, err
	}
	switch {
	case order.Status != OrderPaid || order.DeliveredAt.IsZero():
		o.CodesWithheld = "order is " + string(order.Status)
	case !secureURL(e.URL):
		o.CodesWithheld = "the endpoint's URL is not https" // an endpoint stored before the rule
	}
	if o.CodesWithheld != "" {
		data, err := json.Marshal(o)
		return data, false, err
	}
	codes, err := l.DeliveredCodes(ctx, order)
	if err != nil {
		return nil, false, err
	}
	if err := l.RecordReveals(ctx, Reveal{Channel: RevealWebhook, Viewer: ViewerEndpoint, Actor: "webhook:" + strconv.FormatInt(e.ID, 10),
		OrderNo: o.OrderNo, Codes: len(codes), Ref: "event:" + strconv.FormatInt(ev.ID, 10)}); err != nil {
		return nil, false, fmt.Errorf("recording the reveal: %w", err)
	}
	o.Cards = codes
	data, err := json.Marshal(o)
	return data, true, err
}

// record writes what attempt came to, guarded by the round and attempt it
// took: a resend that started a new round meanwhile is left alone.
func (h *Webhooks) record(ctx context.Context, d *WebhookDelivery, e *WebhookEndpoint, attempt, status int, latency time.Duration, snippet string, sendErr error) (*WebhookDelivery, error) {
	l := h.Ledger
	now := l.now()
	cols := []column{col("last_status = ?", status), col("last_latency_ms = ?", int(latency/time.Millisecond)),
		col("response_snippet = ?", snippet), col("last_error = ?", StoredText(errText(sendErr, status), 255))}
	outcome := OutcomeDelivered
	var err error
	switch {
	case sendErr == nil && status >= 200 && status < 300:
		_, err = applyAlone(ctx, l.db, DeliveryDeliver, now, whereAttempt(d, attempt), append(cols, col("delivered_at = ?", now), col("next_attempt_at = NULL"))...)
	case attempt >= h.Config.MaxAttempts():
		outcome = OutcomeFailed
		var n int64
		n, err = applyAlone(ctx, l.db, DeliveryGiveUp, now, whereAttempt(d, attempt), append(cols, col("next_attempt_at = NULL"))...)
		if err == nil && n == 1 {
			h.Alerts.Alert(ctx, Alert{Kind: "webhook_failed", Subject: fmt.Sprintf("endpoint %d", e.ID),
				Message: fmt.Sprintf("event %d was not delivered to %s after %d attempts: %s; send it again with redeliverWebhookEvent",
					d.EventID, redactURL(e.URL), attempt, StoredText(errText(sendErr, status), 255))})
		}
	default:
		outcome = OutcomeRetry
		_, err = applyAlone(ctx, l.db, DeliveryAttempt, now, whereAttempt(d, attempt),
			append(cols, col("next_attempt_at = ?", l.DBTime().Add(h.Config.backoff(attempt))))...)
	}
	if err != nil {
		return nil, err
	}
	h.observe(outcome, latency)
	if outcome != OutcomeDelivered {
		h.Log.InfoContext(ctx, "webhook attempt failed", "delivery", d.ID, "event", d.EventID, "endpoint", e.ID,
			"attempt", attempt, "status", status, "err", errText(sendErr, status), "outcome", outcome)
	}
	return h.delivery(ctx, d.ID)
}

func (h *Webhooks) observe(o DeliveryOutcome, latency time.Duration) {
	if h.OnAttempt != nil {
		h.OnAttempt(o, latency)
	}
}

// errText says why an attempt failed, without the URL (the log names the
// endpoint) and without the event.
func errText(err error, status int) string {
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err
	}
	switch {
	case err != nil:
		return err.Error()
	case status < 200 || status >= 300:
		return "HTTP " + strconv.Itoa(status)
	}
	return ""
}

// secureURL reports whether raw is an https URL: card codes never cross
// the network in the clear.
func secureURL(raw string) bool {
	u, err := url.Parse(raw)
	return err == nil && u.Scheme == "https"
}

// redactURL is an endpoint's URL to name it in an alert: without the
// userinfo, query and fragment, where a receiver's credentials or tokens
// may be, since alerts go to places the admin API does not.
func redactURL(s string) string {
	u, err := url.Parse(s)
	if err != nil {
		return "(an invalid URL)"
	}
	u.User, u.RawQuery, u.ForceQuery, u.Fragment, u.RawFragment = nil, "", false, "", ""
	return u.String()
}
