package replication

import (
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"time"

	pb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/storage"

	"github.com/tandem-edge/tandem/internal/clock"
)

// Settlement of sync records (DESIGN.md, "Delivery waits for the ack
// rule").
//
// A record taken under a sync ack rule (storage.Record.Sync) may commit
// before its rule is met: in a 2-gateway cluster the master alone commits,
// and in a 3-gateway one a record can commit after its sync_timeout refused
// it. No member may deliver it on commit, then. The master settles each one
// it logged: confirmed when checkSync acks it, aborted when expire refuses
// it. It logs the outcomes in small records of its own on SettleTopic, at
// most one per settleEvery, each saying "every sync record up to Upto is
// settled; those in Abort are aborted, the others confirmed". Every member
// applies them in log order, so every member holds and releases the same
// records the same way; the broker holds a sync record back from sessions
// and uplinks until a settlement covers it, and skips an aborted one forever.
//
// A new master inherits the sync records its predecessor logged and had not
// settled, or settled in a record that never committed: it cannot know
// whether they were acked, so it confirms them (never abort what may have
// been acked). Its first settlement says so: records up to Doubt were
// logged by an earlier master, and each such record it confirms is counted
// as in doubt where it is applied. The one exception is a master with no
// other member at all (a lone gateway restarting): nobody could have held
// those records, so none was acked, and they are aborted (Alone).

// SettleTopic names the master's settlement records (storage.KindSettle):
// their topic before record kinds, kept as their name. Clients cannot
// publish to it ($ topics are the server's).
const SettleTopic = "$tandem/settle"

// settleEvery bounds how often the master logs a settlement: every outcome
// since the last one rides on the next, so a busy sync topic costs one
// small record per interval, not one per publish. A settlement waits up to
// one more interval for publishes to share its commit with.
const settleEvery = 10 * time.Millisecond

// Settlement is the payload of a SettleTopic record.
type Settlement struct {
	// Upto: every sync record at or below this index is settled.
	Upto uint64 `json:"upto"`
	// Abort lists the aborted ones (the rest are confirmed). It may name
	// indexes above Upto: an abort is final at once.
	Abort []uint64 `json:"abort,omitempty"`
	// Doubt: records at or below it were logged by an earlier master and
	// are confirmed without knowing whether they were acked.
	Doubt uint64 `json:"doubt,omitempty"`
	// Alone: the master has no other member, so the records up to Doubt
	// cannot have met a sync rule: they are aborted instead.
	Alone bool `json:"alone,omitempty"`
}

// DecodeSettlement reads a SettleTopic record's payload.
func DecodeSettlement(b []byte) (Settlement, error) {
	var s Settlement
	if err := json.Unmarshal(b, &s); err != nil {
		return Settlement{}, fmt.Errorf("replication: settlement record: %w", err)
	}
	return s, nil
}

// settler is the master's side of the settlement. Loop-owned: the raft
// goroutine alone touches it (proposals resolve there, and the settlement
// records are proposed from there).
type settler struct {
	open     []uint64       // this master's sync records saved and unresolved, ascending
	abortIDs map[recID]bool // refused before their entry was saved: aborted once it is
	// abortedAt remembers the records this node aborted as master, by
	// index, with their id (an index can be reused once a term's tail is
	// overwritten): a slave's forward that comes again for one after its
	// deadline must hear "refused", not be acked from the log
	// (proposeQueued). Bounded by maxAbortedAt; an older abort is found in
	// the applier's hold (Aborter).
	abortedAt map[uint64]recID
	aborts    []uint64    // aborted, not yet in a proposed settlement
	waiting   []*proposal // aborting: their publishers wait for the abort to commit
	saved     uint64      // the last index saved while master
	sentUpto  uint64      // Upto of the last settlement proposed
	doubt     uint64      // the log's end when this node became master; 0 once proposed
	alone     bool        // and it had no other member then
	dirty     bool        // something to say since the last settlement
	last      time.Time   // when the last settlement was proposed
	timer     *time.Timer // wakes the loop for a settlement held back by settleEvery
	timerC    <-chan time.Time
}

// settleLead resets the settlement when this node gains or loses the
// mastership: what a previous term of its own left open is the new
// master's to settle (in doubt), like its predecessor's.
func (n *Node) settleLead(leader bool) {
	st := &n.settle
	st.open, st.aborts, st.doubt, st.dirty = nil, nil, 0, false
	clear(st.abortIDs)
	if !leader {
		return
	}
	last, _ := n.db.LastIndex()
	st.saved, st.sentUpto = last, 0
	if n.inheritsHeld() {
		st.doubt, st.dirty, st.alone = last, true, len(n.Members()) <= 1
	}
}

