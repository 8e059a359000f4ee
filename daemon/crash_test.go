package daemon_test

// Crash tests: the real `tandem` binary run as a child process, killed with
// SIGKILL under load, then read back with `tandem inspect` (DESIGN.md,
// "Guarantees" and "How it is tested").
//
// The binary is built once per test binary, lazily, by tandemBinary. Every
// child is started by startTandem, which registers a t.Cleanup that kills
// and reaps it; nothing else is ever signalled.

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	paho "github.com/eclipse/paho.mqtt.golang"
	"github.com/tandem-edge/tandem/internal/testutil"
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
	out     *testutil.Buffer
	exited  chan struct{} // closed once cmd.Wait has returned
	waitErr error         // cmd.Wait's result, read after exited
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
			two := testutil.FreeAddrs(t, 2)
			a = tandemAddrs{mqtt: two[0], http: two[1]}
		}
		p := &tandemProc{t: t, dataDir: dataDir, addrs: a, out: &testutil.Buffer{}, exited: make(chan struct{})}
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
				t.Logf("tandem (pid %d, data %s) output:\n%s", p.cmd.Process.Pid, p.dataDir, p.out.Tail(4000))
			}
		})
		err := p.waitReady(readyTimeout)
		if err == nil {
			return p
		}
		p.kill9()
		lastOut = p.out.Tail(4000)
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
