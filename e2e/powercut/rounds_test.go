// Package powercut runs power-cut rounds against the real gateway: its data
// dir on internal/powercut's filesystem, four clients publishing, the power
// cut at a seeded moment (the filesystem drops what was not synced, the
// process is killed at once), then a restart on what survived and a check
// of every acknowledged record. They need root and /dev/fuse and skip
// without them (fail under CI=true).
//
// POWERCUT_ROUNDS sets the number of rounds (20 by default), POWERCUT_SEED
// replays the one round of that seed (a failing round prints it).
package powercut

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	paho5 "github.com/eclipse/paho.golang/paho"
	paho3 "github.com/eclipse/paho.mqtt.golang"

	pc "github.com/tandem-edge/tandem/internal/powercut"
)

// tandemBin builds the gateway, with build tags if any, into the test's
// temp dir.
func tandemBin(t *testing.T, tags string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "tandem")
	args := []string{"build", "-o", p}
	if tags != "" {
		args = append(args, "-tags", tags)
	}
	cmd := exec.Command("go", append(args, "github.com/tandem-edge/tandem")...)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return p
}

// needFUSE skips without the power-cut filesystem, and fails under CI.
func needFUSE(t *testing.T) {
	t.Helper()
	if err := pc.Available(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("power-cut rounds need FUSE under CI: %v", err)
		}
		t.Skipf("power-cut rounds: %v (run as root on a machine with /dev/fuse)", err)
	}
}

// A round's kind says where the cut is aimed.
type kind int

const (
	walWrite   kind = iota // a WAL frame written, not yet synced
	walSync                // a WAL fdatasync requested, not yet done
	checkpoint             // a page of a checkpoint into bbolt written, not yet synced
	anytime                // a random instant
	interval               // storage.flush: interval, a random instant
	retention              // a data file write once retention drops records (an 8MiB budget)
	upgrade                // a write, sync, rename or unlink of the data dir's upgrade to format 6 at start
	nKinds
)

func (k kind) String() string {
	return [...]string{"wal-write", "wal-sync", "checkpoint", "anytime", "flush-interval", "retention", "upgrade"}[k]
}

// flushInterval is the interval rounds' storage.flush_interval.
const flushInterval = 50 * time.Millisecond

// retentionBudget is the storage.max_bytes of retention rounds: the least
// the config takes, so that the load passes it within a round.
const retentionBudget = "8MiB"

// client is one publisher of a round.
type client struct {
	id    string
	v5    bool
	qos   byte
	mu    sync.Mutex
	acked map[int]time.Time // seq → when its ack arrived
	err   error
}

func (c *client) topic() string { return "pc/" + c.id }

// payload is the record of seq: its number, padded so that checkpoints
// come often (one per about 256 records).
func payload(seq int) []byte {
	b := fmt.Appendf(nil, "%08d|", seq)
	return append(b, bytes.Repeat([]byte("p"), 1000)...)
}

func (c *client) ack(seq int) {
	c.mu.Lock()
	c.acked[seq] = time.Now()
	c.mu.Unlock()
}

// run publishes until ctx ends or an error (the cut): 3.1.1 with a window of
// 8, 5 one at a time.
func (c *client) run(ctx context.Context, addr string) {
	if c.v5 {
		c.err = c.run5(ctx, addr)
	} else {
		c.err = c.run3(ctx, addr)
	}
}

