package e2e

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/internal/netns"
	"github.com/tandem-edge/tandem/replication"
)

// newPairGW is newGW with mDNS on, on the namespace's own interface:
// these processes never multicast in the host's namespace. (newGW's
// config turns it on already; this keeps the test's premise explicit.)
func newPairGW(t *testing.T, h *netns.Host, name string) *gw {
	g := newGW(t, h, name)
	b, err := os.ReadFile(g.cfg)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), "\ndiscovery:\n  mdns: true\n") {
		b = fmt.Appendf(b, "discovery:\n  mdns: true\n  interface: %s\n", netns.Iface)
		if err := os.WriteFile(g.cfg, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return g
}

// startPair is gw.start with the system D-Bus out of reach, so that the
// daemon takes the hashicorp/mdns path inside its namespace even on a
// machine whose own avahi-daemon would otherwise advertise for it.
func (g *gw) startPair() {
	g.t.Helper()
	g.start("DBUS_SYSTEM_BUS_ADDRESS=unix:path=/nonexistent")
}

// pairingOpen reads the gateway's status: whether pairing is open, and how
// many other members it counts.
func (g *gw) pairingOpen() (open bool, members int, ok bool) {
	s := g.status()
	if s == nil {
		return false, 0, false
	}
	return s.Pairing.Open, len(s.Members), true
}

// pairOpen runs `tandem pair open` on g and returns the code (stdout's
// first line).
func (g *gw) pairOpen(extra ...string) string {
	g.t.Helper()
	out, err := g.cli(append([]string{"pair", "open"}, extra...)...)
	if err != nil {
		g.t.Fatal(err)
	}
	code, _, _ := strings.Cut(out, "\n")
	if len(strings.ReplaceAll(code, "-", "")) < 12 {
		g.t.Fatalf("pair open printed %q", out)
	}
	return code
}

// members fails unless g counts want other members.
func (g *gw) members(want int) {
	g.t.Helper()
	if _, n, ok := g.pairingOpen(); !ok || n != want {
		g.t.Fatalf("%s: %d other members (status ok %v), want %d", g.name, n, ok, want)
	}
}

// TestPairOverMDNS: three gateways with mDNS on pair with two codes (the
// second opened on a slave) into a 3-voter cluster that replicates; a
// wrong code, a reused one and an expired one are refused with membership
// unchanged, strangers on the peer port get nowhere, and no code reaches
// the logs.
func TestPairOverMDNS(t *testing.T) {
	// Mostly waiting (a cut, a slow link, a lease, mDNS), on a network of
	// its own: it runs beside the other waiting ones (make test's time).
	t.Parallel()
	nt := netns.New(t, 3)
	g1, g2, g3 := newPairGW(t, nt.Hosts[0], "gw-1"), newPairGW(t, nt.Hosts[1], "gw-2"), newPairGW(t, nt.Hosts[2], "gw-3")
	tandemBin(t)
	start := time.Now()
	for _, g := range []*gw{g1, g2, g3} {
		g.startPair()
	}
	master := g1.h.Addr() + ":7883"

	code1 := g1.pairOpen()
	if open, _, _ := g1.pairingOpen(); !open {
		t.Fatal("status does not show pairing open")
	}
	// A wrong code: the master refuses; nothing changes.
	wrong := "0000-0000-0000"
	if code1 == wrong {
		wrong = "1111-1111-1111"
	}
	if out, err := g2.cli("pair", "join", wrong, "--timeout", "5s"); err == nil || !strings.Contains(err.Error(), "wrong pairing code") {
		t.Fatalf("wrong code: %v %s", err, out)
	}
	g1.members(0)
	g2.members(0)

	// The right code, found over mDNS.
	t0 := time.Now()
	out, err := g2.cli("pair", "join", code1, "--timeout", "10s")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("gw-2 paired in %v: %s", time.Since(t0).Round(time.Millisecond), strings.TrimSpace(out))
	waitShape(t, g1, 0, 1, 15*time.Second)

	// Reused: no longer advertised, and refused by the master when asked
	// directly.
	if _, err := g3.cli("pair", "join", code1, "--timeout", "2s"); err == nil || !strings.Contains(err.Error(), "no gateway with pairing open") {
		t.Fatalf("reused code over mDNS: %v", err)
	}
	if _, err := g3.cli("pair", "join", code1, "--addr", master); err == nil || !strings.Contains(err.Error(), "already used") {
		t.Fatalf("reused code: %v", err)
	}
	// Expired (opened on the slave: the master holds it).
	short := g2.pairOpen("--ttl", "1s")
	deadline := time.Now().Add(5 * time.Second)
	for open, _, _ := g1.pairingOpen(); open; open, _, _ = g1.pairingOpen() {
		if time.Now().After(deadline) {
			t.Fatal("a 1 s pairing still open after 5 s")
		}
		time.Sleep(50 * time.Millisecond)
	}
	if _, err := g3.cli("pair", "join", short, "--addr", master); err == nil || !strings.Contains(err.Error(), "expired") {
		t.Fatalf("expired code: %v", err)
	}
	g1.members(1)
	g3.members(0)

	// The third, with a code opened on the slave.
	code2 := g2.pairOpen()
	if _, err := g3.cli("pair", "join", code2, "--timeout", "10s"); err != nil {
		t.Fatal(err)
	}
	waitShape(t, g1, 2, 0, 20*time.Second)

	// It replicates: published on one slave, received on the other.
	got := make(chan string, 4)
	sub, err := device(t, g3, "sub3", func(p *paho.Publish) { got <- string(p.Payload) })
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := sub.Subscribe(ctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: "paired/#", QoS: 1}}}); err != nil {
		t.Fatal(err)
	}
	pub, err := device(t, g2, "pub2", nil)
	if err != nil {
		t.Fatal(err)
	}
	if r, err := pub.Publish(ctx, &paho.Publish{Topic: "paired/x", QoS: 1, Payload: []byte("hello")}); err != nil || r.ReasonCode != 0 {
		t.Fatalf("publish: %v %+v", err, r)
	}
	select {
	case p := <-got:
		if p != "hello" {
			t.Fatalf("got %q", p)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("gw-3's subscriber got nothing")
	}

	// Strangers on the master's peer port: a knock with garbage, a knock
	// with a well-formed but unproven request, and a raw TLS client.
	id, err := replication.LoadOrCreateIdentity(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	tr, err := replication.NewPeerTransport(replication.TransportConfig{Identity: id})
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	for _, k := range []struct {
		kind    byte
		payload []byte
	}{
		{replication.KnockPair, []byte("garbage")},
		{replication.KnockJoin, []byte("garbage")},
		{replication.KnockPair, []byte(`{"member":{"id":"` + replication.IDString(id.ID) + `","name":"x","addrs":[],"fp":"00"},"mac":"AAAA"}`)},
	} {
		err := g3.h.Do(func() error {
			_, _, err := tr.Knock(ctx, master, [32]byte{}, k.kind, k.payload)
			return err
		})
		if !errors.Is(err, replication.ErrRemote) {
			t.Fatalf("stranger's knock %q: %v, want a refusal", k.payload, err)
		}
	}
	var raw *tls.Conn
	if err := g3.h.Do(func() (err error) {
		raw, err = tls.Dial("tcp", master, &tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{id.Cert}})
		return err
	}); err == nil {
		raw.SetDeadline(time.Now().Add(5 * time.Second))
		raw.Write([]byte("hello raft, please add me"))
		b, rerr := io.ReadAll(raw)
		raw.Close()
		if len(b) != 0 || (rerr != nil && errors.Is(rerr, os.ErrDeadlineExceeded)) {
			t.Fatalf("raw TLS stranger got %q, %v; want the connection closed without a word", b, rerr)
		}
	}
	g1.members(2)

	// The codes never reach the journal.
	for _, g := range []*gw{g1, g2, g3} {
		logs := g.proc.Output()
		for _, c := range []string{code1, code2, short, wrong, strings.ReplaceAll(code1, "-", "")} {
			if strings.Contains(logs, c) {
				t.Fatalf("%s logged a pairing code", g.name)
			}
		}
		if g == g1 && !strings.Contains(logs, "pairing attempt refused") {
			t.Errorf("gw-1 did not log the refused attempts")
		}
	}
	t.Logf("three gateways paired and checked in %v", time.Since(start).Round(time.Millisecond))
}
