package replication

import (
	"cmp"
	"context"
	"fmt"
	"math/rand"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.etcd.io/raft/v3"
	pb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/storage"
)

// simNet is the network of a test that must replay exactly: nothing moves
// unless the test moves it, as in etcd raft's own network tests. Nodes tick
// only when told (Config.ticks), every message waits in one queue until the
// test delivers or drops it, and each turn of a node's loop ends before the
// next action (Config.afterTurn). So the one goroutine of the test decides
// every order from one seed, and a failing seed replays (TANDEM_SEED=n).
type simNet struct {
	t     *testing.T
	rng   *rand.Rand
	nodes []*simNode // in id order, so that raft's own id order is index order
	index map[uint64]int
	trace []string
	done  chan struct{} // closed when the test ends: turns stop waiting

	// queue is appended to by the node whose turn it is, while the test
	// waits for that turn to end: the turn's channel orders the two.
	queue []pb.Message
}

type simNode struct {
	*testNode
	ticks chan struct{}
	turns chan struct{}
}

// simEndpoint is every node's Transport: messages wait in the queue.
type simEndpoint struct{ net *simNet }

func (e simEndpoint) Send(msgs []pb.Message) { e.net.queue = append(e.net.queue, msgs...) }

// newSimNet starts n voters; lead is the only one whose election timeout
// the test can reach, so the election is not left to raft's randomness
// (crypto/rand, which no seed controls).
func newSimNet(t *testing.T, rng *rand.Rand, n, lead int) *simNet {
	s := &simNet{t: t, rng: rng, index: map[uint64]int{}, done: make(chan struct{})}
	type member struct {
		dir string
		id  uint64
	}
	var ms []member
	for range n {
		dir := t.TempDir()
		id, err := LoadOrCreateIdentity(dir)
		if err != nil {
			t.Fatal(err)
		}
		ms = append(ms, member{dir, id.ID})
	}
	slices.SortFunc(ms, func(a, b member) int { return cmp.Compare(a.id, b.id) })
	var peers []raft.Peer
	for i, m := range ms {
		peers = append(peers, raft.Peer{ID: m.id})
		s.index[m.id] = i
	}
	t.Cleanup(func() {
		close(s.done)
		for _, sn := range s.nodes {
			sn.stop()
		}
	})
	for i, m := range ms {
		sn := &simNode{ticks: make(chan struct{}), turns: make(chan struct{})}
		election := 10 * time.Second // 1,000 ticks: never reached here
		if i == lead {
			election = 300 * time.Millisecond // 30 ticks
		}
		sn.testNode = openTestNodeOpts(t, m.dir, &storage.Options{MinFree: -1}, func(c *Config) {
			c.Transport, c.InitialMembers = simEndpoint{s}, peers
			c.Heartbeat, c.ElectionTimeout = 10*time.Millisecond, election
			c.SyncTimeout = time.Hour // deadlines run on the wall clock: none may fall due
			c.ticks = sn.ticks
			c.sendAtOnce = true
			c.afterTurn = func() {
				select {
				case sn.turns <- struct{}{}:
				case <-s.done:
				}
			}
		})
		s.nodes = append(s.nodes, sn)
		s.waitTurn(i) // the loop's first turn, at start
	}
	return s
}

func (s *simNet) logf(format string, args ...any) {
	s.trace = append(s.trace, fmt.Sprintf(format, args...))
}

// waitTurn waits for node i's loop to end the turn the test caused.
func (s *simNet) waitTurn(i int) {
	s.t.Helper()
	select {
	case <-s.nodes[i].turns:
	case <-time.After(10 * time.Second):
		s.t.Fatalf("node %d took no turn: trace so far:\n%s", i, strings.Join(s.trace, "\n"))
	}
}

func (s *simNet) tick(i int) {
	s.logf("tick %d", i)
	s.nodes[i].ticks <- struct{}{}
	s.waitTurn(i)
}

// deliver takes the k-th queued message and delivers it, or loses it.
func (s *simNet) deliver(k int, lose bool) {
	m := s.queue[k]
	s.queue = slices.Delete(s.queue, k, k+1)
	to, ok := s.index[m.To]
	what := fmt.Sprintf("%v %d→%d term %d index %d commit %d entries %d reject %v", m.Type, s.index[m.From], to, m.Term, m.Index, m.Commit, len(m.Entries), m.Reject)
	if lose || !ok {
		s.logf("lose %s", what)
		return
	}
	s.logf("deliver %s", what)
	s.nodes[to].Step(m)
	s.waitTurn(to)
}

