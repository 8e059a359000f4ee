package mqtt

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// [MQTT-4.3.3-9] and DESIGN's guarantee for a device that moves: QoS 2
// deliveries to a persistent session are exactly once when the device's
// gateway dies (kill -9) and the device resumes on another member. The
// new member sends a message the device may hold under the same packet id
// (the device takes it for the duplicate), PUBRELs a message the device
// PUBREC'd, and never sends again one whose flow the device completed.
func TestMQTT_4_3_3_9_QoS2ExactlyOnceAcrossAMove(t *testing.T) {
	for _, v := range []byte{4, 5} {
		t.Run(fmt.Sprintf("v%d", v), func(t *testing.T) { qos2Move(t, v) })
	}
}

func qos2Move(t *testing.T, v byte) {
	l := newSharedLog()
	a, b := startMember(t, l, 1), startMember(t, l, 2)
	props := sessionProps(v)
	dev := dialRaw(t, a.srv.Addr(), v)
	if ack := dev.connect("dev", false, props); ack.ReasonCode != 0 {
		t.Fatalf("CONNACK %#x", ack.ReasonCode)
	}
	dev.subscribe(1, packets.Subscription{Filter: "m/#", Qos: 2})
	for i := 1; i <= 6; i++ {
		l.add(&Message{Origin: 9, Seq: uint64(i), ClientID: "sensor", Topic: "m/x", QoS: 2, Payload: []byte{byte('0' + i)}})
	}

	// The device: method B of [MQTT-4.3.3]: it hands a message on when
	// its PUBLISH comes and holds the packet id until PUBREL.
	pidOf := map[string]uint16{}
	delivered := map[string]int{}
	for i := 0; i < 6; i++ {
		p := dev.expect(packets.Publish)
		pidOf[string(p.Payload)] = p.PacketID
		delivered[string(p.Payload)]++
	}
	// 1 and 2 complete; 3 is PUBREL'd (no PUBCOMP yet); 4 is PUBREC'd and
	// its PUBREL does not come before the gateway dies; 5 is held, not
	// PUBREC'd; 6 arrived but the device's reply is lost with the link.
	completeOneTwoReleaseThree(t, dev, pidOf)
	b.caughtUp(t) // the releases of 1-3 are in the log, as they were before each PUBREL
	a.kill(t)
	dev.c.Close()

	dev = dialRaw(t, b.srv.Addr(), v)
	if ack := dev.connect("dev", false, props); ack.ReasonCode != 0 || !ack.SessionPresent {
		t.Fatalf("on the other member: CONNACK %#x session present %v; want 0, true", ack.ReasonCode, ack.SessionPresent)
	}
	held := map[uint16]string{pidOf["3"]: "3", pidOf["4"]: "4", pidOf["5"]: "5"} // ids the device still holds
	rel3 := false
	for len(held) > 0 || !rel3 {
		p := dev.next()
		switch p.FixedHeader.Type {
		case packets.Pubrel:
			if held[p.PacketID] == "3" {
				rel3 = true
				delete(held, p.PacketID)
			} else if p.PacketID != pidOf["1"] && p.PacketID != pidOf["2"] {
				t.Fatalf("PUBREL for packet id %d, which the device never PUBREC'd", p.PacketID)
			}
			dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubcomp}, PacketID: p.PacketID})
		case packets.Publish:
			k := string(p.Payload)
			if k == "1" || k == "2" || k == "3" {
				t.Fatalf("message %s, whose flow the device completed or had PUBREL'd, sent again", k)
			}
			if want, ok := pidOf[k]; ok && (k == "4" || k == "5") && (p.PacketID != want || !p.FixedHeader.Dup) {
				t.Fatalf("message %s came again under packet id %d dup %v, not %d dup true: the device takes it for a new one",
					k, p.PacketID, p.FixedHeader.Dup, want)
			}
			if held[p.PacketID] != k {
				delivered[k]++ // not a duplicate of an id the device holds
			}
			if k == "4" || k == "5" {
				delete(held, p.PacketID)
			}
			dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrec}, PacketID: p.PacketID})
		default:
			t.Fatalf("unexpected packet type %d", p.FixedHeader.Type)
		}
	}
	for _, k := range []string{"1", "2", "3", "4", "5"} {
		if delivered[k] != 1 {
			t.Errorf("message %s handed to the device's application %d times, want once", k, delivered[k])
		}
	}
	// B still works: a new message arrives under the id its index gives.
	l.add(&Message{Origin: 9, Seq: 7, ClientID: "sensor", Topic: "m/x", QoS: 2, Payload: []byte("7")})
	for {
		p := dev.next()
		if p.FixedHeader.Type == packets.Publish && string(p.Payload) == "7" {
			break
		}
	}
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
	for dev.next().FixedHeader.Type != packets.Pingresp {
	}
}

// [MQTT-4.3.3-9] for what a device publishes: a QoS 2 publish logged by
// a gateway that died before the device got its PUBREC is resent (DUP) to
// the member the device moves to; it gets the PUBREC there and is not
// logged twice, and its PUBREL gets PUBCOMP. A new publish reusing the
// packet id (no DUP) is logged: a flow of its own.
func TestMQTT_4_3_3_9_QoS2InboundExactlyOnceAcrossAMove(t *testing.T) {
	for _, v := range []byte{4, 5} {
		t.Run(fmt.Sprintf("v%d", v), func(t *testing.T) {
			l, a, b, dev, props := deviceOnA(t, v)
			pub := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 2}, TopicName: "in/x", PacketID: 7, Payload: []byte("once")}
			dev.write(pub)
			dev.expect(packets.Pubrec) // logged; the device is told, but say the PUBREC is lost on its way
			b.caughtUp(t)
			a.kill(t)
			dev.c.Close()

			dev = dialRaw(t, b.srv.Addr(), v)
			if ack := dev.connect("dev", false, props); !ack.SessionPresent {
				t.Fatal("session not present on the other member")
			}
			pub.FixedHeader.Dup = true
			dev.write(pub)
			if rec := dev.expect(packets.Pubrec); rec.PacketID != 7 || rec.ReasonCode >= 0x80 {
				t.Fatalf("PUBREC %+v for the resend", rec)
			}
			dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: 7})
			if comp := dev.expect(packets.Pubcomp); comp.PacketID != 7 || comp.ReasonCode != 0 {
				t.Fatalf("PUBCOMP %#x for the PUBREL, want 0", comp.ReasonCode)
			}
			next := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 2}, TopicName: "in/x", PacketID: 7, Payload: []byte("new")}
			dev.write(next)
			dev.expect(packets.Pubrec)
			b.caughtUp(t)
			counts := map[string]int{}
			l.mu.Lock()
			n := uint64(len(l.recs))
			l.mu.Unlock()
			_ = b.Committed(1, n, func(_ uint64, m *Message) bool {
				if m.Topic == "in/x" {
					counts[string(m.Payload)]++
				}
				return true
			})
			if counts["once"] != 1 || counts["new"] != 1 {
				t.Fatalf("in the log: %v; want the resent publish once and the new one once", counts)
			}
		})
	}
}

// A persistent session's SUBACK (and UNSUBACK) waits until the
// subscription's record is logged: a device told it is subscribed finds
// the subscription on whichever member it moves to. A clean session's
// subscription lives on this member only and is answered at once.
func TestSubackWaitsForTheSubscriptionRecord(t *testing.T) {
	log := newMemLog()
	hold := make(chan struct{})
	log.hold = hold
	s, _ := testServer(t, log, nil)
	clean := dialRaw(t, s.Addr(), 5)
	clean.connect("clean", true, nil)
	clean.subscribe(1, packets.Subscription{Filter: "a/#", Qos: 1}) // expects the SUBACK now

	dev := dialRaw(t, s.Addr(), 5)
	dev.connect("dev", false, &packets.Properties{SessionExpiryInterval: 600, SessionExpiryIntervalFlag: true})
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1}, PacketID: 2,
		Filters: packets.Subscriptions{{Filter: "b/#", Qos: 1}}})
	if pk, err := dev.read(200 * time.Millisecond); err == nil {
		t.Fatalf("packet type %d before the subscription record was logged", pk.FixedHeader.Type)
	}
	close(hold)
	if ack := dev.expect(packets.Suback); ack.PacketID != 2 || ack.ReasonCodes[0] != 1 {
		t.Fatalf("SUBACK %+v", ack)
	}
	log.mu.Lock()
	defer log.mu.Unlock()
	for _, m := range log.recs {
		if m.Topic == sessionTopic && strings.Contains(string(m.Payload), `"op":"sub"`) {
			return
		}
	}
	t.Fatal("no subscription record in the log once SUBACK came")
}

// A lone gateway (a log no other member shares) PUBRELs a QoS 2 delivery
// at once and logs no release record: nobody could take the session over.
func TestLoneGatewayReleasesQoS2WithoutARecord(t *testing.T) {
	s, log := testServer(t, nil, nil)
	dev := dialRaw(t, s.Addr(), 5)
	dev.connect("dev", false, &packets.Properties{SessionExpiryInterval: 600, SessionExpiryIntervalFlag: true})
	dev.subscribe(1, packets.Subscription{Filter: "m/#", Qos: 2})
	pub := dialRaw(t, s.Addr(), 5)
	pub.connect("pub", true, nil)
	pub.publish("m/x", 1, 1, "one")
	pub.expect(packets.Puback)
	p := dev.expect(packets.Publish)
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrec}, PacketID: p.PacketID})
	if rel := dev.expect(packets.Pubrel); rel.PacketID != p.PacketID {
		t.Fatalf("PUBREL %d, want %d", rel.PacketID, p.PacketID)
	}
	log.mu.Lock()
	defer log.mu.Unlock()
	for _, m := range log.recs {
		if m.Topic == sessionTopic && strings.Contains(string(m.Payload), `"rel"`) {
			t.Fatalf("a release record on a lone gateway: %s", m.Payload)
		}
	}
}

