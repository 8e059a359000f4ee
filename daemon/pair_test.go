package daemon

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/admin"
	"github.com/tandem-edge/tandem/replication"
)

func init() {
	// The gateways of these tests derive keys often; the real cost is
	// checked once, in TestPairKey.
	pairKDFCost = 1 << 10
}

func TestPairCodeFormat(t *testing.T) {
	if bits := float64(pairCodeLen) * math.Log2(float64(len(pairAlphabet))); bits < 60 {
		t.Fatalf("a code carries %.0f bits, want at least 60", bits)
	}
	counts := map[rune]int{}
	seen := map[string]bool{}
	for range 2000 {
		code, err := newPairCode()
		if err != nil {
			t.Fatal(err)
		}
		if len(code) != 14 || code[4] != '-' || code[9] != '-' {
			t.Fatalf("code %q is not grouped XXXX-XXXX-XXXX", code)
		}
		canon, err := ParsePairCode(code)
		if err != nil || formatPairCode(canon) != code {
			t.Fatalf("code %q does not parse back: %q %v", code, canon, err)
		}
		for _, r := range canon {
			if strings.ContainsRune("ILOU", r) {
				t.Fatalf("code %q holds a confusable letter", code)
			}
			counts[r]++
		}
		if seen[code] {
			t.Fatalf("code %q drawn twice", code)
		}
		seen[code] = true
	}
	// 24000 symbols over 32: each about 750; a broken draw shows at once.
	if len(counts) != 32 {
		t.Fatalf("%d symbols used, want all 32", len(counts))
	}
	for r, n := range counts {
		if n < 500 || n > 1000 {
			t.Fatalf("symbol %c drawn %d times of 24000: biased", r, n)
		}
	}
}

