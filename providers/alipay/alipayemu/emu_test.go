package alipayemu

import (
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"kami/providers/providertest"
)

// These tests speak to the emulator by hand, without gopay, so that the
// emulator's strictness is proven on its own.

var testKeys = sync.OnceValue(func() [3]*rsa.PrivateKey {
	var ks [3]*rsa.PrivateKey
	for i := range ks {
		k, err := rsa.GenerateKey(rand.Reader, 2048)
		if err != nil {
			panic(err)
		}
		ks[i] = k
	}
	return ks
})

type fixture struct {
	emu    *Server
	srv    *httptest.Server
	app    *rsa.PrivateKey
	gwPub  *rsa.PublicKey
	appID  string
	client *http.Client
}

func setup(t *testing.T) *fixture {
	t.Helper()
	ks := testKeys()
	emu, err := New(Options{AppPublicKey: &ks[0].PublicKey, GatewayKey: ks[1], ForgeKey: ks[2], Hold: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(emu)
	t.Cleanup(srv.Close)
	block, _ := pem.Decode([]byte(emu.PublicKeyPEM()))
	pub, err := x509.ParsePKIXPublicKey(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	return &fixture{emu: emu, srv: srv, app: ks[0], gwPub: pub.(*rsa.PublicKey), appID: emu.AppID(), client: srv.Client()}
}

// params builds a request the way Alipay documents it.
func (f *fixture) params(method string, biz map[string]string) url.Values {
	bz, _ := json.Marshal(biz)
	return url.Values{
		"app_id": {f.appID}, "method": {method}, "format": {"JSON"}, "charset": {"utf-8"},
		"sign_type": {"RSA2"}, "timestamp": {time.Now().In(beijing).Format(alipayTime)},
		"version": {"1.0"}, "biz_content": {string(bz)},
	}
}

func (f *fixture) sign(v url.Values, key *rsa.PrivateKey) url.Values {
	m := map[string]string{}
	for k := range v {
		m[k] = v.Get(k)
	}
	v.Set("sign", rsa2Sign(key, signContent(m, "sign")))
	return v
}

// post sends v and returns the xxx_response object, checking the answer's
// signature with the gateway's public key.
func (f *fixture) post(t *testing.T, v url.Values) map[string]string {
	t.Helper()
	res, err := f.client.Post(f.srv.URL+"/gateway.do?charset=utf-8", "application/x-www-form-urlencoded;charset=utf-8", strings.NewReader(v.Encode()))
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	body, _ := io.ReadAll(res.Body)
	if res.StatusCode != 200 {
		t.Fatalf("status %d: %s", res.StatusCode, body)
	}
	s := string(body)
	i, j := strings.Index(s, `_response":`), strings.LastIndex(s, `,"sign":"`)
	if i < 0 || j < i {
		t.Fatalf("answer not in Alipay's form: %s", s)
	}
	inner := s[i+len(`_response":`) : j]
	var env struct {
		Sign string `json:"sign"`
	}
	if err := json.Unmarshal(body, &env); err != nil {
		t.Fatal(err)
	}
	if err := rsa2Verify(f.gwPub, inner, env.Sign); err != nil {
		t.Fatalf("answer signature: %v", err)
	}
	var out map[string]string
	if err := json.Unmarshal([]byte(inner), &out); err != nil {
		t.Fatal(err)
	}
	return out
}

func TestRefusesUnauthenticatedRequests(t *testing.T) {
	t.Parallel()
	f := setup(t)
	biz := map[string]string{"out_trade_no": "O1"}
	good := func() url.Values { return f.params("alipay.trade.query", biz) }
	cases := map[string]struct {
		v   url.Values
		sub string
	}{
		"Unsigned":      {good(), "isv.missing-signature"},
		"OtherKey":      {f.sign(good(), testKeys()[2]), "isv.invalid-signature"},
		"GatewayKey":    {f.sign(good(), testKeys()[1]), "isv.invalid-signature"},
		"OtherApp":      {func() url.Values { v := good(); v.Set("app_id", OtherAppID); return f.sign(v, f.app) }(), "isv.invalid-app-id"},
		"RSA1":          {func() url.Values { v := good(); v.Set("sign_type", "RSA"); return f.sign(v, f.app) }(), "isv.invalid-signature-type"},
		"Tampered":      {func() url.Values { v := f.sign(good(), f.app); v.Set("biz_content", `{"out_trade_no":"O2"}`); return v }(), "isv.invalid-signature"},
		"VersionEdited": {func() url.Values { v := f.sign(good(), f.app); v.Set("version", "2.0"); return v }(), "isv.invalid-signature"},
		"Repeated":      {func() url.Values { v := f.sign(good(), f.app); v.Add("app_id", f.appID); return v }(), "isv.invalid-parameter"},
		"NoMethod":      {func() url.Values { v := good(); v.Del("method"); return f.sign(v, f.app) }(), "isv.missing-method"},
		"NoTimestamp":   {func() url.Values { v := good(); v.Set("timestamp", "yesterday"); return f.sign(v, f.app) }(), "isv.invalid-timestamp"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			got := f.post(t, tc.v)
			if got["sub_code"] != tc.sub || got["code"] == "10000" {
				t.Errorf("answer %v, want sub_code %s", got, tc.sub)
			}
		})
	}
	if n := f.emu.Calls("alipay.trade.query"); n != 0 {
		t.Errorf("%d refused requests were counted as calls", n)
	}
	got := f.post(t, f.sign(good(), f.app))
	if got["sub_code"] != "ACQ.TRADE_NOT_EXIST" || got["code"] != "40004" {
		t.Errorf("a good request answered %v, want 40004 ACQ.TRADE_NOT_EXIST", got)
	}
}

func TestRefundIdempotence(t *testing.T) {
	t.Parallel()
	f := setup(t)
	if _, _, err := f.emu.Pay("O1", 1000); err != nil {
		t.Fatal(err)
	}
	refund := func(no, amount string) map[string]string {
		return f.post(t, f.sign(f.params("alipay.trade.refund", map[string]string{
			"out_trade_no": "O1", "out_request_no": no, "refund_amount": amount}), f.app))
	}
	first := refund("R1", "6.00")
	if first["code"] != "10000" || first["fund_change"] != "Y" || first["refund_fee"] != "6.00" {
		t.Fatalf("first refund: %v", first)
	}
	again := refund("R1", "6.00")
	if again["code"] != "10000" || again["fund_change"] != "N" || again["refund_fee"] != "6.00" || again["trade_no"] != first["trade_no"] {
		t.Fatalf("repeated refund: %v", again)
	}
	if over := refund("R2", "4.01"); over["sub_code"] != "ACQ.REFUND_AMT_NOT_EQUAL_TOTAL" {
		t.Fatalf("refund above what is left: %v", over)
	}
	if bad := refund("R3", "1.001"); bad["sub_code"] != "ACQ.INVALID_PARAMETER" {
		t.Fatalf("refund of 1.001: %v", bad)
	}
	if rest := refund("R4", "4.00"); rest["fund_change"] != "Y" || rest["refund_fee"] != "10.00" {
		t.Fatalf("refund of the rest: %v", rest)
	}
	if v, _ := f.emu.Trade("O1"); v.Status != statusClosed || v.RefundedFen != 1000 {
		t.Errorf("fully refunded trade: %+v", v)
	}
	for no, want := range map[string][2]int64{"R1": {600, 2}, "R2": {0, 1}, "R4": {400, 1}, "R9": {0, 0}} {
		if fen, calls := f.emu.Refunded(no); fen != want[0] || int64(calls) != want[1] {
			t.Errorf("Refunded(%s) = %d, %d; want %d, %d", no, fen, calls, want[0], want[1])
		}
	}
	q := f.post(t, f.sign(f.params("alipay.trade.fastpay.refund.query", map[string]string{"out_trade_no": "O1", "out_request_no": "R1"}), f.app))
	if q["refund_status"] != "REFUND_SUCCESS" || q["refund_amount"] != "6.00" {
		t.Errorf("refund query: %v", q)
	}
	q = f.post(t, f.sign(f.params("alipay.trade.fastpay.refund.query", map[string]string{"out_trade_no": "O1", "out_request_no": "R2"}), f.app))
	if q["code"] != "10000" || q["refund_status"] != "" || q["refund_amount"] != "" {
		t.Errorf("query of a refund never made: %v", q)
	}
}

func TestInjectFaultCounts(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.emu.InjectFault(providertest.OpQueryPayment, providertest.Fault5xx, 2)
	status := func() int {
		v := f.sign(f.params("alipay.trade.query", map[string]string{"out_trade_no": "O1"}), f.app)
		res, err := f.client.Post(f.srv.URL, "application/x-www-form-urlencoded", strings.NewReader(v.Encode()))
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
		return res.StatusCode
	}
	for i, want := range []int{503, 503, 200} {
		if got := status(); got != want {
			t.Errorf("call %d: status %d, want %d", i+1, got, want)
		}
	}
	f.emu.InjectFault(providertest.OpQueryPayment, providertest.Fault5xx, 0)
	for range 3 {
		if got := status(); got != 503 {
			t.Errorf("n=0: status %d, want 503 until cleared", got)
		}
	}
	f.emu.InjectFault(providertest.OpQueryPayment, providertest.FaultNone, 0)
	if got := status(); got != 200 {
		t.Errorf("cleared: status %d", got)
	}
}

func TestNotificationsSigned(t *testing.T) {
	t.Parallel()
	f := setup(t)
	verify := func(body []byte) (url.Values, error) {
		form, err := url.ParseQuery(string(body))
		if err != nil {
			return nil, err
		}
		m := map[string]string{}
		for k := range form {
			m[k] = form.Get(k)
		}
		return form, rsa2Verify(f.gwPub, signContent(m, "sign", "sign_type"), form.Get("sign"))
	}
	_, pay, _ := f.emu.Pay("O1", 1)
	form, err := verify(pay)
	if err != nil || form.Get("total_amount") != "0.01" || form.Get("trade_status") != statusSuccess || form.Get("app_id") != f.appID {
		t.Errorf("payment notification %v: %v", form, err)
	}
	_, again, _ := f.emu.Pay("O1", 1)
	if string(again) != string(pay) {
		t.Errorf("paying again did not resend the same notification")
	}
	_, forged := f.emu.Forge("O2", 1)
	if _, err := verify(forged); err == nil {
		t.Errorf("forged notification verifies with the gateway key")
	}
	_, other := f.emu.OtherApp("O3", 1)
	if form, err := verify(other); err != nil || form.Get("app_id") != OtherAppID {
		t.Errorf("other-app notification %v: %v", form, err)
	}
	if _, _, err := f.emu.RefundNotification("nope"); err == nil {
		t.Errorf("notification for an unknown refund")
	}
}
