package replication

import (
	"cmp"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"

	pb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/storage"
)

// Member is what the cluster knows of one gateway. It travels in the
// ConfChange.Context of the entry that adds or changes it, so every node
// learns the membership from the log (raft's ConfState holds only ids), and
// it is kept in the data file's members bucket.
type Member struct {
	ID          uint64   `json:"-"`
	Name        string   `json:"name"`
	Addrs       []string `json:"addrs"`
	Fingerprint [32]byte `json:"-"`
	// Voter is false for a learner: a 2-gateway slave, or a third member
	// on its way to becoming a voter.
	Voter bool `json:"voter"`
}

// memberJSON is Member on the wire: ids and fingerprints as hex.
type memberJSON struct {
	ID          string   `json:"id"`
	Name        string   `json:"name"`
	Addrs       []string `json:"addrs"`
	Fingerprint string   `json:"fingerprint"`
	Voter       bool     `json:"voter"`
}

// MarshalJSON encodes m with its id and fingerprint in hex.
func (m Member) MarshalJSON() ([]byte, error) {
	return json.Marshal(memberJSON{IDString(m.ID), m.Name, m.Addrs, hex.EncodeToString(m.Fingerprint[:]), m.Voter})
}

// UnmarshalJSON decodes what MarshalJSON wrote.
func (m *Member) UnmarshalJSON(b []byte) error {
	var j memberJSON
	if err := json.Unmarshal(b, &j); err != nil {
		return err
	}
	var id uint64
	if _, err := fmt.Sscanf(j.ID, "%016x", &id); err != nil {
		return fmt.Errorf("member id %q: %w", j.ID, err)
	}
	fp, err := hex.DecodeString(j.Fingerprint)
	if err != nil || len(fp) != 32 {
		return fmt.Errorf("member %s: bad fingerprint %q", j.ID, j.Fingerprint)
	}
	*m = Member{ID: id, Name: j.Name, Addrs: j.Addrs, Voter: j.Voter}
	copy(m.Fingerprint[:], fp)
	return nil
}

// Errors of membership changes.
var (
	// ErrClusterFull refuses a fourth gateway.
	ErrClusterFull = errors.New("replication: a cluster has at most 3 gateways")
	// ErrLastVoter refuses removing the only voter.
	ErrLastVoter = errors.New("replication: cannot remove the last voter")
	// ErrUnknownMember is returned for an id not in the cluster.
	ErrUnknownMember = errors.New("replication: no such member")
)

// MaxMembers is the largest cluster tandem runs (DESIGN.md).
const MaxMembers = 3

// membersBucket holds Member JSON by 16-hex-digit id.
var membersBucket = storage.BucketMembers

// Members returns the cluster's members, by id.
func (n *Node) Members() []Member {
	n.membersMu.Lock()
	defer n.membersMu.Unlock()
	out := make([]Member, 0, len(n.members))
	for _, m := range n.members {
		out = append(out, m)
	}
	slices.SortFunc(out, func(a, b Member) int { return cmp.Compare(a.ID, b.ID) })
	return out
}

// loadMembers reads the members bucket at start.
func (n *Node) loadMembers() error {
	n.members = map[uint64]Member{}
	return n.db.ForEach(membersBucket, "", func(_, v []byte) error {
		var m Member
		if err := json.Unmarshal(v, &m); err != nil {
			return fmt.Errorf("members bucket: %v: %w", err, storage.ErrCorrupt)
		}
		n.members[m.ID] = m
		return nil
	})
}

// recordMember keeps m's details after its conf change applied, and tells
// OnMembership.
func (n *Node) recordMember(cc pb.ConfChangeSingle, ctx []byte) {
	key := IDString(cc.NodeID)
	n.membersMu.Lock()
	if cc.Type == pb.ConfChangeRemoveNode {
		delete(n.members, cc.NodeID)
		n.membersMu.Unlock()
		n.db.StageDelete(membersBucket, key)
	} else {
		m := n.members[cc.NodeID]
		if len(ctx) > 0 {
			var got Member
			if err := json.Unmarshal(ctx, &got); err != nil {
				n.log.Warn("membership entry without readable details", "peer", key, "error", err)
			} else {
				m = got
			}
		}
		m.ID = cc.NodeID
		m.Voter = cc.Type == pb.ConfChangeAddNode
		n.members[m.ID] = m
		n.membersMu.Unlock()
		b, _ := json.Marshal(m)
		n.db.Stage(membersBucket, key, b)
	}
	if n.cfg.OnMembership != nil {
		n.cfg.OnMembership(n.Members())
	}
}

// confWaiter is a conf change proposal waiting to be applied.
type confWaiter struct {
	id   uint64 // the ConfChangeV2's context id
	done chan error
}

// ChangeMember proposes one membership change and waits until it is
// applied: add m as a learner or voter, promote a learner (AddNode on a
// learner's id), demote a voter (AddLearnerNode), or remove (m.ID only).
// Only the master can change the membership.
func (n *Node) ChangeMember(ctx context.Context, typ pb.ConfChangeType, m Member) error {
	var mctx []byte
	if typ != pb.ConfChangeRemoveNode {
		m.Voter = typ == pb.ConfChangeAddNode
		var err error
		if mctx, err = json.Marshal(m); err != nil {
			return err
		}
	}
	w := &confWaiter{done: make(chan error, 1)}
	req := confReq{cc: pb.ConfChange{Type: typ, NodeID: m.ID, Context: mctx}, w: w}
	select {
	case n.confc <- req:
	case <-ctx.Done():
		return ctx.Err()
	case <-n.stopc:
		return ErrStopped
	}
	select {
	case err := <-w.done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	case <-n.stopc:
		return ErrStopped
	}
}

// confReq carries a conf change to the raft goroutine.
type confReq struct {
	cc pb.ConfChange
	w  *confWaiter
}

// proposeConfChange checks a requested change against the current
// configuration and proposes it; runs on the raft goroutine.
func (n *Node) proposeConfChange(req confReq) {
	if !n.leader {
		req.w.done <- ErrNotLeader
		return
	}
	cfg := n.rn.Status().Config
	voters, learners := cfg.Voters.IDs(), cfg.Learners
	_, isVoter := voters[req.cc.NodeID]
	_, isLearner := learners[req.cc.NodeID]
	member := isVoter || isLearner
	switch req.cc.Type {
	case pb.ConfChangeAddNode, pb.ConfChangeAddLearnerNode:
		if !member && len(voters)+len(learners) >= MaxMembers {
			req.w.done <- ErrClusterFull
			return
		}
	case pb.ConfChangeRemoveNode:
		if !member {
			req.w.done <- ErrUnknownMember
			return
		}
		if isVoter && len(voters) == 1 {
			req.w.done <- ErrLastVoter
			return
		}
	}
	n.confSeq++
	req.w.id = n.confSeq
	req.cc.ID = n.confSeq
	if err := n.rn.ProposeConfChange(req.cc); err != nil {
		req.w.done <- fmt.Errorf("replication: %w", err)
		return
	}
	n.confWait = append(n.confWait, req.w)
}

// confApplied wakes the waiter of the conf change with id, if any.
func (n *Node) confApplied(id uint64, err error) {
	for i, w := range n.confWait {
		if w.id == id {
			w.done <- err
			n.confWait = slices.Delete(n.confWait, i, i+1)
			return
		}
	}
}
