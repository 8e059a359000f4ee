package mqtt

import (
	"bytes"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// The retained store's caps (DESIGN.md, "Budgets": past their caps a new
// retained topic or persistent session is refused with 0x97, never
// admitted over budget). Issue #31: 3000 retained messages of 100 KB were
// all acked on a 64 MiB budget, and every one held in memory.

// retainedPub sends a retained QoS 1 PUBLISH and returns its PUBACK's
// reason code.
func retainedPub(t *testing.T, r *raw, topic string, pid uint16, payload []byte) byte {
	t.Helper()
	r.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1, Retain: true}, TopicName: topic, PacketID: pid, Payload: payload})
	ack := r.expect(packets.Puback)
	if ack.PacketID != pid {
		t.Fatalf("PUBACK for %d, want %d", ack.PacketID, pid)
	}
	return ack.ReasonCode
}

// retainedOn subscribes a fresh client to filter and returns the retained
// messages it is sent, by topic.
func retainedOn(t *testing.T, s *Server, filter string, want int) map[string][]byte {
	t.Helper()
	c := connected(t, s, 5, fmt.Sprintf("look-%d", time.Now().UnixNano()))
	c.subscribe(1, packets.Subscription{Filter: filter, Qos: 0})
	got := map[string][]byte{}
	for range want {
		pk := c.expect(packets.Publish)
		if !pk.FixedHeader.Retain {
			t.Fatalf("%s sent without the retain flag", pk.TopicName)
		}
		got[pk.TopicName] = pk.Payload
	}
	if pk, err := c.read(200 * time.Millisecond); err == nil { // bounded wait for a message that must not come
		t.Fatalf("more retained messages than %d: %s", want, pk.TopicName)
	}
	return got
}

// A retained publish that would add a topic past max_retained gets PUBACK
// 0x97 and is not logged (3.1.1: disconnected; QoS 0: dropped and
// counted); clearing a topic makes room for another.
func TestRetainedPastTheCountCapIsRefused(t *testing.T) {
	obs := &refusalCounter{}
	s, log := testServer(t, nil, func(c *Config) { c.Limits.MaxRetained = 2; c.Observer = obs })
	pub := connected(t, s, 5, "pub")
	for i, topic := range []string{"r/1", "r/2"} {
		if code := retainedPub(t, pub, topic, uint16(i+1), []byte("v")); code != 0 {
			t.Fatalf("%s: PUBACK %#x", topic, code)
		}
	}
	if code := retainedPub(t, pub, "r/3", 3, []byte("v")); code != packets.ErrQuotaExceeded.Code {
		t.Fatalf("a third retained topic past max_retained 2: PUBACK %#x, want 0x97", code)
	}
	// QoS 0: dropped, counted.
	pub.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Retain: true}, TopicName: "r/4", Payload: []byte("v")})
	testutil.WaitFor(t, 5*time.Second, "the QoS 0 refusal counted", func() bool { return obs.count(whyRetainedCount) == 2 })
	// A plain publish on a new topic is not retained and not refused.
	pub.publish("r/plain", 1, 4, "p")
	if ack := pub.expect(packets.Puback); ack.ReasonCode != 0 {
		t.Fatalf("a plain publish at the retained cap: PUBACK %#x", ack.ReasonCode)
	}
	// MQTT 3.1.1 has no negative PUBACK: disconnected.
	old := connected(t, s, 4, "pub311")
	old.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1, Retain: true}, TopicName: "r/5", PacketID: 1, Payload: []byte("v")})
	if _, saw := old.closed(); saw {
		t.Fatal("a 3.1.1 client got a DISCONNECT")
	}
	testutil.WaitFor(t, 5*time.Second, "the log applied", func() bool { return s.applied.Load() == log.lastIndex() })
	if n := s.Retained(); n != 2 {
		t.Fatalf("%d retained messages, want 2", n)
	}
	for _, topic := range log.topics() {
		if slices.Contains([]string{"r/3", "r/4", "r/5"}, topic) {
			t.Fatalf("refused retained publish on %s was logged", topic)
		}
	}
	if n := obs.count(whyRetainedCount); n != 3 {
		t.Fatalf("%d refusals counted, want 3", n)
	}
	// Cleared (an empty retained payload), a topic makes room.
	if code := retainedPub(t, pub, "r/1", 5, nil); code != 0 {
		t.Fatalf("clearing r/1 at the cap: PUBACK %#x", code)
	}
	testutil.WaitFor(t, 5*time.Second, "r/1 cleared", func() bool { return s.Retained() == 1 })
	if code := retainedPub(t, pub, "r/3", 6, []byte("v")); code != 0 {
		t.Fatalf("r/3 once r/1 is cleared: PUBACK %#x", code)
	}
}

