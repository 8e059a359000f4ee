package storage

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"reflect"
	"strings"
	"testing"
)

// fullRecord sets every field, so a field the codec forgets shows up as a
// round-trip difference.
func fullRecord() Record {
	return Record{
		Origin:      0x0102030405060708,
		Seq:         0xfffffffffffffffe,
		ClientID:    "sensor-17",
		Topic:       "plant/line-3/temperature",
		QoS:         2,
		Retain:      true,
		Republished: true,
		Will:        true,
		PacketID:    0xbeef,
		Time:        1_700_000_000_123_456_789,
		Payload:     []byte(`{"c":21.5}`),
		Props: Properties{
			PayloadFormat:    1,
			PayloadFormatSet: true,
			MessageExpiry:    3600,
			MessageExpirySet: true,
			ContentType:      "application/json",
			ResponseTopic:    "plant/line-3/reply",
			CorrelationData:  []byte{0, 1, 2, 0xff},
			User: []UserProperty{
				{"unit", "celsius"},
				{"unit", "kelvin"},
				{"", ""},
			},
		},
	}
}

func sampleRecords() []struct {
	name string
	r    Record
} {
	big := make([]byte, 256<<10)
	for i := range big {
		big[i] = byte(i * 7)
	}
	many := make([]UserProperty, 300)
	for i := range many {
		many[i] = UserProperty{Key: fmt.Sprintf("k%d", i%5), Value: strings.Repeat("v", i)}
	}
	return []struct {
		name string
		r    Record
	}{
		{"zero", Record{}},
		{"empty non-nil slices", Record{Payload: []byte{}, Props: Properties{CorrelationData: []byte{}, User: []UserProperty{}}}},
		{"all properties", fullRecord()},
		{"set flags with zero values", Record{QoS: 1, Props: Properties{PayloadFormatSet: true, MessageExpirySet: true}}},
		{"unset values dropped", Record{Props: Properties{PayloadFormat: 1, MessageExpiry: 60}}},
		{"negative time", Record{Time: -1, Origin: 1, Seq: 1}},
		{"taken under a sync ack rule", Record{Origin: 3, Seq: 4, Topic: "alarms/fire", QoS: 1, Sync: true, Payload: []byte("on")}},
		{"unicode", Record{
			ClientID: "capteur-été-☃",
			Topic:    "工場/ライン/温度/🌡",
			Payload:  []byte("température: 21,5 °C"),
			Props: Properties{
				ContentType:   "text/plain; charset=utf-8",
				ResponseTopic: "réponse/⏎",
				User:          []UserProperty{{"clé", "värde"}, {"ключ", "значение"}},
			},
		}},
		{"256 KiB payload", Record{Origin: 2, Seq: 99, Topic: "big", QoS: 1, PacketID: 1, Payload: big}},
		{"many user properties with duplicate keys", Record{Topic: "t", Props: Properties{User: many}}},
		{"long strings need multi-byte lengths", Record{ClientID: strings.Repeat("c", 200), Topic: strings.Repeat("t", 20000)}},
	}
}

// normalise maps a Record to what DecodeRecord gives back for it: values
// whose Set flag is false are not stored, and empty slices decode as nil.
func normalise(r Record) Record {
	if !r.Props.PayloadFormatSet {
		r.Props.PayloadFormat = 0
	}
	if !r.Props.MessageExpirySet {
		r.Props.MessageExpiry = 0
	}
	if len(r.Payload) == 0 {
		r.Payload = nil
	}
	if len(r.Props.CorrelationData) == 0 {
		r.Props.CorrelationData = nil
	}
	if len(r.Props.User) == 0 {
		r.Props.User = nil
	}
	return r
}

// reseal rewrites the CRC so that a deliberately malformed body gets past
// the CRC check and reaches the parser.
func reseal(b []byte) []byte {
	end := len(b) - crcLen
	binary.BigEndian.PutUint32(b[end:], crc32.Checksum(b[:end], crcTable))
	return b
}

// raw builds an encoding by hand from a header and body parts.
func raw(flags, qos byte, body ...[]byte) []byte {
	b := make([]byte, headerLen, 64)
	b[offVersion] = RecordVersion
	b[offFlags] = flags
	b[offQoS] = qos
	for _, p := range body {
		b = append(b, p...)
	}
	return reseal(append(b, 0, 0, 0, 0))
}

// emptyFields is the body of a record with all six length-prefixed fields
// empty, before the optional fixed fields and the user property count.
var emptyFields = []byte{0, 0, 0, 0, 0, 0}

