package mqtt

import (
	"bytes"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// cursorOf is the cursor of srv's session id (0 when it has none).
func cursorOf(srv *Server, id string) uint64 {
	srv.mu.Lock()
	se := srv.sessions[id]
	srv.mu.Unlock()
	if se == nil {
		return 0
	}
	se.mu.Lock()
	defer se.mu.Unlock()
	return se.cursor
}

// cursorRecords returns the payloads of the cursor records origin logged.
func cursorRecords(l *sharedLog, origin uint64) [][]byte {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out [][]byte
	for _, r := range l.recs {
		if r.Kind == KindCursors && r.Origin == origin {
			out = append(out, r.Payload)
		}
	}
	return out
}

// deliverAll adds msgs QoS 1 messages on c/x to l and has every device
// take and acknowledge them; it returns the last one's index.
func deliverAll(t *testing.T, l *sharedLog, devs []*raw, from, msgs int) uint64 {
	t.Helper()
	for j := from; j < from+msgs; j++ {
		l.add(&Message{Origin: 9, Seq: uint64(j), ClientID: "sensor", Topic: "c/x", QoS: 1, Payload: []byte(fmt.Sprint("m", j))})
	}
	l.mu.Lock()
	last := uint64(len(l.recs))
	l.mu.Unlock()
	for _, d := range devs {
		for j := 0; j < msgs; j++ {
			p := d.expect(packets.Publish)
			d.write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: p.PacketID})
		}
	}
	return last
}

// Issue 31: 100 online persistent sessions with 60 KB client ids wrote
// 1,185 MB to disk in 5 s, each cursor record repeating every id. A cursor
// record names a session by a few bytes now, whatever its client id; and
// the other member still moves its offline copy by it: the device that
// moves there after its gateway died is not handed again what it acked.
func TestCursorRecordsStaySmallWithLongClientIDs(t *testing.T) {
	const n, msgs = 8, 10
	l := newSharedLog()
	long := func(c *Config) { c.Limits.MaxClientIDLength = 65535 }
	a := startMemberWith(t, &member{l: l, id: 1, store: newMemStore()}, long)
	b := startMemberWith(t, &member{l: l, id: 2, store: newMemStore()}, long)
	props := &packets.Properties{SessionExpiryInterval: 600, SessionExpiryIntervalFlag: true}
	ids := make([]string, n)
	devs := make([]*raw, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("%02d", i) + strings.Repeat("x", 60000)
		devs[i] = dialRaw(t, a.srv.Addr(), 5)
		if ack := devs[i].connect(ids[i], false, props); ack.ReasonCode != 0 {
			t.Fatalf("CONNACK %#x", ack.ReasonCode)
		}
		devs[i].subscribe(1, packets.Subscription{Filter: "c/#", Qos: 1})
	}
	last := deliverAll(t, l, devs, 1, msgs)
	testutil.WaitFor(t, 10*time.Second, "the other member's copies to have the cursors", func() bool {
		for _, id := range ids {
			if cursorOf(b.srv, id) < last {
				return false
			}
		}
		return true
	})
	entries, size := 0, 0
	for _, p := range cursorRecords(l, 1) {
		cb, err := decodeCursors(p)
		if err != nil {
			t.Fatalf("cursor record unreadable: %v", err)
		}
		entries += len(cb.byRef) + len(cb.byID)
		size += len(p)
	}
	if entries == 0 || size/entries > 16 {
		t.Fatalf("%d cursor records' payloads took %d bytes for %d session cursors: %d bytes each, want 16 at most",
			len(cursorRecords(l, 1)), size, entries, size/max(entries, 1))
	}

	a.kill(t)
	dev := dialRaw(t, b.srv.Addr(), 5)
	if ack := dev.connect(ids[0], false, props); ack.ReasonCode != 0 || !ack.SessionPresent {
		t.Fatalf("on the other member: CONNACK %#x session present %v", ack.ReasonCode, ack.SessionPresent)
	}
	l.add(&Message{Origin: 9, Seq: 1000, ClientID: "sensor", Topic: "c/x", QoS: 1, Payload: []byte("after")})
	if p := dev.expect(packets.Publish); string(p.Payload) != "after" {
		t.Fatalf("on the other member the device was handed %q again, which it had acked", p.Payload)
	}
}

