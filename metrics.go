package main

import (
	"context"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"kami/domain"
)

// metrics is kami's Prometheus registry: the article's three figures
// (queue backlog, close success rate, refund failure rate) and what it
// takes to see them move. It is the Shop's Observer.
type metrics struct {
	reg *prometheus.Registry

	ordersPlaced   prometheus.Counter
	ordersRefused  *prometheus.CounterVec
	closes         *prometheus.CounterVec
	closeFailures  prometheus.Counter
	closeLatency   prometheus.Histogram
	payments       *prometheus.CounterVec
	refundAttempts *prometheus.CounterVec
	webhooks       *prometheus.CounterVec
	graphql        *prometheus.CounterVec
	alerts         *prometheus.CounterVec
	violations     prometheus.Gauge
	reconciled     *prometheus.GaugeVec
	statementRuns  *prometheus.CounterVec
	statementDiffs *prometheus.CounterVec
	statementDone  *prometheus.GaugeVec
	deliveries     *prometheus.CounterVec
	deliveryTime   prometheus.Histogram

	// closeOK and closeAll count this process's close attempts for the
	// stats query's close success rate.
	closeOK, closeAll atomic.Int64
}

var _ domain.Observer = (*metrics)(nil)

// QueueStat is one delay queue's health at scrape time.
type queueStat struct {
	Name          string
	Backlog       int64
	Leased        int64
	OldestOverdue time.Duration
}

func newMetrics(queues func(context.Context) ([]queueStat, error)) *metrics {
	m := &metrics{reg: prometheus.NewRegistry()}
	f := func(c prometheus.Collector) { m.reg.MustRegister(c) }
	m.ordersPlaced = prometheus.NewCounter(prometheus.CounterOpts{Name: "kami_orders_placed_total", Help: "Orders placed."})
	m.ordersRefused = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kami_orders_refused_total",
		Help: "Orders refused, by error code (SOLD_OUT, LIMIT_EXCEEDED, UNAVAILABLE, BAD_INPUT, ...)."}, []string{"code"})
	m.closes = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kami_closes_total",
		Help: "Orders handled by the close path, by reason (timeout, cancel) and outcome (CLOSED, SKIPPED, NOT_DUE, NOT_FOUND)."},
		[]string{"reason", "outcome"})
	m.closeFailures = prometheus.NewCounter(prometheus.CounterOpts{Name: "kami_close_failures_total",
		Help: "Orders whose close batch failed (retried after the lease)."})
	m.closeLatency = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kami_close_latency_seconds",
		Help:    "Due-to-closed latency: how long after its expiry an order was closed.",
		Buckets: []float64{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800}})
	m.payments = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kami_payments_total",
		Help: "Payments applied, by outcome (DELIVERED, DUPLICATE, LATE_REFUND, LATE_DELIVERED, DUPLICATE_REFUNDS)."}, []string{"outcome"})
	m.refundAttempts = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kami_refund_attempts_total",
		Help: "Refund attempts by result (succeeded, retry, failed, processing: accepted and still processing at the provider, unconfirmed: no answer past the backoff, still asked about) and attempt number (10+ past the tenth)."}, []string{"result", "attempt"})
	m.webhooks = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kami_webhook_notifications_total",
		Help: "Provider notifications received, by provider and result (ok, invalid, refused, error)."}, []string{"provider", "result"})
	m.graphql = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kami_graphql_requests_total",
		Help: "GraphQL operations by operation name and error code (\"\" when none)."}, []string{"operation", "code"})
	m.alerts = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kami_alerts_total",
		Help: "Alerts raised, by kind (refund_failed, inconsistency, amount_mismatch, stragglers, ...)."}, []string{"kind"})
	m.violations = prometheus.NewGauge(prometheus.GaugeOpts{Name: "kami_ledger_violations",
		Help: "Ledger invariant violations found by the last audit (reconciliation)."})
	m.reconciled = prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kami_reconcile_last",
		Help: "Figures of the last reconciliation run: closed stragglers, stale refunds, rescheduled tasks, repaired counters, and its end as a Unix time."},
		[]string{"figure"})
	m.statementRuns = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kami_statement_runs_total",
		Help: "Statement reconciliation runs, by provider, source (STATEMENT, QUERY) and status (DONE, NOT_READY, FAILED)."},
		[]string{"provider", "source", "status"})
	m.statementDiffs = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kami_statement_differences_total",
		Help: "Differences the statement reconciliation found, by provider, kind and what was done (action)."},
		[]string{"provider", "kind", "action"})
	m.statementDone = prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kami_statement_last_done_unix",
		Help: "When a statement of the provider was last reconciled to the end (DONE), as a Unix time."}, []string{"provider"})
	m.deliveries = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kami_webhook_deliveries_total",
		Help: "Outgoing webhook delivery attempts, by outcome (delivered, retry, failed: the last attempt failed, cancelled: its endpoint is disabled or deleted)."},
		[]string{"outcome"})
	m.deliveryTime = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kami_webhook_attempt_seconds",
		Help: "How long outgoing webhook attempts took to be answered (or to fail).", Buckets: prometheus.DefBuckets})
	f(m.deliveries)
	f(m.deliveryTime)
	for _, c := range []prometheus.Collector{m.ordersPlaced, m.ordersRefused, m.closes, m.closeFailures, m.closeLatency,
		m.payments, m.refundAttempts, m.webhooks, m.graphql, m.alerts, m.violations, m.reconciled,
		m.statementRuns, m.statementDiffs, m.statementDone} {
		f(c)
	}
	f(collectors.NewGoCollector())
	f(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if queues != nil {
		f(&queueCollector{stats: queues})
	}
	return m
}