// [MQTT-3.2.0-1]: the first packet from the server is the CONNACK — also
// for a resumed session whose messages wait, when the applier wakes its
// writer (its start record applied) while the CONNECT is still being
// answered.
func TestMQTT_3_2_0_1_NothingBeforeConnack(t *testing.T) {
	s, log := testServer(t, nil, nil)
	// A connect syncs the session before its CONNACK: let the applier
	// apply the session's start record (and wake its writer) meanwhile.
	log.store.onSync = func() {
		testutil.WaitFor(t, 5*time.Second, "the start record applied", func() bool {
			log.mu.Lock()
			defer log.mu.Unlock()
			return int(log.applied) >= len(log.recs)
		})
	}
	props := &packets.Properties{SessionExpiryInterval: 600, SessionExpiryIntervalFlag: true}
	for round := 0; round < 40; round++ {
		id := fmt.Sprintf("early-%d", round)
		dev := dialRaw(t, s.Addr(), 5)
		dev.connect(id, false, props)
		dev.subscribe(1, packets.Subscription{Filter: "early/#", Qos: 1})
		dev.c.Close()
		pub := dialRaw(t, s.Addr(), 5)
		pub.connect("pub", true, nil)
		for i := 1; i <= 3; i++ {
			pub.publish("early/x", 1, uint16(i), "waiting")
			pub.expect(packets.Puback)
		}
		pub.c.Close()
		back := dialRaw(t, s.Addr(), 5)
		if ack := back.connect(id, false, props); !ack.SessionPresent { // fails unless the first packet is the CONNACK
			t.Fatalf("round %d: session not present", round)
		}
		back.expect(packets.Publish)
		back.c.Close()
	}
}

// The release records of the member a device left may be applied on the
// member it comes to only after it came: a follower learns the commit
// index from the next master, so what the dead master logged last is
// applied here once the device is back (e2e: 5 of 410 delivered twice
// through a master's kill -9). Its session is online then, waiting for
// its start record before it replays; a release applied meanwhile must
// keep the flow PUBREL'd as on an offline copy, or the replay sends a
// message the device has completed, and the device takes it for a new one.
func TestQoS2ReleaseAppliedAfterTheDeviceCameBack(t *testing.T) {
	l := newSharedLog()
	a, b := startMember(t, l, 1), startMember(t, l, 2)
	props := &packets.Properties{SessionExpiryInterval: 600, SessionExpiryIntervalFlag: true}
	dev := dialRaw(t, a.srv.Addr(), 5)
	dev.connect("dev", false, props)
	dev.subscribe(1, packets.Subscription{Filter: "m/#", Qos: 2})
	for i := 1; i <= 4; i++ {
		l.add(&Message{Origin: 9, Seq: uint64(i), ClientID: "sensor", Topic: "m/x", QoS: 2, Payload: []byte{byte('0' + i)}})
	}
	last := b.holdHere() // b applies nothing a logs from here on until the device is on b
	b.caughtUp(t)

	pidOf := map[string]uint16{}
	for i := 0; i < 4; i++ {
		p := dev.expect(packets.Publish)
		pidOf[string(p.Payload)] = p.PacketID
	}
	// 1 and 2 complete; 3 is PUBREL'd, its PUBCOMP lost with the link; 4
	// is held, not PUBREC'd.
	completeOneTwoReleaseThree(t, dev, pidOf)
	testutil.WaitFor(t, 5*time.Second, "the releases of 1-3 in the log", func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		n := 0
		for _, m := range l.recs[last:] {
			if m.Kind == KindSession && strings.Contains(string(m.Payload), `"op":"rel"`) {
				var op sessionOp
				if json.Unmarshal(m.Payload, &op) == nil {
					n += len(op.Rel)
				}
			}
		}
		return n == 3
	})
	a.kill(t)
	dev.c.Close()

	dev = dialRaw(t, b.srv.Addr(), 5)
	if ack := dev.connect("dev", false, props); ack.ReasonCode != 0 || !ack.SessionPresent {
		t.Fatalf("on the other member: CONNACK %#x session present %v; want 0, true", ack.ReasonCode, ack.SessionPresent)
	}
	testutil.WaitFor(t, 5*time.Second, "b's start record in the log", func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		for _, m := range l.recs[last:] {
			if m.Origin == 2 && m.Kind == KindSession && strings.Contains(string(m.Payload), `"op":"start"`) {
				return true
			}
		}
		return false
	})
	b.holdAt(0) // the releases are applied now, with the device on b

	held := map[uint16]string{pidOf["3"]: "3", pidOf["4"]: "4"} // ids the device still holds
	for len(held) > 0 {
		p := dev.next()
		switch p.FixedHeader.Type {
		case packets.Pubrel:
			if held[p.PacketID] == "3" {
				delete(held, p.PacketID)
			} else if p.PacketID != pidOf["1"] && p.PacketID != pidOf["2"] {
				t.Fatalf("PUBREL for packet id %d, which the device never PUBREC'd", p.PacketID)
			}
			dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubcomp}, PacketID: p.PacketID})
		case packets.Publish:
			k := string(p.Payload)
			if k != "4" {
				t.Fatalf("message %s, whose flow the device completed or had PUBREL'd, sent again (packet id %d, dup %v)", k, p.PacketID, p.FixedHeader.Dup)
			}
			if p.PacketID != pidOf["4"] || !p.FixedHeader.Dup {
				t.Fatalf("message 4 came again under packet id %d dup %v, not %d dup true", p.PacketID, p.FixedHeader.Dup, pidOf["4"])
			}
			delete(held, p.PacketID)
			dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrec}, PacketID: p.PacketID})
		default:
			t.Fatalf("unexpected packet type %d", p.FixedHeader.Type)
		}
	}
	// b goes on: a new message arrives, and nothing of 1-3 before it.
	l.add(&Message{Origin: 9, Seq: 5, ClientID: "sensor", Topic: "m/x", QoS: 2, Payload: []byte("5")})
	for {
		p := dev.next()
		if p.FixedHeader.Type == packets.Pubrel {
			dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubcomp}, PacketID: p.PacketID})
			continue
		}
		if p.FixedHeader.Type != packets.Publish {
			t.Fatalf("unexpected packet type %d", p.FixedHeader.Type)
		}
		if k := string(p.Payload); k == "5" {
			break
		} else if k != "4" {
			t.Fatalf("message %s sent again", k)
		}
	}
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
	for dev.next().FixedHeader.Type != packets.Pingresp {
	}
}

// completeOneTwoReleaseThree PUBRECs the deliveries of payloads 1, 2 and
// 3 (each answered with its PUBREL) and PUBCOMPs 1 and 2: two flows
// complete, the third released.
func completeOneTwoReleaseThree(t *testing.T, dev *raw, pidOf map[string]uint16) {
	t.Helper()
	for _, k := range []string{"1", "2", "3"} {
		dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrec}, PacketID: pidOf[k]})
		if rel := dev.expect(packets.Pubrel); rel.PacketID != pidOf[k] {
			t.Fatalf("PUBREL for %d, want %d", rel.PacketID, pidOf[k])
		}
	}
	for _, k := range []string{"1", "2"} {
		dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubcomp}, PacketID: pidOf[k]})
	}
}

// [MQTT-4.3.3-9] across a move, when the device asks for its PUBREL again
// before the member it is on has logged the flow's release record: by a
// repeated PUBREC, or by reconnecting to the same member (the resend of
// a resumed session). A PUBREL then would let the device complete a flow
// that the member it moves to, if this one dies before the record is
// logged, sends again under the same packet id: to the device, a new
// message. The PUBREL waits for the record; once it is logged, it goes.
func TestMQTT_4_3_3_9_NoPubrelBeforeTheReleaseIsLogged(t *testing.T) {
	for _, v := range []byte{4, 5} {
		t.Run(fmt.Sprintf("v%d", v), func(t *testing.T) {
			for _, logged := range []bool{true, false} {
				name := "then-moves"
				if logged {
					name = "then-logged"
				}
				t.Run(name, func(t *testing.T) { pubrelWaitsForItsRecord(t, v, logged) })
			}
		})
	}
}

// pubrelWaitsForItsRecord: the device PUBRECs a delivery on a whose
// release record a holds back, asks for the PUBREL again twice, and
// either the record is logged (the PUBREL comes) or a dies without it and
// the device moves to b, where the message comes again under the packet
// id the device still holds.
func pubrelWaitsForItsRecord(t *testing.T, v byte, logged bool) {
	l := newSharedLog()
	a, b := startMember(t, l, 1), startMember(t, l, 2)
	props := sessionProps(v)
	dev := dialRaw(t, a.srv.Addr(), v)
	dev.connect("dev", false, props)
	dev.subscribe(1, packets.Subscription{Filter: "m/#", Qos: 2})
	l.add(&Message{Origin: 9, Seq: 1, ClientID: "sensor", Topic: "m/x", QoS: 2, Payload: []byte("1")})
	p := dev.expect(packets.Publish)
	pid := p.PacketID
	let := a.holdReleases(t)
	rec := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrec}, PacketID: pid}
	ping := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}}
	dev.write(rec)
	dev.write(rec) // again: its PUBREL, if it went, comes before the PINGRESP
	dev.write(ping)
	if pk := dev.next(); pk.FixedHeader.Type != packets.Pingresp {
		t.Fatalf("packet type %d (PUBREL is %d) on a repeated PUBREC, before the release record is logged", pk.FixedHeader.Type, packets.Pubrel)
	}
	dev.c.Close()
	// Back on the same member: its resend comes right after the CONNACK.
	dev = dialRaw(t, a.srv.Addr(), v)
	if ack := dev.connect("dev", false, props); ack.ReasonCode != 0 || !ack.SessionPresent {
		t.Fatalf("back on a: CONNACK %#x session present %v", ack.ReasonCode, ack.SessionPresent)
	}
	dev.write(ping)
	if pk := dev.next(); pk.FixedHeader.Type != packets.Pingresp {
		t.Fatalf("packet type %d (PUBREL is %d) in the resend, before the release record is logged", pk.FixedHeader.Type, packets.Pubrel)
	}
	if logged {
		let()
		if rel := dev.expect(packets.Pubrel); rel.PacketID != pid {
			t.Fatalf("PUBREL %d once the release record is logged, want %d", rel.PacketID, pid)
		}
		dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubcomp}, PacketID: pid})
		dev.write(ping)
		dev.expect(packets.Pingresp)
		return
	}
	b.caughtUp(t)
	a.kill(t) // the release record never logged
	dev.c.Close()
	dev = dialRaw(t, b.srv.Addr(), v)
	if ack := dev.connect("dev", false, props); ack.ReasonCode != 0 || !ack.SessionPresent {
		t.Fatalf("on b: CONNACK %#x session present %v", ack.ReasonCode, ack.SessionPresent)
	}
	// The device still holds pid (never PUBREL'd): the message must come
	// under it, with DUP, and the flow go on to its PUBREL there.
	p = dev.expect(packets.Publish)
	if string(p.Payload) != "1" || p.PacketID != pid || !p.FixedHeader.Dup {
		t.Fatalf("on b: PUBLISH %q id %d dup %v; want the held message under id %d with DUP", p.Payload, p.PacketID, p.FixedHeader.Dup, pid)
	}
	dev.write(rec)
	if rel := dev.expect(packets.Pubrel); rel.PacketID != pid {
		t.Fatalf("on b: PUBREL %d, want %d", rel.PacketID, pid)
	}
}

