package storage

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"math/bits"
	"slices"
)

// Record is one MQTT publish as kept in the log: the unit every raft data
// entry carries. It holds everything a subscriber on any member needs to get
// the message as the device sent it, plus the id that lets a retried forward
// or a requeued tail be recognised instead of logged twice.
type Record struct {
	Origin      uint64 // id of the node that took the publish from a device
	Seq         uint64 // per-origin sequence number; (Origin, Seq) is the record id
	ClientID    string
	Topic       string
	QoS         byte // 0, 1 or 2; AppendRecord panics on anything else
	Retain      bool
	Republished bool // re-proposed from a deposed master's tail (requeue)
	Will        bool // a will (last will and testament) message
	// Sync marks a record taken under a sync ack rule: no member delivers
	// it until the master's settlement confirms it, and none ever does
	// once it is aborted (DESIGN.md, "Delivery waits for the ack rule").
	Sync bool
	// Kind tells a device message (KindMessage) from one of the broker's
	// own control records. It is part of the header, so nothing a device
	// sends can become a control record, whatever its topic.
	Kind Kind
	// Legacy marks a control record in the encoding of builds before
	// record kinds (version 1 on its kind's $tandem/ topic): what a
	// cluster below FeatureControlKinds writes, so that every member can
	// read it (DESIGN.md, "Versions and upgrades").
	Legacy   bool
	PacketID uint16 // MQTT packet id at the origin (0 for QoS 0)
	Time     int64  // publish time, Unix nanoseconds, taken at the origin
	Payload  []byte
	Props    Properties
}

// Properties are the MQTT 5 properties that travel with a message.
//
// MQTT tells an absent payload format or message expiry apart from a zero
// one, hence the Set flags; a value whose flag is false is not stored, so it
// decodes as zero.
type Properties struct {
	PayloadFormat    byte
	PayloadFormatSet bool
	MessageExpiry    uint32 // seconds
	MessageExpirySet bool
	ContentType      string
	ResponseTopic    string
	CorrelationData  []byte
	User             []UserProperty
}

// UserProperty is one MQTT 5 user property (order and duplicates are kept).
type UserProperty struct{ Key, Value string }

// Kind is what a record is: a device message, or one of the broker's own
// state changes. Raft tells a membership entry from a data entry by its
// type; a record tells its kinds apart by its header in the same way,
// never by its content.
type Kind uint8

// The record kinds. A control kind this build does not know decodes (the
// encoding is shared) and is skipped by the applier, which counts it.
const (
	KindMessage Kind = iota // a device's PUBLISH, will, or a downlink message
	KindSettle              // the master's settlement of sync records
	KindSession             // a persistent session's life
	KindCursors             // a batch of session cursors
	KindUplinks             // uplink positions, or an uplink's pause
	KindFeature             // the cluster's feature level, raised
)

// legacyTopics are the topics the control kinds travelled on before the
// record header carried them (version 1, FeatureLevel 1).
var legacyTopics = [...]string{
	KindSettle:  "$tandem/settle",
	KindSession: "$tandem/session",
	KindCursors: "$tandem/cursors",
	KindUplinks: "$tandem/uplinks",
}

// String names the kind as metrics and logs label it.
func (k Kind) String() string {
	switch k {
	case KindMessage:
		return "message"
	case KindSettle:
		return "settle"
	case KindSession:
		return "session"
	case KindCursors:
		return "cursors"
	case KindUplinks:
		return "uplinks"
	case KindFeature:
		return "feature"
	}
	return fmt.Sprintf("kind-%d", uint8(k))
}

// LegacyTopic is the topic kind k travelled on before record kinds, ""
// for KindMessage and the kinds that have no legacy form.
func (k Kind) LegacyTopic() string {
	if int(k) < len(legacyTopics) {
		return legacyTopics[k]
	}
	return ""
}

// legacyKind says which control kind a version-1 record is, KindMessage
// for a device message. Builds before record kinds wrote their control
// records as version-1 records on $tandem/ topics, QoS 0, neither will
// nor retained; those builds also let a device will reach such a topic.
// So a legacy record is trusted as control only in the shape its
// writers gave it: a will, a retained or a QoS 1/2 record on
// $tandem/settle is a device's, and is never obeyed.
func legacyKind(topic []byte, flags, qos byte) Kind {
	if len(topic) < len("$tandem/") || topic[0] != '$' || flags&(flagWill|flagRetain) != 0 || qos != 0 {
		return KindMessage
	}
	for k, t := range legacyTopics {
		if t != "" && string(topic) == t {
			return Kind(k)
		}
	}
	return KindMessage
}

