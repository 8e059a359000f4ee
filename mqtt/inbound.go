package mqtt

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
)

// publish takes a PUBLISH: checked, proposed to the log, its PUBACK or
// PUBREC owed in arrival order once the log resolves it. The read loop
// never waits for the log, except that a 3.1.1 client with max_inflight
// acks owed is not read from until some are written (back-pressure; MQTT
// 5 clients are held to the receive maximum instead). False ends the
// loop.
func (c *conn) publish(pk *packets.Packet) bool {
	srv := c.srv
	v5 := c.v == 5
	if code := publishCheck(pk, srv.cfg.TopicAliasMaximum); code != packets.CodeSuccess {
		c.protocolError(code, "invalid PUBLISH: "+code.Reason)
		return false
	}
	if v5 && pk.Properties.TopicAliasFlag {
		alias := pk.Properties.TopicAlias
		if c.aliasIn == nil {
			c.aliasIn = map[uint16]string{}
		}
		if pk.TopicName != "" {
			c.aliasIn[alias] = pk.TopicName // [MQTT-3.3.2-11]
		} else if t, ok := c.aliasIn[alias]; ok {
			pk.TopicName = t
		} else {
			c.protocolError(packets.ErrProtocolViolation, "topic alias never set") // [MQTT-3.3.4-?]
			return false
		}
	}
	if !validTopic(pk.TopicName) {
		c.protocolError(packets.ErrTopicNameInvalid, "invalid topic name")
		return false
	}
	if why := srv.cfg.Limits.topicProblem(pk.TopicName); why != "" {
		srv.refusal(c.host, why+": disconnected", "client", c.id, "topic", truncate(pk.TopicName))
		c.end(packets.ErrTopicNameInvalid)
		return false
	}
	qos, pid := pk.FixedHeader.Qos, pk.PacketID
	now := time.Now()
	if qos == 2 && pk.FixedHeader.Dup && (!c.awaitStart() || !c.resendRoom()) {
		return false
	}
	// resent: a resend (DUP) of a QoS 2 publish whose packet id this
	// member does not know: logged again, and named first (qos2.go).
	resent := false
	if qos == 2 {
		if done, stale := c.qos2Resend(pid, pk.FixedHeader.Dup, now); done {
			return true
		} else if stale {
			c.forgetInbound(pid)
		}
		resent = pk.FixedHeader.Dup
	}
	if qos > 0 && !c.room() {
		return false
	}
	rule, mode := ruleFor(srv.topicPolicies(), pk.TopicName)
	if hasDollar(pk.TopicName) || !srv.access.Load().ACL.Allowed(c.user, c.id, pk.TopicName, true) {
		srv.refusal(c.id, "publish denied by ACL", "client", c.id, "topic", truncate(pk.TopicName))
		if qos > 0 {
			a := &inAck{c: c, pid: pid, qos: qos, mode: mode, start: now}
			c.queueAck(a)
			c.resolve(a, ErrNotAuthorized, nil)
		}
		return true
	}
	if srv.mem.full() {
		// What waiting cannot fix: the gateway holds its whole memory
		// budget and this client holds nothing of it waiting (or it
		// would not have been read from).
		srv.refusal(c.host, "memory budget full (limits.memory): publish refused", "client", c.id, "used_bytes", srv.mem.used.Load())
		if qos > 0 {
			a := &inAck{c: c, pid: pid, qos: qos, mode: mode, start: now}
			c.queueAck(a)
			c.resolve(a, errMemoryFull, nil)
		}
		return true
	}
	var res *reservation
	if pk.FixedHeader.Retain {
		// Checked here, on the member that takes the publish, so that
		// its publisher is told; the log gets only what fits.
		var probe Message
		probe.fromPacket(c.id, pk, 0)
		size := srv.retained.sizeOf(&probe)
		var why string
		if res, why = srv.retained.reserve(pk.TopicName, size, len(pk.Payload) == 0); why != "" {
			srv.refusal(c.id, why, "client", c.id, "topic", truncate(pk.TopicName), "bytes", size)
			if qos > 0 {
				a := &inAck{c: c, pid: pid, qos: qos, mode: mode, start: now}
				c.queueAck(a)
				c.resolve(a, errRetainedFull, nil)
			}
			return true
		}
	}
	srv.observer().Published(mode, qos, rule)
	charged := c.chargeIn(publishCost(len(pk.TopicName), len(pk.Payload)))
	m := messages.Get().(*Message)
	m.fromPacket(c.id, pk, srv.cfg.Now().UnixNano())
	if qos == 0 {
		srv.log.Reserve(m)
		if res != nil {
			res.track(m.Seq)
		}
		srv.log.Propose(m, mode, DoneFunc(func(err error) {
			c.releaseIn(charged)
			if err != nil && res != nil {
				res.release()
			}
			srv.logFailure(err)
		}))
		putMessage(m)
		return true
	}
	a := &inAck{c: c, pid: pid, qos: qos, mode: mode, start: now, charged: charged}
	srv.log.Reserve(m)
	var resolved Done = a
	if res != nil {
		// Held until the record is applied: acked before that, it is
		// in neither the store nor the log's past, and the next
		// retained publish must still count it.
		res.track(m.Seq)
		resolved = DoneFunc(func(err error) {
			if err != nil {
				res.release()
			}
			a.Done(err)
		})
	}
	if qos == 2 {
		in := &inbound2{origin: m.Origin, seq: m.Seq}
		a.in2 = in
		s := c.sess
		s.mu.Lock()
		s.inbound[pid] = in
		persist := s.persistent()
		s.mu.Unlock()
		a.resent = resent && persist
		srv.inflight.Add(1)
		if persist {
			// Staged before the record is proposed, so it is on disk
			// no later than the record: after a crash a resend is
			// recognised, and a marker whose record never made it is
			// dropped at start.
			srv.stagePut(qos2Key(c.id, pid), encodeQoS2(m.Origin, m.Seq, now))
		}
		if resent && persist && srv.resendMarks() {
			// Before the record, from this member: the original, should
			// it commit after this connection's start record, and
			// this record are then delivered once (inboundDup).
			srv.proposeSession(c.id, sessionOp{Op: "resend", In: []uint16{pid}, Seq: m.Seq})
		}
	}
	c.queueAck(a)
	srv.log.Propose(m, mode, resolved)
	putMessage(m)
	return true
}

