package replication

import (
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/raft/v3"
	pb "go.etcd.io/raft/v3/raftpb"
	"go.etcd.io/raft/v3/tracker"
)

// Handing the mastership over when this node cannot write.
//
// A master whose data dir's filesystem is below storage.min_free refuses
// every publish (0x97), its own devices' and the ones its slaves forward.
// A voter that can write could take them all, so the master hands the
// mastership over (raft's leadership transfer) to the most up-to-date voter
// that reports free space, and from then on its own devices' publishes go
// there on the forward stream while it keeps serving its subscribers.
//
// Members report their disk on the raft heartbeat: every MsgHeartbeatResp
// carries diskTagOK or diskTagLow in RejectHint, a field raft neither sets
// nor reads for that message type; the receiving Step reads the tag and
// clears it before raft sees the message. A member of an older version
// sends 0 there, which counts as no report: it is never a target.
//
// No ping-pong: a member that is low on space, or whose report is older
// than handoffFresh, is never a target, and a member that cannot write does
// not stand for election: its own MsgPreVote and MsgVote are dropped on the
// way out (it still grants votes to others). A cluster whose every voter is
// low keeps the master it has.
//
// A 2-gateway slave is a learner, which raft cannot hand the leadership to:
// there the master keeps refusing and says so (Handoff), `tandem promote`
// on the slave being the way out.

// Disk tags carried in MsgHeartbeatResp.RejectHint.
const (
	diskTagOK  = 1 // the sender can write its log
	diskTagLow = 2 // the sender cannot: below storage.min_free, or its saves fail
)

// handoff is the node's state for handing the mastership over.
type handoff struct {
	mu      sync.Mutex           // guards reports
	reports map[uint64]diskState // the other members' last disk reports

	stuck   atomic.Pointer[string] // why no hand-over is possible, nil otherwise
	to      atomic.Uint64          // the member last handed the mastership to
	noVotes atomic.Bool            // this node drops its own vote requests (logged once per episode)
	// noVotesIncomplete: the same, for an incomplete broker state.
	noVotesIncomplete atomic.Bool

	lastTry time.Time // raft goroutine only: the last TransferLeader
}

// diskState is one member's last disk report.
type diskState struct {
	low bool
	at  time.Time
}

// handoffFresh is how recent a report must be for its member to be a
// target, in election timeouts: heartbeats come every tick, so a member
// with no report that recent is unreachable or of an older version.
const handoffFresh = 2

// cannotWrite says why this node cannot take records into its log, ""
// when it can.
func (n *Node) cannotWrite() string {
	if e := n.diskErr.Load(); e != nil {
		return (*e).Error()
	}
	if n.db.LowOnSpace() {
		return n.db.RefusingReason()
	}
	return ""
}

// SaveFailing reports whether this node's raft loop is retrying a write
// of its log that fails: it can neither take nor apply records until the
// write succeeds.
func (n *Node) SaveFailing() bool { return n.diskErr.Load() != nil }

// Handoff says what this node did about its disk while it cannot write:
// the member it last handed the mastership to (0 for none), and why it
// cannot hand it over ("" when it could, or need not).
func (n *Node) Handoff() (to uint64, stuck string) {
	if s := n.handoff.stuck.Load(); s != nil {
		stuck = *s
	}
	return n.handoff.to.Load(), stuck
}

// noteDiskTag reads and clears the disk tag of a heartbeat response, before
// raft steps it.
func (n *Node) noteDiskTag(m *pb.Message) {
	if m.Type != pb.MsgHeartbeatResp || m.RejectHint == 0 {
		return
	}
	st := diskState{low: m.RejectHint == diskTagLow, at: time.Now()}
	m.RejectHint = 0
	n.handoff.mu.Lock()
	if n.handoff.reports == nil {
		n.handoff.reports = map[uint64]diskState{}
	}
	n.handoff.reports[m.From] = st
	n.handoff.mu.Unlock()
}

// reportsSpace reports whether member id said recently that it can write.
func (n *Node) reportsSpace(id uint64, now time.Time) bool {
	n.handoff.mu.Lock()
	st, ok := n.handoff.reports[id]
	n.handoff.mu.Unlock()
	return ok && !st.low && now.Sub(st.at) <= handoffFresh*n.cfg.ElectionTimeout
}