// RecordVersion is the encoding version AppendRecord writes for a record
// taken without a sync ack rule, RecordVersionSync the same layout with
// flagSync, written exactly when Record.Sync is set. Async records keep
// version 1, so a build that reads version 1 only still reads them (a
// rolling upgrade); a sync record stops such a build, rightly: it would
// deliver the record before its ack rule is met. RecordVersionControl is
// a control record (Kind other than KindMessage): the same fixed header
// followed by the kind byte, written only once the cluster's feature level
// is FeatureControlKinds, since earlier builds reject the version.
// DecodeRecord reads these three versions only: a record from a newer
// tandem is reported, not half understood (the applier counts and skips
// it).
const (
	RecordVersion        = 1
	RecordVersionSync    = 2
	RecordVersionControl = 3
)

// Feature levels: what the cluster's records and peer messages may use
// (DESIGN.md, "Versions and upgrades"). A level is used only once every
// member runs a build that knows it.
const (
	// FeatureBase is what builds before feature levels speak: control
	// records as version-1 records on $tandem/ topics.
	FeatureBase = 1
	// FeatureControlKinds: control records carry their kind in the
	// header (RecordVersionControl).
	FeatureControlKinds = 2
	// FeaturePageCounts: max_retained_bytes and max_session_bytes count
	// what the broker's records take of the data file's pages, not their
	// bytes. The cap on retained messages is a rule every member applies
	// at apply time, so a member counting the other way would retain
	// what the others do not.
	FeaturePageCounts = 3
	// FeatureInboundResends: a member that logs a QoS 2 publish a
	// device resent (DUP) under a packet id it did not know first logs
	// a session record naming it ("resend"), and every member delivers
	// once what that resend and its original, committed later, both
	// carry (mqtt: inboundDup). A member of a build before it ignores
	// the session record and would deliver both.
	FeatureInboundResends = 4
)

// FeatureLevel, the highest level this build knows, is in kind_default.go
// (kind_next.go in a tandem_next test build).

// Flag bits of byte 1. Unknown bits are rejected so that a future version
// cannot smuggle meaning past an old decoder under the same version byte.
const (
	flagRetain        = 1 << 0
	flagRepublished   = 1 << 1
	flagWill          = 1 << 2
	flagPayloadFormat = 1 << 3
	flagMessageExpiry = 1 << 4
	flagSync          = 1 << 5 // version 2 only, and always set there
	flagsKnown        = flagRetain | flagRepublished | flagWill | flagPayloadFormat | flagMessageExpiry
)

// Fixed header layout. It comes first and has fixed offsets so that RecordID
// is a couple of loads.
const (
	offVersion  = 0
	offFlags    = 1
	offQoS      = 2
	offOrigin   = 3
	offSeq      = 11
	offTime     = 19
	offPacketID = 27
	headerLen   = 29
	offKind     = 29 // version 3 only

	crcLen = 4

	// Six zero-length fields and a zero user property count.
	minRecordLen = headerLen + 6 + 1 + crcLen
)

// crcTable is built once: MakeTable(Castagnoli) hands back the table the
// crc32 package recognises for its hardware-accelerated path.
var crcTable = crc32.MakeTable(crc32.Castagnoli)

