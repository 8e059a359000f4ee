package replication

import (
	"encoding/json"
	"errors"
	"fmt"

	pb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/storage"
)

// ErrNotPromotable refuses a forced promotion of a node that is not the
// learner of a 2-gateway cluster.
var ErrNotPromotable = errors.New("replication: only the slave of a 2-gateway cluster can be promoted")

// ForcePromote makes the learner self the sole voter of its cluster, the
// way etcd's force-new-cluster does, on a stopped node's data file: it
// appends two membership entries to its own log — add self as a voter,
// then remove the old master (in that order: removing first would leave no
// voter) — and marks them committed. Started again, the node applies them,
// finds itself the only voter and elects itself at a term above any it
// has seen. It returns the fork index: the last index of the log before
// the promotion, after which the old master's log and this one differ.
//
// The old master still believes itself the sole voter of the old
// configuration; the cluster generation the caller bumps is what tells it
// otherwise (DESIGN.md, "Forced promotion forks the cluster").
//
// A node whose broker state is incomplete (a snapshot's install was
// interrupted: storage's InstallInterrupted) is refused with
// ErrStateIncomplete: only the old master has that state whole.
func ForcePromote(db *storage.DB, self Member, old uint64) (uint64, error) {
	if db.InstallInterrupted() {
		// The master is the only one to have the state whole: promoted,
		// this node would serve and build on a part of it.
		return 0, ErrStateIncomplete
	}
	_, cs, _ := db.InitialState()
	isLearner := false
	for _, id := range cs.Learners {
		isLearner = isLearner || id == self.ID
	}
	if !isLearner || len(cs.Voters) != 1 || cs.Voters[0] != old {
		return 0, fmt.Errorf("%w (voters %v, learners %v)", ErrNotPromotable, cs.Voters, cs.Learners)
	}
	last, err := db.LastIndex()
	if err != nil {
		return 0, err
	}
	hs := db.HardState()
	term := hs.Term
	if lt, err := db.Term(last); err == nil && lt > term {
		term = lt
	}
	// A term of its own, above the old master's: (index, term) must name
	// one entry only, and the old master's appends at its old term are
	// refused from here on.
	term++
	hs.Vote = 0
	self.Voter = true
	ctx, err := json.Marshal(self)
	if err != nil {
		return 0, err
	}
	add, err := (&pb.ConfChange{Type: pb.ConfChangeAddNode, NodeID: self.ID, Context: ctx}).Marshal()
	if err != nil {
		return 0, err
	}
	rm, err := (&pb.ConfChange{Type: pb.ConfChangeRemoveNode, NodeID: old}).Marshal()
	if err != nil {
		return 0, err
	}
	ents := []pb.Entry{
		{Type: pb.EntryConfChange, Term: term, Index: last + 1, Data: add},
		{Type: pb.EntryConfChange, Term: term, Index: last + 2, Data: rm},
	}
	hs.Term, hs.Commit = term, last+2
	if err := db.Save(hs, ents); err != nil {
		return 0, fmt.Errorf("replication: promote: %w", err)
	}
	return last, nil
}

// Fence makes this node take no more proposals: each fails at once with
// ErrNotLeader, forwarded ones included. A master calls it when it learns
// that another gateway was promoted over it (a higher cluster generation)
// but cannot rejoin yet: acking on would grow the tail only one disk holds
// while devices stay split between two masters. Raft itself runs on, so
// what is already in flight resolves; a new Node (the rejoin restarts it)
// is not fenced.
func (n *Node) Fence() bool { return !n.fenced.Swap(true) }

// Fenced reports whether Fence was called.
func (n *Node) Fenced() bool { return n.fenced.Load() }
