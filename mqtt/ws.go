package mqtt

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"net/http"
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
	// OriginPatterns are the browser origins (host patterns, as
	// path.Match) allowed besides the listener's own host: a page of
	// another origin may not open MQTT connections to a gateway on the
	// user's loopback.
	OriginPatterns []string
}

// wsListener serves MQTT over WebSocket.
type wsListener struct {
	srv    *Server
	lst    *srvListener // its connection set and close
	http   *http.Server
	active sync.WaitGroup // connections being served; added to under lst.mu while not closed
}

// wsListenerID names the WebSocket listener in log lines.
const wsListenerID = "ws"

func newWSListener(s *Server, c *WebSocketConfig) (*wsListener, error) {
	l := &wsListener{srv: s, lst: &srvListener{id: wsListenerID, addr: c.Listen, srv: s}}
	if c.TLS {
		if s.cfg.TLS == nil {
			return nil, errors.New("mqtt: websocket tls needs the tls listener's certificate")
		}
		l.lst.tls = &tls.Config{GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) { return s.tlsConf.Load(), nil }}
	}
	if err := l.lst.listen(); err != nil {
		return nil, err
	}
	opts := &websocket.AcceptOptions{Subprotocols: []string{"mqtt"}, OriginPatterns: c.OriginPatterns}
	l.http = &http.Server{
		ReadHeaderTimeout: s.cfg.Limits.ConnectTimeout,
		MaxHeaderBytes:    16 << 10,
		ErrorLog:          nil,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			l.serveWS(w, r, opts)
		}),
	}
	return l, nil
}

// serveWS upgrades one request and runs its MQTT connection.
func (l *wsListener) serveWS(w http.ResponseWriter, r *http.Request, opts *websocket.AcceptOptions) {
	s := l.srv
	host := sourceKey(addrOf(r.RemoteAddr))
	if s.closing.Load() {
		http.Error(w, "stopping", http.StatusServiceUnavailable)
		return
	}
	if !s.connRate.allow(host, time.Now()) {
		s.refusal(host, "connection rate exceeded: closed before CONNECT", "listener", wsListenerID, "source", host)
		http.Error(w, "connection rate exceeded", http.StatusTooManyRequests)
		return
	}
	if n := s.openConns.Add(1); n > s.maxOpenConns {
		s.openConns.Add(-1)
		s.refusal("", "too many open connections: closed before CONNECT", "listener", wsListenerID, "open", n-1)
		http.Error(w, "busy", http.StatusServiceUnavailable)
		return
	}
	defer s.openConns.Add(-1)
	wc, err := websocket.Accept(w, r, opts)
	if err != nil {
		s.refusal(host, "websocket upgrade refused", "remote", r.RemoteAddr, "error", err)
		return
	}
	if wc.Subprotocol() != "mqtt" {
		wc.Close(websocket.StatusPolicyViolation, "subprotocol mqtt required")
		return
	}
	nc := websocket.NetConn(context.Background(), wc, websocket.MessageBinary)
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
	newConn(s, nc, wsListenerID, host).run(func() { close(ended) })
	<-ended // the hijacked connection is served until it ends
}

func (l *wsListener) serve() {
	if err := l.http.Serve(l.lst.ln); err != nil && !errors.Is(err, http.ErrServerClosed) && !l.lst.closed.Load() {
		l.srv.lines.Error("websocket listener stopped", "error", err)
	}
}

// addrOf parses "host:port" for sourceKey.
func addrOf(s string) net.Addr {
	a, err := net.ResolveTCPAddr("tcp", s)
	if err != nil {
		return &net.TCPAddr{}
	}
	return a
}
