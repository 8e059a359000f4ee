package replication

import (
	"errors"
	"fmt"
	"math"
	"time"

	"go.etcd.io/raft/v3"
	pb "go.etcd.io/raft/v3/raftpb"
	"go.etcd.io/raft/v3/tracker"

	"github.com/tandem-edge/tandem/storage"
)

// handleReady processes one Ready; false means the node must stop.
func (n *Node) handleReady() bool {
	rd := n.rn.Ready()
	if rd.SoftState != nil {
		n.setLeader(rd.SoftState.RaftState == raft.StateLeader, rd.SoftState.Lead)
	}

	// A leader may send its appends while it writes the same entries to
	// its own disk (raft's README; etcd does the same): the slaves' fsync
	// then runs beside the master's instead of after it, which is most of
	// a sync ack's latency. Never before a new term or vote is on disk,
	// and never on a follower, whose answers promise what it has saved.
	early := n.leader && n.cfg.Transport != nil && len(rd.Messages) > 0 &&
		(raft.IsEmptyHardState(rd.HardState) || (rd.HardState.Term == n.savedHS.Term && rd.HardState.Vote == n.savedHS.Vote))
	if early {
		n.send(rd.Messages)
	}
	if !raft.IsEmptySnap(rd.Snapshot) && !n.installSnapshot(rd.Snapshot) {
		// The master's log starts past this node's: its snapshot replaces
		// the log and the broker state here, before the entries that
		// follow it in this Ready are saved (snapshot.go).
		return false
	}
	hs := rd.HardState
	if last, _ := n.db.LastIndex(); !raft.IsEmptyHardState(hs) && hs.Term == n.savedHS.Term && hs.Vote == n.savedHS.Vote && hs.Commit <= last {
		// Only the commit index moved, and not past entries already on
		// disk (a follower commits what arrives in the same Ready): no
		// fsync of its own (SetCommit).
		n.db.SetCommit(hs)
		hs = pb.HardState{}
	}
	if len(rd.Entries) > 0 || !raft.IsEmptyHardState(hs) {
		if !n.save(hs, rd.Entries) {
			return false
		}
		if !raft.IsEmptyHardState(hs) {
			n.savedHS = hs
			n.term.Store(hs.Term)
		}
		if n.db.TakeRequeueSignal() {
			n.refuseRequeued()
			select {
			case n.requeueSig <- struct{}{}:
			default:
			}
		}
	}
	if n.leader {
		n.matchSaved(rd.Entries)
		n.flushResolved() // acks first: the rest of the Ready can wait
	} else if n.cfg.Forwarder != nil {
		n.noteLogged(rd.Entries)
	}
	if !early && len(rd.Messages) > 0 {
		n.send(rd.Messages)
	}
	if len(rd.CommittedEntries) > 0 {
		for i := range rd.CommittedEntries {
			if e := &rd.CommittedEntries[i]; e.Type != pb.EntryNormal {
				n.applyConfChange(e)
			} else if len(n.settle.waiting) > 0 {
				n.settleCommitted(e)
			}
		}
		select {
		case n.applyc <- rd.CommittedEntries:
		case <-n.stopc:
			return false
		case <-n.failc:
			return false
		}
	}
	n.rn.Advance(rd)
	n.campaignIfDue()
	n.checkSync()
	return true
}

// save persists one Ready, retrying a failing disk until it works or the
// node stops: raft has handed over this Ready and cannot take it back.
//
// Refused is final: while it fails, the proposals raft has not taken yet
// fail with ErrStorage (0x97 to devices), and new ones fail at once,
// instead of hanging past sync_timeout; they can never be in the log. The
// ones raft has taken are not answered: their entries may be logged yet,
// by this save when the disk recovers, or by the other members, to whom a
// master sends its appends while it saves them (handleReady), and who
// commit them without this node, under a new master if this one stays
// stuck. Their outcome is what becomes of the entry, as for any proposal:
// acked once saved (and replicated, for sync), or refused by the rules of
// sync_timeout and of a lost mastership once the loop goes on. Devices
// wait for their acks meanwhile; the daemon sends them to another member
// where there is one (they publish again there).
func (n *Node) save(hs pb.HardState, ents []pb.Entry) bool {
	backoff := 10 * time.Millisecond
	for {
		var err error
		if f := n.saveFault.Load(); f != nil {
			err = *f
		} else {
			err = n.db.Save(hs, ents)
		}
		if err == nil {
			if n.diskErr.Load() != nil {
				n.log.Info("the log is writable again")
				n.diskErr.Store(nil)
			}
			return true
		}
		if errors.Is(err, storage.ErrClosed) {
			n.fail(fmt.Errorf("%w: %v", ErrStorage, err))
			return false
		}
		if n.diskErr.Load() == nil {
			n.log.Error("saving the log failed; refusing publishes and retrying", "error", err, "index", firstIndex(ents))
		}
		serr := fmt.Errorf("%w: %v", ErrStorage, err)
		n.diskErr.Store(&serr)
		n.failQueued(serr)
		n.flushResolved()
		if !n.waitSaveRetry(backoff) {
			return false
		}
		if backoff < time.Second {
			backoff *= 2
		}
	}
}

