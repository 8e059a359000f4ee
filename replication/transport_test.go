package replication

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	pb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/storage"
)

// tpNode is one transport under test and what its callbacks saw.
type tpNode struct {
	id *Identity
	tr *PeerTransport

	mu      sync.Mutex
	got     []pb.Message
	unreach map[uint64]int
}

func (n *tpNode) onRaft(from uint64, msgs []pb.Message) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.got = append(n.got, msgs...)
}

func (n *tpNode) onUnreachable(id uint64) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.unreach[id]++
}

func (n *tpNode) received() []pb.Message {
	n.mu.Lock()
	defer n.mu.Unlock()
	return append([]pb.Message(nil), n.got...)
}

func (n *tpNode) count() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return len(n.got)
}

func (n *tpNode) unreachable(id uint64) int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.unreach[id]
}

// info is n as a member of someone else's peer set; withAddr false leaves
// the address out, so only n dials that pair (one link, ordered).
func (n *tpNode) info(withAddr bool) PeerInfo {
	pi := PeerInfo{ID: n.id.ID, Fingerprint: n.id.Fingerprint}
	if withAddr {
		pi.Addrs = []string{n.tr.Addr().String()}
	}
	return pi
}

func tpIdentity(t *testing.T) *Identity {
	t.Helper()
	id, err := LoadOrCreateIdentity(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// newTP makes a transport on listen (127.0.0.1:0 when empty) without
// starting it; mod adjusts the config.
func newTP(t *testing.T, id *Identity, listen string, mod func(*TransportConfig)) *tpNode {
	t.Helper()
	if listen == "" {
		listen = "127.0.0.1:0"
	}
	n := &tpNode{id: id, unreach: map[uint64]int{}}
	cfg := TransportConfig{Identity: id, Listen: listen, OnRaft: n.onRaft, OnUnreachable: n.onUnreachable}
	if mod != nil {
		mod(&cfg)
	}
	tr, err := NewPeerTransport(cfg)
	if err != nil {
		t.Fatal(err)
	}
	n.tr = tr
	t.Cleanup(tr.Close)
	return n
}

// tpPair makes a and b; b has no address for a, so a single link (dialled by
// a) carries both directions, in order.
func tpPair(t *testing.T, modA, modB func(*TransportConfig)) (a, b *tpNode) {
	t.Helper()
	a = newTP(t, tpIdentity(t), "", modA)
	b = newTP(t, tpIdentity(t), "", modB)
	a.tr.SetPeers([]PeerInfo{b.info(true)})
	b.tr.SetPeers([]PeerInfo{a.info(false)})
	a.tr.Start()
	b.tr.Start()
	return a, b
}

func tpMsg(from, to, i uint64) pb.Message {
	return pb.Message{Type: pb.MsgApp, From: from, To: to, Term: 3, Index: i, Commit: i,
		Entries: []pb.Entry{{Term: 3, Index: i + 1, Data: []byte(fmt.Sprintf("record %d→%d #%d", from, to, i))}}}
}

// tpCheckRun asserts got holds exactly msgs i = 0..n-1 from→to, in order.
func tpCheckRun(t *testing.T, got []pb.Message, from, to uint64, n int) {
	t.Helper()
	if len(got) != n {
		t.Fatalf("%d messages, want %d", len(got), n)
	}
	for i, m := range got {
		want := tpMsg(from, to, uint64(i))
		if m.Type != want.Type || m.From != from || m.To != to || m.Index != want.Index || m.Term != want.Term ||
			len(m.Entries) != 1 || !bytes.Equal(m.Entries[0].Data, want.Entries[0].Data) {
			t.Fatalf("message %d = %+v, want %+v", i, m, want)
		}
	}
}

func TestTransportExchangesRaftBothWays(t *testing.T) {
	a, b := tpPair(t, nil, nil)
	waitFor(t, "a link", func() bool { return a.tr.Reachable(b.id.ID) && b.tr.Reachable(a.id.ID) })
	const n = 200
	var ab, ba []pb.Message
	for i := range uint64(n) {
		ab = append(ab, tpMsg(a.id.ID, b.id.ID, i))
		ba = append(ba, tpMsg(b.id.ID, a.id.ID, i))
	}
	a.tr.Send(ab) // one Send: batched into few frames
	for _, m := range ba {
		b.tr.Send([]pb.Message{m}) // B has no address for A: it answers on A's link
	}
	waitFor(t, "all messages", func() bool { return a.count() == n && b.count() == n })
	tpCheckRun(t, b.received(), a.id.ID, b.id.ID, n)
	tpCheckRun(t, a.received(), b.id.ID, a.id.ID, n)
	// A frame is counted once its write returns, which may be after the
	// peer has read it.
	waitFor(t, "a's stats to count what it sent", func() bool { return a.tr.Stats().MsgsSent >= n })
	sa := a.tr.Stats()
	if sa.MsgsSent != n || sa.MsgsReceived != n || sa.Dropped != 0 {
		t.Fatalf("a's stats %+v", sa)
	}
	if sa.FramesSent >= sa.MsgsSent {
		t.Fatalf("no batching: %d frames for %d messages", sa.FramesSent, sa.MsgsSent)
	}
	if sa.BytesSent == 0 || b.tr.Stats().BytesReceived == 0 {
		t.Fatalf("bytes not counted: %+v", sa)
	}
}

func TestTransportThreePeers(t *testing.T) {
	nodes := make([]*tpNode, 3)
	for i := range nodes {
		nodes[i] = newTP(t, tpIdentity(t), "", nil)
	}
	var infos []PeerInfo
	for _, n := range nodes {
		infos = append(infos, n.info(true))
	}
	for _, n := range nodes {
		n.tr.SetPeers(infos) // its own entry is ignored
		n.tr.Start()
	}
	for _, x := range nodes {
		for _, y := range nodes {
			if x != y {
				waitFor(t, "links", func() bool { return x.tr.Reachable(y.id.ID) })
			}
		}
	}
	const per = 20
	for _, x := range nodes {
		for _, y := range nodes {
			if x == y {
				continue
			}
			for i := range uint64(per) {
				x.tr.Send([]pb.Message{tpMsg(x.id.ID, y.id.ID, i)})
			}
		}
	}
	for _, n := range nodes {
		waitFor(t, "every message", func() bool { return n.count() == 2*per })
		from := map[uint64]int{}
		for _, m := range n.received() {
			if m.To != n.id.ID {
				t.Fatalf("%x got a message for %x", n.id.ID, m.To)
			}
			from[m.From]++
		}
		for _, x := range nodes {
			if x != n && from[x.id.ID] != per {
				t.Fatalf("%x got %d messages from %x, want %d", n.id.ID, from[x.id.ID], x.id.ID, per)
			}
		}
	}
}

func TestTransportRefusesWrongFingerprint(t *testing.T) {
	a := newTP(t, tpIdentity(t), "", nil)
	b := newTP(t, tpIdentity(t), "", nil)
	other := tpIdentity(t)
	a.tr.SetPeers([]PeerInfo{b.info(true)})
	// B pins another certificate for A's id: A is a stranger to B, and B's
	// own dial to A fails its pin.
	b.tr.SetPeers([]PeerInfo{{ID: a.id.ID, Addrs: []string{a.tr.Addr().String()}, Fingerprint: other.Fingerprint}})
	a.tr.Start()
	b.tr.Start()
	waitFor(t, "refusals both ways", func() bool {
		a.tr.Send([]pb.Message{tpMsg(a.id.ID, b.id.ID, 1)})
		b.tr.Send([]pb.Message{tpMsg(b.id.ID, a.id.ID, 1)})
		return a.tr.Stats().Refused >= 2 && b.tr.Stats().Refused >= 2
	})
	if a.tr.Reachable(b.id.ID) || b.tr.Reachable(a.id.ID) {
		t.Fatal("a link came up despite the wrong fingerprint")
	}
	if a.count() != 0 || b.count() != 0 {
		t.Fatalf("delivered %d and %d messages over refused links", a.count(), b.count())
	}
	if a.tr.Stats().Dropped == 0 || a.unreachable(b.id.ID) == 0 {
		t.Fatalf("drops not counted or not reported: %+v", a.tr.Stats())
	}
}

// tpLogBuffer collects log output from several goroutines.
type tpLogBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *tpLogBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *tpLogBuffer) count(s string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Count(l.b.String(), s)
}

// tpRawDial is a hand-rolled client: TLS with id's certificate and a hello
// with purpose. It lets a test send what a real PeerTransport never would.
func tpRawDial(t *testing.T, id *Identity, addr string, purpose byte) (*tls.Conn, *frameReader) {
	t.Helper()
	tc, err := tls.Dial("tcp", addr, &tls.Config{Certificates: []tls.Certificate{id.Cert}, InsecureSkipVerify: true, MinVersion: tls.VersionTLS13, NextProtos: []string{peerALPN}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tc.Close() })
	tc.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := tc.Write(appendHello(nil, hello{version: peerProtocolMin, maxVersion: peerProtocolMax, level: storage.FeatureLevel, purpose: purpose, id: id.ID})); err != nil {
		t.Fatal(err)
	}
	return tc, newFrameReader(tc, MaxFrameSize)
}

func tpExpectHello(t *testing.T, fr *frameReader) {
	t.Helper()
	if typ, _, err := fr.next(); err != nil || typ != frameHello {
		t.Fatalf("server hello: type %d, %v", typ, err)
	}
}

// tpReadUntilClosed reads until the server closes, failing on any frame but
// those allowed.
func tpReadUntilClosed(t *testing.T, fr *frameReader, allowed ...byte) {
	t.Helper()
	for {
		typ, _, err := fr.next()
		if err != nil {
			return
		}
		if !bytes.Contains(allowed, []byte{typ}) {
			t.Fatalf("unexpected frame type %d from the server", typ)
		}
	}
}

func TestTransportStrangerMayKnockOnce(t *testing.T) {
	logs := &tpLogBuffer{}
	var knocks atomic.Int32
	var requests atomic.Int32
	var seen atomic.Pointer[Remote]
	b := newTP(t, tpIdentity(t), "", func(c *TransportConfig) {
		c.Logger = slog.New(slog.NewTextHandler(logs, nil))
		c.OnStranger = func(_ context.Context, r Remote, kind byte, payload []byte) ([]byte, error) {
			knocks.Add(1)
			seen.Store(&r)
			if string(payload) == "bad" {
				return nil, errors.New("token expired")
			}
			return append([]byte("welcome:"), payload...), nil
		}
		c.OnRequest = func(context.Context, uint64, byte, []byte) ([]byte, error) {
			requests.Add(1)
			return nil, nil
		}
	})
	b.tr.Start()
	baddr := b.tr.Addr().String()
	a := newTP(t, tpIdentity(t), "", nil) // never started: Knock needs no Start
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	reply, r, err := a.tr.Knock(ctx, baddr, b.id.Fingerprint, KnockJoin, []byte("secret"))
	if err != nil || string(reply) != "welcome:secret" {
		t.Fatalf("knock: %q, %v", reply, err)
	}
	if r.ID != b.id.ID || r.Fingerprint != b.id.Fingerprint {
		t.Fatalf("knock answered by %+v", r)
	}
	if s := seen.Load(); s.ID != a.id.ID || s.Fingerprint != a.id.Fingerprint {
		t.Fatalf("OnStranger saw %+v, want a's id and fingerprint", s)
	}
	if _, _, err := a.tr.Knock(ctx, baddr, b.id.Fingerprint, KnockPair, []byte("bad")); !errors.Is(err, ErrRemote) || !strings.Contains(err.Error(), "token expired") {
		t.Fatalf("refused knock: %v", err)
	}
	if _, _, err := a.tr.Knock(ctx, baddr, a.id.Fingerprint, KnockJoin, []byte("secret")); !errors.Is(err, ErrPeerIdentity) {
		t.Fatal("knock accepted a server with the wrong fingerprint")
	}
	if _, _, err := a.tr.Knock(ctx, baddr, b.id.Fingerprint, 'R', nil); err == nil {
		t.Fatal("knock of a member kind allowed")
	}
	if knocks.Load() != 2 {
		t.Fatalf("%d knocks handled, want 2", knocks.Load())
	}

	// Two knocks in one write: one answer, then the connection closes.
	tc, fr := tpRawDial(t, a.id, baddr, purposeKnock)
	tpExpectHello(t, fr)
	two := appendKnock(appendKnock(nil, KnockJoin, []byte("one")), KnockJoin, []byte("two"))
	if _, err := tc.Write(two); err != nil {
		t.Fatal(err)
	}
	typ, body, err := fr.next()
	if err != nil || typ != frameResponse {
		t.Fatalf("answer: type %d, %v", typ, err)
	}
	if resp, _ := decodeResponse(body); string(resp.payload) != "welcome:one" {
		t.Fatalf("answer %q", resp.payload)
	}
	tpReadUntilClosed(t, fr)
	if knocks.Load() != 3 {
		t.Fatalf("%d knocks handled, want 3: the second frame was processed", knocks.Load())
	}

	// A raft frame or a member request instead of the knock: closed, never delivered.
	raft, _ := appendRaftFrame(nil, []pb.Message{tpMsg(a.id.ID, b.id.ID, 1)})
	for _, f := range [][]byte{raft, appendRequest(nil, requestFrame{id: 1, kind: 'R', payload: []byte("x")})} {
		tc, fr := tpRawDial(t, a.id, baddr, purposeKnock)
		tpExpectHello(t, fr)
		tc.Write(f)
		tpReadUntilClosed(t, fr)
	}
	// A stranger asking for a member link: closed without even a hello,
	// three times from one address and logged once.
	for range 3 {
		tc, fr := tpRawDial(t, a.id, baddr, purposeLink)
		tc.Write(raft)
		tpReadUntilClosed(t, fr)
	}
	if b.count() != 0 || requests.Load() != 0 || knocks.Load() != 3 {
		t.Fatalf("stranger got through: %d raft messages, %d requests, %d knocks", b.count(), requests.Load(), knocks.Load())
	}
	waitFor(t, "refusals counted", func() bool { return b.tr.Stats().Refused >= 5 })
	if n := logs.count("unknown fingerprint"); n != 1 {
		t.Fatalf("stranger refusal logged %d times, want once", n)
	}
	if st := b.tr.Stats(); st.Knocks != 3 {
		t.Fatalf("stats %+v", st)
	}
}

// tpGenLog records OnGeneration verdicts and raft deliveries in order.
type tpGenLog struct {
	mu     sync.Mutex
	events []string
	raft   int
}

func (g *tpGenLog) add(e string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.events = append(g.events, e)
	if e == "raft" {
		g.raft++
	}
}

// verdicts returns how many generation verdicts were seen and the last.
func (g *tpGenLog) verdicts() (n int, last string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, e := range g.events {
		if e != "raft" {
			n, last = n+1, e
		}
	}
	return n, last
}

func TestTransportGenerationCheckedBeforeRaft(t *testing.T) {
	var gen atomic.Uint64
	gen.Store(7)
	var allow atomic.Bool
	log := &tpGenLog{}
	a, b := tpPair(t, func(c *TransportConfig) { c.Generation = gen.Load }, func(c *TransportConfig) {
		c.OnGeneration = func(from, g uint64) bool {
			ok := allow.Load()
			log.add(fmt.Sprintf("gen:%x:%d:%v", from, g, ok))
			return ok
		}
		c.OnRaft = func(uint64, []pb.Message) { log.add("raft") }
	})
	waitFor(t, "refused handshakes", func() bool {
		a.tr.Send([]pb.Message{tpMsg(a.id.ID, b.id.ID, 1)})
		n, _ := log.verdicts()
		return n >= 3
	})
	if _, last := log.verdicts(); last != fmt.Sprintf("gen:%x:7:false", a.id.ID) {
		t.Fatalf("OnGeneration saw %q", last)
	}
	allow.Store(true)
	a.tr.Reconnect() // cut the backoff short
	waitFor(t, "raft after admission", func() bool {
		a.tr.Send([]pb.Message{tpMsg(a.id.ID, b.id.ID, 1)})
		log.mu.Lock()
		defer log.mu.Unlock()
		return log.raft > 0
	})
	log.mu.Lock()
	admitted := false
	for _, e := range log.events {
		admitted = admitted || strings.HasSuffix(e, ":true")
		if e == "raft" && !admitted {
			t.Errorf("raft delivered before a generation was accepted: %v", log.events)
			break
		}
	}
	log.mu.Unlock()
	// A generation bump plus Reconnect re-handshakes every link.
	gen.Store(8)
	a.tr.Reconnect()
	waitFor(t, "the new generation seen", func() bool {
		_, last := log.verdicts()
		return last == fmt.Sprintf("gen:%x:8:true", a.id.ID)
	})
}

func TestTransportRequests(t *testing.T) {
	const inflight = 16
	var running atomic.Int32
	all := make(chan struct{})
	slowDone := make(chan error, 1)
	a, b := tpPair(t, nil, func(c *TransportConfig) {
		c.OnRequest = func(ctx context.Context, from uint64, kind byte, p []byte) ([]byte, error) {
			switch kind {
			case 'E': // answers only once all are in flight: proves concurrency
				if running.Add(1) == inflight {
					close(all)
				}
				select {
				case <-all:
				case <-ctx.Done():
					return nil, ctx.Err()
				}
				return append([]byte(fmt.Sprintf("echo from %x:", from)), p...), nil
			case 'F':
				return nil, errors.New("no master")
			case 'S': // never answers; its ctx carries the requester's deadline
				<-ctx.Done()
				slowDone <- ctx.Err()
				return nil, ctx.Err()
			}
			return nil, fmt.Errorf("kind %c", kind)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, inflight)
	for i := range inflight {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p := fmt.Sprintf("p%d", i)
			reply, err := a.tr.Request(ctx, b.id.ID, 'E', []byte(p)) // may wait for the link
			if want := fmt.Sprintf("echo from %x:%s", a.id.ID, p); err != nil || string(reply) != want {
				errs <- fmt.Errorf("request %d: %q, %v; want %q", i, reply, err, want)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if _, err := a.tr.Request(ctx, b.id.ID, 'F', nil); !errors.Is(err, ErrRemote) || !strings.Contains(err.Error(), "no master") {
		t.Fatalf("handler error: %v", err)
	}
	short, cancelShort := context.WithTimeout(ctx, 150*time.Millisecond)
	defer cancelShort()
	if _, err := a.tr.Request(short, b.id.ID, 'S', nil); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("unanswered request: %v, want the deadline", err)
	}
	select {
	case err := <-slowDone:
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("handler's ctx ended with %v, want the propagated deadline", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the handler's ctx never ended")
	}
	// B has no address for A: its request rides A's link; A has no handler.
	if _, err := b.tr.Request(ctx, a.id.ID, 'X', nil); !errors.Is(err, ErrRemote) {
		t.Fatalf("request to a node without a handler: %v", err)
	}
	if _, err := a.tr.Request(ctx, 42, 'E', nil); !errors.Is(err, ErrPeerUnknown) {
		t.Fatalf("request to a non-member: %v", err)
	}
}

func TestTransportReconnectsAfterPeerRestart(t *testing.T) {
	a := newTP(t, tpIdentity(t), "", nil)
	bid := tpIdentity(t)
	b := newTP(t, bid, "", nil)
	a.tr.SetPeers([]PeerInfo{b.info(true)})
	b.tr.SetPeers([]PeerInfo{a.info(true)})
	a.tr.Start()
	b.tr.Start()
	waitFor(t, "first delivery", func() bool {
		a.tr.Send([]pb.Message{tpMsg(a.id.ID, bid.ID, 1)})
		return b.count() > 0
	})
	addr := b.tr.Addr().String()
	b.tr.Close()
	waitFor(t, "a to notice", func() bool { return !a.tr.Reachable(bid.ID) })
	b2 := newTP(t, bid, addr, nil) // same identity, same port
	b2.tr.SetPeers([]PeerInfo{a.info(true)})
	b2.tr.Start()
	waitFor(t, "delivery after the restart", func() bool {
		a.tr.Send([]pb.Message{tpMsg(a.id.ID, bid.ID, 2)})
		b2.tr.Send([]pb.Message{tpMsg(bid.ID, a.id.ID, 2)})
		return b2.count() > 0 && a.count() > 0
	})
	if a.unreachable(bid.ID) == 0 {
		t.Fatal("the lost link was not reported unreachable")
	}
}

func TestTransportFollowsAddressChange(t *testing.T) {
	a, b := tpPair(t, nil, nil)
	waitFor(t, "first delivery", func() bool {
		a.tr.Send([]pb.Message{tpMsg(a.id.ID, b.id.ID, 1)})
		return b.count() > 0
	})
	b.tr.Close()
	// B moves to another port and still has no address for A: only A's
	// redial at the new address can bring the link back.
	b2 := newTP(t, b.id, "", nil)
	b2.tr.SetPeers([]PeerInfo{a.info(false)})
	b2.tr.Start()
	a.tr.SetPeers([]PeerInfo{b2.info(true)})
	waitFor(t, "delivery at the new address", func() bool {
		a.tr.Send([]pb.Message{tpMsg(a.id.ID, b.id.ID, 2)})
		return b2.count() > 0
	})
}

func TestTransportSlowPeerDoesNotBlockSend(t *testing.T) {
	release := make(chan struct{})
	a, b := tpPair(t, func(c *TransportConfig) {
		c.QueueMessages, c.QueueBytes = 64, 256<<10
		c.IdleTimeout = time.Minute // the stall must not end in a redial here
	}, func(c *TransportConfig) {
		c.OnRaft = func(uint64, []pb.Message) { <-release } // stops reading
	})
	t.Cleanup(func() { close(release) }) // runs before the Closes
	waitFor(t, "a link", func() bool { return a.tr.Reachable(b.id.ID) })
	big := make([]byte, 64<<10)
	var slowest time.Duration
	waitFor(t, "drops", func() bool {
		for i := range 16 {
			m := pb.Message{Type: pb.MsgApp, From: a.id.ID, To: b.id.ID, Index: uint64(i), Entries: []pb.Entry{{Data: big}}}
			start := time.Now()
			a.tr.Send([]pb.Message{m})
			slowest = max(slowest, time.Since(start))
		}
		return a.tr.Stats().Dropped > 0
	})
	if slowest > 100*time.Millisecond {
		t.Fatalf("Send took %v with a stalled peer", slowest)
	}
	waitFor(t, "the drops reported", func() bool { return a.unreachable(b.id.ID) > 0 })
	if !a.tr.Reachable(b.id.ID) {
		t.Fatal("a slow peer is not a dead one")
	}
}

func TestTransportRemovedPeerIsCut(t *testing.T) {
	a, b := tpPair(t, nil, nil)
	waitFor(t, "a link", func() bool { return a.tr.Reachable(b.id.ID) && b.tr.Reachable(a.id.ID) })
	a.tr.SetPeers(nil)
	waitFor(t, "the link closed on both sides", func() bool { return !a.tr.Reachable(b.id.ID) && !b.tr.Reachable(a.id.ID) })
	before := a.tr.Stats().Dropped
	a.tr.Send([]pb.Message{tpMsg(a.id.ID, b.id.ID, 1)})
	if a.tr.Stats().Dropped != before+1 {
		t.Fatal("a message to a removed peer was not dropped")
	}
	if _, err := a.tr.Request(context.Background(), b.id.ID, 'E', nil); !errors.Is(err, ErrPeerUnknown) {
		t.Fatalf("request to a removed peer: %v", err)
	}
}

// TestTransportSilentPeerTimesOut: a peer that completes the handshake and
// then says nothing, not even pings, is dropped after IdleTimeout and
// redialled.
func TestTransportSilentPeerTimesOut(t *testing.T) {
	bid := tpIdentity(t)
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{bid.Cert}, ClientAuth: tls.RequireAnyClientCert, MinVersion: tls.VersionTLS13, NextProtos: []string{peerALPN}})
	if err != nil {
		t.Fatal(err)
	}
	var accepted atomic.Int32
	var held sync.WaitGroup
	done := make(chan struct{})
	held.Add(1)
	go func() {
		defer held.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			held.Add(1)
			go func() { // handshake, hello, then silence until the client gives up
				defer held.Done()
				defer c.Close()
				c.Write(appendHello(nil, hello{version: peerProtocolMin, maxVersion: peerProtocolMax, level: storage.FeatureLevel, purpose: purposeLink, id: bid.ID}))
				accepted.Add(1)
				select {
				case <-done:
				case <-tpReadClosed(c):
				}
			}()
		}
	}()
	t.Cleanup(func() { close(done); ln.Close(); held.Wait() })
	a := newTP(t, tpIdentity(t), "", func(c *TransportConfig) { c.IdleTimeout = 300 * time.Millisecond })
	a.tr.SetPeers([]PeerInfo{{ID: bid.ID, Addrs: []string{ln.Addr().String()}, Fingerprint: bid.Fingerprint}})
	a.tr.Start()
	waitFor(t, "a redial after the idle timeout", func() bool { return accepted.Load() >= 2 })
	waitFor(t, "the dead link reported", func() bool { return a.unreachable(bid.ID) > 0 })
}

// tpReadClosed returns a channel closed once c reads EOF or an error; what
// it reads is discarded.
func tpReadClosed(c net.Conn) <-chan struct{} {
	ch := make(chan struct{})
	go func() {
		defer close(ch)
		buf := make([]byte, 4096)
		for {
			if _, err := c.Read(buf); err != nil {
				return
			}
		}
	}()
	return ch
}

func TestTransportCloseIsIdempotent(t *testing.T) {
	a, b := tpPair(t, nil, nil)
	waitFor(t, "a link", func() bool { return a.tr.Reachable(b.id.ID) })
	a.tr.Close()
	a.tr.Close()
	a.tr.Send([]pb.Message{tpMsg(a.id.ID, b.id.ID, 1)})
	a.tr.SetPeers([]PeerInfo{b.info(true)})
	a.tr.Start()
	if a.tr.Reachable(b.id.ID) {
		t.Fatal("reachable after Close")
	}
	if _, err := a.tr.Request(context.Background(), b.id.ID, 'E', nil); !errors.Is(err, ErrTransportClosed) {
		t.Fatalf("request after Close: %v", err)
	}
	if _, _, err := a.tr.Knock(context.Background(), b.tr.Addr().String(), b.id.Fingerprint, KnockJoin, nil); !errors.Is(err, ErrTransportClosed) {
		t.Fatalf("knock after Close: %v", err)
	}
	waitFor(t, "b to notice", func() bool { return !b.tr.Reachable(a.id.ID) })
}

// TestTransportCloseLeavesNothingRunning: Close ends links, dial loops,
// handlers (through their ctx) and waiters, and returns only after.
func TestTransportCloseLeavesNothingRunning(t *testing.T) {
	base := runtime.NumGoroutine()
	entered := make(chan struct{})
	a, b := tpPair(t, nil, func(c *TransportConfig) {
		c.OnRequest = func(ctx context.Context, _ uint64, _ byte, _ []byte) ([]byte, error) {
			close(entered)
			<-ctx.Done() // only Close ends it
			return nil, ctx.Err()
		}
	})
	errc := make(chan error, 1)
	go func() {
		_, err := a.tr.Request(context.Background(), b.id.ID, 'S', nil)
		errc <- err
	}()
	<-entered
	b.tr.Close()
	if err := <-errc; !errors.Is(err, ErrPeerUnreachable) {
		t.Fatalf("request cut by the peer's Close: %v", err)
	}
	a.tr.Close()
	waitFor(t, "goroutines to end", func() bool { return runtime.NumGoroutine() <= base })
}

// The largest answer a snapshot pull may get (4 chunks; snappull.go)
// crosses a member link whole.
func TestTransportCarriesTheLargestSnapshotChunk(t *testing.T) {
	chunk := make([]byte, 4*snapChunk)
	for i := range chunk {
		chunk[i] = byte(i * 7)
	}
	a, b := tpPair(t, nil, func(c *TransportConfig) {
		c.OnRequest = func(context.Context, uint64, byte, []byte) ([]byte, error) { return chunk, nil }
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	got, err := a.tr.Request(ctx, b.id.ID, 'B', make([]byte, snapPullLen))
	if err != nil || !bytes.Equal(got, chunk) {
		t.Fatalf("chunk of %d bytes: %d bytes back, %v", len(chunk), len(got), err)
	}
}
