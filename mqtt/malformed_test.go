package mqtt

import (
	"encoding/binary"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// Packets that mochi's decoder takes and MQTT refuses, sent as raw frames:
// each ends its own connection only (MQTT 5: CONNACK or DISCONNECT 0x81
// Malformed Packet / 0x82 Protocol Error; 3.1.1: the connection closes),
// and a bystander connected beside it is still served.

// Property encodings for raw frames (MQTT 5 section 2.2.2.2).
func propByteOf(id, v byte) []byte { return []byte{id, v} }
func propU16Of(id byte, v uint16) []byte {
	return binary.BigEndian.AppendUint16([]byte{id}, v)
}
func propU32Of(id byte, v uint32) []byte {
	return binary.BigEndian.AppendUint32([]byte{id}, v)
}
func propVarOf(id byte, v uint64) []byte { return binary.AppendUvarint([]byte{id}, v) }
func propStrOf(id byte, s string) []byte { return append([]byte{id}, mqttString(s)...) }
func propPairOf(k, v string) []byte {
	return append(append([]byte{0x26}, mqttString(k)...), mqttString(v)...)
}

// mqttString is a length-prefixed UTF-8 string.
func mqttString(s string) []byte {
	return append(binary.BigEndian.AppendUint16(nil, uint16(len(s))), s...)
}

// propsBlock is a properties block: its length, then the properties.
func propsBlock(props ...[]byte) []byte {
	var b []byte
	for _, p := range props {
		b = append(b, p...)
	}
	return append(binary.AppendUvarint(nil, uint64(len(b))), b...)
}

// connectFrame is a CONNECT (clean start, keep alive 30) of protocol
// version v with client id id; props (MQTT 5 only) is its properties block,
// will (MQTT 5 only, nil for none) its will's: topic "w", payload "x".
func connectFrame(v byte, id string, props, will []byte) []byte {
	flags := byte(0x02)
	if will != nil {
		flags |= 0x04
	}
	b := append(mqttString("MQTT"), v, flags, 0, 30)
	if v == 5 {
		if props == nil {
			props = propsBlock()
		}
		b = append(b, props...)
	}
	b = append(b, mqttString(id)...)
	if will != nil {
		b = append(append(append(b, will...), mqttString("w")...), mqttString("x")...)
	}
	return testutil.MQTTFrame(packets.Connect<<4, b)
}

// subscribeFrame is a SUBSCRIBE with packet id 1 of one filter with the
// options byte opts; props is its properties block (MQTT 5 only).
func subscribeFrame(v byte, props []byte, filter string, opts byte) []byte {
	b := []byte{0, 1}
	if v == 5 {
		if props == nil {
			props = propsBlock()
		}
		b = append(b, props...)
	}
	b = append(append(b, mqttString(filter)...), opts)
	return testutil.MQTTFrame(packets.Subscribe<<4|0x02, b)
}

// publishFrame is a QoS 1 PUBLISH with packet id 7 to topic, with the MQTT
// 5 properties block props.
func publishFrame(topic string, props []byte) []byte {
	b := append(append(mqttString(topic), 0, 7), props...)
	return testutil.MQTTFrame(packets.Publish<<4|0x02, append(b, "payload"...))
}

// refusedWith reads until the server closes r: anything but a DISCONNECT
// (or, before the CONNACK, a refusing CONNACK) fails the test. It returns
// the reason code of the CONNACK or DISCONNECT, 0 when the connection just
// closed.
func refusedWith(t *testing.T, r *raw) byte {
	t.Helper()
	var code byte
	for {
		pk, err := r.read(5 * time.Second)
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				t.Fatal("the connection was not closed")
			}
			return code
		}
		switch typ := pk.FixedHeader.Type; {
		case typ == packets.Disconnect, typ == packets.Connack && pk.ReasonCode >= 0x80:
			code = pk.ReasonCode
		default:
			t.Fatalf("got packet type %d (reason %#x) from a refused packet, want the connection closed", typ, pk.ReasonCode)
		}
	}
}

// bystander connects a client that must outlive every refusal of a test:
// check pings it.
func bystander(t *testing.T, s *Server) (check func()) {
	t.Helper()
	b := dialRaw(t, s.Addr(), 5)
	b.connect("bystander", true, nil)
	return func() {
		t.Helper()
		b.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
		b.expect(packets.Pingresp)
	}
}

// connected dials s and connects client id with protocol version v.
func connected(t *testing.T, s *Server, v byte, id string) *raw {
	t.Helper()
	r := dialRaw(t, s.Addr(), v)
	if ack := r.connect(id, true, nil); ack.ReasonCode != 0 {
		t.Fatalf("CONNACK %#x", ack.ReasonCode)
	}
	return r
}

