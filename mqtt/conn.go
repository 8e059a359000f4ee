package mqtt

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
)

// Listener ids, for log lines and the TLS identity rule.
const (
	listenerID    = "tcp"
	tlsListenerID = "tls"
)

// codes the server ends connections with.
var (
	codeShutdown  = packets.ErrServerShuttingDown
	codeTakenOver = packets.ErrSessionTakenOver
)

// conn is one client connection: a read loop (run) and one writer at a
// time (writer), which alone writes the socket. Everything the client is
// sent goes through the writer: control packets encoded into ctrl, acks
// from the ack queue in the order their publishes came, deliveries from
// the session. A client that stops reading blocks only its own writer.
type conn struct {
	srv      *Server
	nc       net.Conn
	br       *bufio.Reader // read's; nil once loopRaw reads (readraw.go)
	in       inBuf         // loopRaw's
	rl       *rawLoop      // loopRaw's state; nil on read's path
	parkedFD int32         // fd+1 while parked (readpark.go); guarded by the idler's mu
	listener string
	host     string // source key, for refusals
	// rateLimited: the source is over the connect rate; its CONNECT is
	// read only to be refused (listen.go). Set before run.
	rateLimited bool

	// Set by CONNECT, then read-only.
	v         byte // protocol version: 3, 4 (3.1.1) or 5
	id        string
	user      string
	sess      *session
	keepalive uint16
	authed    bool
	window    int    // the client's receive maximum: outbound QoS 1/2 in flight
	maxPacket uint32 // the client's maximum packet size, 0 for none
	aliasMax  uint16 // the client's topic alias maximum
	noProblem bool   // the client asked for no reason strings [MQTT-3.1.2-29]
	will      *Message
	willDelay uint32
	addrSlot  bool // counted in the server's connCounts by address, until finish
	userSlot  bool // ... and by user

	aliasIn map[uint16]string // read loop only

	amu        sync.Mutex // guards acks, resends, closedAcks
	acks       []*inAck   // acks owed, in the order the publishes came
	resends    int        // resend slots in acks (not counted against the receive maximum)
	acond      *sync.Cond // signalled when acks are taken (3.1.1 back-pressure)
	closedAcks bool

	wmu        sync.Mutex // guards ctrl, writing, again, closeAfter, resume, connacked, ended, startErr
	ctrl       []byte     // encoded control packets not yet written
	writing    bool       // a writer goroutine runs
	again      bool       // work arrived while the writer ran
	closeAfter bool       // close the socket once ctrl is written
	// heldIn is what this connection's publishes waiting for the log are
	// charged in the memory account; memSig is signalled when it drops
	// (memory.go).
	heldIn atomic.Int64
	memSig chan struct{}
	// willCharge is what the will is charged while the connection holds
	// it; the read loop's goroutine alone touches it.
	willCharge int64
	// refusedConnect: a refusing CONNACK was sent (the read loop's own);
	// the socket lingers before it closes, as after a DISCONNECT.
	refusedConnect bool
	resume         bool // the session's inflight messages are owed a resend
	connacked      bool // the CONNACK is queued: only then may anything else go out
	ended          bool
	// startErr is why the start record of the resumed session could not
	// be logged, when that came before the CONNACK: the CONNECT is
	// refused instead (startNotLogged).
	startErr error

	startWriter func() // runWriter as a func value, made once

	// wconn is the socket's RawConn when acks may be written on the
	// goroutine that resolves them (plain TCP; not TLS or WebSocket,
	// whose framing only their own Write does), nil otherwise; wconnFn is
	// rawWrite as a func value. Both are set once, under wmu, by the
	// first kickHere.
	wconn    syscall.RawConn
	wconnFn  func(fd uintptr) bool
	wconnSet bool

	// The writer's own (whoever holds writing).
	wbuf     []byte // a round's buffer; between rounds, what kickHere left unwritten
	wconnBuf []byte // what rawWrite writes
	wconnN   int    // what rawWrite wrote, 0 for nothing
	ackBatch []*inAck
	writeBy  time.Time // the write deadline set last
	aliasOut map[string]uint16

	done     chan struct{} // closed when the connection has ended
	endOnce  sync.Once
	endCode  packets.Code // why the server ended it (zero: the client or the network)
	graceful bool         // the client sent DISCONNECT without will
	// noWill drops the will: the server ended the connection to have the
	// device connect again at once (endedBeforeStartLocked), not because
	// it was lost.
	noWill    atomic.Bool
	writerEnd chan struct{}
}