// A device's subscriptions follow it to the member it moves to also when
// that member applies the records of the last ones only after the device
// came (a follower learns the commit index from the next master): its
// session is online then, waiting for its start record before it
// replays, and a subscribe or unsubscribe another member logged before
// is taken as into an offline copy, or the replay misses what the
// device subscribed to and sends what it unsubscribed from. A filter the
// device names again on the new member keeps what it did there.
func TestSubscriptionsAppliedAfterTheDeviceCameBack(t *testing.T) {
	l := newSharedLog()
	a, b := startMember(t, l, 1), startMember(t, l, 2)
	props := &packets.Properties{SessionExpiryInterval: 600, SessionExpiryIntervalFlag: true}
	dev := dialRaw(t, a.srv.Addr(), 5)
	dev.connect("dev", false, props)
	dev.subscribe(1, packets.Subscription{Filter: "old/#", Qos: 1}, packets.Subscription{Filter: "again/#", Qos: 1})
	b.caughtUp(t)
	b.holdHere() // b applies nothing logged from here on until the device is on b

	dev.subscribe(2, packets.Subscription{Filter: "new/#", Qos: 1})
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Unsubscribe, Qos: 1}, PacketID: 3,
		Filters: packets.Subscriptions{{Filter: "old/#"}, {Filter: "again/#"}}})
	dev.expect(packets.Unsuback)
	a.kill(t)
	dev.c.Close()
	for i, topic := range []string{"old/x", "new/x", "again/x"} {
		l.add(&Message{Origin: 9, Seq: uint64(i + 1), ClientID: "sensor", Topic: topic, QoS: 1, Payload: []byte(topic)})
	}

	dev = dialRaw(t, b.srv.Addr(), 5)
	if ack := dev.connect("dev", false, props); ack.ReasonCode != 0 || !ack.SessionPresent {
		t.Fatalf("on the other member: CONNACK %#x session present %v; want 0, true", ack.ReasonCode, ack.SessionPresent)
	}
	// Named again here: newer than a's unsubscribe, applied after it.
	dev.subscribe(4, packets.Subscription{Filter: "again/#", Qos: 1})
	b.holdAt(0)

	var got []string
	for len(got) < 2 {
		p := dev.expect(packets.Publish)
		got = append(got, string(p.Payload))
		dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: p.PacketID})
	}
	if got[0] != "new/x" || got[1] != "again/x" {
		t.Fatalf("delivered %v on the other member; want [new/x again/x] (old/# unsubscribed on a, new/# subscribed on a, again/# subscribed again on b)", got)
	}
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
	dev.expect(packets.Pingresp)
}

// A device that resumes its session on a member that cannot log the
// session's start record (the log full, no master, a failing disk) is not
// served from a state that may lack what the member it left logged: the
// replay waits for that record, and without it this member cannot know
// it has applied the release of a QoS 2 flow the device completed there
// (it would send the message again: to the device, a new one). The
// CONNECT is refused (MQTT 5 0x97 for a full log; 3.1.1 0x03), or, when
// the failure comes after the CONNACK, the connection ends (0x97) before
// anything is delivered; the session stays, and resumes once the record
// can be logged.
func TestResumeRefusedWhileTheStartRecordCannotBeLogged(t *testing.T) {
	for _, tc := range []struct {
		name  string
		v     byte
		late  bool // the refusal comes after the CONNACK
		code  byte // of the CONNACK, or of the DISCONNECT when late
		props *packets.Properties
	}{
		{"v5", 5, false, 0x97, &packets.Properties{SessionExpiryInterval: 600, SessionExpiryIntervalFlag: true}},
		{"v4", 4, false, 0x03, nil},
		{"v5-after-connack", 5, true, 0x97, &packets.Properties{SessionExpiryInterval: 600, SessionExpiryIntervalFlag: true}},
		{"v4-after-connack", 4, true, 0, nil},
	} {
		t.Run(tc.name, func(t *testing.T) { resumeWithoutStart(t, tc.v, tc.late, tc.code, tc.props) })
	}
}

func resumeWithoutStart(t *testing.T, v byte, late bool, code byte, props *packets.Properties) {
	l := newSharedLog()
	a, b := startMember(t, l, 1), startMember(t, l, 2)
	dev := dialRaw(t, a.srv.Addr(), v)
	dev.connect("dev", false, props)
	dev.subscribe(1, packets.Subscription{Filter: "m/#", Qos: 2})
	l.add(&Message{Origin: 9, Seq: 1, ClientID: "sensor", Topic: "m/x", QoS: 2, Payload: []byte("1")})
	b.caughtUp(t)
	b.holdHere() // b applies nothing logged from here on for now
	p := dev.expect(packets.Publish)
	pid := p.PacketID
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrec}, PacketID: pid})
	dev.expect(packets.Pubrel) // a logged the release
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubcomp}, PacketID: pid})
	a.kill(t) // the device completed message 1 there
	dev.c.Close()

	full := fmt.Errorf("%w: the log is over its budget", ErrQuota)
	let := make(chan struct{})
	b.setGate(func(msg *Message) (<-chan struct{}, error) {
		if !isSessionOp(msg, "start") {
			return nil, nil
		}
		if late {
			return let, full
		}
		return nil, full
	})
	dev = dialRaw(t, b.srv.Addr(), v)
	ack := dev.connect("dev", false, props)
	if !late {
		if ack.ReasonCode != code {
			t.Fatalf("CONNACK %#x resuming without a start record, want %#x", ack.ReasonCode, code)
		}
	} else {
		if ack.ReasonCode != 0 || !ack.SessionPresent {
			t.Fatalf("CONNACK %#x session present %v", ack.ReasonCode, ack.SessionPresent)
		}
		close(let)
	}
	for {
		pk, err := dev.read(5 * time.Second)
		if err != nil {
			if !late || v == 4 {
				break // closed
			}
			t.Fatalf("no DISCONNECT after the start record failed: %v", err)
		}
		switch pk.FixedHeader.Type {
		case packets.Publish:
			t.Fatalf("message %q (packet id %d, dup %v) delivered from a state without the release the device completed", pk.Payload, pk.PacketID, pk.FixedHeader.Dup)
		case packets.Disconnect:
			if !late || pk.ReasonCode != code {
				t.Fatalf("DISCONNECT %#x, want %#x", pk.ReasonCode, code)
			}
		default:
			continue
		}
		break
	}
	dev.c.Close()

	// The log takes records again: the session resumes, with the release.
	b.setGate(nil)
	b.holdAt(0)
	dev = dialRaw(t, b.srv.Addr(), v)
	if ack := dev.connect("dev", false, props); ack.ReasonCode != 0 || !ack.SessionPresent {
		t.Fatalf("once the log takes records: CONNACK %#x session present %v", ack.ReasonCode, ack.SessionPresent)
	}
	l.add(&Message{Origin: 9, Seq: 2, ClientID: "sensor", Topic: "m/x", QoS: 2, Payload: []byte("2")})
	for {
		pk := dev.next()
		switch pk.FixedHeader.Type {
		case packets.Pubrel:
			dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubcomp}, PacketID: pk.PacketID})
			continue
		case packets.Publish:
			if string(pk.Payload) != "2" {
				t.Fatalf("message %q sent again after the device completed it", pk.Payload)
			}
		default:
			t.Fatalf("unexpected packet type %d", pk.FixedHeader.Type)
		}
		break
	}
}

// The resend of a resumed session's flows in flight waits for its start
// record too: a device that moves from b to a and back to b (a dies)
// may have completed on a a flow b still holds in flight from when the
// device was on b, and b may apply a's release of it only after the
// device came back. Resent at once, the message goes under the packet id
// the device has freed: to it, a new message. Resent after the start
// record, the flow is PUBREL'd.
func TestMQTT_4_3_3_9_ResendWaitsForTheStartRecord(t *testing.T) {
	l := newSharedLog()
	a, b := startMember(t, l, 1), startMember(t, l, 2)
	props := &packets.Properties{SessionExpiryInterval: 600, SessionExpiryIntervalFlag: true}
	dev := deliverQoS2(t, l, b, props)
	p := dev.expect(packets.Publish) // held in flight on b: the device's answer is lost
	pid := p.PacketID
	dev.c.Close()
	testutil.WaitFor(t, 5*time.Second, "b's session offline", b.offline("dev"))
	a.caughtUp(t)
	b.caughtUp(t)
	b.holdHere() // b applies nothing logged from here on until the device is back

	dev = dialRaw(t, a.srv.Addr(), 5)
	if ack := dev.connect("dev", false, props); !ack.SessionPresent {
		t.Fatal("session not present on a")
	}
	p = dev.expect(packets.Publish)
	if string(p.Payload) != "1" || p.PacketID != pid || !p.FixedHeader.Dup {
		t.Fatalf("on a: PUBLISH %q id %d dup %v, want the held message under %d with DUP", p.Payload, p.PacketID, p.FixedHeader.Dup, pid)
	}
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrec}, PacketID: pid})
	dev.expect(packets.Pubrel) // logged, then sent
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubcomp}, PacketID: pid})
	a.kill(t) // the device has completed message 1 and freed its packet id
	dev.c.Close()

	dev = dialRaw(t, b.srv.Addr(), 5)
	if ack := dev.connect("dev", false, props); !ack.SessionPresent {
		t.Fatal("session not present back on b")
	}
	b.holdAt(0)
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
	for {
		pk := dev.next()
		switch pk.FixedHeader.Type {
		case packets.Publish:
			t.Fatalf("message %q resent (id %d, dup %v) though the device completed it on a", pk.Payload, pk.PacketID, pk.FixedHeader.Dup)
		case packets.Pubrel:
			dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubcomp}, PacketID: pk.PacketID})
			continue
		case packets.Pingresp:
		default:
			t.Fatalf("unexpected packet type %d", pk.FixedHeader.Type)
		}
		break
	}
	// Everything b owed is out once its start record is applied: a
	// later message comes, and message 1 not before it.
	l.add(&Message{Origin: 9, Seq: 2, ClientID: "sensor", Topic: "m/x", QoS: 2, Payload: []byte("2")})
	for {
		pk := dev.next()
		if pk.FixedHeader.Type == packets.Pubrel {
			dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubcomp}, PacketID: pk.PacketID})
			continue
		}
		if pk.FixedHeader.Type != packets.Publish || string(pk.Payload) != "2" {
			t.Fatalf("packet type %d %q, want message 2", pk.FixedHeader.Type, pk.Payload)
		}
		break
	}
}