func TestRecordRoundTrip(t *testing.T) {
	for _, tc := range sampleRecords() {
		t.Run(tc.name, func(t *testing.T) {
			enc := AppendRecord(nil, &tc.r)
			if got, want := len(enc), encodedLen(&tc.r); got != want {
				t.Fatalf("encoding is %d bytes, encodedLen says %d", got, want)
			}
			got, err := DecodeRecord(enc)
			if err != nil {
				t.Fatalf("DecodeRecord: %v", err)
			}
			if want := normalise(tc.r); !reflect.DeepEqual(got, want) {
				t.Fatalf("round trip:\n got %+v\nwant %+v", got, want)
			}
			if again := AppendRecord(nil, &got); !bytes.Equal(again, enc) {
				t.Fatalf("re-encoding the decoded record differs")
			}

			// Appending after existing bytes must leave them alone and
			// checksum only the new record.
			prefix := []byte("prefix")
			ext := AppendRecord(bytes.Clone(prefix), &tc.r)
			if !bytes.Equal(ext[:len(prefix)], prefix) || !bytes.Equal(ext[len(prefix):], enc) {
				t.Fatalf("AppendRecord onto a non-empty dst is not prefix+encoding")
			}
		})
	}
}

func TestDecodeRecordDoesNotAlias(t *testing.T) {
	r := fullRecord()
	enc := AppendRecord(nil, &r)
	got, err := DecodeRecord(enc)
	if err != nil {
		t.Fatal(err)
	}
	// bbolt reuses the page once the transaction ends.
	for i := range enc {
		enc[i] = 0xaa
	}
	if want := normalise(r); !reflect.DeepEqual(got, want) {
		t.Fatalf("decoded record changed when its input was overwritten:\n got %+v\nwant %+v", got, want)
	}
	// Growing a decoded slice must not write into its neighbours.
	_ = append(got.Payload, 'x')
	if got.Props.ContentType != r.Props.ContentType {
		t.Fatalf("appending to Payload changed ContentType")
	}
}

func TestDecodeRecordBitFlips(t *testing.T) {
	for _, r := range []Record{{}, fullRecord()} {
		enc := AppendRecord(nil, &r)
		for i := range enc {
			for bit := range 8 {
				b := bytes.Clone(enc)
				b[i] ^= 1 << bit
				_, err := DecodeRecord(b)
				want := ErrCorrupt
				if v := b[offVersion]; i == offVersion && v != RecordVersion && v != RecordVersionSync && v != RecordVersionControl {
					want = ErrUnknownVersion
				}
				if !errors.Is(err, want) {
					t.Fatalf("flip byte %d bit %d: err = %v, want %v", i, bit, err, want)
				}
			}
		}
	}
}

func TestDecodeRecordTruncated(t *testing.T) {
	for _, tc := range sampleRecords() {
		if len(tc.r.Payload) > 1<<10 {
			continue // every prefix of 256 KiB is slow and adds nothing
		}
		enc := AppendRecord(nil, &tc.r)
		for n := range len(enc) {
			_, err := DecodeRecord(enc[:n])
			if !errors.Is(err, ErrTruncated) && !errors.Is(err, ErrCorrupt) {
				t.Fatalf("%s: prefix of %d/%d bytes: err = %v", tc.name, n, len(enc), err)
			}
			if n < minRecordLen && !errors.Is(err, ErrTruncated) {
				t.Fatalf("%s: prefix of %d bytes: err = %v, want ErrTruncated", tc.name, n, err)
			}
		}
	}
}

// TestRecordSyncVersion: a sync record is version 2 with its flag, any
// other stays version 1 (what earlier builds wrote and read), and neither
// version takes the other's spelling.
func TestRecordSyncVersion(t *testing.T) {
	async := Record{Origin: 1, Seq: 2, Topic: "t", QoS: 1, Payload: []byte("p")}
	sync := async
	sync.Sync = true
	a, s := AppendRecord(nil, &async), AppendRecord(nil, &sync)
	if a[offVersion] != 1 || s[offVersion] != 2 {
		t.Fatalf("versions: async %d, sync %d; want 1 and 2", a[offVersion], s[offVersion])
	}
	if RecordSync(a) || !RecordSync(s) {
		t.Fatalf("RecordSync: async %v, sync %v", RecordSync(a), RecordSync(s))
	}
	// A version-1 record as builds before version 2 wrote it, byte for byte.
	old := raw(flagRetain, 1, []byte{0, 1, 't', 0, 0, 0, 0}, []byte{0})
	if r, err := DecodeRecord(old); err != nil || r.Sync || !r.Retain || r.Topic != "t" {
		t.Fatalf("version 1 record: %+v, %v", r, err)
	}
	v1Flagged := bytes.Clone(a)
	v1Flagged[offFlags] |= flagSync
	v2Bare := bytes.Clone(s)
	v2Bare[offFlags] &^= flagSync
	for name, b := range map[string][]byte{"version 1 with the sync flag": reseal(v1Flagged), "version 2 without it": reseal(v2Bare)} {
		if _, err := DecodeRecord(b); !errors.Is(err, ErrCorrupt) {
			t.Errorf("%s: err = %v, want ErrCorrupt", name, err)
		}
	}
}