func (c *client) run3(ctx context.Context, addr string) error {
	o := paho3.NewClientOptions().AddBroker("tcp://" + addr).SetClientID(c.id).SetProtocolVersion(4).
		SetCleanSession(true).SetAutoReconnect(false).SetConnectRetry(false).SetWriteTimeout(5 * time.Second)
	cl := paho3.NewClient(o)
	if tk := cl.Connect(); !tk.WaitTimeout(5*time.Second) || tk.Error() != nil {
		return fmt.Errorf("connect: %v", tk.Error())
	}
	defer cl.Disconnect(0)
	type inflight struct {
		seq int
		tk  paho3.Token
	}
	win := make(chan inflight, 8)
	done := make(chan error, 1)
	go func() {
		for f := range win {
			var err error
			select {
			case <-f.tk.Done():
				err = f.tk.Error()
			case <-ctx.Done():
				err = ctx.Err()
			}
			if err != nil {
				done <- fmt.Errorf("seq %d: %v", f.seq, err)
				for range win {
				}
				return
			}
			c.ack(f.seq)
		}
		done <- nil
	}()
	for seq := 0; ; seq++ {
		select {
		case <-ctx.Done():
			close(win)
			return <-done
		default:
		}
		tk := cl.Publish(c.topic(), c.qos, false, payload(seq))
		select {
		case win <- inflight{seq, tk}:
		case err := <-done:
			close(win)
			return err
		}
	}
}

func (c *client) run5(rctx context.Context, addr string) error {
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return err
	}
	cl := paho5.NewClient(paho5.ClientConfig{ClientID: c.id, Conn: conn})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	ca, err := cl.Connect(ctx, &paho5.Connect{ClientID: c.id, CleanStart: true, KeepAlive: 30})
	cancel()
	if err != nil || ca.ReasonCode != 0 {
		return fmt.Errorf("connect: %v %+v", err, ca)
	}
	defer cl.Disconnect(&paho5.Disconnect{})
	for seq := 0; ; seq++ {
		if rctx.Err() != nil {
			return nil
		}
		ctx, cancel := context.WithTimeout(rctx, 10*time.Second)
		r, err := cl.Publish(ctx, &paho5.Publish{Topic: c.topic(), QoS: c.qos, Payload: payload(seq)})
		cancel()
		if err != nil {
			return fmt.Errorf("seq %d: %v", seq, err)
		}
		if r != nil && r.ReasonCode >= 0x80 {
			return fmt.Errorf("seq %d: reason %#x", seq, r.ReasonCode)
		}
		c.ack(seq)
	}
}

// runClients starts clients publishing to addr, each on a goroutine of its
// own: stop ends them, wait waits for them.
func runClients(clients []*client, addr string) (stop, wait func()) {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for _, c := range clients {
		c.acked = map[int]time.Time{}
		wg.Add(1)
		go func() { defer wg.Done(); c.run(ctx, addr) }()
	}
	return cancel, wg.Wait
}

// probe publishes one QoS 1 message and waits for its ack.
func probe(addr string) error {
	cl := paho3.NewClient(paho3.NewClientOptions().AddBroker("tcp://" + addr).SetClientID("probe").
		SetAutoReconnect(false).SetConnectRetry(false))
	if tk := cl.Connect(); !tk.WaitTimeout(5*time.Second) || tk.Error() != nil {
		return fmt.Errorf("connect: %v", tk.Error())
	}
	defer cl.Disconnect(0)
	if tk := cl.Publish("probe", 1, false, "after the cut"); !tk.WaitTimeout(5*time.Second) || tk.Error() != nil {
		return fmt.Errorf("publish: %v", tk.Error())
	}
	return nil
}

// gateway is one `tandem run` child.
type gateway struct {
	cmd    *exec.Cmd
	out    *bytes.Buffer
	outMu  *sync.Mutex
	mqtt   string
	http   string
	exited chan struct{}
	err    error
}

type lockedWriter struct {
	mu *sync.Mutex
	b  *bytes.Buffer
}

