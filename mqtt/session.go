package mqtt

import (
	"sort"

	"github.com/mochi-mqtt/server/v2/packets"
	"sync"
	"sync/atomic"
	"time"
)

// session is the state MQTT keeps for a client id across connections:
// its subscriptions, its cursor into the log, the messages handed to it
// and not yet acknowledged (by packet id, from its own id space), and the
// QoS 2 publishes it sent whose PUBREL has not come (a separate space: the
// two directions' ids are independent). It lives while its client is
// connected and, when the client asked for it, for its expiry after.
//
// The applier offers it records under mu and never waits for it; the
// connection's writer takes them out under mu and writes them. Nothing
// under mu blocks.
type session struct {
	srv *Server
	id  string
	on  atomic.Bool // a connection is attached: share groups pick among these

	mu   sync.Mutex // guards everything below
	conn *conn      // nil while offline
	user string     // the user who made it: nobody else may take it over
	// expiry is how long the session outlives its connection, in seconds
	// (0: it ends with it; 0xFFFFFFFF: never); expireAt, while offline,
	// is when it ends.
	expiry   uint32
	expireAt time.Time
	ended    bool // removed from the server

	subs map[string]*subscription // by filter as subscribed

	// cursor is the log index up to which every matching record has been
	// handed out; scanned is how far a replay has read the log (records
	// between cursor and scanned are in queue).
	cursor, scanned uint64
	savedCursor     uint64 // the cursor last written to the store
	sentCursor      uint64 // the cursor last logged for the other members
	// startIndex is where this member's own start record of the session
	// was applied (0: not yet): a start from elsewhere after it means the
	// device connected there later. remoteOnline: the session is live on
	// another member, so it does not expire here.
	startIndex uint64
	// startSeq is the sequence number of the start record this member
	// logged for the session's current connection: only that one is its
	// start (an earlier connection's, applied late, is not the barrier
	// awaitingStartLocked waits for); startComing until it is proposed.
	startSeq    uint64
	startFailed bool // the start record could not be logged, and need not be (proposeStart): replay without it
	// ref is the number cursor records name the session by (cursors.go):
	// the index of its latest start record, when applied at a feature
	// level every member keeps it at; 0: none, named by its client id.
	// Written with srv.mu and mu held.
	ref          uint64
	remoteOnline bool
	// queue holds what was offered and not yet handed out, oldest first.
	queue []*outItem
	// behind means the queue overflowed or the client was offline:
	// records past cursor are read from the log, not offered; more says a
	// record was offered meanwhile, so a replay that reached the end must
	// look again.
	behind, more bool
	// owed are the retained messages new subscriptions are owed, queued
	// as the queue has room (outbudget.go); while any are, offers go to
	// the log, so a subscription's retained messages come before what is
	// published after it.
	owed []*retainedOwed
	// queueBytes, flightBytes and owedBytes are what the queue, the
	// in-flight messages and owed hold, charged to the memory account
	// while the client is connected.
	queueBytes, flightBytes, owedBytes int64

	inflight map[uint16]*outItem // handed out, awaiting PUBACK / PUBREC / PUBCOMP
	nextPID  uint16
	sendSeq  uint64 // orders inflight for a resend

	inbound map[uint16]*inbound2 // QoS 2 publishes received, awaiting PUBREL

	// relPending are the log indexes of QoS 2 deliveries the client has
	// PUBREC'd whose release record is not yet proposed; relBusy says one
	// is in flight. Their PUBRELs wait for it (qos2.go). releasing holds
	// every index of either whose record's outcome has not come: no
	// PUBREL goes for them, neither on a repeated PUBREC nor in the
	// resend of a reconnect, until it is logged (released sends them; a
	// record that failed puts them back in relPending).
	relPending []uint64
	relBusy    bool
	releasing  map[uint64]bool
	// resumed: the session was present at its connection's CONNECT, so
	// the client may hold some of its QoS 2 records already (mayHave).
	resumed bool
	// namedHere are the filters the client subscribed or unsubscribed on
	// this connection while it waited for its start record: what another
	// member logged for them then is older (applySession).
	namedHere map[string]bool
	// doneAbove holds the indexes past the cursor whose QoS 2 flow ended
	// here anyway: flows taken over from another member (applyReleased),
	// completed before the replay reached them, which must skip them.
	doneAbove map[uint64]bool

	// win is the inbound QoS 2 window of the session's latest start
	// record applied here (inboundDup); nil until one is.
	win *resendWindow

	dropped uint64 // log positions retention took before this session was handed them
	bytes   int64  // counted in srv.sessionBytes (sessionbytes.go)
}

