package mqtt

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
)

// Keys of the session store. NUL separates parts because client ids and
// filters may contain any other character. Upper-case prefixes are this
// layout's; the lower-case c, s, i and r are the layout of tandem builds
// on mochi's Server, read once and converted at the first start (q, the
// QoS 2 markers, is the same in both).
const (
	keySession  = "S\x00" // S id → sessionRec (JSON)
	keyCursor   = "K\x00" // K id → cursor, 8 bytes
	keySub      = "B\x00" // B id NUL filter → subRec (JSON)
	keyOut      = "O\x00" // O id NUL pid → outbound in flight (encodeOut)
	keyRetained = "R\x00" // R topic → retainedRec (JSON)
	prefixQoS2  = "q\x00" // q id NUL pid → inbound QoS 2 marker (encodeQoS2)
	keyWindow   = "W\x00" // W id → the session's inbound QoS 2 window (windowRec, JSON)

	legacyClient   = "c\x00"
	legacySub      = "s\x00"
	legacyInflight = "i\x00"
	legacyRetained = "r\x00"
)

// sessionRec is a session's durable record.
type sessionRec struct {
	V      int    `json:"v"`
	User   string `json:"user,omitempty"`
	Expiry uint32 `json:"expiry"`
	// Ref is the session's ref (cursors.go): cursor records from the
	// other members name it by that after a restart or a snapshot too.
	Ref uint64 `json:"ref,omitempty"`
}

// subRec is one subscription's durable record.
type subRec struct {
	QoS   byte   `json:"q"`
	NL    bool   `json:"nl,omitempty"`
	RAP   bool   `json:"rap,omitempty"`
	RH    byte   `json:"rh,omitempty"`
	ID    int    `json:"id,omitempty"`
	Since uint64 `json:"since,omitempty"`
}

// retainedRec is a retained message with the log index that set it.
type retainedRec struct {
	Index uint64   `json:"index"`
	M     *Message `json:"m"`
}

func sessKey(id string) string        { return keySession + id }
func cursorKey(id string) string      { return keyCursor + id }
func windowKey(id string) string      { return keyWindow + id }
func subKey(id, filter string) string { return keySub + id + "\x00" + filter }
func outKey(id string, pid uint16) string {
	return keyOut + id + "\x00" + strconv.Itoa(int(pid))
}

func qos2Key(id string, pid uint16) string {
	return prefixQoS2 + id + "\x00" + strconv.Itoa(int(pid))
}

func (s *Server) stagePut(k string, v []byte) {
	if s.store != nil {
		s.store.Put(k, v)
	}
}

func (s *Server) stageDelete(k string) {
	if s.store != nil {
		s.store.Delete(k)
	}
}

func (s *Server) stageJSON(k string, v any) {
	if s.store == nil {
		return
	}
	b, err := json.Marshal(v)
	if err != nil {
		s.lines.Error("encoding session state failed", "key", k, "error", err)
		return
	}
	s.store.Put(k, b)
}

// saveSession stages se's record.
func (s *Server) saveSession(se *session) {
	se.mu.Lock()
	rec := sessionRec{V: 1, User: se.user, Expiry: se.expiry, Ref: se.ref}
	se.mu.Unlock()
	s.stageJSON(sessKey(se.id), rec)
}

// saveCursor stages se's cursor when it moved.
func (s *Server) saveCursor(se *session) {
	se.mu.Lock()
	cur, moved := se.cursor, se.cursor != se.savedCursor && se.persistent() && !se.ended
	se.savedCursor = cur
	se.mu.Unlock()
	if moved {
		s.stagePut(cursorKey(se.id), binary.BigEndian.AppendUint64(nil, cur))
	}
}