// inAck is one PUBACK/PUBREC owed to the client.
type inAck struct {
	c      *conn
	pid    uint16
	qos    byte
	done   bool
	err    error
	mode   AckMode
	start  time.Time
	resend bool // a QoS 2 resend answered without a new record
	// comp marks a PUBCOMP, owed once the inbound release record is
	// logged (pubrel); unknown: for an id with no flow here (MQTT 5:
	// 0x92). Its flow holds the receive maximum until the PUBCOMP
	// [MQTT-4.9.0-1], so PUBRELs cannot queue records without bound.
	comp, unknown bool
	in2           *inbound2 // QoS 2: the inbound entry this publish made
	// resent marks a QoS 2 resend (DUP) of an id unknown here, logged
	// again on a persistent session: when its proposal fails, its late
	// original may be the message, delivered (resendDeliveredLocked).
	resent bool
	// charged is the memory this publish holds while the log takes it
	// (memory.go), given back when it is resolved.
	charged int64
}

func newConn(s *Server, nc net.Conn, listener, host string) *conn {
	c := &conn{srv: s, nc: nc, listener: listener, host: host, br: newReader(nc),
		done: make(chan struct{}), writerEnd: make(chan struct{}), memSig: make(chan struct{}, 1)}
	c.acond = sync.NewCond(&c.amu)
	c.startWriter = c.runWriter
	return c
}

// messages holds the Messages publishes are proposed as: the Log keeps
// nothing of one past Propose (Log's rule). One per publish was an
// allocation of 200-odd bytes, one per connection 208 bytes of every idle
// connection.
var messages = sync.Pool{New: func() any { return new(Message) }}

// putMessage gives m back to messages, holding nothing of its packet's.
func putMessage(m *Message) {
	*m = Message{}
	messages.Put(m)
}

// newReader is read's bufio.Reader on nc, from a pool: loopRaw gives it
// back once CONNECT is read.
func newReader(nc net.Conn) *bufio.Reader {
	br := readers.Get().(*bufio.Reader)
	br.Reset(nc)
	return br
}

// errProtocol wraps the reason a connection broke the protocol: code for
// the client, why (may be empty) for the log.
type errProtocol struct {
	code packets.Code
	why  string
}

func (e errProtocol) Error() string {
	if e.why != "" {
		return "protocol error: " + e.code.Reason + ": " + e.why
	}
	return "protocol error: " + e.code.Reason
}

// run is the read loop: CONNECT, then packets until the connection ends.
//
// The CONNECT (TLS handshake, bcrypt, the session's first save) runs deep
// and grows its goroutine's stack; the loop after it goes on in a fresh
// goroutine, whose small stack is what an idle connection keeps. ended is
// called once the connection has ended, on whichever goroutine.
func (c *conn) run(ended func()) {
	if !c.open() {
		c.finish()
		ended()
		return
	}
	if c.srv.rawReads.Load() {
		if rc := c.rawConn(); rc != nil {
			c.startRaw(rc, ended)
			return
		}
	}
	c.srv.goFunc(func() {
		defer ended()
		defer c.finish()
		c.loop()
	})
}

// open runs the TLS handshake and the CONNECT; false when the connection
// did not make it.
func (c *conn) open() bool {
	wait := c.srv.cfg.Limits.ConnectTimeout
	if c.rateLimited {
		wait = min(wait, rateTellWait)
	}
	_ = c.nc.SetReadDeadline(time.Now().Add(wait))
	if tc, ok := c.nc.(*tls.Conn); ok {
		if err := tc.Handshake(); err != nil {
			if !quietEnd(err) {
				c.srv.refusal(c.host, "TLS handshake failed", "remote", c.remote(), "error", err)
			}
			return false
		}
	}
	return c.connect()
}

