package mqtt

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// persistentConnect connects id with a persistent session (MQTT 5:
// expiry 600 s; 3.1.1: clean session 0) and returns the client and its
// CONNACK.
func persistentConnect(t *testing.T, addr string, v byte, id string) (*raw, packets.Packet) {
	t.Helper()
	var props *packets.Properties
	if v == 5 {
		props = &packets.Properties{SessionExpiryInterval: 600, SessionExpiryIntervalFlag: true}
	}
	r := dialRaw(t, addr, v)
	return r, r.connect(id, false, props)
}

// Issue 31: 120 persistent sessions of 1000 filters of 1 KB took 460 MB of
// data dir on a 64 MiB budget. Past max_session_bytes a CONNECT that would
// start a new persistent session gets CONNACK 0x97 (3.1.1: 0x03), counted;
// a session resuming is taken, so is a clean one (nothing is kept of it),
// and a session that ends gives its bytes back.
func TestNewPersistentSessionPastMaxSessionBytesIsRefused(t *testing.T) {
	obs := &refusalCounter{}
	id := func(n string) string { return n + strings.Repeat("i", 64-len(n)) }
	one := sessionRecSize(id("x"), "")
	s, _ := testServer(t, nil, func(c *Config) { c.Limits.MaxSessionBytes = 2*one + one/2; c.Observer = obs })
	for _, v := range []byte{4, 5} {
		if _, ack := persistentConnect(t, s.Addr(), v, id(fmt.Sprint("fits", v))); ack.ReasonCode != 0 {
			t.Fatalf("MQTT %d: a session within the cap: CONNACK %#x", v, ack.ReasonCode)
		}
	}
	if got := s.SessionBytes(); got != 2*one {
		t.Fatalf("two sessions count %d bytes, want %d", got, 2*one)
	}
	for _, v := range []byte{4, 5} {
		want := packets.ErrQuotaExceeded.Code
		if v == 4 {
			want = 0x03 // server unavailable
		}
		if _, ack := persistentConnect(t, s.Addr(), v, id(fmt.Sprint("over", v))); ack.ReasonCode != want {
			t.Fatalf("MQTT %d: a new persistent session past max_session_bytes: CONNACK %#x, want %#x", v, ack.ReasonCode, want)
		}
	}
	if n := obs.count(whySessionBytes); n != 2 {
		t.Fatalf("%d refusals counted as %q, want 2", n, whySessionBytes)
	}
	// Resuming is always taken; a clean session keeps nothing.
	c5, ack := persistentConnect(t, s.Addr(), 5, id("fits5"))
	if ack.ReasonCode != 0 || !ack.SessionPresent {
		t.Fatalf("resuming a session: CONNACK %#x present %v", ack.ReasonCode, ack.SessionPresent)
	}
	connected(t, s, 4, id("clean4"))
	// One ending (3.1.1 clean session over it) gives its bytes back.
	connected(t, s, 4, id("fits4")).write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
	c5.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
	testutil.WaitFor(t, 5*time.Second, "the ended session's bytes given back", func() bool { return s.SessionBytes() == one })
	if _, ack := persistentConnect(t, s.Addr(), 4, id("later4")); ack.ReasonCode != 0 {
		t.Fatalf("a new session once one ended: CONNACK %#x", ack.ReasonCode)
	}
}