func TestDecodeRecordUnknownVersion(t *testing.T) {
	r := fullRecord()
	for _, v := range []byte{0, 4, 255} {
		b := AppendRecord(nil, &r)
		b[offVersion] = v
		reseal(b)
		for name, in := range map[string][]byte{"full": b, "one byte": {v}} {
			_, err := DecodeRecord(in)
			if !errors.Is(err, ErrUnknownVersion) {
				t.Fatalf("version %d (%s): err = %v, want ErrUnknownVersion", v, name, err)
			}
			if !strings.Contains(err.Error(), fmt.Sprintf("version %d", v)) {
				t.Fatalf("version %d: error %q does not name the version it saw", v, err)
			}
			if _, _, err := RecordID(in); !errors.Is(err, ErrUnknownVersion) {
				t.Fatalf("RecordID version %d (%s): err = %v, want ErrUnknownVersion", v, name, err)
			}
		}
	}
}

// TestDecodeRecordMalformed feeds bodies with a valid CRC, the way a buggy or
// newer writer would, to reach each check behind the CRC.
func TestDecodeRecordMalformed(t *testing.T) {
	maxVarint := []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01}
	overflow := []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02}
	tests := []struct {
		name string
		in   []byte
		want error
	}{
		{"minimal is valid", raw(0, 0, emptyFields, []byte{0}), nil},
		{"unknown flag bit 5", raw(1<<5, 0, emptyFields, []byte{0}), ErrCorrupt},
		{"unknown flag bit 7", raw(1<<7, 0, emptyFields, []byte{0}), ErrCorrupt},
		{"qos 3", raw(0, 3, emptyFields, []byte{0}), ErrCorrupt},
		{"qos 255", raw(0, 255, emptyFields, []byte{0}), ErrCorrupt},
		{"client id runs past the end", raw(0, 0, []byte{40}, emptyFields[1:], []byte{0}), ErrTruncated},
		{"length 2^64-1", raw(0, 0, maxVarint, emptyFields[1:], []byte{0}), ErrTruncated},
		{"length overflows 64 bits", raw(0, 0, overflow, emptyFields[1:], []byte{0}), ErrCorrupt},
		{"varint longer than 10 bytes", raw(0, 0, []byte{0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00}, emptyFields[1:], []byte{0}), ErrCorrupt},
		{"non-minimal zero length", raw(0, 0, []byte{0x80, 0x00}, emptyFields[1:], []byte{0}), ErrCorrupt},
		{"non-minimal one length", raw(0, 0, []byte{0x81, 0x00, 'x'}, emptyFields[1:], []byte{0}), ErrCorrupt},
		{"body ends inside a varint", raw(0, 0, emptyFields, []byte{0x80}), ErrTruncated},
		{"payload format flag without the byte", raw(flagPayloadFormat, 0, emptyFields), ErrTruncated},
		{"message expiry flag with 3 bytes", raw(flagMessageExpiry, 0, emptyFields, []byte{1, 2, 3}), ErrTruncated},
		{"user count with nothing after", raw(0, 0, emptyFields, []byte{1}), ErrTruncated},
		{"user count 2^62", raw(0, 0, emptyFields, []byte{0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x40}, make([]byte, 8)), ErrTruncated},
		{"user count max", raw(0, 0, emptyFields, maxVarint), ErrTruncated},
		{"user value runs past the end", raw(0, 0, emptyFields, []byte{1, 0, 5, 'a'}), ErrTruncated},
		{"trailing byte", raw(0, 0, emptyFields, []byte{0, 0}), ErrCorrupt},
		{"trailing user pair", raw(0, 0, emptyFields, []byte{1, 0, 0, 0, 0}), ErrCorrupt},
		{"missing user count", raw(0, 0, emptyFields), ErrTruncated},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := DecodeRecord(tc.in)
			if tc.want == nil {
				if err != nil {
					t.Fatalf("err = %v, want nil", err)
				}
				return
			}
			if !errors.Is(err, tc.want) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
		})
	}
}

