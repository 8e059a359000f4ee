package daemon_test

// Crash tests: the real `tandem` binary run as a child process, killed with
// SIGKILL under load, then read back with `tandem inspect` (DESIGN.md,
// "Guarantees" and "How it is tested").
//
// The binary is built once per test binary, lazily, by tandemBinary. Every
// child is started by startTandem, which registers a t.Cleanup that kills
// and reaps it; nothing else is ever signalled.

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	paho "github.com/eclipse/paho.mqtt.golang"
)

// ---------------------------------------------------------------------------
// The binary.

var (
	binDir  string // created by TestMain, removed after the tests
	binOnce sync.Once
	binPath string
	binErr  error
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "tandem-crash-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "crash tests: temp dir:", err)
		os.Exit(1)
	}
	binDir = dir
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// tandemBinary builds github.com/tandem-edge/tandem once and returns its
// path.
func tandemBinary(t *testing.T) string {
	t.Helper()
	binOnce.Do(func() {
		p := filepath.Join(binDir, "tandem")
		cmd := exec.Command("go", "build", "-o", p, "github.com/tandem-edge/tandem")
		out, err := cmd.CombinedOutput()
		if err != nil {
			binErr = fmt.Errorf("go build: %v\n%s", err, out)
			return
		}
		binPath = p
	})
	if binErr != nil {
		t.Fatal(binErr)
	}
	return binPath
}

// ---------------------------------------------------------------------------
// The child process.

// lockedBuffer collects a child's stdout and stderr.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// tail returns the last n bytes of the output.
func (b *lockedBuffer) tail(n int) string {
	s := b.String()
	if len(s) > n {
		s = "…" + s[len(s)-n:]
	}
	return s
}

// tandemAddrs are the listen addresses of one child.
type tandemAddrs struct {
	mqtt, http string
}

// tandemProc is one `tandem run` child process.
type tandemProc struct {
	t       *testing.T
	dataDir string
	addrs   tandemAddrs
	cmd     *exec.Cmd
	out     *lockedBuffer
	exited  chan struct{} // closed once cmd.Wait has returned
	waitErr error         // cmd.Wait's result, read after exited
}

// freeAddr returns a loopback address whose port was free a moment ago.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("picking a free port: %v", err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

const (
	startAttempts = 5
	readyTimeout  = 30 * time.Second
)

// startTandem starts `tandem run` on dataDir and waits until /healthz
// answers 200. With addrs nil it picks fresh ports (again on every attempt);
// otherwise it insists on addrs (a restart on the same ports). A start that
// fails to bind is retried.
func startTandem(t *testing.T, dataDir string, addrs *tandemAddrs, extra ...string) *tandemProc {
	t.Helper()
	bin := tandemBinary(t)
	var lastOut string
	for attempt := 1; attempt <= startAttempts; attempt++ {
		a := tandemAddrs{}
		if addrs != nil {
			a = *addrs
		} else {
			a = tandemAddrs{mqtt: freeAddr(t), http: freeAddr(t)}
		}
		p := &tandemProc{t: t, dataDir: dataDir, addrs: a, out: &lockedBuffer{}, exited: make(chan struct{})}
		p.cmd = exec.Command(bin, append([]string{"run", "--data", dataDir, "--mqtt", a.mqtt, "--http", a.http, "--peer", "127.0.0.1:0"}, extra...)...)
		p.cmd.Stdout = p.out
		p.cmd.Stderr = p.out
		if err := p.cmd.Start(); err != nil {
			t.Fatalf("starting tandem: %v", err)
		}
		go func() {
			p.waitErr = p.cmd.Wait()
			close(p.exited)
		}()
		t.Cleanup(func() {
			p.kill9()
			if t.Failed() {
				t.Logf("tandem (pid %d, data %s) output:\n%s", p.cmd.Process.Pid, p.dataDir, p.out.tail(4000))
			}
		})
		err := p.waitReady(readyTimeout)
		if err == nil {
			return p
		}
		p.kill9()
		lastOut = p.out.tail(4000)
		if !strings.Contains(lastOut, "address already in use") {
			t.Fatalf("tandem did not become ready: %v\noutput:\n%s", err, lastOut)
		}
		t.Logf("start attempt %d: a port was taken, retrying", attempt)
		if addrs != nil {
			// The same ports again: give their other holder a moment
			// (a retry delay, not synchronisation).
			time.Sleep(200 * time.Millisecond)
		}
	}
	t.Fatalf("tandem could not bind its ports in %d attempts; last output:\n%s", startAttempts, lastOut)
	return nil
}

var healthClient = &http.Client{Timeout: time.Second}