func (w lockedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func (g *gateway) output() string {
	g.outMu.Lock()
	defer g.outMu.Unlock()
	s := g.out.String()
	if len(s) > 3000 {
		s = "…" + s[len(s)-3000:]
	}
	return s
}

func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// startGateway starts the gateway on dir with flush mode and waits for
// /healthz; an error says it did not come up (a refusal to start).
func startGateway(bin, base, dir, flush, maxBytes string) (*gateway, error) {
	var last error
	for attempt := 0; attempt < 3; attempt++ {
		mq, err1 := freeAddr()
		ht, err2 := freeAddr()
		for err2 == nil && ht == mq { // the port just freed may come again
			ht, err2 = freeAddr()
		}
		if err := errors.Join(err1, err2); err != nil {
			return nil, err
		}
		cfg := filepath.Join(base, "tandem.yaml")
		yaml := fmt.Sprintf("storage:\n  flush: %s\n  flush_interval: %s\n", flush, flushInterval)
		if maxBytes != "" {
			yaml += "  max_bytes: " + maxBytes + "\n"
		}
		if err := os.WriteFile(cfg, []byte(yaml), 0o644); err != nil {
			return nil, err
		}
		g, err := launch(bin, cfg, dir, mq, ht, "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		if last = g.waitReady(15 * time.Second); last == nil {
			return g, nil
		}
		g.kill()
		if !strings.Contains(g.output(), "address already in use") {
			return nil, fmt.Errorf("the gateway did not start: %v\n%s", last, g.output())
		}
	}
	return nil, last
}

// launch starts `tandem run` on dir with config cfg and these listeners,
// without waiting for it.
func launch(bin, cfg, dir, mqtt, http, peer string, extra ...string) (*gateway, error) {
	g := &gateway{out: &bytes.Buffer{}, outMu: &sync.Mutex{}, mqtt: mqtt, http: http, exited: make(chan struct{})}
	args := append([]string{"run", "--config", cfg, "--data", dir, "--mqtt", mqtt, "--http", http, "--peer", peer}, extra...)
	g.cmd = exec.Command(bin, args...)
	g.cmd.Stdout = lockedWriter{g.outMu, g.out}
	g.cmd.Stderr = g.cmd.Stdout
	if err := g.cmd.Start(); err != nil {
		return nil, err
	}
	go func() { g.err = g.cmd.Wait(); close(g.exited) }()
	return g, nil
}

var httpc = &http.Client{Timeout: 2 * time.Second}

func (g *gateway) waitReady(d time.Duration) error {
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		select {
		case <-g.exited:
			return fmt.Errorf("it exited: %v", g.err)
		default:
		}
		// Ours, not another test's gateway that took the port between
		// its pick and this one's bind (this one then exits with
		// "address already in use"): it says it started on that address.
		if r, err := httpc.Get("http://" + g.http + "/healthz"); err == nil {
			r.Body.Close()
			if r.StatusCode == 200 && strings.Contains(g.output(), "http="+g.http+" ") {
				return nil
			}
		}
		time.Sleep(20 * time.Millisecond) // polling interval
	}
	return errors.New("no /healthz 200 within " + d.String())
}

// kill sends SIGKILL to the gateway's pid and reaps it.
func (g *gateway) kill() {
	select {
	case <-g.exited:
		return
	default:
	}
	_ = g.cmd.Process.Signal(syscall.SIGKILL)
	<-g.exited
}

// stop sends SIGTERM and waits up to d for a clean exit.
func (g *gateway) stop(d time.Duration) error {
	_ = g.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-g.exited:
		if g.err != nil {
			return fmt.Errorf("exit after SIGTERM: %v", g.err)
		}
		return nil
	case <-time.After(d):
		g.kill()
		return fmt.Errorf("no exit within %s of SIGTERM", d)
	}
}

// record is one line of `tandem inspect --json`.
type record struct {
	Index   uint64 `json:"index"`
	QoS     byte   `json:"qos"`
	Topic   string `json:"topic"`
	Client  string `json:"client"`
	Payload string `json:"payload"`
	// Republished marks a record a deposed master's tail gave again.
	Republished bool `json:"republished"`
}

// inspect reads the stopped gateway's log: per client, the seqs in log
// order.
func inspect(bin, dir string) (map[string][]int, error) {
	recs, err := inspectSeqs(bin, dir)
	seqs := map[string][]int{}
	for id, rs := range recs {
		for _, r := range rs {
			seqs[id] = append(seqs[id], r.seq)
		}
	}
	return seqs, err
}

