package alipay_test

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"kami/providers"
	"kami/providers/alipay"
)

func TestNewRefusesBadSettings(t *testing.T) {
	t.Parallel()
	b := setup(t)
	otherKey, err := rsa.GenerateKey(rand.Reader, 1024)
	if err != nil {
		t.Fatal(err)
	}
	shortPEM := string(pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(otherKey)}))
	ownPubDER, _ := x509.MarshalPKIXPublicKey(&appKey().PublicKey)
	ownPub := string(pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: ownPubDER}))
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "alipay"},
		NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour)}
	certDER, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &appKey().PublicKey, appKey())
	if err != nil {
		t.Fatal(err)
	}
	cert := string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: certDER}))

	cases := map[string]struct {
		edit func(*alipay.Config)
		want string
	}{
		"NoAppID":         {func(c *alipay.Config) { c.AppID = "" }, "KAMI_ALIPAY_APP_ID"},
		"AppIDWithSpace":  {func(c *alipay.Config) { c.AppID = "2021 0001" }, "KAMI_ALIPAY_APP_ID"},
		"NoPrivateKey":    {func(c *alipay.Config) { c.PrivateKey = "" }, "KAMI_ALIPAY_PRIVATE_KEY"},
		"MissingKeyFile":  {func(c *alipay.Config) { c.PrivateKey = "/nonexistent/app_private.pem" }, "KAMI_ALIPAY_PRIVATE_KEY"},
		"GarbledPEM":      {func(c *alipay.Config) { c.PrivateKey = strings.Replace(c.PrivateKey, "M", "!", 3) }, "KAMI_ALIPAY_PRIVATE_KEY"},
		"ShortKey":        {func(c *alipay.Config) { c.PrivateKey = shortPEM }, "KAMI_ALIPAY_PRIVATE_KEY"},
		"PublicAsPrivate": {func(c *alipay.Config) { c.PrivateKey = c.AlipayPublicKey }, "KAMI_ALIPAY_PRIVATE_KEY"},
		"NoPublicKey":     {func(c *alipay.Config) { c.AlipayPublicKey = "" }, "KAMI_ALIPAY_PUBLIC_KEY"},
		"PrivateAsPublic": {func(c *alipay.Config) { c.AlipayPublicKey = c.PrivateKey }, "KAMI_ALIPAY_PUBLIC_KEY"},
		"OwnPublicKey":    {func(c *alipay.Config) { c.AlipayPublicKey = ownPub }, "KAMI_ALIPAY_PUBLIC_KEY"},
		"Certificate":     {func(c *alipay.Config) { c.AlipayPublicKey = cert }, "KAMI_ALIPAY_PUBLIC_KEY"},
		"GatewayScheme":   {func(c *alipay.Config) { c.Gateway = "ftp://openapi.example.com/gateway.do" }, "KAMI_ALIPAY_GATEWAY"},
		"GatewayNoHost":   {func(c *alipay.Config) { c.Gateway = "https:///gateway.do" }, "KAMI_ALIPAY_GATEWAY"},
		"GatewayRelative": {func(c *alipay.Config) { c.Gateway = "gateway.do" }, "KAMI_ALIPAY_GATEWAY"},
		"SellerNotAPID":   {func(c *alipay.Config) { c.SellerID = "shop@example.com" }, "KAMI_ALIPAY_SELLER_ID"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			cfg := b.cfg
			tc.edit(&cfg)
			c, err := alipay.New(cfg)
			if err == nil {
				t.Fatalf("New accepted the config: %v", c)
			}
			if !strings.HasPrefix(err.Error(), tc.want+":") {
				t.Errorf("error %q does not start with %s", err, tc.want)
			}
			// No key material, ever: not a line of base64 from a PEM.
			for _, key := range []string{cfg.PrivateKey, cfg.AlipayPublicKey} {
				for _, line := range strings.Split(key, "\n") {
					if len(line) > 20 && !strings.HasPrefix(line, "-----") && strings.Contains(err.Error(), line) {
						t.Errorf("error %q quotes a key", err)
					}
				}
			}
		})
	}
}

// Keys are accepted as PEM text, a PEM file, or the console's bare base64
// (PKCS#8 for the app's key, as the Alipay key tool writes it). Each form is
// proven by a signed round trip through the emulator.
func TestNewKeyForms(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dir := t.TempDir()
	privFile := filepath.Join(dir, "app_private_key.pem")
	pubFile := filepath.Join(dir, "alipay_public_key.pem")
	if err := os.WriteFile(privFile, []byte(b.cfg.PrivateKey), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(pubFile, []byte(b.cfg.AlipayPublicKey), 0o600); err != nil {
		t.Fatal(err)
	}
	pkcs8, err := x509.MarshalPKCS8PrivateKey(appKey())
	if err != nil {
		t.Fatal(err)
	}
	block, _ := pem.Decode([]byte(b.cfg.AlipayPublicKey))
	bareFile := filepath.Join(dir, "bare.txt")
	if err := os.WriteFile(bareFile, []byte(base64.StdEncoding.EncodeToString(block.Bytes)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	forms := map[string]func(*alipay.Config){
		"Files": func(c *alipay.Config) { c.PrivateKey, c.AlipayPublicKey = privFile, pubFile },
		"Bare": func(c *alipay.Config) {
			c.PrivateKey, c.AlipayPublicKey = base64.StdEncoding.EncodeToString(pkcs8), bareFile
		},
		"PKCS8PEM": func(c *alipay.Config) {
			c.PrivateKey = string(pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: pkcs8}))
		},
		"GatewayHost": func(c *alipay.Config) { c.Gateway = strings.TrimSuffix(c.Gateway, "/") + "/" },
	}
	for name, edit := range forms {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			cfg := b.cfg
			edit(&cfg)
			c, err := alipay.New(cfg)
			if err != nil {
				t.Fatalf("New: %v", err)
			}
			st, err := c.QueryPayment(context.Background(), "O"+name)
			if err != nil || st.Status != providers.TradeNotFound {
				t.Fatalf("QueryPayment = %+v, %v; want NOT_FOUND (a signed, verified round trip)", st, err)
			}
		})
	}
}

// Without an override the pay URL is the production gateway's, built
// without any network call.
func TestProductionGatewayURL(t *testing.T) {
	t.Parallel()
	cfg := setup(t).cfg
	cfg.Gateway = ""
	c, err := alipay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	a, err := c.CreatePayment(context.Background(), providers.PaymentRequest{OrderNo: "O1", AmountFen: 100, Subject: "card"})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(a.URL, alipay.ProductionGateway+"?") {
		t.Errorf("URL %q, want the production gateway", a.URL)
	}
}
