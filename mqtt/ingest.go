package mqtt

import (
	"bytes"
	"errors"
	"math"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	mochi "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
)

// Log is what the broker needs of the replicated log.
type Log interface {
	// Reserve gives m its record id (m.Origin, m.Seq) ahead of Propose, so
	// state that names the record can be staged before the record exists.
	Reserve(m *Message)
	// Propose logs m, whose id Reserve set, under mode. done is called
	// exactly once, when the record meets mode's ack rule (nil) or cannot
	// (an error, ErrQuota for lack of space). done must not block. After a
	// run of done calls, the Log calls Broker.ReleaseAcks.
	Propose(m *Message, mode AckMode, done func(err error))
	// Logged reports which of the given sequence numbers of records from
	// origin are in the log.
	Logged(origin uint64, seqs []uint64) (map[uint64]bool, error)
}

// ackSlot is one PUBACK/PUBREC owed to a client, in the order its PUBLISH
// arrived: MQTT wants acks in that order, and sync and async topics resolve
// out of it.
type ackSlot struct {
	cl   *mochi.Client
	pid  uint16
	qos  byte
	done bool
	err  error
	// mode and start are for the Observer: the topic's ack mode and when
	// the PUBLISH was read.
	mode  AckMode
	start time.Time
	// resend marks a QoS 2 resend; original is the slot of the publish it
	// repeats when that was still owed, whose outcome it shares.
	resend   bool
	original *ackSlot
	// cs is the client the ack is owed to; msg is the record a publish
	// proposed, in the slot to save an allocation per publish.
	cs  *clientState
	msg Message
}

// owed counts the publishes an MQTT 5 client has outstanding against its
// receive maximum: acks not yet written, resends of publishes already
// counted aside, and PUBRECs whose PUBREL has not come. Call with cs.mu held.
func (cs *clientState) owed() int { return len(cs.queue) - cs.resends + cs.awaitingRel }

// resolved is the done callback of the slot's proposal.
func (s *ackSlot) resolved(err error) { s.cs.h.resolved(s.cs, s, err) }

// clientState is the ack bookkeeping of one client id; it outlives a
// connection so a session take-over can wait for the old one's acks.
type clientState struct {
	id string
	h  *ingest
	mu sync.Mutex // guards the fields below
	// queue holds the unreleased acks, oldest first.
	queue []*ackSlot
	// writing is true while a writer goroutine drains queue.
	writing bool
	// released is signalled whenever acks are released (back-pressure).
	released *sync.Cond
	// failedQoS2 marks packet ids whose PUBREC carried an error: mochi
	// still holds their PUBREC in Inflight until a read loop drops it.
	failedQoS2 map[uint16]bool
	// awaitingRel counts PUBRECs sent whose PUBREL has not come: with
	// queue, what an MQTT 5 client owes against its receive maximum.
	awaitingRel int
	// resends counts the resend slots in queue.
	resends int
	// batch is the slice takeDone hands out, reused from one batch to the
	// next: it belongs to whoever holds writing, as the batch it holds does.
	batch []*ackSlot
	// listed is true while cs waits in ingest.ready for releaseReady.
	listed bool
	// raw is rawFor's socket, for writes that must not block. rawWrite is
	// the callback raw.Write runs, made once per socket rather than per
	// write: it writes wbuf and leaves its results in wn and werr. All four
	// belong to whoever holds writing.
	raw      syscall.RawConn
	rawFor   *mochi.Client
	rawWrite func(fd uintptr) bool
	wbuf     []byte
	wn       int
	werr     error
}

// ingest is the mochi hook that turns PUBLISHes into log proposals and
// writes the acks when the log says so (FACTS.md, "The MQTT ack path").
// Register it last: it takes over the PUBLISHes other hooks let through.
type ingest struct {
	mochi.HookBase
	b *Broker

	mu      sync.Mutex // guards clients and wills
	clients map[string]*clientState
	wills   map[string]*time.Timer // delayed wills by client id

	readyMu sync.Mutex     // guards ready
	ready   []*clientState // clients with acks resolved since the last releaseReady
}

// bufPool holds encode buffers for acks written without blocking.
var bufPool = sync.Pool{New: func() any { return new(bytes.Buffer) }}

