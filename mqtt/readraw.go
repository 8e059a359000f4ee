package mqtt

import (
	"bufio"
	"errors"
	"io"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
)

// A plain TCP connection's packets after CONNECT are read by loopRaw, not
// through a bufio.Reader on net.Conn.Read. Read goes to the socket first,
// and a client waiting for its ack has sent nothing more: that read
// returns EAGAIN, the goroutine parks, and reads again once woken, two
// read syscalls per message (strace of W1, issue #36). loopRaw handles
// what one read brought while still inside the socket's RawConn.Read, and
// asks it to wait for readability (its func returns false) once a read
// finds nothing (EAGAIN). Inside one RawConn.Read the poller's readiness
// is not reset between the read and the wait, so data that came in
// between wakes the wait at once instead of being missed. The buffer a
// read lands in comes from a pool and goes back when the socket is
// drained: an idle connection holds none, nor a bufio.Reader.
//
// A short read is not taken for drained, though it saves the read that
// finds nothing (one read syscall per message instead of two): a client's
// last packet and its FIN, arriving together, reach Go's edge-triggered
// poller as one edge, which the wake-up for the packet consumed; waiting
// after the short read that brought it waited for an edge that had come
// and gone, and a closed connection stayed until its keep alive ran out
// (TestWaitingConnectionSendingAndClosingAtOnceGoesOffline: in the first
// of ten rounds of 40). Only the read that finds nothing, or the end,
// says what the socket holds.
//
// TLS, WebSocket and anything else that is not a *net.TCPConn keep read
// and its bufio.Reader, as does every CONNECT, and every system but Linux
// (readraw_other.go).

// readBufSize is the pooled buffer one read fills: what a client with a
// window of a hundred small publishes has sent by the time it is read.
const readBufSize = 16 << 10

// Pools of what a connection needs only while it reads: the buffer a read
// fills, the Packet decoded into, and CONNECT's bufio.Reader (newConn).
var (
	readBufs   = sync.Pool{New: func() any { return new([readBufSize]byte) }}
	packetPool = sync.Pool{New: func() any { return new(packets.Packet) }}
	readers    = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 1024) }}
)

// inBuf is what loopRaw read and has not handled yet. Between wake-ups
// it holds no pooled buffer: a packet cut short by the end of a read
// waits in part (its first bytes, when even its length was cut) or pend
// (its body, once its length is known). It is part of every conn, so it
// is kept small.
type inBuf struct {
	buf  *[readBufSize]byte // nil while waiting
	r, w int32              // buf[r:w] is unread

	part   [4]byte // the start of a fixed header cut short: at most 4 bytes
	nPart  uint8
	pendHB byte // the first header byte of pend's packet

	// pend is the body of the packet being read, as far as it has come:
	// its full length is cap(pend).
	pend []byte
}

// rawLoop is loopRaw's state, kept across parks (readpark.go), which its
// func passed to RawConn.Read shares with it (and so is on the heap: kept
// small, the Packet pooled).
type rawLoop struct {
	c     *conn
	rc    syscall.RawConn
	ended func()        // run's, once the connection has ended
	ka    time.Duration // one and a half keep alives; 0: no deadline
	by    time.Time     // the read deadline set last
	pk    *packets.Packet
	rerr  error // why reading stopped; nil when handling ended it

	// Parking (readpark.go): lastData is when a read last brought
	// something, gap the time before it, which predicts the next.
	lastData time.Time
	gap      time.Duration
	wantPark bool // step stopped to park on fd
	fd       int
	resumed  bool        // the loop has run before: this is a wake-up
	noPark   bool        // the idler refused: wait in Go's poller from now on
	timer    *time.Timer // the idler's, for the read deadline; guarded by its mu
}

// leaveReader moves what CONNECT's bufio.Reader read past the CONNECT into
// the connection's inBuf, for loopRaw to handle first, and gives the
// reader back. It runs on the goroutine that read the CONNECT: on loopRaw's,
// a pool's slow path grew every idle connection's stack from 2 to 4 KiB.
func (c *conn) leaveReader() {
	if n := c.br.Buffered(); n > 0 {
		b, _ := c.br.Peek(n)
		c.in.buf = readBufs.Get().(*[readBufSize]byte)
		c.in.w = int32(copy(c.in.buf[:], b))
	}
	c.br.Reset(nil)
	readers.Put(c.br)
	c.br = nil
}

// startRaw starts loopRaw on rc: leaveReader, then a goroutine; ended is
// run's.
func (c *conn) startRaw(rc syscall.RawConn, ended func()) {
	c.leaveReader()
	c.rl = &rawLoop{c: c, rc: rc, ended: ended, ka: time.Duration(c.keepalive) * 1500 * time.Millisecond, gap: idleAfter + 1}
	c.srv.goFunc(c.serveRaw)
}

// serveRaw runs loopRaw, and finishes the connection unless it parked;
// the idler runs it again on a wake-up.
func (c *conn) serveRaw() {
	if c.loopRaw() {
		return
	}
	c.finish()
	c.rl.ended()
}

// loopRaw is loop for a plain TCP socket (above), once leaveReader ran:
// true when it parked.
func (c *conn) loopRaw() bool {
	l := c.rl
	switch {
	case !l.resumed:
		l.resumed = true
		if l.ka == 0 {
			_ = c.nc.SetReadDeadline(time.Time{})
		}
	case l.ka > 0 && !time.Now().Before(l.by):
		// Woken by the deadline's timer (or at it): the keep alive
		// passed, whether or not Go's poller has marked it yet.
		l.rerr = os.ErrDeadlineExceeded
	}
	var err error
	for l.rerr == nil {
		err = l.rc.Read(l.step)
		if !l.wantPark {
			break
		}
		l.wantPark = false
		if d := c.srv.parking(); d != nil && d.park(c, l.fd, l.by) {
			return true
		}
		l.noPark = true
	}
	c.in.drop()
	l.parkPacket()
	if l.rerr == nil {
		l.rerr = err
	}
	if l.rerr != nil {
		c.readFailed(l.rerr)
	}
	return false
}

