package replication

import (
	"context"
	"errors"
	"fmt"
	"math/rand"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.etcd.io/raft/v3"
	pb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/internal/testutil"
	"github.com/tandem-edge/tandem/storage"
)

// memNet is an in-memory network between the nodes of one test, with the
// faults a LAN has: dropped, delayed, duplicated and reordered messages, and
// cut links. Its randomness comes from one seed, printed (TANDEM_SEED=n
// sets it), but the nodes run on the wall clock and their own goroutines, so
// a seed gives the same mix of faults, not the same run: simNet
// (replay_test.go), on logical ticks, replays a seed exactly.
type memNet struct {
	t  *testing.T
	mu sync.Mutex // guards everything below
	// nodes by id; a stopped node is absent.
	nodes map[uint64]*Node
	rng   *rand.Rand
	cut   map[[2]uint64]bool
	drop  float64 // probability a message is lost
	dup   float64 // probability it is delivered twice
	delay time.Duration
	wg    sync.WaitGroup
}

func newMemNet(t *testing.T) *memNet {
	seed := time.Now().UnixNano()
	if s := os.Getenv("TANDEM_SEED"); s != "" {
		seed, _ = strconv.ParseInt(s, 10, 64)
	}
	t.Logf("network seed %d (replay with TANDEM_SEED=%d)", seed, seed)
	n := &memNet{t: t, nodes: map[uint64]*Node{}, rng: rand.New(rand.NewSource(seed)), cut: map[[2]uint64]bool{}}
	t.Cleanup(n.wg.Wait)
	return n
}

// endpoint is one node's Transport.
type endpoint struct {
	net  *memNet
	from uint64
}

func (e endpoint) Send(msgs []pb.Message) {
	nw := e.net
	for _, m := range msgs {
		nw.mu.Lock()
		to := nw.nodes[m.To]
		lost := to == nil || nw.cut[[2]uint64{m.From, m.To}] || nw.rng.Float64() < nw.drop
		copies := 1
		if nw.rng.Float64() < nw.dup {
			copies = 2
		}
		var wait time.Duration
		if nw.delay > 0 {
			wait = time.Duration(nw.rng.Int63n(int64(nw.delay)))
		}
		nw.mu.Unlock()
		if lost {
			continue
		}
		for i := 0; i < copies; i++ {
			if wait == 0 && i == 0 {
				to.Step(m)
				continue
			}
			// A delayed copy overtakes later messages: reordering.
			nw.wg.Add(1)
			time.AfterFunc(wait, func() {
				defer nw.wg.Done()
				to.Step(m)
			})
		}
	}
}

// memForwarder is Forward over the memNet, honouring its cuts.
type memForwarder struct {
	net  *memNet
	from uint64
}