// publishCheck is mochi's Packet.PublishValidate (packets v2.7.9), check
// for check and in its order, with the wildcard test done on bytes:
// strings.ContainsAny(topic, "+#") costs about 500 instructions on a short
// topic (a rune search per byte), a tenth of a publish's own. '+' and '#'
// are ASCII, which no byte of a multi-byte UTF-8 sequence is, so bytes and
// runes find the same ones.
func publishCheck(pk *packets.Packet, topicAliasMaximum uint16) packets.Code {
	switch {
	case pk.FixedHeader.Qos > 0 && pk.PacketID == 0:
		return packets.ErrProtocolViolationNoPacketID // [MQTT-2.2.1-3] [MQTT-2.2.1-4]
	case pk.FixedHeader.Qos == 0 && pk.PacketID > 0:
		return packets.ErrProtocolViolationSurplusPacketID // [MQTT-2.2.1-2]
	case strings.IndexByte(pk.TopicName, '+') >= 0 || strings.IndexByte(pk.TopicName, '#') >= 0:
		return packets.ErrProtocolViolationSurplusWildcard // [MQTT-3.3.2-2]
	case pk.Properties.TopicAlias > topicAliasMaximum:
		return packets.ErrTopicAliasInvalid // [MQTT-3.2.2-17] [MQTT-3.3.2-9] ~[MQTT-3.3.2-10] [MQTT-3.3.2-12]
	case pk.TopicName == "" && pk.Properties.TopicAlias == 0:
		return packets.ErrProtocolViolationNoTopic // ~[MQTT-3.3.2-8]
	case pk.Properties.TopicAliasFlag && pk.Properties.TopicAlias == 0:
		return packets.ErrTopicAliasInvalid // [MQTT-3.3.2-8]
	case len(pk.Properties.SubscriptionIdentifier) > 0:
		return packets.ErrProtocolViolationSurplusSubID // [MQTT-3.3.4-6]
	}
	return packets.CodeSuccess
}

