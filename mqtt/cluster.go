package mqtt

import (
	"encoding/json"
	"errors"
	"strings"
	"sync/atomic"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
)

// Persistent sessions across the cluster.
//
// A persistent session's life is written into the log as small records of
// its own, of KindSession, so that every member that applies the
// log holds the session too: its start (user, expiry, clean start), its
// subscriptions, its going offline, its end, and, in batches, its cursor.
// A device whose gateway died, or that simply connects elsewhere, finds its
// session there: session present, the same subscriptions, and the records
// its filters match from the last replicated cursor on. Log indexes are the
// same on every member, so a cursor means the same everywhere.
//
// The member where the session lives applies its own records as no-ops
// (it has the state already); the others apply them to an offline copy.
// The record's kind says what it is (the log keeps it in the header); the
// topics below only name them, as builds before record kinds logged them,
// and clients can neither subscribe nor publish to them.
const (
	sessionTopic = "$tandem/session" // KindSession; ClientID names the session
	cursorTopic  = "$tandem/cursors" // KindCursors, by session ref or client id (cursors.go)
	controlPref  = "$tandem/"
)

// sessionOp is the payload of a session record.
type sessionOp struct {
	Op     string `json:"op"` // start, sub, unsub, off, end
	User   string `json:"user,omitempty"`
	Expiry uint32 `json:"expiry,omitempty"`
	Clean  bool   `json:"clean,omitempty"`
	Filter string `json:"f,omitempty"`
	QoS    byte   `json:"q,omitempty"`
	NL     bool   `json:"nl,omitempty"`
	RAP    bool   `json:"rap,omitempty"`
	RH     byte   `json:"rh,omitempty"`
	ID     int    `json:"id,omitempty"`
	// Rel lists the log indexes of QoS 2 deliveries the client has
	// PUBREC'd: on another member they are PUBREL'd, never sent again.
	Rel []uint64 `json:"rel,omitempty"`
	// Seq is, in a "resend" record, the sequence number of the record of
	// the resent publish, which follows it from the same member; In names
	// its packet id (qos2.go: inboundDup).
	Seq uint64 `json:"seq,omitempty"`
	// In lists the packet ids of inbound QoS 2 flows the device
	// released (PUBREL) on the member that logged it ("irel"): another
	// member forgets them, so that the device, free to reuse an id once
	// it has the PUBCOMP, is never taken for resending the old publish.
	In []uint16 `json:"in,omitempty"`
}

// IsSessionTopic reports whether a record's topic is that of the session
// records.
func IsSessionTopic(topic string) bool { return topic == sessionTopic }

// IsServingRecord reports whether a session record, by its topic and
// payload, is one a device cannot be served without on a member of a
// cluster, which a master takes while its log is over its budget: a
// resumed session's start record (proposeStart), one per CONNECT, the
// release record of QoS 2 deliveries (releaseNext), whose PUBRELs wait for
// it: refused, the connection ends (released), and the release record of
// an inbound QoS 2 flow, whose PUBCOMP waits for it (pubrel). A release
// names flows the device PUBREC'd, deliveries of records the log holds
// already, each at most once a connection, many to a record; an inbound
// release names a publish the log holds already.
func IsServingRecord(topic string, payload []byte) bool {
	if topic != sessionTopic {
		return false
	}
	var op sessionOp
	return json.Unmarshal(payload, &op) == nil && (op.Op == "start" || op.Op == "rel" || op.Op == "irel")
}

// isControl reports whether a topic is one of the cluster's own records.
func isControl(topic string) bool { return strings.HasPrefix(topic, controlPref) }

// proposeSession logs op for client id. Nobody waits for it: the session
// is live here already, and the record only tells the other members.
func (s *Server) proposeSession(id string, op sessionOp) {
	s.proposeOp(id, op, Async, s.logFailure)
}

// proposeOp logs op as client id's session record under mode; done gets
// the outcome.
func (s *Server) proposeOp(id string, op sessionOp, mode AckMode, done func(error)) {
	b, _ := json.Marshal(op) // a struct of strings and numbers: cannot fail
	s.proposeRecord(KindSession, id, b, mode, DoneFunc(done))
}

