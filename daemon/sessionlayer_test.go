package daemon

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"math/rand"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/coder/websocket"
	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// countingSub is an MQTT 5 subscriber with a given Receive Maximum that
// counts what it receives by the 8-byte id at the start of each payload.
type countingSub struct {
	c    *paho.Client
	mu   sync.Mutex
	seen map[uint64]int
	n    atomic.Int64
}

func newCountingSub(t *testing.T, addr, id string, recvMax uint16) *countingSub {
	t.Helper()
	cs := &countingSub{seen: map[uint64]int{}}
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	cs.c = paho.NewClient(paho.ClientConfig{
		ClientID: id,
		Conn:     conn,
		OnPublishReceived: []func(paho.PublishReceived) (bool, error){func(pr paho.PublishReceived) (bool, error) {
			if len(pr.Packet.Payload) >= 8 {
				k := binary.BigEndian.Uint64(pr.Packet.Payload)
				cs.mu.Lock()
				cs.seen[k]++
				cs.mu.Unlock()
			}
			cs.n.Add(1)
			return true, nil
		}},
	})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ca, err := cs.c.Connect(ctx, &paho.Connect{ClientID: id, CleanStart: true, KeepAlive: 30,
		Properties: &paho.ConnectProperties{ReceiveMaximum: &recvMax}})
	if err != nil || ca.ReasonCode != 0 {
		t.Fatalf("connect %s: %v %+v", id, err, ca)
	}
	t.Cleanup(func() { _ = cs.c.Disconnect(&paho.Disconnect{}) })
	return cs
}

// missing returns how many of ids 0..n-1 never arrived.
func (cs *countingSub) missing(n int) int {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	m := 0
	for i := 0; i < n; i++ {
		if cs.seen[uint64(i)] == 0 {
			m++
		}
	}
	return m
}

// pipelinedPublisher publishes ids [from, to) to topic at qos over c with
// window publishes in flight, and returns the first error.
func pipelinedPublisher(c *paho.Client, topic string, qos byte, window, from, to int) error {
	var next atomic.Int64
	next.Store(int64(from))
	var wg sync.WaitGroup
	errc := make(chan error, window)
	for w := 0; w < window; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(to) {
					return
				}
				payload := binary.BigEndian.AppendUint64(nil, uint64(i))
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				r, err := c.Publish(ctx, &paho.Publish{Topic: topic, QoS: qos, Payload: append(payload, make([]byte, 92)...)})
				cancel()
				if err == nil && r != nil && r.ReasonCode >= 0x80 {
					err = fmt.Errorf("publish %d: reason %#x", i, r.ReasonCode)
				}
				if err != nil {
					errc <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errc)
	return <-errc
}

