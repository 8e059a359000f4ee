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