// logSeq is one of a client's records in the log.
type logSeq struct {
	seq         int
	republished bool
}

// inspectSeqs reads the stopped gateway's log: per client, its records in
// log order.
func inspectSeqs(bin, dir string) (map[string][]logSeq, error) {
	out, err := exec.Command(bin, "inspect", "--data", dir, "--json").Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return nil, fmt.Errorf("tandem inspect: %v: %s", err, ee.Stderr)
		}
		return nil, err
	}
	seqs := map[string][]logSeq{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var r record
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			return nil, fmt.Errorf("inspect line %q: %v", sc.Text(), err)
		}
		if !strings.HasPrefix(r.Topic, "pc/") {
			continue
		}
		p, err := base64.StdEncoding.DecodeString(r.Payload)
		if err != nil || len(p) < 9 {
			return nil, fmt.Errorf("record %d: payload %q", r.Index, r.Payload)
		}
		seq, err := strconv.Atoi(string(p[:8]))
		if err != nil || !bytes.Equal(p, payload(seq)) {
			return nil, fmt.Errorf("record %d of %s: damaged payload", r.Index, r.Client)
		}
		id := strings.TrimPrefix(r.Topic, "pc/")
		seqs[id] = append(seqs[id], logSeq{seq, r.Republished})
	}
	return seqs, sc.Err()
}

// outcome is what one round found.
type outcome struct {
	seed       uint64
	kind       kind
	tear       bool
	cut        pc.CutReport
	acked      int
	present    int
	lostByDesn int           // flush: interval: acked records lost with unsynced WAL writes, allowed
	lostAge    time.Duration // the oldest of those: acked that long before the cut
	dropped    int           // retention rounds: acked records older than every kept one, allowed
	violations []string
	phases     []string // how long each part took
	aim        string   // upgrade rounds: what the cut was aimed at
}

func (o *outcome) phase(name string, since *time.Time) {
	o.phases = append(o.phases, fmt.Sprintf("%s %s", name, time.Since(*since).Round(time.Millisecond)))
	*since = time.Now()
}

func (o *outcome) String() string {
	kind := o.kind.String()
	if o.aim != "" {
		kind += ": " + o.aim
	}
	return fmt.Sprintf("seed %d (%s, tear=%v): %d acked, %d present, %d lost with unsynced WAL writes (acked up to %s before the cut), %d oldest dropped by retention; cut at %v, %d writes and %d names %v dropped, torn %q",
		o.seed, kind, o.tear, o.acked, o.present, o.lostByDesn, o.lostAge.Round(time.Millisecond), o.dropped, o.cut.Op, o.cut.Writes, o.cut.Names, o.cut.NameList, o.cut.Torn)
}