func (h *ingest) ID() string { return "tandem-ingest" }

func (h *ingest) Provides(b byte) bool {
	switch b {
	case mochi.OnPacketRead, mochi.OnSubscribed,
		mochi.OnWill, mochi.OnSessionEstablish, mochi.OnSessionEstablished, mochi.OnDisconnect:
		return true
	}
	return false
}

func (h *ingest) state(id string) *clientState {
	h.mu.Lock()
	defer h.mu.Unlock()
	cs := h.clients[id]
	if cs == nil {
		cs = &clientState{id: id, h: h, failedQoS2: map[uint16]bool{}}
		cs.released = sync.NewCond(&cs.mu)
		h.clients[id] = cs
	}
	return cs
}

// takenTopic is the topic of the inert packet OnPacketRead hands back for a
// PUBLISH it has taken over: it passes mochi's PublishValidate, and
// processPublish drops it at its first check ($SYS is not for clients).
const takenTopic = "$SYS/tandem/taken"

// OnPacketRead runs on the client's read loop, the one goroutine where
// mochi's Inflight may be changed. It drops PUBRECs whose publish failed,
// and takes every PUBLISH over (publish).
func (h *ingest) OnPacketRead(cl *mochi.Client, pk packets.Packet) (packets.Packet, error) {
	cs := h.state(cl.ID)
	h.dropFailed(cl, cs)
	switch pk.FixedHeader.Type {
	case packets.Pubrel:
		if prev, ok := cl.State.Inflight.Get(pk.PacketID); ok && prev.FixedHeader.Type == packets.Pubrec {
			cs.mu.Lock()
			cs.awaitingRel = max(cs.awaitingRel-1, 0)
			cs.mu.Unlock()
		}
		return pk, nil
	case packets.Publish:
		return h.publish(cl, cs, pk)
	}
	return pk, nil
}

