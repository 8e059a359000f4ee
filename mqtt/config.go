package mqtt

import (
	"log/slog"
	"time"
)

// Config configures a Server.
type Config struct {
	// Now is the time of day records are stamped with and their message
	// expiry measured by; nil means time.Now. The gateway gives its clock,
	// which absorbs wall-clock jumps (DESIGN.md, "Time"); durations never
	// read it.
	Now func() time.Time
	// Listen is the TCP address of the MQTT listener ("127.0.0.1:1883").
	Listen string
	// TLS configures an MQTT-over-TLS listener; nil means none.
	TLS *TLSConfig
	// WebSocket configures an MQTT-over-WebSocket listener; nil means
	// none.
	WebSocket *WebSocketConfig
	// AllowAnonymous admits clients without credentials.
	AllowAnonymous bool
	// Users is the users file; nil means none (see Access).
	Users *Users
	// ACL is the ACL file; nil allows everything.
	ACL *ACL
	// Limits bounds clients, topics and connection rates.
	Limits Limits
	// MaxInflight is the receive maximum per client: how many QoS 1/2
	// publishes a client may have unacknowledged.
	MaxInflight int
	// MaxPacketSize bounds one packet, in bytes; 0 means 1 MiB... the MQTT
	// maximum of 256 MiB is too much for a gateway.
	MaxPacketSize uint32
	// TopicAliasMaximum is how many topic aliases an MQTT 5 client may
	// set; 0 means 100.
	TopicAliasMaximum uint16
	// AckReasonStrings has the acks (PUBACK, PUBREC, PUBREL, PUBCOMP,
	// SUBACK, UNSUBACK) carry a Reason String beside a refusal's reason
	// code. Off, they carry the bare code, as Mosquitto and EMQX send, and
	// small device stacks (and the paho test suite) accept only those; the
	// CONNACK and the DISCONNECT carry one either way, and the log says
	// the reason either way.
	AckReasonStrings bool
	// NodeID is this member's id, the Origin the Log gives the records
	// taken here: a session record of this member's own is not applied
	// again.
	NodeID uint64
	// MaxQueued is how many messages a connected session holds ready in
	// memory; past it the session reads the log instead. 0 means 1,000.
	MaxQueued int
	// MaxQueuedBytes bounds the same queue in bytes (topic, payload and
	// outOverhead per message); a message larger than it still goes
	// alone when the queue is empty. 0 means 4 MiB.
	MaxQueuedBytes int64
	// MaxInflightOut is the server's own outbound window per subscriber:
	// how many QoS 1/2 deliveries may await their ack, whatever the
	// client's Receive Maximum (the smaller wins). 0 means 100.
	MaxInflightOut int
	// MaxInflightOutBytes bounds that window in bytes, as MaxQueuedBytes;
	// a message larger than it still goes alone when nothing is in
	// flight. 0 means 4 MiB.
	MaxInflightOutBytes int64
	// DisconnectWhenQueueFull ends the connection of a client whose queue
	// is full (MQTT 5: DISCONNECT 0x97) instead of reading the log for it;
	// its session, if persistent, resumes from its cursor when it comes
	// back.
	DisconnectWhenQueueFull bool
	// Topics chooses each topic's ack mode; first match wins, default async.
	// SetTopics replaces them while the broker runs.
	Topics []TopicPolicy
	// TakeoverWait is how long a session take-over waits for the old
	// connection's acks.
	TakeoverWait time.Duration
	// Sessions persists sessions and retained messages; nil keeps them in
	// memory only.
	Sessions SessionStore
	// Logger receives the broker's messages; nil discards them.
	Logger *slog.Logger
	// Observer is told of each publish and ack, for metrics; nil means
	// none.
	Observer Observer
	// Unreadable is told of a control record the broker cannot read
	// (kind names it): the broker skips it and goes on, as every member
	// does at the same index; nil only logs it.
	Unreadable func(index uint64, kind string, err error)
}