func (m *metrics) OrderPlaced()             { m.ordersPlaced.Inc() }
func (m *metrics) OrderRefused(code string) { m.ordersRefused.WithLabelValues(code).Inc() }
func (m *metrics) OrderClosed(reason domain.CloseReason, outcome domain.CloseOutcome, lateBy time.Duration) {
	m.closes.WithLabelValues(string(reason), string(outcome)).Inc()
	m.closeAll.Add(1)
	if outcome == domain.Closed || outcome == domain.CloseSkipped {
		m.closeOK.Add(1)
	}
	if outcome == domain.Closed && reason == domain.CloseTimeout {
		m.closeLatency.Observe(max(lateBy, 0).Seconds())
	}
}
func (m *metrics) CloseFailed(orders int) {
	m.closeFailures.Add(float64(orders))
	m.closeAll.Add(int64(orders))
}

// closeSuccessRate is the share of this process's close attempts that
// closed or correctly skipped their order; nil before any.
func (m *metrics) closeSuccessRate() *float64 {
	all := m.closeAll.Load()
	if all == 0 {
		return nil
	}
	r := float64(m.closeOK.Load()) / float64(all)
	return &r
}

// Reconciled records the figures of a finished reconciliation.
func (m *metrics) Reconciled(run domain.ReconcileRun) {
	m.violations.Set(float64(run.Violations))
	for figure, v := range map[string]float64{
		"closed_stragglers": float64(run.ClosedStragglers), "stale_refunds": float64(run.StaleRefunds),
		"rescheduled": float64(run.Rescheduled), "counters_repaired": float64(run.CountersRepaired),
		"finished_unix": float64(run.FinishedAt.Unix()),
	} {
		m.reconciled.WithLabelValues(figure).Set(v)
	}
}

// StatementRun records a finished statement run and its differences.
func (m *metrics) StatementRun(run domain.StatementRun, diffs []domain.StatementDifference) {
	m.statementRuns.WithLabelValues(run.Provider, string(run.Source), string(run.Status)).Inc()
	for _, d := range diffs {
		m.statementDiffs.WithLabelValues(run.Provider, string(d.Kind), string(d.Action)).Inc()
	}
	if run.Source == domain.SourceStatement && run.Status == domain.RunDone {
		m.statementDone.WithLabelValues(run.Provider).Set(float64(run.FinishedAt.Unix()))
	}
}

