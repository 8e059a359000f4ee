package daemon

import (
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/config"
)

// mqttConn is a raw client speaking 3.1.1 (version 4) or 5, for packets
// paho will not send: undefined topic aliases, stale packet ids, DUP flags.
type mqttConn struct {
	*rawConn
	version byte
}

func dialVersion(t *testing.T, addr, id string, clean bool, version byte) (*mqttConn, bool) {
	t.Helper()
	c := &mqttConn{rawConn: dialRawNoConnect(t, addr), version: version}
	flags := byte(0)
	if clean {
		flags = 2
	}
	body := []byte{0, 4, 'M', 'Q', 'T', 'T', version, flags, 0, 60}
	if version == 5 {
		body = append(body, 5, 0x11, 0, 0, 0x01, 0x2c) // session expiry 300 s
	}
	body = append(body, byte(len(id)>>8), byte(len(id)))
	body = append(body, id...)
	c.send(0x10, body)
	typ, b := c.read()
	if typ != 0x20 || len(b) < 2 || b[1] != 0 {
		t.Fatalf("connack %#x %v", typ, b)
	}
	return c, b[0]&1 == 1
}

func dialRawNoConnect(t *testing.T, addr string) *rawConn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &rawConn{t, c}
}

func (c *mqttConn) pub(topic string, qos byte, dup bool, pid uint16, props []byte, payload string) {
	body := []byte{byte(len(topic) >> 8), byte(len(topic))}
	body = append(body, topic...)
	if qos > 0 {
		body = append(body, byte(pid>>8), byte(pid))
	}
	if c.version == 5 {
		body = append(body, byte(len(props)))
		body = append(body, props...)
	}
	hdr := byte(0x30) | qos<<1
	if dup {
		hdr |= 8
	}
	c.send(hdr, append(body, payload...))
}

// ping sends PINGREQ and returns the packets that arrive before PINGRESP:
// what the server had queued for the client.
func (c *mqttConn) ping() []byte {
	c.send(0xc0, nil)
	var before []byte
	for {
		typ, _ := c.read()
		if typ == 0xd0 || typ == 0 {
			return append(before, typ)
		}
		before = append(before, typ)
	}
}

func (c *mqttConn) expect(typ byte, pid uint16) {
	c.t.Helper()
	got, b := c.read()
	if got != typ || len(b) < 2 || uint16(b[0])<<8|uint16(b[1]) != pid {
		c.t.Fatalf("got packet %#x %v, want %#x for id %d", got, b, typ, pid)
	}
	if len(b) > 2 && b[2] >= 0x80 {
		c.t.Fatalf("packet %#x for id %d carries reason %#x", got, pid, b[2])
	}
}

func countTopic(t *testing.T, d *Daemon, topic string) int {
	n := 0
	for _, r := range logRecords(t, d) {
		if r.Topic == topic {
			n++
		}
	}
	return n
}

// One packet must not be able to stop the log: a record no subscriber can
// receive would otherwise fail at every apply, at every start.
func TestUndeliverablePublishesDoNotStopTheLog(t *testing.T) {
	d := testGateway(t, t.TempDir(), nil)
	watch, got := v5(t, d.MQTTAddr(), "watch", nil)
	subscribe(t, watch, "#", 1)

	alias, _ := dialVersion(t, d.MQTTAddr(), "alias", true, 5)
	alias.pub("", 1, false, 1, []byte{0x23, 0, 5}, "x") // topic alias 5, never set
	if typ, _ := alias.read(); typ != 0xe0 && typ != 0 {
		t.Fatalf("undefined topic alias answered with %#x, want a disconnect", typ)
	}

	will := dialRawNoConnect(t, d.MQTTAddr())
	body := []byte{0, 4, 'M', 'Q', 'T', 'T', 4, 0x02 | 0x04, 0, 60, 0, 5, 'w', 'i', 'l', 'l', 'c', 0, 3, 'w', '/', '#', 0, 3, 'b', 'y', 'e'}
	will.send(0x10, body)
	// A will topic with wildcards breaks [MQTT-3.1.3-11]: the CONNECT is
	// refused by closing the connection (3.1.1 has no CONNACK code for
	// it), or, by a lenient server, accepted with the will dropped.
	if typ, _ := will.read(); typ != 0x20 && typ != 0 {
		t.Fatalf("connack %#x", typ)
	}
	will.Close() // no DISCONNECT: the (invalid) will would fire

	pub, _ := v5(t, d.MQTTAddr(), "after", nil)
	publish(t, pub, &paho.Publish{Topic: "still/ok", QoS: 1, Payload: []byte("y")})
	if p := receive(t, got, 5*time.Second); p.Topic != "still/ok" {
		t.Fatalf("got %s", p.Topic)
	}
	if err := d.Err(); err != nil {
		t.Fatalf("the log stopped: %v", err)
	}
	for _, r := range logRecords(t, d) {
		if r.Topic == "" || r.Topic == "w/#" {
			t.Fatalf("an undeliverable record was logged: %+v", r)
		}
	}
}