// saveCursors stages every persistent session's cursor that moved: they
// become durable with the log's next commit. A cursor behind on disk after
// a crash costs QoS 1 duplicates only; QoS 2 messages in flight are on
// disk by packet id.
func (s *Server) saveCursors() {
	s.mu.Lock()
	all := make([]*session, 0, len(s.sessions))
	for _, se := range s.sessions {
		all = append(all, se)
	}
	s.mu.Unlock()
	for _, se := range all {
		s.saveCursor(se)
	}
}

// saveSub stages a subscription.
func (s *Server) saveSub(id string, sub *subscription) {
	s.stageJSON(subKey(id, sub.filter), subRec{QoS: sub.qos, NL: sub.noLocal, RAP: sub.rap, RH: sub.rh, ID: sub.id, Since: sub.since})
}

// deleteSessionState stages the removal of everything a session keeps.
func (s *Server) deleteSessionState(id string) {
	if s.store == nil {
		return
	}
	s.store.Delete(sessKey(id))
	s.store.Delete(cursorKey(id))
	s.store.Delete(windowKey(id))
	for _, p := range []string{keySub, keyOut, prefixQoS2} {
		var keys []string
		_ = s.store.Load(p+id+"\x00", func(k string, _ []byte) error {
			keys = append(keys, k)
			return nil
		})
		for _, k := range keys {
			s.store.Delete(k)
		}
	}
}

// encodeOut encodes an outbound message in flight: version, QoS, rel,
// send order, log index, subscription ids; a message with no log index
// (a retained one sent on subscribe) carries the message itself.
func encodeOut(it *outItem) []byte {
	b := []byte{1, it.qos, 0}
	if it.rel {
		b[2] = 1
	}
	if it.retain {
		b[2] |= 2
	}
	b = binary.BigEndian.AppendUint64(b, it.seq)
	b = binary.BigEndian.AppendUint64(b, it.idx)
	b = binary.BigEndian.AppendUint16(b, uint16(len(it.ids)))
	for _, id := range it.ids {
		b = binary.BigEndian.AppendUint32(b, uint32(id))
	}
	if it.idx == 0 && it.m != nil {
		mb, _ := json.Marshal(it.m)
		b = append(b, mb...)
	}
	return b
}

func decodeOut(b []byte) (*outItem, error) {
	if len(b) < 21 || b[0] != 1 {
		return nil, errors.New("outbound message: bad encoding")
	}
	it := &outItem{qos: b[1], rel: b[2]&1 != 0, retain: b[2]&2 != 0,
		seq: binary.BigEndian.Uint64(b[3:]), idx: binary.BigEndian.Uint64(b[11:])}
	n := int(binary.BigEndian.Uint16(b[19:]))
	b = b[21:]
	if len(b) < 4*n {
		return nil, errors.New("outbound message: short")
	}
	for i := 0; i < n; i++ {
		it.ids = append(it.ids, int(binary.BigEndian.Uint32(b[4*i:])))
	}
	b = b[4*n:]
	if len(b) > 0 {
		it.m = &Message{}
		if err := json.Unmarshal(b, it.m); err != nil {
			return nil, fmt.Errorf("outbound message: %w", err)
		}
	}
	return it, nil
}

// encodeQoS2 is the marker of an inbound QoS 2 publish: the record it
// names (origin, seq) and when it arrived.
func encodeQoS2(origin, seq uint64, at time.Time) []byte {
	var v [24]byte
	binary.BigEndian.PutUint64(v[0:], origin)
	binary.BigEndian.PutUint64(v[8:], seq)
	binary.BigEndian.PutUint64(v[16:], uint64(at.Unix()))
	return v[:]
}

// splitKey splits "P\x00id\x00rest" into id and rest.
func splitKey(k, prefix string) (id, rest string, ok bool) {
	return strings.Cut(strings.TrimPrefix(k, prefix), "\x00")
}

// load reads the sessions and retained messages at start, converting the
// layout of earlier builds first.
func (s *Server) load() error {
	if s.store == nil {
		return nil
	}
	if err := s.migrate(); err != nil {
		return err
	}
	return s.loadState(true)
}

