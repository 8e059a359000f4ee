package storage

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"sync"
)

// Segments: the WAL as the log (format 6, being built; see DESIGN.md and
// issue 36's notes). Up to format 5 every record is written twice: once
// into a WAL frame, which the ack waits for, and once more into bbolt's
// runs by the checkpoint, which then lets the WAL file be overwritten. On
// flash that wears out (SD cards, eMMC) the second write is half of what
// the log costs the device: 489 B per 100 B message at W1, 266 of them the
// WAL's.
//
// With segments, the WAL files are the log: a chain of numbered files
// (walPath(dir, seq), seq ≥ firstSegment), each preallocated once and
// linked to the next by the cut frame that ends it, which carries the next
// one's id. A checkpoint still cuts and still writes the staged metadata
// and the hard state into bbolt, but not the entries: they stay where the
// ack put them, and retention drops whole segments from the front.
//
// Reads find an entry through a sparse in-memory index (segIndex): one
// point every segPointEvery bytes of frames, at each segment's first frame
// of entries, and at every frame that overwrites (its first index is not
// past the log's last). Open rebuilds it by reading the chain from its
// head, which it reads whole anyway to check every frame's CRC, as it reads
// every run of the data file in formats up to 5.
//
// An overwrite needs no rewrite of what it overwrites: the later frame
// wins, as in etcd's WAL. The index keeps that true for a reader that
// starts at a point and goes forward: points are sorted by index and by
// position at once (an overwrite at k drops every point at k or past it
// before its own), so the greatest point at or below an index i lies past
// every frame of an earlier generation holding i, and the first frame
// holding i from there is the live one.

// firstSegment is the seq of the first segment of a chain: WAL files 0
// and 1 are the two files formats up to 5 use in turn.
const firstSegment = 2

// segPointEvery is how far apart, in bytes of frames, the index keeps a
// point: the most a read of one entry parses before it reaches its frame.
const segPointEvery = 64 << 10

// segPoint is where a frame starts whose first entry is idx.
type segPoint struct {
	idx uint64
	seq uint64
	off int64
}

// segIndex locates entries in the segments. Not safe for concurrent use:
// the DB guards it.
type segIndex struct {
	pts  []segPoint
	last uint64 // the last entry noted, 0: none
}

// note records a frame whose entries are [first, last], written at seq,
// off.
func (x *segIndex) note(first, last, seq uint64, off int64) {
	over := x.last != 0 && first <= x.last
	if over {
		x.truncate(first)
	}
	// Without an overwrite every point is at or below x.last, so before
	// first: the points stay sorted by index.
	n := len(x.pts)
	if n == 0 || over || x.pts[n-1].seq != seq || off-x.pts[n-1].off >= segPointEvery {
		x.pts = append(x.pts, segPoint{idx: first, seq: seq, off: off})
	}
	x.last = last
}

// truncate forgets every entry from k on: points at k or past it.
func (x *segIndex) truncate(k uint64) {
	i := sort.Search(len(x.pts), func(i int) bool { return x.pts[i].idx >= k })
	x.pts = x.pts[:i]
	if x.last >= k {
		x.last = k - 1
	}
}

// find returns the point to read entry i from: the greatest at or below i.
func (x *segIndex) find(i uint64) (segPoint, bool) {
	if i > x.last {
		return segPoint{}, false
	}
	n := sort.Search(len(x.pts), func(j int) bool { return x.pts[j].idx > i })
	if n == 0 {
		return segPoint{}, false
	}
	return x.pts[n-1], true
}

// dropThrough forgets segments up to seq, whose entries retention dropped:
// the next segment's first point becomes the first. It returns that
// point's index, 0 when no point is left.
func (x *segIndex) dropThrough(seq uint64) uint64 {
	i := sort.Search(len(x.pts), func(i int) bool { return x.pts[i].seq > seq })
	x.pts = append(x.pts[:0], x.pts[i:]...)
	if len(x.pts) == 0 {
		x.last = 0
		return 0
	}
	return x.pts[0].idx
}

