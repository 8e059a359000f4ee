package mqtt

import (
	"context"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	"github.com/mochi-mqtt/server/v2/packets"
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