// publish proposes a PUBLISH and hands mochi an inert packet in its place,
// so mochi neither acks nor routes it: the ack is written when the log
// resolves it, delivery happens at commit. It does here what mochi's
// processPublish does before its OnPublish hooks (topic alias, QoS cap),
// which OnPublish cannot replace: a hook rejecting a publish makes mochi box
// the whole packet for a debug log line, about 850 bytes per publish.
//
// It also bounds the acks a client may owe (MQTT 5: its receive maximum;
// 3.1.1: back-pressure), and answers QoS 2 resends whose PUBREC mochi
// already holds: mochi would answer those with 0x91 (FACTS.md).
func (h *ingest) publish(cl *mochi.Client, cs *clientState, pk packets.Packet) (packets.Packet, error) {
	if pk.PublishValidate(h.b.srv.Options.Capabilities.TopicAliasMaximum) != packets.CodeSuccess ||
		!mochi.IsValidFilter(pk.TopicName, true) {
		// mochi refuses these before any hook, as it should.
		return pk, nil
	}
	// Every PUBLISH sets or uses its topic alias, a resend's included: a
	// client reconnecting sets its aliases up again on what it resends.
	if pk.Properties.TopicAliasFlag && pk.Properties.TopicAlias > 0 { // [MQTT-3.3.2-11]
		pk.TopicName = cl.State.TopicAliases.Inbound.Set(pk.Properties.TopicAlias, pk.TopicName)
	}
	if maxQoS := h.b.srv.Options.Capabilities.MaximumQos; pk.FixedHeader.Qos > maxQoS {
		pk.FixedHeader.Qos = maxQoS // [MQTT-3.2.2-9]
	}
	qos, pid := pk.FixedHeader.Qos, pk.PacketID
	if qos == 2 {
		if prev, ok := cl.State.Inflight.Get(pid); ok && prev.FixedHeader.Type == packets.Pubrec {
			if pk.FixedHeader.Dup {
				// Answered before the bounds below: a resend is owed
				// already, and counting it would refuse, at every
				// reconnect, a client whose window was full when its
				// connection dropped.
				h.resend(cl, cs, pid)
				return inert(pk), nil
			}
			// Not a resend [MQTT-3.3.1-1]: a new flow reusing the id, so
			// the entry is stale (left by a crash before its PUBREL was
			// recorded).
			h.forgetPubrec(cl, cs, pid)
		}
	}
	if qos > 0 {
		if cl.Properties.ProtocolVersion < 5 {
			h.backPressure(cl, cs)
		} else {
			cs.mu.Lock()
			owed := cs.owed()
			cs.mu.Unlock()
			if owed >= h.b.cfg.MaxInflight {
				_ = h.b.srv.DisconnectClient(cl, packets.ErrReceiveMaximum) // [MQTT-3.3.4-9]
				return pk, packets.ErrRejectPacket                          // ends the read loop
			}
		}
	}
	if pk.TopicName == "" {
		// An MQTT 5 topic alias the client never set, with no topic: a
		// protocol error, and a record no subscriber could receive.
		_ = h.b.srv.DisconnectClient(cl, packets.ErrProtocolViolationInvalidTopic)
		return pk, packets.ErrRejectPacket // ends the read loop
	}
	now := time.Now()
	rule, mode := ruleFor(h.b.topicPolicies(), pk.TopicName)
	if !h.b.canPublish(cl, pk.TopicName) {
		// Refused here rather than by mochi, which would write its PUBACK
		// ahead of the acks this client is still owed.
		h.b.logger.Debug("publish denied by ACL", "client", cl.ID, "topic", pk.TopicName)
		if qos > 0 {
			h.refuse(cl, cs, pid, qos, mode, now, ErrNotAuthorized)
		}
		return inert(pk), nil
	}
	h.b.observer().Published(mode, qos, rule)
	if qos == 0 {
		m := &Message{}
		m.fromPacket(cl.ID, &pk, now.UnixNano())
		h.b.log.Reserve(m)
		h.b.log.Propose(m, mode, h.b.logFailure)
		return inert(pk), nil
	}
	slot := &ackSlot{cl: cl, pid: pid, qos: qos, mode: mode, start: now, cs: cs}
	m := &slot.msg
	m.fromPacket(cl.ID, &pk, now.UnixNano())
	h.b.log.Reserve(m)
	if qos == 2 {
		// mochi's processPubrel needs the PUBREC in Inflight.
		rec := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrec}, PacketID: pid, Created: now.Unix()}
		if cl.State.Inflight.Set(rec) {
			atomic.AddInt64(&h.b.srv.Info.Inflight, 1)
		}
		// Staged before the record is proposed, so it is on disk no later
		// than the record: after a crash a resend is recognised, and a
		// marker whose record never made it is dropped at start.
		h.b.persist.qos2Set(cl, pid, m.Origin, m.Seq)
	}
	cs.mu.Lock()
	cs.queue = append(cs.queue, slot)
	cs.mu.Unlock()
	h.b.log.Propose(m, mode, slot.resolved)
	return inert(pk), nil
}

// inert turns pk into the packet mochi is handed for a publish taken over.
func inert(pk packets.Packet) packets.Packet {
	pk.FixedHeader.Qos, pk.FixedHeader.Dup, pk.FixedHeader.Retain = 0, false, false
	pk.PacketID = 0
	pk.TopicName = takenTopic
	pk.Properties.TopicAlias, pk.Properties.TopicAliasFlag = 0, false
	return pk
}

// forgetPubrec removes a PUBREC from mochi's Inflight and its marker; call
// it on cl's read loop (or once that loop has ended).
func (h *ingest) forgetPubrec(cl *mochi.Client, cs *clientState, pid uint16) {
	if cl.State.Inflight.Delete(pid) {
		atomic.AddInt64(&h.b.srv.Info.Inflight, -1)
		cs.mu.Lock()
		cs.awaitingRel = max(cs.awaitingRel-1, 0)
		cs.mu.Unlock()
	}
	h.b.persist.qos2Delete(cl.ID, pid)
}

// dropFailed removes the PUBRECs of publishes whose ack failed from cl's
// Inflight: left there, mochi would resend them as successes when the
// session resumes. Call on cl's read loop, or once that loop has ended.
func (h *ingest) dropFailed(cl *mochi.Client, cs *clientState) {
	cs.mu.Lock()
	if len(cs.failedQoS2) == 0 {
		cs.mu.Unlock()
		return
	}
	failed := cs.failedQoS2
	cs.failedQoS2 = map[uint16]bool{}
	cs.mu.Unlock()
	for pid := range failed {
		if cl.State.Inflight.Delete(pid) {
			atomic.AddInt64(&h.b.srv.Info.Inflight, -1)
		}
	}
}