// outItem is one message for a session: a committed record (idx > 0) or a
// retained message sent on subscribe (idx 0).
type outItem struct {
	idx    uint64
	m      *Message
	qos    byte
	retain bool
	ids    []int // subscription identifiers
	pid    uint16
	rel    bool   // QoS 2: PUBREC received, PUBREL sent, PUBCOMP awaited
	seq    uint64 // send order
	cost   int64  // charged to the memory account while queued or in flight (0: nothing)
}

// inbound2 is a QoS 2 publish received and proposed: its PUBREC goes out
// once the record meets its ack rule, and the id stays taken until PUBREL.
type inbound2 struct {
	origin, seq uint64 // the record's id
	done        bool
	err         error
	waiting     []*inAck // resends answered with this publish's outcome
}

func newSession(srv *Server, id string) *session {
	return &session{srv: srv, id: id, subs: map[string]*subscription{},
		inflight: map[uint16]*outItem{}, inbound: map[uint16]*inbound2{}}
}

func (s *session) online() bool { return s.on.Load() }

func (s *session) current() *conn {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.conn
}

func (s *session) persistent() bool { return s.expiry > 0 }

// offer hands the session a record the applier matched to it. A session
// offline, behind, or whose queue is full reads it from the log later;
// QoS 0 is not read back (matchReplay): a connected session drops it, and
// counts it.
func (s *session) offer(it *outItem) {
	s.mu.Lock()
	c := s.conn
	switch {
	case c == nil:
		// Offline: the log has it for the replay at reconnect.
		s.mu.Unlock()
		return
	case it.idx <= s.scanned:
		// A replay has it already: queued, or skipped if QoS 0.
		s.mu.Unlock()
		if it.qos == 0 {
			s.droppedQoS0()
		}
		return
	case s.behind && it.qos == 0 && it.idx == s.scanned+1 && len(s.owed) == 0 && s.roomLocked(outCost(it.m)):
		// Behind, but with nothing between the replay's reach and this
		// record (a session just connected, before its first replay):
		// a QoS 0 record is queued now, within the queue's bounds, as
		// the replay, which does not read QoS 0 back, would never give
		// it. A replay in progress starts past it.
	case s.behind || len(s.owed) > 0:
		s.behind, s.more = true, true
		// A replay that filled the queue to its bounds leaves the
		// session behind: with queue_full: disconnect, a record that
		// finds it still full ends the connection, as it would have
		// had the queue filled from live records.
		full := it.qos > 0 && !s.roomLocked(outCost(it.m))
		s.mu.Unlock()
		if it.qos == 0 {
			s.droppedQoS0()
		}
		if full && s.srv.cfg.DisconnectWhenQueueFull {
			s.srv.refusal(s.id, "queue full: disconnected", "client", s.id)
			c.end(packets.ErrQuotaExceeded)
			return
		}
		// The writer replays what this session is behind on: woken
		// here, or a session whose first replay has not run yet stays
		// behind with every record offered to it.
		c.kick()
		return
	case !s.roomLocked(outCost(it.m)):
		if it.qos == 0 {
			// Past the queue's bounds: dropped, and the session does
			// not go to the log for it.
			s.mu.Unlock()
			s.droppedQoS0()
			return
		}
		s.behind, s.more = true, true
		s.mu.Unlock()
		if s.srv.cfg.DisconnectWhenQueueFull {
			s.srv.refusal(s.id, "queue full: disconnected", "client", s.id)
			c.end(packets.ErrQuotaExceeded)
			return
		}
		c.kick()
		return
	}
	s.queueLocked(it)
	s.scanned = it.idx
	held := s.heldLocked()
	s.mu.Unlock()
	c.kick()
	s.checkBudget(c, held)
}

// newPIDLocked returns a packet id free in the outbound space.
func (s *session) newPIDLocked() uint16 {
	for {
		s.nextPID++
		if s.nextPID == 0 {
			s.nextPID = 1
		}
		if _, used := s.inflight[s.nextPID]; !used {
			return s.nextPID
		}
	}
}

