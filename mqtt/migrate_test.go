package mqtt

import (
	"testing"

	"github.com/mochi-mqtt/server/v2/packets"
)

// A data dir written by the builds on mochi's Server is converted at the
// first start: the persistent session, its subscription, the message it
// had in flight and the retained message all come back, and the old keys
// are gone.
func TestSessionsOfTheMochiBuildsAreConverted(t *testing.T) {
	log := newMemLog()
	st := log.store
	st.Put("c\x00old-dev", []byte(`{"id":"old-dev","t":"client","username":null,"protocolVersion":4,"clean":false,"properties":{}}`))
	st.Put("s\x00old-dev\x00plant/#", []byte(`{"t":"subscription","id":"s\u0000old-dev\u0000plant/#","client":"old-dev","filter":"plant/#","qos":1}`))
	st.Put("i\x00old-dev\x007", []byte(`{"properties":{},"payload":"aW4gZmxpZ2h0","t":"inflight","client":"old-dev","origin":"sensor","fixedheader":{"remaining":0,"type":3,"qos":1,"dup":false,"retain":false},"topic_name":"plant/a","created":1700000000,"packet_id":7}`))
	st.Put("r\x00plant/state", []byte(`{"properties":{"user":[{"k":"unit","v":"C"}]},"payload":"b24=","t":"retained","origin":"sensor","topic_name":"plant/state","fixedheader":{"remaining":0,"type":3,"qos":1,"dup":false,"retain":true},"created":1700000000}`))
	s, _ := testServer(t, log, nil)
	for _, k := range []string{"c\x00old-dev", "s\x00old-dev\x00plant/#", "i\x00old-dev\x007", "r\x00plant/state"} {
		if _, ok := st.m[k]; ok {
			t.Errorf("old key %q left", k)
		}
	}
	c := dialRaw(t, s.Addr(), 4)
	if ack := c.connect("old-dev", false, nil); !ack.SessionPresent {
		t.Fatal("the converted session is not present")
	}
	p := c.expect(packets.Publish)
	if p.PacketID != 7 || string(p.Payload) != "in flight" || !p.FixedHeader.Dup {
		t.Fatalf("the in-flight message: %+v", p)
	}
	c.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: 7})
	pub := dialRaw(t, s.Addr(), 4)
	pub.connect("pub", true, nil)
	pub.publish("plant/b", 1, 1, "new")
	pub.expect(packets.Puback)
	if p := c.expect(packets.Publish); string(p.Payload) != "new" {
		t.Fatalf("the converted subscription: %q", p.Payload)
	}
	r := dialRaw(t, s.Addr(), 5)
	r.connect("reader", true, nil)
	r.subscribe(1, packets.Subscription{Filter: "plant/state", Qos: 1})
	if p := r.expect(packets.Publish); string(p.Payload) != "on" || !p.FixedHeader.Retain || len(p.Properties.User) != 1 {
		t.Fatalf("the converted retained message: %+v", p)
	}
}
