package replication

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"sync"
	"time"

	"go.etcd.io/raft/v3"
	pb "go.etcd.io/raft/v3/raftpb"
	"go.etcd.io/raft/v3/tracker"

	"github.com/tandem-edge/tandem/storage"
)

// recID is a record's id: origin node and sequence number.
type recID struct{ origin, seq uint64 }

// proposal is one record on its way to its ack rule. Loop-owned after
// Propose hands it over. Fields are ordered so the struct fits a 144-byte
// size class: one is allocated per publish.
type proposal struct {
	id   recID
	data []byte
	// to is told the outcome, with tag (ProposeTo).
	to       Outcomes
	tag      any
	deadline time.Time
	index    uint64
	also     []*proposal // later copies of the same record, sharing the outcome
	// out counts the forward requests carrying the record that have not
	// returned, and doubt is set once one returned without proving the
	// master never had it (forward.go, "Refused is final"). The stream's
	// lock guards both; the raft loop never reads them.
	out      int32
	doubt    bool
	mode     AckMode
	resolved bool
	counted  bool // in batch.inNode: enqueued, not yet resolved
	// inbound marks a record a slave forwarded here: if this node is no
	// longer the master it is answered ErrNotLeader (the slave sends it
	// on), never put on this node's own stream.
	inbound bool
	// viaStream marks one of this node's records that reached its raft
	// queue through the forward stream: it may be in the log already
	// (logged by the previous master), so it is remembered like another
	// node's record.
	viaStream bool
	// stepped is set once raft took the record, here or (forwarded) on
	// the master: from then on it may be in the log, whatever its outcome.
	stepped bool
	// pending marks a record raft has taken whose entry is not saved yet
	// (Node.pending counts them); live holds it meanwhile. A flag, not a
	// second map: an insert and a delete per publish.
	pending bool
	// reuse marks a proposal of ProposeTo that went the plain way, never
	// onto the forward stream: once resolved and out of byDue, nothing
	// holds it and it goes back to proposals (expire).
	reuse bool
	// settles marks a sync record this node handed to raft as master: it
	// settles it (settle.go); tracked, once its index is in settler.open.
	settles, tracked bool
	// aborting marks a settles record past its deadline whose publisher
	// is told nothing yet: refused only once an abort of it commits, or
	// its entry leaves the log (settle.go, "Refused is final").
	aborting bool
	// control marks the node's own settlement record: it is taken even
	// while publishes are refused for space, or held records would wait
	// for ever.
	control bool
}

// proposals recycles ProposeTo's proposals: one per publish was an
// allocation, and garbage, of 144 bytes. Only an async one that took the
// plain way comes back, once it is resolved and leaves byDue (expire):
// such a one is in no map, queue or list then.
var proposals = sync.Pool{New: func() any { return new(proposal) }}

// Outcomes receives the outcomes of proposals. One receiver serves many
// proposals, each told apart by the tag it was proposed with, so that a
// proposal costs its proposer no callback of its own (a closure per
// publish was an allocation, and garbage, per message).
type Outcomes interface {
	// Resolved is called exactly once per proposal, on the replication
	// goroutine (or the proposer's, when the proposal is refused at
	// once), with the record's index when its ack rule is met, or with an
	// error (ErrAckTimeout, ErrNotLeader, ErrStopped, ErrStorage) when it
	// cannot be. It must not block.
	Resolved(tag any, index uint64, err error)
}

// outcomeFunc is a callback as Outcomes; it ignores the tag.
type outcomeFunc func(index uint64, err error)

func (f outcomeFunc) Resolved(_ any, index uint64, err error) { f(index, err) }

// finish tells p's proposer its outcome.
func (p *proposal) finish(index uint64, err error) { p.to.Resolved(p.tag, index, err) }

// Propose submits data, an encoded record, under mode's ack rule. done is
// called exactly once, on the replication goroutine, with the record's index
// when the rule is met, or with an error (ErrAckTimeout, ErrNotLeader,
// ErrStopped, ErrStorage) when it cannot be. done must not block.
func (n *Node) Propose(data []byte, mode AckMode, done func(index uint64, err error)) {
	n.ProposeTo(data, mode, outcomeFunc(done), nil)
}

