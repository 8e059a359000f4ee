package testutil

import (
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Relay is a TCP relay on loopback to one address, for tests of slow and
// stalled links: each chunk it reads is written on a delay later
// (SetDelay), both ways, or swallowed while the relay is frozen
// (SetFrozen: the connections stay open, nothing passes). Its goroutines
// end, and its connections close, when the test ends.
type Relay struct {
	// Addr is where to dial the target through the relay.
	Addr string

	delay  atomic.Int64 // one way, nanoseconds
	frozen atomic.Bool

	mu    sync.Mutex // guards conns
	conns []net.Conn
}

// NewRelay starts a relay to target, with no delay.
func NewRelay(t testing.TB, target string) *Relay {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &Relay{Addr: ln.Addr().String()}
	var wg sync.WaitGroup
	t.Cleanup(func() {
		ln.Close()
		r.mu.Lock()
		for _, c := range r.conns {
			c.Close()
		}
		r.mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			in, err := ln.Accept()
			if err != nil {
				return
			}
			out, err := net.Dial("tcp", target)
			if err != nil {
				in.Close()
				continue
			}
			r.mu.Lock()
			r.conns = append(r.conns, in, out)
			r.mu.Unlock()
			wg.Add(2)
			go func() { defer wg.Done(); r.pipe(&wg, in, out) }()
			go func() { defer wg.Done(); r.pipe(&wg, out, in) }()
		}
	}()
	return r
}

// SetDelay sets the one-way delay, for chunks read from then on.
func (r *Relay) SetDelay(d time.Duration) { r.delay.Store(int64(d)) }

// SetFrozen stops (true) or resumes passing bytes: what arrives while
// frozen is lost.
func (r *Relay) SetFrozen(v bool) { r.frozen.Store(v) }

// pipe copies src to dst, each chunk its delay after it was read; a
// writer of its own keeps a delay from holding up the reads behind it.
func (r *Relay) pipe(wg *sync.WaitGroup, src, dst net.Conn) {
	type chunk struct {
		due time.Time
		b   []byte
	}
	q := make(chan chunk, 1024)
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer dst.Close()
		for c := range q {
			time.Sleep(time.Until(c.due)) // the link's delay, not a synchronisation
			if _, err := dst.Write(c.b); err != nil {
				src.Close()
				for range q {
				}
				return
			}
		}
	}()
	defer close(q)
	for {
		b := make([]byte, 32<<10)
		n, err := src.Read(b)
		if n > 0 && !r.frozen.Load() {
			q <- chunk{time.Now().Add(time.Duration(r.delay.Load())), b[:n]}
		}
		if err != nil {
			return
		}
	}
}
