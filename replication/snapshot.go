package replication

import (
	"fmt"

	"go.etcd.io/raft/v3"
	pb "go.etcd.io/raft/v3/raftpb"
	"go.etcd.io/raft/v3/tracker"

	"github.com/tandem-edge/tandem/storage"
)

// Snapshots.
//
// A member whose next index is below the master's first index (a joiner
// to a compacted log, a slave away for long) gets raft's snapshot: the
// broker state at an applied index of the master (storage/snapshot.go).
// Installing it replaces this member's log and broker state, so it happens
// on the apply goroutine, in log order: every batch committed before it
// has been applied, none after it yet. The raft goroutine waits for it
// before it saves the entries that follow the snapshot in the same Ready.
// An Applier that keeps state of its own derived from the log (the
// broker's sessions and retained messages in memory) implements Restorer
// and takes the new state there.

// Restorer is an Applier that holds state derived from the log besides the
// data file: when a snapshot replaces the log, Restore is called on the
// apply goroutine with the snapshot's index and install, which replaces
// the data file's log and broker state. Restore quiesces what reads or
// writes that state, calls install, then reloads from the data file. An
// error from install must be returned; it stops the node.
type Restorer interface {
	Restore(index uint64, install func() error) error
}

// entrySnapshot marks the batch on applyc that installs a snapshot
// (Node.installing holds it); raft's entry types are 0–2.
const entrySnapshot pb.EntryType = 100

// snapInstall is a snapshot handed to the apply goroutine.
type snapInstall struct {
	snap pb.Snapshot
	done chan error
}

// silentHold is how long a member that stopped answering still holds
// retention (Config.SilentMemberHold's default, in election timeouts).
const silentHold = 10

// installSnapshot has the apply goroutine install snap and waits for it.
// It runs on the raft goroutine; false means the node stops.
func (n *Node) installSnapshot(snap pb.Snapshot) bool {
	req := &snapInstall{snap: snap, done: make(chan error, 1)}
	n.installing = req // read by the apply goroutine after the send below
	select {
	case n.applyc <- []pb.Entry{{Type: entrySnapshot, Index: snap.Metadata.Index, Term: snap.Metadata.Term}}:
	case <-n.stopc:
		return false
	case <-n.failc:
		return false
	}
	var err error
	select {
	case err = <-req.done:
	case <-n.stopc:
		return false
	case <-n.failc:
		return false
	}
	if err != nil {
		n.fail(fmt.Errorf("%w: installing the snapshot at %d: %v", ErrStorage, snap.Metadata.Index, err))
		return false
	}
	n.savedHS = n.db.HardState()
	n.term.Store(n.savedHS.Term)
	size := uint64(len(snap.Data))
	if ref, ok := storage.ParseStagedSnapshot(snap.Data); ok {
		size = ref.Size
	}
	n.log.Warn("behind the master's first index: installed its snapshot of the broker state; the records before it are not on this node",
		"index", snap.Metadata.Index, "term", snap.Metadata.Term, "bytes", size)
	return true
}

// applySnapshot installs the snapshot the raft goroutine handed over, on
// the apply goroutine.
func (n *Node) applySnapshot() {
	req := n.installing
	n.installing = nil
	install := func() error {
		if err := n.db.ApplySnapshot(req.snap); err != nil {
			return err
		}
		n.level.Store(int32(n.db.FeatureLevelOf())) // the snapshot's cluster's
		n.membersMu.Lock()
		err := n.loadMembers()
		n.membersMu.Unlock()
		if err == nil && n.cfg.OnMembership != nil {
			n.cfg.OnMembership(n.Members())
		}
		return err
	}
	n.pull.installing.Store(true)
	var err error
	if r, ok := n.cfg.Applier.(Restorer); ok {
		err = r.Restore(req.snap.Metadata.Index, install)
	} else {
		err = install()
	}
	n.pull.installing.Store(false)
	req.done <- err
}

// silentMembers returns the members other than this one that have not
// answered for longer than Config.SilentMemberHold: they no longer hold
// retention, and get a snapshot when they return. Loop-owned; it runs on
// every tick, after checkCutOff counted it.
//
// Silence is counted on the clock of cutoff.go: the tick at which the raft
// goroutine last took a message from the member (noteHeard). raft's own
// RecentActive is no such clock: check-quorum clears it every election
// timeout and any answer sets it, so it says only "heard since the last
// check". Counted in ticks, a loop held up by a slow disk counts no time
// meanwhile, and a member is silent only once this loop had the chance to
// read what it sent. A member this node never heard from as master (a new
// master, a member just added) counts its silence from the tick it was
// first seen here.
func (n *Node) silentMembers() map[uint64]bool {
	if n.silentSince == nil {
		n.silentSince = map[uint64]uint64{}
	}
	hold := n.cfg.SilentMemberHold
	if hold == 0 {
		hold = silentHold * n.cfg.ElectionTimeout
	}
	holdTicks := uint64((hold + n.cfg.Heartbeat - 1) / n.cfg.Heartbeat)
	var silent map[uint64]bool
	seen := map[uint64]bool{}
	n.rn.WithProgress(func(id uint64, _ raft.ProgressType, _ tracker.Progress) {
		if id == n.id {
			return
		}
		seen[id] = true
		since, ok := n.silentSince[id]
		if !ok {
			since = n.ticks
			n.silentSince[id] = since
		}
		if h, ok := n.heard[id]; ok && h > since {
			since = h
		}
		if n.ticks-since > holdTicks {
			if silent == nil {
				silent = map[uint64]bool{}
			}
			silent[id] = true
		}
	})
	for id := range n.silentSince {
		if !seen[id] {
			delete(n.silentSince, id)
		}
	}
	return silent
}
