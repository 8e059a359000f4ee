package mqtt

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// Conformance tests, named after the normative statements of MQTT 3.1.1
// and 5.0 they check, driven by raw frames and by paho.golang.

func u32(v uint32) *uint32 { return &v }
func u16(v uint16) *uint16 { return &v }

// [MQTT-3.1.4-3]: a second CONNECT with the same client id ends the first
// connection, with DISCONNECT 0x8E for MQTT 5; the new one works.
func TestMQTT_3_1_4_3_TakeOverEndsTheFirstWith0x8E(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	first := dialRaw(t, s.Addr(), 5)
	first.connect("dev", true, nil)
	second := dialRaw(t, s.Addr(), 5)
	second.connect("dev", false, nil)
	if code, ok := first.closed(); !ok || code != packets.ErrSessionTakenOver.Code {
		t.Fatalf("first connection ended with DISCONNECT %v %#x, want 0x8E", ok, code)
	}
	second.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
	second.expect(packets.Pingresp)
}

// [MQTT-3.3.4-9]: a client that sends more QoS 1/2 publishes than the
// server's Receive Maximum is disconnected with 0x93 — that connection
// only — and the same client id then connects and works (the mochi-based
// layer refused it until a restart).
func TestMQTT_3_3_4_9_ReceiveMaximumExceededEndsOnlyThatConnection(t *testing.T) {
	log := newMemLog()
	hold := make(chan struct{})
	log.hold = hold // proposals resolve once released: the acks stay owed
	s, _ := testServer(t, log, func(c *Config) { c.MaxInflight = 4 })
	other := dialRaw(t, s.Addr(), 5)
	other.connect("bystander", true, nil)
	c := dialRaw(t, s.Addr(), 5)
	ack := c.connect("burst", true, nil)
	if ack.Properties.ReceiveMaximum != 4 {
		t.Fatalf("CONNACK receive maximum %d, want 4", ack.Properties.ReceiveMaximum)
	}
	for i := 1; i <= 5; i++ {
		c.publish("burst/x", 2, uint16(i), "p")
	}
	if code, ok := c.closed(); !ok || code != packets.ErrReceiveMaximum.Code {
		t.Fatalf("over the receive maximum: DISCONNECT %v %#x, want 0x93", ok, code)
	}
	close(hold)
	other.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
	other.expect(packets.Pingresp)
	again := dialRaw(t, s.Addr(), 5)
	if ack := again.connect("burst", true, nil); ack.ReasonCode != 0 {
		t.Fatalf("the same client id after 0x93: CONNACK %#x", ack.ReasonCode)
	}
	again.publish("burst/y", 1, 1, "ok")
	if ack := again.expect(packets.Puback); ack.PacketID != 1 || ack.ReasonCode != 0 {
		t.Fatalf("PUBACK %+v", ack)
	}
}

// [MQTT-4.4.0-1]: a client resends a QoS 2 publish only after a
// reconnect. One that resends a flow again and again on one connection
// while the record waits (here for the log) made the gateway queue an ack
// per resend, without bound. MQTT 5: past max_inflight resends owed, it is
// disconnected with 0x82. 3.1.1, which does not forbid it: it is no longer
// read from, at most max_inflight resends are queued, and once the record
// is logged every resend read is answered.
func TestMQTT_4_4_0_1_AFlowResentOnOneConnectionIsBounded(t *testing.T) {
	for _, v := range []byte{4, 5} {
		t.Run(fmt.Sprintf("v%d", v), func(t *testing.T) {
			const max, resends = 4, 50
			log := newMemLog()
			hold := make(chan struct{})
			log.hold = hold // the record waits: its ack and the resends' stay owed
			release := sync.OnceFunc(func() { close(hold) })
			t.Cleanup(release)
			s, _ := testServer(t, log, func(c *Config) { c.MaxInflight = max })
			dev := dialRaw(t, s.Addr(), v)
			dev.connect("dev", true, nil)
			pub := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 2}, TopicName: "in/x", PacketID: 7, Payload: []byte("p")}
			dev.write(pub)
			pub.FixedHeader.Dup = true
			if v == 5 {
				for range max + 1 {
					dev.write(pub)
				}
				if code, ok := dev.closed(); !ok || code != packets.ErrProtocolViolation.Code {
					t.Fatalf("a flow resent %d times on one connection: DISCONNECT %v %#x, want 0x82", max+1, ok, code)
				}
				return
			}
			for range resends {
				dev.write(pub)
			}
			queued := func() int {
				s.mu.Lock()
				se := s.sessions["dev"]
				s.mu.Unlock()
				c := se.current()
				if c == nil {
					return -1
				}
				c.amu.Lock()
				defer c.amu.Unlock()
				return len(c.acks)
			}
			testutil.WaitFor(t, 5*time.Second, "the publish and max_inflight resends queued", func() bool { return queued() >= max+1 })
			if n := queued(); n != max+1 {
				t.Fatalf("%d acks queued for one publish resent %d times, want at most %d", n, resends, max+1)
			}
			release()
			for i := range resends + 1 {
				if rec := dev.expect(packets.Pubrec); rec.PacketID != 7 || rec.ReasonCode != 0 {
					t.Fatalf("PUBREC %d: %d %#x", i, rec.PacketID, rec.ReasonCode)
				}
			}
		})
	}
}