// OnSubscribed tells Deliver that a topic may have gained a subscriber.
func (h *ingest) OnSubscribed(*mochi.Client, packets.Packet, []byte) { h.b.subscribed() }

// OnSessionEstablished lifts mochi's receive quota: mochi checks it on every
// PUBLISH, QoS 0 included, and on 3.1.1 clients, which have no receive
// maximum. OnPacketRead bounds the acks a client owes instead.
func (h *ingest) OnSessionEstablished(cl *mochi.Client, _ packets.Packet) {
	cl.State.Inflight.ResetReceiveQuota(math.MaxInt32)
}

// backPressure holds a 3.1.1 client's read loop while it has max_inflight
// acks owed: it waits only on acks the log will release, never on the
// client's own PUBRELs, which this read loop would have to read.
func (h *ingest) backPressure(cl *mochi.Client, cs *clientState) {
	cs.mu.Lock()
	for len(cs.queue) >= h.b.cfg.MaxInflight && !cl.Closed() && !h.b.closing.Load() {
		cs.released.Wait()
	}
	cs.mu.Unlock()
}

// OnSessionEstablish waits, on a take-over, until the old connection's acks
// are released, so the inherited Inflight holds only PUBRECs that were
// really earned before mochi resends them.
func (h *ingest) OnSessionEstablish(cl *mochi.Client, _ packets.Packet) {
	h.mu.Lock()
	if t := h.wills[cl.ID]; t != nil {
		t.Stop() // [MQTT-3.1.3-9]: the client is back before its will's delay
		delete(h.wills, cl.ID)
	}
	h.mu.Unlock()
	cs := h.state(cl.ID)
	deadline := time.Now().Add(h.b.cfg.SyncTimeout + time.Second)
	cs.mu.Lock()
	for (len(cs.queue) > 0 || cs.writing) && time.Now().Before(deadline) {
		cs.mu.Unlock()
		time.Sleep(2 * time.Millisecond)
		cs.mu.Lock()
	}
	cs.mu.Unlock()
	// The old connection's read loop has ended: its failed PUBRECs can go
	// before mochi clones its Inflight into the new connection.
	if old, ok := h.b.srv.Clients.Get(cl.ID); ok && old != cl {
		h.dropFailed(old, cs)
	}
}

// refuse queues a failed ack for a publish that is not logged.
func (h *ingest) refuse(cl *mochi.Client, cs *clientState, pid uint16, qos byte, mode AckMode, start time.Time, err error) {
	slot := &ackSlot{cl: cl, pid: pid, qos: qos, mode: mode, start: start}
	cs.mu.Lock()
	cs.queue = append(cs.queue, slot)
	cs.mu.Unlock()
	h.resolvedHere(cs, slot, err)
}

// resend answers a QoS 2 resend of a publish already logged: a PUBREC in
// its turn, after the acks owed before it, with the outcome of the original
// when that is still pending.
func (h *ingest) resend(cl *mochi.Client, cs *clientState, pid uint16) {
	slot := &ackSlot{cl: cl, pid: pid, qos: 2, done: true, resend: true}
	cs.mu.Lock()
	for _, s := range cs.queue {
		if s.pid == pid && s.qos == 2 && !s.resend {
			slot.original = s
		}
	}
	cs.queue = append(cs.queue, slot)
	cs.resends++
	cs.mu.Unlock()
	h.resolvedHere(cs, slot, nil)
}

// resolved marks slot done. It runs on the log's goroutine, which calls
// Broker.ReleaseAcks after a run of them: the client is only listed here, so
// all the acks a batch resolves for one client leave in one write.
func (h *ingest) resolved(cs *clientState, slot *ackSlot, err error) {
	cs.mu.Lock()
	slot.done, slot.err = true, err
	list := !cs.writing && !cs.listed && cs.queue[0].done
	if list {
		cs.listed = true
	}
	cs.mu.Unlock()
	if list {
		h.readyMu.Lock()
		h.ready = append(h.ready, cs)
		h.readyMu.Unlock()
	}
}