// A QoS 2 publish whose ack failed must not be acked later by mochi's resend
// of its session's in-flight PUBRECs.
func TestFailedQoS2IsNotResentAsSuccess(t *testing.T) {
	d := testGateway(t, t.TempDir(), func(c *config.Config) {
		c.Cluster.SyncTimeout = config.Duration(200 * time.Millisecond)
		c.Topics = []config.TopicRule{{Match: "s/#", Ack: "sync"}}
	})
	c, _ := dialVersion(t, d.MQTTAddr(), "stale", false, 4)
	c.pub("s/1", 2, false, 9, nil, "x")
	if typ, _ := c.read(); typ != 0 {
		t.Fatalf("3.1.1 client got %#x for a failed sync publish, want a disconnect", typ)
	}
	c2, present := dialVersion(t, d.MQTTAddr(), "stale", false, 4)
	if !present {
		t.Fatal("session not present after reconnect")
	}
	if got := c2.ping(); len(got) != 1 {
		t.Fatalf("after reconnect the server sent %x before PINGRESP: a stale PUBREC for a failed publish", got[:len(got)-1])
	}
}

// After a crash between PUBCOMP and the next commit, the QoS 2 marker of a
// finished flow is still on disk; a new publish reusing its id (DUP=0) must
// be logged, not mistaken for a resend.
func TestStaleQoS2MarkerDoesNotSwallowANewPublish(t *testing.T) {
	dir := t.TempDir()
	slowTick := func(c *config.Config) {
		c.Cluster.Heartbeat = config.Duration(5 * time.Second) // no idle flush in between
		c.Cluster.ElectionTimeout = config.Duration(11 * time.Second)
	}
	d := testGateway(t, dir, slowTick)
	c, _ := dialVersion(t, d.MQTTAddr(), "q2c", false, 4)
	c.pub("q/1", 2, false, 9, nil, "first")
	c.expect(0x50, 9)
	c.send(0x62, []byte{0, 9})
	c.expect(0x70, 9)
	// What kill -9 leaves now: the data file as it is on disk.
	crash := t.TempDir()
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		copyTestFile(t, filepath.Join(dir, e.Name()), filepath.Join(crash, e.Name()))
	}
	d.Stop()

	d2 := testGateway(t, crash, nil)
	c2, _ := dialVersion(t, d2.MQTTAddr(), "q2c", false, 4)
	c2.ping() // drains whatever was resent
	c2.pub("q/2", 2, false, 9, nil, "second")
	c2.expect(0x50, 9)
	c2.send(0x62, []byte{0, 9})
	c2.expect(0x70, 9)
	if n := countTopic(t, d2, "q/2"); n != 1 {
		t.Fatalf("publish q/2 was acked but is in the log %d times", n)
	}
}

func copyTestFile(t *testing.T, src, dst string) {
	t.Helper()
	in, err := os.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.Create(dst)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
}

// Receive Maximum covers QoS 1 and 2 only: a QoS 0 publish at the maximum is
// fine; one more QoS 1 is a protocol violation (0x93).
func TestReceiveMaximumCountsOnlyQoS1And2(t *testing.T) {
	d := testGateway(t, t.TempDir(), func(c *config.Config) {
		c.Cluster.SyncTimeout = config.Duration(3 * time.Second)
		c.MQTT.MaxInflight = 2
		c.Topics = []config.TopicRule{{Match: "s/#", Ack: "sync"}}
	})
	c, _ := dialVersion(t, d.MQTTAddr(), "rm", true, 5)
	c.pub("s/1", 1, false, 1, nil, "x")
	c.pub("s/2", 1, false, 2, nil, "x")
	c.pub("a/0", 0, false, 0, nil, "q0")
	if got := c.ping(); len(got) != 1 || got[0] != 0xd0 {
		t.Fatalf("QoS 0 at the receive maximum: got %x, want only PINGRESP", got)
	}
	c.pub("s/3", 1, false, 3, nil, "x")
	typ, b := c.read()
	if typ != 0xe0 || len(b) < 1 || b[0] != 0x93 {
		t.Fatalf("a third QoS 1 with 2 owed: got %#x %v, want DISCONNECT 0x93", typ, b)
	}
}

