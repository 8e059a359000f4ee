package mqtt

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/mochi-mqtt/server/v2/listeners"
	"github.com/mochi-mqtt/server/v2/packets"
)

// Limits bounds what one client, or one source address, may take from the
// gateway. A zero field means its default.
type Limits struct {
	// MaxClients caps the connected clients. Over it a CONNECT gets CONNACK
	// 0x89 server busy (MQTT 3.1.1: 0x03 server unavailable). Default 1000:
	// each client costs mochi about 70 KiB of buffers.
	MaxClients int
	// MaxTopicLength bounds a topic name or filter, in bytes. Default 1024.
	MaxTopicLength int
	// MaxTopicLevels bounds the levels of a topic name or filter; every
	// level is a node of mochi's topic tree. Default 32.
	MaxTopicLevels int
	// ConnectRate is how many connections per second one source address
	// (an IPv4 address, an IPv6 /64) may open on average, ConnectBurst how
	// many in a row. Over it a connection is closed before anything is
	// read from it. Defaults 20 and 100; a negative rate turns the limit
	// off.
	ConnectRate  float64
	ConnectBurst int
	// KeepAliveMin and KeepAliveMax bound a client's keep-alive, in
	// seconds; 0 means no bound. MQTT 5 clients outside the bounds are
	// told the nearest bound in the CONNACK's server keep alive; MQTT 3.1.1
	// has no way to say so, and such clients are refused with CONNACK 0x02
	// (identifier rejected), as Mosquitto does for max_keepalive. A
	// keep-alive of 0 (never time out) is above any maximum.
	KeepAliveMin, KeepAliveMax uint16
	// ConnectTimeout is how long a new connection has for its TLS
	// handshake and its CONNECT. Default 10s.
	ConnectTimeout time.Duration
}

func (l *Limits) setDefaults() {
	if l.MaxClients <= 0 {
		l.MaxClients = 1000
	}
	if l.MaxTopicLength <= 0 {
		l.MaxTopicLength = 1024
	}
	if l.MaxTopicLevels <= 0 {
		l.MaxTopicLevels = 32
	}
	if l.ConnectRate == 0 {
		l.ConnectRate = 20
	}
	if l.ConnectBurst <= 0 {
		l.ConnectBurst = 100
	}
	if l.ConnectTimeout <= 0 {
		l.ConnectTimeout = 10 * time.Second
	}
}

// topicProblem says what is wrong with a topic name or filter under the
// limits, or "" when nothing is.
func (l *Limits) topicProblem(t string) string {
	if len(t) > l.MaxTopicLength {
		return "topic longer than max_topic_length"
	}
	if strings.Count(t, "/")+1 > l.MaxTopicLevels {
		return "topic deeper than max_topic_levels"
	}
	return ""
}

// keepAlive returns the keep-alive a client asking for ka gets, and
// whether that is ka itself.
func (l *Limits) keepAlive(ka uint16) (uint16, bool) {
	switch {
	case l.KeepAliveMax > 0 && (ka == 0 || ka > l.KeepAliveMax):
		return l.KeepAliveMax, false
	case l.KeepAliveMin > 0 && ka != 0 && ka < l.KeepAliveMin:
		return l.KeepAliveMin, false
	}
	return ka, true
}

// listener is the broker's TCP or TLS listener, in place of mochi's: it
// refuses connections over the per-address rate and the socket cap before
// mochi reads a byte, bounds the time to CONNECT (mochi waits forever),
// survives accept errors such as running out of file descriptors (mochi's
// listener stops for good), and logs failed connections at most once a
// minute per address and reason (mochi's logs each one).
type listener struct {
	id, addr string
	tls      *tls.Config // nil: plain TCP
	b        *Broker
	ln       net.Listener
	closed   atomic.Bool

	mu    sync.Mutex            // guards conns
	conns map[net.Conn]struct{} // handed to mochi and not yet ended
}

