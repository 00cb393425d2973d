package graph

import (
	"fmt"
	"net/http"
	"net/netip"
	"strings"
)

// TrustedProxies finds the client's address behind the reverse proxies
// kami trusts (KAMI_TRUSTED_PROXIES, KAMI_TRUSTED_PROXY_HEADER). Each proxy
// adds the address it was reached from to the forwarding header; anyone
// may write anything there before the first proxy. So the header is read
// from the right, only while the address it was reached from is a trusted
// proxy: the first address that is not one is the client. A request from
// an address that is not a trusted proxy is its own client, whatever its
// headers say.
type TrustedProxies struct {
	nets   []netip.Prefix
	header string // canonical form: X-Forwarded-For, X-Real-Ip or Forwarded
}

// ProxyHeaders are the forwarding headers TrustedProxies reads, one at a
// time: the one the trusted proxies set. Reading another one would read
// what the client wrote, since proxies pass unknown headers on.
var ProxyHeaders = []string{"X-Forwarded-For", "X-Real-IP", "Forwarded"}

// ParseTrustedProxies reads a comma-separated list of networks (CIDR) or
// single addresses. The proxies are taken to set X-Forwarded-For; see
// ReadingHeader for the others.
func ParseTrustedProxies(list string) (TrustedProxies, error) {
	t := TrustedProxies{header: "X-Forwarded-For"}
	for _, part := range strings.Split(list, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		if p, err := netip.ParsePrefix(part); err == nil {
			t.nets = append(t.nets, p.Masked())
			continue
		}
		a, err := netip.ParseAddr(part)
		if err != nil {
			return TrustedProxies{}, fmt.Errorf("%q is neither a network (10.0.0.0/8) nor an address", part)
		}
		a = a.Unmap()
		t.nets = append(t.nets, netip.PrefixFrom(a, a.BitLen()))
	}
	return t, nil
}

// ReadingHeader returns t reading header, one of ProxyHeaders (any case;
// "" keeps X-Forwarded-For).
func (t TrustedProxies) ReadingHeader(header string) (TrustedProxies, error) {
	header = strings.TrimSpace(header)
	if header == "" {
		return t, nil
	}
	for _, h := range ProxyHeaders {
		if strings.EqualFold(h, header) {
			t.header = http.CanonicalHeaderKey(h)
			return t, nil
		}
	}
	return TrustedProxies{}, fmt.Errorf("want one of %s", strings.Join(ProxyHeaders, ", "))
}

// Any reports whether any proxy is trusted.
func (t TrustedProxies) Any() bool { return len(t.nets) > 0 }

func (t TrustedProxies) trusts(a netip.Addr) bool {
	for _, n := range t.nets {
		if n.Contains(a) {
			return true
		}
	}
	return false
}

// ClientAddr is the client's address of r (a Config.ClientAddr).
func (t TrustedProxies) ClientAddr(r *http.Request) string {
	peer, ok := parseHop(RemoteHost(r))
	if !ok {
		return RemoteHost(r)
	}
	if !t.trusts(peer) {
		return peer.String()
	}
	hops := t.hops(r)
	for i := len(hops) - 1; i >= 0; i-- {
		a, ok := parseHop(hops[i])
		if !ok {
			// Not an address where a trusted proxy wrote one ("unknown",
			// an obfuscated name): the nearest proxy is all we know.
			return peer.String()
		}
		if !t.trusts(a) {
			return a.String()
		}
		peer = a
	}
	return peer.String() // every hop is a trusted proxy
}

// hops lists the addresses of the forwarding header, leftmost first; its
// lines are one list, in order.
func (t TrustedProxies) hops(r *http.Request) []string {
	var hops []string
	for _, line := range r.Header.Values(t.header) {
		for _, elem := range strings.Split(line, ",") {
			if t.header != "Forwarded" {
				hops = append(hops, elem)
				continue
			}
			// RFC 7239: for=... among the element's pairs; an element
			// without one is an address we do not know.
			hop := "unknown"
			for _, pair := range strings.Split(elem, ";") {
				k, v, _ := strings.Cut(strings.TrimSpace(pair), "=")
				if strings.EqualFold(k, "for") {
					hop = v
				}
			}
			hops = append(hops, hop)
		}
	}
	return hops
}

// parseHop reads one address as the headers write them: bare, quoted, in
// brackets, with or without a port.
func parseHop(s string) (netip.Addr, bool) {
	s = strings.Trim(strings.TrimSpace(s), `"`)
	if ap, err := netip.ParseAddrPort(s); err == nil {
		return ap.Addr().Unmap().WithZone(""), true
	}
	a, err := netip.ParseAddr(strings.TrimSuffix(strings.TrimPrefix(s, "["), "]"))
	if err != nil {
		return netip.Addr{}, false
	}
	return a.Unmap().WithZone(""), true
}
