package daemon

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/admin"
	"github.com/tandem-edge/tandem/cluster"
	"github.com/tandem-edge/tandem/internal/testutil"
	"github.com/tandem-edge/tandem/replication"
)

func init() {
	// The gateways of these tests derive keys often; the real cost is
	// checked once, in TestPairKey.
	cluster.PairKDFCost = 1 << 10
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
	if _, err := cluster.ParsePairCode(first); err != nil {
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
	testutil.WaitFor(t, 10*time.Second, "gw-2 a caught-up learner", func() bool {
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
	testutil.WaitFor(t, 5*time.Second, "the short code to expire", func() bool { return !statusOfGW(t, g1).Pairing.Open })
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
	testutil.WaitFor(t, 15*time.Second, "three voters", func() bool {
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

// TestPairClosesAfterFiveWrongCodes: five wrong proofs in total close
// the pairing, as docs/clusters.md says, whoever sent them: the real joiner is
// refused with the code and told to open a new one, and pairs with the
// code of the next pair open.
func TestPairClosesAfterFiveWrongCodes(t *testing.T) {
	g1 := clusterGateway(t, "gw-1", nil)
	g2 := clusterGateway(t, "gw-2", nil)
	// Each reading of the master's clock is 1.1 s after the last: the
	// stranger's attempts pass the rate limit without the test waiting.
	base := time.Now()
	var ticks atomic.Int64
	g1.gw.Internals().SetPairClock(func() time.Time { return base.Add(time.Duration(ticks.Add(1)) * 1100 * time.Millisecond) })
	code := pairOpen(t, g1)

	sid, err := replication.LoadOrCreateIdentity(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	stranger := replication.Member{ID: sid.ID, Name: "stranger", Fingerprint: sid.Fingerprint}
	r := replication.Remote{ID: sid.ID, Fingerprint: sid.Fingerprint, Addr: "127.0.0.2:40000", Binding: make([]byte, 32)}
	wrongKey := cluster.PairKey("000000000000")
	proof, _ := json.Marshal(cluster.PairRequest{Member: stranger, MAC: cluster.PairMAC(wrongKey, cluster.PairRoleJoiner, sid.Fingerprint, g1.gw.Self().Fingerprint, r.Binding, nil)})
	for i := range cluster.PairMaxFailures + 2 {
		_, err := g1.gw.Internals().OnPair(t.Context(), r, proof)
		want := cluster.ErrPairWrong
		if i >= cluster.PairMaxFailures {
			want = cluster.ErrPairLocked
		}
		if !errors.Is(err, want) {
			t.Fatalf("stranger's attempt %d: %v, want %v", i+1, err, want)
		}
	}
	if s := statusOfGW(t, g1); s.Pairing.Open {
		t.Fatal("still open after five wrong codes")
	}
	mfs := scrape(t, g1)
	if w, c := value(mfs, "tandem_pair_guesses_total", "outcome", "wrong"), value(mfs, "tandem_pair_guesses_total", "outcome", "closed"); w != cluster.PairMaxFailures || c != 2 {
		t.Fatalf("tandem_pair_guesses_total: wrong %v, closed %v; want %d and 2", w, c, cluster.PairMaxFailures)
	}
	if v := value(mfs, "tandem_peer_stranger_refusals_total", "reason", "evicted"); v != 0 {
		t.Fatalf("tandem_peer_stranger_refusals_total{reason=evicted} %v, want 0", v)
	}
	if exit, out := pairJoin(t, g2, code, g1.PeerAddr()); exit == 0 || !strings.Contains(out, "tandem pair open") {
		t.Fatalf("the real joiner once closed: exit %d: %s", exit, out)
	}
	if exit, out := pairJoin(t, g2, pairOpen(t, g1), g1.PeerAddr()); exit != 0 || !strings.Contains(out, "paired") {
		t.Fatalf("the real joiner with a new code: exit %d: %s", exit, out)
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
				var req cluster.PairRequest
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
			rep, _ := json.Marshal(cluster.JoinReply{Cluster: "evil", Members: []replication.Member{{ID: id.ID, Name: "evil", Fingerprint: id.Fingerprint, Voter: true}}, Master: "evil"})
			return json.Marshal(cluster.PairReply{Reply: rep, MAC: bytes.Repeat([]byte{1}, 32)})
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
