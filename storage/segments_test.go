package storage

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"testing"

	pb "go.etcd.io/raft/v3/raftpb"
)

// segWriter writes frames into a chain of segment files the way the WAL
// does (header, CRC, id; padding to a page; a cut to the next segment), for
// tests of the index and the reader.
type segWriter struct {
	t    *testing.T
	dir  string
	w    walLog
	seq  uint64
	off  int64
	ids  map[uint64]uint64
	x    segIndex
	size int64 // a segment's size: past it, a cut
	rng  *rand.Rand
}

func newSegWriter(t *testing.T, size int64, seed uint64) *segWriter {
	sw := &segWriter{t: t, dir: t.TempDir(), seq: firstSegment, ids: map[uint64]uint64{}, size: size, rng: rand.New(rand.NewPCG(seed, 1))}
	sw.w.id = newWALID()
	sw.ids[sw.seq] = sw.w.id
	return sw
}

func (sw *segWriter) write(b []byte, at int64) {
	sw.t.Helper()
	f, err := os.OpenFile(walPath(sw.dir, int(sw.seq)), os.O_RDWR|os.O_CREATE, 0o640)
	if err != nil {
		sw.t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(b, at); err != nil {
		sw.t.Fatal(err)
	}
}

// frame appends a frame of ents (and a few staged operations, which
// readers of entries skip), cutting to a new segment first when the
// current one is full, and padding it to a page now and then.
func (sw *segWriter) frame(ents []pb.Entry) {
	sw.t.Helper()
	if sw.off >= sw.size {
		next := newWALID()
		sw.write(sw.w.encodeFrame(nil, next, -1, nil, nil), sw.off)
		sw.seq, sw.off, sw.w.id = sw.seq+1, 0, next
		sw.ids[sw.seq] = next
	}
	var ops []stagedOp
	for range sw.rng.IntN(3) {
		ops = append(ops, stagedOp{bucket: "meta", key: "k", val: bytes.Repeat([]byte{'v'}, sw.rng.IntN(50))})
	}
	at, prev := sw.off, int64(-1)
	if sw.off%walPage != 0 && sw.rng.IntN(4) == 0 {
		at, prev = (sw.off+walPage-1)/walPage*walPage, sw.off
	}
	b := sw.w.encodeFrame(nil, 0, prev, ops, ents)
	sw.write(b, at)
	sw.off = at + int64(len(b))
	if len(ents) > 0 {
		sw.x.note(ents[0].Index, ents[len(ents)-1].Index, sw.seq, at)
	}
}

func (sw *segWriter) reader() *segReader {
	return &segReader{files: newSegFiles(sw.dir), ids: func(seq uint64) (uint64, bool) { id, ok := sw.ids[seq]; return id, ok }}
}

// rebuild indexes the chain again from its head, as Open does.
func (sw *segWriter) rebuild() *segIndex {
	sw.t.Helper()
	r := sw.reader()
	defer r.files.close()
	var x segIndex
	if err := r.at(segPoint{seq: firstSegment}); err != nil {
		sw.t.Fatal(err)
	}
	for {
		p, seq, at, ok, err := r.frame()
		if err != nil {
			sw.t.Fatal(err)
		}
		if !ok {
			return &x
		}
		first, last, any, err := frameSpan(p)
		if err != nil {
			sw.t.Fatal(err)
		}
		if any {
			x.note(first, last, seq, at)
		}
	}
}

// first returns the first entry the index holds, 0 when none.
func (x *segIndex) first() uint64 {
	if len(x.pts) == 0 {
		return 0
	}
	return x.pts[0].idx
}

// frameSpan returns the first and last index of a frame's entries, ok
// false for a frame without any.
func frameSpan(p []byte) (first, last uint64, ok bool, err error) {
	err = frameEntries(p, func(idx uint64, _ []byte) bool {
		if !ok {
			first, ok = idx, true
		}
		last = idx
		return true
	})
	return first, last, ok, err
}

// entry reads entry i from the point x gives for it: the value, copied.
func (r *segReader) entry(x *segIndex, i uint64) ([]byte, error) {
	p, ok := x.find(i)
	if !ok {
		return nil, fmt.Errorf("entry %d is not in the segments: %w", i, ErrUnavailable)
	}
	if err := r.at(p); err != nil {
		return nil, err
	}
	for {
		fp, seq, at, ok, err := r.frame()
		if err != nil {
			return nil, err
		}
		if !ok {
			return nil, fmt.Errorf("entry %d: %s has no live frame at offset %d, past the index's point (%d at %d): %w", i, walPath(r.files.dir, int(r.seq)), r.off, p.idx, p.off, ErrCorrupt)
		}
		var v []byte
		err = frameEntries(fp, func(idx uint64, ev []byte) bool {
			if idx == i {
				v = append([]byte(nil), ev...)
				return false
			}
			return idx < i
		})
		if err != nil {
			return nil, fmt.Errorf("%s: frame at offset %d: %w", walPath(r.files.dir, int(seq)), at, err)
		}
		if v != nil {
			return v, nil
		}
	}
}

// checkAll reads every live entry through x and compares it with want.
func checkAll(t *testing.T, r *segReader, x *segIndex, want map[uint64]pb.Entry, last uint64) {
	t.Helper()
	if x.last != last {
		t.Fatalf("the index ends at %d, the log at %d", x.last, last)
	}
	for i := x.first(); i <= last; i++ {
		v, err := r.entry(x, i)
		if err != nil {
			t.Fatalf("entry %d: %v", i, err)
		}
		got, err := decodeEntry(i, v)
		if err != nil {
			t.Fatalf("entry %d: %v", i, err)
		}
		if d := diffEntries([]pb.Entry{got}, []pb.Entry{want[i]}); d != "" {
			t.Fatalf("entry %d: %s", i, d)
		}
	}
	if _, err := r.entry(x, last+1); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("entry %d past the last: %v, want ErrUnavailable", last+1, err)
	}
}