// waitReady polls /healthz until it answers 200, the child exits or the
// deadline passes.
func (p *tandemProc) waitReady(timeout time.Duration) error {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	url := "http://" + p.addrs.http + "/healthz"
	for {
		select {
		case <-p.exited:
			return fmt.Errorf("tandem exited before it was ready: %v", p.waitErr)
		case <-deadline.C:
			return fmt.Errorf("/healthz not OK within %v", timeout)
		case <-tick.C:
		}
		resp, err := healthClient.Get(url)
		if err != nil {
			continue
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			return nil
		}
	}
}

// kill9 SIGKILLs the child (by its own PID, never anything else) and reaps
// it. It is safe to call more than once.
func (p *tandemProc) kill9() {
	select {
	case <-p.exited:
		return
	default:
	}
	_ = p.cmd.Process.Kill()
	<-p.exited
}

// stop sends SIGTERM and returns the exit code; past timeout it kills the
// child and fails the test.
func (p *tandemProc) stop(timeout time.Duration) int {
	p.t.Helper()
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(timeout):
		p.kill9()
		p.t.Errorf("tandem did not stop within %v of SIGTERM", timeout)
	}
	return p.cmd.ProcessState.ExitCode()
}

// ---------------------------------------------------------------------------
// `tandem inspect`.

// inspectLine is one line of `tandem inspect` (DESIGN.md, interface contract).
type inspectLine struct {
	Index   uint64 `json:"index"`
	Term    uint64 `json:"term"`
	Topic   string `json:"topic"`
	QoS     byte   `json:"qos"`
	Retain  bool   `json:"retain"`
	Payload string `json:"payload"`
	Client  string `json:"client"`
	Time    string `json:"time"`

	payload []byte // Payload decoded
}

// runInspect runs `tandem inspect --data dir [extra...]` and parses its
// output. A non-zero exit or an unparsable line fails the test.
func runInspect(t *testing.T, dir string, extra ...string) []inspectLine {
	t.Helper()
	args := append([]string{"inspect", "--data", dir}, extra...)
	cmd := exec.Command(tandemBinary(t), args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("tandem %s: %v\nstderr:\n%s", strings.Join(args, " "), err, stderr.String())
	}
	var recs []inspectLine
	dec := json.NewDecoder(&stdout)
	for {
		var r inspectLine
		err := dec.Decode(&r)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("tandem inspect: line %d: %v", len(recs)+1, err)
		}
		if r.payload, err = base64.StdEncoding.DecodeString(r.Payload); err != nil {
			t.Fatalf("tandem inspect: index %d: payload is not standard base64: %v", r.Index, err)
		}
		if _, err := time.Parse(time.RFC3339Nano, r.Time); err != nil {
			t.Errorf("tandem inspect: index %d: time %q is not RFC 3339: %v", r.Index, r.Time, err)
		}
		recs = append(recs, r)
	}
	return recs
}

// ---------------------------------------------------------------------------
// Test 1: SIGKILL under QoS 1 load, 20 times on one data dir.

const (
	crashRounds      = 20
	crashRoundsShort = 3
	crashPublishers  = 4
	crashWindow      = 16 // QoS 1 publishes in flight per publisher
	crashMinDelay    = 50 * time.Millisecond
	crashMaxDelay    = 400 * time.Millisecond
	ackWait          = 10 * time.Second // a PUBACK slower than this is a failure
)

// crashSeed returns the seed of the run: TANDEM_CRASH_SEED or the clock.
func crashSeed(t *testing.T) int64 {
	t.Helper()
	if s := os.Getenv("TANDEM_CRASH_SEED"); s != "" {
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			t.Fatalf("TANDEM_CRASH_SEED=%q: %v", s, err)
		}
		return v
	}
	return time.Now().UnixNano()
}

// pubResult is what one publisher saw in one round.
type pubResult struct {
	client  string
	sent    int
	acked   []int // seqs, in the order they were published (and acked)
	connErr error // connecting failed (the daemon was ready: a failure)
	slowErr error // a PUBACK took longer than ackWait before the kill

	progress atomic.Int64 // len(acked), readable while publishing

	// Seen while tandem ran (not while draining after the kill): how long
	// from connected to the first PUBACK, and the longest wait between two.
	firstAck, maxGap time.Duration
}

