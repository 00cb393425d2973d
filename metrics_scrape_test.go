package main

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
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

// blockingCollector holds every scrape in Collect until release is closed,
// saying on entered that one came in.
type blockingCollector struct {
	entered chan struct{}
	release chan struct{}
}

var blockingDesc = prometheus.NewDesc("kami_test_blocking", "A scrape held by the test.", nil, nil)

func (c *blockingCollector) Describe(ch chan<- *prometheus.Desc) { ch <- blockingDesc }

func (c *blockingCollector) Collect(ch chan<- prometheus.Metric) {
	c.entered <- struct{}{}
	<-c.release
	ch <- prometheus.MustNewConstMetric(blockingDesc, prometheus.GaugeValue, 1)
}

// TestMetricsScrapesAtOnceAreBounded: each scrape reads the database, and
// /metrics is open to anyone without KAMI_METRICS_TOKEN; while
// metricsScrapesAtOnce scrapes are being answered, another is answered 503
// at once instead of reading the database beside them.
func TestMetricsScrapesAtOnceAreBounded(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	c := &blockingCollector{entered: make(chan struct{}, 16), release: make(chan struct{})}
	reg.MustRegister(c)
	srv := httptest.NewServer(metricsHandler(reg, ""))
	defer srv.Close()
	var released bool
	release := func() {
		if !released {
			released = true
			close(c.release)
		}
	}
	defer release()
	get := func() <-chan int {
		out := make(chan int, 1)
		go func() {
			res, err := http.Get(srv.URL)
			if err != nil {
				out <- 0
				return
			}
			io.Copy(io.Discard, res.Body)
			res.Body.Close()
			out <- res.StatusCode
		}()
		return out
	}
	held := make([]<-chan int, metricsScrapesAtOnce)
	for i := range held {
		held[i] = get()
		<-c.entered
	}
	select {
	case code := <-get():
		if code != http.StatusServiceUnavailable {
			t.Errorf("a scrape beside %d held ones: %d, want 503", metricsScrapesAtOnce, code)
		}
	case <-c.entered:
		t.Errorf("a scrape beside %d held ones read the metrics too", metricsScrapesAtOnce)
	}
	release()
	for _, h := range held {
		if code := <-h; code != http.StatusOK {
			t.Errorf("a held scrape: %d, want 200", code)
		}
	}
}
