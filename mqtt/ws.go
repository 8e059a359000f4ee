package mqtt

import (
	"context"
	"crypto/tls"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/coder/websocket"
)

// WebSocketConfig configures the MQTT-over-WebSocket listener, for browser
// dashboards: the same sessions, auth, ACLs and limits as the TCP
// listener, each WebSocket binary message carrying MQTT bytes
// (subprotocol "mqtt", any path).
type WebSocketConfig struct {
	// Listen is the listener's host:port.
	Listen string
	// TLS serves wss:// with the TLS listener's certificate; it needs
	// Config.TLS.
	TLS bool
	// OriginPatterns are the browser origins whose pages may connect:
	// "host" (any port), "host:port", "*.example.com", "null" (file://
	// pages). With none, a listener that requires credentials admits
	// every page and an anonymous one the pages of loopback and of the
	// address it is reached at (originPolicy).
	OriginPatterns []string
}

// wsListener serves MQTT over WebSocket. Every socket it accepts counts
// against the server's socket cap from accept until it is closed, as the
// TCP listener's do, and has Limits.ConnectTimeout from accept for its TLS
// handshake and its HTTP upgrade; a request that is not an upgrade, or
// an upgrade refused, gets its answer and the socket is closed: the port
// speaks HTTP only to become a WebSocket, never to keep a connection.
type wsListener struct {
	srv     *Server
	origins *originPolicy
	lst     *srvListener // its connection set and close
	http    *http.Server
	active  sync.WaitGroup // connections being served; added to under lst.mu while not closed
}

// wsListenerID names the WebSocket listener in log lines.
const wsListenerID = "ws"

func newWSListener(s *Server, c *WebSocketConfig) (*wsListener, error) {
	origins, err := newOriginPolicy(c.OriginPatterns)
	if err != nil {
		return nil, err
	}
	l := &wsListener{srv: s, origins: origins, lst: &srvListener{id: wsListenerID, addr: c.Listen, srv: s}}
	if c.TLS {
		if s.cfg.TLS == nil {
			return nil, errors.New("mqtt: websocket tls needs the tls listener's certificate")
		}
		l.lst.tls = &tls.Config{GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) { return s.tlsConf.Load(), nil }}
	}
	ln, err := net.Listen("tcp", c.Listen)
	if err != nil {
		return nil, err
	}
	// Admission sits under TLS: a socket over the cap costs no handshake.
	var outer net.Listener = &wsAdmission{Listener: ln, l: l}
	if l.lst.tls != nil {
		outer = tls.NewListener(outer, l.lst.tls)
	}
	l.lst.ln = outer
	// The origin is checked by l.origins before Accept, which knows
	// whether the listener requires credentials.
	opts := &websocket.AcceptOptions{Subprotocols: []string{"mqtt"}, InsecureSkipVerify: true}
	l.http = &http.Server{
		ReadHeaderTimeout: s.cfg.Limits.ConnectTimeout,
		MaxHeaderBytes:    16 << 10,
		// Refusals are logged as refusals; what net/http has to say
		// (a failed TLS handshake, an accept error) is for debugging.
		ErrorLog: slog.NewLogLogger(s.cfg.Logger.Handler(), slog.LevelDebug),
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			ctx = context.WithValue(ctx, wsServedKey{}, c)
			if tc, ok := c.(*tls.Conn); ok {
				c = tc.NetConn()
			}
			return context.WithValue(ctx, wsSocketKey{}, c)
		},
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			l.serveWS(w, r, opts)
		}),
	}
	// One request per socket: an answer that is not a 101 ends it
	// (Connection: close), so a socket is an upgrade or nothing.
	l.http.SetKeepAlivesEnabled(false)
	return l, nil
}

