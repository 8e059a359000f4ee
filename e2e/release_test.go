package e2e

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io/fs"
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

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// Helpers of the upgrade tests: other builds than the one under test (the
// previous release, built from git history; this tree with a build tag),
// gateways restarted on another binary, and what a rolling upgrade must
// keep.

// otherBuilt maps a build's key to its binary's path; guarded by buildMu.
var otherBuilt = map[string]string{}

// previousRelease is the last release RELEASES lists: its tag and commit.
func previousRelease(t *testing.T) (tag, commit string) {
	t.Helper()
	b, err := os.ReadFile("../RELEASES")
	if err != nil {
		t.Fatalf("the previous release: %v", err)
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) == 2 {
			tag, commit = f[0], f[1]
		}
	}
	if commit == "" {
		t.Fatal("RELEASES lists no release")
	}
	return tag, commit
}

// releaseBin builds the previous release from git history, as a release
// build (-trimpath, CGO_ENABLED=0, its tag as the version) and keeps it in
// bin/tandem-TAG-COMMIT, so that the next run takes it from there. The
// source is a temporary git worktree, removed afterwards. A clone without
// the commit (a shallow one) skips the test, or fails it under CI=true,
// where the whole history is cloned.
func releaseBin(t *testing.T) (bin, tag string) {
	t.Helper()
	tag, commit := previousRelease(t)
	buildMu.Lock()
	defer buildMu.Unlock()
	if b := otherBuilt[commit]; b != "" {
		return b, tag
	}
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	bin = filepath.Join(root, "bin", "tandem-"+tag+"-"+commit)
	if _, err := os.Stat(bin); err == nil {
		otherBuilt[commit] = bin
		return bin, tag
	}
	git := releaseGit(t, root, tag, commit)
	src, done := releaseWorktree(t, git, commit, "tandem-release-")
	defer done()
	const pkg = "github.com/tandem-edge/tandem/internal/version"
	out := filepath.Join(filepath.Dir(src), "tandem")
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags",
		"-X "+pkg+".Version="+tag+" -X "+pkg+".Commit="+commit[:7], "-o", out, ".")
	cmd.Dir = src
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOFLAGS=-buildvcs=false")
	started := time.Now()
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building %s (%s): %v\n%s", tag, commit, err, b)
	}
	if err := os.MkdirAll(filepath.Dir(bin), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(out, bin); err != nil {
		t.Fatal(err)
	}
	t.Logf("built %s (%s) in %v: %s", tag, commit[:7], time.Since(started).Round(time.Millisecond), bin)
	otherBuilt[commit] = bin
	return bin, tag
}

// startBin runs bin on the gateway's config and data dir and waits until
// its HTTP API answers.
func (g *gw) startBin(bin string) {
	g.t.Helper()
	g.spawn(bin)
	testutil.WaitFor(g.t, 15*time.Second, g.name+" serving", func() bool { return g.status() != nil })
}

// spawn runs bin on the gateway's config and data dir, and waits for
// nothing.
func (g *gw) spawn(bin string) {
	g.t.Helper()
	p := g.h.Start(g.h.Command(bin, "run", "--config", g.cfg))
	g.proc = p
	name := fmt.Sprintf("%s (%s)", g.name, filepath.Base(bin))
	g.t.Cleanup(func() {
		if g.t.Failed() {
			g.t.Logf("%s output:\n%s", name, p.Output())
		}
	})
}

// stopWithin stops the process with SIGTERM and fails unless it has
// exited within d.
func (g *gw) stopWithin(d time.Duration) {
	g.t.Helper()
	_ = g.proc.Cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-g.proc.Done():
	case <-time.After(d):
		g.t.Fatalf("%s: still running %v after SIGTERM", g.name, d)
	}
}

// cliBin is cli with another binary.
func (g *gw) cliBin(bin string, args ...string) (string, error) {
	switch args[0] {
	case "cluster", "pair", "promote", "status":
		args = append(args, "--config", g.cfg)
	}
	cmd := g.h.Command(bin, args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("%s %s: %v: %s", filepath.Base(bin), strings.Join(args, " "), err, errb.String())
	}
	return out.String(), nil
}

// joinBin is join with another binary's CLI.
func (g *gw) joinBin(bin string, inviter *gw) {
	g.t.Helper()
	out, err := inviter.cliBin(bin, "cluster", "invite")
	if err != nil {
		g.t.Fatal(err)
	}
	tok, _, _ := strings.Cut(out, "\n")
	if _, err := g.cliBin(bin, "cluster", "join", tok); err != nil {
		g.t.Fatal(err)
	}
}

