package mqtt

import (
	"bytes"
	"fmt"
	"testing"

	"github.com/mochi-mqtt/server/v2/packets"
)

// loggedPayloads returns the payloads of the records on topic, in log
// order.
func loggedPayloads(l *memLog, topic string) [][]byte {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out [][]byte
	for _, m := range l.recs {
		if m.Topic == topic {
			out = append(out, m.Payload)
		}
	}
	return out
}

// A client that writes many publishes at once, more than one read takes
// and, for 3.1.1, more than max_inflight (so the read loop stops for acks
// in the middle of what it read), has every one acked in order and logged
// in order, intact.
func TestManyPacketsInOneWriteAreAllDecoded(t *testing.T) {
	for _, v := range []byte{4, 5} {
		t.Run(fmt.Sprintf("v%d", v), func(t *testing.T) {
			s, log := testServer(t, nil, nil)
			n := 1000
			if v == 4 {
				n = 2500 // past max_inflight 1024: back-pressure
			}
			r := dialRaw(t, s.Addr(), v)
			if ack := r.connect("many", true, nil); ack.ReasonCode != 0 {
				t.Fatalf("CONNACK %#x", ack.ReasonCode)
			}
			var all bytes.Buffer
			for i := 1; i <= n; i++ {
				pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1}, TopicName: "many",
					PacketID: uint16(i), Payload: fmt.Appendf(nil, "m%05d", i), ProtocolVersion: v}
				if err := pk.PublishEncode(&all); err != nil {
					t.Fatal(err)
				}
			}
			if all.Len() <= readBufSize {
				t.Fatalf("%d bytes fit one read", all.Len())
			}
			go func() { _, _ = r.c.Write(all.Bytes()) }() // the acks must be read meanwhile
			for i := 1; i <= n; i++ {
				if ack := r.expect(packets.Puback); ack.PacketID != uint16(i) || ack.ReasonCode != 0 {
					t.Fatalf("PUBACK %d: id %d reason %#x", i, ack.PacketID, ack.ReasonCode)
				}
			}
			got := loggedPayloads(log, "many")
			if len(got) != n {
				t.Fatalf("%d records logged, want %d", len(got), n)
			}
			for i, p := range got {
				if want := fmt.Sprintf("m%05d", i+1); string(p) != want {
					t.Fatalf("record %d is %q, want %q", i, p, want)
				}
			}
		})
	}
}

// A publish written a byte at a time, and one of 1 MB, each come through
// whole: acked, logged with every byte, delivered to a subscriber.
func TestPublishesSplitOrLargeAreDecodedWhole(t *testing.T) {
	s, log := testServer(t, nil, nil)
	sub := connected(t, s, 5, "sub")
	sub.subscribe(1, packets.Subscription{Filter: "big/#", Qos: 1})
	pub := connected(t, s, 5, "pub")
	large := make([]byte, 1_000_000)
	for i := range large {
		large[i] = byte(i * 7)
	}
	cases := []struct {
		topic   string
		payload []byte
		step    int // bytes per write
	}{
		{"big/bytewise", []byte("one byte at a time"), 1},
		{"big/1MB", large, 1 << 20},
		{"big/1MB-in-pieces", large, 1000},
	}
	for i, tc := range cases {
		pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1}, TopicName: tc.topic,
			PacketID: uint16(i + 1), Payload: tc.payload, ProtocolVersion: 5}
		var b bytes.Buffer
		if err := pk.PublishEncode(&b); err != nil {
			t.Fatal(err)
		}
		go func() {
			for p := b.Bytes(); len(p) > 0; p = p[min(tc.step, len(p)):] {
				if _, err := pub.c.Write(p[:min(tc.step, len(p))]); err != nil {
					return
				}
			}
		}()
		if ack := pub.expect(packets.Puback); ack.PacketID != uint16(i+1) || ack.ReasonCode != 0 {
			t.Fatalf("%s: PUBACK id %d reason %#x", tc.topic, ack.PacketID, ack.ReasonCode)
		}
		if got := loggedPayloads(log, tc.topic); len(got) != 1 || !bytes.Equal(got[0], tc.payload) {
			t.Fatalf("%s: logged %d records, not the payload sent", tc.topic, len(got))
		}
		d := sub.expect(packets.Publish)
		if d.TopicName != tc.topic || !bytes.Equal(d.Payload, tc.payload) {
			t.Fatalf("%s: delivered %q with %d bytes, not the payload sent", tc.topic, d.TopicName, len(d.Payload))
		}
		sub.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: d.PacketID})
	}
}
