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
	// Limits.ConnectRate allows, and maxRateTelling others were being
	// told so already (or it came on the WebSocket listener).
	refusedRate = "connection rate exceeded: closed before CONNECT"
	// refusedRateTold: the same, told in a CONNACK (0x9F connection rate
	// exceeded; 3.1.1: 0x03 server unavailable) to its CONNECT.
	refusedRateTold = "connection rate exceeded: CONNACK refused"
)

// A connection over the rate limit is read for its CONNECT, to learn the
// protocol version it is to be refused in, for at most rateTellWait, under
// the pre-login packet bound and buffer budget of every CONNECT; at most
// maxRateTelling of them, server-wide, are read at once (each is a socket
// and a goroutine for up to rateTellWait): past that, a flood's are closed
// before anything is read, as a device told once reconnects no faster.
const (
	rateTellWait   = 2 * time.Second
	maxRateTelling = 32
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
// connections over the socket cap before reading a byte, and those over
// the per-address rate at their CONNECT (above), survives accept errors such as running out of file descriptors,
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
	limited := !s.connRate.allow(host, time.Now())
	if limited && s.rateTelling.Add(1) > maxRateTelling {
		s.rateTelling.Add(-1)
		nc.Close()
		s.refusal(host, refusedRate, "listener", l.id, "source", host)
		return
	}
	untell := func() {
		if limited {
			s.rateTelling.Add(-1)
		}
	}
	if n := s.openConns.Add(1); n > s.maxOpenConns {
		s.openConns.Add(-1)
		untell()
		nc.Close()
		s.refusal("", refusedBusy, "listener", l.id, "open", n-1, "source", host)
		return
	}
	l.mu.Lock()
	if l.closed.Load() {
		l.mu.Unlock()
		s.openConns.Add(-1)
		untell()
		nc.Close()
		return
	}
	if l.conns == nil {
		l.conns = map[net.Conn]struct{}{}
	}
	l.conns[nc] = struct{}{}
	l.mu.Unlock()
	s.goFunc(func() {
		c := newConn(s, nc, l.id, host)
		c.rateLimited = limited
		c.run(func() {
			l.mu.Lock()
			delete(l.conns, nc)
			l.mu.Unlock()
			s.openConns.Add(-1)
			untell()
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