// errMemoryFull refuses a publish read while the memory account is full:
// 0x97 Quota exceeded.
var errMemoryFull = fmt.Errorf("%w: the gateway's memory budget is full (limits.memory)", ErrQuota)

// errRetainedFull refuses a retained publish past max_retained or
// max_retained_bytes: 0x97 Quota exceeded.
var errRetainedFull = fmt.Errorf("%w: the gateway's retained messages are at their cap (max_retained, max_retained_bytes)", ErrQuota)

// qos2Resend answers a QoS 2 PUBLISH whose id is still in the inbound
// table: a resend (DUP) gets the PUBREC of the publish it repeats, in its
// turn, with that publish's outcome [MQTT-4.3.3-9]; done is true then. A
// publish that is not a resend but reuses the id starts a new flow: the
// entry is stale (left by a crash before its PUBREL was recorded).
func (c *conn) qos2Resend(pid uint16, dup bool, now time.Time) (done, stale bool) {
	s := c.sess
	s.mu.Lock()
	in := s.inbound[pid]
	if in == nil {
		s.mu.Unlock()
		return false, false
	}
	if !dup {
		s.mu.Unlock()
		return false, true
	}
	// Answered before the receive maximum is checked: a resend is owed
	// already, and counting it would refuse, at every reconnect, a
	// client whose window was full when its connection dropped.
	a := &inAck{c: c, pid: pid, qos: 2, start: now, resend: true}
	if !in.done {
		in.waiting = append(in.waiting, a)
		s.mu.Unlock()
		c.queueAck(a)
		return true, false
	}
	err := in.err
	s.mu.Unlock()
	c.queueAck(a)
	c.resolve(a, err, nil)
	return true, false
}

// forgetInbound drops a stale QoS 2 entry and its marker.
func (c *conn) forgetInbound(pid uint16) {
	s := c.sess
	s.mu.Lock()
	_, had := s.inbound[pid]
	delete(s.inbound, pid)
	s.mu.Unlock()
	if had {
		c.srv.inflight.Add(-1)
	}
	c.srv.stageDelete(qos2Key(c.id, pid))
}

// room bounds what a client may have owed: an MQTT 5 client past the
// server's receive maximum is disconnected with 0x93 [MQTT-3.3.4-9]; a
// 3.1.1 client, which has no receive maximum, is not read from until its
// acks are under max_inflight. False ends the loop.
func (c *conn) room() bool {
	max := c.srv.cfg.MaxInflight
	if c.v == 5 {
		recs := c.pendingRecs()
		c.amu.Lock()
		owed := len(c.acks) - c.resends + recs
		c.amu.Unlock()
		if owed >= max {
			c.protocolError(packets.ErrReceiveMaximum, "receive maximum exceeded")
			return false
		}
		return true
	}
	c.amu.Lock()
	defer c.amu.Unlock()
	for len(c.acks)-c.resends >= max && !c.closedAcks {
		c.acond.Wait()
	}
	return !c.closedAcks
}

