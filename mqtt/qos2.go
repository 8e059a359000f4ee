package mqtt

import (
	"maps"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
)

// QoS 2 deliveries that survive a device's move to another member.
//
// Exactly once to a subscriber rests on two things the client keeps: the
// packet id of a message it has received and not yet seen released, and
// nothing once a flow is complete. A member that takes over a session
// must therefore (a) send a message the client may already hold under the
// same packet id, so that the client takes it for the duplicate it is
// [MQTT-4.3.3-9], and (b) never send again a message whose flow the client
// has completed, only PUBREL it while the client may still hold it.
//
// (a): a QoS 2 delivery of a log record takes its packet id from the
// record's index (pidFor), so every member picks the same one; the
// delivery waits while that id is taken. (b): when the client PUBRECs
// such a delivery on a persistent session, the member logs a release
// record (a session record "rel" with the indexes) and sends the PUBREL
// only once that record is on another member's disk too (Replicated), and
// none while it is not logged (released): a member
// that takes over later has it, keeps the flow as PUBREL'd, and skips the
// record in its replay. It may apply it only after the device came (a
// follower learns the commit index from the next master): the replay
// waits for the session's start record there, and a release applied
// before it is taken into the online session as into an offline copy.
// Until the batched cursor passes it, the flow stays on the copies; a
// PUBREL for a flow the client finished is answered with PUBCOMP (MQTT 5:
// 0x92), harmless. On a log no other member shares (a
// lone gateway: Clustered) the PUBREL goes at once, with no record: nobody
// could take the session over.

// pidFor is the packet id of the QoS 2 delivery of the record at index:
// the same on every member.
func pidFor(index uint64) uint16 { return uint16((index-1)%0xFFFF) + 1 }