// loop reads and handles packets until the connection ends.
func (c *conn) loop() {
	var pk packets.Packet
	ka := time.Duration(c.keepalive) * 1500 * time.Millisecond
	var by time.Time // the read deadline set last
	if ka == 0 {
		_ = c.nc.SetReadDeadline(time.Time{})
	}
	for {
		if !c.readyToRead(ka, &by) {
			return
		}
		if err := c.read(&pk); err != nil {
			c.readFailed(err)
			return
		}
		if !c.handle(&pk) {
			return
		}
	}
}

// read reads one packet into pk, which it zeroes first (a Packet is 800
// bytes: returned by value, it was copied once more per packet). Before
// CONNECT is authenticated a packet may take at most preAuthMaxPacket
// bytes, out of a budget shared by every such connection. On an error pk
// holds what was decoded.
func (c *conn) read(pk *packets.Packet) error {
	*pk = packets.Packet{}
	hb, err := c.br.ReadByte()
	if err != nil {
		return err
	}
	if err := pk.FixedHeader.Decode(hb); err != nil {
		return errProtocol{code: packets.ErrMalformedPacket}
	}
	rem, lenBytes, err := packets.DecodeLength(c.br)
	if err != nil {
		if errors.Is(err, packets.ErrMalformedVariableByteInteger) {
			return errProtocol{code: packets.ErrMalformedPacket}
		}
		return err
	}
	if err := c.header(pk, hb, rem, lenBytes); err != nil {
		return err
	}
	if !c.authed {
		if !c.srv.preAuth.take(rem) {
			return errors.New("pre-connect buffer budget exhausted")
		}
		defer c.srv.preAuth.give(rem)
	}
	// A buffer per packet: mochi's decoder makes strings (topic, client
	// id, filters, user properties) that point into it, without a copy,
	// so it must never be reused.
	buf := make([]byte, rem)
	if _, err := io.ReadFull(c.br, buf); err != nil {
		return err
	}
	return c.decodeBody(pk, buf)
}

// header fills pk's fixed header from its first byte hb and Remaining
// Length rem (encoded in lenBytes), refusing a packet over the size limit:
// before CONNECT is authenticated, preAuthMaxPacket.
func (c *conn) header(pk *packets.Packet, hb byte, rem, lenBytes int) error {
	if err := pk.FixedHeader.Decode(hb); err != nil {
		return errProtocol{code: packets.ErrMalformedPacket}
	}
	limit := int(c.srv.cfg.MaxPacketSize)
	if !c.authed {
		limit = min(limit, preAuthMaxPacket)
	}
	if 1+lenBytes+rem > limit {
		return errProtocol{code: packets.ErrPacketTooLarge} // [MQTT-3.2.2-15]
	}
	pk.FixedHeader.Remaining = rem
	pk.ProtocolVersion = c.v
	return nil
}

// decodeBody decodes a packet's body, buf, into pk, whose fixed header is
// filled; pk keeps pointing into buf.
func (c *conn) decodeBody(pk *packets.Packet, buf []byte) error {
	if plainPublish(pk, buf, c.v == 5) {
		// Nearly every packet: nothing for checkWire to look at.
		if err := decodePlainPublish(pk, buf); err != nil {
			return errProtocol{code: packets.ErrMalformedPacket, why: err.Error()}
		}
		return nil
	}
	if err := decode(pk, buf); err != nil {
		return errProtocol{code: packets.ErrMalformedPacket, why: err.Error()}
	}
	if e := checkWire(pk, buf); e != nil {
		return errProtocol{e.code, e.why}
	}
	return nil
}

// decodePlainPublish decodes a PUBLISH that plainPublish took. An MQTT 5
// one is decoded as 3.1.1 (topic, packet id, payload), and its empty
// properties block, the payload's first byte then, is dropped: mochi's
// decoder would allocate a reader for those properties, on every publish.
func decodePlainPublish(pk *packets.Packet, buf []byte) error {
	v := pk.ProtocolVersion
	pk.ProtocolVersion = 4
	err := decode(pk, buf)
	pk.ProtocolVersion = v
	if err == nil && v == 5 {
		pk.Payload = pk.Payload[1:]
	}
	return err
}