// loadState reads the sessions and retained messages of the store into
// empty maps: at start, and after a snapshot replaced them (Restore).
// checkLog drops the QoS 2 markers whose records are not in the log
// (loadQoS2); a snapshot's are trusted, its log starts after them.
func (s *Server) loadState(checkLog bool) error {
	s.resetCounts() // what is loaded counts by the level the data file holds with it
	if s.store == nil {
		return nil
	}
	err := s.store.Load(keyRetained, func(k string, v []byte) error {
		var rec retainedRec
		if err := json.Unmarshal(v, &rec); err != nil || rec.M == nil {
			return fmt.Errorf("retained message %q: bad record", strings.TrimPrefix(k, keyRetained))
		}
		// Every one is taken in, over the caps or not: they were
		// admitted under the caps of their day, and dropping some now
		// would make this member differ from the others. The counts
		// rebuilt here are what the next retained publish is checked
		// against.
		s.retained.set(rec.M.Topic, rec.Index, rec.M)
		return nil
	})
	if err != nil {
		return err
	}
	err = s.store.Load(keySession, func(k string, v []byte) error {
		var rec sessionRec
		if err := json.Unmarshal(v, &rec); err != nil {
			return fmt.Errorf("session %q: %w", strings.TrimPrefix(k, keySession), err)
		}
		se := newSession(s, strings.TrimPrefix(k, keySession))
		se.user, se.expiry, se.ref = rec.User, rec.Expiry, rec.Ref
		if se.ref != 0 {
			if s.refs == nil {
				s.refs = map[uint64]*session{}
			}
			s.refs[se.ref] = se
		}
		if se.expiry != 0xFFFFFFFF {
			se.expireAt = time.Now().Add(time.Duration(se.expiry) * time.Second)
		}
		s.sessions[se.id] = se
		return nil
	})
	if err != nil {
		return err
	}
	get := func(id string) *session { return s.sessions[id] }
	err = s.store.Load(keyWindow, func(k string, v []byte) error {
		var rec windowRec
		se := get(strings.TrimPrefix(k, keyWindow))
		if se == nil {
			return nil
		}
		if err := json.Unmarshal(v, &rec); err != nil {
			return fmt.Errorf("QoS 2 window of session %q: %w", se.id, err)
		}
		se.win = rec.window()
		return nil
	})
	if err != nil {
		return err
	}
	err = s.store.Load(keyCursor, func(k string, v []byte) error {
		if se := get(strings.TrimPrefix(k, keyCursor)); se != nil && len(v) == 8 {
			se.cursor = binary.BigEndian.Uint64(v)
			se.scanned, se.savedCursor = se.cursor, se.cursor
		}
		return nil
	})
	if err != nil {
		return err
	}
	err = s.store.Load(keySub, func(k string, v []byte) error {
		id, filter, ok := splitKey(k, keySub)
		se := get(id)
		if !ok || se == nil {
			return nil
		}
		var rec subRec
		if err := json.Unmarshal(v, &rec); err != nil {
			return fmt.Errorf("subscription %q of %q: %w", filter, id, err)
		}
		sub := &subscription{filter: filter, qos: rec.QoS, noLocal: rec.NL, rap: rec.RAP, rh: rec.RH, id: rec.ID, since: rec.Since}
		sub.group, sub.match, _, _ = parseShare(filter)
		se.subs[filter] = sub
		s.index.add(se, sub)
		return nil
	})
	if err != nil {
		return err
	}
	for _, se := range s.sessions {
		s.recount(se) // taken in over the cap or not, as retained messages are
	}
	err = s.store.Load(keyOut, func(k string, v []byte) error {
		id, p, ok := splitKey(k, keyOut)
		pid, perr := strconv.Atoi(p)
		se := get(id)
		if !ok || perr != nil || se == nil {
			return nil
		}
		it, err := decodeOut(v)
		if err != nil {
			return fmt.Errorf("client %q packet %d: %w", id, pid, err)
		}
		it.pid = uint16(pid)
		se.inflight[it.pid] = it
		if it.rel && it.idx > 0 {
			// Its release record may not have been logged before this
			// member stopped: it is logged (again) before the PUBREL
			// goes (relog).
			se.relPending = append(se.relPending, it.idx)
			if se.releasing == nil {
				se.releasing = map[uint64]bool{}
			}
			se.releasing[it.idx] = true
		}
		se.sendSeq = max(se.sendSeq, it.seq)
		s.inflight.Add(1)
		return nil
	})
	if err != nil {
		return err
	}
	if err := s.loadHolds(); err != nil {
		return err
	}
	return s.loadQoS2(checkLog)
}

