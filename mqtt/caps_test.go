package mqtt

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// Per-client caps (DESIGN.md, "Budgets"): each refuses the client that
// goes over it, in a way the client can read, and counts the refusal.

// refusalCounter counts the refusals the server reports, by reason.
type refusalCounter struct {
	nopObserver
	mu  sync.Mutex
	got map[string]int
}

func (o *refusalCounter) Refused(reason string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.got == nil {
		o.got = map[string]int{}
	}
	o.got[reason]++
}

func (o *refusalCounter) count(reason string) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.got[reason]
}

// connack sends a raw CONNECT frame and returns the CONNACK's reason code.
func connack(t *testing.T, r *raw, frame []byte) byte {
	t.Helper()
	r.send(frame)
	return r.expect(packets.Connack).ReasonCode
}

// A client id over max_client_id_length is refused with CONNACK 0x85
// (3.1.1: 0x02) before anything is kept of it; one at the limit connects.
// A 60 KB id was accepted, and became a key of the session map.
func TestClientIDLongerThanMaxIsRefused(t *testing.T) {
	obs := &refusalCounter{}
	s, _ := testServer(t, nil, func(c *Config) { c.Limits.MaxClientIDLength = 32; c.Observer = obs })
	const why = "client id longer than max_client_id_length"
	long, max := strings.Repeat("d", 33), strings.Repeat("d", 32)
	for _, v := range []byte{4, 5} {
		want := packets.ErrClientIdentifierNotValid.Code
		if v == 4 {
			want = 0x02 // identifier rejected
		}
		if code := connack(t, dialRaw(t, s.Addr(), v), connectFrame(v, long, nil, nil)); code != want {
			t.Fatalf("MQTT %d, 33-byte id: CONNACK %#x, want %#x", v, code, want)
		}
		if code := connack(t, dialRaw(t, s.Addr(), v), connectFrame(v, max, nil, nil)); code != 0 {
			t.Fatalf("MQTT %d, 32-byte id: CONNACK %#x, want 0", v, code)
		}
	}
	if n := obs.count(why); n != 2 {
		t.Fatalf("%d refusals counted as %q, want 2", n, why)
	}
	// The default, 256, for a real client sending a 60 KB id.
	d, _ := testServer(t, nil, nil)
	conn, err := net.DialTimeout("tcp", d.Addr(), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	c := paho.NewClient(paho.ClientConfig{Conn: conn})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ca, err := c.Connect(ctx, &paho.Connect{ClientID: strings.Repeat("x", 60<<10), CleanStart: true, KeepAlive: 30})
	if ca == nil || ca.ReasonCode != packets.ErrClientIdentifierNotValid.Code {
		t.Fatalf("60 KB client id: CONNACK %+v (%v), want 0x85", ca, err)
	}
	if n := d.Clients(); n != 0 {
		t.Fatalf("%d clients connected after the refusal", n)
	}
}

// A SUBSCRIBE that would take a session past max_filters_per_session gets
// 0x97 quota exceeded (3.1.1: 0x80) for the filters over it, and the rest
// granted; a filter the session holds replaces its subscription
// [MQTT-3.8.4-3] and takes no second place; an unsubscribe frees one.
func TestFiltersPerSessionOverMaxGetQuotaExceeded(t *testing.T) {
	obs := &refusalCounter{}
	s, _ := testServer(t, nil, func(c *Config) { c.Limits.MaxFiltersPerSession = 3; c.Observer = obs })
	pub := connected(t, s, 5, "pub")
	for _, v := range []byte{4, 5} {
		over := packets.ErrQuotaExceeded.Code
		if v == 4 {
			over = 0x80
		}
		id := fmt.Sprintf("filters%d", v)
		c := connected(t, s, v, id)
		sub := func(pid uint16, filters ...packets.Subscription) []byte {
			t.Helper()
			sa := c.subscribe(pid, filters...)
			if sa.PacketID != pid {
				t.Fatalf("SUBACK for packet id %d, want %d", sa.PacketID, pid)
			}
			return sa.ReasonCodes
		}
		a, b := id+"/a", id+"/b"
		if got := sub(1, packets.Subscription{Filter: a, Qos: 1}, packets.Subscription{Filter: b, Qos: 1}); !bytes.Equal(got, []byte{1, 1}) {
			t.Fatalf("MQTT %d: first two filters: SUBACK %x", v, got)
		}
		// a again at QoS 0 replaces its subscription: c is the third
		// filter, d the fourth.
		got := sub(2, packets.Subscription{Filter: a, Qos: 0}, packets.Subscription{Filter: id + "/c", Qos: 1},
			packets.Subscription{Filter: id + "/d", Qos: 1})
		if !bytes.Equal(got, []byte{0, 1, over}) {
			t.Fatalf("MQTT %d: a again, c, d: SUBACK %x, want 00 01 %02x", v, got, over)
		}
		// Replaced, not added: a delivers at QoS 0 (two subscriptions
		// would merge to the highest, 1).
		// At QoS 0 a delivery may be dropped (a session catching up drops
		// QoS 0, as a loaded race run showed): publish until one arrives.
		var p packets.Packet
		for i := uint16(1); ; i++ {
			pub.publish(a, 1, i, "to a")
			pub.expect(packets.Puback)
			var err error
			if p, err = c.read(time.Second); err == nil {
				break
			}
			if i == 10 {
				t.Fatalf("MQTT %d: no delivery on a after %d publishes: %v", v, i, err)
			}
		}
		if p.FixedHeader.Type != packets.Publish || p.FixedHeader.Qos != 0 || string(p.Payload) != "to a" {
			t.Fatalf("MQTT %d: delivery on a: type %d QoS %d %q, want a QoS 0 PUBLISH", v, p.FixedHeader.Type, p.FixedHeader.Qos, p.Payload)
		}
		// Any further copies of it: not in the way of the UNSUBACK.
		for {
			q, err := c.read(200 * time.Millisecond)
			if err != nil {
				break
			}
			if q.FixedHeader.Type != packets.Publish || q.FixedHeader.Qos != 0 {
				t.Fatalf("MQTT %d: after the delivery on a: type %d QoS %d", v, q.FixedHeader.Type, q.FixedHeader.Qos)
			}
		}
		c.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Unsubscribe, Qos: 1}, PacketID: 3,
			Filters: packets.Subscriptions{{Filter: b}}})
		c.expect(packets.Unsuback)
		if got := sub(4, packets.Subscription{Filter: id + "/d", Qos: 1}); !bytes.Equal(got, []byte{1}) {
			t.Fatalf("MQTT %d: d after unsubscribing b: SUBACK %x", v, got)
		}
	}
	if n := obs.count("max_filters_per_session reached: subscription refused"); n != 2 {
		t.Fatalf("%d refusals counted, want 2", n)
	}
}

