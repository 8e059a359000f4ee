package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/internal/netns"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// The hostile-device suite (issue #31; DESIGN.md, "Budgets: what one device
// may take"): seeded attacks of the kinds a device whose firmware nobody here
// wrote can make, against a lone gateway and a 2- and a 3-member cluster of
// real processes. Throughout and after, for every member: it runs, its
// /v1/status answers within 1 s, its anonymous RSS stays within
// limits.memory + 64 MiB (file pages beside: rssSlack) and its data dir
// within storage.max_bytes + the documented slack; a
// well-behaved device publishing QoS 1 alongside is answered every time
// (acked, or 0x97 while a budget is full; never left hanging), and every
// record acked to it is in every member's log at the end; each member stops
// on SIGTERM within 5 s.
//
// TANDEM_HOSTILE_SEED replays a run; TANDEM_HOSTILE_LONG=1 runs each attack
// for longer (make test runs the short form); TANDEM_HOSTILE_ONLY=text runs
// only the rows whose name holds text.

const (
	hostileMemory   = 64 << 20 // limits.memory of the gateways under attack
	hostileMaxBytes = 64 << 20 // their storage.max_bytes
	// rssSlack is what the process may hold beside limits.memory (the
	// issue's bound), in anonymous memory: the pages it allocated itself.
	// Its file-backed resident pages (RssFile: the binary, 17 MiB, and
	// the data file's pages mapped between two releases, 20-28 MiB under
	// these floods) are clean page cache the kernel reclaims under
	// pressure, a property of the host's page cache rather than memory
	// tandem holds; VmHWM, which counts both, may have fileSlack more.
	// dirSlack is what the data dir may hold past max_bytes under the
	// floods below: 0.5-9.6 MiB measured on a 64 MiB budget (storage's
	// 2 MiB slack, the WAL grown to 3-4 MiB by 1 MB records ahead of a
	// checkpoint, and free pages the 100 KB retained messages, single
	// values, do not fit). It was 40 MiB (12-33 MiB measured, 27-31 MiB
	// in the 2-member suite) before the log stored records of many pages
	// in pieces of a page.
	rssSlack  = 64 << 20
	fileSlack = 48 << 20
	dirSlack  = 12 << 20
)

// hostileConfig is added to each gateway's config: small budgets, so that
// the attacks reach them.
var hostileConfig = fmt.Sprintf(`limits:
  memory: %d
storage:
  max_bytes: %d`, hostileMemory, hostileMaxBytes)

func TestHostileDevicesLoneGateway(t *testing.T)   { runHostile(t, 1) }
func TestHostileDevicesTwoGateways(t *testing.T)   { runHostile(t, 2) }
func TestHostileDevicesThreeGateways(t *testing.T) { runHostile(t, 3) }

// attack is one row of the table: it runs against target from the
// attacker's host until ctx ends (or it is done), and says what it did.
type attack struct {
	name string
	run  func(ctx context.Context, a *attacker, target *gw) string
}

// attacker reaches the gateways from a host of its own.
type attacker struct {
	t   *testing.T
	h   *netns.Host
	rng *rand.Rand
	gws []*gw // every member, for a row that must find the master
}

func (a *attacker) dial(g *gw) (net.Conn, error) {
	return dialIn(a.h, g.h.Addr()+":1883")
}

// hostileAttacks are the rows, in the order a seed shuffles.
func hostileAttacks() []attack {
	return []attack{
		{"wills and publishes on control topics", attackControlTopics},
		{"two clients flooding 256 KiB QoS 0 publishes", attackLargeQoS0Flood},
		{"persistent sessions with 60 KB client ids", attackLongClientIDs},
		{"protocol errors the codec lets through", attackProtocolErrors},
		{"retained messages of 100 KB", attackRetainedFlood},
		{"persistent sessions of 1 KB filters", attackSessionFilters},
		{"a subscriber that never acks 1 MB messages", attackNeverAcks},
		{"one SUBSCRIBE of 2000 × # over 1000 retained", attackRepeatedFilter},
		{"WebSocket sockets that send one plain GET and idle", attackWebSocketIdle},
		{"keep-alive connections holding the HTTP API", attackHTTPHogs},
		{"40 addresses guessing the pairing code in parallel", attackPairingGuesses},
		{"40 addresses × 4 sockets holding the peer port", attackPeerStrangers},
	}
}