// [MQTT-2.2.1-2]/[MQTT-4.3.3-?]: the server's outbound packet ids and the
// client's are independent spaces. A 3.1.1 persistent session that comes
// back while a delivery of packet id 1 is in flight subscribes with its
// own packet id 1 and is granted (the mochi-based layer answered 0x91).
func TestMQTT_2_2_1_PacketIDSpacesAreIndependent(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	sub := dialRaw(t, s.Addr(), 4)
	sub.connect("pz1", false, nil)
	sub.subscribe(1, packets.Subscription{Filter: "pz/#", Qos: 1})
	sub.c.Close()
	pub := dialRaw(t, s.Addr(), 4)
	pub.connect("pub", true, nil)
	pub.publish("pz/a", 1, 1, "queued")
	pub.expect(packets.Puback)
	back := dialRaw(t, s.Addr(), 4)
	if ack := back.connect("pz1", false, nil); !ack.SessionPresent {
		t.Fatal("session not present")
	}
	got := back.expect(packets.Publish)
	if string(got.Payload) != "queued" || got.PacketID != 1 {
		t.Fatalf("replayed %+v", got)
	}
	// The delivery is unacked: its id 1 is taken in the server's space.
	back.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1}, PacketID: 1,
		Filters: packets.Subscriptions{{Filter: "other/#", Qos: 1}}})
	sa := back.expect(packets.Suback)
	if sa.PacketID != 1 || len(sa.ReasonCodes) != 1 || sa.ReasonCodes[0] != 1 {
		t.Fatalf("SUBACK %+v, want packet id 1 granted QoS 1", sa)
	}
	pub.publish("other/x", 1, 2, "new filter")
	pub.expect(packets.Puback)
	p := back.expect(packets.Publish)
	if string(p.Payload) != "new filter" {
		t.Fatalf("the new filter does not deliver: %q", p.Payload)
	}
	// Both deliveries acked: nothing in flight (the mochi-based layer's
	// gauge went negative here).
	back.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: got.PacketID})
	back.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: p.PacketID})
	testutil.WaitFor(t, 5*time.Second, "nothing in flight", func() bool { return s.Inflight() == 0 })
}

// [MQTT-3.2.2-21]: a client asking for a keep alive over keepalive_max is
// told the server's in the CONNACK's Server Keep Alive, and held to it.
func TestMQTT_3_2_2_21_ServerKeepAlive(t *testing.T) {
	s, _ := testServer(t, nil, func(c *Config) { c.Limits.KeepAliveMax = 1 })
	c := dialRaw(t, s.Addr(), 5)
	ack := c.connect("ka", true, nil) // asks for 30 s
	if !ack.Properties.ServerKeepAliveFlag || ack.Properties.ServerKeepAlive != 1 {
		t.Fatalf("CONNACK server keep alive %v %d, want 1", ack.Properties.ServerKeepAliveFlag, ack.Properties.ServerKeepAlive)
	}
	start := time.Now()
	if code, ok := c.closed(); !ok || code != packets.ErrKeepAliveTimeout.Code {
		t.Fatalf("silent client: DISCONNECT %v %#x, want 0x8D", ok, code)
	}
	if d := time.Since(start); d > 4*time.Second {
		t.Fatalf("closed after %v, want about 1.5 s", d)
	}
}

// [MQTT-3.1.2-24] for 3.1.1 under keepalive_max: a client asking for a
// keep alive of 0 (none) is taken and held to the maximum, closed once
// silent for 1.5 times it; one asking for more than the maximum cannot be
// told the server's and is refused (CONNACK 0x02).
func TestMQTT_3_1_2_24_KeepAliveZeroHeldToTheMaximumIn311(t *testing.T) {
	s, _ := testServer(t, nil, func(c *Config) { c.Limits.KeepAliveMax = 1 })
	connect := func(id string, ka uint16) (*raw, packets.Packet) {
		c := dialRaw(t, s.Addr(), 4)
		c.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect},
			Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), ClientIdentifier: id, Clean: true, Keepalive: ka}})
		return c, c.expect(packets.Connack)
	}
	c, ack := connect("ka-zero", 0)
	if ack.ReasonCode != 0 {
		t.Fatalf("3.1.1 keep alive 0 under keepalive_max: CONNACK %#x, want 0 (accepted, held to the maximum)", ack.ReasonCode)
	}
	start := time.Now()
	if _, err := c.read(10 * time.Second); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("silent 3.1.1 client with keep alive 0: %v after %v, want the connection closed", err, time.Since(start))
	}
	if d := time.Since(start); d < time.Second || d > 4*time.Second {
		t.Fatalf("closed after %v, want about 1.5 s (1.5 × keepalive_max)", d)
	}
	if _, ack := connect("ka-over", 30); ack.ReasonCode != 0x02 {
		t.Fatalf("3.1.1 keep alive 30 over keepalive_max 1: CONNACK %#x, want 0x02", ack.ReasonCode)
	}
}

// [MQTT-3.3.2-12]/[MQTT-3.3.2-11]: an inbound topic alias set by one
// PUBLISH stands for its topic in the next; [MQTT-3.2.2-17]: the CONNACK
// says how many the server takes; an alias over it is a protocol error
// (0x94).
func TestMQTT_3_3_2_12_InboundTopicAliases(t *testing.T) {
	s, log := testServer(t, nil, nil)
	c := dialRaw(t, s.Addr(), 5)
	if ack := c.connect("alias", true, nil); ack.Properties.TopicAliasMaximum != 100 {
		t.Fatalf("CONNACK topic alias maximum %d, want 100", ack.Properties.TopicAliasMaximum)
	}
	set := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1}, TopicName: "alias/long/topic", PacketID: 1, Payload: []byte("a")}
	set.Properties.TopicAlias, set.Properties.TopicAliasFlag = 7, true
	c.write(set)
	c.expect(packets.Puback)
	use := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1}, PacketID: 2, Payload: []byte("b")}
	use.Properties.TopicAlias, use.Properties.TopicAliasFlag = 7, true
	c.write(use)
	c.expect(packets.Puback)
	if got := log.topics(); len(got) != 2 || got[1] != "alias/long/topic" {
		t.Fatalf("logged topics %v", got)
	}
	over := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1}, TopicName: "x", PacketID: 3}
	over.Properties.TopicAlias, over.Properties.TopicAliasFlag = 101, true
	c.write(over)
	if code, ok := c.closed(); !ok || code != packets.ErrTopicAliasInvalid.Code {
		t.Fatalf("alias over the maximum: DISCONNECT %v %#x, want 0x94", ok, code)
	}
}