// assertAnswersAndStops checks what a hang would break: the gateway acks a
// publish, delivers it, answers /v1/status, and stops within 5 s.
func assertAnswersAndStops(t *testing.T, d *Daemon) {
	t.Helper()
	sub, got := v5(t, d.MQTTAddr(), "probe-sub", nil)
	subscribe(t, sub, "probe/#", 1)
	pub, _ := v5(t, d.MQTTAddr(), "probe-pub", nil)
	if r := publish(t, pub, &paho.Publish{Topic: "probe/x", QoS: 1, Payload: []byte("alive")}); r.ReasonCode != 0 {
		t.Fatalf("probe publish: reason %#x", r.ReasonCode)
	}
	if p := receive(t, got, 10*time.Second); string(p.Payload) != "alive" {
		t.Fatalf("probe delivery: %q", p.Payload)
	}
	hc := &http.Client{Timeout: 5 * time.Second}
	resp, err := hc.Get("http://" + d.HTTPAddr() + "/v1/status")
	if err != nil {
		t.Fatalf("/v1/status: %v", err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("/v1/status: %d", resp.StatusCode)
	}
	stopped := make(chan struct{})
	go func() {
		d.Stop()
		close(stopped)
	}()
	select {
	case <-stopped:
	case <-time.After(5 * time.Second):
		t.Fatal("the gateway did not stop within 5 s")
	}
}

// The deadlock of the mochi-based layer (FACTS.md): one MQTT 5 QoS 1
// subscriber with a small Receive Maximum, while 4 publishers run at a
// window of 64, stopped every ack and delivery within a few hundred
// messages. Here it takes every message, and the gateway still answers.
func TestSmallReceiveMaximumSubscriberDoesNotStopTheGateway(t *testing.T) {
	d := testGateway(t, t.TempDir(), func(c *config.Config) { c.MQTT.MaxInflight = 1024 })
	total := 100_000
	if raceEnabled {
		total = 20_000 // the race detector's cost; the same paths run
	}
	sub := newCountingSub(t, d.MQTTAddr(), "slow-sub", 20)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	if _, err := sub.c.Subscribe(ctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: "bench/#", QoS: 1}}}); err != nil {
		t.Fatal(err)
	}
	cancel()
	var wg sync.WaitGroup
	errs := make([]error, 4)
	per := total / 4
	for p := 0; p < 4; p++ {
		c, _ := v5(t, d.MQTTAddr(), fmt.Sprintf("pub-%d", p), nil)
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[p] = pipelinedPublisher(c, fmt.Sprintf("bench/%d", p), 1, 64, p*per, (p+1)*per)
		}()
	}
	wg.Wait()
	for p, err := range errs {
		if err != nil {
			t.Fatalf("publisher %d: %v", p, err)
		}
	}
	testutil.WaitFor(t, 60*time.Second, "every message at the subscriber", func() bool { return sub.missing(total) == 0 })
	assertAnswersAndStops(t, d)
}

// One MQTT 5 connection publishing at a window of 64 to a topic it is
// subscribed to (the other form of the same deadlock), QoS 1 and QoS 2: it
// gets every ack and every message back.
func TestPublishingToOwnSubscriptionAtWindow64(t *testing.T) {
	d := testGateway(t, t.TempDir(), nil)
	n := 5_000
	if raceEnabled {
		n = 2_000
	}
	for _, qos := range []byte{1, 2} {
		t.Run(fmt.Sprintf("qos%d", qos), func(t *testing.T) {
			cs := newCountingSub(t, d.MQTTAddr(), fmt.Sprintf("self-%d", qos), 64)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			topic := fmt.Sprintf("self/%d", qos)
			if _, err := cs.c.Subscribe(ctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: topic, QoS: qos}}}); err != nil {
				t.Fatal(err)
			}
			cancel()
			if err := pipelinedPublisher(cs.c, topic, qos, 64, 0, n); err != nil {
				t.Fatal(err)
			}
			testutil.WaitFor(t, 30*time.Second, "every message back", func() bool { return cs.missing(n) == 0 })
			cs.mu.Lock()
			for k, c := range cs.seen {
				if qos == 2 && c != 1 {
					t.Errorf("QoS 2 message %d received %d times", k, c)
				}
			}
			cs.mu.Unlock()
		})
	}
	assertAnswersAndStops(t, d)
}

// Many clients subscribing, publishing, disconnecting and taking over each
// other's sessions at random (seeded: a failure replays with its seed),
// MQTT 5 and 3.1.1; afterwards the gateway still acks, delivers, answers
// status and stops.
func TestClientChaos(t *testing.T) {
	d := testGateway(t, t.TempDir(), func(c *config.Config) {
		c.MQTT.ConnectRate, c.MQTT.ConnectBurst = 10000, 10000 // the chaos connects faster than a device
	})
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	dur := 15 * time.Second
	if raceEnabled || testing.Short() {
		dur = 10 * time.Second
	}
	deadline := time.Now().Add(dur)
	var wg sync.WaitGroup
	var ops atomic.Int64
	for w := 0; w < 12; w++ {
		rng := rand.New(rand.NewSource(seed + int64(w)))
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(deadline) {
				chaosRound(d.MQTTAddr(), rng, &ops)
			}
		}()
	}
	wg.Wait()
	t.Logf("%d operations", ops.Load())
	if err := d.Err(); err != nil {
		t.Fatalf("the gateway failed: %v", err)
	}
	// The mochi-based layer's in-flight gauge went negative after queued
	// messages were delivered to reconnecting sessions.
	testutil.WaitFor(t, 10*time.Second, "the chaos clients to be gone", func() bool { return d.broker.Clients() == 0 })
	if n := d.broker.Inflight(); n < 0 {
		t.Fatalf("in-flight gauge %d after the chaos", n)
	}
	assertAnswersAndStops(t, d)
}