// A member that stops (kill -9, power cut) after the device PUBREC'd a
// QoS 2 delivery, before its release record is logged, finds the flow
// PUBREC'd in its session store when it comes back: its PUBREL waits for
// the release record, logged then, or the device completes a flow that
// another member, taking the session over, would send again as new.
func TestMQTT_4_3_3_9_PubrelAfterARestartWaitsForTheReleaseRecord(t *testing.T) {
	l := newSharedLog()
	a := startMember(t, l, 1)
	startMember(t, l, 2)
	props := &packets.Properties{SessionExpiryInterval: 600, SessionExpiryIntervalFlag: true}
	dev := deliverQoS2(t, l, a, props)
	p := dev.expect(packets.Publish)
	a.holdReleases(t) // never logged: a dies first
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrec}, PacketID: p.PacketID})
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
	dev.expect(packets.Pingresp) // the PUBREC is taken
	a.kill(t)
	dev.c.Close()

	l.mu.Lock()
	applied := a.applied
	l.mu.Unlock()
	again := startMemberWith(t, &member{l: l, id: 1, store: a.store, applied: applied, seq: 1000}, nil)
	dev = dialRaw(t, again.srv.Addr(), 5)
	if ack := dev.connect("dev", false, props); ack.ReasonCode != 0 || !ack.SessionPresent {
		t.Fatalf("after the restart: CONNACK %#x session present %v", ack.ReasonCode, ack.SessionPresent)
	}
	rel := dev.expect(packets.Pubrel)
	if rel.PacketID != p.PacketID {
		t.Fatalf("PUBREL %d, want %d", rel.PacketID, p.PacketID)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	var idx uint64
	for i, m := range l.recs {
		if m.Topic == "m/x" {
			idx = uint64(i + 1)
		}
	}
	for _, m := range l.recs {
		var op sessionOp
		if isSessionOp(m, "rel") && json.Unmarshal(m.Payload, &op) == nil && slices.Contains(op.Rel, idx) {
			return
		}
	}
	t.Fatal("PUBREL sent after the restart with no release record in the log")
}

// The start record a resumed session waits for is its current
// connection's: a device that was on b, went to a (where it completed a
// QoS 2 flow) and came back to b (a dies) must not be served on b once
// the start record of its first connection there is applied, which the
// log holds before a's release of the flow: the replay would send the
// completed message again, as new to the device.
func TestMQTT_4_3_3_9_AnEarlierConnectionsStartIsNotTheBarrier(t *testing.T) {
	l := newSharedLog()
	a, b := startMember(t, l, 1), startMember(t, l, 2)
	props := &packets.Properties{SessionExpiryInterval: 600, SessionExpiryIntervalFlag: true}
	startOf := func(origin uint64, after uint64) uint64 {
		l.mu.Lock()
		defer l.mu.Unlock()
		for i, m := range l.recs[after:] {
			if m.Origin == origin && isSessionOp(m, "start") {
				return after + uint64(i) + 1
			}
		}
		return 0
	}
	dev := deliverQoS2(t, l, a, props)
	pid := dev.expect(packets.Publish).PacketID // held; the device's answer is lost
	b.caughtUp(t)
	last := b.holdHere() // b applies nothing logged from here on for now
	dev.c.Close()
	testutil.WaitFor(t, 5*time.Second, "a's session offline", a.offline("dev"))

	dev = dialRaw(t, b.srv.Addr(), 5) // the first connection to b
	if ack := dev.connect("dev", false, props); !ack.SessionPresent {
		t.Fatal("session not present on b")
	}
	var first uint64
	testutil.WaitFor(t, 5*time.Second, "b's first start record in the log", func() bool { first = startOf(2, last); return first > 0 })
	dev.c.Close()
	testutil.WaitFor(t, 5*time.Second, "b's session offline", b.offline("dev"))

	dev = dialRaw(t, a.srv.Addr(), 5) // back to a, which completes the flow
	if ack := dev.connect("dev", false, props); !ack.SessionPresent {
		t.Fatal("session not present back on a")
	}
	if p := dev.expect(packets.Publish); string(p.Payload) != "1" || p.PacketID != pid || !p.FixedHeader.Dup {
		t.Fatalf("on a again: PUBLISH %q id %d dup %v, want the held message", p.Payload, p.PacketID, p.FixedHeader.Dup)
	}
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrec}, PacketID: pid})
	dev.expect(packets.Pubrel)
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubcomp}, PacketID: pid})
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
	dev.expect(packets.Pingresp)
	a.kill(t)
	dev.c.Close()

	dev = dialRaw(t, b.srv.Addr(), 5) // the second connection to b
	if ack := dev.connect("dev", false, props); !ack.SessionPresent {
		t.Fatal("session not present on b the second time")
	}
	testutil.WaitFor(t, 5*time.Second, "b's second start record in the log", func() bool { return startOf(2, first) > 0 })
	b.holdAt(first) // b applies up to its first connection's start record
	b.caughtUpTo(t, first)
	b.srv.mu.Lock()
	se := b.srv.sessions["dev"]
	b.srv.mu.Unlock()
	if !se.awaitingStart() {
		t.Fatal("the start record of b's earlier connection taken for this one's: the session replays before a's release")
	}
	b.holdAt(0)
	l.add(&Message{Origin: 9, Seq: 2, ClientID: "sensor", Topic: "m/x", QoS: 2, Payload: []byte("2")})
	for {
		pk := dev.next()
		if pk.FixedHeader.Type == packets.Pubrel {
			dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubcomp}, PacketID: pk.PacketID})
			continue
		}
		if pk.FixedHeader.Type != packets.Publish || string(pk.Payload) != "2" {
			t.Fatalf("packet type %d %q (id %d), want message 2 and nothing of message 1", pk.FixedHeader.Type, pk.Payload, pk.PacketID)
		}
		break
	}
}

// [MQTT-4.3.3-9] when the release record of a PUBREC'd delivery cannot be
// logged (the log full, no master, a timeout): no PUBREL goes, for the
// device would complete a flow that a member taking the session over,
// without the record, sends again under the same packet id, as new. The
// connection ends instead (0x97 for a full log, 0x89 else; 3.1.1: closed),
// the flow stays PUBREC'd, and the device's next connection has it
// finished: back on the same member the release is logged before its
// PUBREL; on another member the message comes again under the packet id
// the device still holds, with DUP.
func TestMQTT_4_3_3_9_NoPubrelWhenTheReleaseIsNotLogged(t *testing.T) {
	full := fmt.Errorf("%w: the log is over its budget", ErrQuota)
	for _, tc := range []struct {
		name  string
		v     byte
		err   error
		code  byte // of the DISCONNECT (MQTT 5)
		moves bool // the device goes to the other member next
	}{
		{"v5-full-back", 5, full, 0x97, false},
		{"v5-unavailable-moves", 5, errors.New("no master"), 0x89, true},
		{"v4-back", 4, errors.New("ack timeout"), 0, false},
		{"v4-moves", 4, full, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) { releaseNotLogged(t, tc.v, tc.err, tc.code, tc.moves) })
	}
}

func releaseNotLogged(t *testing.T, v byte, fail error, code byte, moves bool) {
	l := newSharedLog()
	a, b := startMember(t, l, 1), startMember(t, l, 2)
	props := sessionProps(v)
	dev := dialRaw(t, a.srv.Addr(), v)
	dev.connect("dev", false, props)
	dev.subscribe(1, packets.Subscription{Filter: "m/#", Qos: 2})
	l.add(&Message{Origin: 9, Seq: 1, ClientID: "sensor", Topic: "m/x", QoS: 2, Payload: []byte("1")})
	pid := dev.expect(packets.Publish).PacketID
	a.setGate(func(msg *Message) (<-chan struct{}, error) {
		if isSessionOp(msg, "rel") {
			return nil, fail
		}
		return nil, nil
	})
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrec}, PacketID: pid})
	for {
		pk, err := dev.read(5 * time.Second)
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				t.Fatal("the connection did not end when the release record failed")
			}
			if v == 5 {
				t.Fatal("closed without a DISCONNECT")
			}
			break
		}
		if pk.FixedHeader.Type == packets.Pubrel {
			t.Fatalf("PUBREL %d though the release record was refused (%v)", pk.PacketID, fail)
		}
		if pk.FixedHeader.Type == packets.Disconnect {
			if pk.ReasonCode != code {
				t.Fatalf("DISCONNECT %#x, want %#x", pk.ReasonCode, code)
			}
			break
		}
	}
	dev.c.Close()
	a.setGate(nil)
	if released(l, "m/x") {
		t.Fatal("a release record in the log: the gate let it through")
	}

	to := a
	if moves {
		b.caughtUp(t)
		a.kill(t)
		to = b
	}
	dev = dialRaw(t, to.srv.Addr(), v)
	if ack := dev.connect("dev", false, props); ack.ReasonCode != 0 || !ack.SessionPresent {
		t.Fatalf("CONNACK %#x session present %v", ack.ReasonCode, ack.SessionPresent)
	}
	if moves {
		// The device still holds pid: the message comes under it, with
		// DUP, and the flow goes on there.
		p := dev.expect(packets.Publish)
		if string(p.Payload) != "1" || p.PacketID != pid || !p.FixedHeader.Dup {
			t.Fatalf("on b: PUBLISH %q id %d dup %v; want the held message under id %d with DUP", p.Payload, p.PacketID, p.FixedHeader.Dup, pid)
		}
		dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrec}, PacketID: pid})
	}
	if rel := dev.expect(packets.Pubrel); rel.PacketID != pid {
		t.Fatalf("PUBREL %d, want %d", rel.PacketID, pid)
	}
	if !released(l, "m/x") {
		t.Fatal("PUBREL sent with no release record in the log")
	}
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubcomp}, PacketID: pid})
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
	dev.expect(packets.Pingresp)
}

