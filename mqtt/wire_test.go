package mqtt

import (
	"reflect"
	"testing"

	"github.com/mochi-mqtt/server/v2/packets"
)

// publishBody is a PUBLISH's bytes after the fixed header: topic, packet
// id (QoS > 0), properties (MQTT 5, nil for none), payload.
func publishBody(topic string, qos byte, props []byte, payload string) []byte {
	b := mqttString(topic)
	if qos > 0 {
		b = append(b, 0x12, 0x34)
	}
	return append(append(b, props...), payload...)
}

// TestCheckWirePlainPublishAgreesWithTheWalk: the fast path takes a
// PUBLISH only when the full walk would find nothing wrong, and leaves
// every publish with properties (good or bad), or cut short, to the walk.
func TestCheckWirePlainPublishAgreesWithTheWalk(t *testing.T) {
	bodies := [][]byte{
		publishBody("a/b", 1, propsBlock(), "x"),
		publishBody("a/b", 0, propsBlock(), "x"),
		publishBody("a/b", 2, propsBlock(), ""),
		publishBody("", 1, propsBlock(propU16Of(0x23, 1)), "x"),
		publishBody("a", 1, propsBlock(propByteOf(0x01, 1), propByteOf(0x01, 1)), "x"), // twice
		publishBody("a", 1, propsBlock(propVarOf(0x0B, 3)), "x"),                       // subscription id
		publishBody("a", 1, []byte{5, 0x01}, ""),                                       // past the end
		publishBody("a", 1, []byte{0x80}, ""),                                          // varint cut short
		{0, 5, 'a'},                                                                    // topic past the end
		{0},                                                                            // length cut short
		{0, 1, 'a', 0x12},                                                              // packet id cut short
	}
	for _, v := range []byte{4, 5} {
		for qos := byte(0); qos <= 2; qos++ {
			for i, body := range bodies {
				pk := packets.Packet{ProtocolVersion: v, FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: qos}}
				if plainPublish(&pk, body, v == 5) && walkWire(&pk, body, v == 5) != nil {
					t.Errorf("v%d QoS %d body %d: the fast path passed what the walk refuses: %v", v, qos, i, walkWire(&pk, body, v == 5).why)
				}
				if got, want := checkWire(&pk, body), walkWire(&pk, body, v == 5); (got == nil) != (want == nil) {
					t.Errorf("v%d QoS %d body %d: checkWire %v, the walk %v", v, qos, i, got, want)
				}
			}
		}
	}
	pk := packets.Packet{ProtocolVersion: 5, FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1}}
	if !plainPublish(&pk, bodies[0], true) {
		t.Error("a QoS 1 publish with no properties is not taken by the fast path")
	}
}

// BenchmarkCheckWirePublish is checkWire on the publish every device
// sends: MQTT 5, QoS 1, no properties.
func BenchmarkCheckWirePublish(b *testing.B) {
	body := publishBody("bench/W1/7", 1, propsBlock(), string(make([]byte, 100)))
	pk := packets.Packet{ProtocolVersion: 5, FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1}}
	b.ReportAllocs()
	for b.Loop() {
		if e := checkWire(&pk, body); e != nil {
			b.Fatal(e.why)
		}
	}
}

// TestDecodePlainPublishAsMochiDoes: a publish the fast path takes decodes
// to the packet mochi's decoder makes of it, and a topic mochi refuses
// (not UTF-8, a NUL) is refused too.
func TestDecodePlainPublishAsMochiDoes(t *testing.T) {
	cases := []struct{ topic, payload string }{
		{"a/b", "payload"}, {"a/b", ""}, {"x", "\x00\x01"}, {"é/ü", "p"}, {"bad\xff", "p"}, {"nul\x00", "p"},
	}
	for _, v := range []byte{4, 5} {
		var props []byte
		if v == 5 {
			props = propsBlock()
		}
		for qos := byte(0); qos <= 2; qos++ {
			for _, c := range cases {
				body := publishBody(c.topic, qos, props, c.payload)
				want := packets.Packet{ProtocolVersion: v, FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: qos, Remaining: len(body)}}
				got := want
				if !plainPublish(&got, body, v == 5) {
					t.Fatalf("v%d QoS %d %q: not taken by the fast path", v, qos, c.topic)
				}
				errWant, errGot := decode(&want, body), decodePlainPublish(&got, body)
				if (errWant == nil) != (errGot == nil) {
					t.Errorf("v%d QoS %d %q: mochi %v, the fast path %v", v, qos, c.topic, errWant, errGot)
					continue
				}
				if errWant == nil && !reflect.DeepEqual(want, got) {
					t.Errorf("v%d QoS %d %q: mochi decoded\n%+v\nthe fast path\n%+v", v, qos, c.topic, want, got)
				}
			}
		}
	}
}
