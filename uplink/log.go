package uplink

import (
	"context"
	"strconv"
)

// Record is one committed log record as the uplink needs it: the daemon
// builds it from storage.Record.
type Record struct {
	Index    uint64 // log index
	Origin   uint64 // node that took the publish; with Seq the record id
	Seq      uint64
	ClientID string // the publishing device, for per-publisher order
	Topic    string
	QoS      byte
	Retain   bool
	Time     int64 // publish time, Unix nanoseconds
	Payload  []byte
	Props    Properties
	// Size is the record's size in the log, the unit of backlog_bytes and
	// max_backlog. It must be what Notify was given for the same index.
	Size int
}

// ID is the record id as the tandem-id user property carries it: origin
// node (16 hex digits, as node ids are printed) and sequence number.
func (r *Record) ID() string {
	return RecordID(r.Origin, r.Seq)
}

// RecordID formats a record id as tandem-id carries it, e.g.
// "00c0ffee00c0ffee-42".
func RecordID(origin, seq uint64) string {
	b := make([]byte, 0, 40)
	h := strconv.AppendUint(nil, origin, 16)
	for range 16 - len(h) {
		b = append(b, '0')
	}
	b = append(b, h...)
	b = append(b, '-')
	return string(strconv.AppendUint(b, seq, 10))
}

// Properties are the MQTT 5 properties that travel with a message.
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

// UserProperty is one MQTT 5 user property.
type UserProperty struct{ Key, Value string }

// Log is what an uplink reads: the committed records. The daemon backs it
// with storage, as it backs mqtt.LogReader.
type Log interface {
	// Committed calls fn for each record with from <= index <= to, in log
	// order, until fn returns false; r is fn's to keep. The uplink asks
	// only up to the last index given to Notify, which is committed (and
	// past its ack rule, for sync topics): an implementation must not stop
	// short of to for any reason but fn. Records that are not messages
	// (conf changes, abort markers, aborted records) are left out.
	Committed(from, to uint64, fn func(r *Record) bool) error
	// FirstIndex is the oldest index the log still holds: records below it
	// were dropped by retention, and an uplink behind it counts them lost.
	FirstIndex() uint64
}

// PositionSink keeps an uplink's position: every record up to and
// including the index has been acknowledged by the cloud (or dropped by
// drop_oldest, or matches none of its topics). The daemon replicates it
// through the log, like session cursors, and the next master passes it to
// Start. Save is called at most every SaveEvery or SaveAcks acks, and once
// at Stop; it must not block for long (propose and return).
type PositionSink interface {
	Save(name string, index uint64)
}

// Message is a downlink message on its way into the local log.
type Message struct {
	Topic   string // LocalPrefix + the remote topic
	QoS     byte
	Retain  bool
	Payload []byte
	Props   Properties
}

// LocalPublisher takes downlink messages. Publish returns once m meets
// the local ack rule of its topic (or fails, or ctx ends): only then is the
// cloud told it has arrived.
type LocalPublisher interface {
	Publish(ctx context.Context, m *Message) error
}