// round runs one round in a fresh dir under base, of one of kinds (any
// when none is given), chosen by the seed like everything else. An error is a failure
// of the harness or of the gateway to come up; violations are what the
// check found.
func round(bin, base string, seed uint64, kinds ...kind) (*outcome, error) {
	rng := rand.New(rand.NewPCG(seed, 0x706f77657263))
	if len(kinds) == 0 {
		kinds = []kind{walWrite, walSync, checkpoint, anytime, interval, retention}
	}
	o := &outcome{seed: seed, kind: kinds[rng.IntN(len(kinds))]}
	o.tear = o.kind != anytime && o.kind != interval && rng.IntN(2) == 0
	budget := ""
	if o.kind == retention {
		budget = retentionBudget
	}
	fs, backing, mnt, err := mountRound(base, seed)
	if err != nil {
		return nil, err
	}
	defer fs.Unmount()
	t0 := time.Now()
	flush := "always"
	if o.kind == interval {
		flush = "interval"
	}
	g, err := startGateway(bin, base, mnt, flush, budget)
	if err != nil {
		return nil, fmt.Errorf("first start: %w", err)
	}
	defer g.kill()
	o.phase("start", &t0)
	clients := []*client{
		{id: "c311q1", qos: 1}, {id: "c311q2", qos: 2},
		{id: "c5q1", v5: true, qos: 1}, {id: "c5q2", v5: true, qos: 2},
	}
	stop, wait := runClients(clients, g.mqtt)
	defer stop()
	// Aim: after a seeded delay, cut at the next operation of the
	// round's kind (skipping a seeded few), or at once for anytime and
	// interval rounds; a checkpoint that does not come within 2 s is cut
	// where it stands.
	delay := time.Duration(200+rng.IntN(600)) * time.Millisecond
	skip := rng.IntN(6)
	time.Sleep(delay) // the seeded moment: load runs meanwhile
	if o.kind == retention {
		// The cut comes among the data file writes of the checkpoints
		// that drop the oldest records.
		if err := waitDropping(g.http, 20*time.Second); err != nil {
			return nil, err
		}
	}
	var cutAt time.Time
	want := func(op pc.Op) bool {
		switch o.kind {
		case retention:
			return op.Kind == pc.Write && op.Path == "tandem.db"
		case walWrite:
			return op.Kind == pc.Write && strings.HasPrefix(op.Path, "tandem.wal")
		case walSync:
			return op.Kind == pc.Sync && strings.HasPrefix(op.Path, "tandem.wal")
		case checkpoint:
			return op.Kind == pc.Write && op.Path == "tandem.db"
		}
		return false
	}
	if o.kind == anytime || o.kind == interval {
		fs.Cut(o.tear)
	} else {
		n := 0
		fs.CutWhen(func(op pc.Op) bool {
			if !want(op) {
				return false
			}
			n++
			return n > skip
		}, o.tear)
		select {
		case <-fs.Done():
		case <-time.After(2 * time.Second):
			fs.Cut(o.tear)
		}
	}
	cutAt = time.Now()
	// What of the WAL survived: everything written before the first
	// write the cut dropped from either file. The last fsync is not
	// that: the two files are synced one at a time, and a checkpoint's
	// cut syncs the one it ends while frames go on into the other.
	walLost := fs.LostFrom("tandem.wal")
	g.kill() // at once: nothing it does after the cut reaches the disk anyway
	stop()   // acks still on their way were sent before the kill
	wait()
	o.cut = *fs.Report()
	o.phase("load", &t0)
	if err := fs.Unmount(); err != nil {
		return nil, fmt.Errorf("unmount: %v", err)
	}
	o.phase("unmount", &t0)
	// Restart on what survived: it must come up, answer, take a publish
	// and stop on SIGTERM.
	g2, err := startGateway(bin, base, backing, flush, budget)
	if err != nil {
		o.violations = append(o.violations, fmt.Sprintf("the gateway refused to start on what survived: %v", err))
		return o, nil
	}
	defer g2.kill()
	o.phase("restart", &t0)
	if err := probe(g2.mqtt); err != nil {
		o.violations = append(o.violations, fmt.Sprintf("the restarted gateway acks no publish: %v", err))
	}
	if r, err := httpc.Get("http://" + g2.http + "/v1/status"); err != nil || r.StatusCode != 200 {
		o.violations = append(o.violations, fmt.Sprintf("the restarted gateway's status: %v", err))
	} else {
		r.Body.Close()
	}
	if err := g2.stop(5 * time.Second); err != nil {
		o.violations = append(o.violations, "the restarted gateway: "+err.Error())
	}
	o.phase("probe+stop", &t0)
	seqs, err := inspect(bin, backing)
	o.phase("inspect", &t0)
	if err != nil {
		o.violations = append(o.violations, err.Error())
		return o, nil
	}
	for _, c := range clients {
		o.check(c, seqs[c.id], cutAt, walLost)
	}
	return o, nil
}