// proposeSessionOps logs ops for client id, in order, and calls then once
// every one is logged (at once when there are none): a SUBACK or UNSUBACK
// waits for them, so a device told it is subscribed finds the subscription
// on any member it moves to, even from a slave whose master takes the
// records. A record that could not be logged is logged about; the answer
// goes anyway, the subscription being in force here.
func (s *Server) proposeSessionOps(id string, ops []sessionOp, then func()) {
	if len(ops) == 0 {
		then()
		return
	}
	var left atomic.Int32
	left.Store(int32(len(ops)))
	for _, op := range ops {
		s.proposeOp(id, op, Async, func(err error) {
			if err != nil {
				s.lines.Warn("subscription record not logged: the other members may not know it", "client", id, "error", err)
			}
			if left.Add(-1) == 0 {
				then()
			}
		})
	}
}

// proposeControl logs one of the cluster's own records; nobody waits for it.
func (s *Server) proposeControl(kind Kind, client string, payload []byte) {
	s.proposeRecord(kind, client, payload, Async, DoneFunc(s.logFailure))
}

// proposeRecord logs a record of the cluster's own under mode.
func (s *Server) proposeRecord(kind Kind, client string, payload []byte, mode AckMode, done Done) {
	topic := sessionTopic
	if kind == KindCursors {
		topic = cursorTopic
	}
	m := &Message{Kind: kind, ClientID: client, Topic: topic, Payload: payload, Time: s.cfg.Now().UnixNano()}
	s.log.Reserve(m)
	s.log.Propose(m, mode, done)
}

// proposeOpTo logs op as client id's session record under mode, its
// outcome to done.
func (s *Server) proposeOpTo(id string, op sessionOp, mode AckMode, done Done) {
	b, _ := json.Marshal(op) // a struct of strings and numbers: cannot fail
	s.proposeRecord(KindSession, id, b, mode, done)
}

// applyControl applies a committed session or cursor record; it runs on
// the applier, in log order.
func (s *Server) applyControl(index uint64, m *Message) {
	s.followCounts() // sessions' counts change here
	switch m.Kind {
	case KindSession:
		var op sessionOp
		if err := json.Unmarshal(m.Payload, &op); err != nil {
			s.unreadable(index, "session", err)
			return
		}
		s.applySession(index, m.ClientID, m.Origin, m.Seq, &op)
	case KindCursors:
		b, err := decodeCursors(m.Payload)
		if err != nil {
			// Read on its origin too, so that every member counts
			// the same records skipped.
			s.unreadable(index, "cursors", err)
			return
		}
		if m.Origin != s.cfg.NodeID {
			s.applyCursors(b)
		}
	}
}

// unreadable reports a control record it skips: the member goes on
// serving (DESIGN.md, "The record").
func (s *Server) unreadable(index uint64, kind string, err error) {
	if f := s.cfg.Unreadable; f != nil {
		f(index, kind, err)
		return
	}
	s.lines.Warn("control record unreadable: skipped", "index", index, "kind", kind, "error", err)
}