// resolvedHere marks slot done from a client's read loop (refusals,
// resends) and starts a writer if none runs.
func (h *ingest) resolvedHere(cs *clientState, slot *ackSlot, err error) {
	cs.mu.Lock()
	slot.done, slot.err = true, err
	start := !cs.writing && cs.queue[0].done
	if start {
		cs.writing = true
	}
	cs.mu.Unlock()
	if start {
		h.b.goFunc(func() { h.release(cs) })
	}
}

// releaseReady writes the acks of the clients resolved listed. It runs on
// the log's goroutine, so it never blocks: a write the socket cannot take
// whole, a client whose lock is busy, or a failed ack goes to a writer
// goroutine of that client. Concurrent calls are safe: each client is
// written by whoever set its writing flag.
func (h *ingest) releaseReady() {
	h.readyMu.Lock()
	ready := h.ready
	h.ready = nil
	h.readyMu.Unlock()
	for _, cs := range ready {
		cs.mu.Lock()
		cs.listed = false
		if cs.writing {
			cs.mu.Unlock()
			continue // its writer goroutine picks these up
		}
		batch := h.takeDone(cs)
		if len(batch) == 0 {
			cs.mu.Unlock()
			continue
		}
		cs.writing = true
		cs.mu.Unlock()
		h.releaseBatch(cs, batch)
	}
}

// releaseBatch tries to write batch at once; what it cannot goes on in a
// writer goroutine, which also drains whatever got done meanwhile.
func (h *ingest) releaseBatch(cs *clientState, batch []*ackSlot) {
	cl := batch[0].cl
	simple := true
	for _, s := range batch {
		if s.err != nil || s.cl != cl {
			simple = false
			break
		}
	}
	if simple {
		buf := bufPool.Get().(*bytes.Buffer)
		defer bufPool.Put(buf)
		buf.Reset()
		for _, s := range batch {
			h.encodeAck(s, buf)
		}
		rest, ok := h.tryWrite(cs, cl, buf.Bytes())
		if ok && len(rest) == 0 {
			h.release(cs) // normally finds nothing more and returns
			return
		}
		if ok {
			rest = append([]byte(nil), rest...)
			h.b.goFunc(func() {
				h.writeAll(cl, rest)
				h.release(cs)
			})
			return
		}
	}
	h.b.goFunc(func() {
		h.writeBatch(batch)
		h.release(cs)
	})
}

// takeDone removes the done acks at the head of cs's queue and returns
// them, in cs.batch: the caller holds writing, or sets it before it lets
// cs.mu go, and is done with the previous batch. Called with cs.mu held.
// Off the queue before the write: the client may send its next publish the
// moment it reads these acks, and must not find them still counted against
// its receive maximum (FACTS.md).
func (h *ingest) takeDone(cs *clientState) []*ackSlot {
	n := 0
	for n < len(cs.queue) && cs.queue[n].done {
		n++
	}
	if n == 0 {
		return nil
	}
	clear(cs.batch) // the last batch is written: its slots may go
	batch := append(cs.batch[:0], cs.queue[:n]...)
	cs.batch = batch
	cs.queue = append(cs.queue[:0], cs.queue[n:]...)
	for _, s := range batch {
		if s.resend {
			cs.resends--
		}
		if s.original != nil {
			s.err = s.original.err // released before s: the queue is in order
		}
		if s.err == nil && s.qos == 2 && !s.resend {
			cs.awaitingRel++
		}
	}
	cs.released.Broadcast()
	return batch
}