// Topic aliases [MQTT-3.3.2-12]: an alias one PUBLISH sets serves later ones
// that carry no topic, and a QoS 2 resend (DUP) sets its alias too, since a
// client that reconnects sets its aliases up again on what it resends.
func TestTopicAliases(t *testing.T) {
	d := testGateway(t, t.TempDir(), nil)
	c, _ := dialVersion(t, d.MQTTAddr(), "aliases", true, 5)
	c.pub("a/1", 1, false, 1, []byte{0x23, 0, 3}, "set")
	c.expect(0x40, 1)
	c.pub("", 1, false, 2, []byte{0x23, 0, 3}, "used")
	c.expect(0x40, 2)

	q, _ := dialVersion(t, d.MQTTAddr(), "resender", false, 5)
	q.pub("q/t", 2, false, 7, nil, "once")
	q.expect(0x50, 7)
	q.Close() // before the PUBREL
	q2, present := dialVersion(t, d.MQTTAddr(), "resender", false, 5)
	if !present {
		t.Fatal("session not present after reconnect")
	}
	q2.pub("q/t", 2, true, 7, []byte{0x23, 0, 4}, "once")
	q2.pub("", 1, false, 8, []byte{0x23, 0, 4}, "by alias")
	for acked := false; !acked; {
		typ, b := q2.read()
		switch {
		case typ == 0x50 && len(b) >= 2 && b[1] == 7: // PUBREC 7: mochi's resend, or the answer to the DUP
		case typ == 0x40 && len(b) >= 2 && b[1] == 8:
			if len(b) > 2 && b[2] >= 0x80 {
				t.Fatalf("PUBACK 8 carries reason %#x", b[2])
			}
			acked = true
		default:
			t.Fatalf("got packet %#x %v, want PUBACK 8 for a publish by the alias a DUP resend set", typ, b)
		}
	}
	if n := countTopic(t, d, "a/1"); n != 2 {
		t.Errorf("%d records on a/1, want 2 (one by its alias)", n)
	}
	if n := countTopic(t, d, "q/t"); n != 2 {
		t.Errorf("%d records on q/t, want 2 (the resent QoS 2 publish once, one by its alias)", n)
	}
}

// A client whose receive maximum was used up by PUBRECs still waiting for
// their PUBREL when its connection dropped may resend those publishes (DUP)
// after it reconnects: a resend is owed already and does not count again.
func TestResendWithFullWindowIsAnswered(t *testing.T) {
	d := testGateway(t, t.TempDir(), func(c *config.Config) { c.MQTT.MaxInflight = 2 })
	c, _ := dialVersion(t, d.MQTTAddr(), "full", false, 5)
	c.pub("w/1", 2, false, 1, nil, "one")
	c.expect(0x50, 1)
	c.pub("w/2", 2, false, 2, nil, "two")
	c.expect(0x50, 2)
	c.Close() // two PUBRECs owed a PUBREL: the window is full

	c2, present := dialVersion(t, d.MQTTAddr(), "full", false, 5)
	if !present {
		t.Fatal("session not present after reconnect")
	}
	c2.pub("w/1", 2, true, 1, nil, "one")
	// mochi resends both PUBRECs at the take-over, so a PUBREC 1 alone
	// proves nothing: the connection must still answer a PINGREQ.
	got := c2.ping()
	for _, typ := range got[:len(got)-1] {
		if typ != 0x50 {
			t.Fatalf("got packet %#x for a resend with the window full, want only PUBRECs", typ)
		}
	}
	if got[len(got)-1] != 0xd0 {
		t.Fatalf("the connection ended after a resend with the window full (packets %x)", got)
	}
	if n := countTopic(t, d, "w/1"); n != 1 {
		t.Errorf("%d records on w/1, want 1", n)
	}
}