// levelStatus is the part of the status JSON about releases and the
// feature level.
type levelStatus struct {
	Role    string `json:"role"`
	Cluster struct {
		FeatureLevel int `json:"feature_level"`
	} `json:"cluster"`
	Members []struct {
		Name         string `json:"name"`
		Version      string `json:"version"`
		FeatureLevel int    `json:"feature_level"`
		Reachable    bool   `json:"reachable"`
	} `json:"members"`
}

// levels asks the gateway's status for its releases and feature level;
// nil when it does not answer.
func (g *gw) levels() *levelStatus {
	var s levelStatus
	if !g.statusAs(&s) {
		return nil
	}
	return &s
}

// waitLevel waits until every one of gws says the cluster runs at level.
func waitLevel(t *testing.T, level int, within time.Duration, gws ...*gw) {
	t.Helper()
	var last []string
	testutil.WaitFor(t, within, fmt.Sprintf("feature level %d on every member", level), func() bool {
		last = last[:0]
		ok := true
		for _, g := range gws {
			s := g.levels()
			if s == nil {
				last = append(last, g.name+": no status")
				ok = false
				continue
			}
			last = append(last, fmt.Sprintf("%s: %d", g.name, s.Cluster.FeatureLevel))
			ok = ok && s.Cluster.FeatureLevel == level
		}
		return ok
	}, func() string { return strings.Join(last, ", ") })
}

// masterOf waits until one of gws is master and sees the others as
// voters, caught up, and returns it.
func masterOf(t *testing.T, within time.Duration, gws ...*gw) *gw {
	t.Helper()
	m := waitMaster(t, time.Now().Add(within), gws...)
	waitShape(t, m, len(gws)-1, 0, within)
	return m
}

// slavesFirst orders gws as a rolling upgrade goes: the slaves, then the
// master.
func slavesFirst(t *testing.T, gws ...*gw) []*gw {
	t.Helper()
	m := masterOf(t, 15*time.Second, gws...)
	var order []*gw
	for _, g := range gws {
		if g != m {
			order = append(order, g)
		}
	}
	return append(order, m)
}

// persistentSub is an MQTT 5 device with a persistent session (QoS 1)
// that follows the cluster: when its gateway goes it connects to the next
// one, resuming its session there. It counts what it receives.
type persistentSub struct {
	t     *testing.T
	id    string
	mu    sync.Mutex // guards got, lost
	got   map[string]int
	lost  int // connects that found no session
	conns int
	stopc chan struct{}
	wg    sync.WaitGroup
}

func startPersistentSub(t *testing.T, id string, filters []string, gws ...*gw) *persistentSub {
	s := &persistentSub{t: t, id: id, got: map[string]int{}, stopc: make(chan struct{})}
	expiry := uint32(3600)
	subscribed := false
	onMsg := func(p *paho.Publish) {
		s.mu.Lock()
		s.got[string(p.Payload)]++
		s.mu.Unlock()
	}
	connect := func(g *gw) (*paho.Client, error) {
		c, ca, err := connectDevice(t, g, &paho.Connect{ClientID: id, CleanStart: !subscribed, KeepAlive: 10,
			Properties: &paho.ConnectProperties{SessionExpiryInterval: &expiry}}, onMsg)
		if err != nil {
			return nil, err
		}
		s.mu.Lock()
		s.conns++
		if subscribed && !ca.SessionPresent {
			s.lost++
		}
		s.mu.Unlock()
		if !subscribed {
			var subs []paho.SubscribeOptions
			for _, f := range filters {
				subs = append(subs, paho.SubscribeOptions{Topic: f, QoS: 1})
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if _, err := c.Subscribe(ctx, &paho.Subscribe{Subscriptions: subs}); err != nil {
				return nil, err
			}
			subscribed = true
		}
		return c, nil
	}
	c, err := connect(gws[0])
	if err != nil {
		t.Fatal(err)
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for at := 0; ; {
			select {
			case <-c.Done():
			case <-s.stopc:
				_ = c.Disconnect(&paho.Disconnect{})
				return
			}
			for {
				at++
				if c, err = connect(gws[at%len(gws)]); err == nil {
					break
				}
				select {
				case <-s.stopc:
					return
				case <-time.After(100 * time.Millisecond): // a stopping gateway refuses at once
				}
			}
		}
	}()
	return s
}

// waitGot waits until the subscriber has received every payload of acked
// whose topic prefix it subscribed to (want reports which).
func (s *persistentSub) waitGot(t *testing.T, acked map[string]time.Time, within time.Duration) {
	t.Helper()
	missing := 0
	testutil.WaitFor(t, within, s.id+" receiving every acked record", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		missing = 0
		for p := range acked {
			if s.got[p] == 0 {
				missing++
			}
		}
		return missing == 0
	}, func() string { return fmt.Sprintf("%d of %d acked records not received", missing, len(acked)) })
}

func (s *persistentSub) stop() (conns, lost, dups int) {
	close(s.stopc)
	s.wg.Wait()
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, n := range s.got {
		dups += n - 1
	}
	return s.conns, s.lost, dups
}