// publish connects as client and publishes QoS 1 "client:round:seq"
// payloads to crash/<client> with up to crashWindow in flight, until stop is
// closed or the connection breaks. connected is signalled once connected
// (or failed to).
func publish(addr, client string, round int, connected *sync.WaitGroup, stop <-chan struct{}, res *pubResult) {
	res.client = client
	opts := paho.NewClientOptions().
		AddBroker("tcp://" + addr).
		SetClientID(client).
		SetCleanSession(true).
		SetAutoReconnect(false).
		SetConnectRetry(false).
		SetConnectTimeout(5 * time.Second).
		SetKeepAlive(30 * time.Second).
		// Also how long a Publish may block when the connection dies
		// under it (paho waits on its outbound queue): keep it short.
		SetWriteTimeout(2 * time.Second)
	c := paho.NewClient(opts)
	tok := c.Connect()
	if !tok.WaitTimeout(10*time.Second) || tok.Error() != nil {
		res.connErr = fmt.Errorf("connect %s: timeout or %v", client, tok.Error())
		connected.Done()
		return
	}
	connected.Done()
	defer c.Disconnect(0)

	type pending struct {
		tok paho.Token
		seq int
	}
	t0 := time.Now()
	lastAck := t0
	var q []pending
	broken := false
	// settle waits for the oldest publish; it reports false once the
	// connection is gone.
	settle := func(draining bool) bool {
		select {
		case <-stop:
			draining = true // tandem is dead: wait times say nothing more
		default:
		}
		p := q[0]
		q = q[1:]
		if !p.tok.WaitTimeout(ackWait) {
			select {
			case <-stop:
			default:
				res.slowErr = fmt.Errorf("%s seq %d: no PUBACK within %v while tandem was running", client, p.seq, ackWait)
			}
			return false
		}
		if p.tok.Error() != nil {
			return false
		}
		if !draining {
			now := time.Now()
			if len(res.acked) == 0 {
				res.firstAck = now.Sub(t0)
			} else if g := now.Sub(lastAck); g > res.maxGap {
				res.maxGap = g
			}
			lastAck = now
		}
		res.acked = append(res.acked, p.seq)
		res.progress.Add(1)
		return true
	}
	topic := "crash/" + client
	for seq := 0; !broken; seq++ {
		select {
		case <-stop:
			broken = true
			continue
		default:
		}
		payload := fmt.Sprintf("%s:%d:%d", client, round, seq)
		q = append(q, pending{tok: c.Publish(topic, 1, false, payload), seq: seq})
		res.sent++
		if len(q) >= crashWindow && !settle(false) {
			broken = true
		}
	}
	// Whatever is still in flight: acked if its PUBACK arrived before the
	// connection died, not acked otherwise.
	for len(q) > 0 {
		settle(true)
	}
}

// ackedMsg identifies one acknowledged publish.
type ackedMsg struct {
	client     string
	round, seq int
}

func (a ackedMsg) payload() string { return fmt.Sprintf("%s:%d:%d", a.client, a.round, a.seq) }

func parseCrashPayload(p []byte) (ackedMsg, bool) {
	parts := strings.Split(string(p), ":")
	if len(parts) != 3 {
		return ackedMsg{}, false
	}
	r, err1 := strconv.Atoi(parts[1])
	s, err2 := strconv.Atoi(parts[2])
	if err1 != nil || err2 != nil {
		return ackedMsg{}, false
	}
	return ackedMsg{client: parts[0], round: r, seq: s}, true
}

// errCap limits how many lines of one kind of failure a test prints.
type errCap struct {
	t    *testing.T
	max  int
	seen map[string]int
}

func (e *errCap) errorf(kind, format string, args ...any) {
	e.t.Helper()
	e.seen[kind]++
	switch n := e.seen[kind]; {
	case n <= e.max:
		e.t.Errorf(kind+": "+format, args...)
	case n == e.max+1:
		e.t.Errorf("%s: more failures of this kind not shown", kind)
	}
}

func TestCrashKill9UnderLoad(t *testing.T) { crashKill9UnderLoad(t) }