// [MQTT-3.1.2-26]/[MQTT-3.3.2-?]: the server sends topic aliases only to a
// client that takes them, no more than its Topic Alias Maximum, and a
// later PUBLISH on the same topic carries the alias with an empty topic.
func TestMQTT_3_1_2_26_OutboundTopicAliases(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	c := dialRaw(t, s.Addr(), 5)
	c.connect("takes-aliases", true, &packets.Properties{TopicAliasMaximum: 1})
	c.subscribe(1, packets.Subscription{Filter: "ta/#", Qos: 0})
	none := dialRaw(t, s.Addr(), 5)
	none.connect("no-aliases", true, nil)
	none.subscribe(1, packets.Subscription{Filter: "ta/#", Qos: 0})
	pub := dialRaw(t, s.Addr(), 5)
	pub.connect("pub", true, nil)
	for i, topic := range []string{"ta/one", "ta/one", "ta/two"} {
		pub.publish(topic, 1, uint16(i+1), "x")
		pub.expect(packets.Puback)
	}
	p1, p2, p3 := c.expect(packets.Publish), c.expect(packets.Publish), c.expect(packets.Publish)
	if p1.TopicName != "ta/one" || p1.Properties.TopicAlias != 1 {
		t.Fatalf("first: topic %q alias %d, want ta/one with alias 1", p1.TopicName, p1.Properties.TopicAlias)
	}
	if p2.TopicName != "" || p2.Properties.TopicAlias != 1 {
		t.Fatalf("second: topic %q alias %d, want the alias alone", p2.TopicName, p2.Properties.TopicAlias)
	}
	if p3.TopicName != "ta/two" || p3.Properties.TopicAlias != 0 {
		t.Fatalf("third: topic %q alias %d, want no alias past the maximum of 1", p3.TopicName, p3.Properties.TopicAlias)
	}
	for i := 0; i < 3; i++ {
		if p := none.expect(packets.Publish); p.Properties.TopicAlias != 0 || p.TopicName == "" {
			t.Fatalf("a client without aliases got %+v", p)
		}
	}
}

// [MQTT-3.3.4-2]..[MQTT-3.3.4-5]: overlapping subscriptions give one copy,
// at the highest QoS granted, carrying every matching subscription
// identifier.
func TestMQTT_3_3_4_3_OverlappingSubscriptionsOneCopyWithEveryIdentifier(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	c := dialRaw(t, s.Addr(), 5)
	c.connect("overlap", true, nil)
	for i, f := range []packets.Subscription{{Filter: "ov/#", Qos: 0}, {Filter: "ov/+/x", Qos: 1}} {
		sub := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1}, PacketID: uint16(i + 1), Filters: packets.Subscriptions{f}}
		sub.Properties.SubscriptionIdentifier = []int{i + 1}
		c.write(sub)
		c.expect(packets.Suback)
	}
	pub := dialRaw(t, s.Addr(), 5)
	pub.connect("ov-pub", true, nil)
	pub.publish("ov/a/x", 1, 1, "once")
	pub.expect(packets.Puback)
	pub.publish("ov/end", 1, 2, "end")
	pub.expect(packets.Puback)
	p := c.expect(packets.Publish)
	if string(p.Payload) != "once" || p.FixedHeader.Qos != 1 {
		t.Fatalf("got %q at QoS %d, want once at 1", p.Payload, p.FixedHeader.Qos)
	}
	ids := fmt.Sprint(p.Properties.SubscriptionIdentifier)
	if ids != "[1 2]" && ids != "[2 1]" {
		t.Fatalf("subscription identifiers %s, want 1 and 2", ids)
	}
	c.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: p.PacketID})
	if e := c.expect(packets.Publish); string(e.Payload) != "end" {
		t.Fatalf("a second copy came: %q", e.Payload)
	}
}

// [MQTT-4.8.2-?] shared subscriptions: each message goes to one session of
// the group, round robin among the connected ones; a plain subscription
// beside the group still gets every one.
func TestMQTT_4_8_2_SharedSubscriptionsDeliverToOneMember(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	var chans []chan *paho.Publish
	for i := 0; i < 2; i++ {
		c, got := pahoClient(t, s.Addr(), fmt.Sprintf("member-%d", i), nil)
		if _, err := c.Subscribe(context.Background(), &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: "$share/g/sh/#", QoS: 1}}}); err != nil {
			t.Fatal(err)
		}
		chans = append(chans, got)
	}
	plain, all := pahoClient(t, s.Addr(), "plain", nil)
	if _, err := plain.Subscribe(context.Background(), &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: "sh/#", QoS: 1}}}); err != nil {
		t.Fatal(err)
	}
	pub, _ := pahoClient(t, s.Addr(), "sh-pub", nil)
	const n = 10
	for i := 0; i < n; i++ {
		if _, err := pub.Publish(context.Background(), &paho.Publish{Topic: "sh/t", QoS: 1, Payload: []byte{byte(i)}}); err != nil {
			t.Fatal(err)
		}
	}
	for i := 0; i < n; i++ {
		<-all
	}
	seen := map[byte]int{}
	counts := make([]int, 2)
	testutil.WaitFor(t, 5*time.Second, "every shared message", func() bool {
		for i, ch := range chans {
			for len(ch) > 0 {
				seen[(<-ch).Payload[0]]++
				counts[i]++
			}
		}
		return len(seen) == n
	})
	for k, v := range seen {
		if v != 1 {
			t.Fatalf("message %d went to %d members", k, v)
		}
	}
	if counts[0] != n/2 || counts[1] != n/2 {
		t.Fatalf("round robin gave %v, want 5 each", counts)
	}
}

