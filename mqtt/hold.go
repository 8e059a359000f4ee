package mqtt

import (
	"cmp"
	"encoding/binary"
	"errors"
	"slices"
	"strings"
	"sync"
)

// Sync records wait for their settlement (DESIGN.md, "Delivery waits for
// the ack rule").
//
// A record taken under a sync ack rule (Message.Sync) is committed, and
// applied here, before its rule is known to be met. Until the master's
// settlement (Settle) confirms it, it is held: a session whose filters it
// matches does not move past it, live or replaying from its cursor, so the
// order of what the session gets is kept and a session that takes no sync
// topic is never held up; a retained one does not yet replace the topic's
// retained message. An aborted record (its publisher was refused) is
// skipped for ever, by every session, here and on every member, after a
// restart too: the held and aborted sets are kept in the session store,
// staged with the apply that changed them, and aborted indexes are
// forgotten once retention drops them.

// holdState is what Settle has said about a sync record so far.
type holdState uint8

const (
	recFree    holdState = iota // not held: confirmed, or not a sync record
	recHeld                     // applied, waiting for its settlement
	recAborted                  // refused: never delivered
	recDup                      // a QoS 2 resend's second copy: never delivered (inboundDup)
)

// Keys of the hold in the session store: an 8-byte big-endian log index.
const (
	keyHeld    = "H\x00" // H index → 1 byte: 1 if the record is retained
	keyAborted = "X\x00" // X index → empty
	keyDup     = "D\x00" // D index → empty: a duplicate (inboundDup)
)

func holdKey(prefix string, index uint64) string {
	return prefix + string(binary.BigEndian.AppendUint64(nil, index))
}

// holds is the server's record of held and aborted sync records.
type holds struct {
	mu      sync.Mutex          // guards everything below; taken after a session's mu
	held    map[uint64]heldRec  // applied, not yet settled
	aborted map[uint64]struct{} // aborted, still in the log
	dups    map[uint64]struct{} // duplicates (inboundDup), still in the log
	waiting map[*session]struct{}
	// pending are the outcomes of failed QoS 2 resends whose late
	// original, at the index they are kept under, was held when they
	// failed: they wait for its settlement (inAck.outcome).
	pending map[uint64][]heldOutcome
	settles int // settlements applied, for the occasional prune
}

// heldOutcome is the outcome of a failed QoS 2 resend, a, waiting for its
// late original's settlement: err is the resend's own failure, what the
// device is told unless the original is confirmed.
type heldOutcome struct {
	a   *inAck
	err error
}

// settledOutcome is a heldOutcome whose original's fate is known now:
// delivered when it was confirmed.
type settledOutcome struct {
	heldOutcome
	late      uint64
	delivered bool
}

// heldRec is one held record: a retained one updates the retained store
// once confirmed (m is nil when it was loaded from the store: it is read
// from the log then).
type heldRec struct {
	retain bool
	m      *Message
}

// pruneEvery is how many settlements pass between two looks for aborted
// indexes that retention dropped.
const pruneEvery = 256

// state reports index's hold state; a session stopping at a held record
// asks to be woken at the next settlement. Called with se.mu held.
func (h *holds) state(index uint64, se *session) holdState {
	h.mu.Lock()
	defer h.mu.Unlock()
	st := h.stateLocked(index)
	if st == recHeld && se != nil {
		if h.waiting == nil {
			h.waiting = map[*session]struct{}{}
		}
		h.waiting[se] = struct{}{}
	}
	return st
}

// stateLocked is index's hold state. Called with h.mu held.
func (h *holds) stateLocked(index uint64) holdState {
	if _, ok := h.held[index]; ok {
		return recHeld
	}
	if _, ok := h.aborted[index]; ok {
		return recAborted
	}
	if _, ok := h.dups[index]; ok {
		return recDup
	}
	return recFree
}

// stateOrWait is state, except that when index is held, o waits for its
// settlement, decided with the same lock so that no settlement comes
// between. Called with o's session's mu held.
func (h *holds) stateOrWait(index uint64, o heldOutcome) holdState {
	h.mu.Lock()
	defer h.mu.Unlock()
	st := h.stateLocked(index)
	if st == recHeld {
		if h.pending == nil {
			h.pending = map[uint64][]heldOutcome{}
		}
		h.pending[index] = append(h.pending[index], o)
	}
	return st
}

