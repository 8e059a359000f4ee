package mqtt

import (
	"errors"
	"strings"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
)

// AckMode is a topic's acknowledgement rule (see DESIGN.md).
type AckMode uint8

const (
	// Async: PUBACK/PUBREC once the record is on the master's disk.
	Async AckMode = iota
	// Sync: PUBACK/PUBREC once a slave has it on disk too.
	Sync
	// Replicated: on another member's disk too whenever this member has
	// one it can reach, else on the master's: for the session records a
	// member that takes a device over must find (a QoS 2 release), which
	// need not wait out sync_timeout on a gateway with nobody to take over.
	// Not a topic's ack mode.
	Replicated
)

// String returns "async", "sync" or "replicated".
func (m AckMode) String() string {
	switch m {
	case Sync:
		return "sync"
	case Replicated:
		return "replicated"
	}
	return "async"
}

// ParseAckMode parses "sync" or "async".
func ParseAckMode(s string) (AckMode, error) {
	switch s {
	case "sync":
		return Sync, nil
	case "async", "":
		return Async, nil
	}
	return Async, errors.New("ack mode must be sync or async")
}

// TopicPolicy chooses the ack mode of the topics Filter matches.
type TopicPolicy struct {
	Filter string
	Ack    AckMode
}

// AckFor returns the ack mode of topic: the first matching policy wins, and
// async when none matches.
func AckFor(policies []TopicPolicy, topic string) AckMode {
	for i := range policies {
		if MatchTopic(policies[i].Filter, topic) {
			return policies[i].Ack
		}
	}
	return Async
}

// MatchTopic reports whether the MQTT topic filter matches topic, with the
// spec's rule that wildcards at the first level do not match topics starting
// with '$'.
func MatchTopic(filter, topic string) bool {
	if strings.HasPrefix(topic, "$") && (strings.HasPrefix(filter, "+") || strings.HasPrefix(filter, "#")) {
		return false
	}
	for {
		fl, frest, fmore := strings.Cut(filter, "/")
		if fl == "#" {
			return true
		}
		tl, trest, tmore := strings.Cut(topic, "/")
		if fl != "+" && fl != tl {
			return false
		}
		if !fmore || !tmore {
			// "a/#" matches "a" too: the parent level.
			return fmore == tmore || (fmore && frest == "#")
		}
		filter, topic = frest, trest
	}
}

// Message is one publish as the broker hands it to the log and gets it back
// when committed. It mirrors the record of DESIGN.md; the daemon converts.
type Message struct {
	Origin uint64 // set by the log: node that took the publish
	Seq    uint64 // set by the log: per-origin sequence number
	// Kind is KindMessage for what a device sent, or one of the broker's
	// own records (cluster.go); the log keeps it in the record's header,
	// so no device can make its message one of them.
	Kind     Kind
	ClientID string
	Topic    string
	QoS      byte
	Retain   bool
	Will     bool
	// Sync: taken under a sync ack rule; delivered only once the master's
	// settlement confirms it (hold.go).
	Sync bool
	// Republished: re-proposed from a deposed master's tail (inboundDup
	// leaves it out).
	Republished bool
	PacketID    uint16
	Time        int64 // Unix nanoseconds
	Payload     []byte

	PayloadFormat    byte
	PayloadFormatSet bool
	MessageExpiry    uint32
	MessageExpirySet bool
	ContentType      string
	ResponseTopic    string
	CorrelationData  []byte
	User             []packets.UserProperty

	// user is who sent a will: its ACL is checked again, as that user,
	// when it is published.
	user string
}

// Kind tells a device's message from the broker's own records of
// persistent sessions, which travel through the log beside them.
type Kind uint8

// The kinds of Message.
const (
	KindMessage Kind = iota // a PUBLISH, a will, a downlink message
	KindSession             // a persistent session's life (sessionOp)
	KindCursors             // a batch of session cursors
)

// fromPacket fills m from a PUBLISH.
func (m *Message) fromPacket(clientID string, pk *packets.Packet, now int64) {
	m.ClientID = clientID
	m.Topic = pk.TopicName
	m.QoS = pk.FixedHeader.Qos
	m.Retain = pk.FixedHeader.Retain
	m.PacketID = pk.PacketID
	m.Time = now
	m.Payload = pk.Payload
	p := &pk.Properties
	m.PayloadFormat, m.PayloadFormatSet = p.PayloadFormat, p.PayloadFormatFlag
	m.MessageExpiry, m.MessageExpirySet = p.MessageExpiryInterval, p.MessageExpiryInterval > 0
	m.ContentType = p.ContentType
	m.ResponseTopic = p.ResponseTopic
	m.CorrelationData = p.CorrelationData
	m.User = p.User
}

// expiryLeft returns the message expiry that is left of m at now, in
// seconds, and false once it has run out [MQTT-3.3.2-5] [MQTT-3.3.2-6].
func (m *Message) expiryLeft(now time.Time) (uint32, bool) {
	if !m.MessageExpirySet {
		return 0, true
	}
	age := now.Sub(time.Unix(0, m.Time))
	if age >= time.Duration(m.MessageExpiry)*time.Second {
		return 0, false
	}
	return m.MessageExpiry - uint32(age/time.Second), true
}

// Sentinel errors the Log may pass to a proposal's done callback to choose
// the reason code a device sees; anything else is "unspecified error".
var (
	// ErrQuota means the log refused the record for lack of space (0x97).
	ErrQuota = errors.New("mqtt: quota exceeded")

	// ErrNotAuthorized means the client may not publish to the topic (0x87).
	ErrNotAuthorized = errors.New("mqtt: not authorized")
)
