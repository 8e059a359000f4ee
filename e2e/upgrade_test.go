package e2e

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/internal/netns"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// upgradeLoad is what runs on a cluster while it is upgraded: a sync and
// an async QoS 1 publisher (MQTT 5, one in flight each, moving to the next
// gateway when theirs goes) and a persistent-session subscriber to both.
type upgradeLoad struct {
	sync, async *publisher
	sub         *persistentSub
}

func startUpgradeLoad(t *testing.T, g1, g2, g3 *gw) *upgradeLoad {
	t.Helper()
	all := func(first int) []*gw {
		gws := []*gw{g1, g2, g3}
		return []*gw{gws[first%3], gws[(first+1)%3], gws[(first+2)%3]}
	}
	u := &upgradeLoad{
		sub: startPersistentSub(t, "sub-persistent", []string{"s/up/#", "a/up/#"}, all(2)...),
		// Paced: a subscriber that follows the cluster from member to
		// member replays what it missed meanwhile.
		sync:  startPublisher(t, "pub-sync", "s/up/1", 5*time.Millisecond, all(0)...),
		async: startPublisher(t, "pub-async", "a/up/1", 5*time.Millisecond, all(1)...),
	}
	u.sync.waitAcks(t, 50, 15*time.Second)
	u.async.waitAcks(t, 50, 15*time.Second)
	return u
}

// restartOn stops g (SIGTERM), starts bin on its data dir and waits until
// it is back in the cluster of gws and sync publishes are acked again.
func (u *upgradeLoad) restartOn(t *testing.T, g *gw, bin string, gws ...*gw) {
	t.Helper()
	began := time.Now()
	g.stopWithin(15 * time.Second)
	g.startBin(bin)
	masterOf(t, 20*time.Second, gws...)
	u.sync.waitAcks(t, 20, 10*time.Second)
	u.async.waitAcks(t, 20, 10*time.Second)
	u.checkGaps(t, g.name+" restarted on "+binName(bin), began)
}

// maxAckGap is the longest a publisher may go without an ack while a
// member restarts: a sync publish held by a stopping master is refused
// after sync_timeout (5 s), and the next one taken by the new master.
const maxAckGap = 8 * time.Second

// checkGaps fails if a publisher went longer than maxAckGap without an
// ack since began.
func (u *upgradeLoad) checkGaps(t *testing.T, what string, began time.Time) {
	t.Helper()
	sg, ag := u.sync.longestGap(began), u.async.longestGap(began)
	t.Logf("%s: back in the cluster %v after its SIGTERM; longest time without an ack: sync %v, async %v", what, time.Since(began).Round(time.Millisecond), sg.Round(time.Millisecond), ag.Round(time.Millisecond))
	if sg > maxAckGap || ag > maxAckGap {
		t.Errorf("%s: publishes went unacked for %v (sync) and %v (async), want at most %v", what, sg, ag, maxAckGap)
	}
}

// finish stops the load, waits until the members agree, and checks what
// a rolling upgrade must keep: every acked record in every member's log
// in each publisher's order, the persistent subscriber got every acked
// record, every member answers its status and stops on SIGTERM in 5 s.
// Their logs are read with inspectBin (a build that knows their level).
func (u *upgradeLoad) finish(t *testing.T, inspectBin string, gws ...*gw) {
	t.Helper()
	syncAcked, syncRefused := u.sync.stop()
	asyncAcked, asyncRefused := u.async.stop()
	acked := map[string]time.Time{}
	for p, at := range syncAcked {
		acked[p] = at
	}
	for p, at := range asyncAcked {
		acked[p] = at
	}
	converge(t, 20*time.Second, gws...)
	u.sub.waitGot(t, acked, 20*time.Second)
	conns, lost, dups := u.sub.stop()
	t.Logf("%d sync and %d async publishes acked (%d and %d refused); the persistent subscriber got them all over %d connections (%d duplicates)", len(syncAcked), len(asyncAcked), syncRefused, asyncRefused, conns, dups)
	if lost > 0 {
		t.Errorf("the persistent subscriber found its session gone on %d of %d connects", lost, conns)
	}
	for _, g := range gws {
		s := g.status()
		if s == nil {
			t.Fatalf("%s does not answer its status", g.name)
		}
		if s.Storage.Damaged != nil || len(s.Storage.Lost) > 0 {
			t.Errorf("%s: storage damaged %+v, lost %v", g.name, s.Storage.Damaged, s.Storage.Lost)
		}
	}
	for _, g := range gws {
		g.stopWithin(5 * time.Second)
	}
	for _, g := range gws {
		log := logOf(t, inspectBin, g)
		checkLogged(t, g, log, acked)
		checkLoadOrder(t, g, log, "pub-sync-", syncAcked)
		checkLoadOrder(t, g, log, "pub-async-", asyncAcked)
	}
}

