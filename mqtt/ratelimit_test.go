package mqtt

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
)

// [MQTT-3.2.2-7] (3.1.1: [MQTT-3.2.2-5]): a connection refused by the
// connect rate limit gets a CONNACK saying why, 0x9F connection rate
// exceeded (3.1.1: 0x03 server unavailable), and then the close, not a
// bare close before anything is read: the device is told why.
func TestMQTT_3_2_2_7_ConnectRateRefusalIsAConnackThenAClose(t *testing.T) {
	obs := &refusalCounter{}
	s, _ := testServer(t, nil, func(c *Config) {
		c.Limits.ConnectRate = 0.001 // no token comes back during the test
		c.Limits.ConnectBurst = 1
		c.Observer = obs
	})
	first := dialRaw(t, s.Addr(), 5)
	if ack := first.connect("first", true, nil); ack.ReasonCode != 0 {
		t.Fatalf("the burst's connection: CONNACK %#x", ack.ReasonCode)
	}

	v5 := dialRaw(t, s.Addr(), 5)
	ack := v5.connect("second-v5", true, nil)
	if ack.ReasonCode != packets.ErrConnectionRateExceeded.Code || ack.Properties.ReasonString != "connection rate exceeded" {
		t.Fatalf("MQTT 5 over the rate: CONNACK %#x %q, want 0x9F connection rate exceeded", ack.ReasonCode, ack.Properties.ReasonString)
	}
	if _, disc := v5.closed(); disc {
		t.Fatal("MQTT 5 over the rate: a DISCONNECT after the refusing CONNACK")
	}

	v311 := dialRaw(t, s.Addr(), 4)
	if ack := v311.connect("second-311", true, nil); ack.ReasonCode != packets.Err3ServerUnavailable.Code {
		t.Fatalf("MQTT 3.1.1 over the rate: CONNACK %#x, want 0x03 server unavailable", ack.ReasonCode)
	}
	v311.closed()
	if n := obs.count(refusedRateTold); n != 2 {
		t.Fatalf("%d refusals counted as told, want 2", n)
	}

	// One that sends nothing is closed after a short wait, not the
	// connect timeout, and costs nothing after.
	silent, err := net.DialTimeout("tcp", s.Addr(), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	start := time.Now()
	_ = silent.SetReadDeadline(time.Now().Add(rateTellWait + 3*time.Second))
	if _, err := io.ReadAll(silent); err != nil {
		t.Fatalf("a silent connection over the rate was not closed within %v: %v", rateTellWait+3*time.Second, err)
	}
	if d := time.Since(start); d < rateTellWait/2 {
		t.Fatalf("a silent connection over the rate closed after %v: it had no time to send its CONNECT", d)
	}
	if n := obs.count(refusedRate); n != 1 {
		t.Fatalf("%d silent refusals counted, want 1", n)
	}
	// The connection in the burst is served throughout.
	first.publish("r/ok", 1, 1, "x")
	first.expect(packets.Puback)
}

// Past maxRateTelling connections over the rate being read at once, the
// next ones are closed before anything is read: a flood holds no more
// sockets and goroutines than that.
func TestConnectRateRefusalsReadAtOnceAreBounded(t *testing.T) {
	obs := &refusalCounter{}
	s, _ := testServer(t, nil, func(c *Config) {
		c.Limits.ConnectRate = 0.001
		c.Limits.ConnectBurst = 1
		c.Observer = obs
	})
	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	for i := 0; i < maxRateTelling+1+5; i++ { // the burst's one, the bound, 5 more
		c, err := net.DialTimeout("tcp", s.Addr(), 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
	}
	deadline := time.Now().Add(rateTellWait / 2)
	for obs.count(refusedRate) < 5 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond) // polling a counter with a deadline
	}
	if n := obs.count(refusedRate); n != 5 {
		t.Fatalf("%d connections closed unread while %d were being read, want 5", n, maxRateTelling)
	}
	if n := s.rateTelling.Load(); n != maxRateTelling {
		t.Fatalf("%d being read, want the bound %d", n, maxRateTelling)
	}
}
