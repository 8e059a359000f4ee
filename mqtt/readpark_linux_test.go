//go:build linux

package mqtt

import (
	"errors"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// parkedConns is how many of s's connections wait in its idler.
func parkedConns(s *Server) int {
	d := s.idle.Load()
	if d == nil {
		return 0
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.byFD)
}

// Connections idle since CONNECT wait in the idler, without a goroutine,
// and are served as before when they send: a publish is acked, a
// take-over ends the old one with 0x8E, a client that closes its socket
// goes offline.
func TestParkedConnectionsAreServed(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	s.parkIdle.Store(true)
	s.rawReads.Store(true)
	const n = 20
	devs := make([]*raw, n)
	for i := range devs {
		devs[i] = connected(t, s, 5, fmt.Sprintf("dev-%d", i))
	}
	testutil.WaitFor(t, 5*time.Second, "every connection parked", func() bool { return parkedConns(s) == n })
	for i, d := range devs[:n-2] {
		d.publish("park/t", 1, uint16(i+1), "p")
		if ack := d.expect(packets.Puback); ack.PacketID != uint16(i+1) || ack.ReasonCode != 0 {
			t.Fatalf("dev-%d: PUBACK %d %#x", i, ack.PacketID, ack.ReasonCode)
		}
	}
	again := connected(t, s, 5, "dev-0")
	if code, ok := devs[0].closed(); !ok || code != packets.ErrSessionTakenOver.Code {
		t.Fatalf("a parked connection taken over: DISCONNECT %v %#x, want 0x8E", ok, code)
	}
	again.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
	again.expect(packets.Pingresp)
	before := s.Clients()
	devs[n-1].c.Close()
	testutil.WaitFor(t, 5*time.Second, "a parked connection whose client closed it offline", func() bool { return s.Clients() == before-1 })
	devs[n-2].publish("park/t", 1, 9, "p")
	devs[n-2].expect(packets.Puback)
}

// [MQTT-3.1.2-22]: a parked connection silent past one and a half times
// its keep alive is disconnected with 0x8D, no sooner: a timer wakes it,
// and the wake-up must not move the deadline on.
func TestMQTT_3_1_2_22_KeepAliveEndsAParkedConnection(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	s.parkIdle.Store(true)
	s.rawReads.Store(true)
	c := dialRaw(t, s.Addr(), 5)
	c.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect},
		Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), ClientIdentifier: "sleepy", Clean: true, Keepalive: 1}})
	c.expect(packets.Connack)
	start := time.Now()
	testutil.WaitFor(t, 5*time.Second, "the connection parked", func() bool { return parkedConns(s) == 1 })
	d, ok, end := readToEnd(c)
	if !ok || d.ReasonCode != packets.ErrKeepAliveTimeout.Code || !errors.Is(end, io.EOF) {
		t.Fatalf("a silent parked client: DISCONNECT %v %#x, then %v; want 0x8D and the stream's end", ok, d.ReasonCode, end)
	}
	if silent := time.Since(start); silent < 1500*time.Millisecond {
		t.Fatalf("disconnected %v after its CONNACK, want 1.5 s", silent)
	}
}

// A device whose connection is parked sends a publish and closes its
// socket at once: every such connection goes offline. When the data and
// the FIN come together while the idler wakes the read loop, a new
// RawConn.Read forgets the readability the poller had noted, and a loop
// that took the short read of the data for the socket's end waited for a
// wake-up that had come and gone. That order is the scheduler's: on an
// idle machine this test passes without the fix too; under load (the
// daemon's TestClientChaos in a race run) a connection stayed counted.
func TestParkedConnectionSendingAndClosingAtOnceGoesOffline(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	s.parkIdle.Store(true)
	s.rawReads.Store(true)
	const n = 40
	devs := make([]*raw, n)
	for i := range devs {
		devs[i] = connected(t, s, 5, fmt.Sprintf("closer-%d", i))
	}
	testutil.WaitFor(t, 5*time.Second, "every connection parked", func() bool { return parkedConns(s) == n })
	for i, d := range devs {
		d.publish("park/t", 0, 0, fmt.Sprint("last words ", i))
		d.c.Close()
	}
	testutil.WaitFor(t, 5*time.Second, "every connection whose client closed it offline", func() bool { return s.Clients() == 0 })
}

// A connection whose read loop waits in Go's poller (not parked), after a
// QoS 1 exchange, whose client then sends a packet and closes at once:
// the data and the FIN may reach the poller as one edge, and the loop
// must still see the end, not wait for an edge that will not come.
func TestWaitingConnectionSendingAndClosingAtOnceGoesOffline(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	s.parkIdle.Store(false)
	s.rawReads.Store(true)
	const rounds, n = 10, 40
	for round := range rounds {
		devs := make([]*raw, n)
		for i := range devs {
			devs[i] = connected(t, s, 5, fmt.Sprintf("closer-%d-%d", round, i))
			devs[i].publish("wait/t", 1, 1, "first")
			devs[i].expect(packets.Puback)
		}
		for i, d := range devs {
			d.publish("wait/t", 0, 0, fmt.Sprint("last words ", i))
			d.c.Close()
		}
		testutil.WaitFor(t, 5*time.Second, fmt.Sprintf("round %d: every connection whose client closed it offline", round), func() bool { return s.Clients() == 0 })
	}
}
