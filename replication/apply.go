package replication

import (
	"fmt"

	pb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/storage"
)

// applyConfChange applies a membership entry on the raft goroutine, as raft
// requires, records the new conf state and the members' details, and wakes
// the proposer waiting for it.
func (n *Node) applyConfChange(e *pb.Entry) {
	var cc pb.ConfChangeI
	var ctx []byte
	var id uint64
	switch e.Type {
	case pb.EntryConfChange:
		var c pb.ConfChange
		if err := c.Unmarshal(e.Data); err != nil {
			n.fail(fmt.Errorf("replication: conf change at %d: %v: %w", e.Index, err, storage.ErrCorrupt))
			return
		}
		cc, ctx, id = c, c.Context, c.ID
	case pb.EntryConfChangeV2:
		var c pb.ConfChangeV2
		if err := c.Unmarshal(e.Data); err != nil {
			n.fail(fmt.Errorf("replication: conf change at %d: %v: %w", e.Index, err, storage.ErrCorrupt))
			return
		}
		cc, ctx = c, c.Context
	default:
		return
	}
	cs := n.rn.ApplyConfChange(cc)
	n.db.SetConfState(*cs)
	for _, ch := range cc.AsV2().Changes {
		n.recordMember(ch, ctx)
		n.log.Info("membership changed", "change", ch.Type.String(), "peer", IDString(ch.NodeID), "index", e.Index)
	}
	if id != 0 {
		n.confApplied(id, nil)
	}
	n.campaignIfLoneVoter(cs, e.Index)
}

// campaignIfLoneVoter has this node stand for election once the Ready is
// done (raft refuses while a membership entry is unapplied) when the
// membership entry at index, the last of its log, left it the only voter:
// a promoted slave (ForcePromote) then leads as soon as it applied its
// promotion, not an election timeout later, as a lone voter does at start
// (NewNode). An entry with more of the log after it is history being
// replayed, which says nothing of the membership now.
func (n *Node) campaignIfLoneVoter(cs *pb.ConfState, index uint64) {
	if n.leader || len(cs.Voters) != 1 || cs.Voters[0] != n.id || n.catchingUp() {
		return
	}
	if last, err := n.db.LastIndex(); err != nil || last != index {
		return
	}
	n.campaignNext = true
}

// campaignIfDue stands for election if campaignIfLoneVoter said to, after
// the Ready that applied the membership entry was advanced.
func (n *Node) campaignIfDue() {
	if !n.campaignNext {
		return
	}
	n.campaignNext = false
	if err := n.rn.Campaign(); err != nil {
		n.log.Warn("standing for election as the only voter failed; raft's election timeout will", "error", err)
	}
}

// applyLoop delivers committed records in order and records the applied
// index after them, so a restart resumes where delivery stopped.
func (n *Node) applyLoop() {
	for ents := range n.applyc {
		if n.Err() != nil {
			continue
		}
		if len(ents) == 1 && ents[0].Type == entrySnapshot {
			n.applySnapshot()
			continue
		}
		if n.db.InstallInterrupted() {
			// The broker state is incomplete: the snapshot that makes it
			// whole includes these entries (incomplete.go).
			n.skipIncomplete(ents)
			continue
		}
		for i := range ents {
			e := &ents[i]
			if e.Type != pb.EntryNormal || len(e.Data) == 0 {
				continue
			}
			if n.applyFeature(e) {
				continue // the cluster's, not the Applier's
			}
			if err := n.cfg.Applier.Apply(e.Index, e.Data); err != nil {
				n.fail(fmt.Errorf("replication: apply %d: %w", e.Index, err))
				break
			}
		}
		if n.Err() == nil {
			n.db.SetApplied(ents[len(ents)-1].Index)
		}
	}
}
