package netns

import (
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"os"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Slow links. The kernel here has no netem (FACTS.md), so a delay is made
// in user space: a TCP relay in each host's namespace, which an iptables
// REDIRECT rule puts in the path of every new connection the host opens to
// the other host's port. The relay holds each chunk it reads for the
// link's delay before writing it on, in both directions, so a relayed
// connection sees that delay one way and twice it as its round trip. The
// client's connect completes at once (the kernel accepts it locally), so
// what it sends is held back one more round trip, as the TCP handshake
// over the slow wire would have cost. Its own connections carry a firewall
// mark the rule skips.
//
// Loss on such a link is what the relay makes of it too (Link.SetLoss):
// the real link under the relay has no delay, so a segment lost there is
// resent within a millisecond or two. On a link with the delay on the wire
// a loss stalls the connection: the duplicate acks take a round trip to
// come back and the resend half of one more, about 1.5 round trips during
// which nothing behind it is delivered (a resend lost too waits for a
// retransmission timeout). The relay holds chunks back that way. Net.Loss
// drops packets on the real link, for the cheap kind.
//
// Only connections opened after Relay go through it: set it up before the
// processes start dialling.

// relayMark marks the relay's own connections, which the REDIRECT rule
// must not catch again.
const relayMark = 0x2424

// Link is the pair of relays between two hosts for one port.
type Link struct {
	net   *Net
	delay atomic.Int64  // nanoseconds, one way
	loss  atomic.Uint64 // math.Float64bits of the loss rate per packet
	// dropReplies loses what a server sends in the last moment before it
	// closes (the answer of a one-shot request, such as a knock), and the
	// close with it: the client waits for an answer that never comes.
	dropReplies atomic.Bool

	relays []*relay
	once   sync.Once
}

// replyHold is how long the relay holds a server's chunk while it drops
// replies, to see whether the server closes right after it.
const replyHold = 100 * time.Millisecond

// relay carries one host's connections to one address.
type relay struct {
	link   *Link
	from   *Host
	target string // host:port the connections were for
	ln     net.Listener
	rule   []string // the iptables arguments after -A/-D

	mu    sync.Mutex // guards conns
	conns map[net.Conn]struct{}
	wg    sync.WaitGroup
}

// Relay puts a delaying relay in the path of every new TCP connection a
// opens to b's port and b opens to a's. The delay starts at 0; SetDelay
// changes it, for chunks read from then on. The relays go at Close or when
// the test ends.
func (nt *Net) Relay(a, b *Host, port int) *Link {
	nt.t.Helper()
	l := &Link{net: nt}
	for _, p := range [][2]*Host{{a, b}, {b, a}} {
		r, err := l.start(p[0], net.JoinHostPort(p[1].Addr(), strconv.Itoa(port)))
		if err != nil {
			l.Close()
			nt.t.Fatalf("netns: relay %s -> %s: %v", p[0], p[1], err)
		}
		l.relays = append(l.relays, r)
	}
	nt.t.Cleanup(l.Close)
	return l
}

// SetDelay sets the one-way delay of the link.
func (l *Link) SetDelay(d time.Duration) { l.delay.Store(int64(d)) }

// SetLoss makes each packet of the link lost with probability p, as a
// lossy link with the delay on the wire would: see the package comment on
// slow links.
func (l *Link) SetLoss(p float64) { l.loss.Store(math.Float64bits(p)) }

// stall is how much longer a chunk of n bytes waits for the losses among
// its packets at the current rate.
func (l *Link) stall(n int) time.Duration {
	p := math.Float64frombits(l.loss.Load())
	if p <= 0 {
		return 0
	}
	packets := (n + mss - 1) / mss
	if rand.Float64() >= 1-math.Pow(1-p, float64(packets)) {
		return 0
	}
	rtt := 2 * time.Duration(l.delay.Load())
	d := rtt + rtt/2 // fast retransmit
	for rto := 2 * rtt; rand.Float64() < p && rto < time.Minute; rto *= 2 {
		d += rto // the resend lost as well: a timeout, backed off
	}
	return d
}

// mss is the payload of one packet on the bridge (1500-byte MTU).
const mss = 1448

// DropReplies makes the link lose, or stop losing, the last answer a
// server sends before closing a connection (see Link.dropReplies).
func (l *Link) DropReplies(on bool) { l.dropReplies.Store(on) }

// Close removes the redirect rules and the relays, and closes the
// connections through them.
func (l *Link) Close() {
	l.once.Do(func() {
		for _, r := range l.relays {
			if out, err := run(append([]string{"ip", "netns", "exec", r.from.NS, "iptables", "-w", "-t", "nat", "-D"}, r.rule...)...); err != nil {
				l.net.t.Logf("netns: removing a relay rule: %v: %s", err, out)
			}
			r.ln.Close()
			r.mu.Lock()
			for c := range r.conns {
				c.Close()
			}
			r.mu.Unlock()
			r.wg.Wait()
		}
	})
}

// start runs a relay in from's namespace for connections to target.
func (l *Link) start(from *Host, target string) (*relay, error) {
	r := &relay{link: l, from: from, target: target, conns: map[net.Conn]struct{}{}}
	err := from.Do(func() (err error) {
		r.ln, err = net.Listen("tcp", "0.0.0.0:0")
		return err
	})
	if err != nil {
		return nil, err
	}
	host, port, _ := net.SplitHostPort(target)
	lport := strconv.Itoa(r.ln.Addr().(*net.TCPAddr).Port)
	r.rule = []string{"OUTPUT", "-p", "tcp", "-d", host, "--dport", port, "-m", "mark", "!", "--mark", fmt.Sprint(relayMark), "-j", "REDIRECT", "--to-ports", lport}
	if out, err := run(append([]string{"ip", "netns", "exec", from.NS, "iptables", "-w", "-t", "nat", "-A"}, r.rule...)...); err != nil {
		r.ln.Close()
		return nil, fmt.Errorf("%v: %s", err, out)
	}
	r.wg.Add(1)
	go r.accept()
	return r, nil
}

func (r *relay) accept() {
	defer r.wg.Done()
	for {
		c, err := r.ln.Accept()
		if err != nil {
			return
		}
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			r.carry(c)
		}()
	}
}

