package replication

import (
	"errors"
	"time"

	"go.etcd.io/raft/v3"
	pb "go.etcd.io/raft/v3/raftpb"
)

// A member whose broker state is known incomplete (storage's
// InstallInterrupted: a snapshot merged into it in place, whose install a
// crash, a cut pull or a damaged body interrupted) takes nothing on top of
// it until a whole snapshot is installed, whatever the master's log holds.
//
// Raft alone would not send one: a master sends a snapshot only to a
// member whose next index is below its own first index, and a master
// whose log still reaches the member's last index (a new leader of three
// gateways, a master whose retention kept more) sends the entries, which
// would be applied onto a state part old, part new. So, while the state is
// marked:
//
//   - The member steps no MsgApp: it answers each with a refusal tagged
//     needSnapshotTag in Context, which a master of this version reads
//     (and clears, before raft sees a plain refusal) as "send me your
//     snapshot": it sends raft's MsgSnap of its current build at once, at
//     most once per election timeout per member, through the same path as
//     raft's own (a ref to pull past the inline limit); the member asks
//     no more while it pulls one. Raft on the member installs it as any
//     snapshot (its index is past the member's commit index: the master's
//     applied index, once it applied an entry of its own term); its answer
//     (the snapshot's index) moves the master's progress for the member
//     there, and entries follow from it.
//   - Its raft log stays as it is: the entries it holds, acked or not,
//     keep counting for elections and commits as before, and the install
//     moves those past the commit index that it wrote as the master to the
//     requeue bucket (storage.ApplySnapshot), as for any snapshot.
//   - Entries committed meanwhile (its log held them, a heartbeat moved
//     its commit index) are not applied: the snapshot's state includes
//     them. The applied index stays where it was.
//   - It does not stand for election (its MsgPreVote and MsgVote are
//     dropped on the way out, as for a member that cannot write): a master
//     applies and serves its own state. It still grants votes: its log is
//     whole. A forced promotion refuses it (ErrStateIncomplete).
//
// The daemon, meanwhile, sends its devices to the other members, or
// refuses them when it can name none (the broker state it would serve them
// is incomplete), and status says why. A member no master will ever send
// a snapshot (a lone gateway) stays so until its operator accepts the
// state as it is (tandem repair --accept-incomplete, which clears the mark
// offline: storage.RepairOptions.AcceptIncomplete).
//
// A master of an older version reads the refusal as a plain one and keeps
// sending entries, which the member keeps refusing: it waits for that
// master's own snapshot (its log starting past the member's), as before.

// needSnapshotTag, in a MsgAppResp's Context, asks the master for its
// snapshot: the sender's broker state is incomplete.
const needSnapshotTag = "tandem/need-snapshot"

// ErrStateIncomplete refuses what needs this member's broker state whole
// while a snapshot merged into it in part waits to be installed again.
var ErrStateIncomplete = errors.New("replication: this member's broker state is incomplete (a snapshot's install was interrupted) until the master sends its snapshot again")

// StateIncomplete reports whether this member's broker state waits for a
// whole snapshot (see the top of incomplete.go).
func (n *Node) StateIncomplete() bool { return n.db.InstallInterrupted() }

// refuseForSnapshot answers a MsgApp to a member whose state is
// incomplete, instead of stepping it; false when the state is whole (step
// m). Raft goroutine only.
func (n *Node) refuseForSnapshot(m pb.Message) bool {
	if m.Type != pb.MsgApp || !n.db.InstallInterrupted() {
		return false
	}
	if !n.incomplete.logged {
		n.incomplete.logged = true
		n.log.Warn("the broker state is incomplete (a snapshot's install was interrupted): refusing the master's entries and asking for its snapshot",
			"master", IDString(m.From), "index", m.Index)
	}
	if m.Term < n.rn.BasicStatus().Term {
		return true // a deposed master's: raft would not take it either
	}
	var ask []byte
	if n.pull.pulling.Load() < 0 {
		// Not while a snapshot is being pulled: asked again, a master
		// whose build is older than a minute builds a new one, which
		// replaces the file pulled and starts the pull over.
		ask = []byte(needSnapshotTag)
	}
	n.cfg.Transport.Send([]pb.Message{{Type: pb.MsgAppResp, To: m.From, From: n.id, Term: m.Term,
		Index: m.Index, Reject: true, Context: ask}})
	return true
}

// noteSnapshotAsked reads and clears the tag of a refusal asking for a
// snapshot, before raft steps it, and sends the snapshot if this node
// leads. Raft goroutine only.
func (n *Node) noteSnapshotAsked(m *pb.Message) {
	if m.Type != pb.MsgAppResp || string(m.Context) != needSnapshotTag {
		return
	}
	m.Context = nil
	m.RejectHint, m.LogTerm = 0, 0
	if !n.leader {
		return
	}
	now := time.Now()
	if last, ok := n.incomplete.sent[m.From]; ok && now.Sub(last) < n.cfg.ElectionTimeout {
		return
	}
	snap, err := n.db.Snapshot()
	switch {
	case errors.Is(err, raft.ErrSnapshotTemporarilyUnavailable):
		return // being built: the member asks again with the next refusal
	case err != nil:
		n.log.Warn("a member with an incomplete broker state asked for a snapshot, and none could be made", "peer", IDString(m.From), "error", err)
		return
	}
	if n.incomplete.sent == nil {
		n.incomplete.sent = map[uint64]time.Time{}
	}
	n.incomplete.sent[m.From] = now
	n.log.Warn("a member's broker state is incomplete (its install of a snapshot was interrupted): sending it a snapshot, though the log holds what it lacks",
		"peer", IDString(m.From), "snapshot_index", snap.Metadata.Index)
	n.cfg.Transport.Send([]pb.Message{{Type: pb.MsgSnap, To: m.From, From: n.id, Term: n.rn.BasicStatus().Term, Snapshot: &snap}})
}

// incompleteState is the raft goroutine's part of the above.
type incompleteState struct {
	logged bool                 // the member side said once that it refuses entries
	sent   map[uint64]time.Time // the master side: when each member was last sent a snapshot
}

// skipIncomplete passes over a batch of committed entries without applying
// them, the broker state being incomplete: the snapshot the member waits
// for is at the master's applied index, past its commit index, so it
// includes them. Apply goroutine only.
func (n *Node) skipIncomplete(ents []pb.Entry) {
	if n.skippedIncomplete.Add(uint64(len(ents))) == uint64(len(ents)) {
		n.log.Warn("the broker state is incomplete (a snapshot's install was interrupted): committed entries are not applied to it until the master's snapshot is installed",
			"first", ents[0].Index, "last", ents[len(ents)-1].Index)
	}
}
