package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/internal/netns"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// healthz is the gateway's GET /healthz status code, 0 when it does not
// answer.
func (g *gw) healthz() int {
	resp, err := g.http.Get("http://127.0.0.1:7880/healthz")
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

// Devices follow the master (DESIGN: "a node that cannot take publishes
// tells MQTT 5 clients 0x9C use another server with a Server Reference and
// /healthz says 503"): a master cut off from its two peers for 30 s tells
// its MQTT 5 device to use another server, naming the other members, about
// an election timeout after the cut; the device's publishes succeed there
// for the whole cut; the cut-off gateway answers /healthz with 503 and
// CONNECTs with 0x9C throughout and, healed, serves again.
func TestCutOffMasterSendsItsDevicesToTheMajority(t *testing.T) {
	// Mostly waiting (a cut, a slow link, a lease, mDNS), on a network of
	// its own: it runs beside the other waiting ones (make test's time).
	t.Parallel()
	nt := netns.New(t, 4) // three gateways and a device's host, which reaches all
	g1, g2, g3 := startThree(t, nt)
	g2.join(g1)
	g3.join(g1)
	waitShape(t, g1, 2, 0, 20*time.Second)
	devHost := nt.Hosts[3]

	told := make(chan *paho.Disconnect, 1)
	conn, err := dialIn(devHost, g1.h.Addr()+":1883")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	dev := paho.NewClient(paho.ClientConfig{ClientID: "follower", Conn: conn,
		OnServerDisconnect: func(d *paho.Disconnect) { told <- d }})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	if ca, err := dev.Connect(ctx, &paho.Connect{ClientID: "follower", CleanStart: true, KeepAlive: 30}); err != nil || ca.ReasonCode != 0 {
		t.Fatalf("connect to gw-1: %v %+v", err, ca)
	}
	cancel()
	if g1.healthz() != 200 {
		t.Fatalf("gw-1 /healthz %d before the cut, want 200", g1.healthz())
	}

	cut := time.Now()
	nt.Partition([]*netns.Host{nt.Hosts[0]}, []*netns.Host{nt.Hosts[1], nt.Hosts[2]})
	var d *paho.Disconnect
	select {
	case d = <-told:
	case <-time.After(15 * time.Second):
		t.Fatal("the cut-off master's device was not told to use another server within 15 s")
	}
	after := time.Since(cut)
	if d.ReasonCode != 0x9C || d.Properties == nil || d.Properties.ServerReference == "" {
		t.Fatalf("DISCONNECT %+v (properties %+v), want 0x9C with a Server Reference", d, d.Properties)
	}
	refs := strings.Fields(d.Properties.ServerReference)
	want := map[string]bool{g2.h.Addr() + ":1883": true, g3.h.Addr() + ":1883": true}
	for _, r := range refs {
		if !want[r] {
			t.Fatalf("Server Reference %q names %q, not one of the other members", d.Properties.ServerReference, r)
		}
	}
	t.Logf("device told to use %q %v after the cut (election timeout 1s); reason %q", d.Properties.ServerReference, after.Round(10*time.Millisecond), d.Properties.ReasonString)
	if code := g1.healthz(); code != 503 {
		t.Fatalf("cut-off gw-1 /healthz %d, want 503", code)
	}

	// The device goes where it was told; its publishes succeed there.
	conn2, err := dialIn(devHost, refs[0])
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn2.Close() })
	dev2 := paho.NewClient(paho.ClientConfig{ClientID: "follower", Conn: conn2})
	ctx, cancel = context.WithTimeout(context.Background(), 5*time.Second)
	if ca, err := dev2.Connect(ctx, &paho.Connect{ClientID: "follower", CleanStart: true, KeepAlive: 30}); err != nil || ca.ReasonCode != 0 {
		t.Fatalf("connect to %s: %v %+v", refs[0], err, ca)
	}
	cancel()
	moved := func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 6*time.Second)
		defer cancel()
		r, err := dev2.Publish(ctx, &paho.Publish{Topic: "a/moved", QoS: 1, Payload: []byte("here")})
		return err == nil && r.ReasonCode == 0
	}
	testutil.WaitFor(t, 15*time.Second, "a publish acked where the device was sent", moved)

	// The cut lasts 30 s (the case): all along, gw-1 keeps sending
	// devices away, a new CONNECT included, and the device's publishes
	// keep succeeding where it went.
	if conn3, err := dialIn(devHost, g1.h.Addr()+":1883"); err == nil {
		late := paho.NewClient(paho.ClientConfig{ClientID: "late", Conn: conn3})
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		ca, err := late.Connect(ctx, &paho.Connect{ClientID: "late", CleanStart: true, KeepAlive: 30})
		cancel()
		conn3.Close()
		if ca == nil || ca.ReasonCode != 0x9C || ca.Properties == nil || ca.Properties.ServerReference == "" {
			t.Fatalf("a CONNECT to the cut-off gw-1: %+v %v, want CONNACK 0x9C with a Server Reference", ca, err)
		}
	} else {
		t.Fatal(err)
	}
	for time.Since(cut) < 30*time.Second {
		if code := g1.healthz(); code != 503 {
			t.Fatalf("cut-off gw-1 /healthz %d %v after the cut, want 503", code, time.Since(cut).Round(time.Second))
		}
		if !moved() {
			t.Fatalf("a publish where the device went failed %v after the cut", time.Since(cut).Round(time.Second))
		}
		time.Sleep(time.Second) // pacing of the checks, not synchronisation
	}

	nt.HealAll()
	testutil.WaitFor(t, 30*time.Second, "gw-1 serving again after the heal", func() bool { return g1.healthz() == 200 })
	back, err := device(t, g1, "back", nil)
	if err != nil {
		t.Fatalf("a device on gw-1 after the heal: %v", err)
	}
	ctx, cancel = context.WithTimeout(context.Background(), 8*time.Second)
	defer cancel()
	if r, err := back.Publish(ctx, &paho.Publish{Topic: "a/back", QoS: 1, Payload: []byte("x")}); err != nil || r.ReasonCode != 0 {
		t.Fatalf("publish on gw-1 after the heal: %v %+v", err, r)
	}
	for _, g := range []*gw{g1, g2, g3} {
		g.stop()
	}
}