func TestParsePairCode(t *testing.T) {
	for _, in := range []string{"7KQF-M2XA-9RTD", "7kqf-m2xa-9rtd", "7KQFM2XA9RTD", " 7KQF M2XA 9RTD ", "7kqF-m2Xa-9RTd"} {
		if got, err := ParsePairCode(in); err != nil || got != "7KQFM2XA9RTD" {
			t.Errorf("parse %q: %q %v", in, got, err)
		}
	}
	// Confusables read as the digit they look like.
	for in, want := range map[string]string{"O0O0-IiLl-1111": "000011111111", "oooo-AAAA-BBBB": "0000AAAABBBB"} {
		if got, err := ParsePairCode(in); err != nil || got != want {
			t.Errorf("parse %q: %q %v, want %q", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "7KQF-M2XA-9RT", "7KQF-M2XA-9RTDX", "7KQF-M2XA-9RTU", "7KQF-M2XA-9RT!", "7KQF-M2XA-9RTÉ", "tandem1.abcdef"} {
		if got, err := ParsePairCode(bad); err == nil {
			t.Errorf("parse %q accepted as %q", bad, got)
		}
	}
}

func TestPairKey(t *testing.T) {
	saved := pairKDFCost
	pairKDFCost = 1 << 15
	defer func() { pairKDFCost = saved }()
	start := time.Now()
	k1 := pairKey("7KQFM2XA9RTD")
	took := time.Since(start)
	if len(k1) != 32 || bytes.Equal(k1, pairKey("7KQFM2XA9RTE")) || !bytes.Equal(k1, pairKey("7KQFM2XA9RTD")) {
		t.Fatal("pairKey is not a 32-byte function of the code")
	}
	t.Logf("key derivation at the real cost: %v", took)
}

func TestPairMACBinding(t *testing.T) {
	key := pairKey("7KQFM2XA9RTD")
	fpJ, fpM := [32]byte{1}, [32]byte{2}
	bind := bytes.Repeat([]byte{3}, 32)
	good := pairMAC(key, pairRoleJoiner, fpJ, fpM, bind, nil)
	if !bytes.Equal(good, pairMAC(key, pairRoleJoiner, fpJ, fpM, bind, nil)) {
		t.Fatal("MAC not deterministic")
	}
	other := bytes.Repeat([]byte{4}, 32)
	for name, mac := range map[string][]byte{
		"another code":         pairMAC(pairKey("7KQFM2XA9RTE"), pairRoleJoiner, fpJ, fpM, bind, nil),
		"the other role":       pairMAC(key, pairRoleMaster, fpJ, fpM, bind, nil),
		"another joiner":       pairMAC(key, pairRoleJoiner, [32]byte{9}, fpM, bind, nil),
		"another master":       pairMAC(key, pairRoleJoiner, fpJ, [32]byte{9}, bind, nil),
		"fingerprints swapped": pairMAC(key, pairRoleJoiner, fpM, fpJ, bind, nil),
		"another connection":   pairMAC(key, pairRoleJoiner, fpJ, fpM, other, nil),
		"another reply":        pairMAC(key, pairRoleJoiner, fpJ, fpM, bind, []byte("x")),
	} {
		if bytes.Equal(mac, good) {
			t.Errorf("%s gives the same MAC", name)
		}
	}
}

func TestPairBookLimits(t *testing.T) {
	key := []byte("key")
	macOf := func(k []byte) []byte { return pairMAC(k, pairRoleJoiner, [32]byte{}, [32]byte{}, nil, nil) }
	right, wrong := macOf(key), macOf([]byte("guess"))
	now := time.Unix(1_000_000, 0)
	var b pairBook

	if open, _ := b.state(now); open {
		t.Fatal("open before pair open")
	}
	if _, _, err := b.try("a", 7, right, macOf, now); !errors.Is(err, errPairClosed) {
		t.Fatalf("closed book: %v", err)
	}

	// Rate limit: a second attempt within a second from one address is
	// not even checked (and not counted); five wrong ones end that
	// address's attempts, not the pairing.
	b.open(key, now.Add(10*time.Minute))
	if open, exp := b.state(now); !open || !exp.Equal(now.Add(10*time.Minute)) {
		t.Fatalf("state after open: %v %v", open, exp)
	}
	if _, n, err := b.try("a", 7, wrong, macOf, now); !errors.Is(err, errPairWrong) || n != 1 {
		t.Fatalf("wrong code: %v (%d failures)", err, n)
	}
	if _, n, err := b.try("a", 7, right, macOf, now.Add(500*time.Millisecond)); !errors.Is(err, errPairBusy) || n != 1 {
		t.Fatalf("second attempt within a second: %v (%d failures)", err, n)
	}
	for i := 2; i <= pairMaxFailures; i++ {
		now = now.Add(pairMinInterval)
		_, n, err := b.try("a", 7, wrong, macOf, now)
		if !errors.Is(err, errPairWrong) || n != i {
			t.Fatalf("wrong code %d: %v (%d failures)", i, err, n)
		}
	}
	now = now.Add(pairMinInterval)
	if _, _, err := b.try("a", 7, right, macOf, now); !errors.Is(err, errPairLocked) {
		t.Fatalf("right code after %d failures from one address: %v, want locked", pairMaxFailures, err)
	}
	if open, _ := b.state(now); !open {
		t.Fatal("a stranger's failures closed the pairing")
	}
	if _, _, err := b.try("b", 7, wrong, macOf, now); !errors.Is(err, errPairWrong) {
		t.Fatalf("wrong code from another address: %v", err)
	}
	if _, _, err := b.try("c", 7, right, macOf, now); err != nil {
		t.Fatalf("right code from a third address: %v", err)
	}
	// Only so many addresses are remembered per code, and many addresses
	// crowd nobody out: the one idle longest is forgotten.
	b.open(key, now.Add(10*time.Minute))
	for i := range pairMaxSources + 10 {
		if _, _, err := b.try(fmt.Sprint("s", i), 7, wrong, macOf, now.Add(time.Duration(i)*time.Millisecond)); !errors.Is(err, errPairWrong) {
			t.Fatalf("source %d: %v", i, err)
		}
	}
	if n := len(b.cur.bySrc); n != pairMaxSources {
		t.Fatalf("%d sources remembered, want %d", n, pairMaxSources)
	}
	if _, ok := b.cur.bySrc["s0"]; ok {
		t.Fatal("the source idle longest was kept")
	}
	if _, _, err := b.try("late", 7, right, macOf, now); err != nil {
		t.Fatalf("a joiner after many addresses: %v", err)
	}

	// Single use: the pairing node may retry, another may not; release
	// (the node could not be added) reopens it.
	b.open(key, now.Add(time.Minute))
	p, _, err := b.try("a", 7, right, macOf, now)
	if err != nil || !bytes.Equal(p.key, key) {
		t.Fatalf("right code: %v", err)
	}
	if open, _ := b.state(now); open {
		t.Fatal("still advertised open once used")
	}
	now = now.Add(pairMinInterval)
	if _, _, err := b.try("b", 8, right, macOf, now); !errors.Is(err, errPairUsed) {
		t.Fatalf("reused by another node: %v", err)
	}
	now = now.Add(pairMinInterval)
	if _, _, err := b.try("a", 7, right, macOf, now); err != nil {
		t.Fatalf("retry by the same node: %v", err)
	}
	b.release(p)
	now = now.Add(pairMinInterval)
	if _, _, err := b.try("b", 8, right, macOf, now); err != nil {
		t.Fatalf("after release: %v", err)
	}

	// Expiry.
	b.open(key, now.Add(time.Minute))
	now = now.Add(time.Minute)
	if open, _ := b.state(now); open {
		t.Fatal("open at its expiry")
	}
	if _, _, err := b.try("a", 7, right, macOf, now); !errors.Is(err, errPairExpired) {
		t.Fatalf("expired: %v", err)
	}
}

// pairOpen runs `tandem pair open` against d and returns the code from
// the first line of its output.
func pairOpen(t *testing.T, d *Daemon, extra ...string) string {
	t.Helper()
	code, out, errOut := runMain(t, append([]string{"pair", "open", "--http", d.HTTPAddr(), "--data", d.cfg.Node.DataDir}, extra...)...)
	if code != 0 {
		t.Fatalf("pair open: exit %d: %s", code, errOut)
	}
	first, _, _ := strings.Cut(out, "\n")
	if _, err := ParsePairCode(first); err != nil {
		t.Fatalf("pair open printed %q first: %v", first, err)
	}
	return first
}

// pairJoin runs `tandem pair join` on d, knocking on addr (no mDNS here).
func pairJoin(t *testing.T, d *Daemon, code, addr string, extra ...string) (int, string) {
	t.Helper()
	exit, out, errOut := runMain(t, append([]string{"pair", "join", code, "--addr", addr, "--http", d.HTTPAddr(), "--data", d.cfg.Node.DataDir}, extra...)...)
	return exit, out + errOut
}

// TestPairInProcess: pairing three in-process gateways with two codes, one
// opened on a slave; wrong, reused and expired codes change nothing.
func TestPairInProcess(t *testing.T) {
	g1 := clusterGateway(t, "gw-1", nil)
	g2 := clusterGateway(t, "gw-2", nil)
	g3 := clusterGateway(t, "gw-3", nil)

	// Not open yet: refused, nothing changes.
	if exit, out := pairJoin(t, g2, "7KQF-M2XA-9RTD", g1.PeerAddr()); exit == 0 || !strings.Contains(out, "not open") {
		t.Fatalf("join before open: exit %d: %s", exit, out)
	}
	code := pairOpen(t, g1)
	if s := statusOfGW(t, g1); !s.Pairing.Open {
		t.Fatal("status does not show pairing open")
	}
	// A wrong code: refused, the pairing stays open for the right one.
	wrong := "0000-0000-0000"
	if code == wrong {
		wrong = "1111-1111-1111"
	}
	if exit, out := pairJoin(t, g2, wrong, g1.PeerAddr()); exit == 0 || !strings.Contains(out, "wrong pairing code") {
		t.Fatalf("wrong code: exit %d: %s", exit, out)
	}
	if len(statusOfGW(t, g1).Members) != 0 || len(statusOfGW(t, g2).Members) != 0 {
		t.Fatal("membership changed after a wrong code")
	}
	// The right one, typed sloppily, within a second of the wrong one
	// (the joiner waits out the rate limit).
	if exit, out := pairJoin(t, g2, strings.ToLower(strings.ReplaceAll(code, "-", "")), g1.PeerAddr()); exit != 0 || !strings.Contains(out, "paired") {
		t.Fatalf("pair join: exit %d: %s", exit, out)
	}
	waitFor(t, 10*time.Second, "gw-2 a caught-up learner", func() bool {
		v, l, ok := shape(statusOfGW(t, g1))
		return v == 0 && l == 1 && ok
	})
	if s := statusOfGW(t, g1); s.Pairing.Open {
		t.Fatal("pairing still open after use")
	}
	// Reused by another gateway: refused.
	if exit, out := pairJoin(t, g3, code, g1.PeerAddr()); exit == 0 || !strings.Contains(out, "not open") && !strings.Contains(out, "already used") {
		t.Fatalf("reused code: exit %d: %s", exit, out)
	}
	// Expired: refused.
	short := pairOpen(t, g2, "--ttl", "1s") // on a slave: the master holds it
	waitFor(t, 5*time.Second, "the short code to expire", func() bool { return !statusOfGW(t, g1).Pairing.Open })
	if exit, out := pairJoin(t, g3, short, g1.PeerAddr()); exit == 0 || !strings.Contains(out, "expired") && !strings.Contains(out, "not open") {
		t.Fatalf("expired code: exit %d: %s", exit, out)
	}
	if len(statusOfGW(t, g1).Members) != 1 || len(statusOfGW(t, g3).Members) != 0 {
		t.Fatal("membership changed after a reused or expired code")
	}
	// The third, with a code opened on the slave.
	if exit, out := pairJoin(t, g3, pairOpen(t, g2), g1.PeerAddr()); exit != 0 {
		t.Fatalf("third gateway: exit %d: %s", exit, out)
	}
	waitFor(t, 15*time.Second, "three voters", func() bool {
		v, l, ok := shape(statusOfGW(t, g1))
		return v == 2 && l == 0 && ok
	})
	// A member cannot pair again; a full cluster opens no pairing.
	if exit, out := pairJoin(t, g3, "7KQF-M2XA-9RTD", g1.PeerAddr()); exit == 0 || !strings.Contains(out, "member") {
		t.Fatalf("a member pairing: exit %d: %s", exit, out)
	}
	if code, msg := api(t, g1, "/v1/pair/open", admin.PairOpenRequest{}, nil); code != http.StatusConflict || !strings.Contains(msg, "most tandem runs") {
		t.Fatalf("pair open in a full cluster: %d %q", code, msg)
	}
}

// TestPairStrangerCannotCloseThePairing: five wrong proofs from a stranger
// at another address end that address's attempts, not the pairing: the
// real joiner pairs with the code afterwards.
func TestPairStrangerCannotCloseThePairing(t *testing.T) {
	g1 := clusterGateway(t, "gw-1", nil)
	g2 := clusterGateway(t, "gw-2", nil)
	// Each reading of the master's clock is 1.1 s after the last: the
	// stranger's attempts pass the rate limit without the test waiting.
	base := time.Now()
	var ticks atomic.Int64
	g1.cl.invites.pair.mu.Lock()
	g1.cl.invites.pair.clock = func() time.Time { return base.Add(time.Duration(ticks.Add(1)) * 1100 * time.Millisecond) }
	g1.cl.invites.pair.mu.Unlock()
	code := pairOpen(t, g1)

	sid, err := replication.LoadOrCreateIdentity(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	stranger := replication.Member{ID: sid.ID, Name: "stranger", Fingerprint: sid.Fingerprint}
	r := replication.Remote{ID: sid.ID, Fingerprint: sid.Fingerprint, Addr: "127.0.0.2:40000", Binding: make([]byte, 32)}
	wrongKey := pairKey("000000000000")
	proof, _ := json.Marshal(pairRequest{Member: stranger, MAC: pairMAC(wrongKey, pairRoleJoiner, sid.Fingerprint, g1.self().Fingerprint, r.Binding, nil)})
	for i := range pairMaxFailures + 2 {
		_, err := g1.cl.onPair(t.Context(), r, proof)
		want := errPairWrong
		if i >= pairMaxFailures {
			want = errPairLocked
		}
		if !errors.Is(err, want) {
			t.Fatalf("stranger's attempt %d: %v, want %v", i+1, err, want)
		}
	}
	if s := statusOfGW(t, g1); !s.Pairing.Open {
		t.Fatal("the stranger's wrong proofs closed the pairing")
	}
	if exit, out := pairJoin(t, g2, code, g1.PeerAddr()); exit != 0 || !strings.Contains(out, "paired") {
		t.Fatalf("the real joiner after the stranger: exit %d: %s", exit, out)
	}
}

// relay is a gateway in the middle: it answers pairing knocks by knocking
// on the master with what it was sent, as itself (it must: its own TLS
// session and certificate), optionally claiming to be the joiner.
func relay(t *testing.T, master string, asJoiner bool) *replication.PeerTransport {
	t.Helper()
	id, err := replication.LoadOrCreateIdentity(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	var tr *replication.PeerTransport
	tr, err = replication.NewPeerTransport(replication.TransportConfig{Identity: id, Listen: "127.0.0.1:0",
		OnStranger: func(ctx context.Context, r replication.Remote, kind byte, payload []byte) ([]byte, error) {
			if !asJoiner {
				var req pairRequest
				if err := json.Unmarshal(payload, &req); err != nil {
					return nil, err
				}
				req.Member = replication.Member{ID: id.ID, Name: "relay", Fingerprint: id.Fingerprint, Addrs: []string{"127.0.0.1:1"}}
				payload, _ = json.Marshal(req)
			}
			reply, _, err := tr.Knock(ctx, master, [32]byte{}, kind, payload)
			if err != nil {
				return nil, errors.New(err.Error())
			}
			return reply, nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	tr.Start()
	t.Cleanup(tr.Close)
	return tr
}

// TestPairRelayFails: a relay between the joiner and the master, which
// passes the joiner's proof on over its own connection, is refused by the
// master, whatever it claims to be; and a gateway that answers without
// knowing the code is refused by the joiner before it changes anything.
func TestPairRelayFails(t *testing.T) {
	g1 := clusterGateway(t, "gw-1", nil)
	g2 := clusterGateway(t, "gw-2", nil)
	code := pairOpen(t, g1)
	for _, asJoiner := range []bool{false, true} {
		r := relay(t, g1.PeerAddr(), asJoiner)
		exit, out := pairJoin(t, g2, code, r.Addr().String())
		if exit == 0 {
			t.Fatalf("paired through a relay (as joiner %v): %s", asJoiner, out)
		}
		t.Logf("through a relay (claiming the joiner's identity: %v): %s", asJoiner, strings.TrimSpace(out))
	}
	if len(statusOfGW(t, g1).Members) != 0 || len(statusOfGW(t, g2).Members) != 0 {
		t.Fatal("membership changed through a relay")
	}

	// An impostor that does not know the code answers with a made-up
	// proof and a join reply naming itself: the joiner refuses it.
	id, err := replication.LoadOrCreateIdentity(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	fake, err := replication.NewPeerTransport(replication.TransportConfig{Identity: id, Listen: "127.0.0.1:0",
		OnStranger: func(context.Context, replication.Remote, byte, []byte) ([]byte, error) {
			rep, _ := json.Marshal(joinReply{Cluster: "evil", Members: []replication.Member{{ID: id.ID, Name: "evil", Fingerprint: id.Fingerprint, Voter: true}}, Master: "evil"})
			return json.Marshal(pairReply{Reply: rep, MAC: bytes.Repeat([]byte{1}, 32)})
		}})
	if err != nil {
		t.Fatal(err)
	}
	fake.Start()
	t.Cleanup(fake.Close)
	before := statusOfGW(t, g2).Cluster.ID
	exit, out := pairJoin(t, g2, code, fake.Addr().String())
	if exit == 0 || !strings.Contains(out, "did not prove") {
		t.Fatalf("joined an impostor: exit %d: %s", exit, out)
	}
	if s := statusOfGW(t, g2); s.Cluster.ID != before || s.Role != "master" {
		t.Fatalf("the joiner changed after refusing an impostor: cluster %s role %s", s.Cluster.ID, s.Role)
	}
	// The real master still pairs it afterwards (the relays' attempts
	// counted as failures but did not close the pairing).
	if exit, out := pairJoin(t, g2, code, g1.PeerAddr()); exit != 0 {
		t.Fatalf("pair join after the relays: exit %d: %s", exit, out)
	}
}
