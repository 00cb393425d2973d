package webhook

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strings"
	"syscall"
	"time"
)

// Guard keeps webhook endpoints from reaching what they must not (SSRF):
// kami itself, loopback, link-local, private, shared (CGNAT), multicast
// and unspecified addresses, unless AllowPrivate is set (a shop whose
// receivers live on its own network). It checks an endpoint's URL when it
// is created, and every address again at dial time (Client), after the
// name was resolved: a name that resolved to a public address at creation
// and to 127.0.0.1 later (DNS rebinding) is still refused.
type Guard struct {
	AllowPrivate bool
	// Self is kami's own public URL (KAMI_PUBLIC_URL): an endpoint on its
	// host and port is refused even where private addresses are allowed,
	// so kami never posts to itself.
	Self string
	// Resolver looks names up at creation; nil: net.DefaultResolver.
	Resolver *net.Resolver
}

// ErrRefused is wrapped by every refusal of the guard.
var ErrRefused = errors.New("webhook endpoint refused")

var cgnat = netip.MustParsePrefix("100.64.0.0/10")

// allowedIP reports whether a delivery may go to ip.
func (g Guard) allowedIP(ip netip.Addr) bool {
	ip = ip.Unmap()
	if !ip.IsValid() {
		return false
	}
	if g.AllowPrivate {
		return true
	}
	return !(ip.IsLoopback() || ip.IsLinkLocalUnicast() || ip.IsLinkLocalMulticast() || ip.IsInterfaceLocalMulticast() ||
		ip.IsMulticast() || ip.IsPrivate() || ip.IsUnspecified() || cgnat.Contains(ip) || ip.Is4() && ip.As4()[0] == 0)
}

// hostPort is u's host and port, the port filled in from the scheme.
func hostPort(u *url.URL) string {
	port := u.Port()
	if port == "" {
		port = "80"
		if u.Scheme == "https" {
			port = "443"
		}
	}
	return net.JoinHostPort(strings.ToLower(strings.TrimSuffix(u.Hostname(), ".")), port)
}

// CheckURL refuses an endpoint URL that is not an absolute http(s) URL,
// carries credentials, points at kami itself, or whose host resolves to
// an address the guard refuses.
func (g Guard) CheckURL(ctx context.Context, raw string) error {
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Hostname() == "" {
		return fmt.Errorf("%w: want an absolute http or https URL", ErrRefused)
	}
	if u.User != nil {
		return fmt.Errorf("%w: the URL may not carry a user or password", ErrRefused)
	}
	if g.Self != "" {
		if self, err := url.Parse(g.Self); err == nil && self.Hostname() != "" && hostPort(self) == hostPort(u) {
			return fmt.Errorf("%w: it points at kami itself", ErrRefused)
		}
	}
	host := u.Hostname()
	if ip, err := netip.ParseAddr(host); err == nil {
		if !g.allowedIP(ip) {
			return fmt.Errorf("%w: %s is a loopback, link-local or private address", ErrRefused, host)
		}
		return nil
	}
	r := g.Resolver
	if r == nil {
		r = net.DefaultResolver
	}
	ips, err := r.LookupNetIP(ctx, "ip", host)
	if err != nil {
		return fmt.Errorf("%w: its host does not resolve", ErrRefused)
	}
	for _, ip := range ips {
		if !g.allowedIP(ip) {
			return fmt.Errorf("%w: %s resolves to a loopback, link-local or private address", ErrRefused, host)
		}
	}
	return nil
}

// control runs on every connection kami dials for a delivery, with the
// address it is about to connect to, after resolution.
func (g Guard) control(_, address string, _ syscall.RawConn) error {
	ap, err := netip.ParseAddrPort(address)
	if err != nil || !g.allowedIP(ap.Addr()) {
		return fmt.Errorf("%w: %s is a loopback, link-local or private address", ErrRefused, address)
	}
	return nil
}

// Client is the HTTP client deliveries are sent with: every dial is
// checked by the guard, no proxy (a proxy would dial for it), no
// redirects (a 3xx is an answer, not a delivery), timeout per request.
func (g Guard) Client(timeout time.Duration) *http.Client {
	d := &net.Dialer{Timeout: timeout, Control: g.control}
	return &http.Client{
		Timeout: timeout,
		Transport: &http.Transport{
			Proxy:               nil,
			DialContext:         d.DialContext,
			TLSHandshakeTimeout: timeout,
			MaxIdleConnsPerHost: 4,
			IdleConnTimeout:     90 * time.Second,
		},
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
}