// ID returns the listener's id, which mochi records in cl.Net.Listener.
func (l *listener) ID() string { return l.id }

// Protocol returns "tcp" or "tls".

func (l *listener) Protocol() string {
	if l.tls != nil {
		return "tls"
	}
	return "tcp"
}

// Address returns the bound address once Init has run (port 0 resolved).
func (l *listener) Address() string {
	if l.ln != nil {
		return l.ln.Addr().String()
	}
	return l.addr
}

// Init binds the address; mochi calls it from AddListener.
func (l *listener) Init(*slog.Logger) error {
	ln, err := net.Listen("tcp", l.addr)
	if err != nil {
		return err
	}
	if l.tls != nil {
		ln = tls.NewListener(ln, l.tls)
	}
	l.ln = ln
	return nil
}

// Serve accepts connections until Close and hands each one, once admitted,
// to establish (mochi's EstablishConnection) on a goroutine of its own.
func (l *listener) Serve(establish listeners.EstablishFn) {
	var delay time.Duration
	for {
		conn, err := l.ln.Accept()
		if err != nil {
			if l.closed.Load() || errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of file descriptors and the like: back off and go
			// on, as net/http does.
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			l.b.refusal("", "accept failed", "listener", l.id, "error", err)
			time.Sleep(delay)
			continue
		}
		delay = 0
		l.handle(conn, establish)
	}
}

// handle admits or refuses one accepted connection.
func (l *listener) handle(conn net.Conn, establish listeners.EstablishFn) {
	b := l.b
	host := sourceKey(conn.RemoteAddr())
	if !b.connRate.allow(host, time.Now()) {
		conn.Close()
		b.refusal(host, "connection rate exceeded: closed before CONNECT", "listener", l.id, "source", host)
		return
	}
	if n := b.openConns.Add(1); n > b.maxOpenConns {
		b.openConns.Add(-1)
		conn.Close()
		b.refusal("", "too many open connections: closed before CONNECT", "listener", l.id, "open", n-1)
		return
	}
	// mochi sets its keep-alive deadline only once CONNECT is in.
	_ = conn.SetDeadline(time.Now().Add(b.cfg.Limits.ConnectTimeout))
	l.mu.Lock()
	if l.conns == nil {
		l.conns = map[net.Conn]struct{}{}
	}
	l.conns[conn] = struct{}{}
	l.mu.Unlock()
	go func() {
		defer func() {
			l.mu.Lock()
			delete(l.conns, conn)
			l.mu.Unlock()
			b.openConns.Add(-1)
		}()
		if l.closed.Load() {
			conn.Close()
			return
		}
		err := establishSafely(establish, l.id, conn)
		b.connectionEnded(conn, host, err)
	}()
}

// Close stops accepting and disconnects this listener's clients (MQTT 5
// with DISCONNECT 0x8B server shutting down), then closes the connections
// still before their CONNECT, which mochi's Close would otherwise wait for.
// It does not call mochi's closeListenerClients: Clients.GetByListener
// read-locks the client map twice, and deadlocks with a client leaving at
// that moment (its write lock queued between the two).
func (l *listener) Close(listeners.CloseFn) {
	if l.closed.Swap(true) {
		return
	}
	if l.ln != nil {
		l.ln.Close()
	}
	srv := l.b.srv
	for _, cl := range srv.Clients.GetAll() {
		switch {
		case cl.Net.Listener != l.id || cl.Closed():
		case cl.Properties.ProtocolVersion == 5:
			_ = srv.DisconnectClient(cl, packets.ErrServerShuttingDown)
		default:
			cl.Stop(packets.ErrServerShuttingDown) // 3.1.1 has no server DISCONNECT
		}
	}
	l.mu.Lock()
	for conn := range l.conns {
		conn.Close()
	}
	l.mu.Unlock()
}

