package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/discovery"
	"github.com/tandem-edge/tandem/internal/netns"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// dialIn opens a TCP connection from inside h's namespace.
func dialIn(h *netns.Host, addr string) (net.Conn, error) {
	var c net.Conn
	err := h.Do(func() (err error) {
		c, err = net.DialTimeout("tcp", addr, 3*time.Second)
		return err
	})
	return c, err
}

// gw is one tandem process on a namespace host.
type gw struct {
	t    *testing.T
	name string
	h    *netns.Host
	dir  string
	cfg  string
	proc *netns.Proc
	http *http.Client
}

const clusterConfig = `node:
  name: %s
  data_dir: %s
mqtt:
  listen: "0.0.0.0:1883"
  allow_anonymous: true
peer:
  listen: "0.0.0.0:7883"
http:
  listen: "127.0.0.1:7880"
cluster:
  heartbeat: 100ms
  election_timeout: 1s
  sync_timeout: 5s
%s
topics:
  - match: "s/#"
    ack: sync
discovery:
  mdns: true
  interface: %s
`

// newGW writes a gateway's config on host h; start runs it. cluster adds
// lines to the config's cluster section.
func newGW(t *testing.T, h *netns.Host, name string, cluster ...string) *gw {
	dir := t.TempDir()
	g := &gw{t: t, name: name, h: h, dir: filepath.Join(dir, "data"), cfg: filepath.Join(dir, "tandem.yaml")}
	if err := os.WriteFile(g.cfg, []byte(fmt.Sprintf(clusterConfig, name, g.dir, strings.Join(cluster, "\n"), netns.Iface)), 0o600); err != nil {
		t.Fatal(err)
	}
	g.http = &http.Client{Timeout: 3 * time.Second, Transport: &http.Transport{
		DialContext: func(_ context.Context, _, addr string) (net.Conn, error) { return dialIn(h, addr) },
	}}
	return g
}

// start runs the gateway, with env added to its environment, and waits
// until its HTTP API answers.
func (g *gw) start(env ...string) {
	g.t.Helper()
	cmd := g.h.Command(tandemBin(g.t), "run", "--config", g.cfg)
	if len(env) > 0 {
		cmd.Env = append(os.Environ(), env...)
	}
	g.proc = g.h.Start(cmd)
	g.t.Cleanup(func() {
		if g.t.Failed() {
			g.t.Logf("%s output:\n%s", g.name, g.proc.Output())
		}
	})
	testutil.WaitFor(g.t, 15*time.Second, g.name+" serving", func() bool { return g.status() != nil })
}

// kill stops the process with SIGKILL.
func (g *gw) kill() { g.proc.Stop() }

// stop stops the process with SIGTERM (a clean stop) and waits.
func (g *gw) stop() {
	g.t.Helper()
	_ = g.proc.Cmd.Process.Signal(syscall.SIGTERM)
	if err := g.proc.Wait(15 * time.Second); err != nil {
		g.t.Fatalf("%s: clean stop: %v", g.name, err)
	}
}

// gwStatus is the part of the status JSON these tests read.
type gwStatus struct {
	Role   string `json:"role"`
	Leader *struct {
		Name string `json:"name"`
	} `json:"leader"`
	Members []struct {
		Name       string `json:"name"`
		Voter      bool   `json:"voter"`
		Reachable  bool   `json:"reachable"`
		MatchIndex uint64 `json:"match_index"`
		LagRecords uint64 `json:"lag_records"`
	} `json:"members"`
	Log struct {
		LastIndex uint64 `json:"last_index"`
	} `json:"log"`
	Cluster struct {
		Generation     uint64 `json:"generation"`
		Requeued       uint64 `json:"requeued"`
		RequeuePending int    `json:"requeue_pending"`
	} `json:"cluster"`
	Pairing struct {
		Open bool `json:"open"`
	} `json:"pairing"`
	Node struct {
		ID string `json:"id"`
	} `json:"node"`
	Storage struct {
		Lost    []struct{ First, Last uint64 } `json:"lost"`
		Damaged *struct {
			Dir        string                         `json:"dir"`
			Error      string                         `json:"error"`
			Unreadable []struct{ First, Last uint64 } `json:"unreadable"`
			Resyncing  bool                           `json:"resyncing"`
		} `json:"damaged"`
	} `json:"storage"`
}

