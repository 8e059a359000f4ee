package mqtt

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
)

// connect reads and answers the CONNECT; false ends the connection.
func (c *conn) connect() bool {
	var pk packets.Packet
	err := c.read(&pk)
	var pe errProtocol
	if errors.As(err, &pe) && pk.FixedHeader.Type == packets.Connect && pk.ProtocolVersion == 5 {
		// Decoded far enough to know an MQTT 5 client: it reads why in
		// the CONNACK [MQTT-3.1.4-1]; 3.1.1 has no code for it, and the
		// connection just closes.
		c.v = 5
		return c.refuse(&pk, pe.code, 0, "invalid CONNECT: "+pe.code.Reason, "error", pe.why)
	}
	if err != nil && c.rateLimited {
		// Nothing to tell it in: it is closed, as before it sent anything.
		c.srv.refusal(c.host, refusedRate, "listener", c.listener, "source", c.host, "error", err)
		return false
	}
	if err != nil {
		c.readFailed(err)
		return false
	}
	if pk.FixedHeader.Type != packets.Connect {
		c.srv.refusal(c.host, "first packet not CONNECT: closed", "remote", c.remote()) // [MQTT-3.1.0-1]
		return false
	}
	c.v = pk.ProtocolVersion
	code := pk.ConnectValidate()
	if code == packets.ErrProtocolViolationFlagNoPassword {
		// mochi takes a zero-length password for none; it is a password
		// [MQTT-3.1.2-19], and MQTT.js sends one for empty login fields.
		// The checks after that one still run, with a stand-in.
		pw := pk.Connect.Password
		pk.Connect.Password = []byte{0}
		code = pk.ConnectValidate()
		pk.Connect.Password = pw
	}
	if code != packets.CodeSuccess {
		switch {
		case code == packets.ErrProtocolViolationProtocolVersion || (c.v != 3 && c.v != 4 && c.v != 5):
			// [MQTT-3.1.2-2]: 0x01 to 3.1.1 clients, 0x84 to 5.
			c.v = min(max(c.v, 4), 5)
			if c.v == 5 {
				return c.refuse(&pk, packets.ErrUnsupportedProtocolVersion, 0, "unsupported protocol version")
			}
			return c.refuse(&pk, packets.Code{}, 0x01, "unsupported protocol version")
		}
		return c.refuse(&pk, packets.ErrMalformedPacket, 0, "malformed CONNECT: "+code.Reason)
	}
	if c.rateLimited {
		// The device is told why, in the words of its version.
		return c.refuse(&pk, packets.ErrConnectionRateExceeded, packets.Err3ServerUnavailable.Code, refusedRateTold,
			"listener", c.listener, "source", c.host, "connect_rate", c.srv.cfg.Limits.ConnectRate, "connect_burst", c.srv.cfg.Limits.ConnectBurst)
	}
	cp := &pk.Connect
	v5 := c.v == 5
	if v5 && pk.Properties.AuthenticationMethod != "" {
		return c.refuse(&pk, packets.ErrBadAuthenticationMethod, 0, "enhanced authentication not supported")
	}
	c.keepalive = cp.Keepalive
	ka, kept := c.srv.cfg.Limits.keepAlive(cp.Keepalive)
	if !kept {
		switch {
		case v5:
			c.keepalive = ka // told in the CONNACK's server keep alive [MQTT-3.2.2-21]
		case cp.Keepalive == 0:
			// A 3.1.1 client that asks for no keep alive cannot be told
			// the maximum, and refusing it locks out devices that never
			// ping (and the paho 3.1.1 suite, whose every connection asks
			// for 0). It is held to the maximum instead: closed once
			// silent for 1.5 × keepalive_max, so an idle or half-open
			// connection still ends (CVE-2020-13849, which made Mosquitto
			// refuse them).
			c.keepalive = ka
		default:
			return c.refuse(&pk, packets.Code{}, 0x02, "keep-alive out of bounds", "keepalive", cp.Keepalive)
		}
	}
	c.id = cp.ClientIdentifier
	if len(c.id) > c.srv.cfg.Limits.MaxClientIDLength {
		// Before the password check: it costs nothing to refuse, and the
		// id would be a key of the session map and of every record.
		return c.refuse(&pk, packets.ErrClientIdentifierNotValid, 0x02, "client id longer than max_client_id_length", "length", len(c.id))
	}
	assigned := false
	if c.id == "" {
		if !v5 && !cp.Clean {
			return c.refuse(&pk, packets.Code{}, 0x02, "empty client id with a persistent session") // [MQTT-3.1.3-8]
		}
		c.id, assigned = newClientID(), true // [MQTT-3.1.3-6]
	}
	if !c.takeAddrSlot(&pk) {
		return false
	}
	user, ok := c.authenticate(&pk)
	if !ok {
		return false
	}
	c.user = user
	if cp.WillFlag {
		if !c.checkWill(&pk) {
			return false
		}
	}
	if r := c.srv.redirect.Load(); r != nil {
		return c.refuseTo(&pk, r)
	}
	if c.srv.clients.Load() >= int64(c.srv.cfg.Limits.MaxClients) {
		return c.refuse(&pk, packets.ErrServerBusy, 0x03, "max_clients reached: CONNECT refused")
	}
	if !c.takeUserSlot(&pk) {
		return false
	}
	// The client's own limits, for what the server sends it.
	c.window = c.srv.cfg.MaxInflight
	if v5 {
		p := &pk.Properties
		if p.ReceiveMaximum > 0 {
			c.window = int(p.ReceiveMaximum)
		} else {
			c.window = 65535
		}
		c.maxPacket = p.MaximumPacketSize
		c.aliasMax = p.TopicAliasMaximum
		c.noProblem = p.RequestProblemInfoFlag && p.RequestProblemInfo == 0
	}
	expiry := uint32(0)
	if v5 {
		expiry = pk.Properties.SessionExpiryInterval
	} else if !cp.Clean {
		expiry = 0xFFFFFFFF // a 3.1.1 persistent session never expires
	}
	// Set before attach makes the connection visible: a take-over may end
	// it from another goroutine at once.
	c.authed = true
	s, present, why := c.srv.attach(c, cp.Clean, expiry)
	if s == nil && why == whyMaxSessions {
		return c.refuse(&pk, packets.ErrQuotaExceeded, 0x03, why, "max_sessions", c.srv.cfg.Limits.MaxSessions)
	}
	if s == nil && why == whySessionBytes {
		return c.refuse(&pk, packets.ErrQuotaExceeded, 0x03, why, "max_session_bytes", c.srv.cfg.Limits.MaxSessionBytes)
	}
	if s == nil {
		return c.refuse(&pk, packets.ErrClientIdentifierNotValid, 0x02, why)
	}
	ack := &packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connack}, SessionPresent: present}
	if v5 {
		p := &ack.Properties
		p.ReceiveMaximum = uint16(c.srv.cfg.MaxInflight)
		p.MaximumPacketSize = c.srv.cfg.MaxPacketSize
		p.TopicAliasMaximum = c.srv.cfg.TopicAliasMaximum
		p.RetainAvailable, p.RetainAvailableFlag = 1, true
		p.WildcardSubAvailable, p.WildcardSubAvailableFlag = 1, true
		p.SubIDAvailable, p.SubIDAvailableFlag = 1, true
		p.SharedSubAvailable, p.SharedSubAvailableFlag = 1, true
		if assigned {
			p.AssignedClientID = c.id
		}
		if !kept {
			p.ServerKeepAlive, p.ServerKeepAliveFlag = ka, true
		}
	}
	// The CONNACK and the right to send anything else are one step: the
	// session is attached already, and the applier may wake the writer
	// for it (its start record applied) before this line. Nothing may
	// go out before the CONNACK [MQTT-3.2.0-1].
	var buf bytes.Buffer
	c.encode(ack, &buf)
	c.wmu.Lock()
	if err := c.startErr; err != nil {
		c.wmu.Unlock()
		code5, why := startRefusal(err)
		return c.refuse(&pk, code5, 0x03, why, "error", err)
	}
	c.resume, c.connacked = present, true
	c.ctrl = append(c.ctrl, buf.Bytes()...)
	c.wmu.Unlock()
	c.kick()
	if r := c.srv.redirect.Load(); r != nil {
		// Redirect came between the check above and attach, after it had
		// looked at the connections online.
		c.endRedirected(r)
		return false
	}
	return true
}