// Entries are read back from the segments through the sparse index as
// raft last wrote them, across cuts, padded frames and overwrites of every
// depth (within a frame, back to an earlier segment, repeated), both
// through the index kept while writing and through one rebuilt from the
// chain's head, as Open builds it.
func TestSegmentsReadTheLiveEntryAfterOverwrites(t *testing.T) {
	for seed := range uint64(6) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			sw := newSegWriter(t, 48<<10, seed)
			want := map[uint64]pb.Entry{}
			var last, term uint64 = 0, 1
			for step := 0; step < 400; step++ {
				from := last + 1
				if last > 0 && sw.rng.IntN(12) == 0 {
					// An overwrite: a new term takes over from an
					// earlier index, some way back.
					from = last - uint64(sw.rng.IntN(int(min(last, 300)))) + 1
					from = max(from, 1)
					term++
				}
				n := uint64(1 + sw.rng.IntN(40))
				ents := makeEntries(from, n, term)
				if sw.rng.IntN(5) == 0 {
					ents = nil // a frame of metadata only
				}
				sw.frame(ents)
				for i := range ents {
					want[ents[i].Index] = ents[i]
				}
				if len(ents) > 0 {
					last = ents[len(ents)-1].Index
				}
			}
			if sw.seq < firstSegment+5 {
				t.Fatalf("only %d segments: the test wants several cuts", sw.seq-firstSegment+1)
			}
			r := sw.reader()
			defer r.files.close()
			checkAll(t, r, &sw.x, want, last)
			x := sw.rebuild()
			if len(x.pts) != len(sw.x.pts) {
				t.Errorf("rebuilt index has %d points, the written one %d", len(x.pts), len(sw.x.pts))
			}
			checkAll(t, r, x, want, last)
			if n := len(x.pts); n > int(last)/4 {
				t.Errorf("%d points for %d entries: the index is not sparse", n, last)
			}
		})
	}
}

// Dropping segments from the front leaves the entries after them
// readable, and the first index the next segment's first entry.
func TestSegmentsDropThrough(t *testing.T) {
	sw := newSegWriter(t, 16<<10, 7)
	want := map[uint64]pb.Entry{}
	var last uint64
	for range 200 {
		ents := makeEntries(last+1, 10, 1)
		sw.frame(ents)
		for i := range ents {
			want[ents[i].Index] = ents[i]
		}
		last += 10
	}
	cut := uint64(firstSegment + 2)
	first := sw.x.dropThrough(cut)
	if first == 0 || first > last {
		t.Fatalf("first index %d after dropping through segment %d", first, cut)
	}
	delete(sw.ids, firstSegment)
	r := sw.reader()
	defer r.files.close()
	checkAll(t, r, &sw.x, want, last)
	if _, err := r.entry(&sw.x, first-1); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("entry %d before the first: %v", first-1, err)
	}
}

// A damaged frame past an index point is reported as corruption, never
// read as the end of the log.
func TestSegmentsDamageIsCorruption(t *testing.T) {
	sw := newSegWriter(t, 1<<20, 3)
	for i := range uint64(100) {
		sw.frame(makeEntries(i*5+1, 5, 1))
	}
	p, _ := sw.x.find(250)
	path := walPath(sw.dir, int(p.seq))
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	// The frame holding 250, found by walking from the point.
	r := sw.reader()
	defer r.files.close()
	if err := r.at(p); err != nil {
		t.Fatal(err)
	}
	for {
		fp, _, at, ok, err := r.frame()
		if err != nil || !ok {
			t.Fatalf("frame: %v %v", ok, err)
		}
		if f, l, _, _ := frameSpan(fp); f <= 250 && 250 <= l {
			b[at+walHdr+5] ^= 0x40
			break
		}
	}
	if err := os.WriteFile(path, b, 0o640); err != nil {
		t.Fatal(err)
	}
	r2 := sw.reader()
	defer r2.files.close()
	if _, err := r2.entry(&sw.x, 250); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("entry in a damaged frame: %v, want ErrCorrupt", err)
	}
	if _, err := r2.entry(&sw.x, 10); err != nil {
		t.Fatalf("entry before the damage: %v", err)
	}
}
