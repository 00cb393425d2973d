package wechat_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"kami/providers/wechat"
)

func TestNewNamesTheBadSetting(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	good := b.cfg

	cases := []struct {
		name   string
		change func(*wechat.Config)
		env    string
	}{
		{"no app id", func(c *wechat.Config) { c.AppID = "" }, "KAMI_WECHAT_APP_ID"},
		{"no mch id", func(c *wechat.Config) { c.MchID = "" }, "KAMI_WECHAT_MCH_ID"},
		{"quoted mch id", func(c *wechat.Config) { c.MchID = `19"00` }, "KAMI_WECHAT_MCH_ID"},
		{"no serial", func(c *wechat.Config) { c.SerialNo = "" }, "KAMI_WECHAT_SERIAL_NO"},
		{"no private key", func(c *wechat.Config) { c.PrivateKey = "" }, "KAMI_WECHAT_PRIVATE_KEY"},
		{"private key not PEM", func(c *wechat.Config) { c.PrivateKey = "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC-secret" }, "KAMI_WECHAT_PRIVATE_KEY"},
		{"public key given as private", func(c *wechat.Config) { c.PrivateKey = b.emu.PlatformPublicKeyPEM() }, "KAMI_WECHAT_PRIVATE_KEY"},
		{"short API v3 key", func(c *wechat.Config) { c.APIv3Key = "0123456789" }, "KAMI_WECHAT_API_V3_KEY"},
		{"no API v3 key", func(c *wechat.Config) { c.APIv3Key = "" }, "KAMI_WECHAT_API_V3_KEY"},
		{"no platform key", func(c *wechat.Config) { c.PlatformPublicKey = "" }, "KAMI_WECHAT_PLATFORM_PUBLIC_KEY"},
		{"private key given as platform key", func(c *wechat.Config) { c.PlatformPublicKey = b.keys.merchantPEM }, "KAMI_WECHAT_PLATFORM_PUBLIC_KEY"},
		{"no platform key id", func(c *wechat.Config) { c.PlatformPublicKeyID = "" }, "KAMI_WECHAT_PLATFORM_PUBLIC_KEY_ID"},
		{"certificate serial as key id", func(c *wechat.Config) { c.PlatformPublicKeyID = "5157F09EFDC096DE15EBE81A47057A72" }, "KAMI_WECHAT_PLATFORM_PUBLIC_KEY_ID"},
		{"api base not a URL", func(c *wechat.Config) { c.APIBase = "api.mch.weixin.qq.com" }, "KAMI_WECHAT_API_BASE"},
		{"api base with query", func(c *wechat.Config) { c.APIBase = "https://proxy.example/?x=1" }, "KAMI_WECHAT_API_BASE"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			cfg := good
			c.change(&cfg)
			_, err := wechat.New(cfg)
			if err == nil {
				t.Fatalf("New accepted a config with %s", c.name)
			}
			msg := err.Error()
			if !strings.Contains(msg, c.env) {
				t.Errorf("error %q does not name %s", msg, c.env)
			}
			// Only the exact setting: KAMI_WECHAT_PLATFORM_PUBLIC_KEY is a
			// prefix of ..._ID.
			if c.env == "KAMI_WECHAT_PLATFORM_PUBLIC_KEY" && strings.Contains(msg, "KAMI_WECHAT_PLATFORM_PUBLIC_KEY_ID") {
				t.Errorf("error %q names the key ID, not the key", msg)
			}
			for _, secret := range []string{"secret", cfg.APIv3Key, "MII"} {
				if secret != "" && strings.Contains(msg, secret) {
					t.Errorf("error %q repeats key material %q", msg, secret)
				}
			}
		})
	}
}

func TestNewReadsKeysFromFiles(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	dir := t.TempDir()
	priv := filepath.Join(dir, "apiclient_key.pem")
	pub := filepath.Join(dir, "pub_key.pem")
	if err := os.WriteFile(priv, []byte(b.keys.merchantPEM), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(pub, []byte(b.emu.PlatformPublicKeyPEM()), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := b.cfg
	cfg.PrivateKey, cfg.PlatformPublicKey = priv, pub
	c, err := wechat.New(cfg)
	if err != nil {
		t.Fatalf("New with key files: %v", err)
	}
	// The keys read from files must be the ones that work.
	if _, err := c.CreatePayment(t.Context(), payment(t, "FILEKEY0001", 100)); err != nil {
		t.Fatalf("CreatePayment with keys from files: %v", err)
	}

	cfg.PrivateKey = filepath.Join(dir, "missing.pem")
	if _, err := wechat.New(cfg); err == nil || !strings.Contains(err.Error(), "KAMI_WECHAT_PRIVATE_KEY") {
		t.Errorf("New with a missing key file: %v, want an error naming KAMI_WECHAT_PRIVATE_KEY", err)
	}
}

func TestNewDefaults(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOptions{})
	cfg := b.cfg
	cfg.APIBase, cfg.Timeout = "", 0
	c, err := wechat.New(cfg)
	if err != nil {
		t.Fatalf("New without APIBase and Timeout: %v", err)
	}
	if c.Name() != "wechat" {
		t.Errorf("Name() = %q", c.Name())
	}
}