// The feature levels of the build under test and of the tandem_next test
// build (storage.FeatureLevel in each; e2e runs the binaries, and a build
// of this package knows only one of them).
const (
	thisLevel = 4
	nextLevel = 5
)

func binName(bin string) string {
	if bin == builtBin {
		return "the build under test"
	}
	i := strings.LastIndex(bin, "/")
	return bin[i+1:]
}

// From the previous release to this build, one member at a time under
// load, then one member back to the previous release and forth again
// (DESIGN.md, "Versions and upgrades"): nothing acked is lost, the feature
// level rises once every member runs this build, and an old build is then
// kept out without harm to anyone's data.
func TestUpgradeFromPreviousRelease(t *testing.T) {
	netns.Skip(t)
	old, tag := releaseBin(t)
	cur := tandemBin(t)
	// The builds first, alone (tests run one at a time until each has
	// called Parallel); the rest mostly waits, beside the other tests.
	t.Parallel()
	began := time.Now()
	g1, g2, g3 := threeOf(t, old)
	gws := []*gw{g1, g2, g3}
	u := startUpgradeLoad(t, g1, g2, g3)
	t.Logf("a cluster of %s under load after %v", tag, time.Since(began).Round(time.Millisecond))

	for i, g := range slavesFirst(t, gws...) {
		u.restartOn(t, g, cur, gws...)
		if i < len(gws)-1 {
			// A member still runs the previous release: the level stays.
			if s := g.levels(); s == nil || s.Cluster.FeatureLevel != 1 {
				t.Fatalf("%s: feature level %+v with a member still on %s, want 1", g.name, s, tag)
			}
		}
	}
	waitLevel(t, thisLevel, 15*time.Second, gws...)
	m := masterOf(t, 15*time.Second, gws...)
	if s := m.levels(); s != nil {
		for _, mb := range s.Members {
			if mb.FeatureLevel != thisLevel {
				t.Errorf("master %s: member %s says level %d (release %q), want %d", m.name, mb.Name, mb.FeatureLevel, mb.Version, thisLevel)
			}
		}
	}
	t.Logf("every member on the build under test, feature level %d, after %v", thisLevel, time.Since(began).Round(time.Millisecond))

	// One slave back to the previous release: the level is raised, so its
	// peers refuse it at the handshake (or it rejoins); the others serve.
	var back *gw
	for _, g := range gws {
		if g != m {
			back = g
			break
		}
	}
	downAt := time.Now()
	back.stopWithin(15 * time.Second)
	back.spawn(old)
	oldProc := back.proc
	refusal := "knows feature levels up to 1"
	var outcome string
	testutil.WaitFor(t, 20*time.Second, back.name+" on "+tag+" refused, exited or rejoined", func() bool {
		select {
		case <-oldProc.Done():
			outcome = "exited"
			return true
		default:
		}
		for _, g := range gws {
			if g != back && strings.Contains(g.proc.Output(), refusal) {
				outcome = "refused at the handshake by " + g.name
				return true
			}
		}
		if s := m.status(); s != nil {
			for _, mb := range s.Members {
				if mb.Name == back.name && mb.Reachable && mb.LagRecords == 0 {
					outcome = "rejoined"
					return true
				}
			}
		}
		return false
	})
	// A while of load with the old build beside the cluster, retrying.
	u.sync.waitAcks(t, 200, 15*time.Second)
	u.async.waitAcks(t, 20, 10*time.Second)
	select {
	case <-oldProc.Done():
	default:
		back.stopWithin(15 * time.Second)
	}
	t.Logf("%s on %s: %s; the others kept serving. Its last output:\n%s", back.name, tag, outcome, lastLines(oldProc.Output(), 6))
	back.startBin(cur)
	masterOf(t, 20*time.Second, gws...)
	u.sync.waitAcks(t, 20, 10*time.Second)
	u.async.waitAcks(t, 20, 10*time.Second)
	u.checkGaps(t, back.name+" to "+tag+" and back", downAt)
	waitLevel(t, thisLevel, 10*time.Second, gws...)

	u.finish(t, cur, gws...)
	t.Logf("upgrade test done in %v", time.Since(began).Round(time.Millisecond))
}