func runHostile(t *testing.T, members int) {
	seed := testSeed(t, "TANDEM_HOSTILE_SEED")
	t.Logf("seed %d (replay with TANDEM_HOSTILE_SEED=%d)", seed, seed)
	each := 3 * time.Second
	if os.Getenv("TANDEM_HOSTILE_LONG") != "" {
		each = 30 * time.Second
	}
	rows := hostileAttacks()
	if only := os.Getenv("TANDEM_HOSTILE_ONLY"); only != "" {
		rows = slices.DeleteFunc(rows, func(r attack) bool { return !strings.Contains(r.name, only) })
	}
	// The members, the well-behaved device, and an attacker host per row:
	// an address's connect rate and connection caps hold one row's
	// attacker, not the next one's.
	nt := netns.New(t, members+1+len(rows))
	var gws []*gw
	for i := range members {
		g := newGW(t, nt.Hosts[i], fmt.Sprintf("gw-%d", i+1), hostileConfig)
		exposeListeners(t, g)
		g.start()
		gws = append(gws, g)
	}
	for i, g := range gws[1:] {
		g.join(gws[0])
		if i == 0 {
			waitShape(t, gws[0], 0, 1, 15*time.Second)
		} else {
			waitShape(t, gws[0], 2, 0, 20*time.Second)
		}
	}
	rng := rand.New(rand.NewPCG(seed, seed>>1))
	mon := watchMembers(t, gws)
	polite := startPolite(t, nt.Hosts[members], gws)

	rng.Shuffle(len(rows), func(i, j int) { rows[i], rows[j] = rows[j], rows[i] })
	for i, row := range rows {
		a := &attacker{t: t, h: nt.Hosts[members+1+i], rng: rng, gws: gws}
		target := gws[rng.IntN(len(gws))]
		ctx, cancel := context.WithTimeout(context.Background(), each)
		start := time.Now()
		did := row.run(ctx, a, target)
		cancel()
		t.Logf("%s on %s (%v): %s", row.name, target.name, time.Since(start).Round(time.Millisecond), did)
		mon.check(t, row.name)
	}
	// A quiet spell: what the device publishes once the attacks are over
	// must be on every member whatever retention dropped during them.
	quiet := polite.sent.Load()
	testutil.WaitFor(t, 10*time.Second, "the well-behaved device publishing after the attacks", func() bool { return polite.sent.Load() >= quiet+20 })
	acked := polite.stop(t)
	mon.stop(t)
	if len(acked) == 0 {
		t.Fatal("the well-behaved device got no ack during the attacks")
	}
	for _, g := range gws {
		hwm := vmHWM(t, g)
		t.Logf("%s: peak RSS %d MiB (limit %d + %d MiB; RssAnon peak %d MiB, RssFile %d MiB), data dir peak %.1f MiB (budget %d + %.1f MiB: %s)",
			g.name, hwm>>20, hostileMemory>>20, rssSlack>>20, mon.anonPeak[g.name]>>20, mon.filePeak[g.name]>>20,
			float64(mon.dirPeak[g.name])/(1<<20), hostileMaxBytes>>20, float64(dirSlack)/(1<<20), mon.dirAt[g.name])
		if anon := mon.anonPeak[g.name]; anon > hostileMemory+rssSlack {
			t.Errorf("%s: anonymous RSS peaked at %d MiB, over limits.memory + %d MiB", g.name, anon>>20, rssSlack>>20)
		}
		if hwm > hostileMemory+rssSlack+fileSlack {
			t.Errorf("%s: peak RSS %d MiB over limits.memory + %d MiB + %d MiB of file pages", g.name, hwm>>20, rssSlack>>20, fileSlack>>20)
		}
		if p := mon.dirPeak[g.name]; p > hostileMaxBytes+dirSlack {
			t.Errorf("%s: data dir reached %d MiB over storage.max_bytes + %d MiB (%s)", g.name, p>>20, dirSlack>>20, mon.dirAt[g.name])
		}
	}
	converge(t, 20*time.Second, gws...)
	for _, g := range gws {
		stopWithin(t, g, 5*time.Second)
	}
	checkKept(t, acked, gws...)
}