// tryWrite writes b to cl's socket without blocking, under the client's
// lock (the one mochi's WritePacket takes). ok is false when it could not
// try (lock busy, no raw socket); rest is what the socket did not take.
func (h *ingest) tryWrite(cs *clientState, cl *mochi.Client, b []byte) (rest []byte, ok bool) {
	if cl.Closed() || cl.Net.Conn == nil {
		return nil, true // the record is durable; a QoS 1 resend is an allowed duplicate
	}
	if cs.rawFor != cl {
		cs.raw, cs.rawFor = nil, cl
		if sc, isSC := cl.Net.Conn.(syscall.Conn); isSC {
			cs.raw, _ = sc.SyscallConn()
		}
		if cs.rawWrite == nil {
			cs.rawWrite = func(fd uintptr) bool {
				cs.wn, cs.werr = syscall.Write(int(fd), cs.wbuf)
				return true // never wait: that is the writer goroutine's job
			}
		}
	}
	if cs.raw == nil || !cl.TryLock() {
		return b, false
	}
	cs.wbuf, cs.wn, cs.werr = b, 0, nil
	err := cs.raw.Write(cs.rawWrite)
	n, werr := cs.wn, cs.werr
	cs.wbuf = nil
	cl.Unlock()
	if n > 0 {
		atomic.AddInt64(&h.b.srv.Info.BytesSent, int64(n))
	}
	if err != nil || (werr != nil && werr != syscall.EAGAIN) {
		return nil, true // connection gone: mochi's read loop cleans up
	}
	return b[max(n, 0):], true
}

// writeAll writes b to cl, blocking, under the client's lock.
func (h *ingest) writeAll(cl *mochi.Client, b []byte) {
	buf := bytes.NewBuffer(b)
	h.flush(cl, buf)
}

// writeBatch encodes and writes batch, blocking, one write per client run.
func (h *ingest) writeBatch(batch []*ackSlot) {
	var buf bytes.Buffer
	var last *mochi.Client
	for _, s := range batch {
		if last != nil && s.cl != last {
			h.flush(last, &buf)
		}
		last = s.cl
		h.encodeAck(s, &buf)
	}
	h.flush(last, &buf)
}

// release writes the acks at the head of cs's queue that are done, in
// order, coalescing each run into one write, until none is left; it owns
// cs.writing while it runs. One writer per client at a time, so a client
// that stops reading blocks only its own acks.
func (h *ingest) release(cs *clientState) {
	for {
		cs.mu.Lock()
		batch := h.takeDone(cs)
		if len(batch) == 0 {
			cs.writing = false
			cs.mu.Unlock()
			return
		}
		cs.mu.Unlock()
		h.writeBatch(batch)
	}
}

// encodeAck appends slot's ack to buf, or acts on its failure.
func (h *ingest) encodeAck(s *ackSlot, buf *bytes.Buffer) {
	cl := s.cl
	v5 := cl.Properties.ProtocolVersion == 5
	if !s.resend { // a resend answers a publish already counted
		h.b.observer().Acked(s.mode, s.err, time.Since(s.start))
	}
	if s.err != nil {
		h.b.log4(cl, s, s.err)
		if s.qos == 2 {
			// The client may retry this id; mochi's PUBREC entry is stale.
			cs := h.state(cl.ID)
			cs.mu.Lock()
			cs.failedQoS2[s.pid] = true
			cs.mu.Unlock()
			h.b.persist.qos2Delete(cl.ID, s.pid)
		}
		if !v5 {
			// 3.1.1 has no negative ack: disconnect; the client resends.
			// (mochi's DisconnectClient would send a DISCONNECT, which a
			// 3.1.1 server must not.)
			h.flush(cl, buf)
			cl.Stop(packets.ErrUnspecifiedError)
			return
		}
	}
	typ := byte(packets.Puback)
	if s.qos == 2 {
		typ = packets.Pubrec
	}
	if s.err == nil {
		// A success has no reason code or properties: the 4 bytes mochi
		// would encode, without its buffers and property checks (a fifth
		// of the acker's CPU when encoded by mochi).
		_, _ = buf.Write([]byte{typ << 4, 2, byte(s.pid >> 8), byte(s.pid)})
		return
	}
	code := packets.ErrUnspecifiedError
	switch {
	case errors.Is(s.err, ErrQuota):
		code = packets.ErrQuotaExceeded
	case errors.Is(s.err, ErrNotAuthorized):
		code = packets.ErrNotAuthorized
	}
	pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: typ}, PacketID: s.pid, ProtocolVersion: cl.Properties.ProtocolVersion, ReasonCode: code.Code}
	if !(cl.Properties.Props.RequestProblemInfoFlag && cl.Properties.Props.RequestProblemInfo == 0) {
		pk.Properties.ReasonString = s.err.Error()
	}
	if typ == packets.Puback {
		_ = pk.PubackEncode(buf)
	} else {
		_ = pk.PubrecEncode(buf)
	}
}

