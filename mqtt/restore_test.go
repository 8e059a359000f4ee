package mqtt

import (
	"encoding/binary"
	"encoding/json"
	"maps"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
)

// A snapshot carries a session as another member would hold it: the
// messages handed out on this member's connection and not acknowledged
// stay here (the cursor goes back below the oldest), released QoS 2 flows
// and everything else travel as they are.
func TestSnapshotSessionsLeavesOutWhatIsUnackedHere(t *testing.T) {
	cur := func(v uint64) string { return string(binary.BigEndian.AppendUint64(nil, v)) }
	out := func(it outItem) string { return string(encodeOut(&it)) }
	store := map[string]string{
		sessKey("dev"):               `{"v":1,"expiry":3600}`,
		cursorKey("dev"):             cur(100),
		subKey("dev", "a/#"):         `{"q":1}`,
		outKey("dev", 5):             out(outItem{idx: 90, qos: 1, seq: 1}),
		outKey("dev", 6):             out(outItem{idx: 95, qos: 2, rel: true, seq: 2}),
		outKey("dev", 7):             out(outItem{qos: 1, seq: 3, m: &Message{Topic: "r", Payload: []byte("x")}}),
		cursorKey("idle"):            cur(50),
		keyRetained + "t":            `{"index":3}`,
		qos2Key("dev", 9):            string(encodeQoS2(1, 2, time.Unix(1700000000, 0))),
		sessKey("idle"):              `{"v":1,"expiry":60}`,
		subKey("idle", "$share/g/x"): `{"q":0}`,
	}
	keys := make([]string, 0, len(store))
	for k := range store {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	scan := func(prefix string, fn func(k, v []byte) error) error {
		for _, k := range keys {
			if strings.HasPrefix(k, prefix) {
				if err := fn([]byte(k), []byte(store[k])); err != nil {
					return err
				}
			}
		}
		return nil
	}
	got := map[string]string{}
	if err := SnapshotSessions(scan, func(k, v []byte) error { got[string(k)] = string(v); return nil }); err != nil {
		t.Fatal(err)
	}
	want := maps.Clone(store)
	want[cursorKey("dev")] = cur(89)
	delete(want, outKey("dev", 5))
	delete(want, outKey("dev", 7))
	if !maps.Equal(got, want) {
		t.Errorf("snapshot of the sessions:\n got %q\nwant %q", got, want)
	}
}

// Restore ends the connections served here (MQTT 5: DISCONNECT 0x89),
// and the broker then holds the snapshot's sessions and retained messages
// instead of its own: a device finds its session, a subscriber the
// retained messages.
func TestRestoreTakesTheSnapshotsState(t *testing.T) {
	s, log := testServer(t, nil, nil)
	live := dialRaw(t, s.Addr(), 5)
	live.connect("live", true, nil)
	live.subscribe(1, packets.Subscription{Filter: "old/#", Qos: 1})
	pub := dialRaw(t, s.Addr(), 5)
	pub.connect("pub", true, nil)
	pub.publish("old/t", 1, 1, "old")
	pub.expect(packets.Puback)
	live.expect(packets.Publish)

	install := func() error {
		st := log.store
		st.mu.Lock()
		defer st.mu.Unlock()
		clear(st.m)
		rec, _ := json.Marshal(retainedRec{Index: 40, M: &Message{Topic: "new/t", Retain: true, QoS: 1, Payload: []byte("kept")}})
		st.m[keyRetained+"new/t"] = rec
		st.m[sessKey("dev")] = []byte(`{"v":1,"expiry":4294967295}`)
		st.m[cursorKey("dev")] = binary.BigEndian.AppendUint64(nil, 41)
		st.m[subKey("dev", "new/#")] = []byte(`{"q":1}`)
		return nil
	}
	if err := s.Restore(42, install); err != nil {
		t.Fatal(err)
	}
	if reason, ok := live.closed(); !ok || reason != codeRestore.Code {
		t.Errorf("a connection served here: DISCONNECT %v reason %#x, want %#x", ok, reason, codeRestore.Code)
	}
	if n := s.Retained(); n != 1 {
		t.Errorf("%d retained messages after the restore, want the snapshot's 1", n)
	}
	dev := dialRaw(t, s.Addr(), 5)
	if ack := dev.connect("dev", false, nil); !ack.SessionPresent {
		t.Error("the snapshot's session is not present")
	}
	look := dialRaw(t, s.Addr(), 5)
	look.connect("look", true, nil)
	look.subscribe(1, packets.Subscription{Filter: "#", Qos: 1})
	if pk := look.expect(packets.Publish); pk.TopicName != "new/t" || string(pk.Payload) != "kept" {
		t.Errorf("retained after the restore: %s %q", pk.TopicName, pk.Payload)
	}
	if again := dialRaw(t, s.Addr(), 5); again.connect("live", false, nil).SessionPresent {
		t.Error("a session the snapshot does not hold is still present")
	}
}