// [MQTT-3.1.3-9]: a will with a delay is not sent when the client comes
// back within it; [MQTT-3.1.2-8]: it is sent when the client does not.
func TestMQTT_3_1_3_9_WillDelay(t *testing.T) {
	s, log := testServer(t, nil, nil)
	connectWithWill := func() *raw {
		c := dialRaw(t, s.Addr(), 5)
		pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect},
			Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), ClientIdentifier: "willy", Keepalive: 30,
				WillFlag: true, WillTopic: "wills/willy", WillPayload: []byte("gone"), WillQos: 1}}
		pk.Properties.SessionExpiryInterval, pk.Properties.SessionExpiryIntervalFlag = 60, true
		pk.Connect.WillProperties.WillDelayInterval = 1
		c.write(pk)
		c.expect(packets.Connack)
		return c
	}
	c := connectWithWill()
	c.c.Close() // no DISCONNECT: the will is due after its delay
	connectWithWill()
	time.Sleep(1500 * time.Millisecond) // the will's delay has to pass to show it was cancelled
	for _, topic := range log.topics() {
		if topic == "wills/willy" {
			t.Fatal("the will was sent although the client came back within its delay")
		}
	}
	c2 := connectWithWill()
	c2.c.Close()
	testutil.WaitFor(t, 5*time.Second, "the will", func() bool {
		for _, topic := range log.topics() {
			if topic == "wills/willy" {
				return true
			}
		}
		return false
	})
}

// [MQTT-3.1.2-24]: the server does not send a packet larger than the
// client's Maximum Packet Size: that message is dropped, the next small
// one arrives.
func TestMQTT_3_1_2_24_ClientMaximumPacketSize(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	c := dialRaw(t, s.Addr(), 5)
	c.connect("small", true, &packets.Properties{MaximumPacketSize: 200})
	c.subscribe(1, packets.Subscription{Filter: "mp/#", Qos: 1})
	pub := dialRaw(t, s.Addr(), 5)
	pub.connect("pub", true, nil)
	pub.publish("mp/big", 1, 1, strings.Repeat("x", 500))
	pub.expect(packets.Puback)
	pub.publish("mp/small", 1, 2, "fits")
	pub.expect(packets.Puback)
	if p := c.expect(packets.Publish); p.TopicName != "mp/small" {
		t.Fatalf("got %s, want only the message that fits", p.TopicName)
	}
}

// [MQTT-3.2.2-15]/[MQTT-3.1.2-?]: a packet over the server's maximum
// packet size ends that connection with 0x95; before CONNECT is
// authenticated the bound is 64 KiB whatever max_packet_size says.
func TestMQTT_3_2_2_15_ServerMaximumPacketSize(t *testing.T) {
	s, _ := testServer(t, nil, func(c *Config) { c.MaxPacketSize = 1 << 20 })
	c := dialRaw(t, s.Addr(), 5)
	c.connect("big", true, nil)
	c.publish("mps/x", 0, 0, strings.Repeat("y", 1<<20))
	if code, ok := c.closed(); !ok || code != packets.ErrPacketTooLarge.Code {
		t.Fatalf("oversize PUBLISH: DISCONNECT %v %#x, want 0x95", ok, code)
	}
	pre := dialRaw(t, s.Addr(), 5)
	// A CONNECT claiming 100 KiB: closed before the server reads it.
	pre.send([]byte{0x10, 0x80, 0x80, 0x06})
	pre.closed()
}

// [MQTT-3.3.5-2]: a PUBLISH the server does not authorize is answered
// with a negative ack (0x87, MQTT 5) or the connection is closed (3.1.1,
// which has none); clients may not publish to $ topics, the server's
// (4.7.2: "SHOULD prevent Clients from using such Topic Names").
func TestMQTT_3_3_5_2_NoPublishesToDollarTopics(t *testing.T) {
	s, log := testServer(t, nil, nil)
	c := dialRaw(t, s.Addr(), 5)
	c.connect("sys5", true, nil)
	c.publish("$SYS/broker/x", 1, 1, "no")
	if ack := c.expect(packets.Puback); ack.ReasonCode != packets.ErrNotAuthorized.Code {
		t.Fatalf("PUBACK %#x, want 0x87", ack.ReasonCode)
	}
	c3 := dialRaw(t, s.Addr(), 4)
	c3.connect("sys3", true, nil)
	c3.publish("$SYS/broker/x", 1, 1, "no")
	c3.closed()
	if got := log.topics(); len(got) != 0 {
		t.Fatalf("logged %v", got)
	}
}

// [MQTT-3.8.3-3]: No Local: a client's own publishes do not come back on
// a subscription with it set; [MQTT-3.3.1-12]/[MQTT-3.3.1-13]: Retain As
// Published keeps the retain flag on forwarded messages, without it the
// flag is cleared.
func TestMQTT_3_8_3_3_NoLocalAndRetainAsPublished(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	c := dialRaw(t, s.Addr(), 5)
	c.connect("nl", true, nil)
	c.subscribe(1, packets.Subscription{Filter: "nl/own", Qos: 1, NoLocal: true},
		packets.Subscription{Filter: "nl/rap", Qos: 1, RetainAsPublished: true},
		packets.Subscription{Filter: "nl/plain", Qos: 1})
	c.publish("nl/own", 1, 1, "mine")
	c.expect(packets.Puback)
	other := dialRaw(t, s.Addr(), 5)
	other.connect("other", true, nil)
	write := func(topic string, pid uint16) {
		other.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1, Retain: true}, TopicName: topic, PacketID: pid, Payload: []byte("r")})
		other.expect(packets.Puback)
	}
	write("nl/rap", 1)
	write("nl/plain", 2)
	p1, p2 := c.expect(packets.Publish), c.expect(packets.Publish)
	if p1.TopicName != "nl/rap" || !p1.FixedHeader.Retain {
		t.Fatalf("retain as published: %s retain=%v", p1.TopicName, p1.FixedHeader.Retain)
	}
	if p2.TopicName != "nl/plain" || p2.FixedHeader.Retain {
		t.Fatalf("plain: %s retain=%v, want the flag cleared", p2.TopicName, p2.FixedHeader.Retain)
	}
}