// Below feature level 2 a member may run v0.1.0, which reads cursor
// records as JSON by client id only: they are written so, and applied.
func TestCursorRecordsOfALegacyClusterAreJSONByClientID(t *testing.T) {
	l := newSharedLog()
	a := startMemberWith(t, &member{l: l, id: 1, store: newMemStore(), legacy: true}, nil)
	b := startMemberWith(t, &member{l: l, id: 2, store: newMemStore(), legacy: true}, nil)
	props := &packets.Properties{SessionExpiryInterval: 600, SessionExpiryIntervalFlag: true}
	dev := dialRaw(t, a.srv.Addr(), 5)
	if ack := dev.connect("legacy-dev", false, props); ack.ReasonCode != 0 {
		t.Fatalf("CONNACK %#x", ack.ReasonCode)
	}
	dev.subscribe(1, packets.Subscription{Filter: "c/#", Qos: 1})
	last := deliverAll(t, l, []*raw{dev}, 1, 3)
	testutil.WaitFor(t, 10*time.Second, "the other member's copy to have the cursor", func() bool {
		return cursorOf(b.srv, "legacy-dev") >= last
	})
	for _, p := range cursorRecords(l, 1) {
		if !bytes.HasPrefix(p, []byte(`{"legacy-dev":`)) {
			t.Fatalf("cursor record %q in a cluster below level 2: want the JSON v0.1.0 reads", p)
		}
	}
}

// Cursor records in the data dirs of earlier builds (JSON by client id)
// are applied; so are compact ones by ref, with the client id form for a
// session that has no ref; an undecodable one is counted and skipped.
func TestCursorRecordsOfEveryFormAreApplied(t *testing.T) {
	l := newSharedLog()
	var mu sync.Mutex
	var skipped []string
	b := startMemberWith(t, &member{l: l, id: 2, store: newMemStore()}, func(c *Config) {
		c.Unreadable = func(_ uint64, kind string, _ error) {
			mu.Lock()
			skipped = append(skipped, kind)
			mu.Unlock()
		}
	})
	control := func(kind Kind, id string, p []byte) {
		l.mu.Lock()
		seq := uint64(len(l.recs) + 1)
		l.mu.Unlock()
		l.add(&Message{Kind: kind, Origin: 9, Seq: seq, ClientID: id, Payload: p})
		b.caughtUp(t)
	}
	control(KindSession, "old", []byte(`{"op":"start","expiry":600}`)) // index 1: its ref
	control(KindSession, "other", []byte(`{"op":"start","expiry":600}`))
	steps := []struct {
		what    string
		payload []byte
		id      string
		want    uint64
	}{
		{"JSON by client id, as earlier builds wrote", []byte(`{"old":5}`), "old", 5},
		{"compact by ref", encodeCursors(&cursorBatch{byRef: map[uint64]uint64{1: 7}}), "old", 7},
		{"compact by client id", encodeCursors(&cursorBatch{byRef: map[uint64]uint64{1: 9}, byID: map[string]uint64{"other": 8}}), "other", 8},
	}
	for _, st := range steps {
		control(KindCursors, "", st.payload)
		if got := cursorOf(b.srv, st.id); got != st.want {
			t.Errorf("%s: cursor %d, want %d", st.what, got, st.want)
		}
	}
	if got := cursorOf(b.srv, "old"); got != 9 {
		t.Errorf("the compact record naming both: cursor of the one by ref %d, want 9", got)
	}
	control(KindCursors, "", []byte{cursorsCompact, 5, 1})
	mu.Lock()
	defer mu.Unlock()
	if len(skipped) != 1 || skipped[0] != "cursors" {
		t.Errorf("an undecodable cursor record: skipped %v, want [cursors]", skipped)
	}
}

// A session's ref is kept where the session is: after a restart the
// member still knows which session a compact cursor record names.
func TestSessionRefSurvivesARestart(t *testing.T) {
	l := newSharedLog()
	b := startMember(t, l, 2)
	l.add(&Message{Kind: KindSession, Origin: 9, Seq: 1, ClientID: "dev", Payload: []byte(`{"op":"start","expiry":600}`)})
	b.caughtUp(t)
	b.halt(t)
	again := startMemberWith(t, &member{l: l, id: 2, store: b.store, applied: b.applied}, nil)
	l.add(&Message{Kind: KindCursors, Origin: 9, Seq: 2, Payload: encodeCursors(&cursorBatch{byRef: map[uint64]uint64{1: 2}})})
	again.caughtUp(t)
	if got := cursorOf(again.srv, "dev"); got != 2 {
		t.Fatalf("after a restart the compact cursor record moved the cursor to %d, want 2", got)
	}
}

// The compact encoding reads back what it wrote, cursors going down as
// well as up between sessions.
func TestCursorEncodingRoundTrip(t *testing.T) {
	in := &cursorBatch{byRef: map[uint64]uint64{3: 1 << 40, 1000: 7, 1001: 1<<40 + 5}, byID: map[string]uint64{"a\x00b": 9, "": 1}}
	p := encodeCursors(in)
	if p[0] == '{' {
		t.Fatal("the compact form starts as JSON does")
	}
	out, err := decodeCursors(p)
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(out.byRef) != fmt.Sprint(in.byRef) || fmt.Sprint(out.byID) != fmt.Sprint(in.byID) {
		t.Fatalf("read back %v %v, wrote %v %v", out.byRef, out.byID, in.byRef, in.byID)
	}
	for cut := 1; cut < len(p); cut++ {
		_, _ = decodeCursors(p[:cut]) // a short record is an error, never a panic
	}
}