// tagTransport is the node's Transport: it tags heartbeat responses with
// this node's disk state and drops this node's vote requests while it
// cannot write.
type tagTransport struct {
	inner Transport
	n     *Node
}

// Send tags and filters msgs in place, then sends them.
func (t tagTransport) Send(msgs []pb.Message) {
	why := t.n.cannotWrite()
	tag := uint64(diskTagOK)
	if why != "" {
		tag = diskTagLow
	} else if t.n.handoff.noVotes.Swap(false) {
		t.n.log.Info("the log is writable again: this gateway stands for election again")
	}
	incomplete := t.n.db.InstallInterrupted()
	if !incomplete && t.n.handoff.noVotesIncomplete.Swap(false) {
		t.n.log.Info("the broker state is whole again: this gateway stands for election again")
	}
	out := msgs[:0]
	for _, m := range msgs {
		switch {
		case m.Type == pb.MsgHeartbeatResp:
			m.RejectHint = tag
		case why != "" && (m.Type == pb.MsgPreVote || m.Type == pb.MsgVote):
			if !t.n.handoff.noVotes.Swap(true) {
				t.n.log.Warn("this gateway cannot write its log: it does not stand for election until it can", "reason", why, "term", m.Term)
			}
			continue
		case incomplete && (m.Type == pb.MsgPreVote || m.Type == pb.MsgVote):
			// A master applies and serves its own state (incomplete.go).
			if !t.n.handoff.noVotesIncomplete.Swap(true) {
				t.n.log.Warn("the broker state is incomplete until the master's snapshot is installed: this gateway does not stand for election meanwhile", "term", m.Term)
			}
			continue
		}
		out = append(out, m)
	}
	if len(out) > 0 {
		t.inner.Send(out)
	}
}

// maybeHandOff runs on every tick of the raft goroutine: a master that
// cannot write hands the mastership to the best voter that can, at most
// once per election timeout (raft gives up a transfer after one).
func (n *Node) maybeHandOff(now time.Time) {
	why := n.cannotWrite()
	if why == "" || !n.leader || n.fenced.Load() {
		n.handoff.stuck.Store(nil)
		if why == "" {
			n.handoff.to.Store(0)
		}
		return
	}
	if n.rn.BasicStatus().LeadTransferee != 0 || now.Sub(n.handoff.lastTry) < n.cfg.ElectionTimeout {
		return
	}
	to, match, stuck := n.handoffTarget(now)
	if to == 0 && stuck == "" {
		return
	}
	if to == 0 {
		if old := n.handoff.stuck.Swap(&stuck); old == nil || *old != stuck {
			n.log.Warn("this master cannot write and keeps the mastership: publishes stay refused until space returns", "reason", why, "because", stuck)
		}
		return
	}
	n.handoff.stuck.Store(nil)
	n.handoff.lastTry = now
	n.handoff.to.Store(to)
	n.log.Warn("this master cannot write: handing the mastership to a member that can; this gateway's devices publish through it and its subscribers stay served",
		"reason", why, "peer", IDString(to), "match_index", match, "term", n.rn.BasicStatus().Term)
	n.rn.TransferLeader(to)
}

// handoffTarget picks the most up-to-date voter that reports free space;
// with none, stuck says why.
func (n *Node) handoffTarget(now time.Time) (to, match uint64, stuck string) {
	voters, learners := 0, 0
	n.rn.WithProgress(func(id uint64, _ raft.ProgressType, pr tracker.Progress) {
		if id == n.id {
			return
		}
		if pr.IsLearner {
			learners++
			return
		}
		voters++
		if n.reportsSpace(id, now) && (to == 0 || pr.Match > match) {
			to, match = id, pr.Match
		}
	})
	switch {
	case to != 0:
		return to, match, ""
	case voters == 0 && learners > 0:
		return 0, 0, "the slave of a 2-gateway cluster is a learner and cannot take the mastership (`tandem promote` on it makes it the master)"
	case voters == 0:
		return 0, 0, "" // a lone gateway: its refusals say all there is
	}
	return 0, 0, "no other voter reports free space"
}
