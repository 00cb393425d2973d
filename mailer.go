package main

import (
	"log/slog"

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