// connectionEnded logs why a connection mochi served ended, when that is
// worth an operator's attention, once a minute per address and reason.
func (b *Broker) connectionEnded(conn net.Conn, host string, err error) {
	if _, done := b.refusedConns.LoadAndDelete(conn); done || err == nil {
		return // refused by the guard, which logged it
	}
	if tc, ok := conn.(*tls.Conn); ok && !tc.ConnectionState().HandshakeComplete {
		if !quietEnd(err) {
			b.refusal(host, "TLS handshake failed", "remote", conn.RemoteAddr().String(), "error", err)
		}
		return
	}
	before := strings.HasPrefix(err.Error(), "read connection: ") // mochi's wording for errors before CONNECT
	switch {
	case errors.Is(err, os.ErrDeadlineExceeded) && before:
		b.refusal(host, "no CONNECT within the connect timeout", "remote", conn.RemoteAddr().String())
	case errors.Is(err, packets.ErrPacketTooLarge):
		b.refusal(host, "packet larger than max_packet_size: disconnected", "remote", conn.RemoteAddr().String())
	case errors.Is(err, packets.ErrServerBusy):
		b.refusal(host, "max_clients reached: CONNECT refused", "remote", conn.RemoteAddr().String())
	case quietEnd(err), errors.Is(err, packets.ErrSessionTakenOver), errors.Is(err, packets.CodeDisconnect):
		b.logger.Debug("client connection ended", "remote", conn.RemoteAddr().String(), "error", err)
	default:
		var code packets.Code
		if errors.As(err, &code) || before {
			b.refusal(host, "protocol error: disconnected", "remote", conn.RemoteAddr().String(), "error", err)
			return
		}
		b.logger.Debug("client connection ended", "remote", conn.RemoteAddr().String(), "error", err)
	}
}

// quietEnd reports the ordinary ways a connection ends: the peer went away.
func quietEnd(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) ||
		(errors.Is(err, os.ErrDeadlineExceeded) && !strings.HasPrefix(err.Error(), "read connection: "))
}

// sourceKey is what the connect rate is counted by: the IPv4 address, or
// the /64 of an IPv6 address, which one host can fill on its own.
func sourceKey(a net.Addr) string {
	ap, err := netip.ParseAddrPort(a.String())
	if err != nil {
		return a.String()
	}
	ip := ap.Addr().Unmap()
	if ip.Is6() {
		p, _ := ip.Prefix(64)
		return p.String()
	}
	return ip.String()
}

// connRate is a token bucket per source address.
type connRate struct {
	rate, burst float64
	mu          sync.Mutex         // guards buckets
	buckets     map[string]*bucket // by sourceKey
}

type bucket struct {
	tokens float64
	last   time.Time
}

const maxBuckets = 1 << 16

func newConnRate(rate float64, burst int) *connRate {
	if rate < 0 {
		return nil
	}
	return &connRate{rate: rate, burst: float64(burst), buckets: map[string]*bucket{}}
}

