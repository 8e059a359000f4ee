package e2e

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	"github.com/eclipse/paho.golang/paho/session/state"
	mqtt3 "github.com/eclipse/paho.mqtt.golang"

	"github.com/tandem-edge/tandem/internal/netns"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// received counts what a device's application was handed, by payload.
type received struct {
	mu  sync.Mutex
	got map[string]int
	how []string
}

func (r *received) add(p string) {
	r.mu.Lock()
	r.got[p]++
	r.mu.Unlock()
}

// missing returns how many of want the device has not got.
func (r *received) missing(want map[string]bool) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for p := range want {
		if r.got[p] == 0 {
			n++
		}
	}
	return n
}

// mover5 is an MQTT 5 device (paho.golang) with a persistent session whose
// client-side state (the QoS 2 packet ids it holds) survives its moves.
type mover5 struct {
	t    *testing.T
	id   string
	from *netns.Host // where its connections start
	sess *state.State
	recv *received
	c    *paho.Client
	n    int
}

// connect connects to addr with clean start off; it returns session present.
func (m *mover5) connect(addr string) bool {
	m.t.Helper()
	conn, err := dialIn(m.from, addr)
	if err != nil {
		m.t.Fatal(err)
	}
	m.t.Cleanup(func() { conn.Close() })
	m.n++
	m.c = paho.NewClient(paho.ClientConfig{ClientID: m.id, Conn: conn, Session: m.sess,
		OnPublishReceived: []func(paho.PublishReceived) (bool, error){func(pr paho.PublishReceived) (bool, error) {
			m.recv.add(string(pr.Packet.Payload))
			m.recv.mu.Lock()
			m.recv.how = append(m.recv.how, fmt.Sprintf("%s pid=%d dup=%v conn=%d", pr.Packet.Payload, pr.Packet.PacketID, pr.Packet.Duplicate(), m.n))
			m.recv.mu.Unlock()
			return true, nil
		}}})
	expiry := uint32(600)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ca, err := m.c.Connect(ctx, &paho.Connect{ClientID: m.id, CleanStart: false, KeepAlive: 30,
		Properties: &paho.ConnectProperties{SessionExpiryInterval: &expiry}})
	if err != nil || ca.ReasonCode != 0 {
		m.t.Fatalf("%s connect to %s: %v %+v", m.id, addr, err, ca)
	}
	return ca.SessionPresent
}

