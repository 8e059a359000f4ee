package replication

import (
	"time"

	pb "go.etcd.io/raft/v3/raftpb"
)

// Each time the commit index moves, raft's leader sends every member an
// append with no entries that carries only the new commit index, besides
// the appends that carry the records. Under load that doubles what a
// slave handles per batch: two messages read, two Readies, two answers,
// and the master reads two answers from each slave. So while appends are
// coming, the master holds such an append back: the next append to that
// member carries the same commit index, and the held one is dropped.
// Appends are coming while proposals are queued here (the loop takes them
// within the group commit's wait), and while records flow: the last two
// appends went out within holdWindow of each other and of now (publishers
// on a sync topic or on a slave send their next publishes only once the
// last ones are acked, so nothing is queued when the commit index moves).
// A held append is sent after all once none of that holds or it has
// waited holdWindow, so a member learns a commit index at most holdWindow
// late, and an isolated record's at once. Raft takes a lost message in its
// stride; a deposed master's held ones are dropped.

// holdWindow bounds how long a commit-only append is held, and how close
// appends must follow each other to count as a flow.
const holdWindow = maxBatchWait

// send hands msgs to the transport, holding back or dropping the
// commit-only appends as said above.
func (n *Node) send(msgs []pb.Message) {
	if n.cfg.Transport == nil {
		return
	}
	if n.leader && !n.cfg.sendAtOnce {
		msgs = n.holdCommits(msgs, time.Now())
	}
	if len(msgs) > 0 {
		n.cfg.Transport.Send(msgs)
	}
}

// holdCommits returns msgs minus the commit-only appends it holds now and
// plus, before a message to the same member, one held earlier that the
// message does not make redundant.
func (n *Node) holdCommits(msgs []pb.Message, now time.Time) []pb.Message {
	for _, m := range msgs {
		if m.Type == pb.MsgApp && len(m.Entries) > 0 {
			n.prevAppend, n.lastAppend = n.lastAppend, now
			break
		}
	}
	coming := n.appendsComing(now)
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
				n.heldSince = now
				n.armHeld()
			}
			n.held[m.To] = m
			continue
		}
		out = append(out, m)
	}
	return out
}

// releaseHeld sends the held appends once appends stop coming or they have
// waited holdWindow; the loop calls it at the end of every turn, and its
// timer (heldWake) makes a turn when the window ends.
func (n *Node) releaseHeld(now time.Time) {
	if len(n.held) == 0 {
		return
	}
	if !n.leader {
		clear(n.held) // raft has moved on: they would only be stale
		return
	}
	if now.Sub(n.heldSince) < holdWindow && n.appendsComing(now) {
		return
	}
	msgs := make([]pb.Message, 0, len(n.held))
	for _, m := range n.held {
		msgs = append(msgs, m)
	}
	clear(n.held)
	n.cfg.Transport.Send(msgs)
}

// appendsComing reports whether proposals are queued, which the loop turns
// into appends within the group commit's wait, or records are flowing.
func (n *Node) appendsComing(now time.Time) bool {
	if now.Sub(n.lastAppend) < holdWindow && n.lastAppend.Sub(n.prevAppend) < holdWindow {
		return true
	}
	n.propMu.Lock()
	defer n.propMu.Unlock()
	return len(n.propQ) > 0
}

// armHeld starts the timer that ends a hold.
func (n *Node) armHeld() {
	if n.heldT == nil {
		n.heldT = time.NewTimer(holdWindow)
		return
	}
	n.heldT.Reset(holdWindow)
}

// heldWake is the hold timer's channel (nil before the first hold).
func (n *Node) heldWake() <-chan time.Time {
	if n.heldT == nil {
		return nil
	}
	return n.heldT.C
}

// commitConveyed is the commit index a member takes from an append it
// accepts: raft's follower commits no further than the append's last entry.
func commitConveyed(m pb.Message) uint64 {
	return min(m.Commit, m.Index+uint64(len(m.Entries)))
}