// [MQTT-3.3.1-9]..[MQTT-3.3.1-11]: retained messages on subscribe, by
// Retain Handling: 0 always, 1 only for a new subscription, 2 never;
// [MQTT-3.3.1-10]: an empty retained payload clears the topic.
func TestMQTT_3_3_1_9_RetainHandling(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	pub := dialRaw(t, s.Addr(), 5)
	pub.connect("rp", true, nil)
	pub.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1, Retain: true}, TopicName: "rh/a", PacketID: 1, Payload: []byte("kept")})
	pub.expect(packets.Puback)
	// Applied too: a subscription made before would also get it live.
	testutil.WaitFor(t, 5*time.Second, "the retained message", func() bool { return s.Retained() == 1 && s.applied.Load() >= 1 })
	c := dialRaw(t, s.Addr(), 5)
	c.connect("rh", true, nil)
	for _, tc := range []struct {
		rh   byte
		want bool
	}{{0, true}, {0, true}, {1, false}, {2, false}} {
		// The retained message may come before the SUBACK: "the Server
		// is permitted to start sending PUBLISH packets matching the
		// Subscription before the Server sends the SUBACK" (3.8.4).
		c.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1}, PacketID: 1,
			Filters: []packets.Subscription{{Filter: "rh/#", Qos: 1, RetainHandling: tc.rh}}})
		var got []packets.Packet
		for acked := false; ; {
			pk, err := c.read(300 * time.Millisecond) // bounded wait for a message that must not come
			if err != nil {
				if !acked {
					t.Fatalf("retain handling %d: no SUBACK: %v", tc.rh, err)
				}
				break
			}
			switch pk.FixedHeader.Type {
			case packets.Suback:
				acked = true
			case packets.Publish:
				got = append(got, pk)
				c.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
			default:
				t.Fatalf("retain handling %d: packet type %d", tc.rh, pk.FixedHeader.Type)
			}
		}
		if (len(got) == 1) != tc.want || len(got) > 1 {
			t.Fatalf("retain handling %d: %d retained messages sent, want it %v", tc.rh, len(got), tc.want)
		}
		if len(got) == 1 && (!got[0].FixedHeader.Retain || string(got[0].Payload) != "kept") {
			t.Fatalf("retained message %+v", got[0])
		}
	}
	fresh := dialRaw(t, s.Addr(), 5)
	fresh.connect("rh-new", true, nil)
	fresh.subscribe(1, packets.Subscription{Filter: "rh/#", Qos: 1, RetainHandling: 1})
	if p := fresh.expect(packets.Publish); string(p.Payload) != "kept" {
		t.Fatalf("retain handling 1 on a new subscription: %q", p.Payload)
	}
	pub.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1, Retain: true}, TopicName: "rh/a", PacketID: 2})
	pub.expect(packets.Puback)
	testutil.WaitFor(t, 5*time.Second, "the retained message cleared", func() bool { return s.Retained() == 0 })
}

// [MQTT-3.3.2-4]..[MQTT-3.3.2-20]: the properties of a PUBLISH reach the
// subscriber unchanged (payload format, content type, response topic,
// correlation data, user properties in order), and [MQTT-3.3.2-6] the
// message expiry it gets is what is left of the publisher's.
func TestMQTT_3_3_2_4_PropertiesPassThrough(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	sub, got := pahoClient(t, s.Addr(), "props-sub", nil)
	if _, err := sub.Subscribe(context.Background(), &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: "req/#", QoS: 1}}}); err != nil {
		t.Fatal(err)
	}
	pub, _ := pahoClient(t, s.Addr(), "props-pub", nil)
	pf := byte(1)
	props := &paho.PublishProperties{PayloadFormat: &pf, MessageExpiry: u32(60), ContentType: "application/json",
		ResponseTopic: "resp/1", CorrelationData: []byte{1, 2, 3},
		User: paho.UserProperties{{Key: "a", Value: "1"}, {Key: "b", Value: "2"}, {Key: "a", Value: "3"}}}
	if _, err := pub.Publish(context.Background(), &paho.Publish{Topic: "req/x", QoS: 1, Payload: []byte(`{}`), Properties: props}); err != nil {
		t.Fatal(err)
	}
	p := <-got
	gp := p.Properties
	if gp == nil || gp.PayloadFormat == nil || *gp.PayloadFormat != 1 || gp.ContentType != "application/json" ||
		gp.ResponseTopic != "resp/1" || string(gp.CorrelationData) != "\x01\x02\x03" || gp.MessageExpiry == nil || *gp.MessageExpiry > 60 || *gp.MessageExpiry < 58 {
		t.Fatalf("properties %+v", gp)
	}
	if fmt.Sprint(gp.User) != fmt.Sprint(props.User) {
		t.Fatalf("user properties %v, want %v in order", gp.User, props.User)
	}
}

// Sessions are cursors into the log: a persistent session whose client is
// offline is handed, on reconnect, every QoS 1 message published meanwhile,
// in log order, read from the log [MQTT-3.1.2-4]/[MQTT-4.6.0-?]. And a
// subscriber slower than its queue reads the log from its cursor: nothing
// is lost and order holds.
func TestMQTT_3_1_2_4_SessionsReplayFromTheirCursor(t *testing.T) {
	s, _ := testServer(t, nil, func(c *Config) { c.MaxQueued = 8 })
	c := dialRaw(t, s.Addr(), 4)
	c.connect("cursor", false, nil)
	c.subscribe(1, packets.Subscription{Filter: "cur/#", Qos: 1})
	c.c.Close()
	pub := dialRaw(t, s.Addr(), 4)
	pub.connect("pub", true, nil)
	const n = 100
	for i := 0; i < n; i++ {
		pub.publish("cur/x", 1, uint16(i+1), fmt.Sprint(i))
		pub.expect(packets.Puback)
	}
	back := dialRaw(t, s.Addr(), 4)
	back.connect("cursor", false, nil)
	for i := 0; i < n; i++ {
		p := back.expect(packets.Publish)
		if string(p.Payload) != fmt.Sprint(i) {
			t.Fatalf("message %d: got %q", i, p.Payload)
		}
		back.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: p.PacketID})
	}
	// Online now, with a queue of 8 and a window of 1: the rest comes
	// from the log.
	slow := dialRaw(t, s.Addr(), 5)
	slow.connect("slow", true, &packets.Properties{ReceiveMaximum: 1})
	slow.subscribe(1, packets.Subscription{Filter: "cur/#", Qos: 1})
	for i := 0; i < n; i++ {
		pub.publish("cur/y", 1, uint16(i+1), fmt.Sprint(i))
		pub.expect(packets.Puback)
	}
	for i := 0; i < n; i++ {
		p := slow.expect(packets.Publish)
		if string(p.Payload) != fmt.Sprint(i) {
			t.Fatalf("slow subscriber, message %d: got %q", i, p.Payload)
		}
		slow.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: p.PacketID})
	}
}

