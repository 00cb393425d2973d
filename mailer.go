package main

import (
	"context"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"kami/domain"
	"kami/mail"
	"kami/queue"
)

// newMailWorker wires the order mails (KAMI_SMTP_URL): the sender, the
// Mailer that makes each attempt, and the worker on the mail queue; the
// shop schedules each paid order's mail on it. Its metrics join reg.
func newMailWorker(cfg *Config, rdb redis.UniversalClient, keys queue.Keys, shop *domain.Shop, reg prometheus.Registerer, logger *slog.Logger) (*queue.MailWorker, error) {
	s, err := mail.New(*cfg.Mail)
	if err != nil {
		return nil, err
	}
	m := &domain.Mailer{Ledger: shop.Ledger, Sender: s, Log: logger, Observer: newMailMetrics(reg)}
	reg.MustRegister(&mailWaitingCollector{ledger: shop.Ledger})
	shop.MailQueue = queue.NewMailScheduler(rdb, keys)
	return queue.NewMailWorker(cfg.Workers, rdb, keys, m, logger), nil
}

// mailMetrics counts mail attempts by outcome and mails given up.
type mailMetrics struct {
	attempts *prometheus.CounterVec
	failed   prometheus.Counter
}

var _ domain.MailObserver = (*mailMetrics)(nil)

func newMailMetrics(reg prometheus.Registerer) *mailMetrics {
	m := &mailMetrics{
		attempts: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kami_mail_attempts_total",
			Help: "Order mail attempts by outcome (sent, not_sent, server_refused: not sent, the SMTP server refused kami before any message, unreachable: not sent, no connection, TLS or a reply other than a 5xx before any message, refused, uncertain: the server took the message and its reply was lost)."}, []string{"outcome"}),
		failed: prometheus.NewCounter(prometheus.CounterOpts{Name: "kami_mail_failed_total",
			Help: "Order mails given up (FAILED): refused, out of attempts at the message, or unconfirmed twice."}),
	}
	reg.MustRegister(m.attempts, m.failed)
	return m
}

func (m *mailMetrics) MailAttempted(outcome string) { m.attempts.WithLabelValues(outcome).Inc() }
func (m *mailMetrics) MailFailed()                  { m.failed.Inc() }

var mailWaitingDesc = prometheus.NewDesc("kami_mail_waiting",
	"Order mails not sent yet (QUEUED, or SENDING an attempt) by how their last attempt ended (last_outcome: an outcome of kami_mail_attempts_total, none before any); unreachable and server_refused ones wait on the SMTP server, at backoff steps that may be hours apart.",
	[]string{"last_outcome"}, nil)

// mailWaitingCollector reads the mails waiting from the database at
// scrape time. Unlike a count of attempts in a window, the figure holds
// for as long as the mails wait, however far apart their attempts are.
type mailWaitingCollector struct{ ledger *domain.Ledger }

func (c *mailWaitingCollector) Describe(ch chan<- *prometheus.Desc) { ch <- mailWaitingDesc }

func (c *mailWaitingCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	n, err := c.ledger.WaitingMails(ctx)
	if err != nil {
		return // nothing, not an invalid metric: see webhookCollector
	}
	ch <- prometheus.MustNewConstMetric(mailWaitingDesc, prometheus.GaugeValue, float64(n[""]), "none")
	for _, o := range domain.MailOutcomes {
		ch <- prometheus.MustNewConstMetric(mailWaitingDesc, prometheus.GaugeValue, float64(n[o]), string(o))
	}
}