// applySession applies one session record, taken on member origin with
// sequence number seq. On that member (own) the session is live, and the
// record is only the moment it took effect cluster-wide; the inbound QoS 2
// window (resendWindow) is kept alike on every member.
func (s *Server) applySession(index uint64, id string, origin, seq uint64, op *sessionOp) {
	s.mu.Lock()
	defer s.mu.Unlock()
	own := origin == s.cfg.NodeID
	defer s.windowOp(id, origin, seq, op)
	se := s.sessions[id]
	if own {
		if op.Op == "start" && se != nil {
			se.mu.Lock()
			if se.startSeq == 0 || se.startSeq == seq {
				se.startIndex = index
			}
			c, keep := se.conn, se.persistent() && !se.ended
			se.mu.Unlock()
			s.setRefLocked(se, index)
			if keep {
				s.saveSession(se) // with its ref
			}
			if c != nil {
				c.startReached() // a resend waited for this (awaitStart)
				c.kick()         // its replay waited for this (awaitingStartLocked)
			}
		}
		return
	}
	switch op.Op {
	case "start":
		if se != nil {
			se.mu.Lock()
			local, mine := se.conn, se.startIndex
			se.mu.Unlock()
			if local != nil {
				if mine > 0 && mine < index {
					// The device connected elsewhere after it connected
					// here: the later connection wins, cluster-wide.
					local.end(codeTakenOver)
				} else {
					// This connection is the later one: its start comes
					// after. A clean start before it wiped the session
					// this one resumes.
					if op.Clean {
						s.startedOverLocked(se, index)
					}
					return
				}
			}
			if op.Clean {
				s.endSessionLocked(se, false)
				se = nil
			}
		}
		if se == nil {
			se = newSession(s, id)
			// Nothing in the log before its start is for it.
			se.cursor, se.scanned, se.sentCursor = index, index, index
			s.sessions[id] = se
		}
		se.mu.Lock()
		se.user, se.expiry, se.remoteOnline = op.User, op.Expiry, true
		se.expireAt = time.Time{}
		s.recountLocked(se)
		se.mu.Unlock()
		s.setRefLocked(se, index)
		s.saveSession(se)
		s.saveCursor(se)
	case "sub", "unsub":
		if se != nil {
			s.applySub(index, se, op)
		}
	case "off":
		if se == nil || se.current() != nil {
			return
		}
		se.mu.Lock()
		se.remoteOnline = false
		if se.expiry > 0 && se.expiry != 0xFFFFFFFF {
			se.expireAt = time.Now().Add(time.Duration(se.expiry) * time.Second)
		}
		se.mu.Unlock()
	case "end":
		if se == nil {
			return
		}
		if se.current() == nil {
			s.endSessionLocked(se, false)
			return
		}
		// Live here: an end before its start record in log order ended
		// the session this connection resumes. One after it comes from
		// a member that had not applied that record yet: the
		// connection here is the session's latest, and stays.
		s.endedBeforeStartLocked(se)
	case "rel":
		if se != nil {
			s.applyReleased(se, op.Rel)
		}
	case "irel":
		if se != nil {
			s.applyInboundReleased(se, op.In)
		}
	}
}

// endedBeforeStartLocked takes into se, live here and waiting for its
// start record, another member's end of the session: log order puts it
// before this connection's start record, so the session the device
// resumed here was gone before it came, and its CONNACK said "session
// present" wrongly. A device told so keeps what it believes the session
// holds and subscribes to nothing again: served from an empty session,
// it would silently get nothing its old subscriptions match. Only a new
// CONNACK sets that right: the session ends here and, by an end record
// after the start record, everywhere, and the connection ends, without
// its will (the device is not gone, it is sent to connect again), so that
// the device comes back to no session, is told so, and subscribes again.
// Called with s.mu held, not se.mu.
func (s *Server) endedBeforeStartLocked(se *session) {
	se.mu.Lock()
	c := se.conn
	waiting := c != nil && se.awaitingStartLocked()
	se.mu.Unlock()
	if !waiting {
		return
	}
	c.noWill.Store(true)
	s.endSessionLocked(se, true)
	s.lines.Info("a resumed session had ended on another member before this connection's start: the device is sent to connect again", "client", se.id)
	c.endTo(packets.ErrUnspecifiedError, "", "the session ended on another member before this connection resumed it: connect again")
}

// startedOverLocked takes into se, live here and waiting for its start
// record (awaitingStartLocked), another member's clean start or end of
// the session at index: log order puts it before this connection's start
// record, so the session the device resumes here is the one that record
// left, empty from index on, and other members, applying the same records,
// hold that. Without this, this member would keep serving subscriptions
// and resending flows the log says are gone. What the device did on this
// connection is newer and stays: the filters it named here (namedHere),
// and the QoS 2 publishes it sent here (their records come after its start
// record). Its CONNACK said the session was present: its state is
// replaced, not the answer. Called with s.mu held, not se.mu.
func (s *Server) startedOverLocked(se *session, index uint64) {
	se.mu.Lock()
	if se.conn == nil || !se.awaitingStartLocked() {
		se.mu.Unlock()
		return
	}
	var gone []*subscription
	for f, sub := range se.subs {
		if !se.namedHere[f] {
			gone = append(gone, sub)
			delete(se.subs, f)
		}
	}
	var outs, ins []uint16
	for p, it := range se.inflight {
		se.landedLocked(it)
		outs = append(outs, p)
	}
	for p, in := range se.inbound {
		if se.sentHereLocked(in) {
			continue // sent on this connection
		}
		ins = append(ins, p)
		delete(se.inbound, p)
	}
	s.inflight.Add(-int64(len(outs) + len(ins)))
	se.inflight = map[uint16]*outItem{}
	se.relPending, se.releasing, se.doneAbove = nil, nil, nil
	// Nothing in the log before it is for the session it left; the
	// replay, held until the start record, reads on from there.
	se.cursor, se.scanned, se.sentCursor = index, index, index
	s.recountLocked(se)
	persist := se.persistent()
	se.mu.Unlock()
	for _, sub := range gone {
		s.index.remove(se, sub)
		s.stageDelete(subKey(se.id, sub.filter))
	}
	for _, p := range outs {
		s.stageDelete(outKey(se.id, p))
	}
	for _, p := range ins {
		s.stageDelete(qos2Key(se.id, p))
	}
	if persist {
		s.saveCursor(se)
	}
}