// resendRoom bounds the QoS 2 resends a connection may have owed, which
// room does not count (qos2Resend): at most max_inflight, as many as the
// flows its client can have pending. More means a flow resent again on
// this connection, each resend an ack queued behind the one that waits
// (for the log, or for an original's settlement): an MQTT 5 client may
// resend only after a reconnect [MQTT-4.4.0-1] and is disconnected
// (0x82); a 3.1.1 client is not read from until its acks are written.
// False ends the loop.
func (c *conn) resendRoom() bool {
	max := c.srv.cfg.MaxInflight
	c.amu.Lock()
	if c.v == 5 {
		over := c.resends >= max
		c.amu.Unlock()
		if over {
			c.protocolError(packets.ErrProtocolViolation, "QoS 2 publish resent again on one connection")
			return false
		}
		return true
	}
	defer c.amu.Unlock()
	for c.resends >= max && !c.closedAcks {
		c.acond.Wait()
	}
	return !c.closedAcks
}

// pendingRecs counts the QoS 2 publishes whose PUBREC was sent and whose
// PUBREL has not come: they count against the receive maximum until the
// PUBCOMP [MQTT-4.9.0-1].
func (c *conn) pendingRecs() int {
	s := c.sess
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, in := range s.inbound {
		if in.done && in.err == nil {
			n++
		}
	}
	return n
}

func (c *conn) queueAck(a *inAck) {
	c.amu.Lock()
	c.acks = append(c.acks, a)
	if a.resend {
		c.resends++
	}
	c.amu.Unlock()
}

// Done is the outcome of a publish's proposal (Log.Propose); it runs on
// the log's goroutine and must not block.
func (a *inAck) Done(err error) { a.outcome(err, nil) }

// Resolver runs a run of proposal outcomes (Log.Propose's Done values)
// and writes each connection's acks once, after the run, instead of once
// per outcome: the outcomes of a batch come together, and a client with 64
// publishes in it got 64 writes of one PUBACK each. Flush writes them.
// Not safe for concurrent use: one goroutine runs the outcomes.
type Resolver struct {
	conns []*conn
	seen  map[*conn]struct{}
}

// Resolve runs done with err; a publish's ack is written at Flush.
func (r *Resolver) Resolve(done Done, err error) {
	if a, ok := done.(*inAck); ok {
		a.outcome(err, r)
		return
	}
	done.Done(err)
}

// Flush writes the acks the outcomes since the last Flush made ready.
func (r *Resolver) Flush() {
	for i, c := range r.conns {
		c.kickHere()
		r.conns[i] = nil
	}
	r.conns = r.conns[:0]
	clear(r.seen)
}

// add notes a connection whose acks are ready to write.
func (r *Resolver) add(c *conn) {
	if r.seen == nil {
		r.seen = map[*conn]struct{}{}
	}
	if _, ok := r.seen[c]; !ok {
		r.seen[c] = struct{}{}
		r.conns = append(r.conns, c)
	}
}

// outcome is Done, its ack written by r's Flush when r is not nil.
func (a *inAck) outcome(err error, r *Resolver) {
	a.c.releaseIn(a.charged)
	if in := a.in2; in != nil {
		s := a.c.sess
		s.mu.Lock()
		var late uint64
		if err != nil && a.resent && s.inbound[a.pid] == in {
			var held bool
			late, held = s.resendDeliveredLocked(a.pid, in, heldOutcome{a, err})
			if held {
				// Its original's settlement decides (settled); until
				// then the ack stays in the queue, not done, as while
				// the proposal was in flight.
				s.mu.Unlock()
				a.c.srv.lines.Info("a QoS 2 resend not logged waits for its late original's settlement", "client", a.c.id, "packet_id", a.pid, "index", late)
				return
			}
			if late > 0 {
				err = nil // the flow goes on: its PUBREL is owed
			}
		}
		a.inboundDoneLocked(err, late, r)
	}
	if a.comp && err != nil {
		a.c.notLogged(err, "irel")
	}
	a.c.resolve(a, err, r)
}