// flush: interval acks before the fsync: a kill -9 must lose nothing all
// the same, since the kernel holds what was written.
func TestCrashKill9UnderLoadFlushInterval(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "tandem.yaml")
	if err := os.WriteFile(cfg, []byte("storage:\n  flush: interval\n  flush_interval: 200ms\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	crashKill9UnderLoad(t, "--config", cfg)
}

// crashKill9UnderLoad kills `tandem run` (with extra arguments) under load,
// round after round, and checks every acked publish is in the log once, in
// order.
func crashKill9UnderLoad(t *testing.T, extra ...string) {
	rounds := crashRounds
	if testing.Short() {
		rounds = crashRoundsShort
	}
	seed := crashSeed(t)
	t.Logf("seed %d (replay with TANDEM_CRASH_SEED=%d)", seed, seed)
	rng := rand.New(rand.NewSource(seed))
	dir := t.TempDir()
	clients := []string{"pubA", "pubB", "pubC", "pubD"}

	var acked []ackedMsg // every acked publish, per round, per client, in publish order
	start := time.Now()
	for round := 0; round < rounds; round++ {
		p := startTandem(t, dir, nil, extra...)
		delay := crashMinDelay + time.Duration(rng.Int63n(int64(crashMaxDelay-crashMinDelay)+1))

		stop := make(chan struct{})
		var connected, done sync.WaitGroup
		results := make([]pubResult, crashPublishers)
		connected.Add(crashPublishers)
		done.Add(crashPublishers)
		for i := 0; i < crashPublishers; i++ {
			go func(i int) {
				defer done.Done()
				publish(p.addrs.mqtt, clients[i], round, &connected, stop, &results[i])
			}(i)
		}
		// The delay runs from the moment every publisher is connected, so
		// each round kills tandem under the full load.
		connected.Wait()
		select {
		case <-time.After(delay):
		case <-p.exited:
			t.Errorf("round %d: tandem exited under load: %v", round, p.waitErr)
		}
		p.kill9()
		close(stop)
		done.Wait()

		var sent, nacked int
		var per []string
		for i := range results {
			r := &results[i]
			if r.connErr != nil {
				t.Errorf("round %d: %v", round, r.connErr)
			}
			if r.slowErr != nil {
				t.Errorf("round %d: %v", round, r.slowErr)
			}
			sent += r.sent
			nacked += len(r.acked)
			per = append(per, fmt.Sprintf("%s %d/%d first %v gap %v", r.client, len(r.acked), r.sent, r.firstAck.Round(time.Millisecond), r.maxGap.Round(time.Millisecond)))
			for _, s := range r.acked {
				acked = append(acked, ackedMsg{client: r.client, round: round, seq: s})
			}
		}
		t.Logf("round %2d: killed after %v: %d acked of %d sent (%s)", round, delay, nacked, sent, strings.Join(per, ", "))
		if t.Failed() {
			t.FailNow()
		}
	}
	t.Logf("%d rounds, %d acked publishes, %v", rounds, len(acked), time.Since(start).Round(time.Millisecond))

	recs := runInspect(t, dir)
	ec := &errCap{t: t, max: 10, seen: map[string]int{}}

	// (d) Indexes strictly increase.
	for i := 1; i < len(recs); i++ {
		if recs[i].Index <= recs[i-1].Index {
			ec.errorf("(d) index order", "line %d has index %d after index %d", i+1, recs[i].Index, recs[i-1].Index)
		}
	}

	// Where each crash payload is in the log, and how often.
	type stream struct {
		client string
		round  int
	}
	at := map[string][]uint64{}
	lastLogged := map[stream]inspectLine{}
	for _, r := range recs {
		m, ok := parseCrashPayload(r.payload)
		if !ok {
			ec.errorf("foreign record", "index %d: payload %q on topic %q is not one of this test's", r.Index, r.payload, r.Topic)
			continue
		}
		if r.Topic != "crash/"+m.client || r.Client != m.client || r.QoS != 1 || r.Retain {
			ec.errorf("record fields", "index %d: payload %q logged with topic %q, client %q, qos %d, retain %v", r.Index, r.payload, r.Topic, r.Client, r.QoS, r.Retain)
		}
		at[string(r.payload)] = append(at[string(r.payload)], r.Index)
		// One connection's publishes are logged in the order sent,
		// acked or not (the acked ones are checked again below).
		s := stream{m.client, m.round}
		if prev, ok := lastLogged[s]; ok {
			if pm, _ := parseCrashPayload(prev.payload); pm.seq >= m.seq {
				ec.errorf("(b) log order", "index %d holds %q after index %d holding %q (seed %d)", r.Index, r.payload, prev.Index, prev.payload, seed)
			}
		}
		lastLogged[s] = r
	}
	for p, idx := range at {
		if len(idx) > 1 {
			// No publish is ever resent here (clean session, no
			// reconnect), so even an unacked one must not be logged twice.
			ec.errorf("(c) duplicate", "payload %q is logged %d times, at indexes %v (seed %d)", p, len(idx), idx, seed)
		}
	}

	// (a) every acked publish is logged (once: see above), and (b) each
	// publisher's acked publishes of one round are logged in seq order.
	lastAt := map[stream]ackedMsg{}
	lastIdx := map[stream]uint64{}
	lost := 0
	for _, a := range acked {
		idx := at[a.payload()]
		if len(idx) == 0 {
			lost++
			ec.errorf("(a) lost", "acked payload %q is not in the log (seed %d)", a.payload(), seed)
			continue
		}
		s := stream{a.client, a.round}
		if prev, ok := lastAt[s]; ok && idx[0] <= lastIdx[s] {
			ec.errorf("(b) order", "acked %q is at index %d, before acked %q at index %d (seed %d)", a.payload(), idx[0], prev.payload(), lastIdx[s], seed)
		}
		lastAt[s], lastIdx[s] = a, idx[0]
	}
	t.Logf("log: %d records; %d acked publishes, %d of them missing; %d unacked publishes were logged too",
		len(recs), len(acked), lost, len(at)-(len(acked)-lost))

	// The log reopens after all those kills, and a SIGTERM stops the
	// daemon cleanly (exit 0).
	p := startTandem(t, dir, nil, extra...)
	if code := p.stop(15 * time.Second); code != 0 {
		t.Errorf("tandem exited %d after SIGTERM, want 0", code)
	}
}

// ---------------------------------------------------------------------------
// A minimal MQTT client (3.1.1 or 5), for driving the QoS 2 flow one packet
// at a time (MQTT 3.1.1 section 3, MQTT 5.0 section 3).

const (
	pktConnect = 1
	pktConnack = 2
	pktPublish = 3
	pktPubrec  = 5
	pktPubrel  = 6
	pktPubcomp = 7
)

type rawMQTT struct {
	t       *testing.T
	version byte // 4 (3.1.1) or 5
	c       net.Conn
	r       *bufio.Reader
}

func dialMQTT(t *testing.T, addr string, version byte) *rawMQTT {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatalf("dial %s: %v", addr, err)
	}
	t.Cleanup(func() { c.Close() })
	return &rawMQTT{t: t, version: version, c: c, r: bufio.NewReader(c)}
}