// ProposeTo is Propose with the outcome told to to, with tag.
func (n *Node) ProposeTo(data []byte, mode AckMode, to Outcomes, tag any) {
	origin, seq, err := storage.RecordID(data)
	if err != nil {
		n.refuseNow(&proposal{to: to, tag: tag}, fmt.Errorf("replication: propose: %w", err))
		return
	}
	p := proposals.Get().(*proposal)
	*p = proposal{id: recID{origin, seq}, data: data, mode: mode, to: to, tag: tag, deadline: time.Now().Add(n.cfg.SyncTimeout)}
	// Another node is the master, or records taken before this one are
	// still on the forward stream: this one follows them there, so a
	// publisher's records keep their order (forward.go).
	if n.cfg.Forwarder != nil && n.fwdTake(p, n.Leader() != n.id) {
		return
	}
	p.reuse = true // before the loop can see it
	n.enqueue(p)
}

// enqueue hands p to the raft goroutine, or fails it at once when the node
// cannot take proposals.
func (n *Node) enqueue(p *proposal) {
	if e := n.diskErr.Load(); e != nil {
		n.refuseNow(p, *e)
		return
	}
	if n.fenced.Load() {
		n.refuseNow(p, ErrNotLeader)
		return
	}
	if n.db.LowOnSpace() && !p.control {
		// The filesystem is nearly full, whoever filled it: a write now
		// could fail halfway through a checkpoint.
		n.refuseNow(p, ErrDiskLow)
		return
	}
	if n.db.Refusing() && !p.control && (n.cfg.PastBudget == nil || !n.cfg.PastBudget(p.data)) {
		// Logging more would only grow the data dir past its budget:
		// devices get 0x97 quota exceeded until the member catches up.
		n.refuseNow(p, ErrLogFull)
		return
	}
	n.propMu.Lock()
	if n.closedErr != nil {
		err := n.closedErr
		n.propMu.Unlock()
		n.refuseNow(p, err)
		return
	}
	n.propQ = append(n.propQ, p)
	wake := len(n.propQ) == 1
	if !p.control {
		// A settlement is no publisher's: counted, it would raise the
		// population the group commit waits for (batch.go).
		p.counted = true
		wake = n.batch.arrived(len(n.propQ))
	}
	n.propMu.Unlock()
	if wake {
		n.wakeProposals()
	}
}

// wakeProposals makes the loop look at propQ.
func (n *Node) wakeProposals() {
	select {
	case n.propSig <- struct{}{}:
	default:
	}
}

// refuseNow fails a proposal on the caller's goroutine, then lets
// AfterResolve act on it as the raft goroutine would.
func (n *Node) refuseNow(p *proposal, err error) {
	p.finish(0, err)
	if n.cfg.AfterResolve != nil {
		n.cfg.AfterResolve()
	}
}

// maxTakeBytes bounds the records one proposeQueued hands raft.
const maxTakeBytes = 1 << 20

// proposeQueued hands the queued proposals to raft in one MsgProp.
func (n *Node) proposeQueued() {
	n.propMu.Lock()
	if len(n.propQ) == 0 || !n.batch.take(time.Now(), n.leader, n.wakeProposals) {
		n.propMu.Unlock()
		return
	}
	// At most maxTakeBytes of records per Ready: what one WAL append
	// and one raft message carry stays bounded whatever a flood of large
	// publishes queued, so the WAL and the memory raft holds do too; the
	// rest waits for the next turn of the loop.
	take, size := 0, 0
	for take < len(n.propQ) && (take == 0 || size+len(n.propQ[take].data) <= maxTakeBytes) {
		size += len(n.propQ[take].data)
		take++
	}
	q := n.propQ
	ps := q[:take:take]
	// The rest, if any, goes to the front of the spare array; q's array
	// is the spare once ps is done with.
	n.propQ = append(n.propSpare, q[take:]...)
	n.propSpare = nil
	if take < len(q) {
		defer n.wakeProposals()
	}
	n.propMu.Unlock()
	defer n.keepSpare(q)
	if len(ps) == 0 {
		return
	}
	if !n.leader {
		var back []*proposal
		for _, p := range ps {
			// A settlement speaks for this master's term only: the
			// next master settles what it leaves (settle.go).
			if n.cfg.Forwarder == nil || p.inbound || p.control {
				n.resolve(p, ErrNotLeader)
				continue
			}
			// Taken here while this node was the master, never handed
			// to raft: it goes to the new master, ahead of what this
			// node took since.
			if p.counted {
				n.batch.left()
				p.counted = false
			}
			back = append(back, p)
		}
		if len(back) > 0 && !n.fwdPutBack(back) {
			for _, p := range back {
				n.resolve(p, ErrStopped)
			}
		}
		return
	}
	ents := make([]pb.Entry, 0, len(ps))
	fresh := ps[:0]
	for _, p := range ps {
		// A record already on its way or in the log (a slave's retried
		// forward, a requeue) is not logged twice: it shares the outcome
		// of the copy that is.
		if live := n.live[p.id]; live != nil {
			live.also = append(live.also, p)
			continue
		}
		if idx, ok := n.logged.get(p.id); ok && n.holds(idx, p.id) {
			p.index = idx
			if p.mode == Sync && storage.RecordSync(p.data) && n.aborted(idx, p.id) {
				// Its first copy was refused and aborted (a slave that
				// heard no answer in time asks again): that stays its
				// outcome, or a publish acked now would never be
				// delivered.
				n.resolve(p, ErrAckTimeout)
				continue
			}
			if p.mode == Async {
				n.resolve(p, nil)
			} else {
				n.waitSync(p)
			}
			continue
		}
		ents = append(ents, pb.Entry{Data: p.data})
		fresh = append(fresh, p)
		n.live[p.id] = p // a copy later in this same batch shares it
	}
	if len(ents) == 0 {
		return
	}
	if err := n.rn.Step(pb.Message{Type: pb.MsgProp, From: n.id, Entries: ents}); err != nil {
		for _, p := range fresh {
			n.resolve(p, fmt.Errorf("%w (%v)", ErrNotLeader, err))
		}
		return
	}
	for _, p := range fresh {
		p.stepped = true
		p.settles = p.mode == Sync && storage.RecordSync(p.data)
		p.pending = true
		n.pending++
		n.byDue = append(n.byDue, p)
	}
}