// released reports whether l holds a release record of the delivery of
// the record on topic.
func released(l *sharedLog, topic string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	var idx uint64
	for i, m := range l.recs {
		if m.Topic == topic {
			idx = uint64(i + 1)
		}
	}
	for _, m := range l.recs {
		var op sessionOp
		if isSessionOp(m, "rel") && json.Unmarshal(m.Payload, &op) == nil && slices.Contains(op.Rel, idx) {
			return true
		}
	}
	return false
}

// A release record that fails after its device has reconnected (the
// resend of the new connection found it in flight, and did not log it
// again) is logged again for the new connection, whose PUBREL waits for
// it: no PUBREL goes on the failure.
func TestMQTT_4_3_3_9_ReleaseFailingAfterAReconnectIsLoggedAgain(t *testing.T) {
	l := newSharedLog()
	a := startMember(t, l, 1)
	startMember(t, l, 2)
	props := &packets.Properties{SessionExpiryInterval: 600, SessionExpiryIntervalFlag: true}
	dev := deliverQoS2(t, l, a, props)
	pid := dev.expect(packets.Publish).PacketID
	let := make(chan struct{})
	a.setGate(func(msg *Message) (<-chan struct{}, error) {
		if isSessionOp(msg, "rel") {
			return let, errors.New("ack timeout")
		}
		return nil, nil
	})
	ping := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}}
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrec}, PacketID: pid})
	dev.write(ping)
	dev.expect(packets.Pingresp)
	dev.c.Close()
	testutil.WaitFor(t, 5*time.Second, "the session offline", a.offline("dev"))

	dev = dialRaw(t, a.srv.Addr(), 5)
	if ack := dev.connect("dev", false, props); ack.ReasonCode != 0 || !ack.SessionPresent {
		t.Fatalf("CONNACK %#x session present %v", ack.ReasonCode, ack.SessionPresent)
	}
	dev.write(ping)
	dev.expect(packets.Pingresp) // no PUBREL in the resend: the record is in flight
	a.setGate(nil)
	close(let) // the first connection's record fails now
	if rel := dev.expect(packets.Pubrel); rel.PacketID != pid {
		t.Fatalf("PUBREL %d, want %d", rel.PacketID, pid)
	}
	if !released(l, "m/x") {
		t.Fatal("PUBREL sent on the failure of its release record, with none in the log")
	}
}

// A device that started its session over on another member (a clean
// start), or whose session ended there, and then resumes on a member that
// applies those records only after it came (a follower learns the commit
// index from the next master) resumes the session the log holds: log
// order puts them before its start record here, so the subscriptions and
// the flows in flight from before are gone, as on every other member. The
// member must neither resend a message of the old session nor deliver
// what only its old subscriptions match; what the device subscribed to
// since (there, or here while it waited) is delivered.
func TestSessionGoneElsewhereBeforeTheDeviceCameBack(t *testing.T) {
	for _, clean := range []bool{true, false} {
		name := "ended"
		if clean {
			name = "clean-start"
		}
		t.Run(name, func(t *testing.T) { goneElsewhere(t, clean) })
	}
}

// goneElsewhere: the device holds old/1 in flight on b, goes to a, where
// its session starts over (clean) or ends (a connection with expiry 0),
// and comes back to b, which applies a's records after it came.
func goneElsewhere(t *testing.T, clean bool) {
	l := newSharedLog()
	a, b := startMember(t, l, 1), startMember(t, l, 2)
	props := &packets.Properties{SessionExpiryInterval: 600, SessionExpiryIntervalFlag: true}
	dev := dialRaw(t, b.srv.Addr(), 5)
	dev.connect("dev", false, props)
	dev.subscribe(1, packets.Subscription{Filter: "old/#", Qos: 1})
	l.add(&Message{Origin: 9, Seq: 1, ClientID: "sensor", Topic: "old/x", QoS: 1, Payload: []byte("old/1")})
	dev.expect(packets.Publish) // held in flight on b: the device's PUBACK is lost
	dev.c.Close()
	testutil.WaitFor(t, 5*time.Second, "b's session offline", b.offline("dev"))
	a.caughtUp(t)
	b.caughtUp(t)
	last := b.holdHere() // b applies nothing logged from here on until the device is back

	dev = dialRaw(t, a.srv.Addr(), 5)
	if clean {
		if ack := dev.connect("dev", true, props); ack.SessionPresent {
			t.Fatal("session present on a clean start")
		}
		dev.subscribe(2, packets.Subscription{Filter: "new/#", Qos: 1})
	} else {
		// Resumed with expiry 0: the session ends with this connection.
		if ack := dev.connect("dev", false, nil); !ack.SessionPresent {
			t.Fatal("session not present on a")
		}
		p := dev.expect(packets.Publish) // a's replay: its start record is applied there
		dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: p.PacketID})
		dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
		testutil.WaitFor(t, 5*time.Second, "a's end of the session in the log", func() bool {
			l.mu.Lock()
			defer l.mu.Unlock()
			for _, m := range l.recs[last:] {
				if m.Origin == 1 && isSessionOp(m, "end") {
					return true
				}
			}
			return false
		})
	}
	a.kill(t)
	dev.c.Close()

	watch := dialRaw(t, b.srv.Addr(), 5)
	watch.connect("watch", true, nil)
	watch.subscribe(1, packets.Subscription{Filter: "will/#", Qos: 0})
	dev = dialRaw(t, b.srv.Addr(), 5)
	// With a will: should b send the device away, the will is not due.
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect}, Properties: *props,
		Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), ClientIdentifier: "dev", Keepalive: 30,
			WillFlag: true, WillTopic: "will/dev", WillPayload: []byte("gone")}})
	if ack := dev.expect(packets.Connack); ack.ReasonCode != 0 || !ack.SessionPresent {
		t.Fatalf("back on b: CONNACK %#x session present %v; want 0, true (b has not applied a's records)", ack.ReasonCode, ack.SessionPresent)
	}
	if !clean {
		dev.subscribe(3, packets.Subscription{Filter: "new/#", Qos: 1}) // while b waits for its start record
	}
	l.add(&Message{Origin: 9, Seq: 2, ClientID: "sensor", Topic: "old/x", QoS: 1, Payload: []byte("old/2")})
	l.add(&Message{Origin: 9, Seq: 3, ClientID: "sensor", Topic: "new/x", QoS: 1, Payload: []byte("new/2")})
	b.holdAt(0)
	if !clean {
		// The session was gone before the device came: the CONNACK's
		// "session present" was wrong, and only a new one sets it right.
		// The connection ends; the device comes back to no session.
		for {
			pk := dev.next()
			if pk.FixedHeader.Type == packets.Publish {
				t.Fatalf("PUBLISH %q on b from a session the log says had ended", pk.Payload)
			}
			if pk.FixedHeader.Type == packets.Disconnect {
				if pk.ReasonCode != 0x80 {
					t.Fatalf("DISCONNECT %#x, want 0x80", pk.ReasonCode)
				}
				break
			}
		}
		dev.c.Close()
		dev = dialRaw(t, b.srv.Addr(), 5)
		if ack := dev.connect("dev", false, props); ack.ReasonCode != 0 || ack.SessionPresent {
			t.Fatalf("back on b: CONNACK %#x session present %v; want 0, false", ack.ReasonCode, ack.SessionPresent)
		}
		dev.subscribe(4, packets.Subscription{Filter: "new/#", Qos: 1})
		l.add(&Message{Origin: 9, Seq: 4, ClientID: "sensor", Topic: "old/x", QoS: 1, Payload: []byte("old/3")})
		l.add(&Message{Origin: 9, Seq: 5, ClientID: "sensor", Topic: "new/x", QoS: 1, Payload: []byte("new/3")})
		p := dev.next()
		if p.FixedHeader.Type != packets.Publish || string(p.Payload) != "new/3" {
			t.Fatalf("packet type %d %q on b; want new/3 alone", p.FixedHeader.Type, p.Payload)
		}
		l.add(&Message{Origin: 9, Seq: 6, ClientID: "sensor", Topic: "will/marker", Payload: []byte("marker")})
		if w := watch.expect(packets.Publish); string(w.Payload) != "marker" {
			t.Fatalf("%q on %s before the marker: the device's will went when b sent it away", w.Payload, w.TopicName)
		}
		b.srv.mu.Lock()
		defer b.srv.mu.Unlock()
		if se := b.srv.sessions["dev"]; se == nil || len(se.subs) != 1 {
			t.Fatal("b's new session does not hold new/# alone")
		}
		return
	}
	p := dev.next()
	if p.FixedHeader.Type != packets.Publish || string(p.Payload) != "new/2" {
		t.Fatalf("packet type %d %q (dup %v) on b; want new/2, and nothing of the session that was gone before b's start record",
			p.FixedHeader.Type, p.Payload, p.FixedHeader.Dup)
	}
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: p.PacketID})
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
	if pk := dev.next(); pk.FixedHeader.Type != packets.Pingresp {
		t.Fatalf("packet type %d %q after new/2, want PINGRESP", pk.FixedHeader.Type, pk.Payload)
	}
	b.srv.mu.Lock()
	se := b.srv.sessions["dev"]
	b.srv.mu.Unlock()
	se.mu.Lock()
	defer se.mu.Unlock()
	if _, ok := se.subs["old/#"]; ok || len(se.subs) != 1 {
		t.Fatalf("b's session subscribes to %d filters (old/# %v); want new/# alone", len(se.subs), ok)
	}
}

