package mqtt

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"syscall"
	"time"
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
	// handshake and its CONNECT; on the WebSocket listener also for its
	// HTTP upgrade, counted from accept. Default 10s.
	ConnectTimeout time.Duration
	// Memory is the gateway-wide budget, in bytes, of what clients make it
	// hold (memory.go): near it the connections that hold the most are
	// not read from, at it publishes are refused with 0x97. 0 means no
	// budget (a library user's choice; the daemon always sets one).
	Memory int64
	// MaxClientIDLength bounds a client id, in bytes: it keys the session
	// map and goes into every record and log line of the client. Over it
	// a CONNECT gets CONNACK 0x85 client identifier not valid (3.1.1:
	// 0x02 identifier rejected). Default 256.
	MaxClientIDLength int
	// MaxFiltersPerSession caps the subscriptions of one session; a filter
	// over it gets SUBACK 0x97 quota exceeded (3.1.1: 0x80 failure). A
	// filter the session holds already replaces its subscription
	// [MQTT-3.8.4-3], so it never counts twice. Each filter is a node of
	// the topic index and, for a persistent session, a record and a key
	// on disk. Default 100.
	MaxFiltersPerSession int
	// MaxConnectionsPerAddress and MaxConnectionsPerUser cap the clients
	// connected at once from one source address (as ConnectRate counts
	// them) and under one user name (anonymous clients have none). Over
	// either a CONNECT gets CONNACK 0x97 quota exceeded (3.1.1: 0x03
	// server unavailable). Loopback is not exempt. Defaults 64.
	MaxConnectionsPerAddress, MaxConnectionsPerUser int
	// MaxRetained caps the retained topics and MaxRetainedBytes the bytes
	// their messages take (retainedSize: what their records take of the
	// data file's pages, where they count in storage.max_bytes and
	// retention cannot drop them; below feature level 3 their bytes,
	// counts.go). A retained publish that would add a topic past the
	// first or grow the bytes past the second gets PUBACK 0x97 quota
	// exceeded (3.1.1: disconnected; QoS 0: dropped) and is not logged;
	// replacing a topic's message within the bytes, or clearing it, is
	// always taken. Defaults 10,000 and 32 MiB (the daemon sets 1/8 of
	// storage.max_bytes).
	MaxRetained      int
	MaxRetainedBytes int64
	// MaxSessions caps the persistent sessions (session expiry above 0,
	// or a 3.1.1 client without clean session), those of every member of
	// the cluster included: each is kept on disk and in memory by every
	// member, offline or not. A CONNECT that would start one past it gets
	// CONNACK 0x97 quota exceeded (3.1.1: 0x03 server unavailable); a
	// session resuming is always taken. Default 10,000.
	MaxSessions int
	// MaxSessionBytes caps the bytes the persistent sessions keep in the
	// data file, every member's together (sessionbytes.go): a CONNECT
	// that would start a new one past it gets CONNACK 0x97 quota exceeded
	// (3.1.1: 0x03 server unavailable), a SUBSCRIBE filter that would add
	// bytes past it SUBACK 0x97 (3.1.1: 0x80); resuming, replacing and
	// removing are always taken. Default 32 MiB (the daemon sets 1/8 of
	// storage.max_bytes).
	MaxSessionBytes int64
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
	if l.MaxClientIDLength <= 0 {
		l.MaxClientIDLength = 256
	}
	if l.MaxFiltersPerSession <= 0 {
		l.MaxFiltersPerSession = 100
	}
	if l.MaxConnectionsPerAddress <= 0 {
		l.MaxConnectionsPerAddress = 64
	}
	if l.MaxConnectionsPerUser <= 0 {
		l.MaxConnectionsPerUser = 64
	}
	if l.MaxRetained <= 0 {
		l.MaxRetained = 10000
	}
	if l.MaxRetainedBytes <= 0 {
		l.MaxRetainedBytes = 32 << 20
	}
	if l.MaxSessions <= 0 {
		l.MaxSessions = 10000
	}
	if l.MaxSessionBytes <= 0 {
		l.MaxSessionBytes = 32 << 20
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

// quietEnd reports the ordinary ways a connection ends: the peer went away.
func quietEnd(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) ||
		(errors.Is(err, os.ErrDeadlineExceeded) && !strings.HasPrefix(err.Error(), "read connection: "))
}

// SourceKey is what the connect rate, and the HTTP API's connection budget,
// are counted by: the IPv4 address, or the /64 of an IPv6 address, which
// one host can fill on its own.
func SourceKey(a net.Addr) string {
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

// LogLimiter lets one log line per key through per interval and counts the
// ones it holds back, so a flood of bad clients or packets costs the
// journal one line a minute each, not one per packet.
type LogLimiter struct {
	every time.Duration
	mu    sync.Mutex // guards seen
	seen  map[string]*logSeen
}

type logSeen struct {
	until      time.Time
	suppressed int
}

const maxLogKeys = 4096

func NewLogLimiter(every time.Duration) *LogLimiter {
	return &LogLimiter{every: every, seen: map[string]*logSeen{}}
}

// Allow reports whether a line with key may be logged now, and how many
// lines with that key were held back since the last one.
func (l *LogLimiter) Allow(key string, now time.Time) (bool, int) {
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

// limitedHandler passes info and warning records through a LogLimiter,
// keyed by message and client (or remote address); debug records, which
// an operator asks for, and errors, which are rare, go through as they are.
type limitedHandler struct {
	slog.Handler
	lim *LogLimiter
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
	ok, held := h.lim.Allow(key, now)
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
