package mqtt

import (
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"golang.org/x/sys/unix"
)

// A plain TCP connection's packets after CONNECT are read by loopRaw, not
// through a bufio.Reader on net.Conn.Read. Read goes to the socket first,
// and a client waiting for its ack has sent nothing more: that read
// returns EAGAIN, the goroutine parks, and reads again once woken, two
// read syscalls per message (strace of W1, issue #36). loopRaw instead
// handles what one read brought while still inside the socket's
// RawConn.Read, and asks it to wait for readability (its func returns
// false) when that read was short, which on a stream socket means it took
// all there was (epoll(7)): one read per wake-up. Inside one RawConn.Read
// the poller's readiness is not reset between the read and the wait, so
// data that came in between wakes the wait at once instead of being
// missed. The buffer a read lands in comes from a pool and goes back when
// the socket is drained: an idle connection holds none.
//
// TLS, WebSocket and anything else that is not a *net.TCPConn keep read
// and its bufio.Reader, as does every CONNECT.

// readBufSize is the pooled buffer one read fills: what a client with a
// window of a hundred small publishes has sent by the time it is read.
const readBufSize = 16 << 10

// readBufs holds the read buffers of connections that are not reading.
var readBufs = sync.Pool{New: func() any { return new([readBufSize]byte) }}

// inBuf is what loopRaw read and has not handled yet. Between wake-ups
// it holds no pooled buffer: a packet cut short by the end of a read
// waits in part (its first bytes, when even its length was cut) or pend
// (its body, once its length is known).
type inBuf struct {
	buf  *[readBufSize]byte // nil while waiting
	r, w int                // buf[r:w] is unread

	part  [4]byte // the start of a fixed header cut short: at most 4 bytes
	nPart int

	pend   []byte // the body of the packet being read, pend[:nPend] read
	nPend  int
	pendHB byte // its first header byte
}

// rawConn returns c's socket for loopRaw, or nil for read's path.
func (c *conn) rawConn() syscall.RawConn {
	tc, ok := c.nc.(*net.TCPConn)
	if !ok || !c.authed {
		return nil
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return nil
	}
	return rc
}

// loopRaw is loop for a plain TCP socket (above). The bytes that CONNECT's
// bufio.Reader read past the CONNECT are handled first; the bufio.Reader
// is dropped.
func (c *conn) loopRaw(rc syscall.RawConn) {
	if n := c.br.Buffered(); n > 0 {
		b, _ := c.br.Peek(n)
		c.in.buf = readBufs.Get().(*[readBufSize]byte)
		c.in.w = copy(c.in.buf[:], b)
	}
	c.br = nil
	var pk packets.Packet
	ka := time.Duration(c.keepalive) * 1500 * time.Millisecond
	var by time.Time
	if ka == 0 {
		_ = c.nc.SetReadDeadline(time.Time{})
	}
	var rerr error // why reading stopped; nil when handling ended it
	// drained: the last read was short, so the socket held no more.
	// Unknown at first: what CONNECT left may not be all.
	drained := false
	err := rc.Read(func(fd uintptr) bool {
		for {
			for {
				ok, err := c.next(&pk)
				if err != nil {
					rerr = err
					return true
				}
				if !ok {
					break
				}
				if c.isEnded() || !c.waitMemory() || !c.handle(&pk) {
					return true
				}
			}
			if drained {
				drained = false
				c.in.park()
				return false // wait for readability, then read
			}
			if !c.readyToRead(ka, &by) {
				return true
			}
			n, asked, err := c.in.fill(int(fd))
			switch {
			case err == syscall.EINTR:
				continue
			case err == syscall.EAGAIN:
				c.in.park()
				return false
			case err != nil:
				rerr = os.NewSyscallError("read", err)
				return true
			case n == 0:
				rerr = io.EOF
				return true
			}
			drained = n < asked
		}
	})
	c.in.drop()
	if rerr == nil {
		rerr = err
	}
	if rerr != nil {
		c.readFailed(rerr)
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

// fill reads once from fd: into the body of the packet being read and the
// buffer after it, or into the buffer. It returns what was read and what
// it asked for: fewer means the socket is drained.
func (in *inBuf) fill(fd int) (n, asked int, err error) {
	if in.buf == nil {
		in.buf = readBufs.Get().(*[readBufSize]byte)
	}
	if in.r > 0 {
		// What is left is the start of a header (next): to the front.
		in.w = copy(in.buf[:], in.buf[in.r:in.w])
		in.r = 0
	}
	if in.nPart > 0 {
		// Only when the buffer was empty (park): it goes in front.
		in.w = copy(in.buf[in.w:], in.part[:in.nPart])
		in.nPart = 0
	}
	if in.pend != nil {
		rest := in.pend[in.nPend:]
		asked = len(rest) + readBufSize - in.w
		n, err = unix.Readv(fd, [][]byte{rest, in.buf[in.w:]})
		if n > 0 {
			k := min(n, len(rest))
			in.nPend += k
			in.w += n - k
		}
		return max(n, 0), asked, err
	}
	asked = readBufSize - in.w
	n, err = syscall.Read(fd, in.buf[in.w:])
	if n > 0 {
		in.w += n
	}
	return max(n, 0), asked, err
}

// park gets in ready to wait: the pooled buffer goes back, a packet cut
// short kept in part or pend. Everything before it has been handled.
func (in *inBuf) park() {
	if in.buf == nil {
		return
	}
	if k := in.w - in.r; k > 0 {
		in.nPart = copy(in.part[:], in.buf[in.r:in.w]) // next left fewer than 5 bytes
	}
	in.r, in.w = 0, 0
	readBufs.Put(in.buf)
	in.buf = nil
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
		if in.nPend < len(in.pend) {
			return false, nil
		}
		body := in.pend
		in.pend, in.nPend = nil, 0
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
	in.r += start + got
	if got < rem {
		in.pend, in.nPend, in.pendHB = body, got, p[0]
		return false, nil
	}
	return true, c.decodeBody(pk, body)
}