// checkKept fails unless every acked payload the log should still hold
// is in every member's log: retention drops the oldest records of a log
// that reached storage.max_bytes (the floods see to it), a front of the log
// in index order. The well-behaved device has one publish in flight at a
// time, so its acked records are in the log in the order it sent them:
// from the oldest of them kept on, every one must be there, the newest
// included. (Publish times do not tell: a flood's records, stamped when a
// slave received them, reached the master's log up to 400 ms later, after
// records of the device acked meanwhile, which retention then dropped
// before them; a margin of 100 ms after the oldest record kept failed.)
func checkKept(t *testing.T, acked map[string]time.Time, gws ...*gw) {
	t.Helper()
	seqs := make([]int, 0, len(acked))
	for p := range acked {
		var n int
		if _, err := fmt.Sscanf(p, "polite-%d", &n); err != nil {
			t.Fatalf("acked payload %q", p)
		}
		seqs = append(seqs, n)
	}
	slices.Sort(seqs)
	for _, g := range gws {
		recs := inspectTimes(t, g)
		logged := map[string]bool{}
		for _, r := range recs {
			logged[r.payload] = true
		}
		kept := slices.IndexFunc(seqs, func(n int) bool { return logged[fmt.Sprintf("polite-%d", n)] })
		if kept < 0 {
			t.Fatalf("%s: none of the %d acked records in its log (%d records)", g.name, len(seqs), len(recs))
		}
		missing := 0
		for _, n := range seqs[kept:] {
			if p := fmt.Sprintf("polite-%d", n); !logged[p] {
				missing++
				if missing < 5 {
					t.Errorf("%s: acked %q (at %s) not in its log, which holds polite-%d", g.name, p, acked[p].Format(time.StampMilli), seqs[kept])
				}
			}
		}
		if missing > 0 {
			t.Fatalf("%s: %d of the %d acked records from the oldest kept on missing", g.name, missing, len(seqs)-kept)
		}
		t.Logf("%s: the %d acked records from the oldest kept on (of %d acked) are in its log (%d records)", g.name, len(seqs)-kept, len(acked), len(recs))
	}
}

type timedRecord struct {
	payload string
	at      time.Time
}

// inspectTimes reads a stopped gateway's log: payload and publish time of
// each record.
func inspectTimes(t *testing.T, g *gw) []timedRecord {
	t.Helper()
	out, err := exec.Command(tandemBin(t), "inspect", "--data", g.dir, "--json").Output()
	if err != nil {
		t.Fatalf("inspect %s: %v", g.name, err)
	}
	var recs []timedRecord
	dec := json.NewDecoder(bytes.NewReader(out))
	for dec.More() {
		var r struct {
			Payload string `json:"payload"`
			Time    string `json:"time"`
		}
		if err := dec.Decode(&r); err != nil {
			t.Fatal(err)
		}
		b, _ := base64.StdEncoding.DecodeString(r.Payload)
		at, err := time.Parse(time.RFC3339Nano, r.Time)
		if err != nil {
			t.Fatalf("inspect %s: time %q: %v", g.name, r.Time, err)
		}
		recs = append(recs, timedRecord{string(b), at})
	}
	return recs
}

// exposeListeners opens a gateway's WebSocket listener (port 8080) and
// its HTTP API (7880) on the LAN, where the attackers are.
func exposeListeners(t *testing.T, g *gw) {
	t.Helper()
	b, err := os.ReadFile(g.cfg)
	if err != nil {
		t.Fatal(err)
	}
	s := strings.Replace(string(b), "  allow_anonymous: true\n", "  allow_anonymous: true\n  websocket:\n    listen: \"0.0.0.0:8080\"\n", 1)
	s = strings.Replace(s, `  listen: "127.0.0.1:7880"`, `  listen: "0.0.0.0:7880"`, 1)
	if err := os.WriteFile(g.cfg, []byte(s), 0o600); err != nil {
		t.Fatal(err)
	}
}

// stopWithin sends SIGTERM and fails unless the process is gone within d.
func stopWithin(t *testing.T, g *gw, d time.Duration) {
	t.Helper()
	_ = g.proc.Cmd.Process.Signal(syscall.SIGTERM)
	if err := g.proc.Wait(d); err != nil {
		// A hang: the goroutine dump says where.
		_ = g.proc.Cmd.Process.Signal(syscall.SIGQUIT)
		_ = g.proc.Wait(5 * time.Second)
		out := g.proc.Output()
		if i := strings.Index(out, "SIGQUIT"); i >= 0 {
			out = out[i:]
		}
		t.Fatalf("%s: not stopped within %v of SIGTERM: %v; goroutines:\n%s", g.name, d, err, tail(out, 60000))
	}
}

// vmHWM is the process's peak resident set (VmHWM), in bytes.
func vmHWM(t *testing.T, g *gw) int64 {
	t.Helper()
	v, ok := procStatus(g)["VmHWM"]
	if !ok {
		t.Fatalf("%s: no VmHWM in /proc/%d/status", g.name, g.proc.Cmd.Process.Pid)
	}
	return v
}

