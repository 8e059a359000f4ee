package mqtt

import (
	"encoding/binary"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
)

// takeDeliveries hands out what the session's queue holds, as far as the
// in-flight window allows (the client's receive maximum and the server's
// own bounds, outbudget.go), each QoS 1/2 message under a packet id of the
// session's outbound space, and appends the PUBLISHes to buf. Retained
// messages owed to new subscriptions are queued first, as there is room.
// It runs on the writer.
func (c *conn) takeDeliveries(buf []byte) []byte {
	s := c.sess
	if s == nil {
		return buf
	}
	// Message expiry is measured against record times, with the gateway's
	// clock, read only for a message that has an expiry: most rounds hand
	// out nothing, or nothing that expires.
	var now time.Time
	acc := c.srv.access.Load()
	// The in-flight records are encoded under the lock: once a message is
	// in s.inflight a PUBREC for its packet id may change it (a client
	// that has the message, or one that guesses the id).
	type put struct {
		k string
		v []byte
	}
	var staged []put
	s.mu.Lock()
	if s.conn != c {
		s.mu.Unlock()
		return buf
	}
	s.refillLocked()
	n := 0
	for n < len(s.queue) {
		it := s.queue[n]
		if it.qos > 0 && s.windowFullLocked(c, it.cost) {
			break
		}
		if it.idx > s.cursor && it.m.Sync {
			// Not past a sync record until it is settled: the
			// session goes on in order once it is (hold.go).
			st := c.srv.holds.state(it.idx, s)
			if st == recHeld {
				break
			}
			if st == recAborted || st == recDup {
				n++
				s.unqueuedLocked(it)
				s.cursor = it.idx
				continue
			}
		}
		if it.qos == 2 && it.idx > 0 && it.idx > s.cursor {
			if _, used := s.inflight[pidFor(it.idx)]; used {
				break // its packet id is still taken: it waits, in order
			}
		}
		n++
		s.unqueuedLocked(it)
		if it.idx > 0 {
			if it.idx <= s.cursor {
				continue // handed out already (a replay and an offer crossed)
			}
			s.cursor = it.idx
		}
		if acc.ACL != nil && !acc.ACL.Allowed(s.user, s.id, it.m.Topic, false) {
			// A subscription granted before a reload stops delivering
			// what the new ACL forbids.
			c.srv.refusal(s.id, "read denied by ACL", "client", s.id, "topic", truncate(it.m.Topic))
			continue
		}
		if it.m.MessageExpirySet && now.IsZero() {
			now = c.srv.cfg.Now()
		}
		expiry, live := it.m.expiryLeft(now)
		if !live {
			continue
		}
		mark := len(buf)
		switch {
		case it.qos == 2 && it.idx > 0:
			it.pid = pidFor(it.idx)
		case it.qos > 0:
			it.pid = s.newPIDLocked()
		}
		var aliased bool
		buf, aliased = c.appendPublish(buf, it, expiry, s.mayHaveLocked(it))
		if c.maxPacket > 0 && uint32(len(buf)-mark) > c.maxPacket {
			// Too big for the client: dropped as if delivered
			// [MQTT-3.1.2-24], and the alias it would have set is not
			// the client's.
			buf = buf[:mark]
			if aliased {
				delete(c.aliasOut, it.m.Topic)
			}
			continue
		}
		if it.qos > 0 {
			s.sendSeq++
			it.seq = s.sendSeq
			s.inflight[it.pid] = it
			s.flyLocked(it)
			c.srv.inflight.Add(1)
			if s.persistent() {
				staged = append(staged, put{outKey(s.id, it.pid), encodeOut(it)})
			}
		}
	}
	clear(s.queue[:n])
	s.queue = s.queue[n:]
	if len(s.queue) == 0 {
		s.queue = nil
	}
	held := s.heldLocked()
	s.mu.Unlock()
	for _, p := range staged {
		c.srv.stagePut(p.k, p.v)
	}
	s.checkBudget(c, held)
	return buf
}

// quietFor reports whether the session has nothing for c's writer to hand
// out or read back: nothing queued or owed, no replay due (or c is not
// its connection, whose writer hands out nothing).
func (s *session) quietFor(c *conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.conn != c || (len(s.queue) == 0 && len(s.owed) == 0 && !s.behind)
}

// resend appends what a resumed session owes first: every message in
// flight, in the order it was sent, as a PUBLISH with DUP set, or a PUBREL
// where the PUBREC came [MQTT-4.4.0-1]. Messages known only by their log
// index (the session was loaded from disk) are read from the log. A PUBREL
// whose release record is still being logged waits for it (released
// sends it): the device would complete the flow, and a member taking the
// session over without the record would send the message again, as new.
func (c *conn) resend(buf []byte) []byte {
	s := c.sess
	s.mu.Lock()
	items := s.resendOrderLocked()
	n := 0
	for _, it := range items {
		if !it.rel || !s.releasing[it.idx] {
			items[n] = it
			n++
		}
	}
	items = items[:n]
	s.mu.Unlock()
	now := c.srv.cfg.Now() // measured against record times: message expiry
	for _, it := range items {
		if it.rel {
			buf = append(buf, packets.Pubrel<<4|2, 2, byte(it.pid>>8), byte(it.pid))
			continue
		}
		if it.m == nil {
			it.m = c.srv.readRecord(it.idx)
			if it.m == nil {
				// Gone from the log: the flow cannot be finished.
				s.acked(it.pid, it.qos)
				continue
			}
		}
		expiry, _ := it.m.expiryLeft(now)
		buf, _ = c.appendPublish(buf, it, expiry, true)
	}
	// What the resend read from the log is held in flight again.
	s.mu.Lock()
	for _, it := range items {
		if s.inflight[it.pid] == it {
			s.flyLocked(it)
		}
	}
	held := s.heldLocked()
	s.mu.Unlock()
	s.checkBudget(c, held)
	return buf
}

