package main

import (
	"strings"
	"testing"
)

func TestMailSettings(t *testing.T) {
	t.Parallel()
	c, err := loadConfig(env{}.get)
	if err != nil || c.Mail != nil {
		t.Fatalf("no KAMI_SMTP_URL: mail %+v, %v; want off", c.Mail, err)
	}
	c, err = loadConfig(env{"KAMI_SMTP_URL": "smtps://u:p@mail.example.com", "KAMI_MAIL_FROM": "Shop <codes@example.com>", "KAMI_SHOP_NAME": "小店"}.get)
	if err != nil || c.Mail == nil || !c.Mail.Server.Implicit || c.Mail.Server.Port != 465 || c.Mail.From.Address != "codes@example.com" || c.Mail.ShopName != "小店" {
		t.Fatalf("mail settings %+v, %v", c.Mail, err)
	}
	for _, tc := range []struct {
		e    env
		name string
	}{
		{env{"KAMI_SMTP_URL": "smtp://mail.example.com"}, "KAMI_MAIL_FROM"},
		{env{"KAMI_SMTP_URL": "http://mail.example.com", "KAMI_MAIL_FROM": "codes@example.com"}, "KAMI_SMTP_URL"},
		{env{"KAMI_SMTP_URL": "smtp://mail.example.com", "KAMI_MAIL_FROM": "not an address"}, "KAMI_MAIL_FROM"},
		{env{"KAMI_SHOP_NAME": "a\nb"}, "KAMI_SHOP_NAME"},
	} {
		if _, err := loadConfig(tc.e.get); err == nil || !strings.Contains(err.Error(), tc.name) {
			t.Errorf("%v: error %v does not name %s", tc.e, err, tc.name)
		}
	}
}