// AppendRecord appends r's encoding to dst and returns the extended slice.
//
// It is on the hot path (one call per publish, into a pooled buffer), so it
// sizes the encoding first and grows dst at most once; with enough capacity
// it does not allocate.
//
// A control record (Kind other than KindMessage) is written as version 3,
// or, with Legacy, as version 1 on its kind's legacy topic.
//
// It panics if r.QoS is above 2, or on a control record that is sync,
// has a QoS, or is legacy without a legacy topic: the decoder would treat
// such a record as corruption or as a device's, so a caller bug must fail
// here rather than poison the log.
func AppendRecord(dst []byte, r *Record) []byte {
	if r.QoS > 2 {
		panic(fmt.Sprintf("storage: AppendRecord: QoS %d is not 0, 1 or 2", r.QoS))
	}
	if r.Kind != KindMessage && (r.Sync || r.QoS != 0 || r.Will || r.Retain || (r.Legacy && (r.Kind.LegacyTopic() == "" || r.Topic != r.Kind.LegacyTopic()))) {
		panic(fmt.Sprintf("storage: AppendRecord: control record of kind %s in the shape of a message (topic %q)", r.Kind, r.Topic))
	}
	p := &r.Props
	dst = slices.Grow(dst, encodedLen(r))
	start := len(dst)

	var flags byte
	if r.Retain {
		flags |= flagRetain
	}
	if r.Republished {
		flags |= flagRepublished
	}
	if r.Will {
		flags |= flagWill
	}
	if p.PayloadFormatSet {
		flags |= flagPayloadFormat
	}
	if p.MessageExpirySet {
		flags |= flagMessageExpiry
	}
	version := byte(RecordVersion)
	if r.Sync {
		flags |= flagSync
		version = RecordVersionSync
	}
	control := r.Kind != KindMessage && !r.Legacy
	if control {
		version = RecordVersionControl
	}

	dst = append(dst, version, flags, r.QoS)
	dst = binary.BigEndian.AppendUint64(dst, r.Origin)
	dst = binary.BigEndian.AppendUint64(dst, r.Seq)
	dst = binary.BigEndian.AppendUint64(dst, uint64(r.Time))
	dst = binary.BigEndian.AppendUint16(dst, r.PacketID)
	if control {
		dst = append(dst, byte(r.Kind))
	}

	dst = appendString(dst, r.ClientID)
	dst = appendString(dst, r.Topic)
	dst = appendBytes(dst, r.Payload)
	dst = appendString(dst, p.ContentType)
	dst = appendString(dst, p.ResponseTopic)
	dst = appendBytes(dst, p.CorrelationData)
	if p.PayloadFormatSet {
		dst = append(dst, p.PayloadFormat)
	}
	if p.MessageExpirySet {
		dst = binary.BigEndian.AppendUint32(dst, p.MessageExpiry)
	}
	dst = binary.AppendUvarint(dst, uint64(len(p.User)))
	for i := range p.User {
		dst = appendString(dst, p.User[i].Key)
		dst = appendString(dst, p.User[i].Value)
	}

	return binary.BigEndian.AppendUint32(dst, crc32.Checksum(dst[start:], crcTable))
}

// encodedLen must agree exactly with AppendRecord, or the single up-front
// grow becomes several.
func encodedLen(r *Record) int {
	p := &r.Props
	n := headerLen +
		bodyStart(r.Kind != KindMessage && !r.Legacy) - headerLen +
		fieldLen(len(r.ClientID)) +
		fieldLen(len(r.Topic)) +
		fieldLen(len(r.Payload)) +
		fieldLen(len(p.ContentType)) +
		fieldLen(len(p.ResponseTopic)) +
		fieldLen(len(p.CorrelationData)) +
		uvarintLen(uint64(len(p.User))) +
		crcLen
	if p.PayloadFormatSet {
		n++
	}
	if p.MessageExpirySet {
		n += 4
	}
	for i := range p.User {
		n += fieldLen(len(p.User[i].Key)) + fieldLen(len(p.User[i].Value))
	}
	return n
}

// bodyStart is where the variable fields begin: after the kind byte in a
// version-3 record.
func bodyStart(control bool) int {
	if control {
		return headerLen + 1
	}
	return headerLen
}

func fieldLen(n int) int { return uvarintLen(uint64(n)) + n }

func uvarintLen(x uint64) int { return (bits.Len64(x|1) + 6) / 7 }

func appendString(dst []byte, s string) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(s)))
	return append(dst, s...)
}

func appendBytes(dst, b []byte) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(b)))
	return append(dst, b...)
}