// idle says what step does when the socket has nothing: wait in Go's
// poller (false), or stop to park (true) when the wait before the last
// data was longer than idleAfter, as is the first after CONNECT.
func (l *rawLoop) idle(fd uintptr) bool {
	if l.noPark || l.gap <= idleAfter {
		return false
	}
	l.wantPark, l.fd = true, int(fd)
	return true
}

// step is loopRaw's func for RawConn.Read: it handles what is buffered,
// then reads, until a read finds nothing (false: wait for readability)
// or the connection is to end (true).
func (l *rawLoop) step(fd uintptr) bool {
	c := l.c
	for {
		for c.in.buffered() {
			if l.pk == nil {
				l.pk = packetPool.Get().(*packets.Packet)
			}
			ok, err := c.next(l.pk)
			if err != nil {
				l.rerr = err
				return true
			}
			if !ok {
				break
			}
			if c.isEnded() || !c.waitMemory() || !c.handle(l.pk) {
				return true
			}
		}
		if !c.readyToRead(l.ka, &l.by) {
			return true
		}
		n, err := c.in.fill(int(fd))
		switch {
		case err == syscall.EINTR:
			continue
		case err == syscall.EAGAIN:
			l.park()
			return l.idle(fd)
		case err != nil:
			l.rerr = os.NewSyscallError("read", err)
			return true
		case n == 0:
			l.rerr = io.EOF
			return true
		}
		now := time.Now()
		l.gap, l.lastData = now.Sub(l.lastData), now
	}
}

// park gives back what the loop holds only while it reads.
func (l *rawLoop) park() {
	l.c.in.park()
	l.parkPacket()
}

func (l *rawLoop) parkPacket() {
	if l.pk != nil {
		*l.pk = packets.Packet{} // nothing of a client's kept in the pool
		packetPool.Put(l.pk)
		l.pk = nil
	}
}

// readyToRead moves the read deadline when it falls short of one and a
// half keep alives (ka; 0: none), then reports whether the connection may
// be read: it has not ended and is within its memory.
//
// [MQTT-3.1.2-24]: one and a half times the keep alive, and up to
// deadlineSlack more: the deadline is moved only when it falls short of
// that (setting it is a timer's update, too much for every packet). It is
// checked for an end after the deadline is set: an end that came meanwhile
// set its own deadline before or after this one, and ended before it. (A
// deadline set by someone else, the end's, is never moved.)
func (c *conn) readyToRead(ka time.Duration, by *time.Time) bool {
	if ka > 0 {
		if now := time.Now(); by.Before(now.Add(ka)) {
			*by = now.Add(ka + deadlineSlack(ka))
			_ = c.nc.SetReadDeadline(*by)
		}
	}
	return !c.isEnded() && c.waitMemory()
}

// park gets in ready to wait: the pooled buffer goes back, a packet cut
// short kept in part or pend. Everything before it has been handled.
func (in *inBuf) park() {
	if in.buf == nil {
		return
	}
	if in.w > in.r {
		in.nPart = uint8(copy(in.part[:], in.buf[in.r:in.w])) // next left fewer than 5 bytes
	}
	in.r, in.w = 0, 0
	readBufs.Put(in.buf)
	in.buf = nil
}

// buffered reports whether next may find a packet.
func (in *inBuf) buffered() bool {
	if in.pend != nil {
		return len(in.pend) == cap(in.pend)
	}
	return in.buf != nil && in.r < in.w
}

// drop gives the buffer back when reading has stopped.
func (in *inBuf) drop() {
	if in.buf != nil {
		readBufs.Put(in.buf)
		in.buf = nil
	}
	in.pend = nil
}

// errLengthTooLong: a Remaining Length of more than four bytes.
var errLengthTooLong = errors.New("remaining length longer than 4 bytes")

// next decodes the next whole packet read into pk: false when there is
// none yet. A packet whose body is not all in the buffer moves to pend,
// allocated at its full length (within the packet size limit), and the
// reads that follow go into it.
func (c *conn) next(pk *packets.Packet) (bool, error) {
	in := &c.in
	if in.pend != nil {
		if len(in.pend) < cap(in.pend) {
			return false, nil
		}
		body := in.pend
		in.pend = nil
		*pk = packets.Packet{}
		if err := c.header(pk, in.pendHB, len(body), 0); err != nil {
			return false, err
		}
		return true, c.decodeBody(pk, body)
	}
	b := in.buf
	if b == nil || in.r == in.w {
		return false, nil
	}
	p := b[in.r:in.w]
	// The Remaining Length: a variable byte integer of at most 4 bytes
	// (section 1.5.5).
	rem, lenBytes := 0, 0
	for i := 1; ; i++ {
		if i > 4 {
			return false, errProtocol{code: packets.ErrMalformedPacket, why: errLengthTooLong.Error()}
		}
		if i >= len(p) {
			return false, nil // cut short: park keeps it in part
		}
		rem |= int(p[i]&127) << (7 * (i - 1))
		if p[i]&128 == 0 {
			lenBytes = i
			break
		}
	}
	*pk = packets.Packet{}
	if err := c.header(pk, p[0], rem, lenBytes); err != nil {
		return false, err
	}
	start := 1 + lenBytes
	body := make([]byte, rem)
	got := copy(body, p[start:])
	in.r += int32(start + got)
	if got < rem {
		in.pend, in.pendHB = body[:got], p[0]
		return false, nil
	}
	return true, c.decodeBody(pk, body)
}
