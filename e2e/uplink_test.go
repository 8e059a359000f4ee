package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/internal/cloudtest"
	"github.com/tandem-edge/tandem/internal/netns"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// uplinkConfig is the uplinks section the gateways of these tests share:
// dev/# goes to the cloud as site/dev/#, the cloud's cmd/# comes down as
// down/cmd/#. extra adds keys to the uplink.
const uplinkConfig = `uplinks:
  - name: cloud
    broker: tcp://%s
    topics:
      - match: dev/#
        remote_prefix: site/
    downlink:
      - remote: cmd/#
        local_prefix: down/
    keepalive: 2s
    reconnect_min: 100ms
    reconnect_max: 500ms
%s`

// withUplink appends the uplink to g's config.
func withUplink(t *testing.T, g *gw, cloud *cloudtest.Cloud, extra string) {
	t.Helper()
	f, err := os.OpenFile(g.cfg, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := fmt.Fprintf(f, uplinkConfig, cloud.Addr(), extra); err != nil {
		t.Fatal(err)
	}
}

// startCloud runs mosquitto on host h, port 1883, and a recorder of what
// arrives under site/.
func startCloud(t *testing.T, h *netns.Host) (*cloudtest.Cloud, *cloudtest.Recorder, func() (net.Conn, error)) {
	t.Helper()
	cloud := cloudtest.StartIn(t, h.Addr(), 1883, h.Command, func(addr string) (net.Conn, error) { return dialIn(h, addr) })
	dial := func() (net.Conn, error) { return dialIn(h, cloud.Addr()) }
	return cloud, cloudtest.Record(t, dial, "site/#"), dial
}

// uplinkState is the uplinks part of a gateway's status.
type uplinkState struct {
	Name           string `json:"name"`
	Connected      bool   `json:"connected"`
	Running        bool   `json:"running"`
	Paused         bool   `json:"paused"`
	BacklogRecords int64  `json:"backlog_records"`
	Position       uint64 `json:"position"`
	LastError      string `json:"last_error"`
}

func (g *gw) uplink() *uplinkState {
	resp, err := g.http.Get("http://127.0.0.1:7880/v1/status")
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	var s struct {
		Uplinks []uplinkState `json:"uplinks"`
	}
	if json.NewDecoder(resp.Body).Decode(&s) != nil || len(s.Uplinks) != 1 {
		return nil
	}
	return &s.Uplinks[0]
}

// cloudCheck compares what the cloud received with what was acked: every
// acked payload arrived, each publisher's first arrivals in the order it
// published; it returns the duplicates.
func cloudCheck(t *testing.T, rec *cloudtest.Recorder, acked map[string]time.Time) (dups int) {
	t.Helper()
	seen := map[string]bool{}
	last := map[string]int{}
	for _, m := range rec.Msgs() {
		if seen[m.Payload] {
			dups++
			continue
		}
		seen[m.Payload] = true
		i := strings.LastIndexByte(m.Payload, '-')
		pub := m.Payload[:i]
		n, _ := strconv.Atoi(m.Payload[i+1:])
		if p, ok := last[pub]; ok && n < p {
			t.Errorf("%s: %d arrived at the cloud after %d", pub, n, p)
		}
		last[pub] = n
	}
	missing := 0
	for p := range acked {
		if !seen[p] {
			missing++
		}
	}
	if missing > 0 {
		t.Fatalf("%d of %d acked records never reached the cloud", missing, len(acked))
	}
	return dups
}

// waitCloud waits until every acked payload has reached the cloud.
func waitCloud(t *testing.T, rec *cloudtest.Recorder, acked map[string]time.Time, within time.Duration) {
	t.Helper()
	testutil.WaitFor(t, within, fmt.Sprintf("%d acked records at the cloud", len(acked)), func() bool {
		seen := map[string]bool{}
		for _, m := range rec.Msgs() {
			seen[m.Payload] = true
		}
		for p := range acked {
			if !seen[p] {
				return false
			}
		}
		return true
	}, func() string { n, _ := rec.Distinct(); return fmt.Sprintf("%d distinct at the cloud", n) })
}

// The uplink cut with iptables under load from several devices, then
// healed: every acked record reaches the cloud, in per-device order; the
// duplicates are only what the cut's in-flight window sent again.
func TestUplinkCutAndHealedUnderLoad(t *testing.T) {
	t.Parallel()
	netns.Skip(t, "iptables")
	nt := netns.New(t, 2)
	cloud, rec, _ := startCloud(t, nt.Hosts[1])
	g := newGW(t, nt.Hosts[0], "gw-1")
	withUplink(t, g, cloud, "")
	g.start()
	testutil.WaitFor(t, 10*time.Second, "the uplink connected", func() bool { u := g.uplink(); return u != nil && u.Connected })
	l := startPacedLoad(t, 4, "dev", func(int) []*gw { return []*gw{g} }, 5*time.Millisecond)
	l.waitAcks(t, 200, 10*time.Second)
	nt.Cut(nt.Hosts[0], nt.Hosts[1])
	cut := time.Now()
	testutil.WaitFor(t, 10*time.Second, "the uplink to notice the cut", func() bool { u := g.uplink(); return u != nil && !u.Connected })
	l.waitAcks(t, 300, 10*time.Second) // devices are not held up by the cut
	for time.Since(cut) < 6*time.Second {
		l.waitAcks(t, 1, 5*time.Second)
	}
	if u := g.uplink(); u == nil || u.BacklogRecords == 0 {
		t.Fatalf("no backlog during the cut: %+v", u)
	}
	nt.Heal(nt.Hosts[0], nt.Hosts[1])
	l.waitAcks(t, 100, 10*time.Second)
	acked := l.stop()
	waitCloud(t, rec, acked, 30*time.Second)
	dups := cloudCheck(t, rec, acked)
	resent := metric(t, g, `tandem_uplink_resent_total{uplink="cloud"}`)
	t.Logf("%d acked, all at the cloud after a %v cut; %d duplicates, %d resent", len(acked), time.Since(cut).Round(time.Second), dups, resent)
	if uint64(dups) > resent {
		t.Errorf("%d duplicates at the cloud, more than the %d messages the uplink resent", dups, resent)
	}
	g.stop()
}

// metric reads one sample of g's /metrics.
func metric(t *testing.T, g *gw, name string) uint64 {
	t.Helper()
	resp, err := g.http.Get("http://127.0.0.1:7880/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var b strings.Builder
	buf := make([]byte, 32<<10)
	for {
		n, err := resp.Body.Read(buf)
		b.Write(buf[:n])
		if err != nil {
			break
		}
	}
	for _, line := range strings.Split(b.String(), "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			f, _ := strconv.ParseFloat(v, 64)
			return uint64(f)
		}
	}
	t.Fatalf("/metrics has no %s", name)
	return 0
}

// Three gateways; the master is killed -9 while its uplink drains a
// backlog: the new master resumes from the replicated position, nothing
// acked is missing at the cloud, and the duplicates stay within the
// window since the last replicated position. A downlink message reaches
// a device on a slave, once.
func TestUplinkMasterKilledWhileDraining(t *testing.T) {
	t.Parallel()
	nt := netns.New(t, 4)
	cloud, rec, dial := startCloud(t, nt.Hosts[3])
	const rate = uplinkRate
	gws := []*gw{newGW(t, nt.Hosts[0], "gw-1"), newGW(t, nt.Hosts[1], "gw-2"), newGW(t, nt.Hosts[2], "gw-3")}
	for _, g := range gws {
		withUplink(t, g, cloud, fmt.Sprintf("    rate: %d\n", rate))
		g.start()
	}
	g1, g2, g3 := gws[0], gws[1], gws[2]
	g2.join(g1)
	waitShape(t, g1, 0, 1, 15*time.Second)
	g3.join(g1)
	waitShape(t, g1, 2, 0, 15*time.Second)
	testutil.WaitFor(t, 10*time.Second, "the master's uplink connected", func() bool { u := g1.uplink(); return u != nil && u.Connected })
	for _, g := range []*gw{g2, g3} {
		if u := g.uplink(); u == nil || u.Running {
			t.Fatalf("%s, a slave, runs the uplink: %+v", g.name, u)
		}
	}
	// A pause asked of a slave holds the master's uplink; a resume asked
	// of the other slave lets it go.
	if _, err := g2.cli("uplink", "pause", "cloud", "--config", g2.cfg); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 5*time.Second, "the master's uplink paused", func() bool { u := g1.uplink(); return u != nil && u.Paused && !u.Connected })
	if _, err := g3.cli("uplink", "resume", "cloud", "--config", g3.cfg); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 5*time.Second, "the master's uplink resumed", func() bool { u := g1.uplink(); return u != nil && !u.Paused && u.Connected })

	// The downlink reaches a device on a slave, once.
	got := make(chan string, 4)
	sub, err := device(t, g3, "listener", func(p *paho.Publish) { got <- p.Topic + " " + string(p.Payload) })
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	_, err = sub.Subscribe(ctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: "down/#", QoS: 1}}})
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	cloudtest.Publish(t, dial, "cmd/valve", "open")
	select {
	case m := <-got:
		if m != "down/cmd/valve open" {
			t.Fatalf("downlink delivered %q", m)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the downlink message did not reach the device on a slave")
	}

	acked := drainThenKill(t, rec, g1, gws, rate)
	select {
	case m := <-got:
		t.Errorf("the downlink message came twice: %q", m)
	default:
	}
	master := waitMaster(t, time.Now().Add(10*time.Second), g2, g3)
	resumedAt(t, rec, acked, master, rate)
	for _, g := range []*gw{g2, g3} {
		g.stop()
	}
}