// loadQoS2 turns the QoS 2 markers whose records are in the log back into
// inbound entries; a marker whose record never reached the log (a crash
// in between) is dropped, so the client's resend is logged.
func (s *Server) loadQoS2(checkLog bool) error {
	type marker struct {
		key, client string
		pid         uint16
		origin, seq uint64
	}
	var ms []marker
	err := s.store.Load(prefixQoS2, func(k string, v []byte) error {
		id, p, ok := splitKey(k, prefixQoS2)
		pid, err := strconv.Atoi(p)
		if len(v) != 24 || !ok || err != nil {
			return nil
		}
		ms = append(ms, marker{k, id, uint16(pid), binary.BigEndian.Uint64(v), binary.BigEndian.Uint64(v[8:])})
		return nil
	})
	if err != nil || len(ms) == 0 {
		return err
	}
	logged := map[[2]uint64]bool{}
	byOrigin := map[uint64][]uint64{}
	for _, m := range ms {
		byOrigin[m.origin] = append(byOrigin[m.origin], m.seq)
		if !checkLog {
			logged[[2]uint64{m.origin, m.seq}] = true
		}
	}
	for origin, seqs := range byOrigin {
		if !checkLog {
			break // every marker is kept (logged, above)
		}
		got, err := s.log.Logged(origin, seqs)
		if err != nil {
			return err
		}
		for q := range got {
			logged[[2]uint64{origin, q}] = true
		}
	}
	for _, m := range ms {
		se := s.sessions[m.client]
		if se == nil || !logged[[2]uint64{m.origin, m.seq}] {
			s.store.Delete(m.key)
			continue
		}
		se.inbound[m.pid] = &inbound2{origin: m.origin, seq: m.seq, done: true}
		s.inflight.Add(1)
	}
	return nil
}

// Legacy records, as tandem builds on mochi's Server wrote them (mochi's
// storage hook types, JSON).
type legacyClientRec struct {
	ID              string `json:"id"`
	Username        []byte `json:"username"`
	ProtocolVersion byte   `json:"protocolVersion"`
	Clean           bool   `json:"clean"`
	Properties      struct {
		SessionExpiryInterval uint32 `json:"sessionExpiryInterval"`
	} `json:"properties"`
}

type legacySubRec struct {
	Client            string `json:"client"`
	Filter            string `json:"filter"`
	Identifier        int    `json:"identifier"`
	RetainHandling    byte   `json:"retain_handling"`
	Qos               byte   `json:"qos"`
	RetainAsPublished bool   `json:"retain_as_pub"`
	NoLocal           bool   `json:"no_local"`
}

type legacyMessageRec struct {
	Properties struct {
		CorrelationData       []byte                 `json:"correlationData"`
		User                  []packets.UserProperty `json:"user"`
		ContentType           string                 `json:"contentType"`
		ResponseTopic         string                 `json:"responseTopic"`
		MessageExpiryInterval uint32                 `json:"messageExpiry"`
		PayloadFormat         byte                   `json:"payloadFormat"`
		PayloadFormatFlag     bool                   `json:"payloadFormatFlag"`
	} `json:"properties"`
	Payload     []byte              `json:"payload"`
	Client      string              `json:"client"`
	Origin      string              `json:"origin"`
	TopicName   string              `json:"topic_name"`
	FixedHeader packets.FixedHeader `json:"fixedheader"`
	Created     int64               `json:"created"`
	PacketID    uint16              `json:"packet_id"`
}

