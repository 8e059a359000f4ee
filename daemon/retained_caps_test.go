package daemon

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// connectReason connects an MQTT 5 client with a persistent session and
// returns the CONNACK's reason code.
func connectReason(t *testing.T, addr, id string) byte {
	t.Helper()
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	c := paho.NewClient(paho.ClientConfig{ClientID: id, Conn: conn})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	expiry := uint32(3600)
	ca, err := c.Connect(ctx, &paho.Connect{ClientID: id, KeepAlive: 30, Properties: &paho.ConnectProperties{SessionExpiryInterval: &expiry}})
	if ca == nil {
		t.Fatalf("connect %s: no CONNACK: %v", id, err)
	}
	if ca.ReasonCode == 0 {
		t.Cleanup(func() { _ = c.Disconnect(&paho.Disconnect{}) })
	}
	return ca.ReasonCode
}

// retainedReason publishes a retained QoS 1 message and returns the
// PUBACK's reason code.
func retainedReason(t *testing.T, c *paho.Client, topic string, payload []byte) byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r, err := c.Publish(ctx, &paho.Publish{Topic: topic, QoS: 1, Retain: true, Payload: payload})
	if r == nil {
		t.Fatalf("publish %s: no PUBACK: %v", topic, err)
	}
	return r.ReasonCode
}

// The retained and session caps hold after a restart: the counts are
// rebuilt from the data file, so a gateway filled to mqtt.max_retained and
// mqtt.max_sessions refuses the next new topic and session with 0x97 once
// it is back, resumes and replaces what it holds, and sends the retained
// payloads it keeps on disk only (over 1 KiB) whole.
func TestRetainedAndSessionCapsHoldAfterARestart(t *testing.T) {
	dir := t.TempDir()
	caps := func(c *config.Config) {
		c.MQTT.MaxRetained = 2
		c.MQTT.MaxSessions = 1
	}
	big := func(i int) []byte { return bytes.Repeat([]byte{byte('a' + i)}, 8<<10) }
	d := testGateway(t, dir, caps)
	pub, _ := v5(t, d.MQTTAddr(), "retainer", nil)
	for i := range 2 {
		if code := retainedReason(t, pub, fmt.Sprintf("caps/%d", i), big(i)); code != 0 {
			t.Fatalf("caps/%d: PUBACK %#x", i, code)
		}
	}
	if code := connectReason(t, d.MQTTAddr(), "kept"); code != 0 {
		t.Fatalf("the first persistent session: CONNACK %#x", code)
	}
	if code := retainedReason(t, pub, "caps/over", []byte("x")); code != 0x97 {
		t.Fatalf("before the restart, a third retained topic: PUBACK %#x, want 0x97", code)
	}
	if err := d.Stop(); err != nil {
		t.Fatal(err)
	}

	d = testGateway(t, dir, caps)
	if n, b := d.broker.Retained(), d.broker.RetainedBytes(); n != 2 || b < 2*(8<<10) {
		t.Fatalf("after the restart: %d retained messages of %d bytes, want 2 of over 16 KiB", n, b)
	}
	if n := d.broker.PersistentSessions(); n != 1 {
		t.Fatalf("after the restart: %d persistent sessions, want 1", n)
	}
	pub, _ = v5(t, d.MQTTAddr(), "retainer", nil)
	if code := retainedReason(t, pub, "caps/over", []byte("x")); code != 0x97 {
		t.Fatalf("after the restart, a third retained topic: PUBACK %#x, want 0x97", code)
	}
	if code := connectReason(t, d.MQTTAddr(), "another"); code != 0x97 {
		t.Fatalf("after the restart, a second persistent session: CONNACK %#x, want 0x97", code)
	}
	if code := connectReason(t, d.MQTTAddr(), "kept"); code != 0 {
		t.Fatalf("after the restart, the session resuming: CONNACK %#x", code)
	}
	if code := retainedReason(t, pub, "caps/0", big(5)); code != 0 {
		t.Fatalf("after the restart, replacing caps/0: PUBACK %#x", code)
	}
	last, err := d.db.LastIndex()
	if err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 10*time.Second, "the replacement applied", func() bool { return d.db.Applied() >= last })
	late, got := v5(t, d.MQTTAddr(), "late", nil)
	subscribe(t, late, "caps/#", 1)
	want := map[string][]byte{"caps/0": big(5), "caps/1": big(1)}
	for range 2 {
		p := receive(t, got, 5*time.Second)
		if w, ok := want[p.Topic]; !ok || !p.Retain || !bytes.Equal(p.Payload, w) {
			t.Fatalf("retained %s: %d bytes starting %q, retain %v", p.Topic, len(p.Payload), p.Payload[:1], p.Retain)
		}
		delete(want, p.Topic)
	}
}