// A persistent session survives the server: subscriptions, cursor and the
// unacked QoS 1 message come back from the session store, and the message
// is resent with DUP [MQTT-4.4.0-1].
func TestMQTT_4_4_0_1_SessionSurvivesRestart(t *testing.T) {
	log := newMemLog()
	s, _ := testServer(t, log, nil)
	c := dialRaw(t, s.Addr(), 5)
	c.connect("durable", false, &packets.Properties{SessionExpiryInterval: 3600, SessionExpiryIntervalFlag: true})
	c.subscribe(1, packets.Subscription{Filter: "dur/#", Qos: 1})
	pub := dialRaw(t, s.Addr(), 5)
	pub.connect("pub", true, nil)
	pub.publish("dur/a", 1, 1, "unacked")
	pub.expect(packets.Puback)
	first := c.expect(packets.Publish) // not acked
	log.halt()
	s2, _ := testServer(t, log, nil)
	back := dialRaw(t, s2.Addr(), 5)
	if ack := back.connect("durable", false, &packets.Properties{SessionExpiryInterval: 3600, SessionExpiryIntervalFlag: true}); !ack.SessionPresent {
		t.Fatal("session not present after the restart")
	}
	p := back.expect(packets.Publish)
	if string(p.Payload) != "unacked" || !p.FixedHeader.Dup || p.PacketID != first.PacketID {
		t.Fatalf("resend %+v (dup %v), want the unacked message with DUP and id %d", p, p.FixedHeader.Dup, first.PacketID)
	}
	back.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: p.PacketID})
	pub2 := dialRaw(t, s2.Addr(), 5)
	pub2.connect("pub", true, nil)
	pub2.publish("dur/b", 1, 1, "after")
	pub2.expect(packets.Puback)
	if p := back.expect(packets.Publish); string(p.Payload) != "after" {
		t.Fatalf("after the restart: %q", p.Payload)
	}
}

// [MQTT-4.3.3-?] QoS 2 inbound: a resent PUBLISH (DUP) of a flow whose
// PUBREL has not come is answered PUBREC and not logged twice; PUBREL for
// an unknown id gets PUBCOMP 0x92.
func TestMQTT_4_3_3_QoS2InboundExactlyOnce(t *testing.T) {
	s, log := testServer(t, nil, nil)
	c := dialRaw(t, s.Addr(), 5)
	c.connect("q2", true, nil)
	c.publish("q2/a", 2, 9, "once")
	c.expect(packets.Pubrec)
	c.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 2, Dup: true}, TopicName: "q2/a", PacketID: 9, Payload: []byte("once")})
	c.expect(packets.Pubrec)
	c.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: 9})
	if comp := c.expect(packets.Pubcomp); comp.ReasonCode != 0 {
		t.Fatalf("PUBCOMP %#x", comp.ReasonCode)
	}
	c.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: 10})
	if comp := c.expect(packets.Pubcomp); comp.ReasonCode != packets.ErrPacketIdentifierNotFound.Code {
		t.Fatalf("PUBCOMP for an unknown id %#x, want 0x92", comp.ReasonCode)
	}
	if got := log.topics(); len(got) != 1 {
		t.Fatalf("logged %v, want once", got)
	}
}

// [MQTT-3.1.2-23]: a session ends its Session Expiry Interval after the
// connection closes; reconnecting after that finds no session.
// [MQTT-3.1.2-4]: Clean Start discards one that is still there.
func TestMQTT_3_1_2_23_SessionExpiry(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	props := &packets.Properties{SessionExpiryInterval: 1, SessionExpiryIntervalFlag: true}
	c := dialRaw(t, s.Addr(), 5)
	c.connect("expiring", false, props)
	c.subscribe(1, packets.Subscription{Filter: "exp/#", Qos: 1})
	c.c.Close()
	// Back within the interval: present.
	testutil.WaitFor(t, 5*time.Second, "the first connection to end", func() bool { return s.Clients() == 0 })
	back := dialRaw(t, s.Addr(), 5)
	if ack := back.connect("expiring", false, props); !ack.SessionPresent {
		t.Fatal("session gone within its expiry")
	}
	back.c.Close()
	testutil.WaitFor(t, 5*time.Second, "the session to expire", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.sessions["expiring"] == nil
	})
	late := dialRaw(t, s.Addr(), 5)
	if ack := late.connect("expiring", false, props); ack.SessionPresent {
		t.Fatal("session present after its expiry")
	}
	late.c.Close()
	testutil.WaitFor(t, 5*time.Second, "the connection to end", func() bool { return s.Clients() == 0 })
	fresh := dialRaw(t, s.Addr(), 5)
	if ack := fresh.connect("expiring", true, props); ack.SessionPresent {
		t.Fatal("clean start kept the session")
	}
}

// [MQTT-3.3.4-7]/[MQTT-3.3.4-8]: the server sends no more unacknowledged
// QoS 1/2 PUBLISHes than the client's Receive Maximum; the next goes out
// as one is acked.
func TestMQTT_3_3_4_7_ClientReceiveMaximumBoundsDeliveries(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	c := dialRaw(t, s.Addr(), 5)
	c.connect("rm3", true, &packets.Properties{ReceiveMaximum: 3})
	c.subscribe(1, packets.Subscription{Filter: "rm/#", Qos: 1})
	pub := dialRaw(t, s.Addr(), 5)
	pub.connect("pub", true, nil)
	for i := 0; i < 10; i++ {
		pub.publish("rm/x", 1, uint16(i+1), fmt.Sprint(i))
		pub.expect(packets.Puback)
	}
	var got []packets.Packet
	for i := 0; i < 3; i++ {
		got = append(got, c.expect(packets.Publish))
	}
	if pk, err := c.read(300 * time.Millisecond); err == nil { // bounded wait for what must not come
		t.Fatalf("a fourth PUBLISH with 3 unacked: %+v", pk)
	}
	for i := 3; i < 10; i++ {
		c.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: got[0].PacketID})
		got = append(got[1:], c.expect(packets.Publish))
		if p := got[len(got)-1]; string(p.Payload) != fmt.Sprint(i) {
			t.Fatalf("message %d: %q", i, p.Payload)
		}
	}
}