// procStatus reads the kB fields of the process's /proc status, in bytes.
func procStatus(g *gw) map[string]int64 {
	out := map[string]int64{}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", g.proc.Cmd.Process.Pid))
	if err != nil {
		return out
	}
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok || !strings.HasSuffix(v, " kB") {
			continue
		}
		if kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(v, " kB")), 10, 64); err == nil {
			out[k] = kb << 10
		}
	}
	return out
}

// dirBytes is what the data dir takes on disk (allocated blocks), and
// what each file takes.
func dirBytes(dir string) (int64, string) {
	var n int64
	var files []string
	_ = filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return nil
		}
		if fi, err := d.Info(); err == nil {
			if st, ok := fi.Sys().(*syscall.Stat_t); ok {
				n += st.Blocks * 512
				files = append(files, fmt.Sprintf("%s %d KiB", filepath.Base(path), st.Blocks/2))
			}
		}
		return nil
	})
	return n, strings.Join(files, ", ")
}

// monitor polls every member while the attacks run.
type monitor struct {
	gws     []*gw
	stopc   chan struct{}
	wg      sync.WaitGroup
	mu      sync.Mutex
	fails   []string
	dirPeak map[string]int64
	dirAt   map[string]string // the files at the peak
	// anonPeak and filePeak are the highest RssAnon and RssFile seen:
	// what VmHWM is made of.
	anonPeak, filePeak map[string]int64
	// rowPeak is the highest RSS of any member since the last check:
	// which row pressed hardest.
	rowPeak int64
}

func watchMembers(t *testing.T, gws []*gw) *monitor {
	m := &monitor{gws: gws, stopc: make(chan struct{}), dirPeak: map[string]int64{}, dirAt: map[string]string{}, anonPeak: map[string]int64{}, filePeak: map[string]int64{}}
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		tick := time.NewTicker(250 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-m.stopc:
				return
			case <-tick.C:
			}
			for _, g := range gws {
				m.poll(g)
			}
		}
	}()
	return m
}

func (m *monitor) poll(g *gw) {
	select {
	case <-g.proc.Done():
		m.fail(fmt.Sprintf("%s exited: %s", g.name, tail(g.proc.Output(), 2000)))
		return
	default:
	}
	c := &http.Client{Timeout: time.Second, Transport: g.http.Transport}
	start := time.Now()
	resp, err := c.Get("http://127.0.0.1:7880/v1/status")
	if err == nil {
		resp.Body.Close()
		if resp.StatusCode != 200 {
			err = fmt.Errorf("HTTP %s", resp.Status)
		}
	}
	if err != nil {
		m.fail(fmt.Sprintf("%s: /v1/status did not answer within 1 s (%v after %v)", g.name, err, time.Since(start).Round(time.Millisecond)))
	}
	n, files := dirBytes(g.dir)
	st := procStatus(g)
	m.mu.Lock()
	if n > m.dirPeak[g.name] {
		m.dirPeak[g.name], m.dirAt[g.name] = n, files
	}
	m.anonPeak[g.name] = max(m.anonPeak[g.name], st["RssAnon"])
	m.rowPeak = max(m.rowPeak, st["VmRSS"])
	m.filePeak[g.name] = max(m.filePeak[g.name], st["RssFile"])
	m.mu.Unlock()
}

func (m *monitor) fail(s string) {
	m.mu.Lock()
	m.fails = append(m.fails, s)
	m.mu.Unlock()
}

// check fails the test with what went wrong during the attack just run.
func (m *monitor) check(t *testing.T, during string) {
	t.Helper()
	m.mu.Lock()
	fails := m.fails
	m.fails = nil
	peak := m.rowPeak
	m.rowPeak = 0
	m.mu.Unlock()
	t.Logf("  RSS peak during %q: %d MiB", during, peak>>20)
	for i, f := range fails {
		if i < 5 {
			t.Errorf("during %q: %s", during, f)
		}
	}
	if len(fails) > 0 {
		t.FailNow()
	}
}