// uplinkRate is the uplinks' rate cap in the kill tests, msg/s: the
// drain takes seconds, and the kill lands in it.
const uplinkRate = 400

// drainThenKill builds a backlog on master's paused uplink from devices
// on every gateway of gws, lets it drain at rate, and kills -9 the master
// once the cloud has some of it. It returns what the devices had acked.
func drainThenKill(t *testing.T, rec *cloudtest.Recorder, master *gw, gws []*gw, rate int) map[string]time.Time {
	t.Helper()
	if _, err := master.cli("uplink", "pause", "cloud", "--config", master.cfg); err != nil {
		t.Fatal(err)
	}
	l := startLoad(t, 4, "dev", func(i int) []*gw { return []*gw{gws[i%len(gws)]} })
	l.waitAcks(t, int64(3*rate), 20*time.Second)
	acked := l.stop()
	converge(t, 20*time.Second, gws...)
	if _, err := master.cli("uplink", "resume", "cloud", "--config", master.cfg); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 10*time.Second, "the drain under way", func() bool { n, _ := rec.Distinct(); return n >= rate/2 })
	master.kill()
	n, _ := rec.Distinct()
	t.Logf("%d acked; %d at the cloud when %s was killed", len(acked), n, master.name)
	return acked
}

// resumedAt checks that the new master's uplink finishes the drain: every
// acked record at the cloud, in per-device order, and the duplicates
// within the window since the last replicated position (saved every
// 100 ms, committed a moment later) plus the in-flight window.
func resumedAt(t *testing.T, rec *cloudtest.Recorder, acked map[string]time.Time, master *gw, rate int) {
	t.Helper()
	testutil.WaitFor(t, 10*time.Second, "the new master's uplink connected", func() bool { u := master.uplink(); return u != nil && u.Connected })
	waitCloud(t, rec, acked, 30*time.Second)
	dups := cloudCheck(t, rec, acked)
	window := 2*rate/10 + 64
	t.Logf("%s resumed; %d duplicates (bound %d)", master.name, dups, window)
	if dups > window {
		t.Errorf("%d duplicates at the cloud, more than the window of %d", dups, window)
	}
}

// Two gateways; the master is killed -9 while its uplink drains, and the
// slave is promoted: it resumes from the replicated position.
func TestUplinkMasterKilledWhileDrainingPromoted(t *testing.T) {
	t.Parallel()
	nt := netns.New(t, 3)
	cloud, rec, _ := startCloud(t, nt.Hosts[2])
	g1, g2 := newGW(t, nt.Hosts[0], "gw-1"), newGW(t, nt.Hosts[1], "gw-2")
	for _, g := range []*gw{g1, g2} {
		withUplink(t, g, cloud, fmt.Sprintf("    rate: %d\n", uplinkRate))
		g.start()
	}
	g2.join(g1)
	waitShape(t, g1, 0, 1, 15*time.Second)
	testutil.WaitFor(t, 10*time.Second, "the master's uplink connected", func() bool { u := g1.uplink(); return u != nil && u.Connected })
	acked := drainThenKill(t, rec, g1, []*gw{g1, g2}, uplinkRate)
	testutil.WaitFor(t, 20*time.Second, "tandem promote on the slave", func() bool { _, err := g2.cli("promote"); return err == nil })
	resumedAt(t, rec, acked, g2, uplinkRate)
	g2.stop()
}
