package e2e

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tandem-edge/tandem/cluster"
	"github.com/tandem-edge/tandem/replication"
)

// The hostile-device suite's rows against the peer port (issue #31): the
// port faces the LAN and takes strangers' knocks, so a host with a subnet
// of addresses is the attacker here.

// peerTransport is a stranger's peer transport that dials from src: a
// fresh identity, no listener, no membership (only Knock is used).
func (a *attacker) peerTransport(src string) (*replication.PeerTransport, *replication.Identity) {
	a.t.Helper()
	id, err := replication.LoadOrCreateIdentity(a.t.TempDir())
	if err != nil {
		a.t.Fatal(err)
	}
	tr, err := replication.NewPeerTransport(replication.TransportConfig{Identity: id, LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}})
	if err != nil {
		a.t.Fatal(err)
	}
	a.t.Cleanup(tr.Close)
	return tr, id
}

// counts reads a labelled counter family of g's /metrics, by label value.
func counts(a *attacker, g *gw, family, label string, values ...string) map[string]uint64 {
	out := map[string]uint64{}
	for _, v := range values {
		out[v] = metric(a.t, g, fmt.Sprintf("%s{%s=%q}", family, label, v))
	}
	return out
}

// attackPairingGuesses: the owner opens a pairing, and 40 source addresses
// knock on the master's peer port with wrong proofs of the code, in
// parallel, for as long as the row runs (on 89e05a4: 12 checked guesses a
// second). The master checks at most 3 at once and one a second after
// that, from all of them together, and closes the pairing after 5 wrong
// codes: every other knock is refused unchecked.
func attackPairingGuesses(ctx context.Context, a *attacker, g *gw) string {
	m := waitMaster(a.t, time.Now().Add(10*time.Second), a.gws...)
	outcomes := cluster.PairOutcomes[:]
	before := counts(a, m, "tandem_pair_guesses_total", "outcome", outcomes...)
	// On any member: the master holds the code. A cluster of 3 takes no
	// fourth gateway, so there the pairing stays closed, and every knock
	// must be refused unchecked all the same.
	full := len(a.gws) == 3
	if !full {
		g.pairOpen()
	} else if _, err := g.cli("pair", "open"); err == nil || !strings.Contains(err.Error(), "already has 3 gateways") {
		a.t.Errorf("%s: pair open in a cluster of 3: %v, want a refusal", g.name, err)
	}
	began := time.Now()
	addr := m.h.Addr() + ":7883"
	var tries atomic.Int64
	var wg sync.WaitGroup
	for _, src := range a.h.AddAddrs(100, 40) {
		tr, id := a.peerTransport(src)
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = a.h.Do(func() error {
				for ctx.Err() == nil {
					tries.Add(1)
					_, _, err := tr.KnockWith(ctx, addr, [32]byte{}, replication.KnockPair, func(replication.Remote) ([]byte, error) {
						mac := make([]byte, 32)
						_, _ = rand.Read(mac)
						me := replication.Member{ID: id.ID, Name: "guesser", Fingerprint: id.Fingerprint}
						return json.Marshal(cluster.PairRequest{Member: me, MAC: mac})
					})
					if err == nil {
						a.t.Errorf("a random pairing proof from %s was taken", src)
						return nil
					}
				}
				return nil
			})
		}()
	}
	wg.Wait()
	took := time.Since(began)
	after := counts(a, m, "tandem_pair_guesses_total", "outcome", outcomes...)
	d := map[string]uint64{}
	for _, o := range outcomes {
		d[o] = after[o] - before[o]
	}
	// Checked guesses: the burst, then one a second, and never more than
	// the 5 wrong ones that close the pairing.
	checked := d["right"] + d["wrong"]
	if limit := uint64(3 + took/time.Second + 1); checked > limit || d["wrong"] > cluster.PairMaxFailures || d["right"] > 0 {
		a.t.Errorf("pairing under 40 guessing addresses for %v: %v checked (right %d), want at most %d and at most %d wrong",
			took.Round(time.Millisecond), checked, d["right"], limit, cluster.PairMaxFailures)
	}
	if full && checked > 0 {
		a.t.Errorf("a cluster of 3, no pairing open: %d guesses checked", checked)
	}
	if d["over_cap"]+d["closed"] == 0 {
		a.t.Errorf("pairing under 40 guessing addresses: none of %d knocks was refused unchecked: %v", tries.Load(), d)
	}
	if d["wrong"] == cluster.PairMaxFailures {
		if open, _, ok := m.pairingOpen(); !ok || open {
			a.t.Errorf("%s: pairing still open (status answered %v) after %d wrong codes", m.name, ok, d["wrong"])
		}
	}
	return fmt.Sprintf("%d knocks in %v: %d checked (%d wrong), %d over the cap, %d after the pairing closed",
		tries.Load(), took.Round(time.Millisecond), checked, d["wrong"], d["over_cap"], d["closed"])
}