func (m *monitor) stop(t *testing.T) {
	close(m.stopc)
	m.wg.Wait()
	m.check(t, "the end")
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// polite is the well-behaved device: QoS 1 publishes, one every 100 ms,
// to a member (the next one after a connection fails). acked maps each
// payload acked to when it was sent.
type polite struct {
	stopc chan struct{}
	wg    sync.WaitGroup
	mu    sync.Mutex
	acked map[string]time.Time
	fails []string
	sent  atomic.Int64
}

func startPolite(t *testing.T, h *netns.Host, gws []*gw) *polite {
	p := &polite{stopc: make(chan struct{}), acked: map[string]time.Time{}}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		var c *paho.Client
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for seq, at := 0, 0; ; seq++ {
			select {
			case <-p.stopc:
				return
			case <-tick.C:
			}
			if c == nil {
				conn, err := dialIn(h, gws[at%len(gws)].h.Addr()+":1883")
				if err != nil {
					at++
					continue
				}
				c = paho.NewClient(paho.ClientConfig{ClientID: "polite", Conn: conn})
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				ca, err := c.Connect(ctx, &paho.Connect{ClientID: "polite", CleanStart: true, KeepAlive: 30})
				cancel()
				if err != nil || ca.ReasonCode != 0 {
					p.failf("connect to %s: %v %v", gws[at%len(gws)].name, err, ca)
					conn.Close()
					c, at = nil, at+1
					continue
				}
			}
			payload := fmt.Sprintf("polite-%d", seq)
			p.sent.Add(1)
			sentAt := time.Now()
			// sync_timeout is 5 s: an answer comes within it, or the
			// device was left hanging.
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			r, err := c.Publish(ctx, &paho.Publish{Topic: "ok/polite", QoS: 1, Payload: []byte(payload)})
			cancel()
			switch {
			case err != nil && r == nil:
				p.failf("publish %s: no answer: %v", payload, err)
				c = nil
			case r.ReasonCode == 0:
				p.mu.Lock()
				p.acked[payload] = sentAt
				p.mu.Unlock()
			case r.ReasonCode != 0x97:
				p.failf("publish %s: reason %#x, want an ack or 0x97", payload, r.ReasonCode)
			}
		}
	}()
	return p
}

func (p *polite) failf(format string, args ...any) {
	p.mu.Lock()
	p.fails = append(p.fails, fmt.Sprintf(format, args...))
	p.mu.Unlock()
}

func (p *polite) stop(t *testing.T) map[string]time.Time {
	t.Helper()
	close(p.stopc)
	p.wg.Wait()
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, f := range p.fails {
		if i < 5 {
			t.Errorf("well-behaved device: %s", f)
		}
	}
	if len(p.fails) > 0 {
		t.FailNow()
	}
	t.Logf("well-behaved device: %d published, %d acked", p.sent.Load(), len(p.acked))
	return p.acked
}

// Raw MQTT, for what no client library sends.

func mqttString(b []byte, s string) []byte {
	b = binary.BigEndian.AppendUint16(b, uint16(len(s)))
	return append(b, s...)
}

// connectFrame is a CONNECT of version (4: 3.1.1, 5), with a will on
// willTopic when set, and props as the MQTT 5 CONNECT properties.
func connectFrame(version byte, id string, clean bool, willTopic, willPayload string, props []byte) []byte {
	flags := byte(0)
	if clean {
		flags |= 0x02
	}
	if willTopic != "" {
		flags |= 0x04
	}
	b := mqttString(nil, "MQTT")
	b = append(b, version, flags, 0, 30)
	if version == 5 {
		b = binary.AppendUvarint(b, uint64(len(props)))
		b = append(b, props...)
	}
	b = mqttString(b, id)
	if willTopic != "" {
		if version == 5 {
			b = append(b, 0)
		}
		b = mqttString(b, willTopic)
		b = mqttString(b, willPayload)
	}
	return testutil.MQTTFrame(0x10, b)
}

func publishFrame(version byte, topic string, qos byte, pid uint16, payload []byte) []byte {
	b := mqttString(nil, topic)
	if qos > 0 {
		b = binary.BigEndian.AppendUint16(b, pid)
	}
	if version == 5 {
		b = append(b, 0)
	}
	return testutil.MQTTFrame(0x30|qos<<1, append(b, payload...))
}

// exchange sends frames on a fresh connection to g and reads until the
// gateway closes it or a second passes; it returns the first byte of each
// packet it read.
func (a *attacker) exchange(g *gw, frames ...[]byte) []byte {
	c, err := a.dial(g)
	if err != nil {
		return nil
	}
	defer c.Close()
	for _, f := range frames {
		if _, err := c.Write(f); err != nil {
			break
		}
	}
	var got []byte
	for {
		_ = c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
		typ, _, err := testutil.ReadMQTTFrame(c)
		if err != nil {
			return got
		}
		got = append(got, typ)
	}
}

