package replication

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"strings"
	"testing"

	pb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/storage"
)

// frameSeeds are one valid frame of each type.
func frameSeeds(t testing.TB) [][]byte {
	raft, err := appendRaftFrame(nil, []pb.Message{
		{Type: pb.MsgApp, From: 1, To: 2, Term: 3, Index: 4, Entries: []pb.Entry{{Term: 3, Index: 5, Data: []byte("payload")}}},
		{Type: pb.MsgHeartbeat, From: 1, To: 2, Commit: 5},
		{Type: pb.MsgSnap, From: 1, To: 2, Snapshot: &pb.Snapshot{Data: []byte("snap"), Metadata: pb.SnapshotMetadata{Index: 9, Term: 3, ConfState: pb.ConfState{Voters: []uint64{1, 2}}}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	return [][]byte{
		appendHello(nil, hello{version: peerProtocolMin, maxVersion: peerProtocolMax, level: storage.FeatureLevel, purpose: purposeLink, id: 0xfeed, gen: 3, cluster: "plant-7"}),
		raft,
		appendRequest(nil, requestFrame{id: 9, timeoutMs: 5000, kind: 'F', payload: []byte("record")}),
		appendResponse(nil, responseFrame{id: 9, status: statusError, payload: []byte("not the master")}),
		appendKnock(nil, KnockJoin, []byte("secret")),
		appendFrame(nil, framePing, nil),
	}
}

func TestFramesRoundTrip(t *testing.T) {
	seeds := frameSeeds(t)
	fr := newFrameReader(bytes.NewReader(bytes.Join(seeds, nil)), MaxFrameSize)
	var types []byte
	for {
		typ, body, err := fr.next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		types = append(types, typ)
		switch typ {
		case frameHello:
			h, err := decodeHello(body)
			if err != nil || h != (hello{version: peerProtocolMin, maxVersion: peerProtocolMax, level: storage.FeatureLevel, purpose: purposeLink, id: 0xfeed, gen: 3, cluster: "plant-7"}) {
				t.Fatalf("hello %+v, %v", h, err)
			}
		case frameRaft:
			msgs, err := decodeRaftBatch(body)
			if err != nil || len(msgs) != 3 || string(msgs[0].Entries[0].Data) != "payload" || msgs[1].Commit != 5 ||
				string(msgs[2].Snapshot.Data) != "snap" || msgs[2].Snapshot.Metadata.ConfState.Voters[1] != 2 {
				t.Fatalf("raft batch %+v, %v", msgs, err)
			}
		case frameRequest:
			r, err := decodeRequest(body)
			if err != nil || r.id != 9 || r.timeoutMs != 5000 || r.kind != 'F' || string(r.payload) != "record" {
				t.Fatalf("request %+v, %v", r, err)
			}
		case frameResponse:
			r, err := decodeResponse(body)
			if err != nil || r.id != 9 || r.status != statusError || string(r.payload) != "not the master" {
				t.Fatalf("response %+v, %v", r, err)
			}
		case frameKnock:
			kind, p, err := decodeKnock(body)
			if err != nil || kind != KnockJoin || string(p) != "secret" {
				t.Fatalf("knock %c %q, %v", kind, p, err)
			}
		}
	}
	if !bytes.Equal(types, []byte{frameHello, frameRaft, frameRequest, frameResponse, frameKnock, framePing}) {
		t.Fatalf("frame types %v", types)
	}
}

// A later version may append fields to the hello; this one ignores them.
func TestHelloToleratesTrailingFields(t *testing.T) {
	f := appendHello(nil, hello{version: 1, purpose: purposeKnock, id: 5, cluster: "c"})
	f = append(f, 0xAA, 0xBB)
	binary.BigEndian.PutUint32(f, uint32(len(f)-4))
	_, body, err := newFrameReader(bytes.NewReader(f), maxSmallFrame).next()
	if err != nil {
		t.Fatal(err)
	}
	if h, err := decodeHello(body); err != nil || h.id != 5 || h.cluster != "c" {
		t.Fatalf("%+v, %v", h, err)
	}
}

func TestFrameReaderRejectsBadLengths(t *testing.T) {
	for _, tc := range []struct {
		length uint32
		want   error
	}{{maxSmallFrame + 1, ErrFrameTooLarge}, {1 << 31, ErrFrameTooLarge}, {0xFFFFFFFF, ErrFrameTooLarge}, {0, errBadFrame}} {
		hdr := binary.BigEndian.AppendUint32(nil, tc.length)
		// No body follows: an oversize length must fail before any read
		// or allocation of the body.
		_, _, err := newFrameReader(bytes.NewReader(hdr), maxSmallFrame).next()
		if !errors.Is(err, tc.want) {
			t.Errorf("length %d: %v, want %v", tc.length, err, tc.want)
		}
	}
	// A frame cut short is an error, not a short frame.
	f := appendKnock(nil, KnockJoin, []byte("secret"))
	if _, _, err := newFrameReader(bytes.NewReader(f[:len(f)-2]), maxSmallFrame).next(); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Errorf("truncated frame: %v", err)
	}
}

func TestRaftBatchRejectsLies(t *testing.T) {
	for name, body := range map[string][]byte{
		"empty":            {},
		"zero count":       {0},
		"count past body":  binary.AppendUvarint(nil, 1<<40),
		"size past body":   {1, 50, 0},
		"trailing bytes":   {1, 0, 7},
		"bad protobuf":     {1, 2, 0xFF, 0xFF},
		"count then short": {3, 0, 0},
	} {
		if _, err := decodeRaftBatch(body); !errors.Is(err, errBadFrame) {
			t.Errorf("%s: %v", name, err)
		}
	}
}

// FuzzFrameDecoder feeds arbitrary bytes to the frame reader and every body
// decoder: nothing may panic, a length over the limit is always
// ErrFrameTooLarge, and a raft batch that decodes re-encodes to one that
// decodes to the same bytes.
func FuzzFrameDecoder(f *testing.F) {
	for _, s := range frameSeeds(f) {
		f.Add(s)
	}
	f.Add(binary.BigEndian.AppendUint32(nil, 0xFFFFFFFF))
	f.Add([]byte{0, 0, 0, 2, frameRaft, 0xFF})
	const limit = 4 << 10
	f.Fuzz(func(t *testing.T, data []byte) {
		fr := newFrameReader(bytes.NewReader(data), limit)
		rest := data
		for {
			typ, body, err := fr.next()
			if len(rest) >= 4 && binary.BigEndian.Uint32(rest) > limit {
				if !errors.Is(err, ErrFrameTooLarge) {
					t.Fatalf("oversize length %d: %v", binary.BigEndian.Uint32(rest), err)
				}
				return
			}
			if err != nil {
				return
			}
			rest = rest[4+1+len(body):]
			decodeHello(body)
			decodeRequest(body)
			decodeResponse(body)
			decodeKnock(body)
			msgs, err := decodeRaftBatch(body)
			if typ != frameRaft || err != nil {
				continue
			}
			again, err := appendRaftFrame(nil, msgs)
			if err != nil {
				t.Fatalf("re-encoding a decoded batch: %v", err)
			}
			msgs2, err := decodeRaftBatch(again[frameHeaderLen:])
			if err != nil {
				t.Fatalf("decoding a re-encoded batch: %v", err)
			}
			third, _ := appendRaftFrame(nil, msgs2)
			if !bytes.Equal(again, third) {
				t.Fatal("a raft batch does not survive a second round trip")
			}
		}
	})
}

// A hello from a build before negotiation has no trailer: it reads as
// protocol version 1 only and feature level 1, and is admitted until the
// cluster's level is raised past it, then refused with both levels named.
func TestHelloOfABuildBeforeFeatureLevels(t *testing.T) {
	old := appendHello(nil, hello{version: 1, purpose: purposeLink, id: 7, gen: 1, cluster: "c"})
	// Cut the trailer this build appends: what an older build sends.
	body := old[frameHeaderLen : frameHeaderLen+helloLen+1]
	h, err := decodeHello(body)
	if err != nil {
		t.Fatal(err)
	}
	if h.maxVersion != 1 || h.level != storage.FeatureBase || h.build != "" {
		t.Fatalf("old hello read as %+v", h)
	}
	level := storage.FeatureBase
	tr := &PeerTransport{cfg: TransportConfig{FeatureLevel: func() int { return level }}}
	r := Remote{ID: 7, Level: int(h.level)}
	if err := tr.levelOK(r); err != nil {
		t.Fatalf("an old build refused before the raise: %v", err)
	}
	level = storage.FeatureControlKinds
	err = tr.levelOK(r)
	if err == nil || !strings.Contains(err.Error(), "feature levels up to 1") || !strings.Contains(err.Error(), "level 2") {
		t.Fatalf("an old build after the raise: %v", err)
	}
	r.Level, r.Build = storage.FeatureLevel, "9.9.9"
	if err := tr.levelOK(r); err != nil {
		t.Fatal(err)
	}
	if l, b, ok := tr.PeerBuild(7); !ok || l != storage.FeatureLevel || b != "9.9.9" {
		t.Fatalf("PeerBuild = %d %q %v", l, b, ok)
	}
}