// A retained publish that would grow the retained bytes past
// max_retained_bytes gets PUBACK 0x97 and is not logged. The payloads
// kept are over 1 KiB: memory holds none of them, and a subscriber is
// sent them whole, read from the session store.
func TestRetainedPastTheByteCapIsRefused(t *testing.T) {
	payload := func(b byte) []byte { return bytes.Repeat([]byte{b}, 4000) }
	size := retainedSize(&Message{ClientID: "pub", Topic: "b/1", Payload: payload('a')})
	s, log := testServer(t, nil, func(c *Config) { c.Limits.MaxRetainedBytes = 2*size + size/2 })
	pub := connected(t, s, 5, "pub")
	for i, topic := range []string{"b/1", "b/2"} {
		if code := retainedPub(t, pub, topic, uint16(i+1), payload(byte('a'+i))); code != 0 {
			t.Fatalf("%s: PUBACK %#x", topic, code)
		}
	}
	if code := retainedPub(t, pub, "b/3", 3, payload('c')); code != packets.ErrQuotaExceeded.Code {
		t.Fatalf("retained bytes past max_retained_bytes: PUBACK %#x, want 0x97", code)
	}
	// A small one still fits in what is left.
	if code := retainedPub(t, pub, "b/small", 4, []byte("s")); code != 0 {
		t.Fatalf("a small retained message under the byte cap: PUBACK %#x", code)
	}
	testutil.WaitFor(t, 5*time.Second, "the log applied", func() bool { return s.applied.Load() == log.lastIndex() })
	if slices.Contains(log.topics(), "b/3") {
		t.Fatal("the refused retained publish was logged")
	}
	if got := s.RetainedBytes(); got > s.cfg.Limits.MaxRetainedBytes {
		t.Fatalf("retained bytes %d past the cap %d", got, s.cfg.Limits.MaxRetainedBytes)
	}
	s.retained.mu.RLock()
	for _, topic := range []string{"b/1", "b/2"} {
		if e := s.retained.m[topic]; e == nil || e.m != nil {
			t.Errorf("%s: held in memory (%v), want read from the store", topic, e)
		}
	}
	s.retained.mu.RUnlock()
	got := retainedOn(t, s, "b/#", 3)
	if !bytes.Equal(got["b/1"], payload('a')) || !bytes.Equal(got["b/2"], payload('b')) || string(got["b/small"]) != "s" {
		t.Fatalf("retained messages sent: %d, %d bytes and %q", len(got["b/1"]), len(got["b/2"]), got["b/small"])
	}
}

// At the caps, replacing a topic's retained message is taken (within the
// bytes) and the subscriber gets the new one; growing it past the bytes is
// refused and the old one stays.
func TestReplacingARetainedTopicIsAllowedAtTheCap(t *testing.T) {
	small := []byte("0123456789")
	size := retainedSize(&Message{ClientID: "pub", Topic: "x/1", Payload: small})
	s, _ := testServer(t, nil, func(c *Config) {
		c.Limits.MaxRetained = 2
		c.Limits.MaxRetainedBytes = 2*size + 100
	})
	pub := connected(t, s, 5, "pub")
	retainedPub(t, pub, "x/1", 1, small)
	retainedPub(t, pub, "x/2", 2, small)
	if code := retainedPub(t, pub, "x/1", 3, []byte("9876543210")); code != 0 {
		t.Fatalf("replacing x/1 at max_retained: PUBACK %#x", code)
	}
	if code := retainedPub(t, pub, "x/2", 4, bytes.Repeat([]byte("z"), 500)); code != packets.ErrQuotaExceeded.Code {
		t.Fatalf("growing x/2 past max_retained_bytes: PUBACK %#x, want 0x97", code)
	}
	testutil.WaitFor(t, 5*time.Second, "x/1 replaced", func() bool {
		m := s.retained.matching("x/1")
		return len(m) == 1 && string(m[0].m.Payload) == "9876543210"
	})
	got := retainedOn(t, s, "x/#", 2)
	if string(got["x/1"]) != "9876543210" || string(got["x/2"]) != string(small) {
		t.Fatalf("retained messages sent: %q", got)
	}
}

// A record past the caps that reaches the log anyway (publishes racing on
// two members, a will) is applied as a plain message on every member: not
// retained, and its subscribers do not see the retain flag.
func TestRetainedRecordPastTheCapAtApplyIsNotRetained(t *testing.T) {
	obs := &refusalCounter{}
	s, _ := testServer(t, nil, func(c *Config) { c.Limits.MaxRetained = 1; c.Observer = obs })
	s.Retain(1, &Message{Topic: "a/1", Retain: true, Payload: []byte("kept")})
	s.Retain(2, &Message{Topic: "a/2", Retain: true, Payload: []byte("over")})
	if n := s.Retained(); n != 1 {
		t.Fatalf("%d retained after a record past max_retained, want 1", n)
	}
	if n := obs.count(whyRetainedApply); n != 1 {
		t.Fatalf("%d refusals at apply counted, want 1", n)
	}
	// Replacing the one kept stays possible.
	s.Retain(3, &Message{Topic: "a/1", Retain: true, Payload: []byte("new")})
	if m := s.retained.matching("a/#"); len(m) != 1 || string(m[0].m.Payload) != "new" {
		t.Fatalf("after replacing a/1: %v", m)
	}
}