// flush writes buf to cl in one write under the client's lock, the lock
// mochi's WritePacket takes, so packets never interleave.
func (h *ingest) flush(cl *mochi.Client, buf *bytes.Buffer) {
	if buf.Len() == 0 || cl == nil {
		return
	}
	defer buf.Reset()
	if cl.Closed() || cl.Net.Conn == nil {
		return // the record is durable; a QoS 1 resend is an allowed duplicate
	}
	cl.Lock()
	n, err := cl.Net.Conn.Write(buf.Bytes())
	cl.Unlock()
	atomic.AddInt64(&h.b.srv.Info.BytesSent, int64(n))
	if err != nil {
		h.b.logger.Debug("writing acks failed", "client", cl.ID, "error", err)
	}
}

// OnWill takes the will over: mochi's sendLWT bypasses OnPublish and cannot
// be vetoed, so the will is proposed here as a record and mochi is handed an
// inert copy with no topic, which reaches no subscriber (FACTS.md).
func (h *ingest) OnWill(cl *mochi.Client, will mochi.Will) (mochi.Will, error) {
	if will.TopicName == "" {
		return will, nil
	}
	if !mochi.IsValidFilter(will.TopicName, true) {
		// A will topic with wildcards passes mochi's CONNECT checks but no
		// subscriber could receive it: not logged.
		h.b.logger.Warn("will with an invalid topic dropped", "client", cl.ID, "topic", will.TopicName)
		return mochi.Will{Flag: will.Flag}, nil
	}
	m := &Message{ClientID: cl.ID, Topic: will.TopicName, QoS: will.Qos, Retain: will.Retain, Will: true, Payload: will.Payload, User: will.User}
	if d := will.WillDelayInterval; d > 0 && cl.Properties.ProtocolVersion == 5 {
		h.mu.Lock()
		if old := h.wills[cl.ID]; old != nil {
			old.Stop()
		}
		h.wills[cl.ID] = time.AfterFunc(time.Duration(d)*time.Second, func() {
			h.mu.Lock()
			delete(h.wills, cl.ID)
			h.mu.Unlock()
			h.proposeWill(m)
		})
		h.mu.Unlock()
	} else {
		h.proposeWill(m)
	}
	return mochi.Will{Flag: will.Flag}, nil
}

func (h *ingest) proposeWill(m *Message) {
	m.Time = time.Now().UnixNano()
	h.b.log.Reserve(m)
	h.b.log.Propose(m, AckFor(h.b.topicPolicies(), m.Topic), h.b.logFailure)
}

// wakeAll wakes every read loop held by back-pressure (at Stop).
func (h *ingest) wakeAll() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, cs := range h.clients {
		cs.mu.Lock()
		cs.released.Broadcast()
		cs.mu.Unlock()
	}
}

// OnDisconnect forgets a client's ack bookkeeping once nothing is owed, so
// the map does not grow with every client id ever seen.
func (h *ingest) OnDisconnect(cl *mochi.Client, _ error, _ bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	cs := h.clients[cl.ID]
	if cs == nil {
		return
	}
	cs.mu.Lock()
	idle := len(cs.queue) == 0 && !cs.writing && len(cs.failedQoS2) == 0 && cs.awaitingRel == 0
	cs.mu.Unlock()
	if idle {
		delete(h.clients, cl.ID)
	}
}

// stopWills cancels delayed wills at shutdown: they are not due yet.
func (h *ingest) stopWills() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for id, t := range h.wills {
		t.Stop()
		delete(h.wills, id)
	}
}

// log4 logs a refused publish once per failure, with its reason.
func (b *Broker) log4(cl *mochi.Client, s *ackSlot, err error) {
	b.logger.Warn("publish not acked", "client", cl.ID, "packet_id", s.pid, "qos", s.qos, "error", err)
}

// logFailure is the done callback of publishes nobody acks (QoS 0, wills).
func (b *Broker) logFailure(err error) {
	if err != nil {
		b.logger.Warn("unacknowledged publish not logged", "error", err)
	}
}
