package alipay

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
)

// gopay v1.5.123 has no setting for the gateway URL: it posts to the
// production (or sandbox) constant. It does let us replace the transport of
// its http client, so with KAMI_ALIPAY_GATEWAY set every request it makes to
// the production gateway is re-aimed at the configured one. Pay URLs (page,
// wap) are built by gopay as strings, not requests; payURL re-aims those.

const productionHost = "openapi.alipay.com"

// parseGateway accepts an absolute http(s) URL. A URL with no path means the
// gateway's usual /gateway.do on that host.
func parseGateway(s string) (*url.URL, error) {
	u, err := url.Parse(s)
	if err != nil {
		return nil, errors.New("not a URL")
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return nil, errors.New("want an http or https URL")
	}
	if u.Host == "" {
		return nil, errors.New("URL has no host")
	}
	if u.User != nil || u.Fragment != "" {
		return nil, errors.New("URL must not carry credentials or a fragment")
	}
	if u.Path == "" || u.Path == "/" {
		u.Path = "/gateway.do"
	}
	return u, nil
}

// gatewayTransport sends gopay's production-gateway requests to target.
type gatewayTransport struct {
	target *url.URL
	base   http.RoundTripper
}

func (t *gatewayTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.URL.Host != productionHost {
		// Never let a request escape to a host nobody configured.
		if req.Body != nil {
			req.Body.Close()
		}
		return nil, fmt.Errorf("alipay gateway override: refusing request to %s", req.URL.Host)
	}
	r := req.Clone(req.Context())
	u := *t.target
	u.RawQuery = joinQuery(t.target.RawQuery, req.URL.RawQuery)
	r.URL = &u
	r.Host = u.Host
	return t.base.RoundTrip(r)
}

// payURL re-aims a pay URL gopay built for the production gateway.
func (c *Client) payURL(s string) string {
	if c.gateway == nil {
		return s
	}
	rest, ok := strings.CutPrefix(s, ProductionGateway+"?")
	if !ok {
		return s
	}
	u := *c.gateway
	u.RawQuery = joinQuery(c.gateway.RawQuery, rest)
	return u.String()
}

func joinQuery(a, b string) string {
	switch {
	case a == "":
		return b
	case b == "":
		return a
	}
	return a + "&" + b
}