// dialFrom is dialRaw from the loopback address local (127.0.0.x).
func dialFrom(t *testing.T, addr, local string, v byte) *raw {
	t.Helper()
	d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(local)}}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &raw{t: t, c: c, v: v, rd: &bytesReader{c}}
}

// loginFrame is a CONNECT of protocol version v with a user name and
// password.
func loginFrame(t *testing.T, v byte, id, user, password string) []byte {
	t.Helper()
	pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect}, ProtocolVersion: v,
		Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), ClientIdentifier: id, Clean: true, Keepalive: 30,
			UsernameFlag: true, Username: []byte(user), PasswordFlag: true, Password: []byte(password)}}
	var b bytes.Buffer
	if err := pk.ConnectEncode(&b); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// Clients connected at once from one address are capped by
// max_connections_per_address, loopback included: one more gets CONNACK
// 0x97 (3.1.1: 0x03) and is counted; another address is not affected;
// a connection that ends frees its place.
func TestConnectionsPerAddressOverMaxAreRefused(t *testing.T) {
	obs := &refusalCounter{}
	s, _ := testServer(t, nil, func(c *Config) { c.Limits.MaxConnectionsPerAddress = 2; c.Observer = obs })
	const why = "max_connections_per_address reached: CONNECT refused"
	first := connected(t, s, 5, "a1")
	connected(t, s, 4, "a2")
	if code := connack(t, dialRaw(t, s.Addr(), 5), connectFrame(5, "a3", nil, nil)); code != packets.ErrQuotaExceeded.Code {
		t.Fatalf("MQTT 5, third from 127.0.0.1: CONNACK %#x, want 0x97", code)
	}
	if code := connack(t, dialRaw(t, s.Addr(), 4), connectFrame(4, "a3", nil, nil)); code != 0x03 {
		t.Fatalf("3.1.1, third from 127.0.0.1: CONNACK %#x, want 0x03", code)
	}
	// A real client reads the reason.
	conn, err := net.DialTimeout("tcp", s.Addr(), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	pc := paho.NewClient(paho.ClientConfig{Conn: conn})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if ca, err := pc.Connect(ctx, &paho.Connect{ClientID: "a3", CleanStart: true, KeepAlive: 30}); ca == nil || ca.ReasonCode != packets.ErrQuotaExceeded.Code {
		t.Fatalf("paho, third from 127.0.0.1: CONNACK %+v (%v), want 0x97", ca, err)
	}
	if n := obs.count(why); n != 3 {
		t.Fatalf("%d refusals counted, want 3", n)
	}
	other := dialFrom(t, s.Addr(), "127.0.0.2", 5)
	if code := connack(t, other, connectFrame(5, "b1", nil, nil)); code != 0 {
		t.Fatalf("first from 127.0.0.2: CONNACK %#x", code)
	}
	first.c.Close()
	testutil.WaitFor(t, 5*time.Second, "the first connection to end", func() bool { return s.Clients() == 2 })
	if code := connack(t, dialRaw(t, s.Addr(), 5), connectFrame(5, "a3", nil, nil)); code != 0 {
		t.Fatalf("after one of 127.0.0.1's ended: CONNACK %#x, want 0", code)
	}
}

// Clients connected at once under one user name are capped by
// max_connections_per_user, whatever their addresses: one more gets
// CONNACK 0x97 (3.1.1: 0x03) and is counted; other users are not
// affected.
func TestConnectionsPerUserOverMaxAreRefused(t *testing.T) {
	users, err := ParseUsers(strings.NewReader(hashLine(t, "alice", "pw")+"\n"+hashLine(t, "bob", "pw")+"\n"), "users")
	if err != nil {
		t.Fatal(err)
	}
	obs := &refusalCounter{}
	s, _ := testServer(t, nil, func(c *Config) {
		c.Users, c.AllowAnonymous = users, false
		c.Limits.MaxConnectionsPerUser = 2
		c.Observer = obs
	})
	const why = "max_connections_per_user reached: CONNECT refused"
	for i, local := range []string{"127.0.0.1", "127.0.0.2"} {
		v := byte(4 + i%2)
		if code := connack(t, dialFrom(t, s.Addr(), local, v), loginFrame(t, v, "alice"+local, "alice", "pw")); code != 0 {
			t.Fatalf("alice from %s: CONNACK %#x", local, code)
		}
	}
	for _, v := range []byte{4, 5} {
		want := packets.ErrQuotaExceeded.Code
		if v == 4 {
			want = 0x03
		}
		if code := connack(t, dialFrom(t, s.Addr(), "127.0.0.3", v), loginFrame(t, v, "alice3", "alice", "pw")); code != want {
			t.Fatalf("MQTT %d, alice's third: CONNACK %#x, want %#x", v, code, want)
		}
	}
	if n := obs.count(why); n != 2 {
		t.Fatalf("%d refusals counted, want 2", n)
	}
	if code := connack(t, dialFrom(t, s.Addr(), "127.0.0.3", 5), loginFrame(t, 5, "bob1", "bob", "pw")); code != 0 {
		t.Fatalf("bob: CONNACK %#x", code)
	}
}
