//go:build linux

package mqtt

import (
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// idler holds the parked connections of a Server (Server.parking).
type idler struct {
	srv *Server
	ep  int // the epoll instance
	efd int // an eventfd in ep, written at Stop: the idler ends

	mu      sync.Mutex // guards byFD, closed, ep's closing and every conn's parkedFD
	byFD    map[int32]*conn
	closed  bool
	stopped sync.Cond // on mu: ep is closed (-1)
}

// parking returns s's idler, started on first use; nil when parking is
// off (parkIdle), the server is stopping or epoll is not to be had (the connection then waits in Go's
// poller, as any other).
func (s *Server) parking() *idler {
	if !s.parkIdle.Load() {
		return nil
	}
	s.idleOnce.Do(func() {
		if s.closing.Load() {
			return
		}
		ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
		if err != nil {
			return
		}
		efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
		if err != nil {
			unix.Close(ep)
			return
		}
		ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(efd)}
		if unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, efd, &ev) != nil {
			unix.Close(ep)
			unix.Close(efd)
			return
		}
		d := &idler{srv: s, ep: ep, efd: efd, byFD: map[int32]*conn{}}
		d.stopped.L = &d.mu
		s.goFunc(d.run)
		s.goFunc(func() {
			<-s.stopc
			_, _ = unix.Write(efd, []byte{1, 0, 0, 0, 0, 0, 0, 0})
			d.mu.Lock()
			for d.ep >= 0 {
				d.stopped.Wait() // run closes ep, then efd may go
			}
			d.mu.Unlock()
			unix.Close(efd)
		})
		s.idle.Store(d)
	})
	return s.idle.Load()
}

// run waits for parked sockets to become readable, and wakes their
// connections, until Stop.
func (d *idler) run() {
	defer func() {
		d.mu.Lock()
		d.closed = true
		parked := make([]*conn, 0, len(d.byFD))
		for _, c := range d.byFD {
			parked = append(parked, c)
		}
		d.mu.Unlock()
		for _, c := range parked {
			d.unpark(c) // Stop ends them all; none is to stay
		}
		d.mu.Lock()
		unix.Close(d.ep)
		d.ep = -1
		d.stopped.Broadcast()
		d.mu.Unlock()
	}()
	var evs [128]unix.EpollEvent
	for {
		n, err := unix.EpollWait(d.ep, evs[:], -1)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			d.srv.lines.Error("waiting for idle connections failed", "error", err)
			return
		}
		for _, ev := range evs[:n] {
			if ev.Fd == int32(d.efd) {
				return
			}
			d.mu.Lock()
			c := d.byFD[ev.Fd]
			d.mu.Unlock()
			if c != nil {
				d.unpark(c)
			}
		}
	}
}

// park registers c's socket fd, its read loop's goroutine about to end:
// false when it may not park (the idler is closed, c has ended, epoll
// refused), and the loop goes on waiting in Go's poller. by is the read
// deadline (zero for none), when a timer wakes it.
func (d *idler) park(c *conn, fd int, by time.Time) bool {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return false
	}
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLRDHUP | unix.EPOLLONESHOT, Fd: int32(fd)}
	if err := unix.EpollCtl(d.ep, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
		if err != unix.EEXIST || unix.EpollCtl(d.ep, unix.EPOLL_CTL_MOD, fd, &ev) != nil {
			d.mu.Unlock()
			return false
		}
	}
	c.parkedFD = int32(fd) + 1
	d.byFD[int32(fd)] = c
	if !by.IsZero() {
		l := c.rl
		if l.timer == nil {
			l.timer = time.AfterFunc(time.Until(by), func() { d.unpark(c) })
		} else {
			l.timer.Reset(time.Until(by))
		}
	}
	d.mu.Unlock()
	// c.end marks the end, then unparks: an end that unparked before c
	// was parked is seen here (checked outside mu: end may be called
	// with c's locks held, which isEnded takes).
	if c.isEnded() {
		d.unpark(c)
	}
	return true
}

// unpark starts c's read loop again if it is parked. The wake-ups are
// the socket's readability, the read deadline's timer and c.end.
func (d *idler) unpark(c *conn) {
	d.mu.Lock()
	if c.parkedFD == 0 {
		d.mu.Unlock()
		return
	}
	fd := c.parkedFD - 1
	c.parkedFD = 0
	delete(d.byFD, fd)
	_ = unix.EpollCtl(d.ep, unix.EPOLL_CTL_DEL, int(fd), nil)
	if t := c.rl.timer; t != nil {
		t.Stop()
	}
	d.mu.Unlock()
	d.srv.goFunc(c.serveRaw)
}