// The retained store is a function of the log: when the log is replaced
// (a join wipes it, a deposed master's rejoin cuts its tail), the
// retained messages that the lost records set go, and those of the kept
// records stay, on disk too.
func TestRetainedFollowsARewoundLog(t *testing.T) {
	s, log := testServer(t, nil, nil)
	s.Retain(5, &Message{Topic: "r/kept", Retain: true, Payload: []byte("a")})
	s.Retain(10, &Message{Topic: "r/tail", Retain: true, Payload: []byte("b")})
	s.Rewind(7, 0)
	if s.Retained() != 1 || len(s.retained.matching("r/kept")) != 1 {
		t.Fatalf("after a rewind to 7: %d retained, want r/kept only", s.Retained())
	}
	if _, ok := log.store.m[keyRetained+"r/tail"]; ok {
		t.Fatal("the dropped retained message is still on disk")
	}
	s.Rewind(0, 0)
	if s.Retained() != 0 {
		t.Fatalf("after the log was wiped: %d retained", s.Retained())
	}
}

// A log replaced under a live session (a join with devices connected)
// takes the session's queued records of the old log with it: the session
// reads the new log from its cursor, and no old index moves it over the
// new log's records there.
func TestRewindDropsTheQueuedRecordsOfTheOldLog(t *testing.T) {
	s, log := testServer(t, nil, nil)
	c := dialRaw(t, s.Addr(), 5)
	c.connect("live", true, &packets.Properties{ReceiveMaximum: 1})
	c.subscribe(1, packets.Subscription{Filter: "j/#", Qos: 1})
	pub := dialRaw(t, s.Addr(), 5)
	pub.connect("pub", true, nil)
	for i := range 5 {
		pub.publish("j/x", 1, uint16(i+1), fmt.Sprint("old", i))
		pub.expect(packets.Puback)
	}
	first := c.expect(packets.Publish) // old0 in flight, old1..old4 queued
	if string(first.Payload) != "old0" {
		t.Fatalf("first delivery %q", first.Payload)
	}
	// The join stops the node before it rewinds (restartNode), so no
	// record of the old log is being applied meanwhile: a PUBACK comes at
	// the record's commit, before its apply.
	testutil.WaitFor(t, 5*time.Second, "the old log to be applied", func() bool {
		log.mu.Lock()
		defer log.mu.Unlock()
		return log.applied == 5
	})
	// The join: the cluster's history is two records, on another topic.
	log.mu.Lock()
	log.recs = []*Message{{Topic: "h/x", QoS: 1, Payload: []byte("h0")}, {Topic: "h/x", QoS: 1, Payload: []byte("h1")}}
	log.applied = 2
	log.mu.Unlock()
	s.Rewind(2, 2)
	for i := range 3 {
		pub.publish("j/x", 1, uint16(10+i), fmt.Sprint("new", i))
		pub.expect(packets.Puback)
	}
	c.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: first.PacketID})
	for i := range 3 {
		p := c.expect(packets.Publish)
		if want := fmt.Sprint("new", i); string(p.Payload) != want {
			t.Fatalf("after the rewind got %q, want %s: the old log's queue was handed out", p.Payload, want)
		}
		c.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: p.PacketID})
	}
}

// With DisconnectWhenQueueFull a client that falls further behind than its
// queue is disconnected with 0x97 rather than read the log for; its
// persistent session resumes from its cursor and loses nothing.
func TestQueueFullDisconnectsAndTheSessionResumes(t *testing.T) {
	s, _ := testServer(t, nil, func(c *Config) { c.MaxQueued = 4; c.DisconnectWhenQueueFull = true })
	props := &packets.Properties{ReceiveMaximum: 1, SessionExpiryInterval: 60, SessionExpiryIntervalFlag: true}
	c := dialRaw(t, s.Addr(), 5)
	c.connect("laggard", false, props)
	c.subscribe(1, packets.Subscription{Filter: "q/#", Qos: 1})
	pub := dialRaw(t, s.Addr(), 5)
	pub.connect("pub", true, nil)
	const n = 20
	for i := 0; i < n; i++ {
		pub.publish("q/x", 1, uint16(i+1), fmt.Sprint(i))
		pub.expect(packets.Puback)
	}
	if code, ok := c.closed(); !ok || code != packets.ErrQuotaExceeded.Code {
		t.Fatalf("a client past its queue: DISCONNECT %v %#x, want 0x97", ok, code)
	}
	testutil.WaitFor(t, 5*time.Second, "the connection to end", func() bool { return s.Clients() == 1 })
	back := dialRaw(t, s.Addr(), 5)
	back.connect("laggard", false, &packets.Properties{SessionExpiryInterval: 60, SessionExpiryIntervalFlag: true})
	seen := map[string]bool{}
	for len(seen) < n {
		p := back.expect(packets.Publish)
		seen[string(p.Payload)] = true
		back.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: p.PacketID})
	}
}