// A CONNECT that would start a persistent session past max_sessions gets
// CONNACK 0x97 (3.1.1: 0x03 server unavailable); a session resuming, a
// session started over in its own place, and clean sessions connect.
func TestPersistentSessionsPastTheCapAreRefused(t *testing.T) {
	obs := &refusalCounter{}
	s, _ := testServer(t, nil, func(c *Config) { c.Limits.MaxSessions = 2; c.Observer = obs })
	keep := &packets.Properties{SessionExpiryInterval: 3600, SessionExpiryIntervalFlag: true}
	for _, id := range []string{"p1", "p2"} {
		if ack := dialRaw(t, s.Addr(), 5).connect(id, false, keep); ack.ReasonCode != 0 {
			t.Fatalf("%s: CONNACK %#x", id, ack.ReasonCode)
		}
	}
	if ack := dialRaw(t, s.Addr(), 5).connect("p3", false, keep); ack.ReasonCode != packets.ErrQuotaExceeded.Code {
		t.Fatalf("a third persistent session past max_sessions 2: CONNACK %#x, want 0x97", ack.ReasonCode)
	}
	if ack := dialRaw(t, s.Addr(), 4).connect("p311", false, nil); ack.ReasonCode != 0x03 {
		t.Fatalf("MQTT 3.1.1 persistent session past max_sessions: CONNACK %#x, want 0x03", ack.ReasonCode)
	}
	if ack := dialRaw(t, s.Addr(), 5).connect("clean", true, nil); ack.ReasonCode != 0 {
		t.Fatalf("a clean session at max_sessions: CONNACK %#x", ack.ReasonCode)
	}
	if ack := dialRaw(t, s.Addr(), 5).connect("p1", false, keep); ack.ReasonCode != 0 || !ack.SessionPresent {
		t.Fatalf("p1 resuming at max_sessions: CONNACK %#x, session present %v", ack.ReasonCode, ack.SessionPresent)
	}
	if ack := dialRaw(t, s.Addr(), 5).connect("p2", true, keep); ack.ReasonCode != 0 {
		t.Fatalf("p2 starting over at max_sessions: CONNACK %#x", ack.ReasonCode)
	}
	if n := s.PersistentSessions(); n != 2 {
		t.Fatalf("%d persistent sessions, want 2", n)
	}
	if n := obs.count(whyMaxSessions); n != 2 {
		t.Fatalf("%d refusals counted, want 2", n)
	}
}

// A client that connects and subscribes while the gateway applies a
// retained message gets it: from the retained store, or live. CI once saw
// paho-mqtt's retained case get nothing in 20 s: the record's index was
// handed to replays before the retained store had it; the new session's
// first replay, with no subscription yet, moved past it; the SUBSCRIBE
// then found the store without it, and the offer that followed was taken
// for one the replay had already had.
func TestRetainedMessageAppliedWhileAClientSubscribesReachesIt(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	stall, goOn := make(chan uint64, 1), make(chan struct{})
	release := sync.OnceFunc(func() { close(goOn) })
	t.Cleanup(release) // before the server stops (cleanups run last first)
	var once sync.Once
	s.handedHook = func(index uint64) {
		once.Do(func() {
			stall <- index
			<-goOn
		})
	}
	pub := dialRaw(t, s.Addr(), 5)
	pub.connect("rp", true, nil)
	pub.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1, Retain: true}, TopicName: "rt/a", PacketID: 1, Payload: []byte("kept")})
	pub.expect(packets.Puback) // acked once logged, before it is applied
	<-stall                    // the applier is inside Deliver
	sub := dialRaw(t, s.Addr(), 4)
	sub.connect("late", true, nil)
	sub.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
	sub.expect(packets.Pingresp) // its first replay has run
	sub.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1}, PacketID: 1,
		Filters: []packets.Subscription{{Filter: "rt/#", Qos: 1}}})
	got := 0
	for suback := false; !suback || got == 0; {
		pk, err := sub.read(3 * time.Second)
		if err != nil {
			break
		}
		switch pk.FixedHeader.Type {
		case packets.Suback:
			suback = true
			release()
		case packets.Publish:
			got++
			if string(pk.Payload) != "kept" {
				t.Fatalf("got %q", pk.Payload)
			}
			sub.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
		}
	}
	if got == 0 {
		t.Fatal("the retained message applied while the client subscribed never reached it")
	}
}