// readRecord returns the committed record at index, or nil.
func (s *Server) readRecord(index uint64) *Message {
	if s.reader == nil || index == 0 {
		return nil
	}
	var out *Message
	err := s.reader.Committed(index, index, func(i uint64, m *Message) bool {
		if i == index {
			out = m
		}
		return false
	})
	if err != nil {
		s.lines.Error("reading a record for a resend failed", "index", index, "error", err)
	}
	return out
}

// appendPublish encodes the PUBLISH delivering it to this client: the
// packet id, QoS and retain of the delivery, the message's properties
// with its expiry reduced to what is left, the subscription identifiers,
// and a topic alias when the client takes them; aliased says it set a new
// one.
func (c *conn) appendPublish(buf []byte, it *outItem, expiry uint32, dup bool) (_ []byte, aliased bool) {
	m := it.m
	topic := m.Topic
	var alias uint16
	if c.v == 5 && c.aliasMax > 0 && !dup {
		if c.aliasOut == nil {
			c.aliasOut = map[string]uint16{}
		}
		if a, ok := c.aliasOut[topic]; ok {
			alias, topic = a, "" // [MQTT-3.3.2-?]: the alias alone stands for the topic
		} else if len(c.aliasOut) < int(c.aliasMax) {
			alias = uint16(len(c.aliasOut) + 1)
			c.aliasOut[topic] = alias
			aliased = true
		}
	}
	var props []byte
	if c.v == 5 {
		props = appendProps(nil, m, it.ids, expiry, alias)
	}
	rem := 2 + len(topic) + len(m.Payload)
	if it.qos > 0 {
		rem += 2
	}
	if c.v == 5 {
		rem += varintLen(len(props)) + len(props)
	}
	hb := byte(packets.Publish<<4) | it.qos<<1
	if dup && it.qos > 0 {
		hb |= 8
	}
	if it.retain {
		hb |= 1
	}
	buf = append(buf, hb)
	buf = appendVarint(buf, rem)
	buf = append(buf, byte(len(topic)>>8), byte(len(topic)))
	buf = append(buf, topic...)
	if it.qos > 0 {
		buf = append(buf, byte(it.pid>>8), byte(it.pid))
	}
	if c.v == 5 {
		buf = appendVarint(buf, len(props))
		buf = append(buf, props...)
	}
	return append(buf, m.Payload...), aliased
}

// appendProps encodes the PUBLISH properties that travel with m
// [MQTT-3.3.2-4] [MQTT-3.3.2-15] [MQTT-3.3.2-16] [MQTT-3.3.2-17]
// [MQTT-3.3.2-20].
func appendProps(b []byte, m *Message, ids []int, expiry uint32, alias uint16) []byte {
	if m.PayloadFormatSet {
		b = append(b, packets.PropPayloadFormat, m.PayloadFormat)
	}
	if m.MessageExpirySet {
		b = append(b, packets.PropMessageExpiryInterval)
		b = binary.BigEndian.AppendUint32(b, expiry)
	}
	if m.ContentType != "" {
		b = appendStrProp(b, packets.PropContentType, m.ContentType)
	}
	if m.ResponseTopic != "" {
		b = appendStrProp(b, packets.PropResponseTopic, m.ResponseTopic)
	}
	if len(m.CorrelationData) > 0 {
		b = appendStrProp(b, packets.PropCorrelationData, string(m.CorrelationData))
	}
	for _, id := range ids {
		b = append(b, packets.PropSubscriptionIdentifier)
		b = appendVarint(b, id)
	}
	if alias > 0 {
		b = append(b, packets.PropTopicAlias, byte(alias>>8), byte(alias))
	}
	for _, u := range m.User {
		b = append(b, packets.PropUser)
		b = append(b, byte(len(u.Key)>>8), byte(len(u.Key)))
		b = append(b, u.Key...)
		b = append(b, byte(len(u.Val)>>8), byte(len(u.Val)))
		b = append(b, u.Val...)
	}
	return b
}

func appendStrProp(b []byte, id byte, s string) []byte {
	b = append(b, id, byte(len(s)>>8), byte(len(s)))
	return append(b, s...)
}

// appendVarint appends MQTT's variable byte integer.
func appendVarint(b []byte, n int) []byte {
	for {
		d := byte(n % 128)
		n /= 128
		if n > 0 {
			d |= 0x80
		}
		b = append(b, d)
		if n == 0 {
			return b
		}
	}
}

func varintLen(n int) int {
	switch {
	case n < 128:
		return 1
	case n < 16384:
		return 2
	case n < 2097152:
		return 3
	}
	return 4
}
