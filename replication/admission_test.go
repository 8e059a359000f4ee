package replication

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/storage"
)

// flood keeps up to n sockets open from each of the source addresses to
// addr, dialling again as the server closes them, until the test ends.
// With knocker set each socket does what the security review's did: TLS,
// the knock hello, then nothing; else it sends no byte at all. It returns
// how many sockets it has opened so far.
func flood(t *testing.T, addr string, sources []string, n int, knocker *Identity) *atomic.Int64 {
	t.Helper()
	var opened atomic.Int64
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	for _, src := range sources {
		for range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: time.Second}
				for ctx.Err() == nil {
					nc, err := d.DialContext(ctx, "tcp", addr)
					if err != nil {
						select {
						case <-ctx.Done():
						case <-time.After(10 * time.Millisecond): // backlog full: the pace of a flood, not a wait for the server
						}
						continue
					}
					opened.Add(1)
					stop := context.AfterFunc(ctx, func() { nc.Close() })
					if knocker != nil {
						tc := tls.Client(nc, &tls.Config{Certificates: []tls.Certificate{knocker.Cert}, InsecureSkipVerify: true, MinVersion: tls.VersionTLS13, NextProtos: []string{peerALPN}})
						if tc.HandshakeContext(ctx) == nil {
							tc.Write(appendHello(nil, hello{version: peerProtocolMin, maxVersion: peerProtocolMax, level: storage.FeatureLevel, purpose: purposeKnock, id: knocker.ID}))
						}
					}
					var b [256]byte
					for {
						if _, err := nc.Read(b[:]); err != nil {
							break // the server gave up on us
						}
					}
					stop()
					nc.Close()
					// A refused socket comes back at a flood's pace, not in a
					// tight loop: under qemu-user on a loaded machine the
					// flooder (in this process, emulated too) took the CPU the
					// joins' TLS handshakes needed within firstHelloTimeout.
					select {
					case <-ctx.Done():
					case <-time.After(10 * time.Millisecond):
					}
				}
			}()
		}
	}
	return &opened
}

// inLink is the link member id dialled into n, nil without one.
func inLink(n *tpNode, id uint64) *conn {
	n.tr.mu.RLock()
	defer n.tr.mu.RUnlock()
	if p := n.tr.peers[id]; p != nil {
		return p.in.Load()
	}
	return nil
}

// relinked has a drop its link to b and waits until a new one is in.
func relinked(t *testing.T, a, b *tpNode, what string) {
	t.Helper()
	old := inLink(b, a.id.ID)
	a.tr.Reconnect()
	waitFor(t, what, func() bool {
		c := inLink(b, a.id.ID)
		return c != nil && c != old && a.tr.Reachable(b.id.ID)
	})
}

// knockServer is a transport whose OnStranger welcomes every knock.
func knockServer(t *testing.T) *tpNode {
	return newTP(t, tpIdentity(t), "", func(c *TransportConfig) {
		c.OnStranger = func(_ context.Context, r Remote, kind byte, payload []byte) ([]byte, error) {
			return append([]byte("welcome:"), payload...), nil
		}
	})
}