// newClientID makes an id for a client that sent none.
func newClientID() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return "tandem-" + hex.EncodeToString(b[:])
}

// authenticate checks the client's credentials; it answers a refusal
// itself.
func (c *conn) authenticate(pk *packets.Packet) (user string, ok bool) {
	acc := c.srv.access.Load()
	cp := &pk.Connect
	switch cert := c.peerCertificate(); {
	case cert != nil && c.listener == tlsListenerID && c.srv.cfg.TLS.IdentityAsUsername:
		user = cert.Subject.CommonName
		if user == "" {
			return "", c.refuse(pk, packets.ErrNotAuthorized, 0x05, "client certificate without a common name")
		}
	case cp.UsernameFlag && acc.Users != nil:
		name := string(cp.Username)
		now := time.Now()
		bo := &c.srv.logins
		srcKey, userKey := "src\x00"+c.host, "user\x00"+name
		if bo.wait(srcKey, now) > 0 {
			return "", c.refuse(pk, packets.ErrBadUsernameOrPassword, 0x04, "login backoff after failed logins", "user", name)
		}
		// A name in backoff is checked once its block ends, not refused:
		// guesses for it slow down whatever their source, and its owner
		// still gets in.
		if wait := bo.wait(userKey, now); wait > 0 {
			select {
			case <-time.After(min(wait, c.srv.cfg.Limits.ConnectTimeout)):
			case <-c.srv.stopc:
				return "", false
			}
		}
		if !c.srv.checkPassword(acc.Users, name, cp.Password) {
			bo.failed(srcKey, now, sourceFreeFails, sourceMaxBlock)
			bo.failed(userKey, now, userFreeFails, userMaxBlock)
			return "", c.refuse(pk, packets.ErrBadUsernameOrPassword, 0x04, "bad user name or password", "user", name)
		}
		bo.succeeded(srcKey)
		bo.succeeded(userKey)
		user = name
	}
	if user == "" && !acc.AllowAnonymous {
		return "", c.refuse(pk, packets.ErrNotAuthorized, 0x05, "anonymous client not allowed")
	}
	return user, true
}