// inFlight reports whether the session has it, a replayed record, in
// flight already or done (taken over from another member with its flow).
func (s *session) inFlight(it *outItem) bool {
	if it.qos != 2 {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	f := s.inflight[pidFor(it.idx)]
	return (f != nil && f.idx == it.idx) || s.doneAbove[it.idx]
}

// releaseNext logs the release record of the PUBREC'd deliveries waiting
// for one, unless one is in flight: its outcome sends their PUBRELs and
// logs the next batch, so a busy subscriber's releases share records.
func (s *session) releaseNext() {
	s.mu.Lock()
	if s.relBusy || len(s.relPending) == 0 {
		s.mu.Unlock()
		return
	}
	batch, c := s.relPending, s.conn
	s.relPending, s.relBusy = nil, true
	s.mu.Unlock()
	s.srv.proposeOp(s.id, sessionOp{Op: "rel", Rel: batch}, Replicated, func(err error) { s.released(batch, c, err) })
}

// released sends the PUBRELs of batch once its release record is logged;
// c is the connection it was proposed for.
//
// When it could not be logged, no PUBREL goes: the device would complete
// flows that a member taking the session over, without the record, sends
// again under the same packet ids, as new messages. The flows stay
// PUBREC'd, their indexes pending again, and c ends as a connection whose
// start record could not be logged does (notLogged): its device connects
// again, and the resend of that connection logs the release first
// (relog), here once the log takes records, or on a member that takes
// them, which resends the messages the device still holds with DUP and
// releases them itself. A newer connection than c, whose resend found this
// record in flight and did not log it again, gets it proposed once more.
func (s *session) released(batch []uint64, c *conn, err error) {
	s.mu.Lock()
	s.relBusy = false
	now := s.conn
	var pids []uint16 // of the flows of batch still PUBREC'd here
	var left []uint64
	for _, idx := range batch {
		p := pidFor(idx)
		if it := s.inflight[p]; it != nil && it.rel && it.idx == idx {
			pids = append(pids, p)
			left = append(left, idx)
		} else {
			delete(s.releasing, idx) // ended meanwhile: its record is not needed
		}
	}
	if err != nil && len(left) > 0 {
		s.relPending = append(left, s.relPending...)
		s.mu.Unlock()
		switch {
		case now == nil:
			// Offline: its next connection's resend logs them (relog).
		case now == c:
			c.notLogged(err, "rel")
		default:
			s.releaseNext()
		}
		return
	}
	for _, idx := range left { // logged (a failure left none here)
		delete(s.releasing, idx)
	}
	s.mu.Unlock()
	if now != nil && len(pids) > 0 {
		now.lateRelease(pids)
	}
	s.releaseNext()
}

// relog logs the release records of the PUBREC'd flows a session loaded
// from the store holds (loadState), as it is resumed here: this member may
// have stopped before they were logged, and their PUBRELs wait for them.
// On a log no other member shares they need none: the PUBRELs go at once.
func (s *session) relog() {
	if s.srv.clustered() {
		s.releaseNext()
		return
	}
	s.mu.Lock()
	for _, idx := range s.relPending {
		delete(s.releasing, idx)
	}
	s.relPending = nil
	s.mu.Unlock()
}

// applyReleased takes another member's release record into the copy of
// the session here: the flows are kept as PUBREL'd (resent as PUBREL when
// the device comes here) and their records are not replayed. The copy is
// offline, or online and waiting for its start record (takesRemoteLocked):
// the device came here before this member had applied all that the one it
// left had logged, and the replay waits until it has. Then the PUBRELs
// go at once, unless the resend to come sends them.
func (s *Server) applyReleased(se *session, rel []uint64) {
	var staged []*outItem
	se.mu.Lock()
	if !se.takesRemoteLocked() {
		se.mu.Unlock()
		return // live here: its flows are this member's
	}
	c := se.conn
	for _, idx := range rel {
		p := pidFor(idx)
		it := se.inflight[p]
		held := it != nil && it.idx == idx
		if idx <= se.cursor && !held {
			// The cursor passed it, and it is not in flight here: the
			// flow is complete. (One in flight here is not, whatever
			// the cursor: it was handed out here, where the cursor
			// passes what is in flight.)
			continue
		}
		if !held {
			if it == nil {
				s.inflight.Add(1)
			} else {
				se.landedLocked(it)
			}
			se.sendSeq++
			it = &outItem{idx: idx, qos: 2, pid: p, seq: se.sendSeq}
			se.inflight[p] = it
		}
		it.rel = true
		staged = append(staged, it)
	}
	id, persist := se.id, se.persistent()
	se.mu.Unlock()
	if persist {
		for _, it := range staged {
			s.stagePut(outKey(id, it.pid), encodeOut(it))
		}
	}
	if c != nil && len(staged) > 0 {
		pids := make([]uint16, len(staged))
		for i, it := range staged {
			pids[i] = it.pid
		}
		c.lateRelease(pids)
	}
}

// takesRemoteLocked reports whether the session's copy here takes the
// records other members log for it: while it is offline, and while the
// device that came back here waits for its start record, before which
// everything another member logged for it is from before the device came
// (awaitingStartLocked). Called with se.mu held.
func (se *session) takesRemoteLocked() bool {
	return se.conn == nil || se.awaitingStartLocked()
}

// lateRelease sends the PUBRELs of flows whose release record came after
// the device connected (logged here: released; or applied from another
// member after the device came back), unless the resend that follows the
// CONNACK is still to come (it sends every flow in flight it may).
// A PUBREL twice is harmless: the device answers the second with PUBCOMP
// (0x92 in MQTT 5), which finds no flow.
func (c *conn) lateRelease(pids []uint16) {
	c.wmu.Lock()
	if !c.connacked || c.resume || c.closeAfter {
		c.wmu.Unlock()
		return
	}
	for _, p := range pids {
		c.ctrl = append(c.ctrl, packets.Pubrel<<4|2, 2, byte(p>>8), byte(p))
	}
	c.wmu.Unlock()
	c.kick()
}

// completedLocked ends, on an offline copy, the released flows the
// replicated cursor has passed (the member where the device is completed
// them) and returns their packet ids. Called with se.mu held.
func (se *session) completedLocked() []uint16 {
	if se.conn != nil {
		return nil
	}
	var done []uint16
	for p, it := range se.inflight {
		if it.rel && it.idx > 0 && it.idx <= se.cursor {
			delete(se.inflight, p)
			se.srv.inflight.Add(-1)
			done = append(done, p)
		}
	}
	return done
}

// noteInbound takes a QoS 2 publish another member logged for a device
// into the copy of its persistent session here while that copy takes
// remote records (takesRemoteLocked): offline, or back here and waiting
// for its start record, before which what the member it left logged for
// it is still being applied. When the device resends it here (DUP, its
// PUBREC lost with the other member), it gets the PUBREC and the record is
// not logged twice [MQTT-4.3.3-9]; its PUBREL gets PUBCOMP. A resend read
// before the start record is applied waits for it (awaitStart), so that
// this table holds every publish logged before the device came. A flow the
// device began on this connection is newer and stays (sentHereLocked). A
// new publish reusing the id comes without DUP and starts a flow of its
// own (qos2Resend).
func (s *Server) noteInbound(m *Message) {
	s.mu.Lock()
	se := s.sessions[m.ClientID]
	s.mu.Unlock()
	if se == nil {
		return
	}
	se.mu.Lock()
	if !se.persistent() || !se.takesRemoteLocked() {
		se.mu.Unlock()
		return
	}
	old := se.inbound[m.PacketID]
	if old != nil && se.conn != nil && se.sentHereLocked(old) {
		se.mu.Unlock()
		return
	}
	if old == nil {
		s.inflight.Add(1)
	}
	se.inbound[m.PacketID] = &inbound2{origin: m.Origin, seq: m.Seq, done: true}
	se.mu.Unlock()
	s.stagePut(qos2Key(m.ClientID, m.PacketID), encodeQoS2(m.Origin, m.Seq, time.Unix(0, m.Time)))
}

// applyInboundReleased takes another member's inbound release record
// ("irel": the device PUBREL'd those QoS 2 publishes there and got, or is
// about to get, the PUBCOMP) into the copy of the session here while it
// takes remote records, as noteInbound took the publishes: the device may
// now reuse the ids for new messages, and a resend of one of those (DUP,
// its original lost with the member it left) must be logged, not taken
// for the released publish and answered with a PUBREC of nothing. A flow
// the device began on this connection is newer and stays.
func (s *Server) applyInboundReleased(se *session, pids []uint16) {
	se.mu.Lock()
	if !se.takesRemoteLocked() {
		se.mu.Unlock()
		return
	}
	var gone []uint16
	for _, p := range pids {
		in := se.inbound[p]
		if in == nil || (se.conn != nil && se.sentHereLocked(in)) {
			continue
		}
		delete(se.inbound, p)
		gone = append(gone, p)
	}
	id, persist := se.id, se.persistent()
	se.mu.Unlock()
	s.inflight.Add(-int64(len(gone)))
	if persist {
		for _, p := range gone {
			s.stageDelete(qos2Key(id, p))
		}
	}
}

// sentHereLocked reports whether in, an entry of the inbound table, is a
// publish the device sent on its current connection here: its record was
// taken after that connection's start record. Called with se.mu held.
func (se *session) sentHereLocked(in *inbound2) bool {
	return in.origin == se.srv.cfg.NodeID && se.startSeq != startComing && in.seq > se.startSeq
}

// awaitStart holds a QoS 2 resend (DUP) that a resumed session's
// connection reads before its start record is applied here, until it is:
// only then has this member applied every publish the device had logged
// on the member it left (log order makes the start record a barrier), and
// the inbound table tells a resend of one of them (PUBREC, not logged
// again: noteInbound) from a publish that never reached the log (logged
// now). Decided earlier, a resend whose original this member had not
// applied yet was logged a second time, and delivered twice. The read
// loop waits, as a 3.1.1 client past max_inflight makes it wait (room),
// so the publishes after the resend keep their order; a resend comes
// right after a reconnect, when the start record is one commit away. On a
// log no other member shares nothing is awaited. False: the connection
// ended meanwhile.
func (c *conn) awaitStart() bool {
	if !c.srv.clustered() {
		return true
	}
	c.amu.Lock()
	defer c.amu.Unlock()
	for !c.closedAcks && c.sess.awaitingStartOf(c) {
		c.acond.Wait()
	}
	return !c.closedAcks
}

// awaitingStartOf reports whether c's session waits for the start record
// of c, its current connection.
func (se *session) awaitingStartOf(c *conn) bool {
	se.mu.Lock()
	defer se.mu.Unlock()
	return se.conn == c && se.awaitingStartLocked()
}

// startReached wakes a resend waiting for the start record (awaitStart):
// it was applied, or will not be awaited.
func (c *conn) startReached() {
	c.amu.Lock()
	c.acond.Broadcast()
	c.amu.Unlock()
}

// mayHaveLocked reports whether the client of a resumed session may hold
// it, a QoS 1 or 2 record, already: one committed before the session's
// start record here (startIndex; 0 until it is applied) may have been sent
// by the member the device came from. Such a delivery goes with DUP set
// [MQTT-3.3.1-1]: "might be re-delivery"; for QoS 2 the client's state
// then decides whether it is new (the packet id is the record's, as the
// other member's was), for QoS 1 it tells the device that a message it
// may have seen before comes again (at least once). Called with se.mu
// held.
func (se *session) mayHaveLocked(it *outItem) bool {
	return it.qos > 0 && it.idx > 0 && se.resumed && (se.startIndex == 0 || it.idx < se.startIndex)
}

// Inbound QoS 2 resends whose original commits late (feature level 4).
//
// A device whose gateway died resends (DUP) on the member it moves to the
// QoS 2 publishes it has no PUBREC for. That member answers the resend of
// one it has applied with PUBREC and logs nothing (noteInbound,
// awaitStart). But the original may commit only after the device's start
// record there: its proposal was still on its way from the member the
// device left. The new member then logs the resend, and the log holds the
// message twice. Every member must deliver it once, deciding alike, in
// log order, from the records alone.
//
// The member that logs such a resend first logs a session record
// "resend" naming its packet id and the resend's sequence number, when
// every member applies this rule (ResendRules). Each session keeps, from
// its latest start record on, a window (resendWindow): the resends named,
// those applied, and the packet ids of late records, QoS 2 publishes of
// an older connection of the device applied after that start record. A
// late record and a resend of the same packet id in one window are the
// same message: a device holds one flow per packet id, and a late record
// is one it cannot have had a PUBREC for (its PUBREC waits until the
// record is on the master's disk, where the start record that came after
// it in time is appended after it), so the device resent it. Whichever of
// the two comes second in the log is a duplicate (inboundDup): not
// delivered, not retained, skipped by replays (holds: recDup), on every
// member; except that an original taken under a sync rule and not yet
// settled gives way to the resend that follows it (demoteHeld), since a
// settlement may still abort it. A deposed master's tail re-published (Republished) is left
// out: it may hold a publish the device had a PUBREC for and whose packet
// id it has reused since, which must not be taken for a duplicate; the
// resend of one it had no PUBREC for is delivered twice.

// ResendRules is implemented by a log whose members may all apply the
// rule above; a log that does not implement it logs no "resend" record.
type ResendRules interface {
	// InboundResends reports whether every member delivers a resend
	// and its late original once (feature level 4 or above).
	InboundResends() bool
}

// resendMarks reports whether a resend of an unknown packet id is to be
// named by a "resend" record: the log is shared and every member applies
// the rule.
func (s *Server) resendMarks() bool {
	r, ok := s.log.(ResendRules)
	return ok && r.InboundResends() && s.clustered()
}

// resendWindow is a session's inbound QoS 2 window since its latest
// start record applied here, taken on member origin with sequence number
// seq.
type resendWindow struct {
	origin, seq uint64
	resends     map[uint16]uint64 // packet id → sequence number of the resend named
	resent      map[uint16]bool   // resends applied
	late        map[uint16]uint64 // packet id → index of the late record applied
}

// windowOp applies session record op, taken on member origin with
// sequence number seq, to the window of client id's session here: a start
// record opens a new one, a "resend" record of the member the start
// record came from names a resend to come. Called with s.mu held.
func (s *Server) windowOp(id string, origin, seq uint64, op *sessionOp) {
	se := s.sessions[id]
	if se == nil {
		return
	}
	se.mu.Lock()
	switch op.Op {
	case "start":
		se.win = &resendWindow{origin: origin, seq: seq}
	case "resend":
		w := se.win
		if w == nil || origin != w.origin || seq < w.seq || len(op.In) != 1 {
			se.mu.Unlock()
			return
		}
		if w.resends == nil {
			w.resends = map[uint16]uint64{}
		}
		w.resends[op.In[0]] = op.Seq
	default:
		se.mu.Unlock()
		return
	}
	rec, persist := se.win.record(), se.persistent()
	se.mu.Unlock()
	if persist {
		s.stageJSON(windowKey(id), rec)
	}
}

// windowRec is a resendWindow as the session store keeps it: a member
// restarted within a device's move decides as the others do.
type windowRec struct {
	O, S uint64            // origin and sequence number of the start record
	R    map[uint16]uint64 `json:",omitempty"`
	D    []uint16          `json:",omitempty"`
	L    map[uint16]uint64 `json:",omitempty"`
}

// record is w as the store keeps it.
func (w *resendWindow) record() windowRec {
	rec := windowRec{O: w.origin, S: w.seq, R: maps.Clone(w.resends), L: maps.Clone(w.late)}
	for p := range w.resent {
		rec.D = append(rec.D, p)
	}
	return rec
}

// window is the resendWindow rec keeps.
func (rec *windowRec) window() *resendWindow {
	w := &resendWindow{origin: rec.O, seq: rec.S, resends: rec.R, late: rec.L}
	for _, p := range rec.D {
		setFlag(&w.resent, p)
	}
	return w
}

// inboundDup reports whether m, the QoS 2 publish at index, is the second
// of a resend and its late original in its session's window, and notes it
// a duplicate then (markDup).
func (s *Server) inboundDup(index uint64, m *Message) bool {
	if m.QoS != 2 || m.PacketID == 0 || m.Will || m.Republished {
		return false
	}
	s.mu.Lock()
	se := s.sessions[m.ClientID]
	s.mu.Unlock()
	if se == nil {
		return false
	}
	p, dup, changed := m.PacketID, false, false
	var demote uint64
	var rec windowRec
	se.mu.Lock()
	if w := se.win; w != nil {
		if m.Origin == w.origin && m.Seq > w.seq {
			if rs, ok := w.resends[p]; ok && rs == m.Seq {
				if late := w.late[p]; late > 0 {
					// The original came first. Taken under a sync
					// rule, it may still be aborted (its publisher,
					// gone, refused): the resend, acked to the
					// device, must not go with it. Not settled yet,
					// the original gives way; aborted, the resend
					// stands; confirmed (or async), it is the copy.
					switch s.holds.state(late, nil) {
					case recHeld:
						demote = late
					case recAborted, recDup:
					default:
						dup = true
					}
				}
				setFlag(&w.resent, p)
				changed = true
			}
		} else {
			dup = w.resent[p]
			if w.late == nil {
				w.late = map[uint16]uint64{}
			}
			w.late[p] = index
			changed = true
		}
		if changed {
			rec = w.record()
		}
	}
	persist := se.persistent()
	se.mu.Unlock()
	if changed && persist {
		s.stageJSON(windowKey(m.ClientID), rec)
	}
	if demote > 0 {
		s.demoteHeld(demote)
		s.lines.Info("a QoS 2 publish resent by its device and logged twice is delivered once", "client", m.ClientID, "packet_id", p, "index", demote)
	}
	if dup {
		s.markDup(index)
		s.lines.Info("a QoS 2 publish resent by its device and logged twice is delivered once", "client", m.ClientID, "packet_id", p, "index", index)
	}
	return dup
}

// resendDeliveredLocked reports, for the resend in (a DUP of packet id p,
// unknown here, logged again) whose proposal failed, the index of its
// late original when that is the message, 0 otherwise. By the window rule
// the two are one message, so the device must not be told "refused"
// (DESIGN.md: a publisher told so never sees its message delivered)
// while the original is delivered: it gets the PUBREC, and its PUBREL
// completes the flow. The original counts when it was applied in the
// resend's window and is free: confirmed, or async; not aborted, nor a
// duplicate (the resend, in the log after all and applied first, took
// its place). When it is still held (a settlement may still abort it),
// held is true and o, the resend's outcome, waits for the settlement
// (holds.pending, inAck.settled).
//
// Decided at the failure, from what is applied here by then: an original
// applied only later is delivered although the device was told "refused"
// (not covered). A resend that reached the log after all (its ack rule
// timed out with the record in it) comes after an original applied
// before the failure, and, named by its "resend" record, is that one's
// copy (inboundDup), or, the original held, its stand-in (demoteHeld).
// Called with se.mu held.
func (se *session) resendDeliveredLocked(p uint16, in *inbound2, o heldOutcome) (late uint64, held bool) {
	w := se.win
	if w == nil || in.origin != w.origin || in.seq <= w.seq {
		return 0, false // not in this window: the device's connection here is gone
	}
	late = w.late[p]
	if late == 0 {
		return 0, false
	}
	switch se.srv.holds.stateOrWait(late, o) {
	case recFree:
		return late, false
	case recHeld:
		return late, true
	}
	return 0, false
}

// setFlag sets p in *m, made on first use.
func setFlag(m *map[uint16]bool, p uint16) {
	if *m == nil {
		*m = map[uint16]bool{}
	}
	(*m)[p] = true
}

// clustered reports whether other members share the log (Clustered).
func (s *Server) clustered() bool {
	c, ok := s.log.(Clustered)
	return ok && c.OtherMembers()
}