// segFiles opens segments for reading, keeping a few open: a chain may
// have thousands, more than a service's open files allow. A file closed
// here while a ReadAt runs on it is not closed under that read (os.File
// counts its users), which then fails with os.ErrClosed and is retried.
type segFiles struct {
	dir   string
	mu    sync.Mutex
	open  map[uint64]*os.File
	order []uint64 // least recently opened first
}

// segFilesOpen is how many segment files segFiles keeps open.
const segFilesOpen = 8

func newSegFiles(dir string) *segFiles { return &segFiles{dir: dir, open: map[uint64]*os.File{}} }

// get returns segment seq, opened read-only.
func (s *segFiles) get(seq uint64) (*os.File, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if f := s.open[seq]; f != nil {
		return f, nil
	}
	f, err := os.Open(walPath(s.dir, int(seq)))
	if err != nil {
		if os.IsNotExist(err) {
			return nil, fmt.Errorf("storage: segment %s is missing: %w", walPath(s.dir, int(seq)), ErrCorrupt)
		}
		return nil, fmt.Errorf("storage: %w", err)
	}
	if len(s.order) >= segFilesOpen {
		old := s.order[0]
		s.order = s.order[1:]
		_ = s.open[old].Close()
		delete(s.open, old)
	}
	s.open[seq] = f
	s.order = append(s.order, seq)
	return f, nil
}

// forget closes segment seq if it is open: it was dropped, or is about to
// be reused.
func (s *segFiles) forget(seq uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if f := s.open[seq]; f != nil {
		_ = f.Close()
		delete(s.open, seq)
		for i, q := range s.order {
			if q == seq {
				s.order = append(s.order[:i], s.order[i+1:]...)
				break
			}
		}
	}
}

// close closes every file.
func (s *segFiles) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for seq, f := range s.open {
		_ = f.Close()
		delete(s.open, seq)
	}
	s.order = nil
}

// segReadAhead is how much a segReader reads at once.
const segReadAhead = 64 << 10

// segReader reads frames forward through the chain, from a point on,
// hopping to the next segment at each cut. ids gives a segment's id.
type segReader struct {
	files *segFiles
	ids   func(seq uint64) (uint64, bool)
	seq   uint64
	id    uint64
	off   int64 // where the next frame is looked for
	// win holds the file's bytes [winOff, winOff+len(win)) of segment
	// winSeq.
	win    []byte
	winSeq uint64
	winOff int64
}

// at positions r at a frame start.
func (r *segReader) at(p segPoint) error {
	id, ok := r.ids(p.seq)
	if !ok {
		return fmt.Errorf("storage: segment %d is not in the chain: %w", p.seq, errSegGone)
	}
	r.seq, r.id, r.off = p.seq, id, p.off
	return nil
}

// errSegGone says a reader reached a segment that the ids it was given do
// not name: one dropped, or replaced by a restarted chain, since they were
// copied. No caller tells it apart: scanChain, which reads outside mu,
// goes on (from the new first index if it moved) after any error once it
// sees that retention dropped what it read; the other readers return it.
var errSegGone = errors.New("segment dropped")

// bytes returns n bytes of the current segment from off, fewer at its end.
func (r *segReader) bytes(off int64, n int) ([]byte, error) {
	if r.winSeq == r.seq && off >= r.winOff && off+int64(n) <= r.winOff+int64(len(r.win)) {
		return r.win[off-r.winOff : off-r.winOff+int64(n)], nil
	}
	f, err := r.files.get(r.seq)
	if err != nil {
		return nil, err
	}
	want := max(n, segReadAhead)
	if cap(r.win) < want {
		r.win = make([]byte, want)
	}
	r.win = r.win[:want]
	for try := 0; ; try++ {
		m, err := f.ReadAt(r.win, off)
		if errors.Is(err, os.ErrClosed) && try < 3 {
			if f, err = r.files.get(r.seq); err != nil {
				return nil, err
			}
			continue
		}
		if err != nil && err != io.EOF {
			return nil, fmt.Errorf("storage: read %s: %w", f.Name(), err)
		}
		r.win, r.winSeq, r.winOff = r.win[:m], r.seq, off
		break
	}
	return r.win[:min(n, len(r.win))], nil
}

