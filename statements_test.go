package main

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"kami/domain"
	"kami/providers"
)

// adminGraphQL posts a GraphQL request to the server with the admin token
// and decodes its data, failing on errors.
func (ta *testApp) adminGraphQL(t *testing.T, query string, vars map[string]any, out any) {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"query": query, "variables": vars})
	req, _ := http.NewRequest(http.MethodPost, ta.srv.URL+"/graphql", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+testAdminToken)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	var r struct {
		Data   json.RawMessage
		Errors []json.RawMessage
	}
	if err := json.NewDecoder(res.Body).Decode(&r); err != nil || len(r.Errors) > 0 {
		t.Fatalf("graphql: %v %s", err, r.Errors)
	}
	if err := json.Unmarshal(r.Data, out); err != nil {
		t.Fatal(err)
	}
}

func (ta *testApp) metricsText(t *testing.T) string {
	t.Helper()
	res, err := http.Get(ta.srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return string(b)
}

// TestStatementsThroughTheServer: a whole kami, its admin API and its
// metrics: the Alipay statement of today, reconciled on an admin's
// request, delivers a payment whose notification was lost; syncOrder
// delivers another; both are counted.
func TestStatementsThroughTheServer(t *testing.T) {
	t.Parallel()
	eachStack(t, func(t *testing.T, s stack) {
		a := newAlipayApp(t, s, env{"KAMI_ORDER_TTL": "1h"})
		p := a.product(t, 1250, "ST-1", "ST-2")
		viaStatement, viaSync := a.order(t, p), a.order(t, p)
		for _, o := range []*domain.Order{viaStatement, viaSync} {
			if _, _, err := a.emu.Pay(o.OrderNo, o.AmountFen); err != nil { // the notifications are lost
				t.Fatal(err)
			}
		}
		var sync struct {
			SyncOrder struct{ Trade struct{ Action string } }
		}
		a.adminGraphQL(t, `mutation($no: String!) { syncOrder(orderNo: $no) { trade { action } } }`, map[string]any{"no": viaSync.OrderNo}, &sync)
		if sync.SyncOrder.Trade.Action != "DELIVERED" || a.status(t, viaSync.OrderNo) != domain.OrderPaid {
			t.Fatalf("sync: %+v, order %s", sync, a.status(t, viaSync.OrderNo))
		}

		var runs struct {
			ReconcileStatements []struct {
				Status                   string
				DifferenceCount, Settled int
				Trades, Matched          int
			}
		}
		a.adminGraphQL(t, `mutation($d: String) { reconcileStatements(provider: "alipay", date: $d) { status differenceCount settled trades matched } }`,
			map[string]any{"d": providers.DayOf(a.ledger.Now()).String()}, &runs)
		if len(runs.ReconcileStatements) != 1 {
			t.Fatalf("runs %+v", runs)
		}
		if r := runs.ReconcileStatements[0]; r.Status != "DONE" || r.Trades != 2 || r.Matched != 1 || r.DifferenceCount != 1 || r.Settled != 1 {
			t.Fatalf("run %+v", r)
		}
		if st := a.status(t, viaStatement.OrderNo); st != domain.OrderPaid {
			t.Fatalf("the order paid by the statement is %s", st)
		}
		m := a.metricsText(t)
		for _, want := range []string{
			`kami_statement_runs_total{provider="alipay",source="STATEMENT",status="DONE"} 1`,
			`kami_statement_differences_total{action="DELIVERED",kind="PAID_PENDING",provider="alipay"} 1`,
			`kami_statement_last_done_unix{provider="alipay"}`,
			`kami_graphql_requests_total{code="",operation="anonymous"} 2`,
		} {
			if !strings.Contains(m, want) {
				t.Errorf("/metrics lacks %s", want)
			}
		}
		a.audit(t)
	})
}
