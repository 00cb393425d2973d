package webhook

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"strconv"
	"syscall"
	"time"
)

// Guard keeps webhook endpoints from reaching what they must not (SSRF).
// Only global unicast addresses are allowed: loopback, private, shared
// (CGNAT), link-local, unique-local and site-local addresses only with
// AllowPrivate (a shop whose receivers live on its own network); the
// special-purpose ranges (unspecified, multicast, broadcast, reserved,
// documentation, benchmarking, protocol assignments, Teredo) and the
// cloud hosts' instance metadata services (which hand out the machine's
// credentials to whoever asks from it) never. An
// IPv6 address that carries an IPv4 address (mapped, compatible, NAT64,
// 6to4) is judged by both. kami itself (its public URL, its listen
// addresses) is refused even with AllowPrivate, so kami never posts to
// itself.
//
// It checks an endpoint's URL when it is created, and every address again
// at dial time (Client), after the name was resolved: a name that resolved
// to a public address at creation and to 127.0.0.1 later (DNS rebinding)
// is still refused.
type Guard struct {
	AllowPrivate bool
	// Self is kami's own public URL (KAMI_PUBLIC_URL): the addresses its
	// host resolves to, on its port, are kami.
	Self string
	// Listen are the host:port addresses kami itself listens on (KAMI_ADDR,
	// KAMI_PPROF_ADDR). One on all interfaces (":8080", "0.0.0.0:8080",
	// "[::]:8080") is reached at every address of this host.
	Listen []string
	// Resolver looks names up; nil: net.DefaultResolver.
	Resolver *net.Resolver
}

// ErrRefused is wrapped by every refusal of the guard.
var ErrRefused = errors.New("webhook endpoint refused")

// class is what the guard makes of an address.
type class int

const (
	public   class = iota // a receiver on the internet
	private               // this host or the shop's own network: only with AllowPrivate
	special               // not a unicast receiver anywhere: never
	metadata              // a cloud host's instance metadata service: never
)

type addrRange struct {
	prefix netip.Prefix
	class  class
}

func ranges(c class, prefixes ...string) []addrRange {
	r := make([]addrRange, len(prefixes))
	for i, p := range prefixes {
		r[i] = addrRange{netip.MustParsePrefix(p), c}
	}
	return r
}

// metadataIPv4 and metadataIPv6 are the addresses where cloud hosts serve
// a machine its metadata and credentials. They sit in ranges a shop may
// open with AllowPrivate (link-local, CGNAT, unique local) or even among
// public ones (Azure's), so they are matched first.
var metadataIPv4 = ranges(metadata,
	"169.254.169.254/32", // AWS, Google Cloud, Azure, Oracle, Huawei Cloud, OpenStack, DigitalOcean
	"169.254.170.2/32",   // AWS ECS task credentials
	"169.254.170.23/32",  // AWS EKS pod identity
	"169.254.0.23/32",    // Tencent Cloud
	"100.100.100.200/32", // Alibaba Cloud
	"168.63.129.16/32",   // Azure host (wire server)
)

var metadataIPv6 = ranges(metadata,
	"fd00:ec2::254/128", // AWS
	"fd00:ec2::23/128",  // AWS EKS pod identity
)

// ipv4Ranges, first match wins: an IPv4 address in none of them is public.
var ipv4Ranges = slices.Concat(metadataIPv4, ranges(private,
	"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", // private
	"100.64.0.0/10",  // shared address space (CGNAT)
	"127.0.0.0/8",    // loopback
	"169.254.0.0/16", // link-local (cloud metadata services live here)
), ranges(special,
	"0.0.0.0/8",                                         // this network (0.0.0.0 dials this host)
	"192.0.0.0/24",                                      // IETF protocol assignments
	"192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", // documentation
	"192.88.99.0/24", // 6to4 relay anycast (deprecated)
	"198.18.0.0/15",  // benchmarking
	"224.0.0.0/4",    // multicast
	"240.0.0.0/4",    // reserved, and the broadcast 255.255.255.255
))

