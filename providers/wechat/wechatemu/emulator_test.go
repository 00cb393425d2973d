package wechatemu_test

import (
	"bytes"
	"crypto"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"
	"time"

	"kami/providers/providertest"
	"kami/providers/wechat/wechatemu"
)

const serial = "MERCHANTSERIAL0001"

var merchantKey = sync.OnceValues(wechatemu.GenerateKey)

type bundle struct {
	emu *wechatemu.Server
	srv *httptest.Server
	key *rsa.PrivateKey
}

func setup(t *testing.T) *bundle {
	t.Helper()
	k, err := merchantKey()
	if err != nil {
		t.Fatal(err)
	}
	emu, err := wechatemu.New(wechatemu.Options{MerchantSerialNo: serial, MerchantPublicKey: &k.PublicKey})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(emu)
	t.Cleanup(srv.Close)
	return &bundle{emu: emu, srv: srv, key: k}
}

// signed is a request as a merchant signs it; fields can be spoiled before
// it is sent.
type signed struct {
	method, uri, body, ts, nonce string
	key                          *rsa.PrivateKey
	bodySent                     string // when set, sent instead of body
}

func (b *bundle) req(method, uri, body string) *signed {
	return &signed{method: method, uri: uri, body: body, ts: strconv.FormatInt(time.Now().Unix(), 10), nonce: randomHex(), key: b.key}
}

func (b *bundle) do(t *testing.T, s *signed) (int, http.Header, []byte) {
	t.Helper()
	sum := sha256.Sum256([]byte(s.method + "\n" + s.uri + "\n" + s.ts + "\n" + s.nonce + "\n" + s.body + "\n"))
	sig, err := rsa.SignPKCS1v15(rand.Reader, s.key, crypto.SHA256, sum[:])
	if err != nil {
		t.Fatal(err)
	}
	sent := s.body
	if s.bodySent != "" {
		sent = s.bodySent
	}
	r, _ := http.NewRequestWithContext(t.Context(), s.method, b.srv.URL+s.uri, bytes.NewBufferString(sent))
	r.Header.Set("Authorization", fmt.Sprintf(`WECHATPAY2-SHA256-RSA2048 mchid="%s",nonce_str="%s",timestamp="%s",serial_no="%s",signature="%s"`,
		b.emu.MchID(), s.nonce, s.ts, serial, base64.StdEncoding.EncodeToString(sig)))
	r.Header.Set("Content-Type", "application/json")
	res, err := http.DefaultClient.Do(r)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	out, _ := io.ReadAll(res.Body)
	return res.StatusCode, res.Header, out
}