// DecodeRecord decodes one record encoded by AppendRecord.
//
// Nothing in the result aliases b, which may be a bbolt page that is only
// valid inside its transaction. Empty Payload, CorrelationData and User come
// back nil.
//
// The CRC is checked before the body is parsed, so a damaged record reports
// ErrCorrupt. ErrTruncated means a length that runs past the input,
// ErrUnknownVersion a version byte other than RecordVersion and
// RecordVersionSync (a newer writer, or a damaged first byte: the two cannot
// be told apart).
func DecodeRecord(b []byte) (Record, error) {
	if err := checkRecord(b); err != nil {
		return Record{}, err
	}
	end := len(b) - crcLen
	flags, qos := b[offFlags], b[offQoS]
	control := b[offVersion] == RecordVersionControl
	r := Record{
		Origin:      binary.BigEndian.Uint64(b[offOrigin:]),
		Seq:         binary.BigEndian.Uint64(b[offSeq:]),
		QoS:         qos,
		Retain:      flags&flagRetain != 0,
		Republished: flags&flagRepublished != 0,
		Will:        flags&flagWill != 0,
		Sync:        flags&flagSync != 0,
		PacketID:    binary.BigEndian.Uint16(b[offPacketID:]),
		Time:        int64(binary.BigEndian.Uint64(b[offTime:])),
	}

	if control {
		r.Kind = Kind(b[offKind])
	}
	d := decoder{b: b[bodyStart(control):end]}
	r.ClientID = string(d.field("client id"))
	r.Topic = string(d.field("topic"))
	if !control && b[offVersion] == RecordVersion {
		if r.Kind = legacyKind([]byte(r.Topic), flags, qos); r.Kind != KindMessage {
			r.Legacy = true
		}
	}
	r.Payload = cloneBytes(d.field("payload"))
	r.Props.ContentType = string(d.field("content type"))
	r.Props.ResponseTopic = string(d.field("response topic"))
	r.Props.CorrelationData = cloneBytes(d.field("correlation data"))
	if flags&flagPayloadFormat != 0 {
		if v := d.fixed("payload format", 1); v != nil {
			r.Props.PayloadFormat = v[0]
			r.Props.PayloadFormatSet = true
		}
	}
	if flags&flagMessageExpiry != 0 {
		if v := d.fixed("message expiry", 4); v != nil {
			r.Props.MessageExpiry = binary.BigEndian.Uint32(v)
			r.Props.MessageExpirySet = true
		}
	}
	n := d.uvarint("user property count")
	// Each pair takes at least two bytes (two zero lengths); bounding the
	// count by what is left keeps a forged count from driving a huge make.
	if d.err == nil && n > uint64(len(d.b))/2 {
		d.err = fmt.Errorf("record: %d user properties cannot fit in the %d bytes left: %w", n, len(d.b), ErrTruncated)
	}
	if d.err == nil && n > 0 {
		r.Props.User = make([]UserProperty, n)
		for i := range r.Props.User {
			r.Props.User[i].Key = string(d.field("user property key"))
			r.Props.User[i].Value = string(d.field("user property value"))
		}
	}
	if d.err != nil {
		return Record{}, d.err
	}
	if len(d.b) != 0 {
		return Record{}, fmt.Errorf("record: %d trailing bytes after the last field: %w", len(d.b), ErrCorrupt)
	}
	return r, nil
}

// RecordTopic returns the topic and retain flag of an encoded record, with
// the header and CRC checked as DecodeRecord checks them, without decoding
// the rest or allocating: the apply path uses it to skip the records no
// subscriber would receive. topic aliases b.
func RecordTopic(b []byte) (topic []byte, retain bool, err error) {
	_, topic, retain, err = RecordHead(b)
	return topic, retain, err
}

// RecordHead is RecordTopic with the record's kind, as DecodeRecord gives
// it: the applier dispatches on it before anything else.
func RecordHead(b []byte) (kind Kind, topic []byte, retain bool, err error) {
	if err := checkRecord(b); err != nil {
		return 0, nil, false, err
	}
	control := b[offVersion] == RecordVersionControl
	d := decoder{b: b[bodyStart(control) : len(b)-crcLen]}
	d.field("client id")
	topic = d.field("topic")
	if d.err != nil {
		return 0, nil, false, d.err
	}
	switch {
	case control:
		kind = Kind(b[offKind])
	case b[offVersion] == RecordVersion:
		kind = legacyKind(topic, b[offFlags], b[offQoS])
	}
	return kind, topic, b[offFlags]&flagRetain != 0, nil
}

// RecordSync reports whether an encoded record was taken under a sync ack
// rule, from its version byte alone (a version-2 record always carries
// flagSync; the full check is the decoder's).
func RecordSync(b []byte) bool { return len(b) > 0 && b[offVersion] == RecordVersionSync }

// RecordQoS2 reports whether an encoded record is a QoS 2 one, from its
// fixed header alone (the full check is the decoder's).
func RecordQoS2(b []byte) bool { return len(b) > offQoS && b[offQoS] == 2 }

// RecordID returns the record id from the fixed header. It neither parses the
// rest nor checks the CRC: the persist path uses it to match entries to
// pending proposals, and the full check happens when the entry is decoded.
func RecordID(b []byte) (origin, seq uint64, err error) {
	if err := checkHeader(b); err != nil {
		return 0, 0, err
	}
	return binary.BigEndian.Uint64(b[offOrigin:]), binary.BigEndian.Uint64(b[offSeq:]), nil
}

// recordTime returns the publish time from a record's fixed header, for
// retention's max_age; like RecordID it leaves the CRC to the full decode.
func recordTime(b []byte) (int64, bool) {
	if checkHeader(b) != nil {
		return 0, false
	}
	return int64(binary.BigEndian.Uint64(b[offTime:])), true
}