// Past max_session_bytes a SUBSCRIBE filter that would add bytes to a
// persistent session gets SUBACK 0x97 (3.1.1: 0x80), counted, the others
// granted; subscribing again to a filter it holds is taken, and an
// unsubscribe makes room. A clean session's filters are not kept, and not
// counted.
func TestSubscriptionPastMaxSessionBytesIsRefused(t *testing.T) {
	for _, v := range []byte{4, 5} {
		t.Run(fmt.Sprintf("v%d", v), func(t *testing.T) {
			obs := &refusalCounter{}
			id := fmt.Sprint("subs", v)
			f := func(n int) string { return fmt.Sprintf("f%d/", n) + strings.Repeat("x", 200) }
			cap := sessionRecSize(id, "") + 2*subRecSize(id, f(1)) + 10
			s, _ := testServer(t, nil, func(c *Config) { c.Limits.MaxSessionBytes = cap; c.Observer = obs })
			c, ack := persistentConnect(t, s.Addr(), v, id)
			if ack.ReasonCode != 0 {
				t.Fatalf("CONNACK %#x", ack.ReasonCode)
			}
			over := packets.ErrQuotaExceeded.Code
			if v == 4 {
				over = 0x80
			}
			sub := func(pid uint16, filters ...string) []byte {
				t.Helper()
				var subs []packets.Subscription
				for _, fl := range filters {
					subs = append(subs, packets.Subscription{Filter: fl, Qos: 1})
				}
				return c.subscribe(pid, subs...).ReasonCodes
			}
			if got := sub(1, f(1), f(2), f(3)); !bytes.Equal(got, []byte{1, 1, over}) {
				t.Fatalf("three filters, room for two: SUBACK %x, want 01 01 %02x", got, over)
			}
			if got := sub(2, f(1)); !bytes.Equal(got, []byte{1}) {
				t.Fatalf("a filter held, again: SUBACK %x, want 01", got)
			}
			c.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Unsubscribe, Qos: 1}, PacketID: 3, Filters: packets.Subscriptions{{Filter: f(2)}}})
			c.expect(packets.Unsuback)
			if got := sub(4, f(3)); !bytes.Equal(got, []byte{1}) {
				t.Fatalf("a filter after an unsubscribe made room: SUBACK %x, want 01", got)
			}
			why := whySessionSubBytes + ": subscription refused"
			if n := obs.count(why); n != 1 {
				t.Fatalf("%d refusals counted as %q, want 1", n, why)
			}
			clean := connected(t, s, v, "clean")
			var many []packets.Subscription
			for i := 0; i < 5; i++ {
				many = append(many, packets.Subscription{Filter: f(10 + i), Qos: 1})
			}
			if got := clean.subscribe(1, many...).ReasonCodes; !bytes.Equal(got, []byte{1, 1, 1, 1, 1}) {
				t.Fatalf("a clean session's filters: SUBACK %x, want all granted", got)
			}
		})
	}
}

// The sessions other members started count here too (every member keeps
// them), and what is counted is counted again after a restart.
func TestSessionBytesCountTheClustersSessionsAndSurviveARestart(t *testing.T) {
	l := newSharedLog()
	long := strings.Repeat("o", 4000)
	one := sessionRecSize(long, "") + subRecSize(long, "a/#")
	capped := func(c *Config) { c.Limits.MaxSessionBytes = one + 100; c.Limits.MaxClientIDLength = 8000 }
	b := startMemberWith(t, &member{l: l, id: 2, store: newMemStore()}, capped)
	l.add(&Message{Kind: KindSession, Origin: 9, Seq: 1, ClientID: long, Payload: []byte(`{"op":"start","expiry":600}`)})
	l.add(&Message{Kind: KindSession, Origin: 9, Seq: 2, ClientID: long, Payload: []byte(`{"op":"sub","f":"a/#","q":1}`)})
	b.caughtUp(t)
	if got := b.srv.SessionBytes(); got != one {
		t.Fatalf("another member's session counts %d bytes here, want %d", got, one)
	}
	if _, ack := persistentConnect(t, b.srv.Addr(), 5, "new"); ack.ReasonCode != packets.ErrQuotaExceeded.Code {
		t.Fatalf("a new session past max_session_bytes, the other member's counted: CONNACK %#x, want 0x97", ack.ReasonCode)
	}
	b.halt(t)
	again := startMemberWith(t, &member{l: l, id: 2, store: b.store, applied: b.applied}, capped)
	if got := again.srv.SessionBytes(); got != one {
		t.Fatalf("after a restart the sessions count %d bytes, want %d", got, one)
	}
}