// resendOrderLocked returns the inflight messages in the order they were
// first sent, for the resend a resumed session owes [MQTT-4.4.0-1].
func (s *session) resendOrderLocked() []*outItem {
	out := make([]*outItem, 0, len(s.inflight))
	for _, it := range s.inflight {
		out = append(out, it)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].seq < out[j].seq })
	return out
}

// acked ends the outbound flow of pid on a PUBACK (qos 1) or PUBCOMP
// (qos 2); it reports whether the flow existed.
func (s *session) acked(pid uint16, qos byte) bool {
	s.mu.Lock()
	it := s.inflight[pid]
	if it == nil || it.qos != qos || (qos == 2 && !it.rel) {
		s.mu.Unlock()
		return false
	}
	delete(s.inflight, pid)
	s.srv.inflight.Add(-1)
	s.landedLocked(it)
	if qos == 2 && it.idx > s.cursor {
		if s.doneAbove == nil {
			s.doneAbove = map[uint64]bool{}
		}
		s.doneAbove[it.idx] = true
	}
	persist := s.persistent()
	s.mu.Unlock()
	if persist {
		s.srv.stageDelete(outKey(s.id, pid))
	}
	return true
}

// received marks a QoS 2 flow as PUBREC'd; ok is false for an id not in
// flight (PUBREL 0x92 then), and ended for a PUBREC with an error code,
// which ends the flow [MQTT-4.3.3-4]. release says the PUBREL waits for a
// release record (a persistent session's delivery of a log record): the
// caller calls releaseNext. A repeated PUBREC of such a flow waits for the
// same record: a PUBREL before it is logged lets the device complete a
// flow that a member taking the session over would send again, as new.
func (s *session) received(pid uint16, failed bool) (ok, release bool) {
	s.mu.Lock()
	it := s.inflight[pid]
	if it == nil || it.qos != 2 {
		s.mu.Unlock()
		return false, false
	}
	if it.rel {
		// A repeated PUBREC: its PUBREL goes again, once released.
		wait := s.releasing[it.idx]
		s.mu.Unlock()
		return true, wait
	}
	persist := s.persistent()
	if failed {
		delete(s.inflight, pid)
		s.srv.inflight.Add(-1)
		s.landedLocked(it)
		s.mu.Unlock()
		if persist {
			s.srv.stageDelete(outKey(s.id, pid))
		}
		return true, false
	}
	it.rel = true
	release = persist && it.idx > 0 && s.srv.clustered()
	if release {
		s.relPending = append(s.relPending, it.idx)
		if s.releasing == nil {
			s.releasing = map[uint64]bool{}
		}
		s.releasing[it.idx] = true
	}
	s.mu.Unlock()
	if persist {
		s.srv.stagePut(outKey(s.id, pid), encodeOut(it))
	}
	return true, release
}