// waitSaveRetry waits d before save tries again, false when the node
// stops. The raft goroutine is held by the failing save meanwhile, so it
// answers status requests from here: the operator's status (and the
// daemon's /v1/status, /healthz) must say the disk is failing while it
// is, not time out. status only reads, and raft's state does not move
// until this Ready is saved.
func (n *Node) waitSaveRetry(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			return true
		case ch := <-n.statusc:
			ch <- n.status()
		case <-n.stopc:
			return false
		}
	}
}

// failQueued fails the proposals raft has not taken: they never will be
// logged.
func (n *Node) failQueued(err error) {
	n.propMu.Lock()
	q := n.propQ
	n.propQ = nil
	n.propMu.Unlock()
	for _, p := range q {
		n.resolve(p, err)
	}
}

// failWaiting fails every proposal not yet acked, queued ones included:
// the loop is exiting (resolveAll).
func (n *Node) failWaiting(err error) {
	n.failQueued(err)
	for _, p := range n.byDue {
		n.resolve(p, err)
	}
	for _, p := range n.settle.waiting {
		n.resolve(p, err)
	}
	for _, p := range n.live { // an async one past its deadline is only here
		if p.pending {
			n.resolve(p, err)
		}
	}
	n.byDue, n.syncWait, n.settle.waiting = nil, nil, nil
	clear(n.live)
}

func firstIndex(ents []pb.Entry) uint64 {
	if len(ents) == 0 {
		return 0
	}
	return ents[0].Index
}

func (n *Node) setLeader(leader bool, lead uint64) {
	if leader != n.leader {
		clear(n.silentSince) // a new term as master counts silence afresh
		term := n.rn.BasicStatus().Term
		if leader {
			// Before this Ready saves the term's first entry: what this
			// node writes as master stays its own through a snapshot
			// install (storage.DB.ApplySnapshot).
			n.db.NoteLed(term)
		}
		n.log.Info("role changed", "master", leader, "leader", IDString(lead), "term", term)
		clear(n.held) // another term's commit index
		n.settleLead(leader)
	}
	n.leader = leader
	if n.lead.Swap(lead) != lead {
		n.leaderChanges.Add(1)
	}
	if !leader {
		for _, w := range n.confWait {
			w.done <- ErrNotLeader
		}
		n.confWait = nil
		// Proposals not yet in a saved Ready will never be: raft dropped
		// them with the leadership.
		for _, p := range n.live {
			if p.pending {
				n.unpend(p)
				n.resolve(p, ErrNotLeader)
			}
		}
	}
}

// updateFloor tells storage how far retention may drop: on the master, the
// lowest Match of the other members, so nothing a member still lacks goes,
// except for a member silent for longer than Config.SilentMemberHold: it
// would hold the log (and, once the budget is full, every publish) for as
// long as it stays away, and gets a snapshot of the broker state when it
// returns; so does a member whose Match the log has passed already. A
// member that never answered has Match 0 and holds everything until then
// if nothing was dropped yet (it then gets the whole log, not a snapshot);
// one receiving a snapshot holds the log after it.
// On a slave (and a candidate) storage's own bound applies: what it has
// applied.
func (n *Node) updateFloor() {
	floor := uint64(math.MaxUint64)
	if n.leader {
		silent := n.silentMembers()
		first, _ := n.db.FirstIndex()
		n.rn.WithProgress(func(id uint64, _ raft.ProgressType, pr tracker.Progress) {
			// A member the log has passed already needs a snapshot:
			// holding the log for it keeps nothing it can use.
			switch {
			case id == n.id || silent[id]:
			case pr.Match+1 >= first:
				floor = min(floor, pr.Match)
			case pr.State == tracker.StateSnapshot:
				// Receiving a snapshot (a large one is pulled for a
				// while): the log after it is what it needs next.
				floor = min(floor, pr.PendingSnapshot)
			}
		})
	}
	n.floor.Store(floor)
	n.db.SetRetentionFloor(floor)
}

// catchingUp reports whether this node has yet to apply up to CatchUpTo.
func (n *Node) catchingUp() bool {
	to := n.catchUp.Load()
	if to == 0 {
		return false
	}
	if n.db.Applied() >= to {
		n.catchUp.Store(0)
		return false
	}
	return true
}
