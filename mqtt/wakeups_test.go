package mqtt

import (
	"fmt"
	"testing"

	"github.com/mochi-mqtt/server/v2/packets"
)

// A QoS 0 message published once the subscriber has its SUBACK reaches
// it: the subscription is in place, and the client reads everything it is
// sent. The retained messages a SUBSCRIBE is owed (an entry even when
// none matched) were recorded after the SUBACK was queued; a SUBACK
// written before that (at once by the read loop, inline writes, or by a
// writer goroutine that ran first) left a window in which an offer found
// the session owing, was left to the log's replay, which does not read
// QoS 0 back, and was dropped: CI's TestMQTT_3_3_4_3 with the RawConn read
// loop and inline writes on. Each round subscribes a new filter and
// publishes to it at once; a QoS 1 message after it marks where the QoS 0
// one should have come.
func TestQoS0PublishedRightAfterSubackIsDelivered(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	s.rawReads.Store(true)
	s.inlineWrites.Store(true)
	sub := dialRaw(t, s.Addr(), 5)
	sub.connect("after-suback", true, nil)
	pub := dialRaw(t, s.Addr(), 5)
	pub.connect("after-suback-pub", true, nil)
	for i := 0; i < 200; i++ {
		topic := fmt.Sprintf("as/%d", i)
		if ack := sub.subscribe(1, packets.Subscription{Filter: topic, Qos: 1}); ack.ReasonCodes[0] != 1 {
			t.Fatalf("round %d: SUBACK %#x", i, ack.ReasonCodes[0])
		}
		pub.publish(topic, 0, 0, "qos0")
		pub.publish(topic, 1, 1, "marker")
		pub.expect(packets.Puback)
		p := sub.expect(packets.Publish)
		if string(p.Payload) != "qos0" {
			t.Fatalf("round %d: got %q first: the QoS 0 message published after the SUBACK was dropped (%d dropped)", i, p.Payload, s.QoS0Dropped())
		}
		m := sub.expect(packets.Publish)
		if string(m.Payload) != "marker" {
			t.Fatalf("round %d: got %q, want the marker", i, m.Payload)
		}
		sub.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: m.PacketID})
		sub.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Unsubscribe, Qos: 1}, PacketID: 2, Filters: packets.Subscriptions{{Filter: topic}}})
		sub.expect(packets.Unsuback)
	}
}