func platformKey(t *testing.T, emu *wechatemu.Server) *rsa.PublicKey {
	t.Helper()
	block, _ := pem.Decode([]byte(emu.PlatformPublicKeyPEM()))
	if block == nil {
		t.Fatal("platform key is not PEM")
	}
	k, err := x509.ParsePKIXPublicKey(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	return k.(*rsa.PublicKey)
}

func randomHex() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func (b *bundle) verifyAnswer(t *testing.T, h http.Header, body []byte) {
	t.Helper()
	if h.Get("Wechatpay-Serial") != b.emu.PlatformPublicKeyID() {
		t.Fatalf("answer serial %q, want %q", h.Get("Wechatpay-Serial"), b.emu.PlatformPublicKeyID())
	}
	pub := platformKey(t, b.emu)
	sig, err := base64.StdEncoding.DecodeString(h.Get("Wechatpay-Signature"))
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256([]byte(h.Get("Wechatpay-Timestamp") + "\n" + h.Get("Wechatpay-Nonce") + "\n" + string(body) + "\n"))
	if err := rsa.VerifyPKCS1v15(pub, crypto.SHA256, sum[:], sig); err != nil {
		t.Fatalf("answer signature: %v", err)
	}
}

func TestRequestsMustBeSigned(t *testing.T) {
	t.Parallel()
	b := setup(t)
	stranger, err := wechatemu.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	uri := "/v3/pay/transactions/out-trade-no/ORDER0001?mchid=" + b.emu.MchID()

	good := b.req("GET", uri, "")
	if code, h, body := b.do(t, good); code != http.StatusNotFound || !bytes.Contains(body, []byte("ORDER_NOT_EXIST")) {
		t.Fatalf("good request: %d %s, want 404 ORDER_NOT_EXIST", code, body)
	} else {
		b.verifyAnswer(t, h, body)
	}

	spoil := map[string]func(*signed){
		"replayed nonce":  func(s *signed) { s.nonce = good.nonce },
		"stale timestamp": func(s *signed) { s.ts = strconv.FormatInt(time.Now().Add(-6*time.Minute).Unix(), 10) },
		"another key":     func(s *signed) { s.key = stranger },
	}
	for name, f := range spoil {
		s := b.req("GET", uri, "")
		f(s)
		if code, _, body := b.do(t, s); code != http.StatusUnauthorized || !bytes.Contains(body, []byte("SIGN_ERROR")) {
			t.Errorf("%s: %d %s, want 401 SIGN_ERROR", name, code, body)
		}
	}
	other := b.req("GET", "/v3/pay/transactions/out-trade-no/ORDER0002?mchid="+b.emu.MchID(), "")
	if code, _, body := b.doTo(t, other, uri); code != http.StatusUnauthorized {
		t.Errorf("signed for another URL: %d %s, want 401", code, body)
	}

	body := `{"mchid":"` + b.emu.MchID() + `"}`
	s := b.req("POST", "/v3/pay/transactions/out-trade-no/ORDER0001/close", body)
	s.bodySent = `{"mchid":"1900009999"}`
	if code, _, out := b.do(t, s); code != http.StatusUnauthorized {
		t.Errorf("body changed after signing: %d %s, want 401", code, out)
	}
}

// doTo signs s but sends it to uri.
func (b *bundle) doTo(t *testing.T, s *signed, uri string) (int, http.Header, []byte) {
	t.Helper()
	sum := sha256.Sum256([]byte(s.method + "\n" + s.uri + "\n" + s.ts + "\n" + s.nonce + "\n" + s.body + "\n"))
	sig, err := rsa.SignPKCS1v15(rand.Reader, s.key, crypto.SHA256, sum[:])
	if err != nil {
		t.Fatal(err)
	}
	r, _ := http.NewRequestWithContext(t.Context(), s.method, b.srv.URL+uri, nil)
	r.Header.Set("Authorization", fmt.Sprintf(`WECHATPAY2-SHA256-RSA2048 mchid="%s",nonce_str="%s",timestamp="%s",serial_no="%s",signature="%s"`,
		b.emu.MchID(), s.nonce, s.ts, serial, base64.StdEncoding.EncodeToString(sig)))
	res, err := http.DefaultClient.Do(r)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	out, _ := io.ReadAll(res.Body)
	return res.StatusCode, res.Header, out
}

func TestRefundsAreIdempotentAndBounded(t *testing.T) {
	t.Parallel()
	b := setup(t)
	if _, _, err := b.emu.Pay("ORDER0001", 1000); err != nil {
		t.Fatal(err)
	}
	refund := func(no string, fen int64) (int, map[string]any) {
		body := fmt.Sprintf(`{"out_trade_no":"ORDER0001","out_refund_no":%q,"amount":{"refund":%d,"total":1000,"currency":"CNY"}}`, no, fen)
		code, h, out := b.do(t, b.req("POST", "/v3/refund/domestic/refunds", body))
		b.verifyAnswer(t, h, out)
		var m map[string]any
		_ = json.Unmarshal(out, &m)
		return code, m
	}
	code, first := refund("RF1", 700)
	if code != http.StatusOK || first["status"] != "SUCCESS" {
		t.Fatalf("first refund: %d %v", code, first)
	}
	code, again := refund("RF1", 700)
	if code != http.StatusOK || again["refund_id"] != first["refund_id"] {
		t.Fatalf("same refund again: %d %v, want the first answer %v", code, again, first)
	}
	if code, m := refund("RF2", 301); code != http.StatusBadRequest || m["code"] != "INVALID_REQUEST" {
		t.Errorf("refund above what is left: %d %v", code, m)
	}
	if fen, calls := b.emu.Refunded("RF1"); fen != 700 || calls != 2 {
		t.Errorf("Refunded(RF1) = %d, %d; want 700, 2", fen, calls)
	}
	if fen, _ := b.emu.Refunded("RF2"); fen != 0 {
		t.Errorf("Refunded(RF2) = %d, want 0", fen)
	}
}

func TestFaults(t *testing.T) {
	t.Parallel()
	b := setup(t)
	uri := "/v3/pay/transactions/out-trade-no/ORDER0001?mchid=" + b.emu.MchID()
	b.emu.InjectFault(providertest.OpQueryPayment, providertest.Fault5xx, 2)
	if code, _, _ := b.do(t, b.req("GET", uri, "")); code != http.StatusInternalServerError {
		t.Errorf("first 5xx: %d", code)
	}
	if code, _, _ := b.do(t, b.req("GET", uri, "")); code != http.StatusServiceUnavailable {
		t.Errorf("second 5xx: %d", code)
	}
	if code, _, _ := b.do(t, b.req("GET", uri, "")); code != http.StatusNotFound {
		t.Errorf("after the faults: %d, want 404", code)
	}
	b.emu.InjectFault(providertest.OpQueryPayment, providertest.FaultBusiness, 0)
	for range 2 {
		if code, h, body := b.do(t, b.req("GET", uri, "")); code != http.StatusBadRequest {
			t.Errorf("business: %d %s", code, body)
		} else {
			b.verifyAnswer(t, h, body)
		}
	}
	b.emu.InjectFault(providertest.OpQueryPayment, providertest.FaultNone, 0)
	if code, _, _ := b.do(t, b.req("GET", uri, "")); code != http.StatusNotFound {
		t.Errorf("cleared: %d, want 404", code)
	}
}