// decode decodes buf into pk by its type. A panic in the codec (mochi
// v2.7.9's SUBSCRIBE decoder indexes past a malformed packet's end) is a
// malformed packet of this connection, not a crash of the gateway.
func decode(pk *packets.Packet, buf []byte) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("decoder panic: %v", r)
		}
	}()
	switch pk.FixedHeader.Type {
	case packets.Connect:
		return pk.ConnectDecode(buf)
	case packets.Publish:
		return pk.PublishDecode(buf)
	case packets.Puback:
		return pk.PubackDecode(buf)
	case packets.Pubrec:
		return pk.PubrecDecode(buf)
	case packets.Pubrel:
		return pk.PubrelDecode(buf)
	case packets.Pubcomp:
		return pk.PubcompDecode(buf)
	case packets.Subscribe:
		return pk.SubscribeDecode(buf)
	case packets.Unsubscribe:
		return pk.UnsubscribeDecode(buf)
	case packets.Pingreq:
		return nil
	case packets.Disconnect:
		return pk.DisconnectDecode(buf)
	case packets.Auth:
		return pk.AuthDecode(buf)
	}
	return fmt.Errorf("packet type %d not for a server", pk.FixedHeader.Type)
}

// readFailed ends the connection after a read error: a protocol error
// gets its DISCONNECT (MQTT 5) and a log line; the peer going away does
// not.
func (c *conn) readFailed(err error) {
	var pe errProtocol
	switch {
	case c.isEnded():
		// The server ended it (a take-over, a refusal, Stop): the read
		// was cut on purpose.
	case errors.As(err, &pe):
		if pe.code == packets.ErrPacketTooLarge {
			c.srv.refusal(c.host, "packet larger than max_packet_size: disconnected", "remote", c.remote(), "client", c.id)
		} else {
			c.srv.refusal(c.host, "protocol error: disconnected", "remote", c.remote(), "client", c.id, "error", pe.Error())
		}
		c.end(pe.code)
	case errors.Is(err, os.ErrDeadlineExceeded) && !c.authed:
		c.srv.refusal(c.host, "no CONNECT within the connect timeout", "remote", c.remote())
	case errors.Is(err, os.ErrDeadlineExceeded):
		c.srv.lines.Debug("keep alive timeout", "client", c.id)
		c.end(packets.ErrKeepAliveTimeout)
	case quietEnd(err):
		c.srv.lines.Debug("client connection ended", "client", c.id, "remote", c.remote(), "error", err)
	default:
		c.srv.refusal(c.host, "connection failed", "remote", c.remote(), "client", c.id, "error", err)
	}
}

func (c *conn) remote() string { return c.nc.RemoteAddr().String() }

// handle acts on one packet of a connected client; false ends the loop.
func (c *conn) handle(pk *packets.Packet) bool {
	switch pk.FixedHeader.Type {
	case packets.Publish:
		return c.publish(pk)
	case packets.Puback:
		if c.sess.acked(pk.PacketID, 1) {
			c.kick() // the window has room
		}
	case packets.Pubrec:
		if ok, release := c.sess.received(pk.PacketID, pk.ReasonCode >= 0x80); ok {
			switch {
			case pk.ReasonCode >= 0x80:
				c.kick()
			case release:
				c.sess.releaseNext() // PUBREL once the other members know
			default:
				c.send(&packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: pk.PacketID})
			}
		} else {
			rel := &packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: pk.PacketID}
			if c.v == 5 {
				rel.ReasonCode = packets.ErrPacketIdentifierNotFound.Code // [MQTT-4.3.3-?]: no such flow
			}
			c.send(rel)
		}
	case packets.Pubcomp:
		if c.sess.acked(pk.PacketID, 2) {
			c.kick()
		}
	case packets.Pubrel:
		return c.pubrel(pk.PacketID)
	case packets.Subscribe:
		return c.subscribe(pk)
	case packets.Unsubscribe:
		return c.unsubscribe(pk)
	case packets.Pingreq:
		c.send(&packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingresp}})
	case packets.Disconnect:
		return c.disconnect(pk)
	case packets.Connect:
		c.protocolError(packets.ErrProtocolViolationSecondConnect, "second CONNECT") // [MQTT-3.1.0-2]
		return false
	case packets.Auth:
		c.protocolError(packets.ErrBadAuthenticationMethod, "AUTH without an authentication method")
		return false
	}
	return true
}