// checkRecord checks what DecodeRecord and RecordTopic both rely on: the
// header, the CRC, and the flag and QoS bytes.
func checkRecord(b []byte) error {
	if err := checkHeader(b); err != nil {
		return err
	}
	end := len(b) - crcLen
	if stored, computed := binary.BigEndian.Uint32(b[end:]), crc32.Checksum(b[:end], crcTable); computed != stored {
		return fmt.Errorf("record: crc mismatch (stored %08x, computed %08x): %w", stored, computed, ErrCorrupt)
	}
	known := byte(flagsKnown)
	if b[offVersion] == RecordVersionSync {
		known |= flagSync
	}
	if flags := b[offFlags]; flags&^known != 0 {
		return fmt.Errorf("record: unknown flag bits %#02x: %w", flags&^known, ErrCorrupt)
	}
	if b[offVersion] == RecordVersionSync && b[offFlags]&flagSync == 0 {
		// The encoding is canonical: a record without the flag is version 1.
		return fmt.Errorf("record: version %d without its sync flag: %w", RecordVersionSync, ErrCorrupt)
	}
	if qos := b[offQoS]; qos > 2 {
		return fmt.Errorf("record: qos %d: %w", qos, ErrCorrupt)
	}
	if b[offVersion] == RecordVersionControl {
		// Canonical: a message is never version 3, and a control record
		// carries nothing of a message's delivery.
		if len(b) < minRecordLen+1 {
			return fmt.Errorf("record: %d bytes, shorter than a control record's %d-byte minimum: %w", len(b), minRecordLen+1, ErrTruncated)
		}
		if b[offKind] == byte(KindMessage) {
			return fmt.Errorf("record: version %d with kind %s: %w", RecordVersionControl, KindMessage, ErrCorrupt)
		}
		if b[offQoS] != 0 || b[offFlags]&(flagWill|flagRetain) != 0 {
			return fmt.Errorf("record: control record with a qos or will/retain flags: %w", ErrCorrupt)
		}
	}
	return nil
}

// checkHeader looks at the version before the length, so that a record from a
// newer tandem is reported as such even if it is shorter than ours can be.
func checkHeader(b []byte) error {
	if len(b) == 0 {
		return fmt.Errorf("record: empty input: %w", ErrTruncated)
	}
	if v := b[offVersion]; v != RecordVersion && v != RecordVersionSync && v != RecordVersionControl {
		return fmt.Errorf("record: version %d, this build reads versions %d to %d only: %w", v, RecordVersion, RecordVersionControl, ErrUnknownVersion)
	}
	if len(b) < minRecordLen {
		return fmt.Errorf("record: %d bytes, shorter than the %d-byte minimum: %w", len(b), minRecordLen, ErrTruncated)
	}
	return nil
}

// decoder walks the variable part of a record. Its error is sticky so that
// DecodeRecord reads as a straight list of fields and checks once.
type decoder struct {
	b   []byte
	err error
}

// uvarint rejects non-minimal encodings as well as overflow: the encoding
// must be canonical (decode then encode gives back the same bytes), so one
// value must have exactly one spelling.
func (d *decoder) uvarint(what string) uint64 {
	if d.err != nil {
		return 0
	}
	var x uint64
	for i, c := range d.b {
		if i == binary.MaxVarintLen64-1 && c > 1 {
			d.err = fmt.Errorf("record: %s: varint overflows 64 bits: %w", what, ErrCorrupt)
			return 0
		}
		x |= uint64(c&0x7f) << (7 * i)
		if c < 0x80 {
			if c == 0 && i > 0 {
				d.err = fmt.Errorf("record: %s: varint not minimally encoded: %w", what, ErrCorrupt)
				return 0
			}
			d.b = d.b[i+1:]
			return x
		}
	}
	d.err = fmt.Errorf("record: input ends inside the %s varint: %w", what, ErrTruncated)
	return 0
}

// field returns a length-prefixed field, aliasing the input; callers copy.
// The length is compared as a uint64 before any conversion to int, which is
// 32 bits on ARM.
func (d *decoder) field(what string) []byte {
	n := d.uvarint(what)
	if d.err != nil {
		return nil
	}
	if n > uint64(len(d.b)) {
		d.err = fmt.Errorf("record: %s length %d exceeds the %d bytes left: %w", what, n, len(d.b), ErrTruncated)
		return nil
	}
	v := d.b[:n:n]
	d.b = d.b[n:]
	return v
}

func (d *decoder) fixed(what string, n int) []byte {
	if d.err != nil {
		return nil
	}
	if n > len(d.b) {
		d.err = fmt.Errorf("record: %s needs %d bytes, %d left: %w", what, n, len(d.b), ErrTruncated)
		return nil
	}
	v := d.b[:n:n]
	d.b = d.b[n:]
	return v
}

func cloneBytes(b []byte) []byte {
	if len(b) == 0 {
		return nil
	}
	c := make([]byte, len(b))
	copy(c, b)
	return c
}
