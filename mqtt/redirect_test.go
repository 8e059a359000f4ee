package mqtt

import (
	"context"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	"github.com/mochi-mqtt/server/v2/packets"
)

// MQTT 5 §4.11 (server redirection), §3.14.2.2.5 and §3.2.2.3.18 (Server
// Reference): a member that cannot take publishes ends its MQTT 5 clients
// with DISCONNECT 0x9C naming the member to use, closes 3.1.1 ones, answers
// CONNECTs with CONNACK 0x9C (3.1.1: 0x03 Server unavailable) until it
// serves again, and keeps persistent sessions for the device's return.
func TestMQTT_4_11_RedirectSendsDevicesToAnotherMember(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	const ref, why = "198.51.100.2:1883", "cut off from the cluster"

	v5 := dialRaw(t, s.Addr(), 5)
	v5.connect("dev5", false, &packets.Properties{SessionExpiryInterval: 300, SessionExpiryIntervalFlag: true})
	v5.subscribe(1, packets.Subscription{Filter: "cmd/#", Qos: 1})
	v3 := dialRaw(t, s.Addr(), 4)
	v3.connect("dev3", true, nil)
	var told *paho.Disconnect
	toldc := make(chan struct{})
	pc := paho.NewClient(paho.ClientConfig{ClientID: "paho", Conn: dialRaw(t, s.Addr(), 5).c,
		OnServerDisconnect: func(d *paho.Disconnect) { told = d; close(toldc) }})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if ca, err := pc.Connect(ctx, &paho.Connect{ClientID: "paho", CleanStart: true, KeepAlive: 30}); err != nil || ca.ReasonCode != 0 {
		t.Fatalf("paho connect: %v %+v", err, ca)
	}

	s.Redirect(ref, why)
	if got, gotWhy := s.Redirecting(); got != ref || gotWhy != why {
		t.Fatalf("Redirecting() = %q, %q", got, gotWhy)
	}
	d, ok := v5.closedBy()
	if !ok || d.ReasonCode != packets.ErrUseAnotherServer.Code || d.Properties.ServerReference != ref || d.Properties.ReasonString != why {
		t.Fatalf("MQTT 5 client ended with DISCONNECT %v %#x ref %q reason %q; want 0x9C %q %q",
			ok, d.ReasonCode, d.Properties.ServerReference, d.Properties.ReasonString, ref, why)
	}
	if _, ok := v3.closedBy(); ok {
		t.Fatal("a 3.1.1 client got a DISCONNECT packet: in 3.1.1 only clients send one")
	}
	select {
	case <-toldc:
		if told.ReasonCode != 0x9C || told.Properties == nil || told.Properties.ServerReference != ref {
			t.Fatalf("paho.golang was told %+v", told)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("paho.golang was not told to use another server")
	}

	again := dialRaw(t, s.Addr(), 5)
	ack := again.connect("dev5", false, &packets.Properties{SessionExpiryInterval: 300, SessionExpiryIntervalFlag: true})
	if ack.ReasonCode != packets.ErrUseAnotherServer.Code || ack.Properties.ServerReference != ref {
		t.Fatalf("CONNACK while redirecting: %#x ref %q; want 0x9C %q", ack.ReasonCode, ack.Properties.ServerReference, ref)
	}
	old := dialRaw(t, s.Addr(), 4)
	if ack := old.connect("dev3", true, nil); ack.ReasonCode != 0x03 {
		t.Fatalf("3.1.1 CONNACK while redirecting: %#x; want 0x03 server unavailable", ack.ReasonCode)
	}

	s.Serve()
	if got, _ := s.Redirecting(); got != "" {
		t.Fatalf("Redirecting() after Serve = %q", got)
	}
	back := dialRaw(t, s.Addr(), 5)
	ack = back.connect("dev5", false, &packets.Properties{SessionExpiryInterval: 300, SessionExpiryIntervalFlag: true})
	if ack.ReasonCode != 0 || !ack.SessionPresent {
		t.Fatalf("back after Serve: CONNACK %#x session present %v; want 0, true", ack.ReasonCode, ack.SessionPresent)
	}
	pub := dialRaw(t, s.Addr(), 5)
	pub.connect("pub", true, nil)
	pub.publish("cmd/x", 1, 1, "still subscribed")
	pub.expect(packets.Puback)
	if got := back.expect(packets.Publish); string(got.Payload) != "still subscribed" {
		t.Fatalf("the resumed session got %q", got.Payload)
	}
}

// An empty reference is no redirection: with no member to name, devices
// stay (the member still serves subscribers).
func TestRedirectWithoutAReferenceKeepsDevices(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	c := dialRaw(t, s.Addr(), 5)
	c.connect("dev", true, nil)
	s.Redirect("", "no master reachable")
	if got, _ := s.Redirecting(); got != "" {
		t.Fatalf("Redirecting() = %q", got)
	}
	c.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
	c.expect(packets.Pingresp)
}

// MQTT 5 §3.2.2.2 (0x88 Server unavailable) and [MQTT-3.2.2-7]: a member
// that must take no devices and has no other member to name (Refuse: its
// broker state is part old, part new) ends its MQTT 5 clients with
// DISCONNECT 0x89 and the reason, closes 3.1.1 ones, and answers every
// CONNECT with CONNACK 0x88 (3.1.1: 0x03) and closes the connection, until
// it serves again.
func TestMQTT_3_2_2_7_RefuseWithoutAReferenceTakesNoDevices(t *testing.T) {
	s, _ := testServer(t, nil, nil)
	const why = "broker state incomplete"
	v5 := dialRaw(t, s.Addr(), 5)
	v5.connect("dev5", false, &packets.Properties{SessionExpiryInterval: 300, SessionExpiryIntervalFlag: true})
	v3 := dialRaw(t, s.Addr(), 4)
	v3.connect("dev3", true, nil)

	s.Refuse(why)
	if ref, got := s.Redirecting(); ref != "" || got != why {
		t.Fatalf("Redirecting() = %q, %q; want no reference and %q", ref, got, why)
	}
	d, ok := v5.closedBy()
	if !ok || d.ReasonCode != packets.ErrServerBusy.Code || d.Properties.ServerReference != "" || d.Properties.ReasonString != why {
		t.Fatalf("MQTT 5 client ended with DISCONNECT %v %#x ref %q reason %q; want 0x89 and %q",
			ok, d.ReasonCode, d.Properties.ServerReference, d.Properties.ReasonString, why)
	}
	if _, ok := v3.closedBy(); ok {
		t.Fatal("a 3.1.1 client got a DISCONNECT packet: in 3.1.1 only clients send one")
	}

	again := dialRaw(t, s.Addr(), 5)
	ack := again.connect("dev5", false, &packets.Properties{SessionExpiryInterval: 300, SessionExpiryIntervalFlag: true})
	if ack.ReasonCode != packets.ErrServerUnavailable.Code || ack.Properties.ServerReference != "" || ack.Properties.ReasonString != why {
		t.Fatalf("CONNACK while refusing: %#x ref %q reason %q; want 0x88, no reference, %q",
			ack.ReasonCode, ack.Properties.ServerReference, ack.Properties.ReasonString, why)
	}
	if d, ok := again.closedBy(); ok { // fails if the connection stays open
		t.Fatalf("a DISCONNECT %#x after a refusing CONNACK", d.ReasonCode)
	}
	old := dialRaw(t, s.Addr(), 4)
	if ack := old.connect("dev3", true, nil); ack.ReasonCode != 0x03 {
		t.Fatalf("3.1.1 CONNACK while refusing: %#x; want 0x03 server unavailable", ack.ReasonCode)
	}

	s.Serve()
	back := dialRaw(t, s.Addr(), 5)
	ack = back.connect("dev5", false, &packets.Properties{SessionExpiryInterval: 300, SessionExpiryIntervalFlag: true})
	if ack.ReasonCode != 0 || !ack.SessionPresent {
		t.Fatalf("back after Serve: CONNACK %#x session present %v; want 0, true", ack.ReasonCode, ack.SessionPresent)
	}
}