// protocolError ends the connection for a violation: MQTT 5 with a
// DISCONNECT carrying code, 3.1.1 by closing, its only way.
func (c *conn) protocolError(code packets.Code, why string) {
	c.srv.refusal(c.host, why+": disconnected", "client", c.id, "remote", c.remote())
	c.end(code)
}

// disconnect handles the client's DISCONNECT.
func (c *conn) disconnect(pk *packets.Packet) bool {
	if c.v == 5 && pk.Properties.SessionExpiryIntervalFlag {
		s := c.sess
		s.mu.Lock()
		was := s.expiry
		if was == 0 && pk.Properties.SessionExpiryInterval > 0 {
			s.mu.Unlock()
			c.protocolError(packets.ErrProtocolViolation, "session expiry set at DISCONNECT after 0 at CONNECT") // [MQTT-3.14.2-2]
			return false
		}
		s.expiry = pk.Properties.SessionExpiryInterval
		s.mu.Unlock()
		if was != s.expiry {
			c.srv.saveSession(s)
		}
	}
	// 0x04 asks for the will; anything else sent by the client drops it
	// [MQTT-3.1.2-10].
	c.graceful = pk.ReasonCode != packets.CodeDisconnectWillMessage.Code
	c.end(packets.Code{})
	return false
}

// send queues a control packet to the writer (kickHere: written by the
// caller when no writer runs).
func (c *conn) send(pk *packets.Packet) {
	var buf bytes.Buffer
	c.encode(pk, &buf)
	c.wmu.Lock()
	c.ctrl = append(c.ctrl, buf.Bytes()...)
	c.wmu.Unlock()
	c.kickHere()
}

// encode appends pk's encoding for this client to buf, with the client's
// limits applied.
func (c *conn) encode(pk *packets.Packet, buf *bytes.Buffer) {
	pk.ProtocolVersion = c.v
	pk.Mods.MaxSize = c.maxPacket
	pk.Mods.DisallowProblemInfo = c.noProblem
	pk.Mods.AllowResponseInfo = true
	if !c.srv.cfg.AckReasonStrings && isAck(pk.FixedHeader.Type) {
		pk.Properties.ReasonString = ""
	}
	var err error
	switch pk.FixedHeader.Type {
	case packets.Connack:
		err = pk.ConnackEncode(buf)
	case packets.Puback:
		err = pk.PubackEncode(buf)
	case packets.Pubrec:
		err = pk.PubrecEncode(buf)
	case packets.Pubrel:
		err = pk.PubrelEncode(buf)
	case packets.Pubcomp:
		err = pk.PubcompEncode(buf)
	case packets.Suback:
		err = pk.SubackEncode(buf)
	case packets.Unsuback:
		err = pk.UnsubackEncode(buf)
	case packets.Pingresp:
		err = pk.PingrespEncode(buf)
	case packets.Disconnect:
		err = pk.DisconnectEncode(buf)
	default:
		err = fmt.Errorf("no encoder for packet type %d", pk.FixedHeader.Type)
	}
	if err != nil {
		c.srv.lines.Error("encoding a packet failed", "client", c.id, "type", pk.FixedHeader.Type, "error", err)
	}
}

// isAck reports whether typ is an ack, whose Reason String only
// Config.AckReasonStrings lets out.
func isAck(typ byte) bool {
	switch typ {
	case packets.Puback, packets.Pubrec, packets.Pubrel, packets.Pubcomp, packets.Suback, packets.Unsuback:
		return true
	}
	return false
}