// maxSpareProps bounds the spare array kept (propSpare): one grown by an
// unusual burst goes back to the garbage collector.
const maxSpareProps = 4096

// keepSpare keeps q's array, taken by proposeQueued, for propQ's next
// turn.
func (n *Node) keepSpare(q []*proposal) {
	clear(q) // the proposals are not the array's to keep alive
	if cap(q) > maxSpareProps {
		return
	}
	n.propMu.Lock()
	if n.propSpare == nil {
		n.propSpare = q[:0]
	}
	n.propMu.Unlock()
}

// waitSync adds a saved sync proposal to syncWait, kept in index order.
func (n *Node) waitSync(p *proposal) {
	i, _ := slices.BinarySearchFunc(n.syncWait, p.index, func(q *proposal, idx uint64) int {
		return cmp.Compare(q.index, idx)
	})
	n.syncWait = slices.Insert(n.syncWait, i, p)
	if !slices.Contains(n.byDue, p) {
		n.byDue = append(n.byDue, p)
	}
}

// matchSaved resolves the proposals whose entries were just saved: async
// ones are acked now (on the master's disk); sync ones wait for replicas.
func (n *Node) matchSaved(ents []pb.Entry) {
	if len(ents) > 0 {
		n.settle.saved = ents[len(ents)-1].Index
	}
	if n.pending == 0 && len(n.settle.abortIDs) == 0 {
		return
	}
	for i := range ents {
		e := &ents[i]
		if e.Type != pb.EntryNormal || len(e.Data) == 0 {
			continue
		}
		origin, seq, err := storage.RecordID(e.Data)
		if err != nil {
			continue
		}
		id := recID{origin, seq}
		p := n.live[id] // a pending proposal is live, and the only one of its id
		if p != nil && !p.pending {
			p = nil
		}
		if origin != n.id || (p != nil && p.viaStream) {
			// Only another node's records come again (a slave's retried
			// forward, a deposed master's requeue), and this node's own
			// that went through the forward stream (another master may
			// have logged them too): others are proposed once, so they
			// need no entry here.
			n.logged.add(id, e.Index)
		}
		n.settleSaved(id, p, e.Index)
		if p == nil {
			continue
		}
		n.unpend(p)
		p.index = e.Index
		if p.mode == Async {
			n.resolve(p, nil)
		} else {
			n.syncWait = append(n.syncWait, p)
		}
	}
}

// noteLogged remembers where the records a follower saves are: should this
// node become the master, the forward streams of the slaves (its own
// included) send again whatever the old master had not answered, and what
// it logged must be answered from the log, not logged twice.
func (n *Node) noteLogged(ents []pb.Entry) {
	for i := range ents {
		e := &ents[i]
		if e.Type != pb.EntryNormal || len(e.Data) == 0 {
			continue
		}
		if origin, seq, err := storage.RecordID(e.Data); err == nil {
			n.logged.add(recID{origin, seq}, e.Index)
		}
	}
}