func (m *metrics) PaymentRecorded(outcome domain.PaymentOutcome) {
	m.payments.WithLabelValues(string(outcome)).Inc()
}
func (m *metrics) RefundAttempt(result string, attempt int) {
	// A refund whose outcome stays unknown is asked about on the slow poll
	// for as long as it takes: its later attempts share one label.
	label := strconv.Itoa(attempt)
	if attempt > 10 {
		label = "10+"
	}
	m.refundAttempts.WithLabelValues(result, label).Inc()
}
func (m *metrics) Webhook(provider, result string) {
	m.webhooks.WithLabelValues(provider, result).Inc()
}
func (m *metrics) GraphQL(operation, code string) { m.graphql.WithLabelValues(operation, code).Inc() }
func (m *metrics) Alert(kind string)              { m.alerts.WithLabelValues(kind).Inc() }

// watchGroups exports the ledger's group-commit counters (see
// domain.GroupStats) by kind: place, pay.
func (m *metrics) watchGroups(l *domain.Ledger) {
	kinds := []struct {
		kind  string
		stats func() domain.GroupStats
	}{{"place", l.PlaceStats}, {"pay", l.PayStats}}
	for _, k := range kinds {
		labels := prometheus.Labels{"kind": k.kind}
		m.reg.MustRegister(
			prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kami_group_batches_total", ConstLabels: labels,
				Help: "Shared transactions (group commit) tried, by kind."}, func() float64 { return float64(k.stats().Batches) }),
			prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kami_group_calls_total", ConstLabels: labels,
				Help: "Calls the shared transactions carried, by kind: calls over batches is the mean batch size."}, func() float64 { return float64(k.stats().Calls) }),
			prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kami_group_split_total", ConstLabels: labels,
				Help: "Shared transactions that failed and were redone call by call, by kind."}, func() float64 { return float64(k.stats().Split) }),
		)
	}
}

// watchStock exports each product's stock, read from the ledger at scrape
// time (a grouped count over the (product_id, status, id) index).
func (m *metrics) watchStock(l *domain.Ledger) { m.reg.MustRegister(&stockCollector{ledger: l}) }

var (
	sellableDesc = prometheus.NewDesc("kami_stock_sellable",
		"Cards of a product that can be sold now (UNSOLD + RECYCLED).", []string{"product"}, nil)
	withdrawnDesc = prometheus.NewDesc("kami_stock_withdrawn",
		"Cards of a product taken off sale by batch recalls.", []string{"product"}, nil)
	lowStockDesc = prometheus.NewDesc("kami_stock_low",
		"1 while a product's sellable cards are at or below its low-stock threshold (its alert was raised).", []string{"product"}, nil)
	stockUpDesc = prometheus.NewDesc("kami_stock_up", "1 when the stock figures could be read from the database.", nil, nil)
)

type stockCollector struct{ ledger *domain.Ledger }

func (c *stockCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- sellableDesc
	ch <- withdrawnDesc
	ch <- lowStockDesc
	ch <- stockUpDesc
}

func (c *stockCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ps, err := c.ledger.Products(ctx, false)
	var counts map[int64]domain.StockCount
	if err == nil {
		counts, err = c.ledger.StockCounts(ctx)
	}
	if err != nil {
		ch <- prometheus.MustNewConstMetric(stockUpDesc, prometheus.GaugeValue, 0)
		return
	}
	ch <- prometheus.MustNewConstMetric(stockUpDesc, prometheus.GaugeValue, 1)
	for _, p := range ps {
		id := strconv.FormatInt(p.ID, 10)
		low := 0.0
		if p.LowStockAlerted {
			low = 1
		}
		ch <- prometheus.MustNewConstMetric(sellableDesc, prometheus.GaugeValue, float64(counts[p.ID].Lockable), id)
		ch <- prometheus.MustNewConstMetric(withdrawnDesc, prometheus.GaugeValue, float64(counts[p.ID].Withdrawn), id)
		ch <- prometheus.MustNewConstMetric(lowStockDesc, prometheus.GaugeValue, low, id)
	}
}

