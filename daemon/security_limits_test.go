package daemon

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// ---------------------------------------------------------------------------
// Limits.

func TestOversizePacketDisconnectsOnlyItsClient(t *testing.T) {
	d, logs := startGateway(t, func(c *config.Config) { c.MQTT.MaxPacketSize = 2 << 10 })
	for _, version := range []byte{5, 4} {
		c := mustConnect(t, d.MQTTAddr(), connOpts{version: version, id: fmt.Sprint("big", version)})
		c.pub("ok/small", 1, false, 1, nil, strings.Repeat("s", 1000))
		if r := c.ack(0x40, 1); r != 0 {
			t.Fatalf("a packet under the limit: PUBACK %#x", r)
		}
		c.pub("ok/big", 1, false, 2, nil, strings.Repeat("b", 3000))
		c.expectClosed()
	}
	// MQTT 5 clients are told the limit.
	_, ca := dialMQTTOpts(t, d.MQTTAddr(), connOpts{version: 5, id: "told"})
	if ca.props == nil || ca.props.MaximumPacketSize == nil || *ca.props.MaximumPacketSize != 2<<10 {
		t.Fatalf("CONNACK does not carry the maximum packet size: %+v", ca.props)
	}
	testutil.WaitFor(t, 5*time.Second, "the refusal to be logged", func() bool { return logs.Count("packet larger than max_packet_size") == 1 })
	if countTopic(t, d, "ok/big") != 0 {
		t.Fatal("an oversize publish reached the log")
	}
	assertServing(t, d, "", "")
}

// dialFrom connects from a given loopback address, so that a test can be
// another source than the flood it causes.
func dialFrom(t *testing.T, local, addr string) net.Conn {
	t.Helper()
	d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(local)}}
	conn, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	return conn
}

func TestConnectionFloodFromOneAddressRefused(t *testing.T) {
	d, logs := startGateway(t, func(c *config.Config) {
		c.MQTT.ConnectRate = 0.1 // one every 10 s, after the burst
		c.MQTT.ConnectBurst = 5
	})
	established := mustConnect(t, d.MQTTAddr(), connOpts{version: 5, id: "established"}) // takes 1 of the burst
	accepted, refused := 0, 0
	for i := 0; i < 20; i++ {
		conn := dialFrom(t, "127.0.0.1", d.MQTTAddr())
		conn.SetDeadline(time.Now().Add(5 * time.Second))
		body := connectBody(connOpts{version: 5, id: fmt.Sprint("flood-", i), keepAlive: 60})
		conn.Write(append([]byte{0x10, byte(len(body))}, body...))
		var b [4]byte
		if n, err := io.ReadAtLeast(conn, b[:], 4); err == nil && n >= 4 && b[0] == 0x20 && b[3] == 0 {
			accepted++
		} else {
			refused++
		}
		conn.Close()
	}
	if accepted > 5 || refused < 15 {
		t.Fatalf("%d accepted, %d refused from one address; want the burst of 4 more, then refusals", accepted, refused)
	}
	if n := logs.Count("connection rate exceeded"); n != 1 {
		t.Errorf("%d refused connections logged %d times, want once a minute:\n%s", refused, n, logs)
	}
	// The established client is served.
	established.pub("ok/established", 1, false, 1, nil, "x")
	if r := established.ack(0x40, 1); r != 0 {
		t.Fatalf("established client: PUBACK %#x", r)
	}
	// Another address is not limited by this one's flood.
	other := dialFrom(t, "127.0.0.2", d.MQTTAddr())
	c, ca := mqttOn(t, other, connOpts{version: 5, id: "other-address"})
	if ca.closed || ca.code != 0 {
		t.Fatalf("a client from another address: %+v", ca)
	}
	c.pub("ok/other", 1, false, 1, nil, "x")
	if r := c.ack(0x40, 1); r != 0 {
		t.Fatalf("other address: PUBACK %#x", r)
	}
	if err := d.Err(); err != nil {
		t.Fatal(err)
	}
	if countTopic(t, d, "ok/other") != 1 || countTopic(t, d, "ok/established") != 1 {
		t.Fatal("acked publishes missing from the log")
	}
}