// settledLocked takes the pending outcomes whose original is no longer
// held: confirmed (delivered), aborted, or a duplicate. Called with h.mu
// held; the caller runs them (runSettled) once it is released.
func (h *holds) settledLocked() []settledOutcome {
	var out []settledOutcome
	for idx, os := range h.pending {
		if _, ok := h.held[idx]; ok {
			continue
		}
		_, aborted := h.aborted[idx]
		_, dup := h.dups[idx]
		for _, o := range os {
			out = append(out, settledOutcome{o, idx, !aborted && !dup})
		}
		delete(h.pending, idx)
	}
	return out
}

// runSettled runs outcomes, with no lock held: each takes its session's.
func runSettled(outcomes []settledOutcome) {
	for _, o := range outcomes {
		o.a.settled(o.err, o.late, o.delivered)
	}
}

// markDup notes the record at index a duplicate: kept in the session
// store, like aborted indexes, until retention drops it.
func (s *Server) markDup(index uint64) {
	h := &s.holds
	h.mu.Lock()
	h.dupLocked(index)
	h.mu.Unlock()
	s.stagePut(holdKey(keyDup, index), nil)
}

// dupLocked notes index a duplicate. Called with h.mu held.
func (h *holds) dupLocked(index uint64) {
	if h.dups == nil {
		h.dups = map[uint64]struct{}{}
	}
	h.dups[index] = struct{}{}
}

// wake has the sessions that waited at a held record go on.
func wake(waiting map[*session]struct{}) {
	for se := range waiting {
		if c := se.current(); c != nil {
			c.kick()
		}
	}
}

// demoteHeld makes the held sync record at index a duplicate: a resend of
// it, acked to its device, is delivered instead (inboundDup). Sessions
// waiting at it go on.
func (s *Server) demoteHeld(index uint64) {
	h := &s.holds
	h.mu.Lock()
	_, held := h.held[index]
	delete(h.held, index)
	h.dupLocked(index) // with the same lock: no session sees it free between
	waiting := h.waiting
	h.waiting = nil
	settled := h.settledLocked()
	h.mu.Unlock()
	if held {
		s.stageDelete(holdKey(keyHeld, index))
	}
	s.stagePut(holdKey(keyDup, index), nil)
	wake(waiting)
	runSettled(settled)
}

// skipsForAll reports whether nobody is ever handed the record at index,
// m: an aborted sync record or a duplicate QoS 2 one.
func (s *Server) skipsForAll(index uint64, m *Message) bool {
	if !m.Sync && m.QoS != 2 {
		return false
	}
	st := s.holds.state(index, nil)
	return st == recAborted || st == recDup
}

// hold notes the sync record at index, just applied: nobody gets it until
// a settlement confirms it.
func (s *Server) hold(index uint64, m *Message) {
	h := &s.holds
	h.mu.Lock()
	if h.held == nil {
		h.held = map[uint64]heldRec{}
	}
	r := heldRec{retain: m.Retain}
	if m.Retain {
		r.m = m
	}
	h.held[index] = r
	h.mu.Unlock()
	v := byte(0)
	if m.Retain {
		v = 1
	}
	s.stagePut(holdKey(keyHeld, index), []byte{v})
}