func appendVarint(b []byte, n int) []byte {
	for {
		d := byte(n % 128)
		n /= 128
		if n > 0 {
			d |= 0x80
		}
		b = append(b, d)
		if n == 0 {
			return b
		}
	}
}

func appendString(b []byte, s string) []byte {
	b = append(b, byte(len(s)>>8), byte(len(s)))
	return append(b, s...)
}

func packet(first byte, body []byte) []byte {
	out := appendVarint([]byte{first}, len(body))
	return append(out, body...)
}

// sessionExpiry is the MQTT 5 session expiry the raw client asks for: a
// session that outlives its connection, as clean session = 0 does in 3.1.1.
const sessionExpiry = 300

func (m *rawMQTT) connectPacket(clientID string, clean bool) []byte {
	body := appendString(nil, "MQTT")
	flags := byte(0)
	if clean {
		flags |= 0x02
	}
	body = append(body, m.version, flags, 0, 60) // keep alive 60 s
	if m.version == 5 {
		// Properties: Session Expiry Interval (0x11), four bytes.
		body = append(body, 5, 0x11, 0, 0, sessionExpiry>>8, sessionExpiry&0xff)
	}
	body = appendString(body, clientID)
	return packet(pktConnect<<4, body)
}

func (m *rawMQTT) publishPacket(topic string, qos byte, dup bool, pid uint16, payload []byte) []byte {
	first := byte(pktPublish<<4) | qos<<1
	if dup {
		first |= 0x08
	}
	body := appendString(nil, topic)
	if qos > 0 {
		body = append(body, byte(pid>>8), byte(pid))
	}
	if m.version == 5 {
		body = append(body, 0) // no properties
	}
	return packet(first, append(body, payload...))
}

// pubrelPacket is a PUBREL; in MQTT 5 its 2-byte form means reason 0.
func pubrelPacket(pid uint16) []byte {
	return []byte{pktPubrel<<4 | 0x02, 2, byte(pid >> 8), byte(pid)}
}

func (m *rawMQTT) send(b []byte) {
	m.t.Helper()
	_ = m.c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if _, err := m.c.Write(b); err != nil {
		m.t.Fatalf("mqtt write: %v", err)
	}
}

// read reads one packet: its type, the flags of its fixed header, its body.
func (m *rawMQTT) read(timeout time.Duration) (typ, flags byte, body []byte, err error) {
	_ = m.c.SetReadDeadline(time.Now().Add(timeout))
	first, err := m.r.ReadByte()
	if err != nil {
		return 0, 0, nil, err
	}
	n, mul := 0, 1
	for i := 0; ; i++ {
		d, err := m.r.ReadByte()
		if err != nil {
			return 0, 0, nil, err
		}
		n += int(d&0x7f) * mul
		mul *= 128
		if d&0x80 == 0 {
			break
		}
		if i == 3 {
			return 0, 0, nil, errors.New("malformed remaining length")
		}
	}
	body = make([]byte, n)
	if _, err := io.ReadFull(m.r, body); err != nil {
		return 0, 0, nil, err
	}
	return first >> 4, first & 0x0f, body, nil
}