// settled is the outcome of a failed QoS 2 resend whose late original, at
// index late, was held when it failed (resendDeliveredLocked), now that
// the original is settled: confirmed, it delivered the message, and the
// device gets the PUBREC; aborted, or a duplicate (the resend was in the
// log after all, and took its place, but failed: it is aborted), the
// message is not delivered, and the device is refused with err, the
// resend's own failure. On a connection ended meanwhile resolve writes
// nothing.
func (a *inAck) settled(err error, late uint64, delivered bool) {
	if delivered {
		err = nil
	} else {
		late = 0
	}
	a.c.sess.mu.Lock()
	a.inboundDoneLocked(err, late, nil)
	a.c.resolve(a, err, nil)
}

// inboundDoneLocked ends the wait of a's QoS 2 inbound entry with err:
// the resends waiting for it get the same answer; refused, the entry and
// its marker go, and the client may use the id again. late is the index
// of the late original that made a failed resend a success. Called with
// the session's mu held, which it releases.
func (a *inAck) inboundDoneLocked(err error, late uint64, r *Resolver) {
	in, s := a.in2, a.c.sess
	in.done, in.err = true, err
	waiting := in.waiting
	in.waiting = nil
	if err != nil && s.inbound[a.pid] == in {
		// The client may retry this id: the flow is over.
		delete(s.inbound, a.pid)
		a.c.srv.inflight.Add(-1)
	}
	persist := s.persistent()
	s.mu.Unlock()
	if err != nil && persist {
		a.c.srv.stageDelete(qos2Key(a.c.id, a.pid))
	}
	if late > 0 {
		a.c.srv.lines.Info("a QoS 2 resend not logged is acked: its late original was delivered", "client", a.c.id, "packet_id", a.pid, "index", late)
	}
	for _, w := range waiting {
		w.c.resolve(w, err, r)
	}
}

// resolve marks a done and, when a is at the head, has it written
// (kickHere: by the caller when no writer runs), or by r's Flush.
func (c *conn) resolve(a *inAck, err error, r *Resolver) {
	c.amu.Lock()
	a.done, a.err = true, err
	head := len(c.acks) > 0 && c.acks[0].done
	c.amu.Unlock()
	switch {
	case !head:
	case r != nil:
		r.add(c)
	default:
		c.kickHere()
	}
}

// takeAcks appends the acks at the head of the queue that are done, in
// order. They leave the queue before the write: the client may send its
// next publish the moment it reads them, and must not find them still
// counted (FACTS.md). failed is true when a refused publish of a 3.1.1
// client, which has no negative ack, ends the connection after the acks
// before it. now is the writer's clock reading for this round, what the
// acks' latencies are measured to.
func (c *conn) takeAcks(buf []byte, now time.Time) (_ []byte, failed bool) {
	c.amu.Lock()
	n := 0
	for n < len(c.acks) && c.acks[n].done {
		n++
	}
	if n == 0 {
		c.amu.Unlock()
		return buf, false
	}
	clear(c.ackBatch)
	batch := append(c.ackBatch[:0], c.acks[:n]...)
	c.ackBatch = batch
	// Moved to the front rather than resliced, so the queue keeps its
	// array and appending to it does not allocate.
	rest := copy(c.acks, c.acks[n:])
	clear(c.acks[rest:])
	c.acks = c.acks[:rest]
	for _, a := range batch {
		if a.resend {
			c.resends--
		}
	}
	c.acond.Broadcast()
	c.amu.Unlock()
	obs := c.srv.observer()
	for i, a := range batch {
		if a.comp {
			// Not logged, none goes: notLogged ends the connection.
			if a.err == nil {
				buf = c.appendComp(buf, a)
			}
			continue
		}
		if !a.resend {
			obs.Acked(a.mode, a.err, now.Sub(a.start))
		}
		if a.err != nil {
			c.srv.lines.Warn("publish not acked", "client", c.id, "packet_id", a.pid, "qos", a.qos, "error", a.err)
			if c.v != 5 {
				// 3.1.1 has no negative ack: disconnect; the client
				// resends. The acks after it are not written.
				for _, rest := range batch[i+1:] {
					if !rest.resend {
						obs.Acked(rest.mode, errors.New("connection closed"), now.Sub(rest.start))
					}
				}
				return buf, true
			}
		}
		buf = c.appendAck(buf, a)
	}
	return buf, false
}

