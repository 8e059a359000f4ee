package replication

import (
	"context"
	"time"

	"go.etcd.io/raft/v3"
	"go.etcd.io/raft/v3/tracker"
)

// Status is a point-in-time view of the node, for the status endpoint.
type Status struct {
	ID      uint64
	Role    string // "master", "slave" or "candidate"
	Term    uint64
	Leader  uint64 // 0 when none is known
	Commit  uint64
	Applied uint64
	First   uint64
	Last    uint64
	Members []MemberProgress // the master's view of the others; empty elsewhere
	// LeaderChanges counts the times this node saw the leader change
	// (to another node or to none) since it started.
	LeaderChanges uint64
	// RetentionFloor is the highest index storage may drop (what every
	// other member holds, on the master); MaxUint64 when no member holds
	// it back.
	RetentionFloor uint64
	// CatchingUp: this member installed a snapshot and is pulling the
	// records before it from the master (backfill.go); CatchUp is how far
	// it got. Also while its broker state holds a snapshot merged in part
	// (storage's InstallInterrupted), until one is installed.
	CatchingUp bool
	CatchUp    CatchUp
}

// MemberProgress is what the master knows of one other member.
type MemberProgress struct {
	ID      uint64
	Learner bool
	Match   uint64
}

// RoleName maps a raft state to the role names of the status contract.
func RoleName(s raft.StateType) string {
	switch s {
	case raft.StateLeader:
		return "master"
	case raft.StateFollower:
		return "slave"
	default:
		return "candidate"
	}
}

// status is computed on the raft goroutine.
func (n *Node) status() Status {
	bs := n.rn.BasicStatus()
	st := n.db.Stats()
	s := Status{ID: n.id, Role: RoleName(bs.RaftState), Term: bs.Term, Leader: bs.Lead, Commit: bs.Commit, Applied: st.Applied, First: st.FirstIndex, Last: st.LastIndex, LeaderChanges: n.leaderChanges.Load(), RetentionFloor: n.floor.Load()}
	s.CatchUp, s.CatchingUp = n.catchUpProgress()
	if s.Role == "master" && n.fenced.Load() {
		// Fenced: raft still leads the old configuration, but this node
		// takes no publishes; it waits to rejoin as the slave.
		s.Role = "candidate"
	}
	if bs.RaftState == raft.StateLeader {
		n.rn.WithProgress(func(id uint64, typ raft.ProgressType, pr tracker.Progress) {
			if id != n.id {
				s.Members = append(s.Members, MemberProgress{ID: id, Learner: pr.IsLearner, Match: pr.Match})
			}
		})
	}
	return s
}

// Status asks the raft goroutine for the node's status.
func (n *Node) Status(ctx context.Context) (Status, error) {
	ch := make(chan Status, 1)
	select {
	case n.statusc <- ch:
	case <-n.stopc:
		return Status{}, ErrStopped
	case <-n.failc:
		return Status{}, n.Err()
	case <-ctx.Done():
		return Status{}, ctx.Err()
	}
	select {
	case s := <-ch:
		return s, nil
	case <-ctx.Done():
		return Status{}, ctx.Err()
	}
}

// Leader returns the leader raft last reported, 0 when none is known.
// Unlike Status it does not need the raft goroutine, which may be busy.
func (n *Node) Leader() uint64 { return n.lead.Load() }

// Term returns the raft term this node last saved, without asking the
// raft goroutine: cheap enough for every mDNS answer.
func (n *Node) Term() uint64 { return n.term.Load() }

// WaitLeader waits until the group has a master (this node or another).
func (n *Node) WaitLeader(ctx context.Context) error {
	t := time.NewTicker(5 * time.Millisecond)
	defer t.Stop()
	for n.Leader() == 0 {
		select {
		case <-t.C:
		case <-n.failc:
			return n.Err()
		case <-n.stopc:
			return ErrStopped
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}