func TestRecordID(t *testing.T) {
	for _, tc := range sampleRecords() {
		enc := AppendRecord(nil, &tc.r)
		origin, seq, err := RecordID(enc)
		if err != nil || origin != tc.r.Origin || seq != tc.r.Seq {
			t.Fatalf("%s: RecordID = %d, %d, %v; want %d, %d, nil", tc.name, origin, seq, err, tc.r.Origin, tc.r.Seq)
		}
	}

	// The CRC is not its business: a damaged body still yields the id.
	r := fullRecord()
	enc := AppendRecord(nil, &r)
	enc[len(enc)-1] ^= 1
	if origin, seq, err := RecordID(enc); err != nil || origin != r.Origin || seq != r.Seq {
		t.Fatalf("RecordID with a bad CRC = %d, %d, %v", origin, seq, err)
	}

	for n := range minRecordLen {
		if _, _, err := RecordID(enc[:n]); !errors.Is(err, ErrTruncated) {
			t.Fatalf("RecordID on %d bytes: err = %v, want ErrTruncated", n, err)
		}
	}
}

func TestAppendRecordPanicsOnBadQoS(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Fatal("AppendRecord with QoS 3 did not panic")
		}
	}()
	AppendRecord(nil, &Record{QoS: 3})
}

func TestAppendRecordAllocs(t *testing.T) {
	r := fullRecord()
	buf := make([]byte, 0, encodedLen(&r))
	allocs := testing.AllocsPerRun(100, func() {
		buf = AppendRecord(buf[:0], &r)
	})
	if allocs != 0 {
		t.Fatalf("AppendRecord into a buffer with room allocates %v times, want 0", allocs)
	}
}

func FuzzDecodeRecord(f *testing.F) {
	for _, tc := range sampleRecords() {
		// Big seeds stall the fuzzer: it spends up to a minute minimising
		// each interesting input derived from them.
		if enc := AppendRecord(nil, &tc.r); len(enc) <= 1<<10 {
			f.Add(enc)
		}
	}
	for _, r := range controlRecords() {
		f.Add(AppendRecord(nil, &r))
	}
	f.Add([]byte{})
	f.Add([]byte{RecordVersion})
	f.Add(raw(0, 0, emptyFields, []byte{0}))
	f.Add(raw(0, 0, emptyFields, []byte{1, 0, 5, 'a'}))

	f.Fuzz(func(t *testing.T, b []byte) {
		checkDecode(t, b)
		// Random bytes almost never carry a matching CRC, so also try the
		// same bytes with the CRC fixed up: that is what reaches the parser.
		if len(b) >= crcLen {
			checkDecode(t, reseal(bytes.Clone(b)))
		}
	})
}

// checkDecode holds the properties of DecodeRecord on any input: no panic, no
// change to the input, agreement with RecordTopic and RecordID, and a
// canonical encoding.
func checkDecode(t *testing.T, b []byte) {
	t.Helper()
	in := bytes.Clone(b)
	r, err := DecodeRecord(b)
	if !bytes.Equal(in, b) {
		t.Fatal("DecodeRecord modified its input")
	}
	if err != nil {
		if !reflect.DeepEqual(r, Record{}) {
			t.Fatalf("failed decode returned a non-zero record: %+v", r)
		}
		return
	}
	topic, retain, topicErr := RecordTopic(b)
	if topicErr != nil || string(topic) != r.Topic || retain != r.Retain {
		t.Fatalf("RecordTopic = %q, %v, %v; DecodeRecord says %q, %v", topic, retain, topicErr, r.Topic, r.Retain)
	}
	if kind, _, _, err := RecordHead(b); err != nil || kind != r.Kind {
		t.Fatalf("RecordHead kind = %s, %v; DecodeRecord says %s", kind, err, r.Kind)
	}
	origin, seq, idErr := RecordID(b)
	if idErr != nil || origin != r.Origin || seq != r.Seq {
		t.Fatalf("RecordID = %d, %d, %v; DecodeRecord says %d, %d", origin, seq, idErr, r.Origin, r.Seq)
	}
	if enc := AppendRecord(nil, &r); !bytes.Equal(enc, b) {
		t.Fatalf("encoding is not canonical:\n in  %x\n out %x", b, enc)
	}
}