// applySub takes another member's subscribe or unsubscribe record into
// the copy of the session here while it takes remote records
// (takesRemoteLocked): offline, or back here and waiting for its start
// record, before which the device's subscriptions on the member it left
// are still being applied (a follower learns the commit index from the
// next master) and must be in force before its replay reads the log. A
// filter the device has named here since it came keeps what it did
// here, which is the newer.
func (s *Server) applySub(index uint64, se *session, op *sessionOp) {
	se.mu.Lock()
	if !se.takesRemoteLocked() || se.namedHere[op.Filter] {
		se.mu.Unlock()
		return
	}
	old := se.subs[op.Filter]
	if op.Op == "unsub" {
		delete(se.subs, op.Filter)
		s.recountLocked(se)
		se.mu.Unlock()
		if old != nil {
			s.index.remove(se, old)
			s.stageDelete(subKey(se.id, op.Filter))
		}
		return
	}
	sub := &subscription{filter: op.Filter, qos: op.QoS, noLocal: op.NL, rap: op.RAP, rh: op.RH, id: op.ID, since: index}
	sub.group, sub.match, _, _ = parseShare(op.Filter)
	if old != nil {
		sub.since = old.since
	}
	se.subs[op.Filter] = sub
	s.recountLocked(se)
	se.mu.Unlock()
	if old != nil {
		s.index.remove(se, old)
	}
	s.index.add(se, sub)
	s.saveSub(se.id, sub)
}

// namedLocked notes that the client named filter in a SUBSCRIBE or
// UNSUBSCRIBE on this connection, while the session waits for its start
// record (applySub). Called with s.mu held.
func (s *session) namedLocked(filter string) {
	if !s.awaitingStartLocked() {
		return
	}
	if s.namedHere == nil {
		s.namedHere = map[string]bool{}
	}
	s.namedHere[filter] = true
}

// ackedCursorLocked is the cursor another member may resume the session
// from: below every message handed out here and not yet acknowledged,
// which the device may never have got. Called with se.mu held.
func (se *session) ackedCursorLocked() uint64 {
	cur := se.cursor
	for _, it := range se.inflight {
		if it.idx > 0 && it.idx-1 < cur {
			cur = it.idx - 1
		}
	}
	return cur
}

// replicateCursors logs, in one record, the cursors of the persistent
// sessions live here that moved since the last batch: after a failover
// their devices are handed again at most what was delivered since.
func (s *Server) replicateCursors() {
	legacy := s.legacyControl()
	b := &cursorBatch{byRef: map[uint64]uint64{}, byID: map[string]uint64{}}
	s.mu.Lock()
	for id, se := range s.sessions {
		se.mu.Lock()
		// A session that connected here and whose start record is not
		// applied yet waits for it: the other members start their copy
		// at that record, and name it by it from then on.
		pending := se.conn != nil && se.startIndex == 0 && !se.startFailed
		if cur := se.ackedCursorLocked(); se.persistent() && cur > se.sentCursor && !pending {
			if legacy || se.ref == 0 {
				b.byID[id] = cur // its start record not logged, or not read as a ref everywhere
			} else {
				b.byRef[se.ref] = cur
			}
			se.sentCursor = cur
		}
		se.mu.Unlock()
	}
	s.mu.Unlock()
	if b.empty() {
		return
	}
	if legacy {
		p, err := json.Marshal(b.byID)
		if err == nil {
			s.proposeControl(KindCursors, "", p)
		}
		return
	}
	s.proposeControl(KindCursors, "", encodeCursors(b))
}