// expectAck reads until an ack of type typ for pid arrives and returns its
// reason code (MQTT 5; 0 when absent) and how many acks of type skip for
// pid came first. Anything else fails the test.
func (m *rawMQTT) expectAck(typ byte, pid uint16, skip byte) (reason byte, skipped int) {
	m.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		got, _, body, err := m.read(time.Until(deadline))
		if err != nil {
			m.t.Fatalf("waiting for packet type %d id %d: %v", typ, pid, err)
		}
		if len(body) < 2 {
			m.t.Fatalf("packet type %d with a %d-byte body while waiting for type %d id %d", got, len(body), typ, pid)
		}
		id := uint16(body[0])<<8 | uint16(body[1])
		switch {
		case got == typ && id == pid:
			if len(body) > 2 {
				reason = body[2]
			}
			return reason, skipped
		case got == skip && id == pid:
			skipped++
		default:
			m.t.Fatalf("got packet type %d id %d while waiting for type %d id %d", got, id, typ, pid)
		}
	}
}

// connect sends CONNECT and returns CONNACK's session-present flag; a
// refused connection fails the test.
func (m *rawMQTT) connect(clientID string, clean bool) bool {
	m.t.Helper()
	m.send(m.connectPacket(clientID, clean))
	typ, _, body, err := m.read(10 * time.Second)
	if err != nil {
		m.t.Fatalf("waiting for CONNACK: %v", err)
	}
	if typ != pktConnack || len(body) < 2 || (m.version == 4 && len(body) != 2) {
		m.t.Fatalf("got packet type %d (%d bytes) instead of CONNACK", typ, len(body))
	}
	if body[1] != 0 {
		m.t.Fatalf("CONNACK return code %#x", body[1])
	}
	return body[0]&1 == 1
}

// ---------------------------------------------------------------------------
// Test 2: QoS 2, SIGKILL between PUBREC and PUBREL.

// TestCrashQoS2RestartBetweenPubrecAndPubrel kills tandem right after it
// sent a PUBREC: the PUBREC promised the PUBREL its PUBCOMP, across a crash
// too. Variants:
//   - pubrel: 3.1.1, the client goes on with PUBREL. A 3.1.1 PUBCOMP cannot
//     say "unknown id", so only session present and the log are checked.
//   - pubrel-v5: the same in MQTT 5, whose PUBCOMP says 0x92 (packet
//     identifier not found) if the PUBREC state was lost.
//   - resend-publish: 3.1.1, the client resends the PUBLISH (DUP), as one
//     that never read the PUBREC would: it must be answered with a PUBREC
//     and not logged a second time.
func TestCrashQoS2RestartBetweenPubrecAndPubrel(t *testing.T) {
	const (
		topic = "crash/qos2"
		pid   = uint16(7)
	)
	for _, tc := range []struct {
		name    string
		version byte
		resend  bool
	}{
		{"pubrel", 4, false},
		{"pubrel-v5", 5, false},
		{"resend-publish", 4, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			clientID := "qos2-crash-" + tc.name
			payload := []byte("qos2:" + tc.name + ":" + strconv.FormatInt(time.Now().UnixNano(), 10))

			p := startTandem(t, dir, nil)
			c := dialMQTT(t, p.addrs.mqtt, tc.version)
			if c.connect(clientID, false) {
				t.Errorf("first CONNACK on a fresh data dir has session present = 1")
			}
			c.send(c.publishPacket(topic, 2, false, pid, payload))
			if reason, _ := c.expectAck(pktPubrec, pid, 0); reason != 0 {
				t.Fatalf("PUBREC reason %#x, want 0", reason)
			}

			p.kill9()
			c.c.Close()
			p = startTandem(t, dir, &p.addrs)

			c = dialMQTT(t, p.addrs.mqtt, tc.version)
			if !c.connect(clientID, false) {
				t.Errorf("CONNACK after the restart has session present = 0: the session (and its PUBREC state) was lost")
			}
			resent := 0
			if tc.resend {
				c.send(c.publishPacket(topic, 2, true, pid, payload))
				reason, n := c.expectAck(pktPubrec, pid, pktPubrec)
				if reason != 0 {
					t.Errorf("PUBREC for the resent PUBLISH: reason %#x, want 0", reason)
				}
				resent += n + 1
			}
			c.send(pubrelPacket(pid))
			reason, n := c.expectAck(pktPubcomp, pid, pktPubrec)
			resent += n
			if reason != 0 {
				t.Errorf("PUBCOMP reason %#x after the restart, want 0 (0x92: tandem lost the PUBREC it had sent)", reason)
			}
			t.Logf("PUBRECs for id %d seen after the restart: %d", pid, resent)
			c.send([]byte{0xe0, 0}) // DISCONNECT (3.1.1; in MQTT 5: reason 0, no properties)
			c.c.Close()
			p.kill9()

			n = 0
			for _, r := range runInspect(t, dir) {
				if bytes.Equal(r.payload, payload) {
					n++
					if r.Topic != topic || r.QoS != 2 || r.Client != clientID {
						t.Errorf("index %d: logged with topic %q, qos %d, client %q; want %q, 2, %q", r.Index, r.Topic, r.QoS, r.Client, topic, clientID)
					}
				}
			}
			if n != 1 {
				t.Errorf("the QoS 2 publish is in the log %d times, want exactly 1", n)
			}
		})
	}
}

