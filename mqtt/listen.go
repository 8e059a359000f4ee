package mqtt

import (
	"crypto/tls"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Reasons of the listeners' refusals of a socket (Observer.Refused).
const (
	// refusedRate: the source opened connections faster than
	// Limits.ConnectRate allows.
	refusedRate = "connection rate exceeded: closed before CONNECT"
	// refusedBusy: the server's socket cap, twice Limits.MaxClients
	// and some, is reached: the sockets of every listener count, those
	// not yet a client included.
	refusedBusy = "too many open connections: closed before CONNECT"
	// refusedWSUpgrade: a request on the WebSocket port that is not an
	// acceptable upgrade (a plain GET, another origin, no key).
	refusedWSUpgrade = "websocket upgrade refused"
	// refusedWSTimeout: a WebSocket socket that did not finish its TLS
	// handshake and upgrade within Limits.ConnectTimeout of its accept.
	refusedWSTimeout = "websocket handshake timed out"
)

// srvListener is one TCP or TLS listener of a Server: it refuses
// connections over the per-address rate and the socket cap before reading
// a byte, survives accept errors such as running out of file descriptors,
// and hands each admitted connection to its own read loop.
type srvListener struct {
	id, addr string
	tls      *tls.Config // nil: plain TCP
	srv      *Server
	ln       net.Listener
	closed   atomic.Bool

	mu    sync.Mutex            // guards conns
	conns map[net.Conn]struct{} // accepted and not yet ended
}

func (l *srvListener) listen() error {
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

func (l *srvListener) address() string {
	if l.ln != nil {
		return l.ln.Addr().String()
	}
	return l.addr
}

// serve accepts connections until close.
func (l *srvListener) serve() {
	var delay time.Duration
	for {
		nc, err := l.ln.Accept()
		if err != nil {
			if l.closed.Load() || errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of file descriptors and the like: back off and go
			// on, as net/http does.
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			l.srv.refusal("", "accept failed", "listener", l.id, "error", err)
			select {
			case <-time.After(delay):
			case <-l.srv.stopc:
				return
			}
			continue
		}
		delay = 0
		l.admit(nc)
	}
}

// admit refuses nc or starts its connection.
func (l *srvListener) admit(nc net.Conn) {
	s := l.srv
	host := SourceKey(nc.RemoteAddr())
	if !s.connRate.allow(host, time.Now()) {
		nc.Close()
		s.refusal(host, refusedRate, "listener", l.id, "source", host)
		return
	}
	if n := s.openConns.Add(1); n > s.maxOpenConns {
		s.openConns.Add(-1)
		nc.Close()
		s.refusal("", refusedBusy, "listener", l.id, "open", n-1, "source", host)
		return
	}
	l.mu.Lock()
	if l.closed.Load() {
		l.mu.Unlock()
		s.openConns.Add(-1)
		nc.Close()
		return
	}
	if l.conns == nil {
		l.conns = map[net.Conn]struct{}{}
	}
	l.conns[nc] = struct{}{}
	l.mu.Unlock()
	s.goFunc(func() {
		newConn(s, nc, l.id, host).run(func() {
			l.mu.Lock()
			delete(l.conns, nc)
			l.mu.Unlock()
			s.openConns.Add(-1)
		})
	})
}

// stopAccepting closes the listening socket.
func (l *srvListener) stopAccepting() {
	l.mu.Lock()
	was := l.closed.Swap(true)
	l.mu.Unlock()
	if !was && l.ln != nil {
		l.ln.Close()
	}
}

// close stops accepting and ends the connections still open: Server.Stop
// first ends those with a session, in order, with a DISCONNECT.
func (l *srvListener) close() {
	l.stopAccepting()
	l.mu.Lock()
	defer l.mu.Unlock()
	for nc := range l.conns {
		// Sessions' connections are ended in order by Stop; a deadline
		// in the past unblocks the rest.
		_ = nc.SetReadDeadline(time.Now())
	}
}