// Settle applies the master's settlement record at index (replication's
// Settlement, in log order): every held record up to upto is settled, those
// in aborts are aborted and the others confirmed; doubt says which of the
// confirmed ones were logged by an earlier master, which may have refused
// them (counted: Observer.InDoubt), unless alone says no member could have
// acked them: then they are aborted. Sessions held at a settled record go
// on.
func (s *Server) Settle(index, upto uint64, aborts []uint64, doubt uint64, alone bool) {
	defer s.Applied(index)
	h := &s.holds
	type confirmed struct {
		index uint64
		r     heldRec
	}
	var retained []confirmed
	var inDoubt uint64
	h.mu.Lock()
	if h.aborted == nil {
		h.aborted = map[uint64]struct{}{}
	}
	if alone {
		for idx := range h.held {
			if idx <= doubt {
				aborts = append(slices.Clip(aborts), idx)
			}
		}
	}
	for _, a := range aborts {
		if _, ok := h.aborted[a]; ok {
			continue
		}
		h.aborted[a] = struct{}{}
		if _, ok := h.held[a]; ok {
			delete(h.held, a)
			s.stageDelete(holdKey(keyHeld, a))
		}
		s.stagePut(holdKey(keyAborted, a), nil)
	}
	for idx, r := range h.held {
		if idx > upto {
			continue
		}
		delete(h.held, idx)
		s.stageDelete(holdKey(keyHeld, idx))
		if idx <= doubt {
			inDoubt++
		}
		if r.retain {
			retained = append(retained, confirmed{idx, r})
		}
	}
	waiting := h.waiting
	h.waiting = nil
	settled := h.settledLocked()
	h.settles++
	prune := h.settles%pruneEvery == 0
	h.mu.Unlock()
	slices.SortFunc(retained, func(a, b confirmed) int { return cmp.Compare(a.index, b.index) })
	for _, c := range retained {
		m := c.r.m
		if m == nil {
			m = s.readRecord(c.index)
		}
		if m == nil {
			continue
		}
		if _, live := m.expiryLeft(s.cfg.Now()); live {
			s.retainIfNewer(c.index, m)
		}
	}
	if inDoubt > 0 {
		s.observer().InDoubt(inDoubt)
		s.lines.Warn("sync records confirmed in doubt: an earlier master logged them and did not settle them", "records", inDoubt, "index", index)
	}
	wake(waiting)
	runSettled(settled)
	if prune {
		s.pruneAborted()
	}
}

// supersedeHeld notes that a later record set or cleared topic's retained
// message: a held retained record on it, once confirmed, no longer
// changes the store.
func (s *Server) supersedeHeld(topic string) {
	h := &s.holds
	h.mu.Lock()
	if len(h.held) == 0 {
		h.mu.Unlock()
		return
	}
	var unread, gone []uint64
	for idx, r := range h.held {
		switch {
		case !r.retain:
		case r.m == nil:
			unread = append(unread, idx) // loaded from the store: topic unknown here
		case r.m.Topic == topic:
			gone = append(gone, idx)
		}
	}
	h.mu.Unlock()
	for _, idx := range unread {
		if m := s.readRecord(idx); m != nil && m.Topic == topic {
			gone = append(gone, idx)
		}
	}
	for _, idx := range gone {
		h.mu.Lock()
		_, ok := h.held[idx]
		if ok {
			h.held[idx] = heldRec{}
		}
		h.mu.Unlock()
		if ok {
			s.stagePut(holdKey(keyHeld, idx), []byte{0})
		}
	}
}

// retainIfNewer applies a confirmed retained record unless a later record
// already set its topic.
func (s *Server) retainIfNewer(index uint64, m *Message) {
	if cur, ok := s.retained.index(m.Topic); ok && cur > index {
		return
	}
	s.retain(index, m)
}

// pruneAborted forgets aborted indexes the log no longer holds.
func (s *Server) pruneAborted() {
	r, ok := s.reader.(Retained)
	if !ok {
		return
	}
	first := r.FirstIndex()
	h := &s.holds
	h.mu.Lock()
	defer h.mu.Unlock()
	for idx := range h.aborted {
		if idx < first {
			delete(h.aborted, idx)
			s.stageDelete(holdKey(keyAborted, idx))
		}
	}
	for idx := range h.dups {
		if idx < first {
			delete(h.dups, idx)
			s.stageDelete(holdKey(keyDup, idx))
		}
	}
}

// Aborted reports whether the sync record at index was aborted by a
// settlement applied here (replication.Aborter).
func (s *Server) Aborted(index uint64) bool {
	return s.holds.state(index, nil) == recAborted
}