// TestCrashQoS2PipelinedResendLogsOnce kills tandem while a persistent
// 3.1.1 session has many QoS 2 publishes in flight, then behaves as MQTT
// 3.1.1 section 4.4 requires of the client: on reconnecting it resends
// every PUBLISH it got no PUBREC for (DUP) and a PUBREL for every PUBREC it
// got, and answers each PUBREC with a PUBREL. Each publish must then be in
// the log exactly once: a publish whose record reached the disk before the
// kill must be recognised when it is resent.
func TestCrashQoS2PipelinedResendLogsOnce(t *testing.T) {
	const (
		trials   = 3
		inflight = 400 // QoS 2 publishes sent in one burst
		topic    = "crash/qos2burst"
	)
	seed := crashSeed(t)
	t.Logf("seed %d (replay with TANDEM_CRASH_SEED=%d)", seed, seed)
	rng := rand.New(rand.NewSource(seed))
	for trial := 0; trial < trials; trial++ {
		dir := t.TempDir()
		clientID := fmt.Sprintf("qos2-burst-%d", trial)
		payload := func(pid uint16) []byte { return []byte(fmt.Sprintf("burst:%d:%d", trial, pid)) }

		p := startTandem(t, dir, nil)
		c := dialMQTT(t, p.addrs.mqtt, 4)
		c.connect(clientID, false)
		var burst []byte
		for pid := uint16(1); pid <= inflight; pid++ {
			burst = append(burst, c.publishPacket(topic, 2, false, pid, payload(pid))...)
		}
		// Read PUBRECs until the connection dies with the daemon.
		var mu sync.Mutex
		pubrec := map[uint16]bool{}
		readerDone := make(chan struct{})
		go func() {
			defer close(readerDone)
			for {
				typ, _, body, err := c.read(30 * time.Second)
				if err != nil {
					return
				}
				if typ == pktPubrec && len(body) >= 2 {
					mu.Lock()
					pubrec[uint16(body[0])<<8|uint16(body[1])] = true
					mu.Unlock()
				}
			}
		}()
		c.send(burst)
		delay := time.Duration(rng.Int63n(int64(8 * time.Millisecond)))
		time.Sleep(delay) // how long the burst runs before the kill: the random part of the test, not synchronisation
		p.kill9()
		c.c.Close()
		<-readerDone

		p = startTandem(t, dir, &p.addrs)
		c = dialMQTT(t, p.addrs.mqtt, 4)
		if !c.connect(clientID, false) {
			// The kill came before anything of the session reached the
			// disk. Legal only if nothing was promised: no PUBREC sent,
			// nothing logged (the session rides with the first records).
			c.c.Close()
			p.kill9()
			recs := runInspect(t, dir)
			if len(pubrec) > 0 || len(recs) > 0 {
				t.Errorf("trial %d: session present = 0 after the restart, but %d PUBRECs were sent and %d records logged before the kill", trial, len(pubrec), len(recs))
			}
			t.Logf("trial %d: killed %v after the burst, before the session was on disk; nothing logged", trial, delay)
			continue
		}
		var again []byte
		resent := 0
		for pid := uint16(1); pid <= inflight; pid++ {
			if pubrec[pid] {
				again = append(again, pubrelPacket(pid)...)
			} else {
				again = append(again, c.publishPacket(topic, 2, true, pid, payload(pid))...)
				resent++
			}
		}
		c.send(again)
		released := map[uint16]bool{}
		for pid := range pubrec {
			released[pid] = true
		}
		complete := map[uint16]bool{}
		deadline := time.Now().Add(20 * time.Second)
		for len(complete) < inflight {
			typ, _, body, err := c.read(time.Until(deadline))
			if err != nil {
				t.Fatalf("trial %d: %d of %d QoS 2 flows complete after the restart: %v", trial, len(complete), inflight, err)
			}
			if len(body) < 2 {
				continue
			}
			pid := uint16(body[0])<<8 | uint16(body[1])
			switch typ {
			case pktPubrec:
				if !released[pid] {
					released[pid] = true
					c.send(pubrelPacket(pid))
				}
			case pktPubcomp:
				complete[pid] = true
			}
		}
		c.send([]byte{0xe0, 0})
		c.c.Close()
		p.kill9()

		count := map[string][]uint64{}
		for _, r := range runInspect(t, dir) {
			count[string(r.payload)] = append(count[string(r.payload)], r.Index)
		}
		bad := 0
		for pid := uint16(1); pid <= inflight; pid++ {
			if idx := count[string(payload(pid))]; len(idx) != 1 {
				bad++
				if bad <= 5 {
					t.Errorf("trial %d: packet id %d (PUBREC before the kill: %v) is in the log %d times, at %v; want once", trial, pid, pubrec[pid], len(idx), idx)
				}
			}
		}
		t.Logf("trial %d: killed %v after the burst; %d PUBRECs before the kill, %d PUBLISHes resent; %d of %d publishes not logged exactly once",
			trial, delay, len(pubrec), resent, bad, inflight)
	}
}