// appendComp encodes a's PUBCOMP.
func (c *conn) appendComp(buf []byte, a *inAck) []byte {
	if a.unknown && c.v == 5 {
		// Remaining length 3: the reason code, no properties [MQTT-3.7.2.2].
		return append(buf, packets.Pubcomp<<4, 3, byte(a.pid>>8), byte(a.pid), packets.ErrPacketIdentifierNotFound.Code)
	}
	return append(buf, packets.Pubcomp<<4, 2, byte(a.pid>>8), byte(a.pid))
}

// appendAck encodes a's PUBACK or PUBREC.
func (c *conn) appendAck(buf []byte, a *inAck) []byte {
	typ := byte(packets.Puback)
	if a.qos == 2 {
		typ = packets.Pubrec
	}
	if a.err == nil {
		// A success has no reason code or properties: 4 bytes.
		return append(buf, typ<<4, 2, byte(a.pid>>8), byte(a.pid))
	}
	code := packets.ErrUnspecifiedError
	switch {
	case errors.Is(a.err, ErrQuota):
		code = packets.ErrQuotaExceeded
	case errors.Is(a.err, ErrNotAuthorized):
		code = packets.ErrNotAuthorized
	}
	pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: typ}, PacketID: a.pid, ReasonCode: code.Code}
	if !c.noProblem {
		pk.Properties.ReasonString = a.err.Error()
	}
	var b bytes.Buffer
	c.encode(&pk, &b)
	return append(buf, b.Bytes()...)
}

// pubrel answers a PUBREL: the inbound QoS 2 flow ends with PUBCOMP; an
// id not in flight gets PUBCOMP 0x92 on MQTT 5 [MQTT-4.3.3-11].
//
// On a persistent session whose log other members share, the PUBCOMP
// waits for an inbound release record ("irel") that every member applies
// (applyInboundReleased): with the PUBCOMP the device may reuse the id at
// once, and a member that had taken the released publish into its copy of
// the session (noteInbound) would take a resend of the new one (DUP, its
// original lost with the member the device left) for the old one, answer
// PUBREC and log nothing: a message acked and lost. The record goes for
// an id unknown here too, which another member may hold. Not logged, no
// PUBCOMP goes and the connection ends (notLogged): the device sends the
// PUBREL again when it comes back, here or elsewhere. Until then the flow
// holds the receive maximum (room): a client sending PUBRELs faster than
// their records are logged is held back (3.1.1) or disconnected (MQTT 5,
// 0x93), as for PUBLISH. False ends the loop.
func (c *conn) pubrel(pid uint16) bool {
	s := c.sess
	s.mu.Lock()
	in := s.inbound[pid]
	ok := in != nil && in.done && in.err == nil
	if ok {
		delete(s.inbound, pid)
	}
	persist := s.persistent()
	s.mu.Unlock()
	if ok {
		c.srv.inflight.Add(-1)
		if persist {
			c.srv.stageDelete(qos2Key(c.id, pid))
		}
	}
	if persist && c.srv.clustered() {
		if !c.room() {
			return false
		}
		a := &inAck{c: c, pid: pid, qos: 2, comp: true, unknown: !ok, start: time.Now()}
		c.queueAck(a)
		c.srv.proposeOpTo(c.id, sessionOp{Op: "irel", In: []uint16{pid}}, Replicated, a)
		return true
	}
	comp := &packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubcomp}, PacketID: pid}
	if !ok && c.v == 5 {
		comp.ReasonCode = packets.ErrPacketIdentifierNotFound.Code
	}
	c.send(comp)
	return true
}