// The rows.

// controlTopics are the topics the gateway's own records travelled on
// before they became a kind of their own.
var controlTopics = []string{"$tandem/settle", "$tandem/session", "$tandem/cursors", "$tandem/uplinks"}

// attackControlTopics: a will on each control topic (a payload that is no
// settlement, a pause of an uplink), dropped without DISCONNECT so that
// it fires, and a publish on each, in 3.1.1 and 5.
func attackControlTopics(ctx context.Context, a *attacker, g *gw) string {
	n := 0
	for _, topic := range controlTopics {
		for _, v := range []byte{4, 5} {
			for _, payload := range []string{"not json {", `{"name":"cloud","paused":true}`, `{"cloud":1000000000}`} {
				if ctx.Err() != nil {
					return fmt.Sprintf("%d tries", n)
				}
				a.exchange(g, connectFrame(v, fmt.Sprintf("w%d-%d", v, n), true, topic, payload, nil))
				a.exchange(g, connectFrame(v, fmt.Sprintf("p%d-%d", v, n), true, "", "", nil), publishFrame(v, topic, 1, 1, []byte(payload)))
				n++
			}
		}
	}
	return fmt.Sprintf("%d wills and %d publishes", n, n)
}

// attackLargeQoS0Flood: two connections writing 256 KiB QoS 0 publishes as
// fast as the gateway reads them.
func attackLargeQoS0Flood(ctx context.Context, a *attacker, g *gw) string {
	frame := publishFrame(4, "flood/x", 0, 0, bytes.Repeat([]byte{'x'}, 256<<10))
	var sent atomic.Int64
	var wg sync.WaitGroup
	for i := range 2 {
		c, err := a.dial(g)
		if err != nil {
			continue
		}
		if _, err := c.Write(connectFrame(4, fmt.Sprintf("flood-%d", i), true, "", "", nil)); err != nil {
			c.Close()
			continue
		}
		stop := context.AfterFunc(ctx, func() { c.Close() })
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer stop()
			for ctx.Err() == nil {
				if _, err := c.Write(frame); err != nil {
					return
				}
				sent.Add(1)
			}
		}()
	}
	wg.Wait()
	return fmt.Sprintf("%d MiB sent", sent.Load()/4)
}

// attackLongClientIDs: 100 persistent sessions with 60 KB client ids.
func attackLongClientIDs(ctx context.Context, a *attacker, g *gw) string {
	refused, admitted := 0, 0
	for i := 0; i < 100 && ctx.Err() == nil; i++ {
		id := fmt.Sprintf("%d-%s", i, strings.Repeat("i", 60<<10))
		props := []byte{0x11, 0xff, 0xff, 0xff, 0xff} // session expiry: never
		if c := a.session(g, connectFrame(5, id, false, "", "", props)); c != nil {
			admitted++
			c.Close()
			continue
		}
		refused++ // a refusing CONNACK, or closed without one
	}
	return fmt.Sprintf("%d refused, %d admitted", refused, admitted)
}

// attackProtocolErrors: what mochi's codec lets through and the spec calls
// a protocol error, each on a connection of its own.
func attackProtocolErrors(ctx context.Context, a *attacker, g *gw) string {
	cases := [][]byte{
		connectFrame(5, "dup-props", true, "", "", []byte{0x21, 0, 10, 0x21, 0, 20}),            // Receive Maximum twice
		connectFrame(5, "rm-zero", true, "", "", []byte{0x21, 0, 0}),                            // Receive Maximum 0
		connectFrame(5, "mps-zero", true, "", "", []byte{0x27, 0, 0, 0, 0}),                     // Maximum Packet Size 0
		connectFrame(5, "dup-expiry", true, "", "", []byte{0x11, 0, 0, 0, 1, 0x11, 0, 0, 0, 2}), // Session Expiry twice
	}
	n := 0
	for _, f := range cases {
		if ctx.Err() != nil {
			break
		}
		a.exchange(g, f)
		n++
	}
	// A SUBSCRIBE with reserved option bits and one with Subscription
	// Identifier 0, after a good CONNECT.
	for _, sub := range [][]byte{
		testutil.MQTTFrame(0x82, append([]byte{0, 1, 0}, append(mqttString(nil, "a/b"), 0xc1)...)),
		testutil.MQTTFrame(0x82, append([]byte{0, 1, 2, 0x0b, 0}, append(mqttString(nil, "a/b"), 0x01)...)),
	} {
		a.exchange(g, connectFrame(5, fmt.Sprintf("sub-%d", n), true, "", "", nil), sub)
		n++
	}
	return fmt.Sprintf("%d connections", n)
}