// propose hands node i a sync record; acked is called with its outcome,
// on i's loop, within a later turn.
func (s *simNet) propose(i int, topic string, acked func(index uint64, err error)) {
	s.logf("propose %s at %d", topic, i)
	tn := s.nodes[i]
	tn.Propose(tn.record(s.t, topic), Sync, func(index uint64, err error) {
		s.logf("outcome %s: index %d, %v", topic, index, err)
		acked(index, err)
	})
	s.waitTurn(i)
}

// replayScenario runs a 3-voter group on a lossy, reordering network for
// seed and returns the trace of every step and the topics acked.
func replayScenario(t *testing.T, seed int64) (trace []string, acked []string) {
	rng := rand.New(rand.NewSource(seed))
	lead := rng.Intn(3)
	s := newSimNet(t, rng, 3, lead)
	// Tick the candidate until it campaigns: how many ticks that takes is
	// raft's random draw, and leaves no trace in its state (a campaign
	// resets the count), so these ticks are not in the trace.
	for i := 0; len(s.queue) == 0; i++ {
		if i == 100 {
			t.Fatal("the candidate never campaigned")
		}
		s.nodes[lead].ticks <- struct{}{}
		s.waitTurn(lead)
	}
	s.logf("%d campaigns", lead)
	// The election on a network that loses nothing: a lost vote would
	// leave the next campaign to raft's random timeout too.
	for len(s.queue) > 0 {
		s.deliver(0, false)
	}
	st, err := s.nodes[lead].Status(context.Background())
	s.waitTurn(lead)
	if err != nil || st.Role != "master" {
		t.Fatalf("after the election member %d is %q (%v), want the master", lead, st.Role, err)
	}
	pending, next := false, 0
	for step := 0; step < 2000 && len(acked) < 10; step++ {
		switch {
		case !pending && rng.Intn(4) == 0:
			topic := fmt.Sprintf("r/%d", next)
			next++
			pending = true
			s.propose(lead, topic, func(_ uint64, err error) {
				pending = false
				if err == nil {
					acked = append(acked, topic)
				}
			})
		case len(s.queue) > 0 && rng.Intn(10) < 8:
			s.deliver(rng.Intn(len(s.queue)), rng.Float64() < 0.15)
		default:
			s.tick(rng.Intn(3))
		}
	}
	// Heal: deliver everything in order, with heartbeats, until nothing
	// is left to say; every member then holds every acked record.
	for range 10 {
		for len(s.queue) > 0 {
			s.deliver(0, false)
		}
		s.tick(lead)
	}
	for i, sn := range s.nodes {
		waitFor(t, fmt.Sprintf("member %d to apply the acked records", i), func() bool {
			sn.app.mu.Lock()
			defer sn.app.mu.Unlock()
			got := map[string]bool{}
			for _, r := range sn.app.recs {
				got[r.Topic] = true
			}
			for _, a := range acked {
				if !got[a] {
					return false
				}
			}
			return true
		})
	}
	return s.trace, acked
}

// TestSeededFaultyNetworkReplaysExactly: with logical ticks and the test
// choosing every delivery, loss and reordering from one seed, a run of the
// group replays step for step, so a seed that fails can be debugged; and
// every record acked as sync on that network reaches every member.
func TestSeededFaultyNetworkReplaysExactly(t *testing.T) {
	seed := time.Now().UnixNano()
	if v := os.Getenv("TANDEM_SEED"); v != "" {
		seed, _ = strconv.ParseInt(v, 10, 64)
	}
	t.Logf("seed %d (replay with TANDEM_SEED=%d)", seed, seed)
	first, acked := replayScenario(t, seed)
	if len(acked) < 10 {
		t.Fatalf("only %d records acked in the run: %v", len(acked), acked)
	}
	again, _ := replayScenario(t, seed)
	for i := range max(len(first), len(again)) {
		var a, b string
		if i < len(first) {
			a = first[i]
		}
		if i < len(again) {
			b = again[i]
		}
		if a != b {
			t.Fatalf("the second run of seed %d differs at step %d of %d:\n first: %s\nsecond: %s", seed, i, len(first), a, b)
		}
	}
	t.Logf("%d steps replayed exactly, %d records acked", len(first), len(acked))
}