// serveWS upgrades one request and runs its MQTT connection.
func (l *wsListener) serveWS(w http.ResponseWriter, r *http.Request, opts *websocket.AcceptOptions) {
	s := l.srv
	sock, _ := r.Context().Value(wsSocketKey{}).(*wsSocket)
	served, _ := r.Context().Value(wsServedKey{}).(net.Conn)
	if sock == nil || served == nil {
		http.Error(w, "internal error", http.StatusInternalServerError)
		return
	}
	sock.requested()
	if s.closing.Load() {
		http.Error(w, "stopping", http.StatusServiceUnavailable)
		return
	}
	origin := r.Header.Get("Origin")
	if why := l.origins.refusal(origin, r.Host, !s.access.Load().AllowAnonymous); why != "" {
		s.refusal(sock.host, refusedWSOrigin, "listener", wsListenerID, "remote", r.RemoteAddr, "origin", origin, "why", why)
		http.Error(w, why, http.StatusForbidden)
		return
	}
	wc, err := websocket.Accept(w, r, opts)
	if err != nil {
		s.refusal(sock.host, refusedWSUpgrade, "listener", wsListenerID, "remote", r.RemoteAddr, "error", err)
		return
	}
	sock.upgraded()
	if wc.Subprotocol() != "mqtt" {
		wc.Close(websocket.StatusPolicyViolation, "subprotocol mqtt required")
		return
	}
	nc := &wsConn{Conn: websocket.NetConn(context.Background(), wc, websocket.MessageBinary), sock: served}
	ln := l.lst
	ln.mu.Lock()
	if ln.closed.Load() {
		ln.mu.Unlock()
		nc.Close()
		return
	}
	if ln.conns == nil {
		ln.conns = map[net.Conn]struct{}{}
	}
	ln.conns[nc] = struct{}{}
	l.active.Add(1)
	ln.mu.Unlock()
	defer func() {
		ln.mu.Lock()
		delete(ln.conns, nc)
		ln.mu.Unlock()
		l.active.Done()
	}()
	ended := make(chan struct{})
	newConn(s, nc, wsListenerID, sock.host).run(func() { close(ended) })
	<-ended // the hijacked connection is served until it ends
}

func (l *wsListener) serve() {
	if err := l.http.Serve(l.lst.ln); err != nil && !errors.Is(err, http.ErrServerClosed) && !l.lst.closed.Load() {
		l.srv.lines.Error("websocket listener stopped", "error", err)
	}
}

// wsAdmission is the WebSocket listener's TCP listener: it refuses a
// socket over its source's connect rate or over the server's socket cap
// before reading a byte, as srvListener.admit does, and wraps the rest.
type wsAdmission struct {
	net.Listener
	l *wsListener
}

// Accept returns the next socket admitted; refused ones are closed on the
// way, so net/http never sees them.
func (a *wsAdmission) Accept() (net.Conn, error) {
	for {
		nc, err := a.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if c := a.admit(nc); c != nil {
			return c, nil
		}
	}
}

// admit counts nc in the socket cap and gives it its handshake deadline,
// or closes it and returns nil.
func (a *wsAdmission) admit(nc net.Conn) net.Conn {
	s := a.l.srv
	host := SourceKey(nc.RemoteAddr())
	if !s.connRate.allow(host, time.Now()) {
		nc.Close()
		s.refusal(host, refusedRate, "listener", wsListenerID, "source", host)
		return nil
	}
	if n := s.openConns.Add(1); n > s.maxOpenConns {
		s.openConns.Add(-1)
		nc.Close()
		s.refusal("", refusedBusy, "listener", wsListenerID, "open", n-1, "source", host)
		return nil
	}
	c := &wsSocket{Conn: nc, srv: s, host: host, handshake: time.Now().Add(s.cfg.Limits.ConnectTimeout)}
	_ = nc.SetDeadline(c.handshake)
	return c
}

// wsServedKey is the request context key of the net.Conn net/http serves
// a request on (the *wsSocket, or the *tls.Conn over it): the one an
// upgrade hijacks.
type wsServedKey struct{}

// wsConn is an MQTT connection over a WebSocket: its bytes are the binary
// messages of a websocket.Conn, its deadlines are set on the socket under
// it. The library's own net.Conn adapter closes the connection at once,
// with no close frame and over the client's unread data, when a read
// deadline passes during a read, and the server ends a connection by
// such a deadline once its DISCONNECT is written: the DISCONNECT could
// be lost (a page saw 0x8B in 1 of 3 restarts, issue 35). On the socket,
// a deadline only fails the read.
type wsConn struct {
	net.Conn          // websocket.NetConn: messages in and out, Close
	sock     net.Conn // the hijacked socket
}

