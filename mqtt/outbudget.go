package mqtt

import (
	"github.com/mochi-mqtt/server/v2/packets"
)

// What one subscriber may make the gateway hold (DESIGN.md, "Budgets").
//
// A connected session holds messages in three places: its ready queue
// (Config.MaxQueued, MaxQueuedBytes), its outbound in-flight window
// (MaxInflightOut, MaxInflightOutBytes, whatever the client's Receive
// Maximum), and the retained messages its new subscriptions are owed and
// not yet queued (references into the retained store). Past the queue's
// bounds a QoS 1/2 record stays in the log and the session reads it from
// its cursor later; a QoS 0 one is dropped and counted (QoS 0 may be
// lost, and is never read back). Every byte held is charged to the
// memory account while the client is connected; a session that alone
// holds more than half of it has its connection ended with 0x97.

// outOverhead is what a queued or in-flight delivery costs beyond its
// topic and payload: the outItem, its slot in the queue or the in-flight
// map, its packet's header.
const outOverhead = 256

// owedRefCost is what one retained message owed to a subscription costs
// while it waits to be queued: a reference, not a copy.
const owedRefCost = 16

// outCost is what a delivery of m is charged and counted against the
// queue's and the window's byte bounds.
func outCost(m *Message) int64 {
	if m == nil {
		return 0
	}
	return int64(len(m.Topic)+len(m.Payload)) + outOverhead
}

// retainedOwed is the retained messages one subscription is owed at its
// SUBSCRIBE, oldest first, not yet queued. They are queued as the queue
// has room, with the subscription's options of that moment: the same
// filter subscribed again replaces the entry (the last options win, and
// the messages go once).
type retainedOwed struct {
	filter string // as subscribed: the key of the session's subscription
	match  string // the filter matched (without a share prefix)
	msgs   []*Message
}

// heldLocked is what the session holds now, in bytes charged.
func (s *session) heldLocked() int64 { return s.queueBytes + s.flightBytes + s.owedBytes }

// roomLocked reports whether the queue takes one more message of cost
// bytes: below both bounds, or empty (a message larger than the byte bound
// still goes, alone).
func (s *session) roomLocked(cost int64) bool {
	n := len(s.queue)
	return n == 0 || (n < s.srv.cfg.MaxQueued && s.queueBytes+cost <= s.srv.cfg.MaxQueuedBytes)
}

// windowFullLocked reports whether the in-flight window takes no QoS 1/2
// delivery of cost bytes: at the client's Receive Maximum or the server's
// MaxInflightOut, or past MaxInflightOutBytes with something in flight
// (a message larger than the byte bound goes alone, never stalls).
func (s *session) windowFullLocked(c *conn, cost int64) bool {
	n := len(s.inflight)
	if n >= min(c.window, s.srv.cfg.MaxInflightOut) {
		return true
	}
	return n > 0 && s.flightBytes+cost > s.srv.cfg.MaxInflightOutBytes
}

// queueLocked appends it to the queue and charges it.
func (s *session) queueLocked(it *outItem) {
	it.cost = outCost(it.m)
	s.queueBytes += it.cost
	s.srv.mem.charge(it.cost)
	s.queue = append(s.queue, it)
}

// unqueuedLocked notes that it has left the queue (handed out, skipped or
// dropped) and releases its charge; flyLocked charges it again if it
// stays in flight.
func (s *session) unqueuedLocked(it *outItem) {
	s.queueBytes -= it.cost
	s.srv.mem.release(it.cost)
	it.cost = 0
}

// flyLocked charges it, just put in flight with its message.
func (s *session) flyLocked(it *outItem) {
	if it.cost > 0 || it.m == nil {
		return
	}
	it.cost = outCost(it.m)
	s.flightBytes += it.cost
	s.srv.mem.charge(it.cost)
}

// landedLocked releases it, which has left the in-flight window.
func (s *session) landedLocked(it *outItem) {
	s.flightBytes -= it.cost
	s.srv.mem.release(it.cost)
	it.cost = 0
}

// releaseHeldLocked gives back everything the session is charged, when
// its connection ends or the session does: the queue and what it is owed
// are dropped (the log and the retained store have them). Going offline,
// an in-flight log record keeps only its index (the resend at reconnect
// reads it from the log), so an offline session holds no payloads.
func (s *session) releaseHeldLocked(offline bool) {
	for _, it := range s.queue {
		s.srv.mem.release(it.cost)
		it.cost = 0
	}
	s.queue, s.queueBytes = nil, 0
	for _, it := range s.inflight {
		s.srv.mem.release(it.cost)
		it.cost = 0
		if offline && it.idx > 0 && s.srv.reader != nil {
			it.m = nil
		}
	}
	s.flightBytes = 0
	s.srv.mem.release(s.owedBytes)
	s.owed, s.owedBytes = nil, 0
}

