//go:build linux

package mqtt

import (
	"bytes"
	"errors"
	"fmt"
	"syscall"
	"testing"

	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// rawStream is a client's bytes after CONNECT: packets of every header
// length (a Remaining Length of 1, 2 and 3 bytes), one larger than a read
// buffer. want names them in order.
func rawStream() (stream []byte, want []string) {
	add := func(frame []byte, name string) {
		stream = append(stream, frame...)
		want = append(want, name)
	}
	pub := func(topic string, pid byte, payload []byte) []byte {
		b := append(append(mqttString(topic), 0, pid), 0) // no properties
		return testutil.MQTTFrame(packets.Publish<<4|0x02, append(b, payload...))
	}
	add(pub("a", 1, []byte("x")), "publish a 1")
	add(pub("b", 2, bytes.Repeat([]byte("y"), 300)), "publish b 300")
	add(subscribeFrame(5, nil, "s/#", 1), "subscribe s/#")
	add(testutil.MQTTFrame(packets.Pingreq<<4, nil), "pingreq")
	add(pub("c", 3, bytes.Repeat([]byte("z"), 3*readBufSize+17)), fmt.Sprintf("publish c %d", 3*readBufSize+17))
	add(testutil.MQTTFrame(packets.Pingreq<<4, nil), "pingreq")
	return stream, want
}

func packetName(pk *packets.Packet) string {
	switch pk.FixedHeader.Type {
	case packets.Publish:
		for _, b := range pk.Payload {
			if b != pk.Payload[0] {
				return "publish with a corrupt payload"
			}
		}
		return fmt.Sprintf("publish %s %d", pk.TopicName, len(pk.Payload))
	case packets.Subscribe:
		return "subscribe " + pk.Filters[0].Filter
	case packets.Pingreq:
		return "pingreq"
	}
	return fmt.Sprintf("packet type %d", pk.FixedHeader.Type)
}

// readRawSplit writes stream to a socket in pieces of chunk bytes and reads
// the other end as loopRaw does after each piece: fill and next until a
// short read or EAGAIN, then park. It returns the packets' names, and the
// first error.
func readRawSplit(t *testing.T, stream []byte, chunk int) ([]string, error) {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_NONBLOCK, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(fds[0])
	defer syscall.Close(fds[1])
	c := &conn{srv: &Server{cfg: Config{MaxPacketSize: 1 << 20}}, v: 5, authed: true}
	defer c.in.drop()
	var got []string
	var pk packets.Packet
	for off := 0; off < len(stream); off += chunk {
		piece := stream[off:min(off+chunk, len(stream))]
		if n, err := syscall.Write(fds[1], piece); err != nil || n != len(piece) {
			t.Fatalf("write: %d %v", n, err)
		}
		for {
			n, err := c.in.fill(fds[0])
			if err == syscall.EAGAIN {
				c.in.park()
				break
			}
			if err != nil || n == 0 {
				t.Fatalf("read: %d %v", n, err)
			}
			for {
				ok, err := c.next(&pk)
				if err != nil {
					return got, err
				}
				if !ok {
					break
				}
				got = append(got, packetName(&pk))
			}
		}
	}
	return got, nil
}

// Packets cut anywhere by the network, down to a byte per segment, a
// header cut inside its Remaining Length included, decode as sent; so do
// many packets that come in one read, and a packet larger than the read
// buffer.
func TestReadRawDecodesPacketsCutAnywhere(t *testing.T) {
	stream, want := rawStream()
	for _, chunk := range []int{1, 2, 3, 5, 7, 64, 301, readBufSize - 1, readBufSize, len(stream)} {
		got, err := readRawSplit(t, stream, chunk)
		if err != nil {
			t.Fatalf("pieces of %d bytes: %v", chunk, err)
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("pieces of %d bytes: got %q, want %q", chunk, got, want)
		}
	}
}

// MQTT 5 section 1.5.5: a Variable Byte Integer takes at most four bytes.
// A fifth is a Malformed Packet however the bytes come.
func TestMQTT_1_5_5_RemainingLengthOfFiveBytesIsMalformedInAnyPieces(t *testing.T) {
	stream := []byte{packets.Pingreq << 4, 0, packets.Publish << 4, 0x80, 0x80, 0x80, 0x80, 0x01}
	for _, chunk := range []int{1, 2, 3, len(stream)} {
		got, err := readRawSplit(t, stream, chunk)
		var pe errProtocol
		if !errors.As(err, &pe) || pe.code != packets.ErrMalformedPacket {
			t.Fatalf("pieces of %d bytes: error %v, want a malformed packet", chunk, err)
		}
		if fmt.Sprint(got) != "[pingreq]" {
			t.Fatalf("pieces of %d bytes: got %q before it, want the PINGREQ", chunk, got)
		}
	}
}