// mountRound mounts a round's power-cut filesystem: mnt, over backing,
// both made under base.
func mountRound(base string, seed uint64) (fs *pc.FS, backing, mnt string, err error) {
	backing, mnt = filepath.Join(base, "backing"), filepath.Join(base, "mnt")
	for _, d := range []string{backing, mnt} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, "", "", err
		}
	}
	fs, err = pc.Mount(backing, mnt, &pc.Options{Seed: seed})
	return fs, backing, mnt, err
}

// waitDropping waits until the gateway's log has dropped records (its
// first index is past 1).
func waitDropping(http string, d time.Duration) error {
	deadline := time.Now().Add(d)
	for {
		var st struct {
			Log struct {
				FirstIndex uint64 `json:"first_index"`
			} `json:"log"`
		}
		if r, err := httpc.Get("http://" + http + "/v1/status"); err == nil {
			err = json.NewDecoder(r.Body).Decode(&st)
			r.Body.Close()
			if err == nil && st.Log.FirstIndex > 1 {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("retention dropped nothing within %v of load on a %s budget", d, retentionBudget)
		}
		time.Sleep(20 * time.Millisecond) // polling a live gateway's status
	}
}

// check compares what client c was acked with what the log holds.
//
// flush: always: every acked seq is present. flush: interval (DESIGN.md: a
// power cut loses up to one flush_interval of acked records; the flusher's
// fdatasyncs cover every frame written before them): a missing acked seq
// must have been acked after the first WAL write the cut dropped (walLost,
// as the filesystem saw it; a frame is written before its ack), and be part
// of the tail: nothing present after it. Retention rounds: a missing acked
// seq must be older than every seq present, the oldest records being the
// ones dropped. All: seqs in publish order, QoS 2 ones once.
func (o *outcome) check(c *client, got []int, cutAt, walLost time.Time) {
	present := map[int]int{}
	prev := -1
	for _, s := range got {
		present[s]++
		if present[s] > 1 {
			if c.qos == 2 {
				o.violations = append(o.violations, fmt.Sprintf("%s: QoS 2 seq %d is in the log %d times", c.id, s, present[s]))
			}
			continue
		}
		if s < prev {
			o.violations = append(o.violations, fmt.Sprintf("%s: seq %d after seq %d: out of order", c.id, s, prev))
		}
		prev = s
	}
	o.acked += len(c.acked)
	o.present += len(present)
	maxPresent, minPresent := -1, -1
	for s := range present {
		maxPresent = max(maxPresent, s)
		if minPresent < 0 || s < minPresent {
			minPresent = s
		}
	}
	if o.kind == retention && len(present) == 0 && len(c.acked) > 0 {
		o.violations = append(o.violations, fmt.Sprintf("%s: none of %d acked seqs is in the log: retention kept nothing of it", c.id, len(c.acked)))
	}
	var lost []int
	for s, at := range c.acked {
		if present[s] > 0 {
			continue
		}
		if o.kind == interval && s > maxPresent && !walLost.IsZero() && !at.Before(walLost) {
			o.lostByDesn++
			o.lostAge = max(o.lostAge, cutAt.Sub(at))
			continue
		}
		if o.kind == retention && s < minPresent {
			o.dropped++
			continue
		}
		lost = append(lost, s)
		if len(lost) <= 3 {
			when := "no write to the WAL was lost"
			if !walLost.IsZero() {
				when = fmt.Sprintf("%s before the first WAL write the cut dropped", walLost.Sub(at).Round(time.Millisecond))
			}
			o.violations = append(o.violations, fmt.Sprintf("%s: acked seq %d (acked %s before the cut, %s) is not in the log",
				c.id, s, cutAt.Sub(at).Round(time.Millisecond), when))
		}
	}
	if len(lost) > 3 {
		o.violations = append(o.violations, fmt.Sprintf("%s: %d acked seqs missing in all", c.id, len(lost)))
	}
}

// seeds returns the rounds to run: POWERCUT_SEED alone, or POWERCUT_ROUNDS
// (default n) from a base seed that changes from run to run.
func seeds(t *testing.T, n int) []uint64 {
	if s := os.Getenv("POWERCUT_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("POWERCUT_SEED=%q: %v", s, err)
		}
		return []uint64{v}
	}
	if s := os.Getenv("POWERCUT_ROUNDS"); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v < 1 {
			t.Fatalf("POWERCUT_ROUNDS=%q: want a positive number", s)
		}
		n = v
	}
	base := uint64(time.Now().UnixNano()) % 1_000_000_000 * 1000
	out := make([]uint64, n)
	for i := range out {
		out[i] = base + uint64(i)
	}
	return out
}