// subscribeFrame is a SUBSCRIBE of version with each filter at qos.
func subscribeFrame(version byte, pid uint16, qos byte, filters ...string) []byte {
	b := binary.BigEndian.AppendUint16(nil, pid)
	if version == 5 {
		b = append(b, 0)
	}
	for _, f := range filters {
		b = mqttString(b, f)
		b = append(b, qos)
	}
	return testutil.MQTTFrame(0x82, b)
}

// session opens a connection to g with CONNECT frame and returns it once
// the CONNACK came (nil when refused or closed).
func (a *attacker) session(g *gw, connect []byte) net.Conn {
	c, err := a.dial(g)
	if err != nil {
		return nil
	}
	if _, err := c.Write(connect); err != nil {
		c.Close()
		return nil
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	typ, body, err := testutil.ReadMQTTFrame(c)
	if err != nil || typ != 0x20 || len(body) < 2 || body[1] != 0 {
		c.Close()
		return nil
	}
	_ = c.SetReadDeadline(time.Time{})
	return c
}

// drain reads and discards what c receives until it closes.
func drain(c net.Conn) {
	buf := make([]byte, 64<<10)
	for {
		if _, err := c.Read(buf); err != nil {
			return
		}
	}
}

// publishQoS1 sends n QoS 1 publishes of payload on c, with at most window
// unacknowledged, reading the acks in between; it stops at ctx's end or
// when the connection does. It returns how many were acked, and how many
// refused.
func publishQoS1(ctx context.Context, c net.Conn, version byte, topic func(i int) string, retain bool, payload []byte, n, window int) (acked, refused int) {
	acks := make(chan byte, window)
	go func() {
		defer close(acks)
		for {
			typ, body, err := testutil.ReadMQTTFrame(c)
			if err != nil {
				return
			}
			if typ>>4 == 4 { // PUBACK
				code := byte(0)
				if len(body) > 2 {
					code = body[2]
				}
				acks <- code
			}
		}
	}()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	out := 0
	for i := 0; i < n && ctx.Err() == nil; i++ {
		for out >= window {
			code, ok := <-acks
			if !ok {
				return
			}
			out--
			if code < 0x80 {
				acked++
			} else {
				refused++
			}
		}
		f := publishFrame(version, topic(i), 1, uint16(i%60000+1), payload)
		if retain {
			f[0] |= 0x01
		}
		if _, err := c.Write(f); err != nil {
			return
		}
		out++
	}
	return
}

// attackRetainedFlood: retained messages of 100 KB on topics of their own,
// QoS 1, as fast as the acks come.
func attackRetainedFlood(ctx context.Context, a *attacker, g *gw) string {
	c := a.session(g, connectFrame(5, "retainer", true, "", "", nil))
	if c == nil {
		return "not connected"
	}
	defer c.Close()
	acked, refused := publishQoS1(ctx, c, 5, func(i int) string { return fmt.Sprintf("ret/%d", i) }, true, bytes.Repeat([]byte{'r'}, 100<<10), 3000, 16)
	return fmt.Sprintf("%d retained acked, %d refused", acked, refused)
}

// attackSessionFilters: persistent sessions that never expire, each
// subscribing filters of 1 KB, 100 to a SUBSCRIBE.
func attackSessionFilters(ctx context.Context, a *attacker, g *gw) string {
	sessions, granted := 0, 0
	props := []byte{0x11, 0xff, 0xff, 0xff, 0xff}
	for s := 0; s < 120 && ctx.Err() == nil; s++ {
		c := a.session(g, connectFrame(5, fmt.Sprintf("hoarder-%d", s), false, "", "", props))
		if c == nil {
			continue
		}
		sessions++
		for k := 0; k < 10 && ctx.Err() == nil; k++ {
			filters := make([]string, 100)
			for i := range filters {
				filters[i] = fmt.Sprintf("f/%d/%d/%s", k, i, strings.Repeat("x", 1000))
			}
			if _, err := c.Write(subscribeFrame(5, uint16(k+1), 1, filters...)); err != nil {
				break
			}
			_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
			typ, body, err := testutil.ReadMQTTFrame(c)
			if err != nil || typ != 0x90 {
				break
			}
			for _, code := range body[3:] {
				if code < 0x80 {
					granted++
				}
			}
		}
		c.Close()
	}
	return fmt.Sprintf("%d sessions, %d filters granted", sessions, granted)
}

// attackNeverAcks: an MQTT 5 subscriber with no Receive Maximum (65535)
// that reads but never acks, and 1 MB QoS 1 publishes for it.
func attackNeverAcks(ctx context.Context, a *attacker, g *gw) string {
	sub := a.session(g, connectFrame(5, "never-acks", true, "", "", nil))
	if sub == nil {
		return "not connected"
	}
	defer sub.Close()
	if _, err := sub.Write(subscribeFrame(5, 1, 1, "big/#")); err != nil {
		return "subscribe failed"
	}
	go drain(sub)
	pub := a.session(g, connectFrame(5, "big-publisher", true, "", "", nil))
	if pub == nil {
		return "publisher not connected"
	}
	defer pub.Close()
	acked, refused := publishQoS1(ctx, pub, 5, func(int) string { return "big/x" }, false, bytes.Repeat([]byte{'b'}, 1000<<10), 400, 8)
	return fmt.Sprintf("%d acked, %d refused", acked, refused)
}

// attackRepeatedFilter: 1000 retained messages, then one SUBSCRIBE of 2000
// × "#" from a client that never reads.
func attackRepeatedFilter(ctx context.Context, a *attacker, g *gw) string {
	c := a.session(g, connectFrame(5, "rep-retainer", true, "", "", nil))
	if c == nil {
		return "not connected"
	}
	acked, _ := publishQoS1(ctx, c, 5, func(i int) string { return fmt.Sprintf("rep/%d", i) }, true, bytes.Repeat([]byte{'p'}, 1000), 1000, 32)
	c.Close()
	s := a.session(g, connectFrame(5, "rep-subscriber", true, "", "", nil))
	if s == nil {
		return fmt.Sprintf("%d retained; subscriber not connected", acked)
	}
	defer s.Close()
	filters := make([]string, 2000)
	for i := range filters {
		filters[i] = "#"
	}
	_, _ = s.Write(subscribeFrame(5, 1, 1, filters...))
	<-ctx.Done() // it never reads
	return fmt.Sprintf("%d retained, one SUBSCRIBE of 2000 × #", acked)
}

// attackWebSocketIdle: sockets to the WebSocket port that send one plain
// GET (no upgrade), or nothing at all, and stay.
func attackWebSocketIdle(ctx context.Context, a *attacker, g *gw) string {
	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	opened := 0
	for i := 0; i < 300 && ctx.Err() == nil; i++ {
		c, err := dialIn(a.h, g.h.Addr()+":8080")
		if err != nil {
			continue
		}
		opened++
		if i%2 == 0 {
			fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: %s:8080\r\n\r\n", g.h.Addr())
		}
		held = append(held, c)
	}
	<-ctx.Done()
	// What the gateway still holds open of them: a plain GET's answer is
	// followed by a close, an idle socket is closed at connect_timeout.
	open := 0
	for _, c := range held {
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Millisecond))
		var b [1024]byte
		for {
			_, err := c.Read(b[:])
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				open++
				break
			}
			if err != nil {
				break
			}
		}
	}
	return fmt.Sprintf("%d sockets, %d still open at the end", opened, open)
}

// attackHTTPHogs: keep-alive connections to the HTTP API, each sending a
// request now and then, to hold every slot.
func attackHTTPHogs(ctx context.Context, a *attacker, g *gw) string {
	refused, served := 0, 0
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i := 0; i < 64; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := dialIn(a.h, g.h.Addr()+":7880")
			if err != nil {
				return
			}
			defer c.Close()
			stop := context.AfterFunc(ctx, func() { c.Close() })
			defer stop()
			for ctx.Err() == nil {
				fmt.Fprintf(c, "GET /healthz HTTP/1.1\r\nHost: %s:7880\r\n\r\n", g.h.Addr())
				_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
				resp, err := http.ReadResponse(bufio.NewReader(c), nil)
				if err != nil {
					return
				}
				resp.Body.Close()
				mu.Lock()
				if resp.StatusCode == 503 && resp.Header.Get("Retry-After") != "" {
					refused++
				} else {
					served++
				}
				mu.Unlock()
				select {
				case <-ctx.Done():
				case <-time.After(time.Second):
				}
			}
		}()
	}
	wg.Wait()
	return fmt.Sprintf("%d answered, %d refused", served, refused)
}
