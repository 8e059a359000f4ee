package mqtt

import (
	"bytes"
	"io"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
)

// BenchmarkAckPathWindow1 is W1's path for one client on the in-memory
// log: a QoS 1 PUBLISH of 100 B, then its PUBACK, one at a time. Beside
// ns/op (a round trip, mostly the kernel's) it reports the process's CPU
// per publish (cpu-ns/op), which the client's share only adds a constant
// to: the client encodes nothing and allocates nothing in the loop.
func BenchmarkAckPathWindow1(b *testing.B) {
	s, _ := testServer(b, nil, nil)
	c, err := net.DialTimeout("tcp", s.Addr(), 5*time.Second)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	var buf bytes.Buffer
	conn := packets.Packet{ProtocolVersion: 5, FixedHeader: packets.FixedHeader{Type: packets.Connect},
		Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), ClientIdentifier: "bench", Clean: true, Keepalive: 30}}
	if err := conn.ConnectEncode(&buf); err != nil {
		b.Fatal(err)
	}
	if _, err := c.Write(buf.Bytes()); err != nil {
		b.Fatal(err)
	}
	in := make([]byte, 512)
	if _, err := c.Read(in); err != nil { // the CONNACK
		b.Fatal(err)
	}
	buf.Reset()
	pub := packets.Packet{ProtocolVersion: 5, FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1},
		TopicName: "bench/w1", PacketID: 1, Payload: make([]byte, 100)}
	if err := pub.PublishEncode(&buf); err != nil {
		b.Fatal(err)
	}
	frame := buf.Bytes()
	pidAt := len(frame) - 100 - 1 - 2 // the packet id, before the properties' length (0) and the payload
	var ru0, ru1 syscall.Rusage
	b.ReportAllocs()
	b.ResetTimer()
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru0)
	for i := 0; i < b.N; i++ {
		pid := uint16(i%65535 + 1)
		frame[pidAt], frame[pidAt+1] = byte(pid>>8), byte(pid)
		if _, err := c.Write(frame); err != nil {
			b.Fatal(err)
		}
		// A v5 PUBACK with reason Success and no properties is 4 bytes.
		if _, err := io.ReadFull(c, in[:4]); err != nil {
			b.Fatal(err)
		}
		if in[0] != packets.Puback<<4 || in[2] != byte(pid>>8) || in[3] != byte(pid) {
			b.Fatalf("got % x, want the PUBACK of %d", in[:4], pid)
		}
	}
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru1)
	b.StopTimer()
	cpu := time.Duration(syscall.TimevalToNsec(ru1.Utime) - syscall.TimevalToNsec(ru0.Utime) + syscall.TimevalToNsec(ru1.Stime) - syscall.TimevalToNsec(ru0.Stime))
	b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/op")
}
