package alipay

import (
	"bytes"
	"context"
	"crypto"
	"crypto/rsa"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
)

// gopay v1.5.123 has no setting for the gateway URL: it posts to the
// production (or sandbox) constant. It does let us replace the transport of
// its http client, so with KAMI_ALIPAY_GATEWAY set every request it makes to
// the production gateway is re-aimed at the configured one. Pay URLs (page,
// wap) are built by gopay as strings, not requests; payURL re-aims those.
//
// The same transport keeps a copy of each answer for the call that asked
// (through the request's context): gopay verifies the signature of
// successful answers only, and kami must not take a business error such as
// ACQ.TRADE_NOT_EXIST ("nothing to close", "no such refund") on trust.

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

// transport sends gopay's production-gateway requests to target (when
// set) and records answers for the calls that asked.
type transport struct {
	target *url.URL // nil: production
	base   http.RoundTripper
}

// maxAnswer bounds a recorded answer, as SetBodySize bounds gopay's read.
const maxAnswer = 1 << 20

func (t *transport) RoundTrip(req *http.Request) (*http.Response, error) {
	r := req
	if t.target != nil {
		if req.URL.Host != productionHost {
			// Never let a request escape to a host nobody configured.
			if req.Body != nil {
				req.Body.Close()
			}
			return nil, fmt.Errorf("alipay gateway override: refusing request to %s", req.URL.Host)
		}
		r = req.Clone(req.Context())
		u := *t.target
		u.RawQuery = joinQuery(t.target.RawQuery, req.URL.RawQuery)
		r.URL = &u
		r.Host = u.Host
	}
	res, err := t.base.RoundTrip(r)
	if err != nil {
		return nil, err
	}
	if rec, ok := req.Context().Value(recorderKey{}).(*recorder); ok {
		body, err := io.ReadAll(io.LimitReader(res.Body, maxAnswer))
		res.Body.Close()
		if err != nil {
			return nil, err
		}
		rec.body = body
		res.Body = io.NopCloser(bytes.NewReader(body))
	}
	return res, nil
}

type recorderKey struct{}

// recorder holds the last answer of one call.
type recorder struct{ body []byte }

func record(ctx context.Context) (context.Context, *recorder) {
	rec := &recorder{}
	return context.WithValue(ctx, recorderKey{}, rec), rec
}

// answerSignature reports whether answer carries a signature and whether
// it is valid: Alipay's key over the text of the xxx_response object, which
// is what Alipay signs (and what gopay checks on successful answers).
func (c *Client) answerSignature(answer []byte) (present, valid bool) {
	var env struct {
		Sign string `json:"sign"`
	}
	if json.Unmarshal(answer, &env) != nil || env.Sign == "" {
		return false, false
	}
	s := string(answer)
	i := strings.Index(s, `_response":`)
	j := strings.LastIndex(s, `,"sign":"`)
	if i < 0 || j < i+len(`_response":`) {
		return true, false
	}
	sig, err := base64.StdEncoding.DecodeString(env.Sign)
	if err != nil {
		return true, false
	}
	sum := sha256.Sum256([]byte(s[i+len(`_response":`) : j]))
	return true, rsa.VerifyPKCS1v15(c.pub, crypto.SHA256, sum[:], sig) == nil
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