// checkWill validates the will and keeps it; it answers a refusal itself.
func (c *conn) checkWill(pk *packets.Packet) bool {
	cp := &pk.Connect
	topic := cp.WillTopic
	if why := c.srv.cfg.Limits.topicProblem(topic); why != "" || !validTopic(topic) || hasDollar(topic) {
		switch {
		case hasDollar(topic):
			// $ topics are the server's: a will there is refused as
			// a PUBLISH there is (DESIGN.md, "The record").
			why = "topic starts with $: reserved for the server"
		case why == "":
			why = "topic invalid"
		}
		if c.v != 5 {
			return c.refuse(pk, packets.Code{}, 0, "will "+why) // 3.1.1 has no CONNACK code for it [MQTT-3.2.2-6]
		}
		return c.refuse(pk, packets.ErrTopicNameInvalid, 0, "will "+why)
	}
	if !c.srv.access.Load().ACL.Allowed(c.user, c.id, topic, true) {
		return c.refuse(pk, packets.ErrNotAuthorized, 0x05, "will topic denied by ACL", "topic", topic)
	}
	w := &Message{ClientID: c.id, Topic: topic, QoS: cp.WillQos, Retain: cp.WillRetain, Will: true, Payload: cp.WillPayload, user: c.user}
	if c.v == 5 {
		wp := &cp.WillProperties
		w.PayloadFormat, w.PayloadFormatSet = wp.PayloadFormat, wp.PayloadFormatFlag
		w.MessageExpiry, w.MessageExpirySet = wp.MessageExpiryInterval, wp.MessageExpiryInterval > 0
		w.ContentType, w.ResponseTopic, w.CorrelationData, w.User = wp.ContentType, wp.ResponseTopic, wp.CorrelationData, wp.User
		c.willDelay = wp.WillDelayInterval
	}
	c.will = w
	// Held for as long as the connection (and a will delay after it):
	// charged to the memory account (memory.go) until then.
	c.willCharge = publishCost(len(topic), len(w.Payload))
	c.srv.mem.charge(c.willCharge)
	return true
}