// holds reports whether the log entry at index is still the record id: an
// entry recentLogged remembers may since have been overwritten (and moved
// to the requeue bucket) when this node lost the mastership, and the record
// must then be logged again, not taken as logged.
func (n *Node) holds(index uint64, id recID) bool {
	ents, err := n.db.Entries(index, index+1, math.MaxUint64)
	if err != nil || len(ents) != 1 {
		return false
	}
	o, s, err := storage.RecordID(ents[0].Data)
	return err == nil && o == id.origin && s == id.seq
}

// checkSync acks the sync proposals that enough other members hold, as
// their Progress.Match says (learners count: a 2-gateway slave is one).
func (n *Node) checkSync() {
	if len(n.syncWait) == 0 || !n.leader {
		return
	}
	k := n.cfg.MinSyncReplicas
	var top [2]uint64 // the k highest Match among others; k ≤ 2
	n.rn.WithProgress(func(id uint64, _ raft.ProgressType, pr tracker.Progress) {
		if id == n.id {
			return
		}
		m := pr.Match
		if m > top[0] {
			top[0], top[1] = m, top[0]
		} else if m > top[1] {
			top[1] = m
		}
	})
	if k < 1 || k > len(top) {
		return
	}
	covered := top[k-1]
	i := 0
	for ; i < len(n.syncWait) && n.syncWait[i].index <= covered; i++ {
		if !n.syncWait[i].aborting { // its abort is on its way: too late
			n.resolve(n.syncWait[i], nil)
		}
	}
	n.syncWait = n.syncWait[i:]
}

// resolve reports p's outcome once, and the same outcome to the copies
// of its record that waited on it.
func (n *Node) resolve(p *proposal, err error) {
	if p.resolved {
		return
	}
	p.resolved = true
	n.resolvedSome = true
	n.unpend(p) // the loop is exiting (failWaiting), or raft dropped it
	if p.counted {
		n.batch.left()
	}
	if n.live[p.id] == p {
		delete(n.live, p.id)
	}
	if !p.aborting { // an aborting one told the settler already
		n.settleResolved(p, err)
	}
	for _, q := range p.also {
		q.index = p.index
		n.resolve(q, err)
	}
	if err != nil {
		if p.stepped {
			// Its publisher hears "refused", yet the record may be in the
			// log: should this node's requeue ever meet it, it is dropped.
			n.noteRefused(p.id, p.index)
		}
		p.finish(0, err)
		return
	}
	p.finish(p.index, nil)
}

// unpend takes p off the pending count: its entry is saved, or it will
// never be.
func (n *Node) unpend(p *proposal) {
	if p.pending {
		p.pending = false
		n.pending--
	}
}

// flushResolved lets AfterResolve act on the callbacks run since the last
// call (acks written in one go per client).
func (n *Node) flushResolved() {
	if n.resolvedSome && n.cfg.AfterResolve != nil {
		n.cfg.AfterResolve()
	}
	n.resolvedSome = false
}

// expire fails the proposals past their deadline and drops resolved ones
// from the head of byDue.
func (n *Node) expire(now time.Time) {
	i := 0
	for ; i < len(n.byDue); i++ {
		p := n.byDue[i]
		if !p.resolved && !p.aborting {
			if now.Before(p.deadline) {
				break
			}
			if p.settles {
				n.startAbort(p)
				continue
			}
			if p.mode == Async && n.leader && p.pending {
				// Handed to raft, not yet saved (a slow disk): the next
				// Ready saves it, and its rule is this disk, or the
				// mastership goes first and raft drops it (setLeader).
				// Refused now, it could be logged a moment later and
				// delivered, though its publisher was told it failed.
				continue
			}
			n.unpend(p)
			n.resolve(p, ErrAckTimeout)
		}
	}
	if i > 0 {
		for _, p := range n.byDue[:i] {
			if p.reuse && p.resolved && p.mode == Async {
				// Out of live (resolve), off the pending count, never in
				// syncWait or the settler (async), never another's copy
				// (it was proposed fresh): byDue held it last.
				*p = proposal{}
				proposals.Put(p)
			}
		}
		n.byDue = append(n.byDue[:0], n.byDue[i:]...)
	}
	j := 0
	for ; j < len(n.syncWait) && (n.syncWait[j].resolved || n.syncWait[j].aborting); j++ {
	}
	n.syncWait = n.syncWait[j:]
}

// resolveAll fails every unresolved proposal, queued ones included, and
// makes later proposals fail at once: the loop is exiting.
func (n *Node) resolveAll(err error) {
	n.propMu.Lock()
	n.closedErr = err
	n.propMu.Unlock()
	n.failWaiting(err)
	n.flushResolved()
}