// A QoS 2 publish the device sent to a member it then left, logged there
// with its PUBREC lost, and resent (DUP, same packet id) to a member that
// has not applied that record yet: until the PUBREL the receiver answers a
// publish with the same packet id with PUBREC and does not deliver it
// onwards again [MQTT-4.3.3-9]. The member the device came to decides the
// resend only once it has applied its start record, after which it holds
// every record the device had logged before it came.
func TestMQTT_4_3_3_9_InboundResendBeforeTheOriginalIsApplied(t *testing.T) {
	for _, v := range []byte{4, 5} {
		t.Run(fmt.Sprintf("v%d", v), func(t *testing.T) {
			l := newSharedLog()
			a, b := startMember(t, l, 1), startMember(t, l, 2)
			props := sessionProps(v)
			sub := dialRaw(t, b.srv.Addr(), v)
			sub.connect("sub", true, nil)
			sub.subscribe(1, packets.Subscription{Filter: "in/#", Qos: 2})
			dev := dialRaw(t, a.srv.Addr(), v)
			dev.connect("dev", false, props)
			b.caughtUp(t) // b holds the session, offline
			b.holdHere()  // b lags: it applies nothing logged from here on for now

			pub := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 2}, TopicName: "in/x", PacketID: 7, Payload: []byte("once")}
			dev.write(pub)
			dev.expect(packets.Pubrec) // logged on a; say the PUBREC is lost on its way
			a.kill(t)
			dev.c.Close()

			dev = dialRaw(t, b.srv.Addr(), v)
			if ack := dev.connect("dev", false, props); !ack.SessionPresent {
				t.Fatal("session not present on b")
			}
			pub.FixedHeader.Dup = true
			dev.write(pub)
			// Answered now, it is decided before b knows the original:
			// the count below tells.
			rec, err := dev.read(300 * time.Millisecond)
			b.holdAt(0)
			if err != nil {
				rec = dev.next()
			}
			if rec.FixedHeader.Type != packets.Pubrec || rec.PacketID != 7 || rec.ReasonCode >= 0x80 {
				t.Fatalf("packet type %d %+v for the resend, want PUBREC", rec.FixedHeader.Type, rec)
			}
			dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: 7})
			if comp := dev.expect(packets.Pubcomp); comp.PacketID != 7 || comp.ReasonCode != 0 {
				t.Fatalf("PUBCOMP %#x for the PUBREL, want 0", comp.ReasonCode)
			}
			b.caughtUp(t)
			if n := countLogged(b, l, "in/x", "once"); n != 1 {
				t.Fatalf("the message is in the log %d times, want once", n)
			}
			// The subscriber gets it once: a marker published after it
			// comes next.
			dev.publish("in/y", 1, 8, "marker")
			dev.expect(packets.Puback)
			if got := untilMarker(sub); len(got) != 2 || got[0] != "once" {
				t.Fatalf("subscriber got %q, want the message once, then the marker", got)
			}
		})
	}
}

// untilMarker reads sub's deliveries, acknowledging them, up to the
// message "marker", and returns their payloads.
func untilMarker(sub *raw) []string {
	sub.t.Helper()
	var got []string
	for len(got) == 0 || got[len(got)-1] != "marker" {
		pk := sub.next()
		switch pk.FixedHeader.Type {
		case packets.Publish:
			got = append(got, string(pk.Payload))
			if pk.FixedHeader.Qos == 2 {
				sub.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrec}, PacketID: pk.PacketID})
			} else if pk.FixedHeader.Qos == 1 {
				sub.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
			}
		case packets.Pubrel:
			sub.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubcomp}, PacketID: pk.PacketID})
		}
	}
	return got
}

// A QoS 2 publish whose original commits only after the device's start
// record on the member it moved to: its proposal was still on its way
// from the member the device left (a slow forward), and the device,
// without a PUBREC, resent it there. That member cannot know the original
// yet and logs the resend; the log holds the message twice. Every member
// delivers it once [MQTT-4.3.3-9], whichever copy comes first in the log,
// to live subscribers and to a persistent one that replays it from the
// log. The resend is named by a "resend" record first (feature level 4).
func TestMQTT_4_3_3_9_ResendWhoseOriginalCommitsLateIsDeliveredOnce(t *testing.T) {
	for _, first := range []string{"resend", "original"} {
		for _, v := range []byte{4, 5} {
			t.Run(fmt.Sprintf("%s-first-v%d", first, v), func(t *testing.T) { lateOriginal(t, v, first == "original", false) })
		}
	}
	// Below level 4 a member of an earlier build may deliver both: no
	// member names the resend then.
	t.Run("level3", func(t *testing.T) { lateOriginal(t, 5, false, true) })
}

func lateOriginal(t *testing.T, v byte, originalFirst, level3 bool) {
	l := newSharedLog()
	a := startMemberWith(t, &member{l: l, id: 1, store: newMemStore(), level3: level3}, nil)
	b := startMemberWith(t, &member{l: l, id: 2, store: newMemStore(), level3: level3}, nil)
	props := sessionProps(v)
	// A persistent subscriber, offline while it all happens: it replays.
	psub := dialRaw(t, b.srv.Addr(), 5)
	psub.connect("psub", false, sessionProps(5))
	psub.subscribe(1, packets.Subscription{Filter: "in/#", Qos: 2})
	psub.c.Close()
	var subs []*raw
	for _, m := range []*member{a, b} {
		sub := dialRaw(t, m.srv.Addr(), v)
		sub.connect(fmt.Sprintf("sub%d", m.id), true, nil)
		sub.subscribe(1, packets.Subscription{Filter: "in/#", Qos: 2})
		subs = append(subs, sub)
	}
	dev := dialRaw(t, a.srv.Addr(), v)
	dev.connect("dev", false, props)
	testutil.WaitFor(t, 5*time.Second, "psub offline on b", b.offline("psub"))
	b.caughtUp(t)

	// a takes the publish; its proposal is held on its way.
	taken, slow := make(chan struct{}), make(chan struct{})
	held := false // the gate runs under the log's lock
	a.setGate(func(msg *Message) (<-chan struct{}, error) {
		if msg.Kind == KindMessage && !held {
			held = true
			close(taken)
			return slow, nil // proposed again once slow is closed
		}
		return nil, nil
	})
	pub := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 2}, TopicName: "in/x", PacketID: 7, Payload: []byte("once")}
	dev.write(pub)
	<-taken
	dev.c.Close() // lost with its PUBREC never sent; a lives on

	dev = dialRaw(t, b.srv.Addr(), v)
	if ack := dev.connect("dev", false, props); !ack.SessionPresent {
		t.Fatal("session not present on b")
	}
	start := waitLogged(t, l, func(m *Message) bool { return m.Origin == 2 && isSessionOp(m, "start") && m.ClientID == "dev" })
	if originalFirst {
		// The original commits after b's start record and before the
		// resend; b, behind, has not applied it when the resend comes.
		b.caughtUpTo(t, start)
		b.holdAt(start)
		close(slow)
		waitLogged(t, l, func(m *Message) bool { return m.Origin == 1 && m.Kind == KindMessage && m.Topic == "in/x" })
	}
	pub.FixedHeader.Dup = true
	dev.write(pub)
	if rec := dev.expect(packets.Pubrec); rec.PacketID != 7 || rec.ReasonCode >= 0x80 {
		t.Fatalf("PUBREC %+v for the resend", rec)
	}
	if originalFirst {
		b.holdAt(0)
	} else {
		close(slow) // the original commits after the resend
	}
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: 7})
	dev.expect(packets.Pubcomp)
	waitLogged(t, l, func(m *Message) bool { return m.Origin == 1 && m.Kind == KindMessage && m.Topic == "in/x" })
	a.caughtUp(t)
	b.caughtUp(t)
	if n := countLogged(b, l, "in/x", "once"); n != 2 {
		t.Fatalf("the message is in the log %d times; the case needs it twice (the original committed late)", n)
	}
	named := waitLoggedOrNot(l, func(m *Message) bool { return isSessionOp(m, "resend") })
	if level3 {
		if named {
			t.Fatal("a resend record below feature level 4: a member of an earlier build would deliver both copies anyway")
		}
		return
	}
	if !named {
		t.Fatal("no resend record before the resend")
	}
	dev.publish("in/y", 1, 8, "marker")
	dev.expect(packets.Puback)
	for i, sub := range subs {
		if got := untilMarker(sub); len(got) != 2 || got[0] != "once" {
			t.Fatalf("the subscriber on member %d got %q, want the message once, then the marker", i+1, got)
		}
	}
	// b restarts: what it decided is kept with its session state.
	b.caughtUp(t)
	b.halt(t)
	b = startMemberWith(t, &member{l: l, id: 2, store: b.store, applied: b.applied, seq: 1000}, nil)
	psub = dialRaw(t, b.srv.Addr(), 5)
	psub.connect("psub", false, sessionProps(5))
	if got := untilMarker(psub); len(got) != 2 || got[0] != "once" {
		t.Fatalf("the persistent subscriber's replay on b, restarted, got %q, want the message once, then the marker", got)
	}
	// What tandem inspect marks: one copy, a duplicate.
	_, _, dups, err := HoldState(b.store)
	if err != nil || len(dups) != 1 {
		t.Fatalf("duplicates in b's store: %v (%v), want one", dups, err)
	}
	for idx := range dups {
		l.mu.Lock()
		m := l.recs[idx-1]
		l.mu.Unlock()
		if m.Topic != "in/x" || string(m.Payload) != "once" {
			t.Fatalf("index %d marked a duplicate holds %s %q", idx, m.Topic, m.Payload)
		}
	}
}

// The original of a QoS 2 resend, committed late and taken under a sync
// rule, may still be aborted when the resend is applied: its publisher,
// the device's old connection, is gone, and its ack rule can time out.
// The resend was acked to the device, so the message must be delivered
// once whatever the settlement says: the original gives way while it is
// held, and the resend stands if it was aborted; confirmed first, the
// original is the copy delivered. Without that, an aborted original and
// a resend taken for its copy delivered the message to nobody.
func TestMQTT_4_3_3_9_ResendAfterASyncOriginalIsDeliveredOnceWhateverItsSettlement(t *testing.T) {
	for _, tc := range []struct {
		name   string
		before string // the original's settlement before the resend is applied
		after  string // and after
	}{
		{"held-then-aborted", "", "abort"},
		{"held-then-confirmed", "", "confirm"},
		{"aborted-first", "abort", ""},
		{"confirmed-first", "confirm", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, l := testServer(t, nil, nil)
			sub := resendWindowOn(t, s, l)
			l.addRaw(&Message{Origin: leftMember, Seq: 40, ClientID: "dev", Topic: "in/x", QoS: 2, PacketID: 7, Sync: true, Payload: []byte("once")})
			original := l.lastIndex()
			settle := func(how string) {
				switch how {
				case "abort":
					l.settle(original, original)
				case "confirm":
					l.settle(original)
				}
			}
			settle(tc.before)
			l.addRaw(&Message{Origin: cameMember, Seq: 11, ClientID: "dev", Topic: "in/x", QoS: 2, PacketID: 7, Payload: []byte("once")})
			settle(tc.after)
			l.addRaw(&Message{Origin: cameMember, Seq: 13, ClientID: "dev", Topic: "in/y", QoS: 1, PacketID: 8, Payload: []byte("marker")})
			if got := untilMarker(sub); len(got) != 2 || got[0] != "once" {
				t.Fatalf("the subscriber got %q, want the message once, then the marker", got)
			}
			// An aborted original is no copy: the resend is the message.
			want := 1
			if tc.before == "abort" {
				want = 0
			}
			_, _, dups, err := HoldState(l.store)
			if err != nil || len(dups) != want {
				t.Fatalf("duplicates %v (%v), want %d", dups, err, want)
			}
		})
	}
}

