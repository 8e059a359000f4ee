package admin

import (
	"context"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"time"

	"github.com/tandem-edge/tandem/mqtt"
)

// The HTTP listener's connection budget. netutil.LimitListener makes
// Accept wait for a free slot, which cannot keep one for loopback: it must
// decide before it knows who is next. So connections are accepted and then
// judged by their source: other hosts share http.max_conns, at most
// http.max_conns_per_address each; loopback counts in the total but may go
// loopbackReserve past it and has no per-address cap, since every local
// client (the CLI, a browser on the gateway, a local scraper) shares
// 127.0.0.1. Kept-alive connections close after http.idle_timeout, so the
// slots a stranger holds are those it keeps busy.
//
// A refused connection is answered 503 with Connection: close, as nginx's
// limit_conn does, so the client learns why; at most refusingConns are
// being answered at once, and past them a connection is closed at accept,
// costing nothing but the accept.
const (
	defaultHTTPMaxConns        = 64
	defaultHTTPMaxConnsPerAddr = 8
	defaultHTTPIdleTimeout     = 10 * time.Second
	// loopbackReserve is how many loopback connections may be open past
	// http.max_conns: `tandem status` and a local browser's page.
	loopbackReserve = 8
	// refusingConns bounds the refused connections being answered 503.
	refusingConns = 16
	// httpReadHeaderTimeout bounds the wait for a request's header, and
	// idle_timeout does when it is shorter.
	httpReadHeaderTimeout = 5 * time.Second
)

// Reasons of the HTTP listener's refusals: the tandem_http_refused_total
// label and the 503's text.
const (
	refusedHTTPAddr  = "too many connections from the address"
	refusedHTTPTotal = "too many connections"
)

// connLimiter is the HTTP listener with the connection budget above.
type connLimiter struct {
	net.Listener
	max, perAddr int
	// isLocal judges a source loopback (tests judge some loopback
	// addresses strangers).
	isLocal func(netip.Addr) bool
	// refused is told of each refused connection, on the accepting
	// goroutine: it counts and logs it.
	refused func(reason, source string, open int)

	mu       sync.Mutex     // guards the counts
	total    int            // connections admitted and not yet closed
	byAddr   map[string]int // those of other hosts, by source key
	refusing int            // refused connections being answered
}

func newConnLimiter(ln net.Listener, max, perAddr int, refused func(reason, source string, open int)) *connLimiter {
	return &connLimiter{Listener: ln, max: max, perAddr: perAddr, refused: refused,
		isLocal: func(a netip.Addr) bool { return a.IsLoopback() }, byAddr: map[string]int{}}
}

// Accept returns the next connection, admitted or to be answered 503;
// those refused outright are closed on the way.
func (l *connLimiter) Accept() (net.Conn, error) {
	for {
		nc, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if c := l.admit(nc); c != nil {
			return c, nil
		}
	}
}

// admit counts nc in, or marks it refused, or closes it and returns nil.
func (l *connLimiter) admit(nc net.Conn) *budgetConn {
	ip, key := sourceOf(nc.RemoteAddr())
	local := l.isLocal(ip)
	c := &budgetConn{Conn: nc, l: l, key: key, local: local}
	l.mu.Lock()
	var open int
	switch {
	case local && l.total < l.max+loopbackReserve,
		!local && l.total < l.max && l.byAddr[key] < l.perAddr:
		l.total++
		if !local {
			l.byAddr[key]++
		}
	case !local && l.byAddr[key] >= l.perAddr:
		c.refusal, open = refusedHTTPAddr, l.byAddr[key]
	default:
		c.refusal, open = refusedHTTPTotal, l.total
	}
	answer := c.refusal != "" && l.refusing < refusingConns
	if answer {
		l.refusing++
	}
	l.mu.Unlock()
	if c.refusal == "" {
		return c
	}
	l.refused(c.refusal, key, open)
	if !answer {
		nc.Close()
		return nil
	}
	return c
}

// release gives c's slot back.
func (l *connLimiter) release(c *budgetConn) {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case c.refusal != "":
		l.refusing--
	case c.local:
		l.total--
	default:
		l.total--
		if l.byAddr[c.key]--; l.byAddr[c.key] <= 0 {
			delete(l.byAddr, c.key)
		}
	}
}

// open returns the connections admitted and open, and those being
// refused.
func (l *connLimiter) open() (admitted, refusing int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.total, l.refusing
}

// budgetConn is a connection of the HTTP listener; it holds its slot
// until closed.
type budgetConn struct {
	net.Conn
	l       *connLimiter
	key     string // sourceOf's key
	local   bool
	refusal string // why it is refused, "" when admitted
	once    sync.Once
}

// Close closes the connection and frees its slot once.
func (c *budgetConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() { c.l.release(c) })
	return err
}

// CloseWrite lets net/http half-close the connection after a 503, so the
// client reads it before the close instead of a reset.
func (c *budgetConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// budgetConnKey is the request context key of the *budgetConn a request
// came on.
type budgetConnKey struct{}

// connContext is the http.Server's ConnContext: it puts the connection in
// its requests' context, for refuseOver.
func connContext(ctx context.Context, c net.Conn) context.Context {
	return context.WithValue(ctx, budgetConnKey{}, c)
}

// refuseOver answers every request on a refused connection 503 and closes
// it; the rest go to h.
func refuseOver(h http.Handler, retryAfter time.Duration) http.Handler {
	retry := strconv.Itoa(max(1, int(retryAfter/time.Second)))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if c, ok := r.Context().Value(budgetConnKey{}).(*budgetConn); ok && c.refusal != "" {
			w.Header().Set("Connection", "close")
			w.Header().Set("Retry-After", retry)
			http.Error(w, "busy: "+c.refusal, http.StatusServiceUnavailable)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// sourceOf returns a's address and the key its connections are counted
// by, as the MQTT listener counts (mqtt.SourceKey).
func sourceOf(a net.Addr) (netip.Addr, string) {
	ap, _ := netip.ParseAddrPort(a.String())
	return ap.Addr().Unmap(), mqtt.SourceKey(a)
}