// HoldState reads from st what the settlements applied so far say of the
// sync records they cover: aborted holds the indexes of the aborted ones
// still in the log, held those applied and not yet settled; dups holds
// the duplicate QoS 2 resends (inboundDup). tandem inspect marks them.
func HoldState(st SessionStore) (aborted, held, dups map[uint64]bool, err error) {
	aborted, held, dups = map[uint64]bool{}, map[uint64]bool{}, map[uint64]bool{}
	for _, x := range []struct {
		prefix string
		into   map[uint64]bool
	}{{keyAborted, aborted}, {keyHeld, held}, {keyDup, dups}} {
		err = st.Load(x.prefix, func(k string, _ []byte) error {
			if rest, ok := strings.CutPrefix(k, x.prefix); ok && len(rest) == 8 {
				x.into[binary.BigEndian.Uint64([]byte(rest))] = true
			}
			return nil
		})
		if err != nil {
			return nil, nil, nil, err
		}
	}
	return aborted, held, dups, nil
}

// Holding reports whether sync records applied here wait for a settlement
// (a new master then settles them). Before Start has loaded the store, it
// looks there: a lone gateway restarting becomes the master before that.
func (s *Server) Holding() bool {
	s.holds.mu.Lock()
	loaded, n := s.holds.held != nil, len(s.holds.held)
	s.holds.mu.Unlock()
	if loaded || s.store == nil {
		return n > 0
	}
	found := false
	_ = s.store.Load(keyHeld, func(string, []byte) error {
		found = true
		return errStopLoad
	})
	return found
}

// errStopLoad ends a store Load early.
var errStopLoad = errors.New("mqtt: stop")

// SyncState reports whether the sync record at index is held (no
// settlement yet) or aborted, for the uplinks, which follow the same rule
// as sessions; a QoS 2 record that is a resend's second copy
// (inboundDup) is reported aborted too: nobody gets it.
func (s *Server) SyncState(index uint64) (held, aborted bool) {
	st := s.holds.state(index, nil)
	return st == recHeld, st == recAborted || st == recDup
}

// rewindHolds forgets the held and aborted records past applied: the log
// there was replaced (Rewind), and its indexes now name other records. A
// resend's outcome waiting for an original forgotten so is a refusal: the
// original is not in the log that stays.
func (s *Server) rewindHolds(applied uint64) {
	h := &s.holds
	h.mu.Lock()
	var gone []settledOutcome
	for idx, os := range h.pending {
		if idx > applied {
			for _, o := range os {
				gone = append(gone, settledOutcome{o, idx, false})
			}
			delete(h.pending, idx)
		}
	}
	for idx := range h.held {
		if idx > applied {
			delete(h.held, idx)
			s.stageDelete(holdKey(keyHeld, idx))
		}
	}
	for idx := range h.aborted {
		if idx > applied {
			delete(h.aborted, idx)
			s.stageDelete(holdKey(keyAborted, idx))
		}
	}
	for idx := range h.dups {
		if idx > applied {
			delete(h.dups, idx)
			s.stageDelete(holdKey(keyDup, idx))
		}
	}
	h.mu.Unlock()
	runSettled(gone)
}

// loadHolds reads the held and aborted sets at start.
func (s *Server) loadHolds() error {
	h := &s.holds
	held, aborted, dups := map[uint64]heldRec{}, map[uint64]struct{}{}, map[uint64]struct{}{}
	defer func() {
		h.mu.Lock()
		h.held, h.aborted, h.dups = held, aborted, dups
		h.mu.Unlock()
	}()
	err := s.store.Load(keyDup, func(k string, _ []byte) error {
		if idx, ok := holdIndex(k, keyDup); ok {
			dups[idx] = struct{}{}
		}
		return nil
	})
	if err != nil {
		return err
	}
	err = s.store.Load(keyHeld, func(k string, v []byte) error {
		if idx, ok := holdIndex(k, keyHeld); ok {
			held[idx] = heldRec{retain: len(v) == 1 && v[0] == 1}
		}
		return nil
	})
	if err != nil {
		return err
	}
	return s.store.Load(keyAborted, func(k string, _ []byte) error {
		if idx, ok := holdIndex(k, keyAborted); ok {
			aborted[idx] = struct{}{}
		}
		return nil
	})
}

func holdIndex(k, prefix string) (uint64, bool) {
	if len(k) != len(prefix)+8 {
		return 0, false
	}
	return binary.BigEndian.Uint64([]byte(k[len(prefix):])), true
}