// Holder is an extra an Applier may implement: Holding reports whether it
// holds sync records applied and not yet settled. A new master asks it
// whether it inherits any (a cluster without sync topics then logs no
// settlement at all).
type Holder interface {
	Holding() bool
}

// inheritsHeld reports whether the log holds sync records no settlement
// may cover yet: among those not yet applied (read first: one applied
// meanwhile is then seen by the applier), or held by the applier.
func (n *Node) inheritsHeld() bool {
	found := false
	_ = n.db.Scan(n.db.Applied()+1, func(e pb.Entry) bool {
		found = e.Type == pb.EntryNormal && storage.RecordSync(e.Data)
		return !found
	})
	if found {
		return true
	}
	h, ok := n.cfg.Applier.(Holder)
	return ok && h.Holding()
}

// settleSaved notes the entries this master just saved: its sync records
// wait in open for their outcome, and one refused before it was saved is
// aborted now that its index is known.
func (n *Node) settleSaved(id recID, p *proposal, index uint64) {
	st := &n.settle
	if p != nil && p.settles && !p.aborting {
		p.tracked = true
		st.open = append(st.open, index) // saved in index order
		return
	}
	if p != nil && p.aborting {
		p.index = index // past its deadline before it was saved
	}
	if st.abortIDs[id] {
		delete(st.abortIDs, id)
		st.aborts = append(st.aborts, index)
		st.noteAborted(index, id)
		st.dirty = true
	}
}

// maxAbortedAt bounds settler.abortedAt; past it the lower half goes.
const maxAbortedAt = 1 << 12

// noteAborted remembers that the record id at index was aborted.
func (st *settler) noteAborted(index uint64, id recID) {
	if st.abortedAt == nil {
		st.abortedAt = map[uint64]recID{}
	}
	st.abortedAt[index] = id
	if len(st.abortedAt) <= maxAbortedAt {
		return
	}
	idx := slices.Sorted(maps.Keys(st.abortedAt))
	for _, i := range idx[:len(idx)/2] {
		delete(st.abortedAt, i)
	}
}

// Aborter is an extra an Applier may implement: Aborted reports whether
// the sync record at index was aborted by a settlement it applied.
type Aborter interface {
	Aborted(index uint64) bool
}

// aborted reports whether the sync record id, logged at index, was
// aborted: by this node as master, or by a settlement already applied.
// Loop-owned.
func (n *Node) aborted(index uint64, id recID) bool {
	if got, ok := n.settle.abortedAt[index]; ok && got == id {
		return true
	}
	a, ok := n.cfg.Applier.(Aborter)
	return ok && a.Aborted(index)
}

// settleResolved notes p's outcome: met (err nil) confirms it; any
// refusal while this node is still the master (a timeout, a failing disk)
// aborts it. One lost with the mastership is the next master's to settle.
func (n *Node) settleResolved(p *proposal, err error) {
	st := &n.settle
	if !p.settles || !n.leader {
		return
	}
	if !p.tracked {
		if err != nil {
			if st.abortIDs == nil {
				st.abortIDs = map[recID]bool{}
			}
			st.abortIDs[p.id] = true
		}
		return
	}
	if i, ok := slices.BinarySearch(st.open, p.index); ok {
		st.open = slices.Delete(st.open, i, i+1)
	}
	if err != nil {
		st.aborts = append(st.aborts, p.index)
		st.noteAborted(p.index, p.id)
	}
	st.dirty = true
}

