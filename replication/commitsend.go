package replication

import (
	"time"

	pb "go.etcd.io/raft/v3/raftpb"
)

// Each time the commit index moves, raft's leader sends every member an
// append with no entries that carries only the new commit index, besides
// the appends that carry the records. Under load that doubles what a
// slave handles per batch: two messages read, two Readies, two answers,
// and the master reads two answers from each slave. So while proposals
// are queued here, the master holds such an append back: the next append
// to that member, which those proposals make within the group commit's
// wait, carries the same commit index, and the held one is dropped. It is
// sent after all when no proposal is queued (an idle master tells the
// members at once) or once it has waited maxBatchWait. Raft takes a lost
// message in its stride; what matters is that a member learns the commit
// index no later than that, and a deposed master's held ones are dropped.

// send hands msgs to the transport, holding back or dropping the
// commit-only appends as said above.
func (n *Node) send(msgs []pb.Message) {
	if n.cfg.Transport == nil {
		return
	}
	if n.leader {
		msgs = n.holdCommits(msgs)
	}
	if len(msgs) > 0 {
		n.cfg.Transport.Send(msgs)
	}
}

// holdCommits returns msgs minus the commit-only appends it holds now and
// plus, before a message to the same member, one held earlier that the
// message does not make redundant.
func (n *Node) holdCommits(msgs []pb.Message) []pb.Message {
	coming := n.appendsComing()
	if !coming && len(n.held) == 0 {
		return msgs
	}
	out := make([]pb.Message, 0, len(msgs)+len(n.held))
	for _, m := range msgs {
		if h, ok := n.held[m.To]; ok {
			delete(n.held, m.To)
			if m.Type != pb.MsgApp || commitConveyed(m) < commitConveyed(h) {
				out = append(out, h) // first: the member sees them in order
			}
		}
		if coming && m.Type == pb.MsgApp && len(m.Entries) == 0 {
			if n.held == nil {
				n.held = map[uint64]pb.Message{}
			}
			if len(n.held) == 0 {
				n.heldSince = time.Now()
			}
			n.held[m.To] = m
			continue
		}
		out = append(out, m)
	}
	return out
}

// releaseHeld sends the held appends once no proposal is queued or they
// have waited maxBatchWait; the loop calls it at the end of every turn.
func (n *Node) releaseHeld(now time.Time) {
	if len(n.held) == 0 {
		return
	}
	if !n.leader {
		clear(n.held) // raft has moved on: they would only be stale
		return
	}
	if n.appendsComing() && now.Sub(n.heldSince) < maxBatchWait {
		return
	}
	msgs := make([]pb.Message, 0, len(n.held))
	for _, m := range n.held {
		msgs = append(msgs, m)
	}
	clear(n.held)
	n.cfg.Transport.Send(msgs)
}

// appendsComing reports whether proposals are queued, which the loop
// turns into appends to every member within the group commit's wait.
func (n *Node) appendsComing() bool {
	n.propMu.Lock()
	defer n.propMu.Unlock()
	return len(n.propQ) > 0
}

// commitConveyed is the commit index a member takes from an append it
// accepts: raft's follower commits no further than the append's last entry.
func commitConveyed(m pb.Message) uint64 {
	return min(m.Commit, m.Index+uint64(len(m.Entries)))
}