// chaosRound connects one client (an id from a small pool, so sessions
// are taken over), does a few random things and leaves, gracefully or
// not. Errors are part of the chaos: only the gateway's state after is
// checked.
func chaosRound(addr string, rng *rand.Rand, ops *atomic.Int64) {
	id := fmt.Sprintf("chaos-%d", rng.Intn(8))
	conn, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		return
	}
	defer conn.Close()
	recvMax := uint16(1 + rng.Intn(30))
	expiry := uint32(rng.Intn(2) * 60)
	c := paho.NewClient(paho.ClientConfig{ClientID: id, Conn: conn,
		OnPublishReceived: []func(paho.PublishReceived) (bool, error){func(paho.PublishReceived) (bool, error) { return true, nil }}})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	if _, err := c.Connect(ctx, &paho.Connect{ClientID: id, CleanStart: rng.Intn(2) == 0, KeepAlive: 30,
		Properties: &paho.ConnectProperties{ReceiveMaximum: &recvMax, SessionExpiryInterval: &expiry}}); err != nil {
		return
	}
	for i := rng.Intn(20); i >= 0; i-- {
		ops.Add(1)
		switch rng.Intn(4) {
		case 0:
			_, _ = c.Subscribe(ctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{
				{Topic: []string{"chaos/#", "chaos/+/x", "$share/g/chaos/#", "chaos/a"}[rng.Intn(4)], QoS: byte(rng.Intn(3))}}})
		case 1:
			_, _ = c.Unsubscribe(ctx, &paho.Unsubscribe{Topics: []string{"chaos/#"}})
		default:
			_, _ = c.Publish(ctx, &paho.Publish{Topic: []string{"chaos/a", "chaos/b/x", "chaos/c"}[rng.Intn(3)],
				QoS: byte(rng.Intn(3)), Retain: rng.Intn(10) == 0, Payload: []byte("x")})
		}
	}
	if rng.Intn(2) == 0 {
		_ = c.Disconnect(&paho.Disconnect{})
	}
}

// mqtt.websocket.listen opens MQTT over WebSocket with the gateway's users
// and log: a publish over it is acked, logged and delivered to a TCP
// subscriber.
func TestWebSocketListenerFromConfig(t *testing.T) {
	d := testGateway(t, t.TempDir(), func(c *config.Config) { c.MQTT.WebSocket.Listen = "127.0.0.1:0" })
	if d.MQTTWSAddr() == "" {
		t.Fatal("no websocket listener")
	}
	sub, got := v5(t, d.MQTTAddr(), "tcp-sub", nil)
	subscribe(t, sub, "ws/#", 1)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	wc, _, err := websocket.Dial(ctx, "ws://"+d.MQTTWSAddr()+"/mqtt", &websocket.DialOptions{Subprotocols: []string{"mqtt"}})
	if err != nil {
		t.Fatal(err)
	}
	// paho.golang writes a packet as several Writes and locks only a
	// sync.Locker: over WebSocket each Write is a message, so lock it.
	c := paho.NewClient(paho.ClientConfig{ClientID: "browser", Conn: &lockedConn{Conn: websocket.NetConn(context.Background(), wc, websocket.MessageBinary)}})
	if ca, err := c.Connect(ctx, &paho.Connect{ClientID: "browser", CleanStart: true, KeepAlive: 30}); err != nil || ca.ReasonCode != 0 {
		t.Fatalf("connect: %v %+v", err, ca)
	}
	defer c.Disconnect(&paho.Disconnect{})
	if r, err := c.Publish(ctx, &paho.Publish{Topic: "ws/x", QoS: 1, Payload: []byte("from a browser")}); err != nil || r.ReasonCode != 0 {
		t.Fatalf("publish: %v %+v", err, r)
	}
	if p := receive(t, got, 5*time.Second); string(p.Payload) != "from a browser" {
		t.Fatalf("got %q", p.Payload)
	}
	found := false
	for _, r := range logRecords(t, d) {
		found = found || (r.Topic == "ws/x" && r.ClientID == "browser")
	}
	if !found {
		t.Fatal("the websocket publish is not in the log")
	}
}

