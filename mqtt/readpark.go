package mqtt

import (
	"sync"
	"sync/atomic"
	"time"
)

// An idle plain TCP connection waits without a goroutine (on Linux). A
// goroutine parked in Go's poller keeps its stack, 2 KiB at least: close
// to half of what an idle connection held once its read buffer was
// pooled. So a read loop that finds nothing to read, after
// going longer than idleAfter without anything (or right after CONNECT),
// hands its socket to the server's idler and its goroutine ends. The
// idler is one goroutine on an epoll instance of its own, where the
// socket is registered one-shot for readability; data, a hang-up, the
// keep alive deadline (a timer) or an end of the connection (end, Stop)
// starts a read loop again, on a new goroutine. A connection busier than
// idleAfter never parks: a park and wake-up cost two epoll_ctl calls, a
// timer and a goroutine.
const idleAfter = time.Second

// unpark wakes c's read loop if it is parked (c.end).
func (c *conn) unpark() {
	if d := c.srv.idle.Load(); d != nil {
		d.unpark(c)
	}
}

// idleSlot is what Server keeps of its idler.
type idleSlot struct {
	idleOnce sync.Once
	idle     atomic.Pointer[idler]
	// parkIdle switches parking on; NewServer does. It was off for a
	// while: under load a read loop that the idler had woken was seen
	// waiting in Go's poller for a socket whose client had closed it (the
	// daemon's TestClientChaos in race runs, about one in two). The cause
	// was the read loop's, not the idler's: it took a short read for a
	// drained socket, and a packet and the FIN that came with it were one
	// edge of Go's poller (readraw.go), parked or not.
	parkIdle atomic.Bool
	// rawReads and inlineWrites switch on the read loop in RawConn.Read
	// (one read syscall a message, readraw.go) and the writing of acks by
	// the goroutine that resolves them (kickHere). NewServer switches
	// both on. They were off for a while: CI's race pass had a subscriber
	// wait past 5 s for a QoS 0 delivery (TestMQTT_3_3_4_3) with both on,
	// taken for a lost wake-up; it was a SUBACK written before the
	// session recorded what the subscription owed (owe), which these
	// paths made likelier and the writer goroutine allowed too. Off, a
	// connection reads through a bufio.Reader and every write is its
	// writer goroutine's, as the releases before did.
	rawReads, inlineWrites atomic.Bool
}