// status asks the gateway's HTTP API; nil when it does not answer.
func (g *gw) status() *gwStatus {
	var s gwStatus
	if !g.statusAs(&s) {
		return nil
	}
	return &s
}

// statusAs decodes the gateway's status JSON into v (the fields a test
// reads); false when it does not answer.
func (g *gw) statusAs(v any) bool {
	resp, err := g.http.Get("http://127.0.0.1:7880/v1/status")
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	return resp.StatusCode == 200 && json.NewDecoder(resp.Body).Decode(v) == nil
}

// cli runs a tandem command in the gateway's namespace (so it reaches the
// daemon's loopback HTTP listener) and returns its stdout. Commands that
// talk to the daemon get --config, which tells them where its API token
// is (the data dir is a test's temporary one, not ./tandem-data).
func (g *gw) cli(args ...string) (string, error) {
	switch args[0] {
	case "cluster", "pair", "promote", "status":
		args = append(args, "--config", g.cfg)
	}
	cmd := g.h.Command(tandemBin(g.t), args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	if err != nil {
		return out.String(), fmt.Errorf("tandem %s: %v: %s", strings.Join(args, " "), err, errb.String())
	}
	return out.String(), nil
}

// join has g join the cluster of master, with a token from inviter.
func (g *gw) join(inviter *gw) {
	g.t.Helper()
	out, err := inviter.cli("cluster", "invite")
	if err != nil {
		g.t.Fatal(err)
	}
	tok, _, _ := strings.Cut(out, "\n")
	if _, err := g.cli("cluster", "join", tok); err != nil {
		g.t.Fatal(err)
	}
}

// waitShape waits until master sees the others as voters/learners, caught up.
func waitShape(t *testing.T, master *gw, voters, learners int, within time.Duration) {
	t.Helper()
	var s *gwStatus
	testutil.WaitFor(t, within, fmt.Sprintf("%s seeing %d other voters and %d learners, caught up", master.name, voters, learners), func() bool {
		if s = master.status(); s == nil || s.Role != "master" {
			return false
		}
		v, l := 0, 0
		for _, m := range s.Members {
			if m.Voter {
				v++
			} else {
				l++
			}
			if m.MatchIndex == 0 || !m.Reachable || m.LagRecords > 64 {
				return false
			}
		}
		return v == voters && l == learners
	}, func() string { b, _ := json.Marshal(s); return "status " + string(b) })
}

// device is an MQTT 5 client connected to a gateway from inside its host.
func device(t *testing.T, g *gw, id string, onMsg func(*paho.Publish)) (*paho.Client, error) {
	c, _, err := connectDevice(t, g, &paho.Connect{ClientID: id, CleanStart: true, KeepAlive: 30}, onMsg)
	return c, err
}

// connectDevice is device with the CONNECT given; it also returns the
// CONNACK.
func connectDevice(t *testing.T, g *gw, cp *paho.Connect, onMsg func(*paho.Publish)) (*paho.Client, *paho.Connack, error) {
	conn, err := dialIn(g.h, g.h.Addr()+":1883")
	if err != nil {
		return nil, nil, err
	}
	cfg := paho.ClientConfig{ClientID: cp.ClientID, Conn: conn}
	if onMsg != nil {
		cfg.OnPublishReceived = []func(paho.PublishReceived) (bool, error){func(pr paho.PublishReceived) (bool, error) {
			onMsg(pr.Packet)
			return true, nil
		}}
	}
	c := paho.NewClient(cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ca, err := c.Connect(ctx, cp)
	if err != nil {
		conn.Close()
		return nil, nil, err
	}
	if ca.ReasonCode != 0 {
		conn.Close()
		return nil, nil, fmt.Errorf("connect %s: reason %#x", cp.ClientID, ca.ReasonCode)
	}
	t.Cleanup(func() { conn.Close() })
	return c, ca, nil
}

// load publishes QoS 1 on sync topics from clients spread over gateways,
// one in flight each, reconnecting to the next gateway of its list when
// its connection fails, and remembers every payload acked.
type load struct {
	t     *testing.T
	mu    sync.Mutex
	acked map[string]time.Time
	n     atomic.Int64
	stopc chan struct{}
	wg    sync.WaitGroup
	pace  time.Duration // between one client's publishes; 0: as fast as acks come
}

func startLoad(t *testing.T, clients int, topic string, gws func(i int) []*gw) *load {
	return startPacedLoad(t, clients, topic, gws, 0)
}

// startPacedLoad is startLoad with each client publishing at most once per
// pace: a load a subscriber can follow through a burst of catch-up.
func startPacedLoad(t *testing.T, clients int, topic string, gws func(i int) []*gw, pace time.Duration) *load {
	l := &load{t: t, acked: map[string]time.Time{}, stopc: make(chan struct{}), pace: pace}
	for i := 0; i < clients; i++ {
		l.wg.Add(1)
		go l.run(i, topic, gws(i))
	}
	return l
}

func (l *load) run(i int, topic string, gws []*gw) {
	defer l.wg.Done()
	id := fmt.Sprintf("load-%s-%d", strings.ReplaceAll(topic, "/", "-"), i)
	var c *paho.Client
	var tick <-chan time.Time
	if l.pace > 0 {
		t := time.NewTicker(l.pace)
		defer t.Stop()
		tick = t.C
	}
	for seq, at := 0, 0; ; {
		select {
		case <-l.stopc:
			return
		default:
		}
		if tick != nil {
			select {
			case <-l.stopc:
				return
			case <-tick:
			}
		}
		if c == nil {
			var err error
			if c, err = device(l.t, gws[at%len(gws)], id, nil); err != nil {
				at++
				time.Sleep(50 * time.Millisecond) // a dead gateway refuses at once; don't spin
				continue
			}
		}
		payload := fmt.Sprintf("%s-%d", id, seq)
		ctx, cancel := context.WithTimeout(context.Background(), 8*time.Second)
		r, err := c.Publish(ctx, &paho.Publish{Topic: fmt.Sprintf("%s/%d", topic, i), QoS: 1, Payload: []byte(payload)})
		cancel()
		seq++
		switch {
		case err != nil && r == nil:
			// Connection lost (its gateway killed): try the next one.
			c, at = nil, at+1
		case r.ReasonCode < 0x80:
			l.mu.Lock()
			l.acked[payload] = time.Now()
			l.mu.Unlock()
			l.n.Add(1)
		}
	}
}

// stop ends the load and returns what was acked, and when.
func (l *load) stop() map[string]time.Time {
	close(l.stopc)
	l.wg.Wait()
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.acked
}

// waitAcks waits until the load has n more acks than it had.
func (l *load) waitAcks(t *testing.T, n int64, within time.Duration) {
	t.Helper()
	want := l.n.Load() + n
	testutil.WaitFor(t, within, fmt.Sprintf("%d acks", want), func() bool { return l.n.Load() >= want },
		func() string { return fmt.Sprintf("%d acks", l.n.Load()) })
}

// converge waits, once the load has stopped, until the gateways agree: a
// master among them whose members among them hold its whole log, nothing left to
// re-publish anywhere. An async ack promises the master's disk only, so the
// others may lag behind the last acks until then.
func converge(t *testing.T, within time.Duration, gws ...*gw) {
	t.Helper()
	names := map[string]bool{}
	for _, g := range gws {
		names[g.name] = true
	}
	testutil.WaitFor(t, within, "the gateways converging", func() bool {
		master := false
		for _, g := range gws {
			s := g.status()
			if s == nil || s.Cluster.RequeuePending > 0 {
				return false
			}
			if s.Role != "master" {
				continue
			}
			master = true
			for _, m := range s.Members {
				if names[m.Name] && (m.LagRecords > 0 || !m.Reachable) {
					return false
				}
			}
		}
		return master
	})
}

// payloads reads a stopped gateway's log with tandem inspect: how often
// each payload is in it.
func payloads(t *testing.T, g *gw) map[string]int {
	t.Helper()
	got := map[string]int{}
	for _, p := range logOrder(t, g) {
		got[p]++
	}
	return got
}

// checkAll fails unless every acked payload is in every gateway's log.
func checkAll(t *testing.T, acked map[string]time.Time, gws ...*gw) {
	t.Helper()
	for _, g := range gws {
		logged := payloads(t, g)
		missing := 0
		for p := range acked {
			if logged[p] == 0 {
				missing++
				if missing < 5 {
					t.Errorf("%s: acked %q not in its log", g.name, p)
				}
			}
		}
		if missing > 0 {
			t.Fatalf("%s: %d of %d acked records missing", g.name, missing, len(acked))
		}
		t.Logf("%s: all %d acked records in its log (%d records)", g.name, len(acked), len(logged))
	}
}

func TestThreeGatewaysSurviveMasterKill(t *testing.T) {
	t.Parallel()
	nt := netns.New(t, 3)
	g1, g2, g3 := startThree(t, nt)
	g2.join(g1)
	waitShape(t, g1, 0, 1, 15*time.Second)
	g3.join(g2) // asked on a slave: the master issues the token
	waitShape(t, g1, 2, 0, 15*time.Second)

	// Every gateway is on the LAN, with its live role and cluster.
	out, err := g3.cli("peers", "--json", "--timeout", "2s")
	if err != nil {
		t.Fatal(err)
	}
	var seen []discovery.Peer
	if err := json.Unmarshal([]byte(out), &seen); err != nil {
		t.Fatalf("peers --json: %v: %s", err, out)
	}
	roles := map[string]string{}
	clusters := map[string]bool{}
	for _, p := range seen {
		roles[p.Name] = p.Role
		clusters[p.Cluster] = true
	}
	if roles["gw-1"] != "master" || roles["gw-2"] != "slave" || roles["gw-3"] != "slave" || len(clusters) != 1 {
		t.Fatalf("tandem peers: %s", out)
	}

	// A device on a slave publishes and another on the other slave gets it.
	got := make(chan string, 16)
	sub, err := device(t, g3, "sub3", func(p *paho.Publish) { got <- string(p.Payload) })
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	if _, err := sub.Subscribe(ctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: "hello/#", QoS: 1}}}); err != nil {
		t.Fatal(err)
	}
	cancel()
	pub, err := device(t, g2, "pub2", nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel = context.WithTimeout(context.Background(), 5*time.Second)
	r, err := pub.Publish(ctx, &paho.Publish{Topic: "hello/x", QoS: 1, Payload: []byte("from a slave")})
	cancel()
	if err != nil || r.ReasonCode != 0 {
		t.Fatalf("publish on a slave: %v %+v", err, r)
	}
	select {
	case p := <-got:
		if p != "from a slave" {
			t.Fatalf("got %q", p)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the other slave's subscriber got nothing")
	}

	// Sync load on all three, and two devices on a slave that keep a
	// window of publishes in flight (async and sync): the slave forwards
	// them, and each device's order must survive the kill. Kill -9 the
	// master.
	l := startLoad(t, 6, "s/load", func(i int) []*gw {
		all := []*gw{g1, g2, g3}
		return []*gw{all[i%3], all[(i+1)%3], all[(i+2)%3]}
	})
	ord := []*windowPublisher{startWindowPublisher(t, g2, "ord-a", "ord/a", 16), startWindowPublisher(t, g2, "ord-s", "s/ord", 16)}
	l.waitAcks(t, 300, 20*time.Second)
	killed := time.Now()
	g1.kill()
	atKill := make([]int, len(ord))
	for i, p := range ord {
		atKill[i] = p.ackedCount()
	}
	master := waitMaster(t, killed.Add(5*time.Second), g2, g3)
	elected := time.Since(killed)
	l.waitAcks(t, 300, 20*time.Second)
	for i, p := range ord {
		testutil.WaitFor(t, 20*time.Second, p.id+" acked after the kill", func() bool { return p.ackedCount() > atKill[i]+100 })
	}
	for _, p := range ord {
		if err := p.stop(); err != nil {
			t.Errorf("%s lost its connection to the slave: %v", p.id, err)
		}
	}
	acked := l.stop()
	// The write pause: the longest gap between acks once the master died.
	var times []time.Time
	for _, at := range acked {
		times = append(times, at)
	}
	slices.SortFunc(times, func(a, b time.Time) int { return a.Compare(b) })
	var pause time.Duration
	for i := 1; i < len(times); i++ {
		if times[i].After(killed) {
			pause = max(pause, times[i].Sub(times[i-1]))
		}
	}
	t.Logf("master killed: %s elected after %v; longest pause between acks %v; %d acked", master.name, elected.Round(time.Millisecond), pause.Round(time.Millisecond), len(acked))
	converge(t, 20*time.Second, g2, g3)
	g2.stop()
	g3.stop()
	checkAll(t, acked, g2, g3)
	checkOrder(t, g2, ord...)
	checkOrder(t, g3, ord...)
}

func TestGrowAndShrinkUnderLoad(t *testing.T) {
	t.Parallel()
	nt := netns.New(t, 3)
	g1, g2, g3 := startThree(t, nt)
	g2.join(g1)
	waitShape(t, g1, 0, 1, 15*time.Second)
	l := startLoad(t, 4, "s/grow", func(i int) []*gw { return []*gw{[]*gw{g1, g2}[i%2]} })
	l.waitAcks(t, 200, 20*time.Second)
	// Retained messages set before the third gateway joins, one of them
	// cleared again: it must hold the same set as the others.
	retained := map[string]string{"ret/a": "1", "ret/b": "2"}
	for topic, p := range retained {
		publishRetained(t, g1, topic, p)
	}
	publishRetained(t, g2, "ret/gone", "x")
	publishRetained(t, g1, "ret/gone", "")
	g3.join(g1) // 2 → 3 under load
	waitShape(t, g1, 2, 0, 20*time.Second)
	l.waitAcks(t, 200, 20*time.Second)
	sameRetained(t, g1, retained, g1, g2, g3)
	if _, err := g2.cli("cluster", "remove", "gw-3"); err != nil { // 3 → 2, asked on a slave
		t.Fatal(err)
	}
	waitShape(t, g1, 0, 1, 20*time.Second)
	l.waitAcks(t, 200, 20*time.Second)
	acked := l.stop()
	converge(t, 20*time.Second, g1, g2)
	g1.stop()
	g2.stop()
	checkAll(t, acked, g1, g2)
}

func TestMasterFoundAgainAfterAddressChange(t *testing.T) {
	// Mostly waiting (a cut, a slow link, a lease, mDNS), on a network of
	// its own: it runs beside the other waiting ones (make test's time).
	t.Parallel()
	nt := netns.New(t, 2)
	g1, _ := startPair(t, nt)
	// The master's DHCP lease changes: the slave knows only the old
	// address and must find it again by mDNS.
	nt.Hosts[0].SetAddr("101")
	moved := time.Now()
	pub, err := device(t, g1, "pub", nil)
	if err != nil {
		t.Fatal(err)
	}
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 6*time.Second)
		r, err := pub.Publish(ctx, &paho.Publish{Topic: "s/moved", QoS: 1, Payload: []byte("x")})
		cancel()
		if r == nil {
			t.Fatal(err)
		}
		if r.ReasonCode == 0 {
			break // a sync ack: the slave has it again
		}
		if time.Since(moved) > 30*time.Second {
			t.Fatalf("replication did not resume within 30 s of the address change (reason %#x)", r.ReasonCode)
		}
	}
	t.Logf("replication resumed %v after the master's address changed", time.Since(moved).Round(time.Millisecond))
	waitShape(t, g1, 0, 1, 10*time.Second)
}

// waitMaster waits until one of gws is master, at the latest by deadline.
func waitMaster(t *testing.T, deadline time.Time, gws ...*gw) *gw {
	t.Helper()
	var master *gw
	testutil.WaitFor(t, time.Until(deadline), "a master among the gateways", func() bool {
		for _, g := range gws {
			if s := g.status(); s != nil && s.Role == "master" {
				master = g
				return true
			}
		}
		return false
	})
	return master
}