// ipv6Ranges, first match wins: an IPv6 address in none of them is
// special (it is not global unicast: unspecified, IPv4-compatible,
// discard-only, multicast, reserved).
var ipv6Ranges = slices.Concat(metadataIPv6, ranges(private,
	"::1/128",        // loopback
	"fc00::/7",       // unique local
	"fe80::/10",      // link-local
	"fec0::/10",      // site-local (deprecated, still private)
	"64:ff9b:1::/48", // NAT64 for local use: a translator of the shop's own
), ranges(special,
	"2001::/23",                  // IETF protocol assignments: Teredo, benchmarking, ORCHID
	"2001:db8::/32", "3fff::/20", // documentation
), ranges(public,
	"64:ff9b::/96", // NAT64: judged by the IPv4 address it carries too
	"2002::/16",    // 6to4: judged by the IPv4 address it carries too
	"2000::/3",     // global unicast
))

// classify is the class of ip, and of the IPv4 address it carries if any,
// whichever is stricter.
func classify(ip netip.Addr) class {
	ip = ip.WithZone("") // a prefix never contains a zoned address
	if ip.Is4In6() {
		ip = ip.Unmap()
	}
	if !ip.IsValid() {
		return special
	}
	if ip.Is4() {
		for _, r := range ipv4Ranges {
			if r.prefix.Contains(ip) {
				return r.class
			}
		}
		return public
	}
	c := special
	for _, r := range ipv6Ranges {
		if r.prefix.Contains(ip) {
			c = r.class
			break
		}
	}
	if v4, ok := embeddedIPv4(ip); ok {
		c = max(c, classify(v4))
	}
	return c
}

var (
	nat64  = netip.MustParsePrefix("64:ff9b::/96")
	sixTo4 = netip.MustParsePrefix("2002::/16")
	compat = netip.MustParsePrefix("::/96")
)

// embeddedIPv4 is the IPv4 address an IPv6 address carries: mapped
// (::ffff:a.b.c.d), compatible (::a.b.c.d; :: and ::1 are not),
// NAT64 (64:ff9b::a.b.c.d) or 6to4 (2002:aabb:ccdd::).
func embeddedIPv4(ip netip.Addr) (netip.Addr, bool) {
	ip = ip.WithZone("")
	b := ip.As16()
	switch {
	case ip.Is4In6():
		return ip.Unmap(), true
	case ip.Is6() && (nat64.Contains(ip) || compat.Contains(ip) && !ip.IsLoopback() && !ip.IsUnspecified()):
		return netip.AddrFrom4([4]byte(b[12:16])), true
	case ip.Is6() && sixTo4.Contains(ip):
		return netip.AddrFrom4([4]byte(b[2:6])), true
	}
	return netip.Addr{}, false
}

// port is u's port as a number, filled in from the scheme: "0443" is 443.
func port(u *url.URL) (uint16, bool) {
	p := u.Port()
	if p == "" {
		if u.Scheme == "https" {
			return 443, true
		}
		return 80, true
	}
	n, err := strconv.ParseUint(p, 10, 16)
	return uint16(n), err == nil && n != 0
}

// lookup is host's addresses: host itself if it is an address.
func (g Guard) lookup(ctx context.Context, host string) ([]netip.Addr, error) {
	if ip, err := netip.ParseAddr(host); err == nil {
		return []netip.Addr{ip}, nil
	}
	r := g.Resolver
	if r == nil {
		r = net.DefaultResolver
	}
	return r.LookupNetIP(ctx, "ip", host)
}

// self is where kami itself answers on port p: these addresses, and, if
// everywhere is set, every address of this host (a listener on all
// interfaces). Names are resolved on every call, as the receiver's are.
func (g Guard) self(ctx context.Context, p uint16) (addrs []netip.Addr, everywhere bool, err error) {
	add := func(host string) error {
		ips, err := g.lookup(ctx, host)
		if err != nil {
			return fmt.Errorf("%w: kami's own address %s does not resolve", ErrRefused, host)
		}
		addrs = append(addrs, ips...)
		return nil
	}
	if u, err := url.Parse(g.Self); g.Self != "" && err == nil && u.Hostname() != "" {
		if sp, ok := port(u); ok && sp == p {
			if err := add(u.Hostname()); err != nil {
				return nil, false, err
			}
		}
	}
	for _, l := range g.Listen {
		host, service, err := net.SplitHostPort(l)
		if err != nil {
			continue
		}
		if lp, err := net.LookupPort("tcp", service); err != nil || lp != int(p) {
			continue
		}
		if ip, err := netip.ParseAddr(host); host == "" || err == nil && ip.IsUnspecified() {
			everywhere = true
		} else if err := add(host); err != nil {
			return nil, false, err
		}
	}
	return addrs, everywhere, nil
}