// end ends the connection: an MQTT 5 client is sent DISCONNECT with code
// when it is a server's reason (not for a zero code), then the socket
// closes once the writer has written what it holds.
func (c *conn) end(code packets.Code) { c.endTo(code, "", "") }

// endTo is end with a DISCONNECT that names another server (ref, the
// Server Reference) and says why (a Reason String); both may be empty.
func (c *conn) endTo(code packets.Code, ref, why string) {
	c.endOnce.Do(func() {
		c.endCode = code
		c.wmu.Lock()
		c.ended = true
		if code.Code >= 0x80 && c.v == 5 && c.authed {
			var buf bytes.Buffer
			pk := &packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}, ReasonCode: code.Code}
			pk.Properties.ServerReference = ref
			pk.Properties.ReasonString = why
			c.encode(pk, &buf)
			c.ctrl = append(c.ctrl, buf.Bytes()...)
		}
		c.closeAfter = true
		c.wmu.Unlock()
		c.amu.Lock()
		c.closedAcks = true
		c.acond.Broadcast()
		c.amu.Unlock()
		// A writer stuck on a client that stopped reading is cut loose
		// by a deadline.
		_ = c.nc.SetWriteDeadline(time.Now().Add(time.Second))
		c.kick()
		c.unpark() // a parked read loop finishes (readpark.go)
	})
}

// isEnded reports whether end has run.
func (c *conn) isEnded() bool {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	return c.ended
}

// finish runs when the read loop ends: the session goes offline (or
// ends), the will is due, the socket closes. A socket that lingers does so
// after the rest: a take-over waits for done, and the client taking over
// (often the same device, its old connection half-open) is not to wait
// for its old socket's drain (the paho 3.1.1 suite, which allows 0.5 s
// for a CONNACK, timed out).
func (c *conn) finish() {
	c.end(packets.Code{})
	<-c.writerEnd
	linger := c.endCode.Code >= 0x80 || c.refusedConnect
	if !linger {
		c.nc.Close()
	}
	c.giveSlots()
	close(c.done)
	if c.sess != nil {
		c.srv.detach(c)
	}
	c.srv.mem.release(c.willCharge) // proposed or dropped; a delayed one took it
	if linger {
		c.linger()
		c.nc.Close()
	}
}

// lingerFor and lingerBytes bound how long, and how much, a connection the
// server ended with a reason is drained before it is closed.
const (
	lingerFor   = 500 * time.Millisecond
	lingerBytes = 4 << 20
)

// linger closes the write side after the DISCONNECT or refusing CONNACK,
// then reads and discards what the client still sends, until it closes,
// lingerFor passes or lingerBytes came: a close with unread data in the
// socket sends a reset, which makes the client's stack throw away the
// reason code it has not read yet (FACTS.md: the paho suite saw
// ConnectionResetError instead of 0x93).
func (c *conn) linger() {
	cw, ok := c.nc.(interface{ CloseWrite() error })
	if !ok || cw.CloseWrite() != nil {
		return
	}
	_ = c.nc.SetReadDeadline(time.Now().Add(lingerFor))
	_, _ = io.CopyN(io.Discard, c.nc, lingerBytes)
}

// kick has the writer run: started if none runs, told to go round again
// if one does.
func (c *conn) kick() {
	c.wmu.Lock()
	if !c.takeWritingLocked() {
		c.wmu.Unlock()
		return
	}
	c.wmu.Unlock()
	c.goWriter()
}

// takeWritingLocked makes the caller the writer (writing), unless one
// runs, which it tells to go round again, or the connection has ended.
// Called with wmu held.
func (c *conn) takeWritingLocked() bool {
	if c.writing {
		c.again = true
		return false
	}
	if c.writerClosed() {
		return false // the connection has ended
	}
	c.writing = true
	return true
}

// goWriter starts a writer goroutine for the caller, which holds writing.
func (c *conn) goWriter() {
	c.srv.wg.Add(1)
	go c.startWriter() // made once per connection: a kick per ack allocates nothing
}