// With the network's delay set, a request waits a random part of it
// first, so concurrent requests overtake each other as handlers on their
// own goroutines do.
func (f memForwarder) Forward(ctx context.Context, master uint64, batch []byte) ([]byte, error) {
	for {
		f.net.mu.Lock()
		to, cut := f.net.nodes[master], f.net.cut[[2]uint64{f.from, master}]
		var wait time.Duration
		if f.net.delay > 0 {
			wait = time.Duration(f.net.rng.Int63n(int64(f.net.delay)))
		}
		f.net.mu.Unlock()
		if to != nil && !cut {
			if wait > 0 {
				select {
				case <-ctx.Done():
					return nil, ctx.Err()
				case <-time.After(wait):
				}
			}
			return to.HandleForward(ctx, f.from, batch)
		}
		select { // the link is down: the request waits like a TCP retry
		case <-ctx.Done():
			return nil, fmt.Errorf("%w (%w)", ctx.Err(), ErrNotSent) // it never left
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// isolate cuts every link of id, both ways; heal undoes all cuts.
func (nw *memNet) isolate(id uint64) {
	nw.mu.Lock()
	defer nw.mu.Unlock()
	for other := range nw.nodes {
		nw.cut[[2]uint64{id, other}] = true
		nw.cut[[2]uint64{other, id}] = true
	}
}

func (nw *memNet) heal() {
	nw.mu.Lock()
	defer nw.mu.Unlock()
	clear(nw.cut)
}

// cluster is n voters on one memNet, each with its own data dir.
type cluster struct {
	t     *testing.T
	net   *memNet
	ids   []uint64
	dirs  map[uint64]string
	nodes map[uint64]*testNode
	peers []raft.Peer
	// storeOpts, if set, opens every member's data file (retention).
	storeOpts *storage.Options
	// mutate, if set, adjusts every member's config.
	mutate func(*Config)
}

func newCluster(t *testing.T, n int) *cluster { return newClusterWith(t, n, nil) }

// newClusterWith is newCluster with every member's config adjusted.
func newClusterWith(t *testing.T, n int, mutate func(*Config)) *cluster {
	c := &cluster{t: t, net: newMemNet(t), dirs: map[uint64]string{}, nodes: map[uint64]*testNode{}, mutate: mutate}
	for i := 0; i < n; i++ {
		dir := t.TempDir()
		id, err := LoadOrCreateIdentity(dir)
		if err != nil {
			t.Fatal(err)
		}
		c.ids = append(c.ids, id.ID)
		c.dirs[id.ID] = dir
		c.peers = append(c.peers, raft.Peer{ID: id.ID})
	}
	for _, id := range c.ids {
		c.start(id)
	}
	return c
}

func (c *cluster) start(id uint64) *testNode {
	t := c.t
	tn := openTestNodeOpts(t, c.dirs[id], c.storeOpts, func(cfg *Config) {
		cfg.Transport, cfg.Forwarder, cfg.InitialMembers = endpoint{c.net, id}, memForwarder{c.net, id}, c.peers
		if c.mutate != nil {
			c.mutate(cfg)
		}
	})
	c.attach(id, tn)
	return tn
}

// attach puts tn on the network as id; it is stopped when the test ends.
func (c *cluster) attach(id uint64, tn *testNode) {
	c.net.mu.Lock()
	c.net.nodes[id] = tn.Node
	c.net.mu.Unlock()
	c.nodes[id] = tn
	c.t.Cleanup(func() { c.stop(id) })
}

// setFaults sets the probability that a message is lost or duplicated, and
// the most it may be delayed.
func (nw *memNet) setFaults(drop, dup float64, delay time.Duration) {
	nw.mu.Lock()
	nw.drop, nw.dup, nw.delay = drop, dup, delay
	nw.mu.Unlock()
}

func (c *cluster) stop(id uint64) {
	tn := c.nodes[id]
	if tn == nil {
		return
	}
	c.net.mu.Lock()
	delete(c.net.nodes, id)
	c.net.mu.Unlock()
	delete(c.nodes, id)
	tn.stop()
}

// leader waits for a node that is master with a majority agreeing.
func (c *cluster) leader() *testNode {
	c.t.Helper()
	var lead *testNode
	waitFor(c.t, "a master", func() bool {
		lead = nil
		for _, tn := range c.nodes {
			s, err := tn.Status(context.Background())
			if err == nil && s.Role == "master" {
				lead = tn
			}
		}
		return lead != nil
	})
	return lead
}

// proposeUntil proposes until the current master accepts, retrying across
// elections, and returns the outcome.
func (c *cluster) propose(topic string, mode AckMode) result {
	c.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		lead := c.leader()
		r := wait(c.t, lead.propose(c.t, topic, mode))
		if !errors.Is(r.err, ErrNotLeader) || time.Now().After(deadline) {
			return r
		}
	}
}

// masterOtherThan waits for a master other than old (a deposed one).
func (c *cluster) masterOtherThan(old uint64) *testNode {
	c.t.Helper()
	var lead *testNode
	waitFor(c.t, "a new master", func() bool {
		for id, tn := range c.nodes {
			if s, err := tn.Status(context.Background()); err == nil && id != old && s.Role == "master" {
				lead = tn
				return true
			}
		}
		return false
	})
	return lead
}

func (c *cluster) applied(id uint64) []string {
	tn := c.nodes[id]
	tn.app.mu.Lock()
	defer tn.app.mu.Unlock()
	out := make([]string, len(tn.app.recs))
	for i, r := range tn.app.recs {
		out[i] = r.Topic
	}
	return out
}

func TestThreeVotersAckSyncOnlyWithAReplica(t *testing.T) {
	c := newCluster(t, 3)
	lead := c.leader()
	for i := 0; i < 20; i++ {
		r := c.propose(fmt.Sprintf("s/%d", i), Sync)
		if r.err != nil {
			t.Fatalf("sync proposal %d: %v", i, r.err)
		}
		// Acked sync means on the master's disk and on another member's.
		holders := 0
		for _, id := range c.ids {
			if last, _ := c.nodes[id].db.LastIndex(); last >= r.index {
				holders++
			}
		}
		if holders < 2 {
			t.Fatalf("sync record %d acked while on %d member(s)", r.index, holders)
		}
	}
	for _, id := range c.ids {
		waitFor(t, "every member applies the 20 records", func() bool { return len(c.applied(id)) == 20 })
	}
	if fmt.Sprint(c.applied(c.ids[0])) != fmt.Sprint(c.applied(c.ids[1])) || fmt.Sprint(c.applied(c.ids[1])) != fmt.Sprint(c.applied(c.ids[2])) {
		t.Fatal("members applied different logs")
	}
	_ = lead
}

func TestIsolatedMasterStopsAckingSyncAndANewOneIsElected(t *testing.T) {
	c := newCluster(t, 3)
	old := c.leader()
	if r := c.propose("before", Sync); r.err != nil {
		t.Fatal(r.err)
	}
	c.net.isolate(old.ID())
	// On the cut-off master a sync publish cannot find a replica.
	r := wait(t, old.propose(t, "cut-off", Sync))
	if r.err == nil {
		t.Fatal("an isolated master acked a sync record")
	}
	// The others elect a new master (check-quorum makes the old one step down).
	waitFor(t, "a new master among the others", func() bool {
		for id, tn := range c.nodes {
			if id == old.ID() {
				continue
			}
			if s, err := tn.Status(context.Background()); err == nil && s.Role == "master" {
				return true
			}
		}
		return false
	})
	waitFor(t, "the old master steps down", func() bool {
		s, err := old.Status(context.Background())
		return err == nil && s.Role != "master"
	})
	c.net.heal()
	if r := c.propose("after", Sync); r.err != nil {
		t.Fatal(r.err)
	}
}

// Over a lossy, reordering network, every sync-acked record ends up on every
// member, and members apply the same log.
func TestSyncAckedRecordsSurviveAFaultyNetwork(t *testing.T) {
	c := newCluster(t, 3)
	c.net.setFaults(0.05, 0.05, 5*time.Millisecond)
	var acked []string
	for i := 0; i < 60; i++ {
		topic := fmt.Sprintf("f/%d", i)
		if r := c.propose(topic, Sync); r.err == nil {
			acked = append(acked, topic)
		}
		if i == 30 {
			c.stop(c.leader().ID()) // the master dies mid-run
		}
	}
	c.net.setFaults(0, 0, 0)
	if len(acked) < 30 {
		t.Fatalf("only %d of 60 sync proposals acked", len(acked))
	}
	for id := range c.nodes {
		waitFor(t, "survivors apply every acked record", func() bool {
			got := map[string]bool{}
			for _, tp := range c.applied(id) {
				got[tp] = true
			}
			for _, tp := range acked {
				if !got[tp] {
					return false
				}
			}
			return true
		})
	}
}

// startJoiner starts a fresh node that waits to be added to the cluster.
func (c *cluster) startJoiner() uint64 {
	t := c.t
	dir := t.TempDir()
	ident, err := LoadOrCreateIdentity(dir)
	if err != nil {
		t.Fatal(err)
	}
	tn := openTestNodeOpts(t, dir, c.storeOpts, func(cfg *Config) {
		cfg.Transport, cfg.Join = endpoint{c.net, ident.ID}, true
	})
	c.ids = append(c.ids, ident.ID)
	c.dirs[ident.ID] = dir
	c.attach(ident.ID, tn)
	return ident.ID
}

func (c *cluster) change(typ pb.ConfChangeType, id uint64) error {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return c.leader().ChangeMember(ctx, typ, Member{ID: id, Name: "gw-" + ShortID(id), Addrs: []string{"198.51.100.1:7883"}})
}

func (c *cluster) voters() (voters, learners int) {
	st, err := c.leader().Status(context.Background())
	if err != nil {
		c.t.Fatal(err)
	}
	voters = 1 // the master
	for _, m := range st.Members {
		if m.Learner {
			learners++
		} else {
			voters++
		}
	}
	return voters, learners
}

// 1 → 2 → 3 → 2 gateways: the second joins as a learner (RocketMQ's slave,
// and enough for sync acks), the third joins as a learner and both slaves
// become voters; removing one demotes the other back to learner. A fourth
// is refused, and so is removing the last voter.
func TestGrowAndShrinkMembership(t *testing.T) {
	c := newCluster(t, 1)
	a := c.ids[0]
	if r := c.propose("solo", Sync); !errors.Is(r.err, ErrAckTimeout) {
		t.Fatalf("sync on one gateway: %v", r.err)
	}
	b := c.startJoiner()
	if err := c.change(pb.ConfChangeAddLearnerNode, b); err != nil {
		t.Fatal(err)
	}
	if r := c.propose("two", Sync); r.err != nil {
		t.Fatalf("sync with a learner slave: %v", r.err)
	}
	waitFor(t, "the slave has the whole log", func() bool { return len(c.applied(b)) == 2 })

	cc := c.startJoiner()
	if err := c.change(pb.ConfChangeAddLearnerNode, cc); err != nil {
		t.Fatal(err)
	}
	for _, id := range []uint64{b, cc} {
		if err := c.change(pb.ConfChangeAddNode, id); err != nil {
			t.Fatalf("promote %s: %v", ShortID(id), err)
		}
	}
	if v, l := c.voters(); v != 3 || l != 0 {
		t.Fatalf("after 2 → 3: %d voters, %d learners", v, l)
	}
	d := c.startJoiner()
	if err := c.change(pb.ConfChangeAddLearnerNode, d); !errors.Is(err, ErrClusterFull) {
		t.Fatalf("a fourth member: %v, want ErrClusterFull", err)
	}
	members := c.leader().Members()
	if len(members) != 3 {
		t.Fatalf("members %v", members)
	}
	for _, m := range members {
		if m.ID != a && (m.Name != "gw-"+ShortID(m.ID) || len(m.Addrs) != 1) {
			t.Fatalf("member details lost: %+v", m)
		}
	}

	// 3 → 2: remove a slave, demote the other.
	lead := c.leader().ID()
	var others []uint64
	for _, id := range []uint64{a, b, cc} {
		if id != lead {
			others = append(others, id)
		}
	}
	if err := c.change(pb.ConfChangeRemoveNode, others[0]); err != nil {
		t.Fatal(err)
	}
	if err := c.change(pb.ConfChangeAddLearnerNode, others[1]); err != nil {
		t.Fatal(err)
	}
	if v, l := c.voters(); v != 1 || l != 1 {
		t.Fatalf("after 3 → 2: %d voters, %d learners", v, l)
	}
	if r := c.propose("two-again", Sync); r.err != nil {
		t.Fatalf("sync after 3 → 2: %v", r.err)
	}
	if err := c.change(pb.ConfChangeRemoveNode, lead); !errors.Is(err, ErrLastVoter) {
		t.Fatalf("removing the last voter: %v, want ErrLastVoter", err)
	}
}

func (c *cluster) follower() *testNode {
	c.t.Helper()
	lead := c.leader()
	for _, tn := range c.nodes {
		if tn != lead {
			return tn
		}
	}
	c.t.Fatal("no follower")
	return nil
}

// A publish taken on a slave is forwarded to the master and acked under the
// same rule; a retried forward of the same record is logged once.
func TestSlaveForwardsToMasterOnce(t *testing.T) {
	c := newCluster(t, 3)
	f := c.follower()
	data := f.record(t, "via/slave")
	for i := 0; i < 2; i++ { // the second is a retry of the same record
		ch := make(chan result, 1)
		f.Propose(data, Sync, func(idx uint64, err error) { ch <- result{idx, err} })
		if r := wait(t, ch); r.err != nil {
			t.Fatalf("forwarded sync publish (try %d): %v", i, r.err)
		}
	}
	for _, id := range c.ids {
		waitFor(t, "every member applies the forwarded record", func() bool { return len(c.applied(id)) >= 1 })
	}
	// Something proposed later proves nothing else is still on its way.
	if r := c.propose("marker", Async); r.err != nil {
		t.Fatal(r.err)
	}
	for _, id := range c.ids {
		waitFor(t, "the marker", func() bool { return len(c.applied(id)) == 2 })
		if got := c.applied(id); got[0] != "via/slave" {
			t.Fatalf("member %s applied %v", ShortID(id), got)
		}
	}
}

// A slave cut off from the master cannot get a publish acked: after
// sync_timeout the device gets the "no slave reachable" outcome.
func TestCutOffSlaveTimesOut(t *testing.T) {
	c := newCluster(t, 3)
	f := c.follower()
	c.net.isolate(f.ID())
	start := time.Now()
	r := wait(t, f.propose(t, "lost/slave", Async))
	if !errors.Is(r.err, ErrAckTimeout) || !errors.Is(r.err, ErrNoMaster) {
		t.Fatalf("publish on a cut-off slave: %v, want ErrNoMaster (an ErrAckTimeout)", r.err)
	}
	if el := time.Since(start); el < 2*time.Second {
		t.Fatalf("gave up after %v, before sync_timeout", el)
	}
}

// A master cut off from the others keeps acking async publishes (they are
// on its disk) until it steps down; when it rejoins, raft overwrites that
// tail, and the requeue re-publishes it on the new master: nothing acked is
// lost (DESIGN.md, "Truncation eats async acks").
func TestDeposedMastersAsyncAcksAreRequeued(t *testing.T) {
	c := newCluster(t, 3)
	old := c.leader()
	if r := c.propose("before", Async); r.err != nil {
		t.Fatal(r.err)
	}
	acked := cutOffAcks(t, c, old)
	// The others elect a master and write over the same indexes.
	lead2 := c.masterOtherThan(old.ID())
	for i := 0; i < 10; i++ {
		if r := wait(t, lead2.propose(t, fmt.Sprintf("new/%d", i), Sync)); r.err != nil {
			t.Fatal(r.err)
		}
	}
	c.net.heal()
	waitAppliedEverywhere(t, c, acked)
	// The count follows the re-published records' answers, which may come
	// after the records are applied everywhere (seen under ARM qemu).
	waitFor(t, fmt.Sprintf("the deposed master to count at least %d re-published records", len(acked)), func() bool {
		return old.Requeued() >= uint64(len(acked))
	})
}

// cutOffAcks cuts old, the master, off from the others and has it ack a
// few async publishes they never get; it returns their topics.
func cutOffAcks(t *testing.T, c *cluster, old *testNode) []string {
	t.Helper()
	c.net.isolate(old.ID())
	var acked []string
	for i := 0; i < 5; i++ {
		topic := fmt.Sprintf("cut/%d", i)
		if r := wait(t, old.propose(t, topic, Async)); r.err == nil {
			acked = append(acked, topic)
		}
	}
	if len(acked) == 0 {
		t.Fatal("the cut-off master acked nothing; the test needs it to")
	}
	return acked
}

// waitAppliedEverywhere waits until every member applied every topic.
func waitAppliedEverywhere(t *testing.T, c *cluster, topics []string) {
	t.Helper()
	lacks := func(id uint64) []string {
		got := map[string]bool{}
		for _, tp := range c.applied(id) {
			got[tp] = true
		}
		var out []string
		for _, tp := range topics {
			if !got[tp] {
				out = append(out, tp)
			}
		}
		return out
	}
	// On a timeout, what every member holds: which of them lacks what,
	// whom it follows and how far its log and its applier got.
	diag := func() string {
		var b strings.Builder
		for _, id := range c.ids {
			tn := c.nodes[id]
			first, _ := tn.db.FirstIndex()
			last, _ := tn.db.LastIndex()
			fmt.Fprintf(&b, "member %d: leader %d, log %d..%d, %d applied, lacks %v; ", id, tn.Leader(), first, last, len(c.applied(id)), lacks(id))
		}
		return b.String()
	}
	for _, id := range c.ids {
		testutil.WaitFor(t, 20*time.Second, "every async ack of the deposed master on every member",
			func() bool { return len(lacks(id)) == 0 }, diag)
	}
}