// refuse answers a CONNECT with a refusing CONNACK (code5 to MQTT 5
// clients, code3 to older ones; none when that code is zero) and logs the
// refusal once a minute per reason and address. It returns false.
func (c *conn) refuse(pk *packets.Packet, code5 packets.Code, code3 byte, reason string, args ...any) bool {
	return c.refuseKeyed(c.host, pk, code5, code3, reason, args...)
}

// refuseKeyed is refuse logging once a minute per reason and key.
func (c *conn) refuseKeyed(key string, pk *packets.Packet, code5 packets.Code, code3 byte, reason string, args ...any) bool {
	ack := &packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connack}}
	if c.v == 5 {
		ack.ReasonCode = code5.Code
		ack.Properties.ReasonString = code5.Reason
	} else {
		ack.ReasonCode = code3
	}
	// Counted before the client can read it: whoever sees the CONNACK
	// finds it in the metrics.
	c.srv.refusal(key, reason, append(args, "client", truncate(pk.Connect.ClientIdentifier), "remote", c.remote())...)
	if ack.ReasonCode != 0 {
		c.send(ack)
		c.refusedConnect = true
	}
	return false
}

// attach gives c its session: a new one, or the existing one resumed
// (present), whose connection, if any, is taken over: ended with 0x8E and
// waited for. It refuses (nil, why) a client id whose session belongs to
// another user.
func (s *Server) attach(c *conn, clean bool, expiry uint32) (se *session, present bool, why string) {
	for tries := 0; ; tries++ {
		if s.closing.Load() {
			return nil, false, "server stopping"
		}
		s.mu.Lock()
		se = s.sessions[c.id]
		if se != nil {
			se.mu.Lock()
			if se.user != c.user {
				se.mu.Unlock()
				s.mu.Unlock()
				return nil, false, "client id held by another user's session"
			}
			old := se.conn
			if old != nil {
				se.mu.Unlock()
				s.mu.Unlock()
				old.end(codeTakenOver) // [MQTT-3.1.4-3]
				select {
				case <-old.done:
				case <-time.After(5 * time.Second):
					return nil, false, "previous connection of the client id did not end"
				}
				continue
			}
			se.mu.Unlock()
		}
		if expiry > 0 && (se == nil || clean) {
			// A new persistent session: within max_sessions, or
			// refused. One resuming always comes back; one started
			// over in its own place takes no more room.
			n := s.persistentSessionsLocked()
			if se != nil && se.persistent() {
				n--
			}
			if n >= s.cfg.Limits.MaxSessions {
				s.mu.Unlock()
				return nil, false, whyMaxSessions
			}
			var free int64 // the bytes of the session it starts over
			if se != nil {
				se.mu.Lock()
				free = se.bytes
				se.mu.Unlock()
			}
			if !s.sessionRoom(sessionRecCount(c.id, c.user, s.pageCounts.Load()), free) {
				s.mu.Unlock()
				return nil, false, whySessionBytes
			}
		}
		if w := s.wills[c.id]; w != nil {
			s.dropWillLocked(c.id, w) // [MQTT-3.1.3-9]: back before its will's delay ran out
		}
		if se != nil && clean {
			s.endSessionLocked(se, false) // the start record says clean
			se = nil
		}
		if se == nil {
			se = newSession(s, c.id)
			se.user = c.user
			// Nothing already in the log is for a new session, nor
			// its cursor for the other members: they start their copy
			// at its start record.
			se.cursor = s.applied.Load()
			se.scanned, se.savedCursor, se.sentCursor = se.cursor, se.cursor, se.cursor
			s.sessions[c.id] = se
		} else {
			present = true
		}
		s.clients.Add(1)
		c.sess = se
		se.mu.Lock()
		se.conn = c
		se.on.Store(true)
		wasPersistent := se.persistent()
		se.expiry = expiry
		se.expireAt = time.Time{}
		s.recountLocked(se)
		se.remoteOnline, se.startIndex, se.startFailed, se.startSeq = false, 0, false, startComing
		if s.refs[se.ref] == se {
			delete(s.refs, se.ref)
		}
		se.ref = 0 // until its new start record is applied
		se.resumed, se.namedHere = present, nil
		// Whatever the log holds past the cursor is read from it: the
		// client was away.
		se.behind, se.more = true, false
		se.scanned = se.cursor
		se.releaseHeldLocked(true)
		relog := len(se.relPending) > 0 && !se.relBusy
		se.mu.Unlock()
		s.mu.Unlock()
		if se.persistent() || wasPersistent {
			s.proposeStart(se, c, sessionOp{Op: "start", User: c.user, Expiry: expiry, Clean: clean})
		}
		if relog {
			se.relog()
		}
		if se.persistent() {
			s.saveSession(se)
			if s.store != nil {
				// Connects are rare: the session is durable before the
				// client is told it exists.
				if err := s.store.Sync(); err != nil {
					s.lines.Error("saving the session failed", "client", c.id, "error", err)
				}
			}
		}
		return se, present, ""
	}
}