// kickHere is kick for control packets and acks that have become
// writable: when no writer runs and the session has nothing to hand out
// or read back, the caller writes them itself, in one write that never
// waits (rawWrite), instead of starting a goroutine for it. Whatever that
// write could not take, and anything else owed, goes to a writer
// goroutine as from kick, which writes it first. The caller (the read
// loop, or the goroutine that resolves the log's outcomes for every
// connection) is thus never held by a client that does not read. The
// order on the wire is a writer round's: control packets, then the acks
// in the order their publishes came; deliveries, which a writer round
// puts after them, are always a writer goroutine's.
func (c *conn) kickHere() {
	if !c.srv.inlineWrites.Load() {
		c.kick()
		return
	}
	// Looked at first, under the session's lock alone: what is offered
	// after this look kicks, and finds the writer running.
	quiet := c.sess == nil || c.sess.quietFor(c)
	c.wmu.Lock()
	if !c.takeWritingLocked() {
		c.wmu.Unlock()
		return
	}
	if !c.wconnSet {
		c.wconnSet = true
		if tc, ok := c.nc.(*net.TCPConn); ok {
			if rc, err := tc.SyscallConn(); err == nil {
				c.wconn, c.wconnFn = rc, c.rawWrite
			}
		}
	}
	// A round that resends, or ends the connection, or one before the
	// CONNACK, is the writer's; so is a remainder (wbuf) it still owes,
	// and one with deliveries.
	if !quiet || c.wconn == nil || c.resume || c.closeAfter || !c.connacked || len(c.wbuf) > 0 {
		c.wmu.Unlock()
		c.goWriter()
		return
	}
	c.again = false
	buf := append(c.wbuf[:0], c.ctrl...)
	c.ctrl = c.ctrl[:0]
	c.wmu.Unlock()
	if !c.writeAcksNow(buf) {
		c.goWriter()
	}
}

// writeAcksNow is kickHere's round, by the caller holding writing: the
// done acks at the head of the queue are appended to buf and buf is
// written without waiting. True when all of it went and nothing more is
// owed (writing is cleared then); false leaves writing held and what is
// left in wbuf, for a writer goroutine.
func (c *conn) writeAcksNow(buf []byte) bool {
	buf, failed := c.takeAcks(buf, time.Now())
	if failed {
		// A 3.1.1 client refused a publish: the writer writes the acks
		// before it, then closes, as its own round would.
		c.wbuf = buf
		c.end(packets.Code{})
		return false
	}
	n := 0
	if len(buf) > 0 {
		c.wconnBuf, c.wconnN = buf, 0
		if err := c.wconn.Write(c.wconnFn); err == nil {
			n = c.wconnN
		}
		c.wconnBuf = nil
	}
	rest := copy(buf, buf[n:])
	buf = buf[:rest]
	if rest == 0 && cap(buf) > 64<<10 {
		buf = nil // do not keep a burst's buffer on an idle connection
	}
	c.wbuf = buf
	c.wmu.Lock()
	if rest > 0 || c.again || len(c.ctrl) > 0 || c.closeAfter || c.resume {
		c.wmu.Unlock()
		return false
	}
	c.writing = false
	c.wmu.Unlock()
	return true
}

// rawWrite is the RawConn write callback of writeAcksNow: one write of
// wconnBuf on the non-blocking socket, and done whatever it took (true),
// so that RawConn.Write never waits for the socket to drain. A full
// socket buffer (EAGAIN) or an error leaves wconnN at 0: the writer's own
// write then waits, or meets the error and ends the connection.
func (c *conn) rawWrite(fd uintptr) bool {
	if n := writeOnce(fd, c.wconnBuf); n > 0 {
		c.wconnN = n
	}
	return true
}

// writerClosed reports whether the writer has closed writerEnd. Called
// with wmu held.
func (c *conn) writerClosed() bool {
	select {
	case <-c.writerEnd:
		return true
	default:
		return false
	}
}

// runWriter is writer on a goroutine of the server's wait group.
func (c *conn) runWriter() {
	defer c.srv.wg.Done()
	c.writer()
}