// owe adds the retained messages owed to new subscriptions (in the order
// subscribed), each replacing what the same filter was owed and has not
// yet been queued. It does not wake the writer: the caller queues the
// SUBACK after it and kicks, so the writer round that writes the SUBACK
// has queued them already. While a session owes anything, what is offered
// to it is left to the log's replay, which does not read QoS 0 back: owed
// after its SUBACK had gone (written at once by kickHere, or by a writer
// that ran first), a subscriber lost the QoS 0 messages published right
// after it (TestQoS0PublishedRightAfterSubackIsDelivered). A filter that
// matched no retained message owes nothing, for the same reason.
func (s *session) owe(owed []*retainedOwed) {
	if len(owed) == 0 {
		return
	}
	s.mu.Lock()
	c := s.conn
	if c == nil {
		s.mu.Unlock()
		return
	}
	for _, o := range owed {
		for i, prev := range s.owed {
			if prev.filter == o.filter {
				s.dropOwedLocked(i)
				break
			}
		}
		if len(o.msgs) == 0 {
			continue
		}
		cost := int64(len(o.msgs)) * owedRefCost
		s.owedBytes += cost
		s.srv.mem.charge(cost)
		s.owed = append(s.owed, o)
	}
	held := s.heldLocked()
	s.mu.Unlock()
	s.checkBudget(c, held)
}

// dropOwedLocked removes s.owed[i] and releases what it is charged.
func (s *session) dropOwedLocked(i int) {
	cost := int64(len(s.owed[i].msgs)) * owedRefCost
	s.owedBytes -= cost
	s.srv.mem.release(cost)
	s.owed = append(s.owed[:i], s.owed[i+1:]...)
}

// nextOwedLocked returns the retained message owed next and the
// subscription it goes under, taking it off owed; nil when nothing is
// owed. A subscription gone since (unsubscribed) owes nothing more.
func (s *session) nextOwedLocked() (*Message, *subscription) {
	for len(s.owed) > 0 {
		o := s.owed[0]
		sub := s.subs[o.filter]
		if sub == nil || len(o.msgs) == 0 {
			s.dropOwedLocked(0)
			continue
		}
		m := o.msgs[0]
		o.msgs[0] = nil
		o.msgs = o.msgs[1:]
		s.owedBytes -= owedRefCost
		s.srv.mem.release(owedRefCost)
		if len(o.msgs) == 0 {
			s.owed = s.owed[1:]
		}
		return m, sub
	}
	s.owed = nil
	return nil, nil
}

// owedRoomLocked reports whether a retained message is owed and the queue
// has room for the next one: the writer goes round again to queue it.
func (s *session) owedRoomLocked() bool {
	for _, o := range s.owed {
		if len(o.msgs) > 0 {
			return s.roomLocked(outCost(o.msgs[0]))
		}
	}
	return len(s.owed) > 0 // entries with nothing left: dropped by the next refill
}

// refillLocked queues owed retained messages while the queue has room.
func (s *session) refillLocked() {
	for len(s.owed) > 0 {
		if o := s.owed[0]; len(o.msgs) > 0 && !s.roomLocked(outCost(o.msgs[0])) {
			return
		}
		m, sub := s.nextOwedLocked()
		if m == nil {
			return
		}
		if sub.noLocal && m.ClientID == s.id {
			continue
		}
		it := &outItem{m: m, qos: min(m.QoS, sub.qos), retain: true}
		if sub.id > 0 {
			it.ids = []int{sub.id}
		}
		s.queueLocked(it)
	}
}

// checkBudget ends c when its session, holding held bytes, alone holds more
// than half of the memory account: MQTT 5 gets DISCONNECT 0x97, 3.1.1 is
// closed. A persistent session resumes from its cursor when the client
// comes back.
func (s *session) checkBudget(c *conn, held int64) {
	m := s.srv.mem
	if !m.on() || held <= m.limit/2 || c.isEnded() {
		return
	}
	s.srv.refusal(s.id, "session holds over half of limits.memory: disconnected", "client", s.id, "held_bytes", held, "limit", m.limit)
	c.end(packets.ErrQuotaExceeded)
	// What it holds goes now, not once its connection has drained, and
	// nothing more is queued for it: the log keeps the records past its
	// cursor.
	s.mu.Lock()
	if s.conn == c {
		s.releaseHeldLocked(false)
		s.behind, s.more = true, true
		s.scanned = s.cursor
	}
	s.mu.Unlock()
}

// droppedQoS0 counts QoS 0 messages a connected session did not take
// because it was behind or its queue was full.
func (s *session) droppedQoS0() {
	s.srv.qos0Dropped.Add(1)
	s.srv.lines.Warn("QoS 0 messages dropped: the client reads slower than they come", "client", s.id)
}

// QoS0Dropped is how many QoS 0 messages connected sessions dropped because
// their client read slower than they came (tandem_mqtt_qos0_dropped_total).
func (s *Server) QoS0Dropped() uint64 { return s.qos0Dropped.Load() }