// TestTransportKnockFloodFromOneAddress: a host that opens a hundred
// sockets that send the knock hello and then stall (the review's attack)
// stops neither a member's link nor a real join knocking from another
// address.
func TestTransportKnockFloodFromOneAddress(t *testing.T) {
	b := knockServer(t)
	b.tr.Start()
	baddr := b.tr.Addr().String()
	opened := flood(t, baddr, []string{"127.0.0.2"}, 100, tpIdentity(t))
	waitFor(t, "the flood under way and refused", func() bool {
		return opened.Load() >= 100 && b.tr.Stats().Refused >= 20
	})

	// Real joins, one after another, from 127.0.0.1 (not a member host yet:
	// no reserved slot helps them).
	// Each may take a second try, as a user runs `tandem cluster join`
	// again: under qemu-user on a loaded machine one TLS handshake beside
	// the flood's (emulated in this process too) can outlast the 2 s
	// firstHelloTimeout, which a real gateway's never comes near.
	j := newTP(t, tpIdentity(t), "", nil)
	for i := range 3 {
		want := fmt.Sprintf("join %d", i)
		var reply []byte
		var err error
		for try := range 2 {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			reply, _, err = j.tr.Knock(ctx, baddr, b.id.Fingerprint, KnockJoin, []byte(want))
			cancel()
			if err == nil {
				break
			}
			t.Logf("join knock %d, try %d, during the flood: %v", i, try+1, err)
		}
		if err != nil || string(reply) != "welcome:"+want {
			t.Fatalf("join knock %d during the flood, twice: %q, %v", i, reply, err)
		}
	}
	// A member from 127.0.0.1 (b has no address for it: only its own
	// dial, through the flooded listener, brings the link up).
	a := newTP(t, tpIdentity(t), "", nil)
	a.tr.SetPeers([]PeerInfo{b.info(true)})
	b.tr.SetPeers([]PeerInfo{a.info(false)})
	a.tr.Start()
	waitFor(t, "the member link up through the flood", func() bool {
		return a.tr.Reachable(b.id.ID) && b.tr.Reachable(a.id.ID)
	})

	// And the member link survives a reconnect during the flood.
	relinked(t, a, b, "the member link back after a reconnect")
}

// TestTransportFloodFromManyAddressesLeavesMembersAWayIn: silent sockets
// from forty addresses fill every shared handshake slot; a member, known
// by the host its link came from, still gets back in after its link drops.
func TestTransportFloodFromManyAddressesLeavesMembersAWayIn(t *testing.T) {
	b := knockServer(t)
	a := newTP(t, tpIdentity(t), "", nil)
	a.tr.SetPeers([]PeerInfo{b.info(true)})
	b.tr.SetPeers([]PeerInfo{a.info(false)})
	b.tr.Start()
	a.tr.Start()
	waitFor(t, "the member link up", func() bool { return a.tr.Reachable(b.id.ID) && b.tr.Reachable(a.id.ID) })

	var sources []string
	for i := range 40 {
		sources = append(sources, fmt.Sprintf("127.0.1.%d", i+1))
	}
	flood(t, b.tr.Addr().String(), sources, srcHandshakes, nil)
	waitFor(t, "the shared slots full", func() bool {
		b.tr.handshakes.mu.Lock()
		defer b.tr.handshakes.mu.Unlock()
		return b.tr.handshakes.n >= maxHandshakes
	})
	for i := range 3 {
		relinked(t, a, b, fmt.Sprintf("the member link back during the flood (%d)", i))
	}
}

// TestSrcLimiter pins the accounting: per source, shared, reserved.
func TestSrcLimiter(t *testing.T) {
	l := newSrcLimiter(3, 1, 2)
	if !l.acquire("x", false) || !l.acquire("x", false) || l.acquire("x", false) {
		t.Fatal("per-source bound of 2 not kept")
	}
	if !l.acquire("y", false) || l.acquire("z", false) {
		t.Fatal("shared bound of 3 not kept")
	}
	if !l.acquire("m", true) || l.acquire("m", true) {
		t.Fatal("one reserved slot for members")
	}
	l.release("x")
	if l.acquire("z", false) {
		t.Fatal("a member's slot counts against the shared ones too")
	}
	l.release("m")
	if !l.acquire("z", false) {
		t.Fatal("a released slot is free again")
	}
	for _, s := range []string{"x", "y", "z"} {
		l.release(s)
	}
	if l.n != 0 || len(l.bySrc) != 0 {
		t.Fatalf("after releasing all: n %d, bySrc %v", l.n, l.bySrc)
	}
	// One IPv6 /64 is one source: rotating addresses in it gains nothing.
	if !l.acquire("2001:db8::1", false) || !l.acquire("2001:db8::2", false) || l.acquire("2001:db8::ffff:3", false) {
		t.Fatal("an IPv6 /64 is not held to the per-source bound")
	}
	if !l.acquire("2001:db8:0:1::1", false) {
		t.Fatal("another /64 is another source")
	}
}
