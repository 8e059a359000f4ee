package storage

import (
	"bytes"
	"errors"
	"reflect"
	"testing"
)

// controlRecords are one control record of each kind, in the header's
// encoding and in the legacy one.
func controlRecords() []Record {
	var out []Record
	for k := KindSettle; k <= KindFeature; k++ {
		r := Record{Origin: 7, Seq: uint64(k), Kind: k, Topic: k.LegacyTopic(), ClientID: "c", Time: 42, Payload: []byte(`{"x":1}`)}
		out = append(out, r)
		if k.LegacyTopic() != "" {
			r.Legacy = true
			out = append(out, r)
		}
	}
	return out
}

func TestControlRecordsRoundTripWithTheirKind(t *testing.T) {
	for _, r := range controlRecords() {
		b := AppendRecord(nil, &r)
		wantVersion := byte(RecordVersionControl)
		if r.Legacy {
			wantVersion = RecordVersion
		}
		if b[offVersion] != wantVersion {
			t.Fatalf("%s legacy=%v: version %d, want %d", r.Kind, r.Legacy, b[offVersion], wantVersion)
		}
		got, err := DecodeRecord(b)
		if err != nil {
			t.Fatalf("%s legacy=%v: %v", r.Kind, r.Legacy, err)
		}
		if !reflect.DeepEqual(got, r) {
			t.Fatalf("%s legacy=%v: decoded\n %+v\nwant\n %+v", r.Kind, r.Legacy, got, r)
		}
		checkDecode(t, b)
	}
}

// A device message on a control topic is a message, whatever its topic:
// only the header makes a control record.
func TestDeviceRecordOnAControlTopicIsAMessage(t *testing.T) {
	for _, topic := range []string{"$tandem/settle", "$tandem/session", "$tandem/cursors", "$tandem/uplinks"} {
		for name, r := range map[string]Record{
			"will":     {Topic: topic, Will: true, Payload: []byte("x")},
			"retained": {Topic: topic, Retain: true},
			"qos 1":    {Topic: topic, QoS: 1, PacketID: 1},
			"sync":     {Topic: topic, Sync: true},
		} {
			b := AppendRecord(nil, &r)
			got, err := DecodeRecord(b)
			if err != nil {
				t.Fatal(err)
			}
			if got.Kind != KindMessage || got.Legacy {
				t.Errorf("%s on %s: kind %s (legacy %v), want a message", name, topic, got.Kind, got.Legacy)
			}
		}
	}
	// A message on a control topic in the header's encoding cannot exist:
	// version 3 with kind 0 is corrupt.
	r := Record{Kind: KindSession, Topic: "x"}
	b := AppendRecord(nil, &r)
	b[offKind] = byte(KindMessage)
	if _, err := DecodeRecord(reseal(b)); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("version 3 of kind message: err = %v, want ErrCorrupt", err)
	}
}

func TestControlRecordInAMessagesShapeIsCorrupt(t *testing.T) {
	r := Record{Kind: KindCursors}
	for name, set := range map[string]func(b []byte){
		"qos":    func(b []byte) { b[offQoS] = 1 },
		"will":   func(b []byte) { b[offFlags] |= flagWill },
		"retain": func(b []byte) { b[offFlags] |= flagRetain },
		"sync":   func(b []byte) { b[offFlags] |= flagSync },
	} {
		b := AppendRecord(nil, &r)
		set(b)
		if _, err := DecodeRecord(reseal(b)); !errors.Is(err, ErrCorrupt) {
			t.Errorf("%s: err = %v, want ErrCorrupt", name, err)
		}
	}
	for name, bad := range map[string]Record{
		"sync":          {Kind: KindSession, Sync: true},
		"qos":           {Kind: KindSession, QoS: 1},
		"legacy topic":  {Kind: KindSession, Legacy: true, Topic: "a/b"},
		"legacy kind 5": {Kind: KindFeature, Legacy: true},
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("AppendRecord of a %s control record did not panic", name)
				}
			}()
			AppendRecord(nil, &bad)
		}()
	}
}

// A control kind from a newer build decodes, kind and all: the applier
// skips what it does not know instead of stopping.
func TestUnknownControlKindDecodes(t *testing.T) {
	r := Record{Kind: Kind(200), Topic: "later", Payload: []byte{1}}
	b := AppendRecord(nil, &r)
	got, err := DecodeRecord(b)
	if err != nil || got.Kind != Kind(200) {
		t.Fatalf("kind 200: %v, %v", got.Kind, err)
	}
	if s := got.Kind.String(); s != "kind-200" {
		t.Fatalf("String = %q", s)
	}
	if !bytes.Equal(AppendRecord(nil, &got), b) {
		t.Fatal("not canonical")
	}
}