// replay reads the log past scanned for a session that is behind, and
// queues what matches its subscriptions, up to a batch; it clears behind
// once it reaches the end of what the applier has handed the server with
// nothing offered meanwhile. It runs on the connection's writer, and
// reports whether the writer is to go round again: it queued something,
// or the session is still behind.
func (s *session) replay(c *conn) bool {
	const batch = 256
	if c.isEnded() {
		return false // nothing more is queued for a connection that is ending
	}
	s.mu.Lock()
	if s.conn == c && len(s.owed) > 0 {
		// Owed retained messages go first; the writer goes round again
		// to queue them while there is room.
		more := s.owedRoomLocked()
		s.mu.Unlock()
		return more
	}
	if s.conn != c || !s.behind || len(s.queue) > 0 || s.awaitingStartLocked() {
		s.mu.Unlock()
		return false
	}
	// One scan fills the queue at most to its bounds. With queue_full:
	// disconnect it may pass max_queued (not the byte bound): a client
	// that reads nothing must find its queue over it, and be
	// disconnected, rather than stay behind with room for one more.
	maxItems, maxBytes := min(batch, s.srv.cfg.MaxQueued), s.srv.cfg.MaxQueuedBytes
	if s.srv.cfg.DisconnectWhenQueueFull {
		maxItems = batch
	}
	from := s.scanned + 1
	ret, hasRet := s.srv.reader.(Retained)
	if hasRet {
		if first := ret.FirstIndex(); from < first {
			s.droppedLocked(first - from)
			s.scanned = first - 1
			from = first
		}
	}
	s.more = false
	subs := make([]*subscription, 0, len(s.subs))
	for _, sub := range s.subs {
		if sub.group == "" { // a share group's messages go to one live member
			subs = append(subs, sub)
		}
	}
	s.mu.Unlock()
	// Up to what the applier has handed over, not only what it has done
	// with: a record offered while this session is behind is past
	// applied until its Deliver returns, and once more is cleared above
	// nothing else would send this replay to it.
	to := s.srv.handed.Load()
	var items []*outItem
	var bytes int64
	last := from - 1
	full := false
	var lost uint64 // taken by retention while this scan read the log
	if s.srv.reader != nil && from <= to && len(subs) > 0 {
		err := s.srv.reader.Committed(from, to, func(idx uint64, m *Message) bool {
			prevLast, prevLost := last, lost
			if idx > last+1 && hasRet {
				// The log reads on past what retention drops under it: a
				// jump to at or past the new first index lost those
				// positions (other jumps are records that carry no message).
				if first := ret.FirstIndex(); first > last+1 {
					lost += min(idx, first) - (last + 1)
				}
			}
			last = idx
			if s.srv.skipped(idx) {
				return true // delivered here before the rejoin
			}
			if s.srv.skipsForAll(idx, m) {
				return true // its publisher was refused, or it is a resend's second copy
			}
			if it := matchReplay(subs, s.id, idx, m, s.srv.cfg.Now()); it != nil && !s.inFlight(it) {
				cost := outCost(m)
				if len(items) > 0 && bytes+cost > maxBytes {
					// Not taken: the next scan starts at it.
					last, lost, full = prevLast, prevLost, true
					return false
				}
				items = append(items, it)
				bytes += cost
			}
			full = len(items) >= maxItems
			return !full
		})
		if err != nil {
			s.srv.lines.Error("reading the log for a session failed", "client", s.id, "error", err)
			return false // behind stays: the next wake tries again
		}
	}
	if !full {
		last = max(last, to)
	}
	if c.isEnded() {
		return false
	}
	more, held := s.replayed(c, items, last, lost, full)
	if len(items) > 0 {
		s.checkBudget(c, held)
	}
	return more
}

// replayed queues what a replay read, up to last, and reports whether the
// writer is to go round again, and what the session holds now.
func (s *session) replayed(c *conn, items []*outItem, last, lost uint64, full bool) (more bool, held int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.conn != c {
		return false, 0
	}
	if lost > 0 {
		s.droppedLocked(lost)
	}
	for _, it := range items {
		s.queueLocked(it)
	}
	if last > s.scanned {
		s.scanned = last
	}
	if len(items) == 0 && s.scanned > s.cursor {
		s.cursor = s.scanned // nothing matched in between
	}
	for idx := range s.doneAbove {
		if idx <= s.scanned {
			delete(s.doneAbove, idx) // the replay is past it
		}
	}
	if !full && !s.more {
		s.behind = false
	}
	// Still behind with nothing queued: a record was offered during the
	// scan, and its offer did not wake the writer, so this one goes round
	// again.
	return len(items) > 0 || s.behind, s.heldLocked()
}

// droppedLocked counts lost log positions that retention took before this
// session was handed them; the first loss of a session is logged.
func (s *session) droppedLocked(lost uint64) {
	if s.dropped == 0 {
		s.srv.lines.Warn("session fell behind the log's retention: its oldest messages are gone", "client", s.id, "log_positions", lost)
	}
	s.dropped += lost
	s.srv.observer().Dropped(lost)
}

// matchReplay is Deliver's matching for one session reading the log: the
// record's outItem, or nil when none of subs takes it. QoS 0 records are
// not replayed: at most once, and a client back from a day offline is not
// to be flooded with them.
func matchReplay(subs []*subscription, client string, idx uint64, m *Message, now time.Time) *outItem {
	if _, live := m.expiryLeft(now); !live {
		return nil
	}
	var it *outItem
	for _, sub := range subs {
		if idx <= sub.since || (sub.noLocal && m.ClientID == client) || !MatchTopic(sub.match, m.Topic) {
			continue
		}
		if it == nil {
			it = &outItem{idx: idx, m: m}
		}
		it.qos = max(it.qos, min(m.QoS, sub.qos))
		it.retain = it.retain || (m.Retain && sub.rap)
		if sub.id > 0 {
			it.ids = append(it.ids, sub.id)
		}
	}
	if it == nil || it.qos == 0 {
		return nil
	}
	return it
}
