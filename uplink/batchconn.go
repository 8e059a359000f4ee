package uplink

import (
	"bufio"
	"net"
	"sync"
	"time"
)

// batchConn coalesces writes (and buffers reads): paho writes each packet with a syscall of
// its own, which at thousands of messages a second was half the gateway's
// CPU (a profile of 50 devices forwarding to a local broker). Write
// appends to a buffer and a flusher goroutine writes what has gathered in
// one syscall, so packets written while a write is under way go out
// together. Order is kept. A write error is returned by the next Write
// and ends the connection (it is closed, so paho's reader sees it too).
// Safe for concurrent use: it also serves as paho's thread-safe conn.
//
// Its Lock and Unlock (sync.Locker) are what paho.golang looks for to hold
// one packet's writes together: it writes a packet as a header and a body,
// each a Write of its own, and a PUBACK sent while a SUBSCRIBE is written
// would otherwise land between them (the cloud then ends the connection
// for a malformed packet).
type batchConn struct {
	net.Conn
	r       *bufio.Reader // paho reads a packet in small pieces; one reader
	packet  sync.Mutex    // held over the writes of one packet (Lock)
	mu      sync.Mutex
	cond    *sync.Cond
	buf     []byte // what waits to be written
	spare   []byte // the buffer the flusher wrote last, reused
	err     error  // the first write error; then every Write fails
	closing bool
	done    chan struct{} // the flusher has ended
}

// maxBatch bounds the bytes buffered: Write waits while more than this is
// pending, so a stalled link holds back the sender instead of memory.
const maxBatch = 256 << 10

func newBatchConn(c net.Conn) *batchConn {
	b := &batchConn{Conn: c, r: bufio.NewReaderSize(c, 16<<10), done: make(chan struct{})}
	b.cond = sync.NewCond(&b.mu)
	go b.flusher()
	return b
}

// Read reads through a buffer: the acks of a window come in one segment.
// paho reads from one goroutine only.
func (b *batchConn) Read(p []byte) (int, error) { return b.r.Read(p) }

// Lock holds the writes of one packet together (see batchConn).
func (b *batchConn) Lock() { b.packet.Lock() }

// Unlock lets the next packet's writes in.
func (b *batchConn) Unlock() { b.packet.Unlock() }

// Write queues p for the flusher.
func (b *batchConn) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for len(b.buf) > maxBatch && b.err == nil && !b.closing {
		b.cond.Wait()
	}
	if b.err != nil {
		return 0, b.err
	}
	if b.closing {
		return 0, net.ErrClosed
	}
	b.buf = append(b.buf, p...)
	b.cond.Broadcast()
	return len(p), nil
}

// flusher writes what Write queued until Close.
func (b *batchConn) flusher() {
	defer close(b.done)
	b.mu.Lock()
	defer b.mu.Unlock()
	for {
		for len(b.buf) == 0 && !b.closing {
			b.cond.Wait()
		}
		if len(b.buf) == 0 || b.err != nil {
			return // closing with nothing left, or the link is broken
		}
		out := b.buf
		b.buf = b.spare[:0]
		b.mu.Unlock()
		_, err := b.Conn.Write(out)
		b.mu.Lock()
		b.spare = out
		if err != nil {
			b.err = err
			b.cond.Broadcast()
			b.Conn.Close()
			return
		}
		b.cond.Broadcast()
	}
}

// closeWait is how long Close lets the flusher write what is queued (a
// DISCONNECT, say) before it closes the connection under it: a stalled
// link must not hold up a Stop.
const closeWait = time.Second

// Close writes what is queued, within closeWait, ends the flusher and
// closes the connection.
func (b *batchConn) Close() error {
	b.mu.Lock()
	b.closing = true
	b.cond.Broadcast()
	b.mu.Unlock()
	t := time.NewTimer(closeWait)
	defer t.Stop()
	select {
	case <-b.done:
	case <-t.C:
		b.Conn.Close() // the write under way fails, the flusher ends
		<-b.done
	}
	return b.Conn.Close()
}