func (l *legacyMessageRec) message() *Message {
	p := &l.Properties
	return &Message{ClientID: l.Origin, Topic: l.TopicName, QoS: l.FixedHeader.Qos, Retain: l.FixedHeader.Retain,
		Time: l.Created * int64(time.Second), Payload: l.Payload,
		PayloadFormat: p.PayloadFormat, PayloadFormatSet: p.PayloadFormatFlag,
		MessageExpiry: p.MessageExpiryInterval, MessageExpirySet: p.MessageExpiryInterval > 0,
		ContentType: p.ContentType, ResponseTopic: p.ResponseTopic, CorrelationData: p.CorrelationData, User: p.User}
}

// migrate converts the session store of builds on mochi's Server: its
// sessions, subscriptions and retained messages, and the messages it held
// in flight for offline sessions, which become this layout's in-flight
// messages (with their content: they have no log index). The old keys go
// in the same commit as the new ones.
func (s *Server) migrate() error {
	var old []string
	put := func(k string, v any) {
		b, _ := json.Marshal(v)
		s.store.Put(k, b)
	}
	err := s.store.Load(legacyClient, func(k string, v []byte) error {
		old = append(old, k)
		var c legacyClientRec
		if err := json.Unmarshal(v, &c); err != nil {
			return fmt.Errorf("session %q of an earlier build: %w", k[2:], err)
		}
		expiry := c.Properties.SessionExpiryInterval
		if c.ProtocolVersion < 5 {
			expiry = 0xFFFFFFFF
		}
		put(sessKey(c.ID), sessionRec{V: 1, User: string(c.Username), Expiry: expiry})
		return nil
	})
	if err != nil {
		return err
	}
	err = s.store.Load(legacySub, func(k string, v []byte) error {
		old = append(old, k)
		var r legacySubRec
		if err := json.Unmarshal(v, &r); err != nil {
			return fmt.Errorf("subscription of an earlier build %q: %w", k, err)
		}
		put(subKey(r.Client, r.Filter), subRec{QoS: r.Qos, NL: r.NoLocal, RAP: r.RetainAsPublished, RH: r.RetainHandling, ID: r.Identifier})
		return nil
	})
	if err != nil {
		return err
	}
	err = s.store.Load(legacyRetained, func(k string, v []byte) error {
		old = append(old, k)
		var r legacyMessageRec
		if err := json.Unmarshal(v, &r); err != nil {
			return fmt.Errorf("retained message of an earlier build %q: %w", k, err)
		}
		m := r.message()
		m.Retain = true
		if !strings.HasPrefix(m.Topic, "$") { // mochi's own $SYS statistics are not kept
			put(keyRetained+m.Topic, retainedRec{M: m})
		}
		return nil
	})
	if err != nil {
		return err
	}
	seq := uint64(0)
	err = s.store.Load(legacyInflight, func(k string, v []byte) error {
		old = append(old, k)
		var r legacyMessageRec
		if err := json.Unmarshal(v, &r); err != nil {
			return fmt.Errorf("in-flight message of an earlier build %q: %w", k, err)
		}
		if r.FixedHeader.Type != packets.Publish || r.PacketID == 0 {
			return nil
		}
		seq++
		it := &outItem{m: r.message(), qos: r.FixedHeader.Qos, pid: r.PacketID, seq: seq}
		s.store.Put(outKey(r.Client, r.PacketID), encodeOut(it))
		return nil
	})
	if err != nil {
		return err
	}
	if len(old) == 0 {
		return nil
	}
	for _, k := range old {
		s.store.Delete(k)
	}
	s.lines.Info("converted the sessions of an earlier build", "records", len(old))
	return s.store.Sync()
}