// queueCollector reads the delay queues' backlog at scrape time, so the
// figures are never stale.
type queueCollector struct {
	stats func(context.Context) ([]queueStat, error)
}

var (
	backlogDesc = prometheus.NewDesc("kami_queue_backlog", "Tasks waiting in a delay queue.", []string{"queue"}, nil)
	leasedDesc  = prometheus.NewDesc("kami_queue_leased", "Tasks claimed by a worker and not yet acknowledged.", []string{"queue"}, nil)
	overdueDesc = prometheus.NewDesc("kami_queue_oldest_overdue_seconds", "How long the most overdue task is past its due time (0: none).", []string{"queue"}, nil)
	queueUpDesc = prometheus.NewDesc("kami_queue_up", "1 when the queue figures could be read from Redis.", nil, nil)
)

func (c *queueCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- backlogDesc
	ch <- leasedDesc
	ch <- overdueDesc
	ch <- queueUpDesc
}

func (c *queueCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	stats, err := c.stats(ctx)
	if err != nil {
		ch <- prometheus.MustNewConstMetric(queueUpDesc, prometheus.GaugeValue, 0)
		return
	}
	ch <- prometheus.MustNewConstMetric(queueUpDesc, prometheus.GaugeValue, 1)
	for _, s := range stats {
		ch <- prometheus.MustNewConstMetric(backlogDesc, prometheus.GaugeValue, float64(s.Backlog), s.Name)
		ch <- prometheus.MustNewConstMetric(leasedDesc, prometheus.GaugeValue, float64(s.Leased), s.Name)
		ch <- prometheus.MustNewConstMetric(overdueDesc, prometheus.GaugeValue, s.OldestOverdue.Seconds(), s.Name)
	}
}

// WebhookAttempt counts one outgoing webhook attempt.
func (m *metrics) WebhookAttempt(o domain.DeliveryOutcome, took time.Duration) {
	m.deliveries.WithLabelValues(string(o)).Inc()
	if o != domain.OutcomeCancelled {
		m.deliveryTime.Observe(took.Seconds())
	}
}

// watchWebhooks reports the outbox's backlog at each scrape.
func (m *metrics) watchWebhooks(h *domain.Webhooks) { m.reg.MustRegister(&webhookCollector{hooks: h}) }

// webhookCollector reads the outbox's backlog from the database at scrape
// time: what waits to be fanned out, what waits to be delivered, and the
// age of the oldest event not delivered yet. When the database cannot be
// read it sends nothing (kami_stock_up says so): an invalid metric would
// make promhttp answer the whole scrape with a 500, every other series of
// the process (Redis's queues, the counters) lost with it
// (TestMetricsServedWhileTheDatabaseCannotBeRead).
type webhookCollector struct{ hooks *domain.Webhooks }

var (
	webhookBacklogDesc = prometheus.NewDesc("kami_webhook_backlog",
		"Outgoing webhook work waiting, by kind (events: not fanned out yet; deliveries: PENDING).", []string{"kind"}, nil)
	webhookOldestDesc = prometheus.NewDesc("kami_webhook_oldest_undelivered_seconds",
		"Age of the oldest event not yet delivered to every endpoint that wants it; 0 when none waits.", nil, nil)
)

func (c *webhookCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- webhookBacklogDesc
	ch <- webhookOldestDesc
}

func (c *webhookCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	b, err := c.hooks.Backlog(ctx)
	if err != nil {
		return // nothing, not an invalid metric: see webhookCollector
	}
	ch <- prometheus.MustNewConstMetric(webhookBacklogDesc, prometheus.GaugeValue, float64(b.Events), "events")
	ch <- prometheus.MustNewConstMetric(webhookBacklogDesc, prometheus.GaugeValue, float64(b.Pending), "deliveries")
	age := 0.0
	if !b.OldestSince.IsZero() {
		age = max(c.hooks.Ledger.DBTime().Sub(b.OldestSince).Seconds(), 0)
	}
	ch <- prometheus.MustNewConstMetric(webhookOldestDesc, prometheus.GaugeValue, age)
}