// checkLoadOrder fails unless g's log holds the acked publishes of the
// load client whose payloads start with prefix in the order it published
// them (one in flight: each acked before the next was sent).
func checkLoadOrder(t *testing.T, g *gw, log []string, prefix string, acked map[string]time.Time) {
	t.Helper()
	last, violations, n := -1, 0, 0
	seen := map[string]bool{}
	for _, p := range log {
		s, ok := strings.CutPrefix(p, prefix)
		if !ok || seen[p] {
			continue
		}
		seen[p] = true
		if _, ok := acked[p]; !ok {
			continue // refused: it may be logged, anywhere
		}
		i, err := strconv.Atoi(s)
		if err != nil {
			continue
		}
		n++
		if i < last {
			violations++
		}
		last = i
	}
	if violations > 0 || n == 0 {
		t.Errorf("%s: %s*: %d of %d acked publishes in its log out of order", g.name, prefix, violations, n)
	}
}

// publisher is an MQTT 5 device publishing QoS 1 on one topic, one
// publish in flight, at most one per pace, that moves to the next gateway
// of its list when its connection goes. Its payloads are id-seq. A
// publish whose connection goes is given up at once (its gateway stopped:
// no ack can come), so a stop costs the load a reconnect, not a timeout.
type publisher struct {
	t     *testing.T
	id    string
	mu    sync.Mutex // guards acked, times, refused
	acked map[string]time.Time
	times []time.Time // of the acks, in order
	// refused counts PUBACKs with a failure reason (0x80 while a member
	// restarts, say).
	refused int
	n       atomic.Int64
	stopc   chan struct{}
	wg      sync.WaitGroup
}

func startPublisher(t *testing.T, id, topic string, pace time.Duration, gws ...*gw) *publisher {
	p := &publisher{t: t, id: id, acked: map[string]time.Time{}, stopc: make(chan struct{})}
	p.wg.Add(1)
	go p.run(topic, pace, gws)
	return p
}

func (p *publisher) run(topic string, pace time.Duration, gws []*gw) {
	defer p.wg.Done()
	tick := time.NewTicker(pace)
	defer tick.Stop()
	var c *paho.Client
	var connCtx context.Context
	for seq, at := 0, 0; ; {
		select {
		case <-p.stopc:
			if c != nil {
				_ = c.Disconnect(&paho.Disconnect{})
			}
			return
		case <-tick.C:
		}
		if c == nil {
			var err error
			if c, err = device(p.t, gws[at%len(gws)], p.id, nil); err != nil {
				c, at = nil, at+1
				continue
			}
			var cancel context.CancelFunc
			connCtx, cancel = context.WithCancel(context.Background())
			p.wg.Add(1)
			go func(c *paho.Client) {
				defer p.wg.Done()
				select {
				case <-c.Done():
				case <-p.stopc:
				}
				cancel()
			}(c)
		}
		payload := fmt.Sprintf("%s-%d", p.id, seq)
		seq++
		ctx, cancel := context.WithTimeout(connCtx, 8*time.Second)
		r, err := c.Publish(ctx, &paho.Publish{Topic: topic, QoS: 1, Payload: []byte(payload)})
		cancel()
		switch {
		case err != nil && r == nil:
			_ = c.Disconnect(&paho.Disconnect{})
			c, at = nil, at+1
		case r.ReasonCode < 0x80:
			now := time.Now()
			p.mu.Lock()
			p.acked[payload] = now
			p.times = append(p.times, now)
			p.mu.Unlock()
			p.n.Add(1)
		default:
			p.mu.Lock()
			p.refused++
			p.mu.Unlock()
		}
	}
}

// waitAcks waits until the publisher has n more acks than it had.
func (p *publisher) waitAcks(t *testing.T, n int64, within time.Duration) {
	t.Helper()
	want := p.n.Load() + n
	testutil.WaitFor(t, within, fmt.Sprintf("%s: %d acks", p.id, want), func() bool { return p.n.Load() >= want },
		func() string { return fmt.Sprintf("%d acks", p.n.Load()) })
}

// longestGap is the longest time without an ack since from (counting
// from the last ack before it) until now.
func (p *publisher) longestGap(from time.Time) time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	var gap time.Duration
	prev := from
	for _, at := range p.times {
		if at.Before(from) {
			prev = at
			continue
		}
		gap = max(gap, at.Sub(prev))
		prev = at
	}
	return max(gap, time.Since(prev))
}

// stop ends the publisher and returns what was acked, and how many
// publishes were refused.
func (p *publisher) stop() (acked map[string]time.Time, refused int) {
	close(p.stopc)
	p.wg.Wait()
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.acked, p.refused
}