// A QoS 2 resend whose own proposal fails (its sync ack rule timed out,
// or the log refused it) is told "refused" unless the message was
// delivered anyway: when its late original (from the device's connection
// on the member it left, committed after its start record here) was
// applied first and is confirmed, or async, the two are one message by
// the window rule (qos2.go), and a device told "refused" would see
// delivered a message it was refused. It gets the PUBREC (MQTT 5: 0x00;
// 3.1.1: no disconnect), as do the resends of it waiting for that outcome,
// and the subscriber gets the message once. An original still held
// (unsettled: it may yet be aborted) has the answer wait for its
// settlement: confirmed, the PUBREC; aborted, the refusal, and nobody
// gets the message. No original leaves the refusal.
func TestMQTT_4_3_3_9_FailedResendOfADeliveredLateOriginalIsAcked(t *testing.T) {
	for _, original := range []string{"confirmed", "async", "held-then-confirmed", "held-then-aborted", "none"} {
		for _, v := range []byte{4, 5} {
			t.Run(fmt.Sprintf("%s-v%d", original, v), func(t *testing.T) { failedResend(t, v, original) })
		}
	}
}

// errRuleTimedOut is a sync proposal's failure as replication gives it
// (its ErrAckTimeout).
var errRuleTimedOut = errors.New("replication: ack rule not met within sync_timeout")

func failedResend(t *testing.T, v byte, original string) {
	l := newSharedLog()
	a := startMemberWith(t, &member{l: l, id: 1, store: newMemStore()}, func(c *Config) {
		c.Topics = []TopicPolicy{{Filter: "in/x", Ack: Sync}}
	})
	sub := dialRaw(t, a.srv.Addr(), 5)
	sub.connect("sub", true, nil)
	sub.subscribe(1, packets.Subscription{Filter: "in/#", Qos: 2})
	dev := dialRaw(t, a.srv.Addr(), v)
	dev.connect("dev", false, sessionProps(v))
	waitLogged(t, l, func(m *Message) bool { return m.Origin == 1 && isSessionOp(m, "start") && m.ClientID == "dev" })
	held := strings.HasPrefix(original, "held")
	var late uint64
	if original != "none" {
		l.add(&Message{Origin: leftMember, Seq: 40, ClientID: "dev", Topic: "in/x", QoS: 2, PacketID: 7, Sync: original != "async", Payload: []byte("once")})
		late = waitLogged(t, l, func(m *Message) bool { return m.Origin == leftMember })
		if original == "confirmed" {
			l.settle(late)
		}
	}
	a.caughtUp(t) // the original is applied before the resend fails

	fail := make(chan struct{})
	a.setGate(func(msg *Message) (<-chan struct{}, error) {
		if msg.Kind == KindMessage && msg.Topic == "in/x" {
			return fail, errRuleTimedOut
		}
		return nil, nil
	})
	pub := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 2, Dup: true}, TopicName: "in/x", PacketID: 7, Payload: []byte("once")}
	dev.write(pub)
	dev.write(pub) // again before the outcome: it waits for it (qos2Resend)
	testutil.WaitFor(t, 5*time.Second, "the second resend waiting for the first's outcome", func() bool {
		a.srv.mu.Lock()
		se := a.srv.sessions["dev"]
		a.srv.mu.Unlock()
		se.mu.Lock()
		defer se.mu.Unlock()
		in := se.inbound[7]
		return in != nil && len(in.waiting) == 1
	})
	close(fail)

	if held {
		// Nothing is told before the settlement: a check for absence.
		pk, err := dev.read(200 * time.Millisecond)
		var ne net.Error
		if err == nil {
			t.Fatalf("%v before the original's settlement, want nothing yet", pk.FixedHeader)
		} else if !errors.As(err, &ne) || !ne.Timeout() {
			t.Fatalf("reading before the original's settlement: %v, want a timeout", err)
		}
		// Settled after the failure, not before it (the resend would
		// find the original free then).
		testutil.WaitFor(t, 5*time.Second, "the resend's outcome waiting for its original's settlement", func() bool {
			a.srv.holds.mu.Lock()
			defer a.srv.holds.mu.Unlock()
			return len(a.srv.holds.pending[late]) == 1
		})
		if original == "held-then-confirmed" {
			l.settle(late)
		} else {
			l.settle(late, late)
		}
		a.caughtUp(t)
		a.srv.holds.mu.Lock()
		left := len(a.srv.holds.pending)
		a.srv.holds.mu.Unlock()
		if left != 0 {
			t.Fatalf("%d outcomes still wait after the settlement", left)
		}
	}

	if original == "held-then-aborted" || original == "none" {
		// Refused: nothing here says the message was delivered.
		expectRefused(t, dev, v)
		mark := dialRaw(t, a.srv.Addr(), 5)
		mark.connect("mark", true, nil)
		mark.publish("in/y", 1, 1, "marker")
		mark.expect(packets.Puback)
		if got := untilMarker(sub); len(got) != 1 {
			t.Fatalf("the subscriber got %q, want the marker alone: the message was refused", got)
		}
		return
	}
	for range 2 {
		if rec := dev.expect(packets.Pubrec); rec.PacketID != 7 || rec.ReasonCode != 0 {
			t.Fatalf("PUBREC %d %#x for the resend, want 0x00: its late original was delivered", rec.PacketID, rec.ReasonCode)
		}
	}
	dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: 7})
	if comp := dev.expect(packets.Pubcomp); comp.PacketID != 7 || comp.ReasonCode != 0 {
		t.Fatalf("PUBCOMP %d %#x, want 7, 0", comp.PacketID, comp.ReasonCode)
	}
	dev.publish("in/y", 1, 8, "marker")
	dev.expect(packets.Puback)
	if got := untilMarker(sub); len(got) != 2 || got[0] != "once" {
		t.Fatalf("the subscriber got %q, want the message once, then the marker", got)
	}
	if n := countLogged(a, l, "in/x", "once"); n != 1 {
		t.Fatalf("the message is in the log %d times, want once: the original", n)
	}
}

// expectRefused checks that both resends of packet id 7 were refused: MQTT 5
// PUBREC with a failure code, 3.1.1 the connection's end.
func expectRefused(t *testing.T, dev *raw, v byte) {
	t.Helper()
	if v == 5 {
		for range 2 {
			if rec := dev.expect(packets.Pubrec); rec.PacketID != 7 || rec.ReasonCode < 0x80 {
				t.Fatalf("PUBREC %d %#x for the resend, want a refusal", rec.PacketID, rec.ReasonCode)
			}
		}
		return
	}
	for {
		pk, err := dev.read(5 * time.Second)
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				t.Fatal("the connection did not end when the resend was refused")
			}
			return
		}
		if pk.FixedHeader.Type == packets.Pubrec {
			t.Fatal("PUBREC for a refused resend")
		}
	}
}

// The members of the resend-window tests: the device "dev" left member
// leftMember and came to member cameMember.
const leftMember, cameMember = 0xa1, 0xb2

// resendWindowOn connects a subscriber to in/# on s and logs, as member
// cameMember took them, dev's start record (seq 10) and its resend record
// naming packet id 7 as the record of seq 11 (seq 12): the window the
// tests' records are then decided in. It returns the subscriber.
func resendWindowOn(t *testing.T, s *Server, l *memLog) *raw {
	t.Helper()
	sub := dialRaw(t, s.Addr(), 5)
	sub.connect("sub", true, nil)
	sub.subscribe(1, packets.Subscription{Filter: "in/#", Qos: 2})
	l.addRaw(&Message{Kind: KindSession, Origin: cameMember, Seq: 10, ClientID: "dev", Topic: sessionTopic, Payload: []byte(`{"op":"start","expiry":600}`)})
	l.addRaw(&Message{Kind: KindSession, Origin: cameMember, Seq: 12, ClientID: "dev", Topic: sessionTopic, Payload: []byte(`{"op":"resend","in":[7],"seq":11}`)})
	return sub
}

// A member that restarts between a resend and its late original decides
// as the others: the session's window is kept in the session store.
func TestMQTT_4_3_3_9_ResendWindowSurvivesARestart(t *testing.T) {
	s, l := testServer(t, nil, nil)
	sub := resendWindowOn(t, s, l)
	l.addRaw(&Message{Origin: cameMember, Seq: 11, ClientID: "dev", Topic: "in/x", QoS: 2, PacketID: 7, Payload: []byte("once")})
	l.addRaw(&Message{Origin: cameMember, Seq: 13, ClientID: "dev", Topic: "in/y", QoS: 1, PacketID: 8, Payload: []byte("marker")})
	if got := untilMarker(sub); len(got) != 2 || got[0] != "once" {
		t.Fatalf("before the restart the subscriber got %q, want the resend, then the marker", got)
	}
	l.halt()
	s, _ = testServer(t, l, nil)
	sub = dialRaw(t, s.Addr(), 5)
	sub.connect("sub", true, nil)
	sub.subscribe(1, packets.Subscription{Filter: "in/#", Qos: 2})
	l.addRaw(&Message{Origin: leftMember, Seq: 40, ClientID: "dev", Topic: "in/x", QoS: 2, PacketID: 7, Payload: []byte("once")})
	l.addRaw(&Message{Origin: cameMember, Seq: 14, ClientID: "dev", Topic: "in/y", QoS: 1, PacketID: 9, Payload: []byte("marker")})
	if got := untilMarker(sub); len(got) != 1 {
		t.Fatalf("after the restart the subscriber got %q, want the marker alone: the late original is the resend's copy", got)
	}
}

// waitLogged waits until the log holds a record that match accepts, and
// returns its index.
func waitLogged(t *testing.T, l *sharedLog, match func(*Message) bool) uint64 {
	t.Helper()
	var at uint64
	testutil.WaitFor(t, 5*time.Second, "the record in the log", func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		for i, m := range l.recs {
			if match(m) {
				at = uint64(i + 1)
				return true
			}
		}
		return false
	})
	return at
}

// waitLoggedOrNot reports whether the log holds a record match accepts.
func waitLoggedOrNot(l *sharedLog, match func(*Message) bool) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.ContainsFunc(l.recs, match)
}