func FuzzRecordRoundTrip(f *testing.F) {
	full := fullRecord()
	f.Add(full.Origin, full.Seq, full.ClientID, full.Topic, full.QoS, byte(0xff), full.PacketID, full.Time,
		full.Payload, full.Props.PayloadFormat, full.Props.MessageExpiry, full.Props.ContentType,
		full.Props.ResponseTopic, full.Props.CorrelationData, "unit\x00celsius\x00unit\x00kelvin")
	f.Add(uint64(0), uint64(0), "", "", byte(0), byte(0), uint16(0), int64(0), []byte(nil), byte(0), uint32(0), "", "", []byte(nil), "")

	f.Fuzz(func(t *testing.T, origin, seq uint64, clientID, topic string, qos, flags byte, packetID uint16, tm int64,
		payload []byte, pf byte, expiry uint32, contentType, responseTopic string, corr []byte, user string) {
		r := Record{
			Origin:      origin,
			Seq:         seq,
			ClientID:    clientID,
			Topic:       topic,
			QoS:         qos % 3,
			Retain:      flags&1 != 0,
			Republished: flags&2 != 0,
			Will:        flags&4 != 0,
			Sync:        flags&32 != 0,
			PacketID:    packetID,
			Time:        tm,
			Payload:     payload,
			Props: Properties{
				PayloadFormat:    pf,
				PayloadFormatSet: flags&8 != 0,
				MessageExpiry:    expiry,
				MessageExpirySet: flags&16 != 0,
				ContentType:      contentType,
				ResponseTopic:    responseTopic,
				CorrelationData:  corr,
			},
		}
		// NUL-separated key, value, key, value...; an odd last key gets an
		// empty value.
		if user != "" {
			parts := strings.Split(user, "\x00")
			for i := 0; i < len(parts); i += 2 {
				p := UserProperty{Key: parts[i]}
				if i+1 < len(parts) {
					p.Value = parts[i+1]
				}
				r.Props.User = append(r.Props.User, p)
			}
		}

		enc := AppendRecord(nil, &r)
		got, err := DecodeRecord(enc)
		if err != nil {
			t.Fatalf("DecodeRecord(AppendRecord(r)): %v", err)
		}
		if want := normalise(r); !reflect.DeepEqual(got, want) {
			t.Fatalf("round trip:\n got %+v\nwant %+v", got, want)
		}
	})
}

func benchRecord() Record {
	r := fullRecord()
	r.Payload = bytes.Repeat([]byte{'p'}, 100)
	return r
}

func BenchmarkAppendRecord(b *testing.B) {
	r := benchRecord()
	var buf []byte
	b.ReportAllocs()
	b.SetBytes(int64(encodedLen(&r)))
	for b.Loop() {
		buf = AppendRecord(buf[:0], &r)
	}
}

func BenchmarkDecodeRecord(b *testing.B) {
	r := benchRecord()
	enc := AppendRecord(nil, &r)
	b.ReportAllocs()
	b.SetBytes(int64(len(enc)))
	for b.Loop() {
		if _, err := DecodeRecord(enc); err != nil {
			b.Fatal(err)
		}
	}
}

// TestRecordTopicRefusesWhatDecodeRefuses: the apply path skips unrouted
// records on RecordTopic alone, so a damaged record must stop it there just
// as DecodeRecord would, and reading the topic must not allocate.
func TestRecordTopicRefusesWhatDecodeRefuses(t *testing.T) {
	r := Record{Origin: 1, Seq: 2, ClientID: "dev-1", Topic: "plant/line1/temp", QoS: 1, Retain: true, Payload: []byte("21.5")}
	enc := AppendRecord(nil, &r)
	if n := testing.AllocsPerRun(100, func() { _, _, _ = RecordTopic(enc) }); n != 0 {
		t.Errorf("RecordTopic allocates %.0f times", n)
	}
	for i := range enc {
		bad := bytes.Clone(enc)
		bad[i] ^= 0x40
		_, decErr := DecodeRecord(bad)
		_, _, topicErr := RecordTopic(bad)
		if decErr == nil || topicErr == nil {
			t.Fatalf("byte %d damaged: DecodeRecord %v, RecordTopic %v; want both to fail", i, decErr, topicErr)
		}
		if !errors.Is(topicErr, ErrCorrupt) && !errors.Is(topicErr, ErrUnknownVersion) {
			t.Fatalf("byte %d damaged: RecordTopic error %v is neither ErrCorrupt nor ErrUnknownVersion", i, topicErr)
		}
	}
}