// frame returns the payload of the next frame and where it starts, and
// moves past it; a cut moves r on to the next segment (its payload is
// returned all the same). ok is false where no live frame follows: the end
// of the log, or damage, which the caller tells apart by what it expected.
func (r *segReader) frame() (payload []byte, seq uint64, at int64, ok bool, err error) {
	at = r.off
	p, err := r.frameAt(at)
	if err != nil {
		return nil, 0, 0, false, err
	}
	if p == nil {
		// A frame padded to the next page, after a gap left on purpose.
		if pad := (r.off + walPage - 1) / walPage * walPage; pad != r.off {
			if p, err = r.frameAt(pad); err != nil {
				return nil, 0, 0, false, err
			}
			if p == nil || len(p) < 33+8 || p[0]&walPadded == 0 || int64(binary.LittleEndian.Uint64(p[33:])) != r.off {
				p = nil
			}
			at = pad
		}
	}
	if p == nil {
		return nil, 0, 0, false, nil
	}
	seq = r.seq
	r.off = at + walHdr + int64(len(p))
	if p[0]&2 != 0 {
		next := binary.LittleEndian.Uint64(p[25:])
		id, known := r.ids(r.seq + 1)
		if !known {
			return nil, 0, 0, false, fmt.Errorf("storage: segment %d is not in the chain: %w", r.seq+1, errSegGone)
		}
		if id != next {
			return nil, 0, 0, false, fmt.Errorf("storage: %s ends with a cut to id %x, segment %d has id %x: %w", walPath(r.files.dir, int(r.seq)), next, r.seq+1, id, ErrCorrupt)
		}
		r.seq, r.id, r.off = r.seq+1, id, 0
	}
	return p, seq, at, true, nil
}

// frameAt returns the payload of the live frame at off of the current
// segment, nil if there is none. It aliases the window.
func (r *segReader) frameAt(off int64) ([]byte, error) {
	h, err := r.bytes(off, walHdr)
	if err != nil || len(h) < walHdr {
		return nil, err
	}
	n := int64(binary.LittleEndian.Uint32(h))
	if binary.LittleEndian.Uint64(h[8:]) != r.id || n > walMaxFrame {
		return nil, nil
	}
	b, err := r.bytes(off, walHdr+int(n))
	if err != nil || int64(len(b)) < walHdr+n {
		return nil, err
	}
	p, ok := frameAt(b, 0, r.id)
	if !ok {
		return nil, nil
	}
	return p, nil
}

// frameEntries walks the entries of a frame's payload (whose CRC checked
// out): fn gets each entry's index and value (aliasing p) until it returns
// false. It skips the staged operations without decoding them.
func frameEntries(p []byte, fn func(idx uint64, v []byte) bool) error {
	le := binary.LittleEndian
	short := fmt.Errorf("frame payload of %d bytes ends early: %w", len(p), ErrCorrupt)
	if len(p) < 33+4 {
		return short
	}
	off := 33
	if p[0]&walPadded != 0 {
		off += 8
	}
	if len(p) < off+4 {
		return short
	}
	nops := le.Uint32(p[off:])
	off += 4
	for range nops {
		if len(p) < off+1 {
			return short
		}
		off += 1 + int(p[off])
		if len(p) < off+2 {
			return short
		}
		off += 2 + int(le.Uint16(p[off:]))
		if len(p) < off+4 {
			return short
		}
		vl := le.Uint32(p[off:])
		off += 4
		if vl > 0 {
			if uint64(len(p)-off) < uint64(vl-1) {
				return short
			}
			off += int(vl - 1)
		}
	}
	if len(p) < off+12 {
		return short
	}
	n := le.Uint32(p[off:])
	idx := le.Uint64(p[off+4:])
	off += 12
	for i := range n {
		if len(p) < off+4 || uint64(len(p)-off-4) < uint64(le.Uint32(p[off:])) {
			return short
		}
		sz := int(le.Uint32(p[off:]))
		if !fn(idx+uint64(i), p[off+4:off+4+sz]) {
			return nil
		}
		off += 4 + sz
	}
	return nil
}