// settleTurn proposes a settlement when there is something to say and
// settleEvery has passed since the last one; otherwise it arms the timer
// that brings the loop back for it.
func (n *Node) settleTurn(now time.Time) {
	st := &n.settle
	if !st.dirty || !n.leader || n.fenced.Load() {
		return // a fenced master's records are the promoted one's to settle
	}
	wait := settleEvery - now.Sub(st.last)
	if wait <= 0 && wait > -settleEvery {
		// Under load, publishes are queued for the next commit: the
		// settlement rides on it. Alone, it would cost a commit (an
		// fsync on every member) of its own: only once it has waited
		// another settleEvery for company.
		n.propMu.Lock()
		company := len(n.propQ) > 0
		n.propMu.Unlock()
		if !company {
			wait += settleEvery
		}
	}
	if wait > 0 {
		if st.timer == nil {
			st.timer = time.NewTimer(wait)
			st.timerC = st.timer.C
		} else {
			st.timer.Reset(wait)
		}
		return
	}
	upto := st.saved
	if len(st.open) > 0 {
		upto = min(upto, st.open[0]-1)
	}
	if upto <= st.sentUpto && len(st.aborts) == 0 && st.doubt == 0 {
		st.dirty = false // a confirmation waits for an earlier record still open
		return
	}
	s := Settlement{Upto: max(upto, st.sentUpto), Abort: st.aborts, Doubt: st.doubt, Alone: st.doubt > 0 && st.alone}
	b, _ := json.Marshal(s) // numbers only: cannot fail
	rec := storage.Record{Kind: storage.KindSettle, Legacy: n.LegacyControl(),
		Origin: n.id, Seq: n.NextSeq(), Topic: SettleTopic, Time: clock.Now().UnixNano(), Payload: b}
	st.aborts, st.doubt, st.dirty, st.last = nil, 0, false, now
	prevUpto := st.sentUpto
	st.sentUpto = s.Upto
	p := &proposal{data: storage.AppendRecord(nil, &rec), mode: Async, control: true, deadline: now.Add(n.cfg.SyncTimeout)}
	p.id = recID{rec.Origin, rec.Seq}
	p.to = outcomeFunc(func(_ uint64, err error) {
		if err == nil || !n.leader {
			return
		}
		// Not logged, and still the master (a refusal that did not take
		// the mastership): say it again with the next settlement.
		st.aborts = append(st.aborts, s.Abort...)
		st.doubt = max(st.doubt, s.Doubt)
		st.sentUpto = min(st.sentUpto, prevUpto)
		st.dirty = true
	})
	n.enqueue(p)
}

// settleWake is the settlement timer's channel (nil while none is armed).
func (n *Node) settleWake() <-chan time.Time { return n.settle.timerC }

// Refused is final, on the master (DESIGN.md, "Guarantees"; issue #32).
// A sync record this node logged as master may be on another member: the
// next master would confirm it, in doubt, should this node lose the
// mastership before an abort of it commits. So a record past its deadline
// is not refused at once: startAbort puts its abort in the next settlement
// and its publisher waits until a settlement covering it commits
// (settleCommitted): this node's abort (0x80, ≈ one settlement interval
// later), or, if the mastership went first, the next master's settlement,
// which confirms it (0x00: it will be delivered) or aborts it; or until a
// conflicting append takes its entry out of this log (refuseRequeued:
// refused, it is in no log). A paused master that wakes past the deadline
// of its records, or a deposed one whose records were on a slave, tells
// its devices what the cluster's log says, not a guess.

// startAbort turns p, past its deadline, into an aborting record.
func (n *Node) startAbort(p *proposal) {
	n.settleResolved(p, ErrAckTimeout) // its abort, if this node is still the master
	p.aborting = true
	n.settle.waiting = append(n.settle.waiting, p)
}

// settleCommitted resolves the aborting records a committed settlement
// entry e covers. Loop-owned; only while some wait.
func (n *Node) settleCommitted(e *pb.Entry) {
	if kind, _, _, err := storage.RecordHead(e.Data); err != nil || kind != storage.KindSettle {
		return
	}
	rec, err := storage.DecodeRecord(e.Data)
	if err != nil {
		return
	}
	s, err := DecodeSettlement(rec.Payload)
	if err != nil {
		return
	}
	st := &n.settle
	keep := st.waiting[:0]
	for _, p := range st.waiting {
		if p.resolved {
			continue
		}
		idx := p.index
		switch {
		case idx == 0 || idx >= e.Index:
			// Not saved here yet (this node's raft still has it), or
			// logged after this settlement: a later one covers it.
			keep = append(keep, p)
		case slices.Contains(s.Abort, idx) || (s.Alone && idx <= s.Doubt):
			n.resolve(p, ErrAckTimeout)
		case idx <= s.Upto:
			// A master that cannot know whether it was acked confirmed
			// it: it will be delivered, so its publisher hears so.
			n.resolve(p, nil)
		default:
			keep = append(keep, p)
		}
	}
	clear(st.waiting[len(keep):])
	st.waiting = keep
	n.flushResolved()
}