// MQTT 5 section 2.2.2.2 and each property's definition: "It is a Protocol
// Error to include X more than once", for every property but User Property
// (and Subscription Identifier in a server's PUBLISH). mochi keeps the last
// one; the connection that sent it ends with 0x82 instead.
func TestMQTT_2_2_2_2_PropertyMoreThanOnceIsAProtocolError(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	alive := bystander(t, s)
	connects := []struct {
		name        string
		props, will []byte
	}{
		{"CONNECT Session Expiry Interval", propsBlock(propU32Of(0x11, 10), propU32Of(0x11, 20)), nil},
		{"CONNECT Receive Maximum", propsBlock(propU16Of(0x21, 10), propU16Of(0x21, 10)), nil},
		{"CONNECT Topic Alias Maximum", propsBlock(propU16Of(0x22, 1), propU32Of(0x27, 1000), propU16Of(0x22, 2)), nil},
		{"will Will Delay Interval", nil, propsBlock(propU32Of(0x18, 1), propU32Of(0x18, 1))},
		{"will Content Type", nil, propsBlock(propStrOf(0x03, "a"), propStrOf(0x03, "b"))},
	}
	for _, tc := range connects {
		t.Run(tc.name, func(t *testing.T) {
			c := dialRaw(t, s.Addr(), 5)
			c.send(connectFrame(5, "dup", tc.props, tc.will))
			if code := refusedWith(t, c); code != packets.ErrProtocolViolation.Code {
				t.Fatalf("CONNACK %#x, want 0x82", code)
			}
			alive()
		})
	}
	after := []struct {
		name  string
		frame []byte
	}{
		{"PUBLISH Message Expiry Interval", publishFrame("dup/t", propsBlock(propU32Of(0x02, 5), propU32Of(0x02, 5)))},
		{"PUBLISH Topic Alias", publishFrame("dup/t", propsBlock(propU16Of(0x23, 1), propU16Of(0x23, 2)))},
		{"PUBLISH Response Topic", publishFrame("dup/t", propsBlock(propStrOf(0x08, "r"), propPairOf("k", "v"), propStrOf(0x08, "r")))},
		{"SUBSCRIBE Subscription Identifier", subscribeFrame(5, propsBlock(propVarOf(0x0B, 1), propVarOf(0x0B, 2)), "dup/#", 1)},
		{"PUBACK Reason String", testutil.MQTTFrame(packets.Puback<<4, append([]byte{0, 1, 0}, propsBlock(propStrOf(0x1F, "a"), propStrOf(0x1F, "b"))...))},
	}
	for _, tc := range after {
		t.Run(tc.name, func(t *testing.T) {
			c := connected(t, s, 5, "dup")
			c.send(tc.frame)
			if code := refusedWith(t, c); code != packets.ErrProtocolViolation.Code {
				t.Fatalf("DISCONNECT %#x, want 0x82", code)
			}
			alive()
		})
	}
	t.Run("User Property repeats", func(t *testing.T) {
		c := connected(t, s, 5, "dup")
		c.send(publishFrame("dup/t", propsBlock(propPairOf("k", "1"), propPairOf("k", "2"))))
		if ack := c.expect(packets.Puback); ack.PacketID != 7 || ack.ReasonCode != 0 {
			t.Fatalf("PUBACK %+v", ack)
		}
	})
}

// MQTT 5 section 3.1.2.11.3: "It is a Protocol Error to include the Receive
// Maximum value more than once or for it to have the value 0." mochi reads
// 0 as absent (65,535).
func TestMQTT_3_1_2_11_3_ReceiveMaximumZeroIsAProtocolError(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	alive := bystander(t, s)
	c := dialRaw(t, s.Addr(), 5)
	c.send(connectFrame(5, "rm0", propsBlock(propU16Of(0x21, 0)), nil))
	if code := refusedWith(t, c); code != packets.ErrProtocolViolation.Code {
		t.Fatalf("CONNACK %#x, want 0x82", code)
	}
	alive()
	ok := dialRaw(t, s.Addr(), 5)
	ok.send(connectFrame(5, "rm0", propsBlock(propU16Of(0x21, 1)), nil))
	if ack := ok.expect(packets.Connack); ack.ReasonCode != 0 {
		t.Fatalf("Receive Maximum 1: CONNACK %#x", ack.ReasonCode)
	}
}

// MQTT 5 section 3.1.2.11.4: "It is a Protocol Error to include the Maximum
// Packet Size more than once, or for the value to be set to zero." mochi
// reads 0 as "no limit".
func TestMQTT_3_1_2_11_4_MaximumPacketSizeZeroIsAProtocolError(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	alive := bystander(t, s)
	c := dialRaw(t, s.Addr(), 5)
	c.send(connectFrame(5, "mps0", propsBlock(propU32Of(0x27, 0)), nil))
	if code := refusedWith(t, c); code != packets.ErrProtocolViolation.Code {
		t.Fatalf("CONNACK %#x, want 0x82", code)
	}
	alive()
}

