package main

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"kami/domain"
	"kami/domain/dbtest"
)

// TestMetricsServedWhileTheDatabaseCannotBeRead: the collectors that read
// the database at scrape time (the stock, the webhook outbox's backlog,
// the mails waiting) must not take the rest of /metrics down with them
// when the database cannot be read. promhttp answers a scrape with any
// invalid metric as a 500: every series of the process (Redis's queues,
// the counters) went stale for as long as the database was away.
// kami_stock_up says the database could not be read.
func TestMetricsServedWhileTheDatabaseCannotBeRead(t *testing.T) {
	t.Parallel()
	db := dbtest.Open(t, dbtest.SQLite)
	l := domain.NewLedger(db, nil, domain.Config{}, nil)
	m := newMetrics(func(context.Context) ([]queueStat, error) { return nil, nil })
	m.watchStock(l)
	m.watchWebhooks(&domain.Webhooks{Ledger: l})
	m.reg.MustRegister(&mailWaitingCollector{ledger: l})
	db.Close()

	srv := httptest.NewServer(promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{}))
	defer srv.Close()
	res, err := http.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	if res.StatusCode != http.StatusOK || !strings.Contains(string(b), "kami_stock_up 0") || !strings.Contains(string(b), "kami_orders_placed_total") {
		t.Fatalf("/metrics with the database unreadable: %s\n%s", res.Status, b)
	}
	for _, gone := range []string{"kami_mail_waiting{", "kami_webhook_backlog{"} {
		if strings.Contains(string(b), gone) {
			t.Errorf("/metrics shows %s with the database unreadable", gone)
		}
	}
}