// writer writes whatever is owed until nothing is, then ends; a kick
// starts the next one. Each round goes out in one write. Once the
// connection is ending it writes only the control packets (the
// DISCONNECT last), then lets the read loop finish.
func (c *conn) writer() {
	for {
		c.wmu.Lock()
		c.again = false
		// wbuf holds what kickHere's write could not take, to go first.
		buf := append(c.wbuf, c.ctrl...)
		c.ctrl = c.ctrl[:0]
		resume, closing, connacked := c.resume, c.closeAfter, c.connacked
		c.wmu.Unlock()
		// The resend waits, and what is delivered after it, until the
		// session's start record is applied (the applier kicks the
		// writer then), as its replay does (awaitingStartLocked): a flow
		// in flight here may have been completed on the member the
		// device came from, whose release this member applies before
		// that record.
		owed := resume && !closing && connacked && c.sess.awaitingStart()
		if resume && !owed {
			c.wmu.Lock()
			c.resume = false // before the resend reads the flows: lateRelease
			c.wmu.Unlock()
		}
		failed := false
		// One clock reading per round: the acks' latencies and the write
		// deadline (a round is a batch: with many clients it holds many
		// acks).
		now := time.Now()
		if !closing && connacked {
			if resume && !owed {
				buf = c.resend(buf)
			}
			buf, failed = c.takeAcks(buf, now)
			if !failed && !owed {
				buf = c.takeDeliveries(buf)
			}
		}
		if wt := c.writeTimeout(); len(buf) > 0 && (closing || c.writeBy.Before(now.Add(wt))) {
			// Moved only when it falls short, as the read deadline;
			// when closing it is set anew (an end cuts a stuck write
			// short with a deadline of its own).
			c.writeBy = now.Add(wt + deadlineSlack(wt))
			_ = c.nc.SetWriteDeadline(c.writeBy)
		}
		if len(buf) > 0 {
			if _, err := c.nc.Write(buf); err != nil {
				failed = true
				c.srv.lines.Debug("writing to a client failed", "client", c.id, "error", err)
			}
		}
		if cap(buf) > 64<<10 {
			buf = nil // do not keep a burst's buffer on an idle connection
		}
		c.wbuf = buf[:0]
		more := false
		if failed {
			c.end(packets.Code{})
		} else if !closing && connacked && c.sess != nil {
			more = c.sess.replay(c)
		}
		c.wmu.Lock()
		if more || c.again || len(c.ctrl) > 0 || (c.closeAfter && !closing) {
			c.wmu.Unlock()
			continue
		}
		c.writing = false
		if c.closeAfter && !c.writerClosed() {
			close(c.writerEnd)
			c.wmu.Unlock()
			_ = c.nc.SetReadDeadline(time.Now()) // the read loop finishes
			return
		}
		c.wmu.Unlock()
		return
	}
}

// writeTimeout is how long one write may wait for a client that does not
// read before the connection is given up (and up to deadlineSlack more).
func (c *conn) writeTimeout() time.Duration {
	return max(30*time.Second, time.Duration(c.keepalive)*1500*time.Millisecond)
}

// deadlineSlack is what a connection's read or write deadline may run
// past its timeout d: a deadline is moved only once it is less than d
// away, to d plus this, so a connection busy with packets moves it about
// once per slack instead of once per packet. At most a second (a keep
// alive is a whole number of seconds), and 1/16 of d for short ones.
func deadlineSlack(d time.Duration) time.Duration { return min(time.Second, d/16) }

// peerCertificate returns the verified client certificate of a TLS
// connection, or nil.
func (c *conn) peerCertificate() *x509.Certificate {
	tc, ok := c.nc.(*tls.Conn)
	if !ok {
		return nil
	}
	st := tc.ConnectionState()
	if len(st.VerifiedChains) == 0 || len(st.PeerCertificates) == 0 {
		return nil
	}
	return st.PeerCertificates[0]
}

// hasDollar reports whether a topic is one of the server's ($SYS and the
// like), which clients may not publish to (4.7.2; refused per [MQTT-3.3.5-2]).
func hasDollar(topic string) bool { return strings.HasPrefix(topic, "$") }