// SetDeadline sets both deadlines on the socket.
func (c *wsConn) SetDeadline(t time.Time) error { return c.sock.SetDeadline(t) }

// SetReadDeadline sets the read deadline on the socket.
func (c *wsConn) SetReadDeadline(t time.Time) error { return c.sock.SetReadDeadline(t) }

// SetWriteDeadline sets the write deadline on the socket.
func (c *wsConn) SetWriteDeadline(t time.Time) error { return c.sock.SetWriteDeadline(t) }

// RemoteAddr is the client's address, for log lines.
func (c *wsConn) RemoteAddr() net.Addr { return c.sock.RemoteAddr() }

// LocalAddr is the listener's address.
func (c *wsConn) LocalAddr() net.Addr { return c.sock.LocalAddr() }

// Close is conn.linger over WebSocket: a close frame after whatever was
// written (the DISCONNECT), then what the client still sends is read and
// dropped until its close frame comes or lingerFor passes, and the socket
// closes.
func (c *wsConn) Close() error {
	_ = c.sock.SetDeadline(time.Now().Add(lingerFor))
	return c.Conn.Close()
}

// wsSocketKey is the request context key of the *wsSocket a request
// came on.
type wsSocketKey struct{}

// wsSocket is one socket of the WebSocket listener. It holds its place in
// the server's socket count until it is closed, and until its upgrade no
// deadline set on it (net/http sets several) reaches past the handshake
// deadline: a socket that does not become a WebSocket within
// Limits.ConnectTimeout of its accept is closed.
type wsSocket struct {
	net.Conn
	srv  *Server
	host string // sourceKey of the remote address

	mu sync.Mutex // guards the fields below
	// handshake is the deadline of the TLS handshake and the upgrade;
	// zero once upgraded.
	handshake time.Time
	asked     bool // a request was read whole
	timedOut  bool // a read hit the handshake deadline
	closed    bool
}

// Read notes a read that ran into the handshake deadline, for the
// refusal Close reports.
func (c *wsSocket) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if err != nil && errors.Is(err, os.ErrDeadlineExceeded) {
		c.mu.Lock()
		c.timedOut = c.timedOut || !c.handshake.IsZero()
		c.mu.Unlock()
	}
	return n, err
}

// SetDeadline sets both deadlines, no later than the handshake's.
func (c *wsSocket) SetDeadline(t time.Time) error { return c.Conn.SetDeadline(c.clamp(t)) }

// SetReadDeadline sets the read deadline, no later than the handshake's.
func (c *wsSocket) SetReadDeadline(t time.Time) error { return c.Conn.SetReadDeadline(c.clamp(t)) }

// SetWriteDeadline sets the write deadline, no later than the handshake's.
func (c *wsSocket) SetWriteDeadline(t time.Time) error { return c.Conn.SetWriteDeadline(c.clamp(t)) }

func (c *wsSocket) clamp(t time.Time) time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	if hs := c.handshake; !hs.IsZero() && (t.IsZero() || t.After(hs)) {
		return hs
	}
	return t
}

// CloseWrite lets net/http half-close the socket after a refusal, so the
// client reads the answer before the close instead of a reset.
func (c *wsSocket) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// requested notes that a whole request came in time.
func (c *wsSocket) requested() {
	c.mu.Lock()
	c.asked = true
	c.mu.Unlock()
}

// upgraded lifts the handshake deadline: from here the MQTT connection
// keeps its own (the CONNECT's, then the keep-alive's) on the WebSocket.
func (c *wsSocket) upgraded() {
	c.mu.Lock()
	c.handshake = time.Time{}
	c.mu.Unlock()
	_ = c.Conn.SetDeadline(time.Time{})
}

// Close closes the socket and frees its place in the socket count, once.
func (c *wsSocket) Close() error {
	err := c.Conn.Close()
	c.mu.Lock()
	first := !c.closed
	c.closed = true
	timedOut := c.timedOut && !c.asked
	c.mu.Unlock()
	if first {
		c.srv.openConns.Add(-1)
		if timedOut {
			c.srv.refusal(c.host, refusedWSTimeout, "listener", wsListenerID, "remote", c.RemoteAddr().String(),
				"timeout", c.srv.cfg.Limits.ConnectTimeout)
		}
	}
	return err
}