// A persistent session lives on every member: a device that subscribed
// through one gateway and connects to another finds its session there
// (session present, the same subscription) and gets what was published to
// its filter while it was away, each message once, then new ones.
func TestPersistentSessionMovesToAnotherMember(t *testing.T) {
	g1, g2 := twoGateways(t, "gw") // fieldview_test.go
	expiry := uint32(300)
	persistent := func() *paho.Connect {
		return &paho.Connect{CleanStart: false, Properties: &paho.ConnectProperties{SessionExpiryInterval: &expiry}}
	}
	dev, got := v5(t, g1.MQTTAddr(), "mover", persistent())
	subscribe(t, dev, "mv/#", 1)
	pub, _ := v5(t, g1.MQTTAddr(), "mv-pub", nil)
	send := func(from, to int) {
		for i := from; i < to; i++ {
			publish(t, pub, &paho.Publish{Topic: "mv/x", QoS: 1, Payload: []byte(fmt.Sprint("m", i))})
		}
	}
	send(0, 3)
	for i := 0; i < 3; i++ {
		receive(t, got, 5*time.Second)
	}
	if err := dev.Disconnect(&paho.Disconnect{}); err != nil {
		t.Fatal(err)
	}
	// The session goes offline on gw-1 once it has read the DISCONNECT:
	// its "off" record, and the cursor record proposed right after it,
	// go into the log before the publishes below. (A device that moves
	// before its cursor is logged may get the un-replicated window again,
	// as QoS 1 allows: not what this test is about.)
	testutil.WaitFor(t, 10*time.Second, "gw-1 to log the session going offline", func() bool {
		for _, r := range logRecords(t, g1) {
			if r.ClientID == "mover" && r.Topic == "$tandem/session" && strings.Contains(string(r.Payload), `"op":"off"`) {
				return true
			}
		}
		return false
	})
	send(3, 8) // while the device is away
	testutil.WaitFor(t, 10*time.Second, "gw-2 to apply the whole log", func() bool {
		return statusOfGW(t, g2).Log.AppliedIndex >= statusOfGW(t, g1).Log.LastIndex
	})
	c, moved, ca := resume(t, g2.MQTTAddr(), "mover", expiry)
	defer c.Disconnect(&paho.Disconnect{})
	if !ca.SessionPresent {
		t.Fatal("the session is not present on the other member")
	}
	seen := map[string]int{}
	for i := 3; i < 8; {
		p := receive(t, moved, 10*time.Second)
		seen[string(p.Payload)]++
		if string(p.Payload) == fmt.Sprint("m", i) {
			i++
		}
	}
	for k, n := range seen {
		if n != 1 {
			t.Errorf("%s handed %d times on the other member", k, n)
		}
	}
	if len(seen) != 5 {
		t.Errorf("handed %v on the other member, want m3..m7 once each (the cursor came along)", seen)
	}
	send(8, 9)
	if p := receive(t, moved, 10*time.Second); string(p.Payload) != "m8" {
		t.Fatalf("after the move: %q", p.Payload)
	}
}