// attackPeerStrangers: 40 source addresses, 4 sockets each, connect to the
// peer port and say nothing, reconnecting as the port closes them, so
// that every stranger slot is held (on 89e05a4: 17 addresses × 4 sockets
// locked out 121 of 122 other strangers' probes, and a real join would
// have been too). Meanwhile a stranger from a fresh address asks what any
// stranger may (a join probe, the first step of a slave's auto failover
// too) every 100 ms: each must be answered, at the latest on a second try
// as `tandem cluster join` would be run again. The members' links and the
// well-behaved device are the monitor's.
func attackPeerStrangers(ctx context.Context, a *attacker, g *gw) string {
	reasons := []string{"per_address", "full", "evicted"}
	before := counts(a, g, "tandem_peer_stranger_refusals_total", "reason", reasons...)
	addr := g.h.Addr() + ":7883"
	var opened atomic.Int64
	var wg sync.WaitGroup
	for _, src := range a.h.AddAddrs(150, 40) {
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_ = a.h.Do(func() error {
					d := net.Dialer{Timeout: 2 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
					for ctx.Err() == nil {
						c, err := d.DialContext(ctx, "tcp", addr)
						if err == nil {
							opened.Add(1)
							stop := context.AfterFunc(ctx, func() { c.Close() })
							var b [1]byte
							_, _ = c.Read(b[:]) // until the port closes it
							stop()
							c.Close()
						}
						// Not a spin: a refused socket comes back in 50 ms.
						select {
						case <-ctx.Done():
						case <-time.After(50 * time.Millisecond):
						}
					}
					return nil
				})
			}()
		}
	}
	prober, _ := a.peerTransport(a.h.Addr())
	probes, retried, failed := 0, 0, 0
	var firstErr error
	probe := func() error {
		return a.h.Do(func() error {
			pctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_, _, err := prober.Knock(pctx, addr, [32]byte{}, replication.KnockJoin, []byte(`{"probe":true}`))
			return err
		})
	}
	tick := time.NewTicker(100 * time.Millisecond)
	for ctx.Err() == nil {
		select {
		case <-ctx.Done():
		case <-tick.C:
			probes++
			if err := probe(); err != nil {
				retried++
				if err = probe(); err != nil {
					failed++
					if firstErr == nil {
						firstErr = err
					}
				}
			}
		}
	}
	tick.Stop()
	wg.Wait()
	after := counts(a, g, "tandem_peer_stranger_refusals_total", "reason", reasons...)
	d := map[string]uint64{}
	for _, r := range reasons {
		d[r] = after[r] - before[r]
	}
	if failed > 0 {
		a.t.Errorf("%s: %d of %d join probes from a fresh address not answered, twice, while 40 addresses held the peer port: %v", g.name, failed, probes, firstErr)
	}
	if d["full"]+d["evicted"] == 0 {
		a.t.Errorf("%s: the peer port's stranger slots never filled (refusals %v): the row tested nothing", g.name, d)
	}
	return fmt.Sprintf("%d sockets; refused %v; %d probes answered (%d on a second try)", opened.Load(), d, probes-failed, retried-failed)
}