// TestPowerCutRounds cuts the power under load, restarts on what
// survived and checks every acked record (see round and check).
func TestPowerCutRounds(t *testing.T) {
	needFUSE(t)
	runRounds(t, tandemBin(t, ""), 20, "TestPowerCutRounds$", nil)
}

// TestPowerCutRoundsFormat6 runs the rounds against a test build whose
// new data dirs are in format 6, the WAL's segments as the log (storage's
// tandem_format6 tag), before that format is the default: a segment cut,
// made ready or dropped is where this format can lose what format 5 could
// not. Each round's data dir must be in format 6.
func TestPowerCutRoundsFormat6(t *testing.T) {
	needFUSE(t)
	runRounds(t, tandemBin(t, "tandem_format6"), 12, "TestPowerCutRoundsFormat6", format6Dir)
}

// runRounds runs the rounds of seeds (n by default) against bin, checking
// each data dir with dirCheck if it is given. name is the test to replay a
// failed round with.
func runRounds(t *testing.T, bin string, n int, name string, dirCheck func(dir string) error) {
	start := time.Now()
	var kinds [nKinds]int
	failed := 0
	for _, seed := range seeds(t, n) {
		base := t.TempDir()
		o, err := round(bin, base, seed)
		if err != nil {
			t.Fatalf("seed %d: %v (replay: POWERCUT_SEED=%d)", seed, err, seed)
		}
		kinds[o.kind]++
		if dirCheck != nil {
			if err := dirCheck(filepath.Join(base, "backing")); err != nil {
				o.violations = append(o.violations, "data dir: "+err.Error())
			}
		}
		if len(o.violations) > 0 {
			failed++
			t.Errorf("round %s\n  %s\n  replay: POWERCUT_SEED=%d go test ./e2e/powercut/ -run '%s'", o, strings.Join(o.violations, "\n  "), seed, name)
			continue
		}
		if testing.Verbose() {
			t.Logf("round %s: ok (%s)", o, strings.Join(o.phases, ", "))
		}
	}
	el := time.Since(start)
	ran := 0
	for _, k := range kinds {
		ran += k
	}
	t.Logf("%d rounds (%d failed) in %s: %.0f rounds/min; by kind: %v", ran, failed, el.Round(time.Millisecond), float64(ran)/el.Minutes(), kinds)
}

// TestPowerCutRoundsCatchAMissingFsync runs the rounds against a gateway
// built with the deliberate fault of storage's tandem_nowalsync tag (a WAL
// append acked without its fdatasync): the rounds must find acked records
// missing. A process crash could not show this; only the power cut does.
func TestPowerCutRoundsCatchAMissingFsync(t *testing.T) {
	needFUSE(t)
	bin := tandemBin(t, "tandem_nowalsync")
	base := uint64(time.Now().UnixNano()) % 1_000_000_000 * 1000
	for i := range uint64(5) {
		o, err := round(bin, t.TempDir(), base+i, walWrite, walSync, anytime)
		if err != nil {
			t.Fatalf("seed %d: %v", base+i, err)
		}
		for _, v := range o.violations {
			if strings.Contains(v, "is not in the log") {
				t.Logf("round %s caught it: %s", o, v)
				return
			}
		}
		t.Logf("round %s: nothing found: %v", o, o.violations)
	}
	t.Fatal("5 rounds against a WAL without fdatasync found no acked record missing: the harness cannot see a missing fsync")
}
