package replication

import (
	"time"

	"go.etcd.io/raft/v3"
	"go.etcd.io/raft/v3/tracker"

	"github.com/tandem-edge/tandem/internal/clock"
)

// A master cut off from the majority.
//
// check-quorum makes such a master step down, but only at its next check,
// one to two election timeouts after the cut (raft looks at who was heard
// since the previous check), and the member then waits for a master that
// never comes. The raft goroutine notes when it last heard from each peer;
// a master that has heard from no majority of the voters for an election
// timeout knows it is cut off at once, and says so (CutOff) until it hears
// a majority again, whatever raft makes of it meanwhile: its devices can
// be sent to the others an election timeout after the cut.

// noteHeard records a message from a peer; raft goroutine only. Time is
// counted in the loop's ticks, as raft's own check-quorum does: a loop held
// up by a slow disk counts no ticks meanwhile, so the messages queued for
// it are read before a majority can seem silent.
func (n *Node) noteHeard(from uint64) {
	if n.heard == nil {
		n.heard = map[uint64]uint64{}
	}
	n.heard[from] = n.ticks
}

// checkCutOff runs on every tick: it starts a cut-off episode when this
// master has heard from no majority for an election timeout and ends it
// when a majority is heard again.
func (n *Node) checkCutOff(now time.Time) {
	n.ticks++
	timeout := uint64(n.cfg.ElectionTimeout / n.cfg.Heartbeat)
	voters, heard := 1, 1 // this node
	n.rn.WithProgress(func(id uint64, _ raft.ProgressType, pr tracker.Progress) {
		if id == n.id || pr.IsLearner {
			return
		}
		voters++
		if h, ok := n.heard[id]; ok && n.ticks-h < timeout {
			heard++
		}
	})
	n.noteMasterSilence(timeout)
	switch {
	case voters < 3 || 2*heard > voters:
		if n.cutOff.Swap(0) != 0 {
			n.log.Info("a majority of the cluster is in reach again")
		}
	case n.leader && n.cutOff.Load() == 0 && !n.catchingUp():
		n.cutOff.Store(int64(clock.Mono()))
		n.log.Warn("this master has heard from no majority of the voters for an election timeout: it is cut off", "voters", voters, "heard", heard, "term", n.rn.BasicStatus().Term)
	}
}

// CutOff returns when this node, as the master of three voters, found
// itself cut off from the majority (zero while it is not): from then until
// it hears a majority again, it cannot commit anything, whatever its role.
func (n *Node) CutOff() time.Time {
	if t := n.cutOff.Load(); t != 0 {
		// A reading of the monotonic clock: now.Sub of it is a duration
		// no wall-clock jump moves.
		return time.Now().Add(time.Duration(t) - clock.Mono())
	}
	return time.Time{}
}

// noteMasterSilence sets masterSilent on every tick: whether the master
// this node knows, another member, has sent nothing for timeout ticks. A
// 2-gateway slave is a learner, which never campaigns, so raft names its
// master forever once heard; a voter names it until its own election
// timeout fires. Neither is a sign that the master is in reach.
func (n *Node) noteMasterSilence(timeout uint64) {
	silent := false
	if lead := n.lead.Load(); lead != 0 && lead != n.id {
		h, ok := n.heard[lead]
		silent = !ok || n.ticks-h >= timeout
	}
	n.masterSilent.Store(silent)
}

// MasterSilent reports whether the master this node knows, another
// member, has sent it nothing (not even a heartbeat) for an election
// timeout, counted in the loop's ticks: it is not in reach, whatever
// Leader says.
func (n *Node) MasterSilent() bool { return n.masterSilent.Load() }