// A device whose messages were handed to it on one member but never acked
// (its connection died with them in flight) gets them from the other
// member: the cursor the members share stops below what is unacked.
func TestUnackedMessagesFollowTheSessionToAnotherMember(t *testing.T) {
	g1, g2 := twoGateways(t, "gw") // fieldview_test.go
	expiry := uint32(300)
	connect := func(addr string, manual bool, got chan *paho.Publish) *paho.Client {
		conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		c := paho.NewClient(paho.ClientConfig{ClientID: "lossy", Conn: conn, EnableManualAcknowledgment: manual,
			OnPublishReceived: []func(paho.PublishReceived) (bool, error){func(pr paho.PublishReceived) (bool, error) {
				got <- pr.Packet
				return true, nil
			}}})
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if ca, err := c.Connect(ctx, &paho.Connect{ClientID: "lossy", CleanStart: false, KeepAlive: 30,
			Properties: &paho.ConnectProperties{SessionExpiryInterval: &expiry}}); err != nil || ca.ReasonCode != 0 {
			t.Fatalf("connect: %v %+v", err, ca)
		}
		t.Cleanup(func() { conn.Close() })
		return c
	}
	first := make(chan *paho.Publish, 16)
	c1 := connect(g1.MQTTAddr(), true, first) // never acks
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := c1.Subscribe(ctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: "ls/#", QoS: 1}}}); err != nil {
		t.Fatal(err)
	}
	pub, _ := v5(t, g1.MQTTAddr(), "ls-pub", nil)
	for i := 0; i < 4; i++ {
		publish(t, pub, &paho.Publish{Topic: "ls/x", QoS: 1, Payload: []byte(fmt.Sprint("u", i))})
	}
	for i := 0; i < 4; i++ {
		receive(t, first, 5*time.Second) // handed out, not acked
	}
	// The cursors replicate every 100 ms while the device is connected:
	// wait for one round past the deliveries, then kill the connection.
	testutil.WaitFor(t, 10*time.Second, "gw-2 to apply the whole log", func() bool {
		last := statusOfGW(t, g1).Log.LastIndex
		return statusOfGW(t, g2).Log.AppliedIndex >= last && last > 0
	})
	c1.Disconnect(&paho.Disconnect{ReasonCode: 0x04}) // in flight: u0..u3
	testutil.WaitFor(t, 10*time.Second, "gw-2 to apply the disconnect", func() bool {
		return statusOfGW(t, g2).Log.AppliedIndex >= statusOfGW(t, g1).Log.LastIndex && g1.broker.Clients() == 1
	})
	moved := make(chan *paho.Publish, 16)
	connect(g2.MQTTAddr(), false, moved)
	seen := map[string]bool{}
	for len(seen) < 4 {
		seen[string(receive(t, moved, 10*time.Second).Payload)] = true
	}
}

// Two connections with one client id on two members: the later one wins
// cluster-wide, through the log — the earlier is ended with 0x8E.
func TestTakeOverAcrossMembers(t *testing.T) {
	g1, g2 := twoGateways(t, "gw") // fieldview_test.go
	expiry := uint32(300)
	ended := make(chan byte, 1)
	conn, err := net.DialTimeout("tcp", g2.MQTTAddr(), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	early := paho.NewClient(paho.ClientConfig{ClientID: "twice", Conn: conn,
		OnServerDisconnect: func(d *paho.Disconnect) { ended <- d.ReasonCode }})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if ca, err := early.Connect(ctx, &paho.Connect{ClientID: "twice", CleanStart: false, KeepAlive: 30,
		Properties: &paho.ConnectProperties{SessionExpiryInterval: &expiry}}); err != nil || ca.ReasonCode != 0 {
		t.Fatalf("connect on gw-2: %v %+v", err, ca)
	}
	// Its start is in the log (forwarded by gw-2 to the master), applied
	// on both, before the second connects.
	testutil.WaitFor(t, 10*time.Second, "the start in the log, applied on gw-2", func() bool {
		started := false
		for _, r := range logRecords(t, g1) {
			started = started || (r.Topic == "$tandem/session" && r.ClientID == "twice")
		}
		return started && statusOfGW(t, g2).Log.AppliedIndex >= statusOfGW(t, g1).Log.LastIndex
	})
	v5(t, g1.MQTTAddr(), "twice", &paho.Connect{CleanStart: false, Properties: &paho.ConnectProperties{SessionExpiryInterval: &expiry}})
	select {
	case code := <-ended:
		if code != 0x8E {
			t.Fatalf("the earlier connection ended with %#x, want 0x8E", code)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the earlier connection on the other member was not ended")
	}
}

// lockedConn makes a connection a sync.Locker, so that paho.golang writes
// each packet whole.
type lockedConn struct {
	net.Conn
	sync.Mutex
}