func TestTopicLimits(t *testing.T) {
	d, logs := startGateway(t, func(c *config.Config) {
		c.MQTT.MaxTopicLength = 32
		c.MQTT.MaxTopicLevels = 4
	})
	long := strings.Repeat("x", 33)
	deep := "a/b/c/d/e"
	for _, topic := range []string{long, deep} {
		c5 := mustConnect(t, d.MQTTAddr(), connOpts{version: 5, id: "t5"})
		c5.pub(topic, 1, false, 1, nil, "x")
		if r := c5.expectClosed(); r != 0x90 {
			t.Fatalf("MQTT 5 publish to %q: DISCONNECT %#x, want 0x90 topic name invalid", topic, r)
		}
		c3 := mustConnect(t, d.MQTTAddr(), connOpts{version: 4, id: "t3"})
		c3.pub(topic, 1, false, 1, nil, "x")
		c3.expectClosed()
	}
	for _, tt := range []struct {
		version, refused byte
	}{{5, 0x8f}, {4, 0x80}} {
		c := mustConnect(t, d.MQTTAddr(), connOpts{version: tt.version, id: fmt.Sprint("s", tt.version)})
		got := c.subscribe(1, "ok/#", deep, "a/b/c/#", long)
		if want := []byte{1, tt.refused, 1, tt.refused}; !bytes.Equal(got, want) {
			t.Fatalf("version %d: SUBACK %x, want %x", tt.version, got, want)
		}
		c.pub("ok/after", 1, false, 2, nil, "x")
		if typ, _ := c.read(); typ&0xf0 != 0x30 && typ != 0x40 {
			t.Fatalf("after a refused filter the client is not served: %#x", typ)
		}
	}
	// A will whose topic is over the limits is refused at CONNECT.
	_, ca := dialMQTTOpts(t, d.MQTTAddr(), connOpts{version: 5, id: "w5", willTopic: deep})
	if ca.closed || ca.code != 0x90 {
		t.Fatalf("MQTT 5 will over the limits: %+v, want CONNACK 0x90", ca)
	}
	c3, ca := dialMQTTOpts(t, d.MQTTAddr(), connOpts{version: 4, id: "w3", willTopic: long})
	if !ca.closed {
		t.Fatalf("3.1.1 will over the limits: %+v, want the connection closed (no CONNACK code fits)", ca)
	}
	c3.Close()
	if logs.Count("topic deeper than max_topic_levels: disconnected") != 1 {
		t.Errorf("two publishes over the level limit from one address logged %d times, want once", logs.Count("topic deeper than max_topic_levels: disconnected"))
	}
	for _, r := range assertServing(t, d, "", "") {
		if r.Topic == long || r.Topic == deep {
			t.Fatalf("a topic over the limits reached the log: %s", r.Topic)
		}
	}
}

func TestKeepAliveBounds(t *testing.T) {
	d, _ := startGateway(t, func(c *config.Config) {
		c.MQTT.KeepAliveMin = config.Duration(10 * time.Second)
		c.MQTT.KeepAliveMax = config.Duration(120 * time.Second)
	})
	for _, tt := range []struct {
		version byte
		ka      uint16
		code    byte
		server  uint16 // server keep alive in the CONNACK, 0 for none
	}{
		{5, 60, 0, 0},
		{5, 0, 0, 120},
		{5, 600, 0, 120},
		{5, 2, 0, 10},
		{4, 60, 0, 0},
		{4, 600, 0x02, 0},
		{4, 0, 0, 0}, // taken, held to the maximum (3.1.1 cannot be told)
		{4, 2, 0x02, 0},
	} {
		conn, err := net.DialTimeout("tcp", d.MQTTAddr(), 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		_, ca := mqttOnKA(t, conn, connOpts{version: tt.version, id: fmt.Sprint("ka", tt.version, "-", tt.ka), keepAlive: tt.ka})
		if ca.closed || ca.code != tt.code {
			t.Errorf("version %d keep-alive %d: %+v, want CONNACK %#x", tt.version, tt.ka, ca, tt.code)
			continue
		}
		var server uint16
		if ca.props != nil && ca.props.ServerKeepAlive != nil {
			server = *ca.props.ServerKeepAlive
		}
		if server != tt.server {
			t.Errorf("version %d keep-alive %d: server keep alive %d, want %d", tt.version, tt.ka, server, tt.server)
		}
	}
	assertServing(t, d, "", "")
}

func TestMaxClients(t *testing.T) {
	d, _ := startGateway(t, func(c *config.Config) { c.MQTT.MaxClients = 3 })
	a := mustConnect(t, d.MQTTAddr(), connOpts{version: 5, id: "a"})
	mustConnect(t, d.MQTTAddr(), connOpts{version: 5, id: "b"})
	mustConnect(t, d.MQTTAddr(), connOpts{version: 4, id: "c"})
	testutil.WaitFor(t, 5*time.Second, "3 clients", func() bool { return d.broker.Clients() == 3 })
	for _, tt := range []struct{ version, code byte }{{5, 0x89}, {4, 0x03}} {
		c, ca := dialMQTTOpts(t, d.MQTTAddr(), connOpts{version: tt.version, id: "one-too-many"})
		if ca.closed || ca.code != tt.code {
			t.Fatalf("version %d: %+v, want CONNACK %#x", tt.version, ca, tt.code)
		}
		c.expectClosed()
	}
	a.pub("ok/a", 1, false, 1, nil, "x")
	if r := a.ack(0x40, 1); r != 0 {
		t.Fatalf("PUBACK %#x", r)
	}
}

// Stopping while clients leave must not hang. mochi's own way of closing a
// listener's clients read-locks its client map twice and deadlocks with a
// client removing itself in between (seen once in ~100 loaded runs of this
// file); the listener no longer goes that way. The window is too narrow for
// this test to hit reliably: it checks the shutdown path, not the race.
func TestStopWhileClientsLeave(t *testing.T) {
	for round := 0; round < 5; round++ {
		d, _ := startGateway(t, nil)
		var conns []*mqttConn
		for i := 0; i < 40; i++ {
			conns = append(conns, mustConnect(t, d.MQTTAddr(), connOpts{version: byte(4 + i%2), id: fmt.Sprint("leaver-", i)}))
		}
		stopped := make(chan struct{})
		go func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		go func() {
			d.Stop()
			close(stopped)
		}()
		select {
		case <-stopped:
		case <-time.After(20 * time.Second):
			t.Fatalf("round %d: Stop hangs while clients disconnect", round)
		}
	}
}