// A client resuming its session subscribes again to its filter while the
// messages that waited for it are still being handed over (mosquitto_sub
// -c does): they all still come [MQTT-3.8.4-3] — the subscription is
// replaced, not made anew. 300 waiting messages and a window of 10: the
// replay reads them in batches, some after the SUBSCRIBE.
func TestMQTT_3_8_4_3_ResubscribeKeepsWhatWaited(t *testing.T) {
	s, _ := testServer(t, nil, func(c *Config) { c.MaxInflight = 10 })
	c := dialRaw(t, s.Addr(), 4)
	c.connect("resub", false, nil)
	c.subscribe(1, packets.Subscription{Filter: "rs/#", Qos: 1})
	c.c.Close()
	testutil.WaitFor(t, 5*time.Second, "the first connection to end", func() bool { return s.Clients() == 0 })
	pub := dialRaw(t, s.Addr(), 5)
	pub.connect("pub", true, nil)
	const n = 300
	for i := 0; i < n; i++ {
		pub.publish("rs/x", 1, uint16(i+1), fmt.Sprint(i))
		pub.expect(packets.Puback)
	}
	back := dialRaw(t, s.Addr(), 4)
	back.connect("resub", false, nil)
	first := back.expect(packets.Publish)
	back.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1}, PacketID: 1,
		Filters: packets.Subscriptions{{Filter: "rs/#", Qos: 1}}})
	got := map[string]bool{string(first.Payload): true}
	back.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: first.PacketID})
	for len(got) < n {
		p := back.next()
		if p.FixedHeader.Type != packets.Publish {
			continue // the SUBACK
		}
		got[string(p.Payload)] = true
		back.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: p.PacketID})
	}
}

// countingObserver counts the drops the server reports.
type countingObserver struct {
	nopObserver
	dropped atomic.Uint64
}

func (o *countingObserver) Dropped(n uint64) { o.dropped.Add(n) }

// offlineWithTen leaves a persistent session "behind" on rt/# offline and
// publishes 0..9 on rt/x meanwhile.
func offlineWithTen(t *testing.T, s *Server) {
	t.Helper()
	c := dialRaw(t, s.Addr(), 4)
	c.connect("behind", false, nil)
	c.subscribe(1, packets.Subscription{Filter: "rt/#", Qos: 1})
	c.c.Close()
	testutil.WaitFor(t, 5*time.Second, "the connection to end", func() bool { return s.Clients() == 0 })
	pub := dialRaw(t, s.Addr(), 4)
	pub.connect("pub", true, nil)
	for i := 0; i < 10; i++ {
		pub.publish("rt/x", 1, uint16(i+1), fmt.Sprint(i))
		pub.expect(packets.Puback)
	}
}

// A persistent session offline while retention drops the log's oldest
// records gets the records kept, and what it lost is counted.
func TestRetentionDropsAreCountedPerSession(t *testing.T) {
	obs := &countingObserver{}
	s, log := testServer(t, nil, func(c *Config) { c.Observer = obs })
	offlineWithTen(t, s)
	log.mu.Lock()
	n := len(log.recs)
	log.first = uint64(n - 3) // the last four records are kept
	log.mu.Unlock()
	back := dialRaw(t, s.Addr(), 4)
	back.connect("behind", false, nil)
	for i := 6; i < 10; i++ {
		p := back.expect(packets.Publish)
		if string(p.Payload) != fmt.Sprint(i) {
			t.Fatalf("got %q, want %d: the kept records only", p.Payload, i)
		}
		back.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: p.PacketID})
	}
	if obs.dropped.Load() == 0 {
		t.Fatal("the dropped records were not counted")
	}
}

// Retention may drop records while a session's replay is reading the
// log (the store reads in chunks and goes on at the new first index): the
// positions it jumped over are counted as dropped too, and the session
// gets the rest.
func TestRetentionDropsDuringAReplayAreCounted(t *testing.T) {
	obs := &countingObserver{}
	s, log := testServer(t, nil, func(c *Config) { c.Observer = obs })
	offlineWithTen(t, s)
	log.mu.Lock()
	at := map[string]uint64{}
	for i, m := range log.recs {
		if m.Topic == "rt/x" {
			at[string(m.Payload)] = uint64(i + 1)
		}
	}
	// Once the replay has read message 1, retention takes 2..5.
	log.scanHook = func(idx uint64) {
		if idx == at["1"] {
			log.mu.Lock()
			log.first = at["6"]
			log.mu.Unlock()
		}
	}
	log.mu.Unlock()
	back := dialRaw(t, s.Addr(), 4)
	back.connect("behind", false, nil)
	for _, want := range []string{"0", "1", "6", "7", "8", "9"} {
		p := back.expect(packets.Publish)
		if string(p.Payload) != want {
			t.Fatalf("got %q, want %s: the records kept only", p.Payload, want)
		}
		back.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: p.PacketID})
	}
	if got, want := obs.dropped.Load(), at["6"]-at["1"]-1; got != want {
		t.Fatalf("%d log positions counted as dropped, want %d", got, want)
	}
}

// A record the applier reports as delivered before a rejoin (Delivered)
// is skipped by a replaying session as by the live path: a subscriber
// gets each record once across a deposed master's rejoin.
func TestReplaySkipsRecordsDeliveredBeforeARejoin(t *testing.T) {
	s, log := testServer(t, nil, nil)
	c := dialRaw(t, s.Addr(), 4)
	c.connect("once", false, nil)
	c.subscribe(1, packets.Subscription{Filter: "once/#", Qos: 1})
	c.c.Close()
	testutil.WaitFor(t, 5*time.Second, "the connection to end", func() bool { return s.Clients() == 0 })
	pub := dialRaw(t, s.Addr(), 4)
	pub.connect("pub", true, nil)
	for i := 0; i < 3; i++ {
		pub.publish("once/x", 1, uint16(i+1), fmt.Sprint(i))
		pub.expect(packets.Puback)
	}
	log.mu.Lock()
	idx := uint64(0)
	for i, m := range log.recs {
		if m.Topic == "once/x" && string(m.Payload) == "1" {
			idx = uint64(i + 1)
		}
	}
	log.mu.Unlock()
	s.Delivered(idx)
	back := dialRaw(t, s.Addr(), 4)
	back.connect("once", false, nil)
	for _, want := range []string{"0", "2"} {
		p := back.expect(packets.Publish)
		if string(p.Payload) != want {
			t.Fatalf("got %q, want %s (1 was delivered before)", p.Payload, want)
		}
		back.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: p.PacketID})
	}
}