// allow takes a token from key's bucket; a nil connRate allows all.
func (c *connRate) allow(key string, now time.Time) bool {
	if c == nil {
		return true
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	bk := c.buckets[key]
	if bk == nil {
		if len(c.buckets) >= maxBuckets {
			c.pruneLocked(now)
		}
		bk = &bucket{tokens: c.burst, last: now}
		c.buckets[key] = bk
	}
	bk.tokens = min(c.burst, bk.tokens+now.Sub(bk.last).Seconds()*c.rate)
	bk.last = now
	if bk.tokens < 1 {
		return false
	}
	bk.tokens--
	return true
}

// pruneLocked forgets the buckets that have refilled, which are the same as
// no bucket; if that is not enough it forgets all, trading a moment of
// leniency for bounded memory.
func (c *connRate) pruneLocked(now time.Time) {
	for k, bk := range c.buckets {
		if bk.tokens+now.Sub(bk.last).Seconds()*c.rate >= c.burst {
			delete(c.buckets, k)
		}
	}
	if len(c.buckets) >= maxBuckets {
		clear(c.buckets)
	}
}

// logLimiter lets one log line per key through per interval and counts the
// ones it holds back, so a flood of bad clients or packets costs the
// journal one line a minute each, not one per packet.
type logLimiter struct {
	every time.Duration
	mu    sync.Mutex // guards seen
	seen  map[string]*logSeen
}

type logSeen struct {
	until      time.Time
	suppressed int
}

const maxLogKeys = 4096

func newLogLimiter(every time.Duration) *logLimiter {
	return &logLimiter{every: every, seen: map[string]*logSeen{}}
}

// allow reports whether a line with key may be logged now, and how many
// lines with that key were held back since the last one.
func (l *logLimiter) allow(key string, now time.Time) (bool, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := l.seen[key]
	if s != nil && now.Before(s.until) {
		s.suppressed++
		return false, 0
	}
	held := 0
	if s != nil {
		held = s.suppressed
	} else if len(l.seen) >= maxLogKeys {
		for k, v := range l.seen {
			if !now.Before(v.until) {
				delete(l.seen, k)
			}
		}
		if len(l.seen) >= maxLogKeys {
			// Too many distinct sources at once: one key for the rest.
			key = "\x00overflow"
			if s := l.seen[key]; s != nil && now.Before(s.until) {
				s.suppressed++
				return false, 0
			}
		}
	}
	l.seen[key] = &logSeen{until: now.Add(l.every)}
	return true, held
}

// limitedHandler passes info and warning records through a logLimiter,
// keyed by message and client (or remote address); debug records, which
// an operator asks for, and errors, which are rare, go through as they are.
type limitedHandler struct {
	slog.Handler
	lim *logLimiter
}

// Handle passes r on unless its key has had its line this interval.
func (h limitedHandler) Handle(ctx context.Context, r slog.Record) error {
	if r.Level < slog.LevelInfo || r.Level >= slog.LevelError {
		return h.Handler.Handle(ctx, r)
	}
	key := r.Message
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "client" || a.Key == "remote" {
			key += "\x00" + a.Value.String()
		}
		return true
	})
	now := r.Time
	if now.IsZero() {
		now = time.Now()
	}
	ok, held := h.lim.allow(key, now)
	if !ok {
		return nil
	}
	if held > 0 {
		r = r.Clone()
		r.AddAttrs(slog.Int("suppressed", held))
	}
	return h.Handler.Handle(ctx, r)
}

func (h limitedHandler) WithAttrs(a []slog.Attr) slog.Handler {
	return limitedHandler{h.Handler.WithAttrs(a), h.lim}
}

func (h limitedHandler) WithGroup(g string) slog.Handler {
	return limitedHandler{h.Handler.WithGroup(g), h.lim}
}

// refusal logs a refused client or packet at warning level, once a minute
// per reason and key: the source address, or the client id for refusals of
// a connected client ("" for those tied to neither).
func (b *Broker) refusal(key, reason string, args ...any) {
	ok, held := b.refusals.allow(reason+"\x00"+key, time.Now())
	if !ok {
		return
	}
	if held > 0 {
		args = append(args, "suppressed", held)
	}
	b.rawLogger.Warn("client refused: "+reason, args...)
}

// establishSafely runs mochi's connection loop and turns a panic in it into
// an error for that one connection: mochi v2.7.9's SUBSCRIBE decoder indexes
// past a malformed packet's end (found by FuzzInboundStream), and a panic on
// this goroutine would otherwise take the whole gateway down with it.
func establishSafely(establish func(string, net.Conn) error, id string, conn net.Conn) (err error) {
	defer func() {
		if r := recover(); r != nil {
			conn.Close()
			err = fmt.Errorf("malformed packet (decoder panic: %v)", r)
		}
	}()
	return establish(id, conn)
}