// A device's persistent session moves with it (DESIGN: "a device moves to
// another member"): an MQTT 5 and an MQTT 3.1.1 device subscribed with QoS
// 1 and 2 on the master, which is killed -9 while messages flow; they
// reconnect to another member with clean start off and find their session
// there (session present, the same subscriptions) and every acked message
// published to their filters; QoS 2 ones exactly once to the MQTT 5 device,
// whose client keeps its packet-id state [MQTT-4.3.3-9]; QoS 1 duplicates
// are counted (at most the cursor window since the last replicated batch).
func TestPersistentSessionMovesWhenItsGatewayDies(t *testing.T) {
	t.Parallel()
	nt := netns.New(t, 3)
	g1, g2, g3 := startThree(t, nt)
	g2.join(g1)
	waitShape(t, g1, 0, 1, 15*time.Second)
	g3.join(g2)
	waitShape(t, g1, 2, 0, 15*time.Second)
	addr := func(g *gw) string { return g.h.Addr() + ":1883" }
	subs := []paho.SubscribeOptions{{Topic: "mv/1/#", QoS: 1}, {Topic: "mv/2/#", QoS: 2}}

	d5 := &mover5{t: t, id: "mover5", from: g3.h, sess: state.NewInMemory(), recv: &received{got: map[string]int{}}}
	d5.connect(addr(g1))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	if _, err := d5.c.Subscribe(ctx, &paho.Subscribe{Subscriptions: subs}); err != nil {
		t.Fatal(err)
	}
	cancel()

	// The 3.1.1 device: paho.mqtt.golang, its brokers g1 then g2, dialled
	// from g3's host; it goes to g2 by itself when g1 dies.
	r3 := &received{got: map[string]int{}}
	o := mqtt3.NewClientOptions().AddBroker("tcp://" + addr(g1)).AddBroker("tcp://" + addr(g2)).
		SetClientID("mover3").SetCleanSession(false).SetProtocolVersion(4).SetAutoReconnect(true).
		SetConnectRetry(true).SetMaxReconnectInterval(500 * time.Millisecond).SetOrderMatters(false).
		SetCustomOpenConnectionFn(func(u *url.URL, _ mqtt3.ClientOptions) (net.Conn, error) { return dialIn(g3.h, u.Host) }).
		SetDefaultPublishHandler(func(_ mqtt3.Client, m mqtt3.Message) { r3.add(string(m.Payload())) })
	c3 := mqtt3.NewClient(o)
	if tok := c3.Connect(); !tok.WaitTimeout(5*time.Second) || tok.Error() != nil {
		t.Fatalf("3.1.1 connect: %v", tok.Error())
	}
	// It does not subscribe again after its move (paho.mqtt.golang's
	// ResumeSubs is off): what reaches it on gw-2 comes through the
	// session it finds there.
	if tok := c3.SubscribeMultiple(map[string]byte{"mv/1/#": 1, "mv/2/#": 2}, nil); !tok.WaitTimeout(5*time.Second) || tok.Error() != nil {
		t.Fatalf("3.1.1 subscribe: %v", tok.Error())
	}
	t.Cleanup(func() { c3.Disconnect(0) })

	// A publisher on g3 sends QoS 1 and QoS 2 in turn, paced, and keeps
	// what was acked; it outlives the master's death (g3 stays up).
	acked := map[string]bool{}
	var amu sync.Mutex
	stop := make(chan struct{})
	var wg sync.WaitGroup
	pub, err := device(t, g3, "mv-pub", nil)
	if err != nil {
		t.Fatal(err)
	}
	count := func() int {
		amu.Lock()
		defer amu.Unlock()
		return len(acked)
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-tick.C:
			}
			q := byte(1 + i%2)
			p := fmt.Sprintf("m%d-q%d", i, q)
			ctx, cancel := context.WithTimeout(context.Background(), 8*time.Second)
			r, err := pub.Publish(ctx, &paho.Publish{Topic: fmt.Sprintf("mv/%d/x", q), QoS: q, Payload: []byte(p)})
			cancel()
			if err == nil && r.ReasonCode < 0x80 {
				amu.Lock()
				acked[p] = true
				amu.Unlock()
			}
		}
	}()
	testutil.WaitFor(t, 20*time.Second, "100 acked publishes before the kill", func() bool { return count() >= 100 })
	g1.kill()
	// A new connection may take the client's session state only once the
	// old one has let go of it (paho.golang's issue #160): its last
	// messages handled and their PUBRECs noted.
	select {
	case <-d5.c.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the MQTT 5 client did not notice its gateway's death")
	}
	if !d5.connect(addr(g2)) {
		t.Fatal("MQTT 5 device on gw-2 after gw-1 died: session present = 0")
	}
	testutil.WaitFor(t, 20*time.Second, "the 3.1.1 device back with its session", func() bool {
		return c3.IsConnectionOpen()
	})
	before := count()
	testutil.WaitFor(t, 30*time.Second, "200 acked publishes after the kill", func() bool { return count() >= before+200 })
	close(stop)
	wg.Wait()

	amu.Lock()
	want := map[string]bool{}
	for p := range acked {
		want[p] = true
	}
	amu.Unlock()
	for name, r := range map[string]*received{"MQTT 5": d5.recv, "3.1.1": r3} {
		testutil.WaitFor(t, 30*time.Second, name+" device has every acked message", func() bool { return r.missing(want) == 0 },
			func() string { return fmt.Sprintf("%d of %d missing", r.missing(want), len(want)) })
	}
	dup1, dup2 := 0, 0
	d5.recv.mu.Lock()
	for p, n := range d5.recv.got {
		switch {
		case n > 1 && strings.HasSuffix(p, "-q2"):
			dup2++
			if dup2 < 5 {
				t.Errorf("QoS 2 message %s handed to the MQTT 5 device %d times", p, n)
				for _, h := range d5.recv.how {
					if strings.HasPrefix(h, p+" ") {
						t.Logf("  handed over as %s", h)
					}
				}
			}
		case n > 1:
			dup1 += n - 1
		}
	}
	d5.recv.mu.Unlock()
	if dup2 > 0 {
		t.Errorf("%d QoS 2 messages delivered more than once across the move", dup2)
	}
	t.Logf("%d acked messages; MQTT 5 device: %d QoS 1 duplicates, %d QoS 2 duplicates across the move", len(want), dup1, dup2)
	for _, g := range []*gw{g2, g3} {
		if g.status() == nil {
			t.Fatalf("%s does not answer", g.name)
		}
	}
	g2.stop()
	g3.stop()
	for p, n := range payloads(t, g2) {
		if n > 1 && want[p] {
			t.Errorf("acked message %s is in gw-2's log %d times", p, n)
		}
	}
}