// countLogged counts the device messages on topic with payload in the
// log, as m reads it.
func countLogged(m *member, l *sharedLog, topic, payload string) int {
	l.mu.Lock()
	n := uint64(len(l.recs))
	l.mu.Unlock()
	count := 0
	_ = m.Committed(1, n, func(_ uint64, r *Message) bool {
		if r.Kind == KindMessage && r.Topic == topic && string(r.Payload) == payload {
			count++
		}
		return true
	})
	return count
}

// A resend whose original never reached the log (the member the device
// left died with it) is logged once the new member has applied its start
// record, and delivered: waiting for that record swallows nothing.
func TestInboundResendOfAPublishNeverLoggedIsLoggedOnce(t *testing.T) {
	for _, v := range []byte{4, 5} {
		t.Run(fmt.Sprintf("v%d", v), func(t *testing.T) {
			l, a, b, dev, props := deviceOnA(t, v)
			b.caughtUp(t)
			lost := make(chan struct{})
			t.Cleanup(func() { close(lost) })
			a.setGate(func(msg *Message) (<-chan struct{}, error) {
				if msg.Kind == KindMessage {
					return lost, errCut // never logged
				}
				return nil, nil
			})
			pub := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 2}, TopicName: "in/x", PacketID: 7, Payload: []byte("once")}
			dev.write(pub)
			a.kill(t)
			dev.c.Close()
			b.holdHere() // the resend waits for b's start record

			dev = dialRaw(t, b.srv.Addr(), v)
			if ack := dev.connect("dev", false, props); !ack.SessionPresent {
				t.Fatal("session not present on b")
			}
			pub.FixedHeader.Dup = true
			dev.write(pub)
			b.holdAt(0)
			if rec := dev.expect(packets.Pubrec); rec.PacketID != 7 || rec.ReasonCode >= 0x80 {
				t.Fatalf("PUBREC %+v for the resend", rec)
			}
			b.caughtUp(t)
			if n := countLogged(b, l, "in/x", "once"); n != 1 {
				t.Fatalf("the message is in the log %d times, want once", n)
			}
		})
	}
}

// A device that completes a QoS 2 flow on one member may reuse the packet
// id at once for a new message [MQTT-4.3.3-9: until the PUBREL the id is
// the old message's; after the PUBCOMP it is free]. When that new
// publish never reaches the log (the member dies with it) and the device
// resends it (DUP) to another member, that member must log it: it held
// the released publish under the same id, taken from the log while the
// session was offline there, and without the release record answered the
// resend with a PUBREC for the old one and logged nothing, a message
// acked and lost.
func TestMQTT_4_3_3_9_IdReusedAfterPubcompIsANewMessageOnEveryMember(t *testing.T) {
	for _, v := range []byte{4, 5} {
		t.Run(fmt.Sprintf("v%d", v), func(t *testing.T) {
			l, a, b, dev, props := deviceOnA(t, v)
			b.caughtUp(t) // b holds the session, offline

			first := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 2}, TopicName: "in/x", PacketID: 7, Payload: []byte("first")}
			dev.write(first)
			dev.expect(packets.Pubrec)
			b.caughtUp(t) // b has the publish: a resend of it would be known there
			dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: 7})
			if comp := dev.expect(packets.Pubcomp); comp.PacketID != 7 || comp.ReasonCode != 0 {
				t.Fatalf("PUBCOMP %d %#x, want 7, 0", comp.PacketID, comp.ReasonCode)
			}
			if !inboundReleaseLogged(l, 7) {
				t.Fatal("PUBCOMP sent before the inbound release was in the log")
			}

			// The id again, for a new message that a never logs.
			lost := make(chan struct{})
			t.Cleanup(func() { close(lost) })
			a.setGate(func(msg *Message) (<-chan struct{}, error) {
				if msg.Kind == KindMessage {
					return lost, errCut
				}
				return nil, nil
			})
			second := first
			second.Payload = []byte("second")
			dev.write(second)
			a.kill(t)
			dev.c.Close()

			dev = dialRaw(t, b.srv.Addr(), v)
			if ack := dev.connect("dev", false, props); !ack.SessionPresent {
				t.Fatal("session not present on b")
			}
			second.FixedHeader.Dup = true
			dev.write(second)
			if rec := dev.expect(packets.Pubrec); rec.PacketID != 7 || rec.ReasonCode >= 0x80 {
				t.Fatalf("PUBREC %+v for the resend", rec)
			}
			dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: 7})
			dev.expect(packets.Pubcomp)
			b.caughtUp(t)
			if n := countLogged(b, l, "in/x", "second"); n != 1 {
				t.Fatalf("the new message is in the log %d times, want once: acked by b, it must be there", n)
			}
			if n := countLogged(b, l, "in/x", "first"); n != 1 {
				t.Fatalf("the first message is in the log %d times, want once", n)
			}
		})
	}
}

// An inbound release record that cannot be logged sends no PUBCOMP: the
// connection ends, and the device, which still holds the flow, sends its
// PUBREL again on the member it comes back to, which logs the release and
// completes the flow.
func TestMQTT_4_3_3_9_NoPubcompWhenTheInboundReleaseIsNotLogged(t *testing.T) {
	for _, v := range []byte{4, 5} {
		t.Run(fmt.Sprintf("v%d", v), func(t *testing.T) {
			l, a, b, dev, props := deviceOnA(t, v)
			dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 2}, TopicName: "in/x", PacketID: 7, Payload: []byte("m")})
			dev.expect(packets.Pubrec)
			a.setGate(func(msg *Message) (<-chan struct{}, error) {
				if isSessionOp(msg, "irel") {
					return nil, errors.New("no master")
				}
				return nil, nil
			})
			dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: 7})
			for {
				pk, err := dev.read(5 * time.Second)
				if err != nil {
					var ne net.Error
					if errors.As(err, &ne) && ne.Timeout() {
						t.Fatal("the connection did not end when the inbound release failed")
					}
					if v == 5 {
						t.Fatal("closed without a DISCONNECT")
					}
					break
				}
				if pk.FixedHeader.Type == packets.Pubcomp {
					t.Fatal("PUBCOMP though the inbound release was refused")
				}
				if pk.FixedHeader.Type == packets.Disconnect {
					if pk.ReasonCode != 0x89 {
						t.Fatalf("DISCONNECT %#x, want 0x89", pk.ReasonCode)
					}
					break
				}
			}
			dev.c.Close()
			if inboundReleaseLogged(l, 7) {
				t.Fatal("an inbound release in the log: the gate let it through")
			}
			b.caughtUp(t)
			a.kill(t)
			dev = dialRaw(t, b.srv.Addr(), v)
			if ack := dev.connect("dev", false, props); !ack.SessionPresent {
				t.Fatal("session not present on b")
			}
			dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: 7})
			if comp := dev.expect(packets.Pubcomp); comp.PacketID != 7 || comp.ReasonCode != 0 {
				t.Fatalf("PUBCOMP %d %#x on b, want 7, 0 (b holds the flow from the log)", comp.PacketID, comp.ReasonCode)
			}
			if !inboundReleaseLogged(l, 7) {
				t.Fatal("b sent PUBCOMP without logging the release")
			}
		})
	}
}

// inboundReleaseLogged reports whether the log holds an inbound release
// record of packet id pid.
func inboundReleaseLogged(l *sharedLog, pid uint16) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, m := range l.recs {
		if !isSessionOp(m, "irel") {
			continue
		}
		var op sessionOp
		if json.Unmarshal(m.Payload, &op) == nil && slices.Contains(op.In, pid) {
			return true
		}
	}
	return false
}

// deviceOnA starts two members on a shared log and connects a device
// "dev" to a, session kept (sessionProps(v)), in protocol version v.
func deviceOnA(t *testing.T, v byte) (l *sharedLog, a, b *member, dev *raw, props *packets.Properties) {
	t.Helper()
	l = newSharedLog()
	a, b = startMember(t, l, 1), startMember(t, l, 2)
	props = sessionProps(v)
	dev = dialRaw(t, a.srv.Addr(), v)
	dev.connect("dev", false, props)
	return l, a, b, dev, props
}

// sessionProps is a persistent session's CONNECT properties in protocol
// version v: 3.1.1 has none (clean session false keeps it).
func sessionProps(v byte) *packets.Properties {
	if v != 5 {
		return nil
	}
	return &packets.Properties{SessionExpiryInterval: 600, SessionExpiryIntervalFlag: true}
}

// deliverQoS2 connects a device "dev" to m (MQTT 5, session kept with
// props), subscribes it to m/# at QoS 2, and logs a message for it
// ("1" on m/x), whose PUBLISH the caller reads.
func deliverQoS2(t *testing.T, l *sharedLog, m *member, props *packets.Properties) *raw {
	t.Helper()
	dev := dialRaw(t, m.srv.Addr(), 5)
	dev.connect("dev", false, props)
	dev.subscribe(1, packets.Subscription{Filter: "m/#", Qos: 2})
	l.add(&Message{Origin: 9, Seq: 1, ClientID: "sensor", Topic: "m/x", QoS: 2, Payload: []byte("1")})
	return dev
}

// A PUBREL'd inbound flow holds the receive maximum until its PUBCOMP
// [MQTT-4.9.0-1], and its PUBCOMP waits for the inbound release record:
// a client sending PUBRELs (for any ids) faster than those records are
// logged is disconnected with 0x93 once past the receive maximum, not
// left to queue records and acks without bound.
func TestMQTT_4_9_0_1_PubrelsAwaitingTheirPubcompHoldTheReceiveMaximum(t *testing.T) {
	l := newSharedLog()
	a := startMemberWith(t, &member{l: l, id: 1, store: newMemStore()}, func(c *Config) { c.MaxInflight = 2 })
	slow := make(chan struct{})
	t.Cleanup(func() { close(slow) }) // before the member stops
	a.setGate(func(msg *Message) (<-chan struct{}, error) {
		if isSessionOp(msg, "irel") {
			return slow, nil
		}
		return nil, nil
	})
	dev := dialRaw(t, a.srv.Addr(), 5)
	dev.connect("dev", false, sessionProps(5))
	for pid := uint16(1); pid <= 3; pid++ {
		dev.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: pid})
	}
	for {
		pk, err := dev.read(5 * time.Second)
		if err != nil {
			t.Fatalf("no DISCONNECT past the receive maximum: %v", err)
		}
		if pk.FixedHeader.Type == packets.Disconnect {
			if pk.ReasonCode != 0x93 {
				t.Fatalf("DISCONNECT %#x, want 0x93", pk.ReasonCode)
			}
			return
		}
	}
}