// A record too large for a run of the log (over about 2 KB) is stored in
// pieces of a page, which the previous release cannot read: the data file
// says format 4 from then on, and that release refuses to start on it,
// naming both formats, and leaves it as it is; this build serves it again,
// the record in it. (A data dir that never held such a record stays at
// format 3: TestUpgradeFromPreviousRelease takes one back.)
func TestPreviousReleaseRefusesADataDirWithPieces(t *testing.T) {
	netns.Skip(t)
	old, tag := releaseBin(t)
	cur := tandemBin(t)
	// The builds first, alone (tests run one at a time until each has
	// called Parallel); the rest mostly waits, beside the other tests.
	t.Parallel()
	nt := netns.New(t, 1)
	g := newGW(t, nt.Hosts[0], "gw-1")
	g.startBin(cur)
	c, err := device(t, g, "big", nil)
	if err != nil {
		t.Fatal(err)
	}
	payload := bytes.Repeat([]byte("large record "), 100<<10/13)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if r, err := c.Publish(ctx, &paho.Publish{Topic: "big/x", QoS: 1, Payload: payload}); err != nil || r.ReasonCode != 0 {
		t.Fatalf("publish of %d bytes: %v, %+v", len(payload), err, r)
	}
	_ = c.Disconnect(&paho.Disconnect{})
	g.stopWithin(15 * time.Second)

	refusedBy(t, g, old, tag, "with a record in pieces", "data format 4, this build reads up to 3")

	g.startBin(cur)
	if s := g.status(); s == nil {
		t.Fatal("no status from this build back on its data dir")
	}
	g.stopWithin(5 * time.Second)
	found := false
	for _, r := range inspectAll(t, cur, g) {
		found = found || (r.Type == "record" && bytes.Equal(r.Payload, payload))
	}
	if !found {
		t.Error("the large record is not in the log after going back and forth")
	}
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// notes counts the KindNote records (a kind the release build does not
// know: inspect names it by number) in g's log, read with bin.
func notes(t *testing.T, bin string, g *gw) int {
	t.Helper()
	n := 0
	for _, r := range inspectAll(t, bin, g) {
		if r.Type == "control" && r.Kind == noteKind {
			n++
		}
	}
	return n
}

// noteKind is how inspect names storage.KindNote, which only a tandem_next
// build defines.
const noteKind = "kind-6"

// From this build (feature level 4) to a test build of a next release
// (-tags tandem_next: level 5 and a record kind gated behind it), one
// member at a time under load: while a member of this build remains, the
// level stays 4 and no record of the new kind is written, also with a
// next build as master; once all run it, the level is 5 and the new
// record is in every member's log. A data dir at level 5 then refuses
// this build, unchanged. The gating is proven before a real format change
// relies on it.
func TestUpgradeToNextLevel(t *testing.T) {
	netns.Skip(t)
	cur, next := tandemBin(t), nextBin(t)
	// The builds first, alone (tests run one at a time until each has
	// called Parallel); the rest mostly waits, beside the other tests.
	t.Parallel()
	began := time.Now()
	g1, g2, g3 := threeOf(t, cur)
	gws := []*gw{g1, g2, g3}
	waitLevel(t, thisLevel, 15*time.Second, gws...)
	u := startUpgradeLoad(t, g1, g2, g3)

	// A slave, then the master: a next build may now be master with a
	// member of this build left.
	order := slavesFirst(t, gws...)
	first, master, last := order[0], order[2], order[1]
	u.restartOn(t, first, next, gws...)
	u.restartOn(t, master, next, gws...)
	if m := masterOf(t, 15*time.Second, gws...); m == last {
		// This build's member leads: it cannot raise the level anyway.
		// Stopped until a next build leads, it hands the lead over; a
		// quick restart could win the election again (its log is as
		// long as theirs), which is raft, not a bug.
		began := time.Now()
		last.stopWithin(15 * time.Second)
		waitMaster(t, time.Now().Add(15*time.Second), first, master)
		last.startBin(cur)
		masterOf(t, 20*time.Second, gws...)
		u.sync.waitAcks(t, 20, 10*time.Second)
		u.async.waitAcks(t, 20, 10*time.Second)
		u.checkGaps(t, last.name+" restarted on "+binName(cur), began)
	}
	m := masterOf(t, 15*time.Second, gws...)
	if m == last {
		t.Fatalf("%s, on this build, is master again", m.name)
	}
	// The next build's master knows the member of this build says level
	// 3; for two of its raise checks (every 2 s), nothing may change.
	testutil.WaitFor(t, 15*time.Second, fmt.Sprintf("%s seeing %s at level %d", m.name, last.name, thisLevel), func() bool {
		s := m.levels()
		if s == nil {
			return false
		}
		for _, mb := range s.Members {
			if mb.Name == last.name && mb.FeatureLevel == thisLevel {
				return true
			}
		}
		return false
	})
	watched := time.Now()
	testutil.WaitFor(t, 15*time.Second, "5 s of a mixed cluster", func() bool {
		for _, g := range gws {
			if s := g.levels(); s != nil && s.Cluster.FeatureLevel != thisLevel {
				t.Fatalf("%s: feature level %d with %s still on this build", g.name, s.Cluster.FeatureLevel, last.name)
			}
		}
		return time.Since(watched) > 5*time.Second
	})
	for _, g := range gws {
		if n := notes(t, cur, g); n > 0 {
			t.Fatalf("%s: %d notes logged with %s still on this build", g.name, n, last.name)
		}
	}
	t.Logf("a mixed cluster, master %s on the next build, %s on this one: level %d, no note", m.name, last.name, thisLevel)

	u.restartOn(t, last, next, gws...)
	waitLevel(t, nextLevel, 15*time.Second, gws...)
	for _, g := range gws {
		testutil.WaitFor(t, 10*time.Second, "the note in "+g.name+"'s log", func() bool { return notes(t, next, g) > 0 })
	}
	t.Logf("every member on the next build: level %d and the note on every member, after %v", nextLevel, time.Since(began).Round(time.Millisecond))

	// A data dir at level 5 refuses this build, which changes nothing.
	m = masterOf(t, 15*time.Second, gws...)
	var slave *gw
	for _, g := range gws {
		if g != m {
			slave = g
			break
		}
	}
	downAt := time.Now()
	slave.stopWithin(15 * time.Second)
	before := dirDigest(t, slave.dir)
	slave.spawn(cur)
	select {
	case <-slave.proc.Done():
	case <-time.After(15 * time.Second):
		t.Fatalf("%s: this build still runs on a data dir at level %d", slave.name, nextLevel)
	}
	if out := slave.proc.Output(); slave.proc.Cmd.ProcessState.Success() || !strings.Contains(out, fmt.Sprintf("feature level %d", nextLevel)) {
		t.Fatalf("%s: this build on a data dir at level %d: exit %v, output:\n%s", slave.name, nextLevel, slave.proc.Cmd.ProcessState, out)
	}
	if after := dirDigest(t, slave.dir); after != before {
		t.Fatalf("%s: this build changed a data dir it refused", slave.name)
	}
	t.Logf("%s: this build refused its data dir: %s", slave.name, lastLines(slave.proc.Output(), 1))
	slave.startBin(next)
	masterOf(t, 20*time.Second, gws...)
	u.sync.waitAcks(t, 20, 10*time.Second)
	u.async.waitAcks(t, 20, 10*time.Second)
	u.checkGaps(t, slave.name+" refused by this build and back on the next", downAt)

	u.finish(t, next, gws...)
	t.Logf("next-level upgrade test done in %v", time.Since(began).Round(time.Millisecond))
}

// threeOf starts a 3-gateway cluster of the binary bin on hosts of its
// own: gw-1 the master, then gw-2 and gw-3 joined and caught up.
func threeOf(t *testing.T, bin string) (g1, g2, g3 *gw) {
	t.Helper()
	return threeOn(t, netns.New(t, 3), bin)
}

// threeOn is threeOf on the first three hosts of nt, for a test that
// cuts their links.
func threeOn(t *testing.T, nt *netns.Net, bin string) (g1, g2, g3 *gw) {
	t.Helper()
	g1, g2, g3 = newGW(t, nt.Hosts[0], "gw-1"), newGW(t, nt.Hosts[1], "gw-2"), newGW(t, nt.Hosts[2], "gw-3")
	for _, g := range []*gw{g1, g2, g3} {
		g.startBin(bin)
	}
	g2.joinBin(bin, g1)
	waitShape(t, g1, 0, 1, 15*time.Second)
	g3.joinBin(bin, g1)
	waitShape(t, g1, 2, 0, 15*time.Second)
	return g1, g2, g3
}

// While this build runs, its WAL may hold padded frames (a frame that
// would straddle a page starts at the next one), which the previous
// release takes for damage: a data dir this build left by a crash says
// format 5, and that release refuses it, naming both formats, and leaves
// it as it is. This build recovers it, the acked records in it; after a
// clean stop the data dir says format 3 again and the previous release
// runs on it.
func TestPreviousReleaseRefusesADataDirLeftByACrash(t *testing.T) {
	netns.Skip(t)
	old, tag := releaseBin(t)
	cur := tandemBin(t)
	t.Parallel()
	nt := netns.New(t, 1)
	g := newGW(t, nt.Hosts[0], "gw-1")
	g.startBin(cur)
	c, err := device(t, g, "dev", nil)
	if err != nil {
		t.Fatal(err)
	}
	// Records of 1.5 KB, small enough for a run of the log (no pieces,
	// which that release cannot read either): one frame in two or three
	// would straddle a page, so the WAL holds padded ones when it dies.
	payload := bytes.Repeat([]byte("p"), 1500)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for i := 0; i < 20; i++ {
		if r, err := c.Publish(ctx, &paho.Publish{Topic: "crash/x", QoS: 1, Payload: payload}); err != nil || r.ReasonCode != 0 {
			t.Fatalf("publish %d: %v, %+v", i, err, r)
		}
	}
	g.kill()

	refusedBy(t, g, old, tag, "this build left by a crash", "data format 5, this build reads up to")

	g.startBin(cur)
	g.stopWithin(5 * time.Second)
	n := 0
	for _, r := range inspectAll(t, cur, g) {
		if r.Type == "record" && bytes.Equal(r.Payload, payload) {
			n++
		}
	}
	if n != 20 {
		t.Errorf("%d of the 20 acked records in the log after the crash, want 20", n)
	}
	g.startBin(old)
	if s := g.status(); s == nil {
		t.Fatalf("no status from %s on a data dir this build stopped cleanly", tag)
	}
	g.stopWithin(5 * time.Second)
}

// refusedBy runs bin (release tag) on g's data dir, which it must refuse:
// it exits non-zero within seconds, saying want, and leaves the data dir
// as it was. what says which data dir, for the failures.
func refusedBy(t *testing.T, g *gw, bin, tag, what, want string) {
	t.Helper()
	before := dirDigest(t, g.dir)
	g.spawn(bin)
	select {
	case <-g.proc.Done():
	case <-time.After(15 * time.Second):
		t.Fatalf("%s still runs on a data dir %s", tag, what)
	}
	if out := g.proc.Output(); g.proc.Cmd.ProcessState.Success() || !strings.Contains(out, want) {
		t.Fatalf("%s on a data dir %s: exit %v, output:\n%s", tag, what, g.proc.Cmd.ProcessState, out)
	}
	if after := dirDigest(t, g.dir); after != before {
		t.Fatalf("%s changed a data dir it refused", tag)
	}
	t.Logf("%s refused the data dir: %s", tag, lastLines(g.proc.Output(), 1))
}