// whyMaxSessions is attach's refusal of a new persistent session past
// max_sessions.
const whyMaxSessions = "persistent sessions at max_sessions: CONNECT refused"

// persistentSessionsLocked counts the persistent sessions this member
// holds, online or not, its own and the other members' alike. Called with
// s.mu held.
func (s *Server) persistentSessionsLocked() int {
	n := 0
	for _, se := range s.sessions {
		se.mu.Lock()
		if se.persistent() && !se.ended {
			n++
		}
		se.mu.Unlock()
	}
	return n
}

// PersistentSessions is how many persistent sessions this member holds,
// for metrics.
func (s *Server) PersistentSessions() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return int64(s.persistentSessionsLocked())
}

// detach runs when c's read loop has ended: its session goes offline or
// ends, and its will is proposed or scheduled.
func (s *Server) detach(c *conn) {
	se := c.sess
	s.clients.Add(-1)
	s.mu.Lock()
	se.mu.Lock()
	if se.conn != c {
		se.mu.Unlock()
		s.mu.Unlock()
		return
	}
	se.conn = nil
	se.on.Store(false)
	if !se.behind && len(se.queue) == 0 {
		// Everything applied so far was offered, and handed out.
		se.cursor = max(se.cursor, s.applied.Load())
	}
	se.scanned = se.cursor
	se.releaseHeldLocked(true)
	expiry := se.expiry
	if expiry > 0 && expiry != 0xFFFFFFFF {
		se.expireAt = time.Now().Add(time.Duration(expiry) * time.Second)
	}
	ended := se.ended
	se.mu.Unlock()
	if expiry == 0 {
		s.endSessionLocked(se, true)
	}
	will := c.will
	sendWill := will != nil && !c.graceful && !c.noWill.Load()
	delay := c.willDelay
	if sendWill && delay > 0 && expiry > 0 && !s.closing.Load() {
		// [MQTT-3.1.3-9]: the will waits for its delay or the session's
		// end, whichever comes first; a reconnect cancels it.
		d := time.Duration(min(delay, expiry)) * time.Second
		pw := &pendingWill{cost: c.willCharge}
		c.willCharge = 0 // the pending will holds it now
		pw.t = time.AfterFunc(d, func() {
			s.mu.Lock()
			if s.wills[c.id] != pw {
				s.mu.Unlock()
				return
			}
			delete(s.wills, c.id)
			s.mu.Unlock()
			s.proposeWill(will)
			s.mem.release(pw.cost)
		})
		s.wills[c.id] = pw
		sendWill = false
	}
	s.mu.Unlock()
	if expiry > 0 && !ended {
		// An ended session's "off" would come after the end record
		// and could find the client's next session on other members.
		// The cursor first: a member that has applied the "off" has
		// the cursor the device left with, whether this batch or an
		// earlier one logged it.
		s.saveCursor(se)
		s.replicateCursors()
		s.proposeSession(c.id, sessionOp{Op: "off"})
	}
	if sendWill {
		s.proposeWill(will)
	}
}