// track adds c to the connections Close ends.
func (r *relay) track(c net.Conn) {
	r.mu.Lock()
	r.conns[c] = struct{}{}
	r.mu.Unlock()
}

func (r *relay) untrack(c net.Conn) {
	r.mu.Lock()
	delete(r.conns, c)
	r.mu.Unlock()
	c.Close()
}

// carry relays one connection: client is what the host's process opened.
func (r *relay) carry(client net.Conn) {
	// The handshake the client did not have to wait for.
	handshake := time.Now().Add(2 * time.Duration(r.link.delay.Load()))
	r.track(client)
	defer r.untrack(client)
	var server net.Conn
	err := r.from.Do(func() (err error) {
		d := net.Dialer{Timeout: 10 * time.Second, Control: markSocket}
		server, err = d.Dial("tcp", r.target)
		return err
	})
	if err != nil {
		return
	}
	r.track(server)
	defer r.untrack(server)
	done := make(chan struct{}, 2)
	go func() { r.pipe(client, server, false, handshake); done <- struct{}{} }()
	go func() { r.pipe(server, client, true, time.Time{}); done <- struct{}{} }()
	<-done
	<-done
}

// chunk is what one read returned, and when.
type chunk struct {
	data []byte
	at   time.Time
}

// pipe copies src to dst, each chunk held for the link's delay, counted
// from no earlier than notBefore. reply says src is the server's side,
// whose last answer DropReplies loses.
func (r *relay) pipe(src, dst net.Conn, reply bool, notBefore time.Time) {
	q := make(chan chunk, 4096)
	var eofAt atomic.Int64 // when src ended, Unix nanoseconds
	go func() {
		defer close(q)
		for {
			b := make([]byte, 32<<10)
			n, err := src.Read(b)
			if n > 0 {
				q <- chunk{b[:n], time.Now()}
			}
			if err != nil {
				eofAt.Store(time.Now().UnixNano())
				return
			}
		}
	}()
	dropping := false
	for c := range q {
		due := maxTime(c.at, notBefore).Add(time.Duration(r.link.delay.Load()) + r.link.stall(len(c.data)))
		drop := reply && r.link.dropReplies.Load()
		if drop {
			due = maxTime(due, c.at.Add(replyHold))
		}
		if w := time.Until(due); w > 0 {
			time.Sleep(w) // the delay itself, not a wait for another goroutine
		}
		if drop {
			if e := eofAt.Load(); e != 0 && c.at.UnixNano() >= e-int64(replyHold) {
				dropping = true // the answer just before the close: lost
			}
		}
		if dropping {
			continue
		}
		if _, err := dst.Write(c.data); err != nil {
			src.Close()
			for range q {
			}
			return
		}
	}
	if dropping {
		// The close is lost with the answer: the client waits, times
		// out and closes, which ends the other pipe and the connection.
		return
	}
	if tc, ok := dst.(*net.TCPConn); ok {
		tc.CloseWrite()
	}
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// markSocket sets relayMark on a socket before it connects.
func markSocket(_, _ string, c syscall.RawConn) error {
	var serr error
	if err := c.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, relayMark)
	}); err != nil {
		return err
	}
	return serr
}

// Do runs fn on an OS thread moved into the host's network namespace:
// sockets fn opens live there, and stay usable from any goroutine after.
// The thread is never unlocked, so it exits with its goroutine instead of
// carrying the namespace back into the pool.
func (h *Host) Do(fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		f, err := os.Open("/var/run/netns/" + h.NS)
		if err != nil {
			errc <- err
			return
		}
		defer f.Close()
		if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("setns %s: %w", h.NS, err)
			return
		}
		errc <- fn()
	}()
	return <-errc
}

// Loss drops each IPv4 packet between a and b, both ways, with probability
// p (iptables' statistic match on each host's input); p 0 removes it.
// Setting it again replaces the previous rate.
func (nt *Net) Loss(a, b *Host, p float64) {
	nt.t.Helper()
	if p < 0 || p >= 1 {
		nt.t.Fatalf("netns: loss %v: want 0 <= p < 1", p)
	}
	key := [2]*Host{a, b}
	if b.Index < a.Index {
		key = [2]*Host{b, a}
	}
	if nt.losses == nil {
		nt.losses = map[[2]*Host]float64{}
	}
	rule := func(op string, h, other *Host, p float64) error {
		out, err := run("ip", "netns", "exec", h.NS, "iptables", "-w", op, "INPUT", "-s", other.Addr(), "-m", "statistic", "--mode", "random", "--probability", strconv.FormatFloat(p, 'f', -1, 64), "-j", "DROP")
		if err != nil {
			return fmt.Errorf("%v: %s", err, out)
		}
		return nil
	}
	if old, ok := nt.losses[key]; ok {
		for _, hs := range [][2]*Host{key, {key[1], key[0]}} {
			if err := rule("-D", hs[0], hs[1], old); err != nil {
				nt.t.Fatalf("netns: loss: %v", err)
			}
		}
		delete(nt.losses, key)
	}
	if p == 0 {
		return
	}
	for _, hs := range [][2]*Host{key, {key[1], key[0]}} {
		if err := rule("-I", hs[0], hs[1], p); err != nil {
			nt.t.Fatalf("netns: loss: %v", err)
		}
	}
	nt.losses[key] = p
}
