package mqtt

import (
	"time"
)

// Observer is told about publishes and acks as they happen, for metrics. It
// is called on the broker's hot path (client read loops and the log's
// goroutine): implementations must be cheap, must not block and must not
// allocate per call. The broker does not depend on what it does.
type Observer interface {
	// Published is called for each PUBLISH taken into the log (QoS 0, 1
	// and 2; not wills, not QoS 2 resends of a publish already taken).
	// rule is the index of the first topic rule matching it in the rules
	// in force (Config.Topics, then each SetTopics), -1 when none does
	// and the default applies.
	Published(mode AckMode, qos byte, rule int)
	// Acked is called for each PUBACK or PUBREC the broker owes, when it
	// is written (or, for a 3.1.1 client that has no negative ack, when
	// the client is disconnected instead): err is nil for success, else
	// why the publish was refused, as the Log reported it, or
	// ErrNotAuthorized. latency runs from the PUBLISH being read to the
	// ack being encoded, so it includes the wait for earlier acks of the
	// same client, which MQTT makes it go out after.
	Acked(mode AckMode, err error, latency time.Duration)
	// Refused is called for each client, packet or subscription refused
	// (a rate limit, a bad login, an ACL, a limit, a protocol error),
	// every one, also those whose log line is held back. reason is one of
	// a fixed set of phrases.
	Refused(reason string)
	// Dropped is called when retention took n log positions a session
	// had not been handed yet (an upper bound of the messages it lost:
	// not every position matched its filters).
	Dropped(n uint64)
	// InDoubt is called when n sync records are confirmed that an
	// earlier master logged and never settled: they are delivered,
	// though their publishers may have been refused (docs/acks.md, "What an
	// ack means").
	InDoubt(n uint64)
}

// nopObserver is the Observer when Config.Observer is nil, so the hot path
// needs no nil check.
type nopObserver struct{}

func (nopObserver) Published(AckMode, byte, int)        {}
func (nopObserver) Acked(AckMode, error, time.Duration) {}
func (nopObserver) Refused(string)                      {}
func (nopObserver) Dropped(uint64)                      {}
func (nopObserver) InDoubt(uint64)                      {}

// ruleFor is AckFor that also says which rule matched (-1: none, the
// default async), for the Observer's per-rule counts.
func ruleFor(policies []TopicPolicy, topic string) (int, AckMode) {
	for i := range policies {
		if MatchTopic(policies[i].Filter, topic) {
			return i, policies[i].Ack
		}
	}
	return -1, Async
}