// inspectRecord is the part of a `tandem inspect --all` line these tests
// read.
type inspectRecord struct {
	Type    string `json:"type"`
	Kind    string `json:"kind"`
	Payload []byte `json:"payload"` // base64 in the JSON
}

// inspectAll reads g's whole log, control records too, with bin's tandem
// inspect: from the data dir of a stopped gateway, over the HTTP API of a
// running one.
func inspectAll(t *testing.T, bin string, g *gw) []inspectRecord {
	t.Helper()
	cmd := g.h.Command(bin, "inspect", "--data", g.dir, "--all", "--config", g.cfg)
	var errb bytes.Buffer
	cmd.Stderr = &errb
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s inspect %s: %v: %s", filepath.Base(bin), g.name, err, errb.String())
	}
	var recs []inspectRecord
	dec := json.NewDecoder(bytes.NewReader(out))
	for dec.More() {
		var r inspectRecord
		if err := dec.Decode(&r); err != nil {
			t.Fatalf("inspect %s: %v", g.name, err)
		}
		recs = append(recs, r)
	}
	return recs
}

// logOf is g's device messages' payloads in log order, read with bin.
func logOf(t *testing.T, bin string, g *gw) []string {
	t.Helper()
	var log []string
	for _, r := range inspectAll(t, bin, g) {
		if r.Type == "record" {
			log = append(log, string(r.Payload))
		}
	}
	return log
}

// checkLogged fails unless every acked payload is in log, g's.
func checkLogged(t *testing.T, g *gw, log []string, acked map[string]time.Time) {
	t.Helper()
	in := map[string]bool{}
	for _, p := range log {
		in[p] = true
	}
	missing := 0
	for p := range acked {
		if !in[p] {
			if missing++; missing < 5 {
				t.Errorf("%s: acked %q not in its log", g.name, p)
			}
		}
	}
	if missing > 0 {
		t.Fatalf("%s: %d of %d acked records missing", g.name, missing, len(acked))
	}
	t.Logf("%s: all %d acked records in its log (%d records)", g.name, len(acked), len(log))
}

// nextBin builds this tree with -tags tandem_next (a test build of a next
// release: feature level 3, storage/kind_next.go) once per test binary.
func nextBin(t *testing.T) string { return tagBin(t, "tandem_next", "tandem-next") }

// tagBin builds this tree with -tags tag as binDir/name, once per run.
func tagBin(t *testing.T, tag, name string) string {
	t.Helper()
	buildMu.Lock()
	defer buildMu.Unlock()
	if b := otherBuilt[name]; b != "" {
		return b
	}
	out := filepath.Join(binDir, name)
	cmd := exec.Command("go", "build", "-tags", tag, "-o", out, ".")
	cmd.Dir = ".."
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build -tags %s: %v\n%s", tag, err, b)
	}
	otherBuilt[name] = out
	return out
}

// dirDigest is a digest of every file under dir: names, sizes and
// contents.
func dirDigest(t *testing.T, dir string) string {
	t.Helper()
	h := sha256.New()
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		fmt.Fprintf(h, "%s %d\n", path, len(b))
		h.Write(b)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// releaseGit returns a runner of git in the clone at root, once it has
// checked that the release's commit is in the clone's history: it skips
// without it (a shallow clone), and fails under CI=true, which clones the
// whole history.
func releaseGit(t *testing.T, root, tag, commit string) func(args ...string) ([]byte, error) {
	t.Helper()
	git := func(args ...string) ([]byte, error) {
		cmd := exec.Command("git", args...)
		cmd.Dir = root
		return cmd.CombinedOutput()
	}
	if out, err := git("cat-file", "-e", commit+"^{commit}"); err != nil {
		msg := fmt.Sprintf("release %s (commit %s) is not in this clone's history (a shallow clone? git fetch --unshallow): %v %s", tag, commit, err, out)
		if os.Getenv("CI") == "true" {
			t.Fatal(msg + " (CI=true: CI clones the whole history)")
		}
		t.Skip("SKIPPED: " + msg)
	}
	return git
}

// releaseWorktree checks commit out in a worktree under a temporary
// directory named after prefix; done removes both.
func releaseWorktree(t *testing.T, git func(args ...string) ([]byte, error), commit, prefix string) (src string, done func()) {
	t.Helper()
	tmp, err := os.MkdirTemp("", prefix)
	if err != nil {
		t.Fatal(err)
	}
	src = filepath.Join(tmp, "src")
	if out, err := git("worktree", "add", "--detach", src, commit); err != nil {
		os.RemoveAll(tmp)
		t.Fatalf("git worktree add %s: %v: %s", commit, err, out)
	}
	return src, func() {
		if out, err := git("worktree", "remove", "--force", src); err != nil {
			t.Logf("git worktree remove %s: %v: %s", src, err, out)
			_, _ = git("worktree", "prune")
		}
		os.RemoveAll(tmp)
	}
}
