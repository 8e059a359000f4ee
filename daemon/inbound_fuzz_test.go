package daemon

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/testutil"
	"github.com/tandem-edge/tandem/storage"
)

// ---------------------------------------------------------------------------
// Fuzzing the inbound path.

// FuzzInboundStream feeds arbitrary bytes to a gateway as a client's
// stream, then checks that another client is served (a publish and its
// PUBACK) and that the log still decodes. One gateway serves every input of
// a fuzzing process.
func FuzzInboundStream(f *testing.F) {
	d, _ := startGateway(f, func(c *config.Config) {
		c.MQTT.ConnectRate = 1e9 // the fuzzer connects far faster than any device
		c.MQTT.ConnectBurst = 1 << 30
		c.MQTT.MaxPacketSize = 64 << 10
		c.MQTT.MaxTopicLevels = 8
	})
	for _, seed := range fuzzSeeds() {
		f.Add(seed)
	}
	var mu sync.Mutex // guards next and n: the fuzzer may run inputs in parallel
	next, n := uint64(1), 0
	f.Fuzz(func(t *testing.T, data []byte) {
		conn, err := net.DialTimeout("tcp", d.MQTTAddr(), 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		conn.SetDeadline(time.Now().Add(5 * time.Second))
		conn.Write(data)
		// EOF after the input: the gateway reads all of it, then hangs up.
		conn.(*net.TCPConn).CloseWrite()
		io.Copy(io.Discard, conn)
		conn.Close()

		mu.Lock()
		n++
		id := fmt.Sprintf("fuzz-check-%d", n)
		mu.Unlock()
		c, _ := dialVersion(t, d.MQTTAddr(), id, true, 4)
		c.pub("fuzz/check", 1, false, 1, nil, id)
		c.expect(0x40, 1)
		c.Close()
		if err := d.Err(); err != nil {
			t.Fatalf("the node failed: %v", err)
		}
		mu.Lock()
		defer mu.Unlock()
		from := next
		err = d.db.Scan(from, func(e pbEntry) bool {
			if e.Type == 0 && len(e.Data) > 0 {
				if _, derr := storage.DecodeRecord(e.Data); derr != nil {
					t.Errorf("entry %d: %v", e.Index, derr)
					return false
				}
			}
			next = e.Index + 1
			return true
		})
		if err != nil {
			t.Fatal(err)
		}
	})
}

// fuzzSeeds are client streams worth mutating: valid sessions of both
// protocol versions and the usual kinds of malformation.
func fuzzSeeds() [][]byte {
	frame := testutil.MQTTFrame
	v3 := frame(0x10, connectBody(connOpts{version: 4, id: "f3", keepAlive: 30}))
	v5 := frame(0x10, connectBody(connOpts{version: 5, id: "f5", keepAlive: 30}))
	will := frame(0x10, connectBody(connOpts{version: 4, id: "fw", keepAlive: 30, willTopic: "fuzz/will"}))
	pub3 := frame(0x32, append(appendMQTTString(nil, "fuzz/a"), 0, 1, 'x'))
	pub5 := frame(0x34, append(appendMQTTString(nil, "fuzz/b"), 0, 2, 3, 0x23, 0, 1, 'y')) // QoS 2, topic alias 1
	alias := frame(0x32, append(appendMQTTString(nil, ""), 0, 3, 3, 0x23, 0, 1, 'z'))
	pubrel := frame(0x62, []byte{0, 2, 0, 0})
	sub3 := frame(0x82, append(appendMQTTString([]byte{0, 4}, "fuzz/#"), 1))
	sub5 := frame(0x82, append(appendMQTTString([]byte{0, 5, 0}, "$share/g/fuzz/#"), 2))
	unsub := frame(0xa2, appendMQTTString([]byte{0, 6}, "fuzz/#"))
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	return [][]byte{
		cat(v3, pub3, sub3, unsub, []byte{0xc0, 0}, []byte{0xe0, 0}),
		cat(v5, pub5, pubrel, alias, sub5, []byte{0xe0, 0}),
		cat(will, pub3),
		cat(v3, pub3, pub3), // same packet id twice
		cat(v3, []byte{0x32, 0xff, 0xff, 0xff, 0x7f}),     // remaining length at the maximum
		cat(v3, []byte{0x30 | 6, 0x05, 0xff, 0xff, 1, 2}), // QoS 3, topic past the end
		cat(v3, v3), // a second CONNECT
		pub3,        // PUBLISH before CONNECT
		[]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
		{0x10, 0x80, 0x80, 0x80, 0x80, 0x01}, // a length of five bytes
		{},
	}
}