// MQTT 5 section 3.8.2.1.2: "It is a Protocol Error if the Subscription
// Identifier has a value of 0." mochi takes it as "no identifier".
func TestMQTT_3_8_2_1_2_SubscriptionIdentifierZeroIsAProtocolError(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	alive := bystander(t, s)
	c := connected(t, s, 5, "sid0")
	c.send(subscribeFrame(5, propsBlock(propVarOf(0x0B, 0)), "sid/#", 1))
	if code := refusedWith(t, c); code != packets.ErrProtocolViolation.Code {
		t.Fatalf("DISCONNECT %#x, want 0x82", code)
	}
	alive()
	ok := connected(t, s, 5, "sid1")
	ok.send(subscribeFrame(5, propsBlock(propVarOf(0x0B, 1)), "sid/#", 1))
	if sa := ok.expect(packets.Suback); len(sa.ReasonCodes) != 1 || sa.ReasonCodes[0] != 1 {
		t.Fatalf("Subscription Identifier 1: SUBACK %+v", sa.ReasonCodes)
	}
}

// [MQTT-3.3.4-6]: "A PUBLISH packet sent from a Client to a Server MUST NOT
// contain a Subscription Identifier." mochi passes it on to subscribers.
func TestMQTT_3_3_4_6_ClientPublishWithSubscriptionIdentifierIsAProtocolError(t *testing.T) {
	s, log := testServer(t, nil, nil)
	alive := bystander(t, s)
	c := connected(t, s, 5, "pubsid")
	c.send(publishFrame("sid/t", propsBlock(propVarOf(0x0B, 3))))
	if code := refusedWith(t, c); code != packets.ErrProtocolViolation.Code {
		t.Fatalf("DISCONNECT %#x, want 0x82", code)
	}
	alive()
	log.mu.Lock()
	n := len(log.recs)
	log.mu.Unlock()
	if n != 0 {
		t.Fatalf("%d records logged from a refused PUBLISH", n)
	}
}

// [MQTT-3.8.3-5] (MQTT 5): "The Server MUST treat a SUBSCRIBE packet as
// malformed if any of Reserved bits in the Payload are non-zero" (bits 6
// and 7 of the options byte, which mochi drops); [MQTT-3-8.3-4] (3.1.1):
// "…as malformed and close the Network Connection if any of Reserved bits
// in the payload are non-zero, or QoS is not 0,1 or 2" (bits 2-7). And MQTT
// 5 section 3.8.3.1: "It is a Protocol Error to send a Retain Handling
// value of 3."
func TestMQTT_3_8_3_5_SubscribeOptionsReservedBitsAreMalformed(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	alive := bystander(t, s)
	cases := []struct {
		name string
		v    byte
		opts byte
		want byte // 0: closed without a DISCONNECT (3.1.1)
	}{
		{"5 bit 6", 5, 0x41, packets.ErrMalformedPacket.Code},
		{"5 bit 7", 5, 0x81, packets.ErrMalformedPacket.Code},
		{"5 QoS 3", 5, 0x03, packets.ErrMalformedPacket.Code},
		{"5 Retain Handling 3", 5, 0x31, packets.ErrProtocolViolation.Code},
		{"3.1.1 bit 2", 4, 0x05, 0},
		{"3.1.1 bit 7", 4, 0x81, 0},
		{"3.1.1 QoS 3", 4, 0x03, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := connected(t, s, tc.v, "opts")
			c.send(subscribeFrame(tc.v, nil, "opts/#", tc.opts))
			if code := refusedWith(t, c); code != tc.want {
				t.Fatalf("options %#02x: DISCONNECT %#x, want %#x", tc.opts, code, tc.want)
			}
			alive()
		})
	}
	// Every option an MQTT 5 client may set is still taken.
	c := connected(t, s, 5, "opts")
	c.send(subscribeFrame(5, nil, "opts/#", 0x2E)) // QoS 2, no local, RAP, Retain Handling 2
	if sa := c.expect(packets.Suback); len(sa.ReasonCodes) != 1 || sa.ReasonCodes[0] != 2 {
		t.Fatalf("valid options: SUBACK %+v", sa.ReasonCodes)
	}
}

// publishCheck answers every PUBLISH as mochi's PublishValidate does,
// which it replaces on the hot path: the same code, checked in the same
// order, whatever the topic bytes (wildcards beside multi-byte and invalid
// UTF-8 included).
func TestPublishCheckAnswersAsMochisPublishValidate(t *testing.T) {
	topics := []string{"", "a", "a/b", "bench/12", "+", "#", "a/+/b", "a/#", "s/é+", "s/\xff#", "\xe2\x82+", "日本/語", "x+y#z"}
	for _, topic := range topics {
		for _, qos := range []byte{0, 1, 2} {
			for _, pid := range []uint16{0, 7} {
				for _, alias := range []uint16{0, 1, 9} {
					for _, flag := range []bool{false, true} {
						for _, subIDs := range [][]int{nil, {3}} {
							pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: qos}, TopicName: topic, PacketID: pid}
							pk.Properties.TopicAlias, pk.Properties.TopicAliasFlag = alias, flag
							pk.Properties.SubscriptionIdentifier = subIDs
							if got, want := publishCheck(&pk, 5), pk.PublishValidate(5); got != want {
								t.Errorf("topic %q qos %d pid %d alias %d flag %v subids %v: %v, mochi %v", topic, qos, pid, alias, flag, subIDs, got, want)
							}
						}
					}
				}
			}
		}
	}
}
