package mqtt

import (
	"bytes"
	"fmt"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// A will is held for as long as its connection, and a will delay after it:
// it is charged to limits.memory for as long, and given back once it is
// proposed, cancelled by the client's return, or dropped by a clean
// DISCONNECT. Wills were the one thing a client could make the gateway
// hold that no budget counted (up to 64 KiB each: a CONNECT's bound before
// it is authenticated; a pending one outlives its connection).
func TestWillsAreChargedToTheMemoryBudget(t *testing.T) {
	s, _ := testServer(t, nil, func(c *Config) { c.Limits.Memory = 64 << 20 })
	payload := bytes.Repeat([]byte("w"), 32<<10)
	connectWithWill := func(id string, delay uint32) *raw {
		c := dialRaw(t, s.Addr(), 5)
		pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect},
			Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), ClientIdentifier: id, Keepalive: 30,
				WillFlag: true, WillTopic: "wills/" + id, WillPayload: payload, WillQos: 1}}
		pk.Properties.SessionExpiryInterval, pk.Properties.SessionExpiryIntervalFlag = 3600, true
		pk.Connect.WillProperties.WillDelayInterval = delay
		c.write(pk)
		c.expect(packets.Connack)
		return c
	}
	charged := func() bool { return s.MemoryUsed() >= int64(len(payload)) }
	idle := func() bool { return s.MemoryUsed() == 0 }

	// A clean DISCONNECT drops the will, and what it was charged.
	c := connectWithWill("graceful", 0)
	testutil.WaitFor(t, 5*time.Second, "the will charged", charged)
	c.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
	testutil.WaitFor(t, 5*time.Second, "the charge given back", idle, func() string { return fmt.Sprint("used ", s.MemoryUsed()) })

	// A will waiting for its delay stays charged after its connection,
	// until the client comes back and cancels it.
	c = connectWithWill("delayed", 600)
	c.c.Close()
	testutil.WaitFor(t, 5*time.Second, "the connection gone", func() bool { return s.Clients() == 0 })
	if !charged() {
		t.Fatalf("a pending will is charged %d bytes, want at least %d", s.MemoryUsed(), len(payload))
	}
	back := dialRaw(t, s.Addr(), 5)
	back.connect("delayed", false, &packets.Properties{SessionExpiryInterval: 3600, SessionExpiryIntervalFlag: true})
	testutil.WaitFor(t, 5*time.Second, "the cancelled will's charge given back", idle, func() string { return fmt.Sprint("used ", s.MemoryUsed()) })

	// A will sent at once when the connection drops gives its charge back.
	c = connectWithWill("dropped", 0)
	c.c.Close()
	testutil.WaitFor(t, 5*time.Second, "the sent will's charge given back", idle, func() string { return fmt.Sprint("used ", s.MemoryUsed()) })
}