// onThisHost reports whether ip is one of this host's addresses.
func onThisHost(ip netip.Addr) bool {
	if ip.IsLoopback() || ip.IsUnspecified() {
		return true
	}
	ifaddrs, err := net.InterfaceAddrs()
	if err != nil {
		return true // unknown: a listener on all interfaces may be there
	}
	for _, a := range ifaddrs {
		if n, ok := a.(*net.IPNet); ok {
			if own, ok := netip.AddrFromSlice(n.IP); ok && own.Unmap() == ip {
				return true
			}
		}
	}
	return false
}

// isSelf reports whether ip (or the IPv4 address it carries) is among
// kami's own addresses, as self returned them.
func isSelf(ip netip.Addr, addrs []netip.Addr, everywhere bool) bool {
	candidates := []netip.Addr{ip.WithZone("").Unmap()}
	if v4, ok := embeddedIPv4(ip); ok {
		candidates = append(candidates, v4)
	}
	for _, c := range candidates {
		if everywhere && onThisHost(c) {
			return true
		}
		for _, a := range addrs {
			if a.WithZone("").Unmap() == c {
				return true
			}
		}
	}
	return false
}

// check refuses ips on port p if one of them is kami itself, special, or
// private without AllowPrivate. name is what the refusal talks about.
func (g Guard) check(ctx context.Context, name string, ips []netip.Addr, p uint16) error {
	addrs, everywhere, err := g.self(ctx, p)
	if err != nil {
		return err
	}
	for _, ip := range ips {
		if isSelf(ip, addrs, everywhere) {
			return fmt.Errorf("%w: it points at kami itself", ErrRefused)
		}
		switch classify(ip) {
		case metadata:
			return fmt.Errorf("%w: %s is a cloud instance metadata service", ErrRefused, name)
		case special:
			return fmt.Errorf("%w: %s is not a public unicast address", ErrRefused, name)
		case private:
			if !g.AllowPrivate {
				return fmt.Errorf("%w: %s is a loopback, link-local or private address", ErrRefused, name)
			}
		}
	}
	return nil
}

// CheckURL refuses an endpoint URL that is not an absolute http(s) URL,
// carries credentials, or whose host resolves to an address the guard
// refuses.
func (g Guard) CheckURL(ctx context.Context, raw string) error {
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Hostname() == "" {
		return fmt.Errorf("%w: want an absolute http or https URL", ErrRefused)
	}
	if u.User != nil {
		return fmt.Errorf("%w: the URL may not carry a user or password", ErrRefused)
	}
	p, ok := port(u)
	if !ok {
		return fmt.Errorf("%w: want a port from 1 to 65535", ErrRefused)
	}
	host := u.Hostname()
	ips, err := g.lookup(ctx, host)
	if err != nil {
		return fmt.Errorf("%w: its host does not resolve", ErrRefused)
	}
	return g.check(ctx, host, ips, p)
}

// control runs on every connection kami dials for a delivery, with the
// address it is about to connect to, after resolution.
func (g Guard) control(ctx context.Context, _, address string, _ syscall.RawConn) error {
	ap, err := netip.ParseAddrPort(address)
	if err != nil {
		return fmt.Errorf("%w: %s is not an address", ErrRefused, address)
	}
	return g.check(ctx, address, []netip.Addr{ap.Addr()}, ap.Port())
}

// maxAnswerHeader bounds the headers a receiver's answer may have: kami
// reads only the status and a snippet of the body, and each attempt would
// otherwise hold up to http.Transport's default of 10 MiB.
const maxAnswerHeader = 64 << 10

// Client is the HTTP client deliveries are sent with: every dial is
// checked by the guard, no proxy (a proxy would dial for it), no
// redirects (a 3xx is an answer, not a delivery), timeout per request,
// answers' headers bounded.
func (g Guard) Client(timeout time.Duration) *http.Client {
	d := &net.Dialer{Timeout: timeout, Resolver: g.Resolver, ControlContext: g.control}
	return &http.Client{
		Timeout: timeout,
		Transport: &http.Transport{
			Proxy:                  nil,
			DialContext:            d.DialContext,
			TLSHandshakeTimeout:    timeout,
			MaxResponseHeaderBytes: maxAnswerHeader,
			MaxIdleConnsPerHost:    4,
			IdleConnTimeout:        90 * time.Second,
		},
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
}