// endSessionLocked removes se: its subscriptions, its state on disk; tell
// logs its end for the other members (a persistent session ending here).
// Called with s.mu held, not se.mu.
func (s *Server) endSessionLocked(se *session, tell bool) {
	se.mu.Lock()
	if se.ended {
		se.mu.Unlock()
		return
	}
	se.ended = true
	if tell && (se.persistent() || se.startIndex > 0) {
		defer s.proposeSession(se.id, sessionOp{Op: "end"})
	}
	subs := se.subs
	se.subs = map[string]*subscription{}
	s.recountLocked(se)
	se.releaseHeldLocked(false)
	s.inflight.Add(-int64(len(se.inflight) + len(se.inbound)))
	se.inflight, se.inbound = map[uint16]*outItem{}, map[uint16]*inbound2{}
	se.mu.Unlock()
	for _, sub := range subs {
		s.index.remove(se, sub)
	}
	if s.sessions[se.id] == se {
		delete(s.sessions, se.id)
	}
	if s.refs[se.ref] == se {
		delete(s.refs, se.ref)
	}
	s.deleteSessionState(se.id)
}

// pendingWill is a will waiting for its delay, and what it is charged in
// the memory account.
type pendingWill struct {
	t    *time.Timer
	cost int64
}

// dropWillLocked cancels id's pending will w. Called with s.mu held.
func (s *Server) dropWillLocked(id string, w *pendingWill) {
	if w.t.Stop() {
		s.mem.release(w.cost) // its func will not run
	}
	delete(s.wills, id)
}

// proposeWill logs a will as a record.
func (s *Server) proposeWill(m *Message) {
	// Checked again (a reload may have changed the ACL since CONNECT) as
	// the user who connected: a clean session is gone by now.
	if !s.access.Load().ACL.Allowed(m.user, m.ClientID, m.Topic, true) {
		s.refusal(m.ClientID, "will denied by ACL: dropped", "client", m.ClientID, "topic", m.Topic)
		return
	}
	m.Time = s.cfg.Now().UnixNano()
	s.log.Reserve(m)
	s.log.Propose(m, AckFor(s.topicPolicies(), m.Topic), DoneFunc(s.logFailure))
}

// logFailure is the done callback of publishes nobody acks (QoS 0, wills).
func (s *Server) logFailure(err error) {
	if err != nil {
		s.lines.Warn("unacknowledged publish not logged", "error", err)
	}
}

// cursorEvery is how often the cursors of live persistent sessions are
// logged for the other members: what a device moving to another member is
// handed twice at most (QoS 1 duplicates) is what was delivered since.
const cursorEvery = 100 * time.Millisecond

// sweeper ends offline sessions whose expiry has passed, and replicates
// cursors.
func (s *Server) sweeper() {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	cur := time.NewTicker(cursorEvery)
	defer cur.Stop()
	for {
		select {
		case <-s.stopc:
			return
		case <-cur.C:
			s.replicateCursors()
		case now := <-t.C:
			s.mu.Lock()
			for _, se := range s.sessions {
				se.mu.Lock()
				due := se.conn == nil && !se.remoteOnline && !se.expireAt.IsZero() && now.After(se.expireAt)
				se.mu.Unlock()
				if due {
					s.endSessionLocked(se, true)
				}
			}
			s.mu.Unlock()
			s.saveCursors()
		}
	}
}