// proposeStart logs the start record of se, a persistent session that just
// connected here on c. A resumed session replays the log only once that
// record is applied here (awaitingStartLocked). When it cannot be logged
// (no master, the log full, a failing disk) and other members share the
// log, nothing tells this member that it has applied what the member the
// device left logged for the session: a replay, or a resend, could send
// again a QoS 2 message whose flow the device completed there, or miss
// what it subscribed to. So the device is not served from that state: its
// CONNECT is refused, or, once it has its CONNACK, the connection ends
// (startNotLogged), and it connects again, here once the log takes records
// or elsewhere. Its session stays as it was. On a lone gateway nobody else
// could have logged anything for it: it goes on without the record.
func (s *Server) proposeStart(se *session, c *conn, op sessionOp) {
	b, _ := json.Marshal(op) // a struct of strings and numbers: cannot fail
	m := &Message{Kind: KindSession, ClientID: se.id, Topic: sessionTopic, Payload: b, Time: s.cfg.Now().UnixNano()}
	s.log.Reserve(m)
	se.mu.Lock()
	if se.conn == c {
		se.startSeq = m.Seq
	}
	se.mu.Unlock()
	s.log.Propose(m, Async, DoneFunc(func(err error) {
		if err == nil {
			return
		}
		se.mu.Lock()
		if se.conn != c {
			se.mu.Unlock()
			return // gone; a later connection has its own start record
		}
		barrier := se.awaitingStartLocked() && s.clustered()
		if !barrier {
			se.startFailed = true
		}
		se.mu.Unlock()
		if barrier {
			c.startNotLogged(err)
			return
		}
		s.lines.Warn("session start record not logged: replaying without it", "client", se.id, "error", err)
		c.startReached()
		c.kick()
	}))

}

// startNotLogged ends the connection of a resumed session whose start record
// could not be logged (proposeStart): before its CONNACK, the CONNECT is
// refused (connect reads startErr); after, it ends with a DISCONNECT: 0x97
// when the log refused the record for space (as a publish is), 0x9C with
// the member to use when this one is sending devices away, else 0x89.
func (c *conn) startNotLogged(err error) {
	c.notLogged(err, "start")
}

// notLogged ends c, whose session cannot be served without a record that
// could not be logged (what names its op, for the log line), as
// startNotLogged says.
func (c *conn) notLogged(err error, what string) {
	c.wmu.Lock()
	if !c.connacked {
		c.startErr = err
		c.wmu.Unlock()
		return
	}
	c.wmu.Unlock()
	code5, why := startRefusal(err)
	c.srv.refusal(c.id, why+": disconnected", "client", c.id, "record", what, "error", err)
	if r := c.srv.redirect.Load(); r != nil && !errors.Is(err, ErrQuota) {
		c.endRedirected(r)
		return
	}
	if code5 == packets.ErrServerUnavailable {
		code5 = packets.ErrServerBusy // 0x88 is a CONNACK's only
	}
	c.endTo(code5, "", why)
}

// startRefusal is the reason code and words a device gets when a record
// the session it resumes needs (its start, a release) cannot be logged.
func startRefusal(err error) (packets.Code, string) {
	if errors.Is(err, ErrQuota) {
		return packets.ErrQuotaExceeded, "the log takes no records now: the session cannot be resumed here yet"
	}
	return packets.ErrServerUnavailable, "the session's state could not be logged: connect again"
}

// startComing is session.startSeq while the start record of a connection
// is yet to be proposed: no start record applied meanwhile is its.
const startComing = ^uint64(0)

// awaitingStartLocked reports whether a resumed session must wait before
// it replays the log: until its start record is applied here, this member
// may not have applied all that the cluster committed before the device
// came (a follower learns the commit index from the next master), such as
// the release records of QoS 2 flows the device finished on the member it
// came from, which must not be sent again. Log order makes the start
// record a barrier: what was committed before it is applied before it.
// Called with se.mu held.
func (se *session) awaitingStartLocked() bool {
	return se.resumed && se.startIndex == 0 && !se.startFailed
}

// awaitingStart is awaitingStartLocked for a caller without se.mu.
func (se *session) awaitingStart() bool {
	se.mu.Lock()
	defer se.mu.Unlock()
	return se.awaitingStartLocked()
}