// ---------------------------------------------------------------------------
// Test 3: inspect changes nothing, also after an unclean stop.

// fileState is what dirState records of one file.
type fileState struct {
	mode  fs.FileMode
	size  int64
	mtime time.Time
	sum   string
}

// dirState records every file under dir: mode, size, mtime and SHA-256.
func dirState(t *testing.T, dir string) map[string]fileState {
	t.Helper()
	out := map[string]fileState{}
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, path)
		info, err := d.Info()
		if err != nil {
			return err
		}
		st := fileState{mode: info.Mode(), size: info.Size(), mtime: info.ModTime()}
		if d.IsDir() {
			st.size = 0 // a directory's size says nothing about its entries
		}
		if info.Mode().IsRegular() {
			f, err := os.Open(path)
			if err != nil {
				return err
			}
			h := sha256.New()
			_, err = io.Copy(h, f)
			f.Close()
			if err != nil {
				return err
			}
			st.sum = hex.EncodeToString(h.Sum(nil))
		}
		out[rel] = st
		return nil
	})
	if err != nil {
		t.Fatalf("reading %s: %v", dir, err)
	}
	return out
}

func compareDirState(t *testing.T, what string, before, after map[string]fileState) {
	t.Helper()
	var names []string
	for n := range before {
		names = append(names, n)
	}
	for n := range after {
		if _, ok := before[n]; !ok {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	for _, n := range names {
		b, okb := before[n]
		a, oka := after[n]
		switch {
		case !okb:
			t.Errorf("%s created %s", what, n)
		case !oka:
			t.Errorf("%s removed %s", what, n)
		case a != b:
			t.Errorf("%s changed %s: before %+v, after %+v", what, n, b, a)
		}
	}
}

func TestInspectLeavesDataUntouched(t *testing.T) {
	dir := t.TempDir()
	p := startTandem(t, dir, nil)

	// A persistent session with a QoS 2 publish half done, so the file
	// holds session state as well as log entries.
	raw := dialMQTT(t, p.addrs.mqtt, 4)
	raw.connect("inspect-session", false)
	raw.send(raw.publishPacket("inspect/qos2", 2, false, 1, []byte("half done")))
	raw.expectAck(pktPubrec, 1, 0)

	// QoS 1 load, then SIGKILL with publishes in flight.
	var connected, done sync.WaitGroup
	stop := make(chan struct{})
	var res pubResult
	connected.Add(1)
	done.Add(1)
	go func() {
		defer done.Done()
		publish(p.addrs.mqtt, "inspectPub", 0, &connected, stop, &res)
	}()
	connected.Wait()
	if res.connErr != nil {
		t.Fatal(res.connErr)
	}
	deadline := time.Now().Add(10 * time.Second)
	tick := time.NewTicker(5 * time.Millisecond)
	for res.progress.Load() < 200 && time.Now().Before(deadline) {
		<-tick.C
	}
	tick.Stop()
	p.kill9()
	close(stop)
	done.Wait()
	raw.c.Close()
	t.Logf("killed with %d QoS 1 publishes sent, %d acked", res.sent, len(res.acked))

	before := dirState(t, dir)
	recs := runInspect(t, dir)
	if len(recs) == 0 {
		t.Errorf("inspect printed no records")
	}
	compareDirState(t, "tandem inspect", before, dirState(t, dir))
	runInspect(t, dir, "--all", "--from", "2", "--limit", "5")
	compareDirState(t, "tandem inspect --all --from 2 --limit 5", before, dirState(t, dir))
}
