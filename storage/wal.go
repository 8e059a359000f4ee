package storage

import (
	"bytes"
	crand "crypto/rand"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"path/filepath"
	"sync/atomic"
	"time"

	pb "go.etcd.io/raft/v3/raftpb"
)

// WALName is the name of the write-ahead log inside the data dir: two
// files, WALName+".0" and WALName+".1", used in turn.
//
// Why a log in front of bbolt: a bbolt commit costs two fdatasyncs (its
// pages, then its meta page) and the work of copying the tree's right edge,
// and an ack waits for all of it. Appending the same batch to a file that is
// already allocated and written costs one fdatasync of a page or two:
// 177–199 µs against 380–608 µs for a commit of 43 records on this VM, and
// one flush instead of two on an SD card or eMMC, where each takes 1–5 ms.
// So Save appends each batch to the WAL and the acks wait for that, and the
// entries reach bbolt later, 256 KiB of them at a time, in one transaction
// (a checkpoint), on a goroutine of their own while the next frames go to the
// other file. bbolt stays the store every reader and every other write goes
// through; the WAL only holds what the last checkpoint has not written yet,
// and is replayed into the file at the next Open.
const WALName = "tandem.wal"

const (
	// walPrealloc is the size the WAL is kept at, written with zeros once:
	// a frame then lands on allocated blocks, so its fdatasync writes data
	// only, no allocation and no inode. It is grown (rarely) only when a
	// checkpoint cannot be written and frames keep coming.
	walPrealloc = 1 << 20
	// walCheckpointAt is the WAL offset past which a checkpoint is due,
	// whatever the entries' size (frames of metadata only, large ones).
	walCheckpointAt = 512 << 10
	// walFixed is the fixed part of a frame's payload.
	walFixed = 1 + 24 + 8 + 4 + 4 + 8
	// walHdr is a frame's header: payload length (4), CRC-32C of the id
	// and the payload (4), the WAL id (8).
	walHdr = 16
	// walMaxFrame bounds a frame's payload length read back, so a damaged
	// length cannot make the reader allocate gigabytes.
	walMaxFrame = 1 << 30
	// walPage is the block a filesystem writes (ext4, f2fs and vfat use
	// 4 KiB): an fdatasync writes every such block a frame touched, whole,
	// so a frame that starts in the page the previous one ended in rewrites
	// that page, already durable, and one that straddles a boundary writes
	// two where one would do. See padFrame.
	walPage = 4096
	// walPadded is the flags bit of a frame that starts at a page
	// boundary past the end of the previous one (padFrame); the offset that
	// frame ended at follows the fixed part, so a reader knows the gap was
	// left on purpose.
	walPadded = 4
)

// Frame payload: flags (1; bit 0: a hard state follows; bit 1: the next
// frames go to the other file; bit 2: padded) | hard state (term, vote,
// commit: 24) | the other file's id (8) | in a padded frame only, the offset
// the previous frame ended at (8) | op count (4) | ops | entry count (4) |
// first index (8) | entries. An op: bucket length (1) | bucket | key length (2) | key |
// value length + 1 (4; 0 is a delete) | value. An entry: value length (4) |
// the value as the log bucket stores it (CRC, term, type, data).
//
// Each checkpoint starts with a cut: a last frame in the current file says
// that the next ones go to the other file, under a new random id. The
// checkpoint's bbolt transaction records that file and id. A frame counts
// only if it carries the id the file records (or the one a cut frame passed
// on), so frames written before the last checkpoint are dead without
// anything being erased, and a frame is never mistaken for one inside an
// older frame's payload (nobody can guess the id).

// zeros is the source of grow's writes.
var zeros = make([]byte, 64<<10)

// walSeg is one of the two WAL files.
type walSeg struct {
	f    *os.File
	size int64 // bytes the file holds (frames and zeros)
	// step is what the file grows by, 0 for walPrealloc: in format 6
	// segStep, so that a record larger than a segment does not take a
	// whole walPrealloc more of the budget.
	step int64
}

// growStep is what w grows by.
func (w *walSeg) growStep() int64 {
	if w.step > 0 {
		return w.step
	}
	return walPrealloc
}

// walLog is the WAL and where the next frame goes. Guarded by DB.wmu.
type walLog struct {
	segs [2]walSeg
	// chain is set in format 6 (segments.go): cur is then a segment's
	// seq, cseg the segment frames go to and spare, when not nil, the
	// next one, made ready ahead of the cut that will lead to it.
	chain bool
	cseg  *walSeg
	spare *walSeg
	// sealed is the segment the last cut ended, still open: the flusher
	// may be syncing it without wmu. Closed at the next cut.
	sealed *walSeg
	cur    int // the file frames go to
	// lastAt is where the last frame written starts; sinceMark counts
	// the bytes of frames written since the replay point (format 6).
	lastAt    int64
	sinceMark atomic.Int64 // read by behind without wmu
	// segFirst is the publish time of the first record in the current
	// segment, 0 when it holds none (format 6, sealIfFullLocked).
	segFirst int64
	off      int64  // where the last frame ends in it: the next one goes there, or at the next page (padFrame)
	id       uint64 // the id its frames carry; 0 until the first checkpoint
	buf      []byte // frame being built, reused
	// retry is set when a frame failed to be written or synced: the next
	// frame goes where that one went, padded as it was, so that it
	// overwrites its header and no part of it can be read back as live.
	retry, retryPad bool
	// mayPad is set once the file says formatPadded (a checkpoint of
	// this process committed): only then may a frame be padded.
	mayPad atomic.Bool

	// dirtyLo and dirtyHi are the pages frames were written to since the
	// last fdatasync, and written counts the bytes of the pages each
	// fdatasync of the WAL covered (and its grows wrote): what the WAL
	// costs the device, which the tests bound per record.
	dirtyLo, dirtyHi int64
	written          atomic.Int64

	// synced is off once the frames before it are on disk: what a crash at
	// this instant keeps, once no cut's sync is owed (unsyncedCut). Read
	// without wmu: by behind, on every write, and by the tests' crash
	// copies.
	synced atomic.Int64
	// unsyncedCut is the cut frame that ended the other file and leads to
	// this one, while its fdatasync is owed.
	unsyncedCut *unsyncedCut
}

// walFrame is one decoded frame, at Open.
type walFrame struct {
	seg    int
	off    int64
	padded bool  // it starts past a gap left on purpose (padFrame)
	prev   int64 // then: where the frame before the gap ended
	hs     *pb.HardState
	next   uint64 // a cut: the id of the frames in the other file
	ops    []stagedOp
	ents   []pb.Entry
}

// walPath is the path of WAL file i in dir.
func walPath(dir string, i int) string { return filepath.Join(dir, fmt.Sprintf("%s.%d", WALName, i)) }

// openWALs opens both WAL files; see openWAL.
func openWALs(dir string, ro, want bool) (*walLog, error) {
	w := &walLog{}
	for i := range w.segs {
		seg, err := openWAL(walPath(dir, i), ro, want)
		if err != nil {
			w.close()
			return nil, err
		}
		w.segs[i] = seg
	}
	return w, nil
}

func (w *walLog) close() {
	for i := range w.segs {
		if w.segs[i].f != nil {
			_ = w.segs[i].f.Close()
			w.segs[i].f = nil
		}
	}
	for _, s := range []*walSeg{w.cseg, w.spare, w.sealed} {
		if s != nil && s.f != nil {
			_ = s.f.Close()
			s.f = nil
		}
	}
}

// curSeg is the file frames go to.
func (w *walLog) curSeg() *walSeg {
	if w.chain {
		if w.cseg == nil {
			return &walSeg{}
		}
		return w.cseg
	}
	return &w.segs[w.cur]
}

// openWAL opens (read-write: creating) a WAL file. want says it is
// expected to exist: the data file is of format 2 or later, so the WAL may
// hold acked records that are nowhere else.
func openWAL(path string, ro, want bool) (walSeg, error) {
	flag := os.O_RDWR
	if ro {
		flag = os.O_RDONLY
	}
	f, err := os.OpenFile(path, flag, 0)
	switch {
	case os.IsNotExist(err) && want:
		return walSeg{}, fmt.Errorf("%s is missing: it may hold acknowledged records that %s does not have yet; restore it, or create it empty to start without them: %w", path, FileName, ErrCorrupt)
	case os.IsNotExist(err) && ro:
		return walSeg{}, nil
	case os.IsNotExist(err):
		if f, err = os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o640); err != nil {
			return walSeg{}, fmt.Errorf("storage: create %s: %w", path, err)
		}
		if err := syncDir(filepath.Dir(path)); err != nil {
			f.Close()
			return walSeg{}, err
		}
	case err != nil:
		return walSeg{}, fmt.Errorf("storage: open %s: %w", path, err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return walSeg{}, fmt.Errorf("storage: stat %s: %w", path, err)
	}
	return walSeg{f: f, size: st.Size()}, nil
}

// syncDir makes a new directory entry durable.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("storage: open %s: %w", dir, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("storage: sync %s: %w", dir, err)
	}
	return nil
}

// growWAL grows seg to at least n bytes (walSeg.grow), unless the DB's
// failpoints make that fail.
func (db *DB) growWAL(seg *walSeg, n int64) error {
	if n > seg.size {
		if err := db.faults.growErr(seg.f.Name(), n); err != nil {
			return fmt.Errorf("storage: grow %s: %w", seg.f.Name(), err)
		}
	}
	return seg.grow(n)
}

// grow writes zeros from the end of the file up to at least n bytes and
// makes the new size durable. It never writes below the current end, where
// live frames may be.
func (w *walSeg) grow(n int64) error {
	if w.size >= n {
		return nil
	}
	for off := w.size; off < n; off += int64(len(zeros)) {
		if _, err := w.f.WriteAt(zeros[:min(int64(len(zeros)), n-off)], off); err != nil {
			return fmt.Errorf("storage: grow %s: %w", w.f.Name(), err)
		}
	}
	if err := w.f.Sync(); err != nil {
		return fmt.Errorf("storage: grow %s: %w", w.f.Name(), err)
	}
	w.size = n
	return nil
}

// newWALID returns a random non-zero WAL id.
func newWALID() uint64 {
	var b [8]byte
	for {
		if _, err := crand.Read(b[:]); err != nil {
			panic(fmt.Sprintf("storage: random WAL id: %v", err))
		}
		if id := binary.LittleEndian.Uint64(b[:]); id != 0 {
			return id
		}
	}
}

// readAll returns the live frames: those of file seg carrying id, from its
// start, and if they end with a cut, those of the other file that carry
// the id the cut names.
func (w *walLog) readAll(seg int, id uint64) ([]walFrame, error) {
	var all []walFrame
	for hop := 0; hop < 2 && id != 0; hop++ {
		frames, end, err := w.segs[seg].readFrames(id)
		if err != nil {
			return nil, err
		}
		for i := range frames {
			frames[i].seg = seg
		}
		all = append(all, frames...)
		w.cur, w.off, w.id = seg, end, id
		w.synced.Store(end)
		if len(frames) == 0 || frames[len(frames)-1].next == 0 {
			break
		}
		seg, id = 1-seg, frames[len(frames)-1].next
		w.cur, w.off, w.id = seg, 0, id
		w.synced.Store(0)
	}
	return all, nil
}

// readFrames returns the frames of the file carrying id, from offset 0 on,
// up to a cut or the first that does not check out, and the offset where
// they end. A frame that does not check out is the end of the log, torn or
// never written, unless a live frame follows it somewhere: frames are
// written one after the other and each is synced before the next, so a good
// one past a bad one means the bad one was damaged after it was acked, which
// is corruption, not a torn write.
func (w *walSeg) readFrames(id uint64) ([]walFrame, int64, error) {
	if w.f == nil || w.size == 0 {
		return nil, 0, nil
	}
	b := make([]byte, w.size)
	if _, err := w.f.ReadAt(b, 0); err != nil && err != io.EOF {
		return nil, 0, fmt.Errorf("storage: read %s: %w", w.f.Name(), err)
	}
	var frames []walFrame
	off := int64(0)
	for {
		at := off
		payload, ok := frameAt(b, at, id)
		if !ok {
			if payload, at, ok = paddedAt(b, off, id); !ok {
				break
			}
		}
		fr, err := decodeFrame(payload)
		if err != nil {
			return nil, 0, fmt.Errorf("%s: frame at offset %d: %v: %w", w.f.Name(), at, err, ErrCorrupt)
		}
		fr.off = at
		frames = append(frames, fr)
		off = at + walHdr + int64(len(payload))
		if fr.next != 0 {
			break
		}
	}
	if err := w.checkLength(b, off, id); err != nil {
		return nil, 0, err
	}
	if at, ok := findFrame(b, off+1, id); ok {
		return nil, 0, fmt.Errorf("%s: the frame at offset %d is damaged or missing, and a good one follows at %d: acknowledged records would be lost: %w", w.f.Name(), off, at, ErrCorrupt)
	}
	return frames, off, nil
}

// findFrame returns the offset of the first frame carrying id that checks
// out in b at from or past it. It looks for the id (at offset 8 of a
// header): a search for 8 bytes, fast enough to do over a whole file at
// every Open.
func findFrame(b []byte, from int64, id uint64) (int64, bool) {
	var pat [8]byte
	binary.LittleEndian.PutUint64(pat[:], id)
	for p := from + 8; p < int64(len(b)); {
		i := bytes.Index(b[p:], pat[:])
		if i < 0 {
			break
		}
		if _, ok := frameAt(b, p+int64(i)-8, id); ok {
			return p + int64(i) - 8, true
		}
		p += int64(i) + 1
	}
	return 0, false
}

// checkLength reports a file cut short below the frames that end at off.
// Frames are only ever written into space that grow made durable first, in
// whole walPrealloc steps, so a power cut never leaves a frame past the end
// of the file, and never a file that ends, short of a whole step, inside
// the step frames reach: either means the file lost its tail (copied or
// truncated by hand, a damaged filesystem), and with it acked records. A
// file short of a whole step with every frame below that step is a grow
// the cut interrupted: nothing was written there yet.
func (w *walSeg) checkLength(b []byte, off int64, id uint64) error {
	size := int64(len(b))
	if off+walHdr <= size {
		h := b[off:]
		n := int64(binary.LittleEndian.Uint32(h))
		if binary.LittleEndian.Uint64(h[8:]) == id && n <= walMaxFrame && off+walHdr+n > size {
			return fmt.Errorf("%s is cut short: the frame at offset %d needs %d bytes, the file has %d: acknowledged records past it would be lost: %w", w.f.Name(), off, off+walHdr+n, size, ErrCorrupt)
		}
	}
	if rem := size % w.growStep(); rem != 0 && off > size-rem {
		return fmt.Errorf("%s is cut short: it has %d bytes, not a whole number of %d-byte steps, and its frames reach offset %d: acknowledged records past the cut would be lost: %w", w.f.Name(), size, w.growStep(), off, ErrCorrupt)
	}
	return nil
}

// frameAt returns the payload of the live frame at off in b, if there is one.
func frameAt(b []byte, off int64, id uint64) ([]byte, bool) {
	if off+walHdr > int64(len(b)) {
		return nil, false
	}
	h := b[off:]
	n := int64(binary.LittleEndian.Uint32(h))
	if binary.LittleEndian.Uint64(h[8:]) != id || n > walMaxFrame || off+walHdr+n > int64(len(b)) {
		return nil, false
	}
	if crc32.Checksum(b[off+8:off+walHdr+n], castagnoli) != binary.LittleEndian.Uint32(h[4:]) {
		return nil, false
	}
	return b[off+walHdr : off+walHdr+n], true
}

// paddedAt returns the frame after the gap padFrame leaves past a frame
// that ends at off: one at the next page boundary that says it follows a
// frame ending at off. Any other frame there is not the log's next one.
func paddedAt(b []byte, off int64, id uint64) ([]byte, int64, bool) {
	at := (off + walPage - 1) / walPage * walPage
	if at == off {
		return nil, 0, false
	}
	p, ok := frameAt(b, at, id)
	if !ok || len(p) < 33+8 || p[0]&walPadded == 0 || int64(binary.LittleEndian.Uint64(p[33:])) != off {
		return nil, 0, false
	}
	return p, at, true
}

// padFrame says whether a frame of n bytes (unpadded: a padded one has 8
// more) that would start at off is better started at the next page
// boundary: when that writes fewer pages at its fdatasync. A frame that
// fits in what is left of its page is never padded (the page is written
// anyway), so records one per fdatasync still share pages and the WAL does
// not fill faster; one that would spill into a page more than it needs
// starts afresh, and its fdatasync writes only the pages it fills, none
// already durable. A cut is not padded (it is small, and once per
// checkpoint) unless it retries a padded frame that failed.
func padFrame(off int64, n int) bool {
	in := off % walPage
	if in == 0 {
		return false
	}
	return (int64(n)+8+walPage-1)/walPage < (in+int64(n)+walPage-1)/walPage
}

// frameSize is the size of the WAL frame of ops and ents, unpadded.
func frameSize(ops []stagedOp, ents []pb.Entry) int {
	n := walHdr + walFixed
	for i := range ops {
		n += 1 + len(ops[i].bucket) + 2 + len(ops[i].key) + 4 + len(ops[i].val)
	}
	for i := range ents {
		n += 4 + entrySize(&ents[i])
	}
	return n
}

// encodeFrame builds the frame of a batch in w.buf; next, when not 0,
// makes it a cut; prev, when not negative, a padded frame that follows one
// ending at prev.
func (w *walLog) encodeFrame(hs *pb.HardState, next uint64, prev int64, ops []stagedOp, ents []pb.Entry) []byte {
	n := frameSize(ops, ents)
	if prev >= 0 {
		n += 8
	}
	if cap(w.buf) < n {
		w.buf = make([]byte, n, n+n/4)
	}
	b := w.buf[:n]
	le := binary.LittleEndian
	p := b[walHdr:]
	p[0] = 0
	if hs != nil {
		p[0] = 1
		le.PutUint64(p[1:], hs.Term)
		le.PutUint64(p[9:], hs.Vote)
		le.PutUint64(p[17:], hs.Commit)
	} else {
		clear(p[1:25])
	}
	if next != 0 {
		p[0] |= 2
	}
	le.PutUint64(p[25:], next)
	p = p[33:]
	if prev >= 0 {
		b[walHdr] |= walPadded
		le.PutUint64(p, uint64(prev))
		p = p[8:]
	}
	le.PutUint32(p, uint32(len(ops)))
	p = p[4:]
	for i := range ops {
		op := &ops[i]
		p[0] = byte(len(op.bucket))
		p = p[1+copy(p[1:], op.bucket):]
		le.PutUint16(p, uint16(len(op.key)))
		p = p[2+copy(p[2:], op.key):]
		if op.val == nil {
			le.PutUint32(p, 0)
			p = p[4:]
			continue
		}
		le.PutUint32(p, uint32(len(op.val))+1)
		p = p[4+copy(p[4:], op.val):]
	}
	le.PutUint32(p, uint32(len(ents)))
	var first uint64
	if len(ents) > 0 {
		first = ents[0].Index
	}
	le.PutUint64(p[4:], first)
	p = p[12:]
	for i := range ents {
		sz := entrySize(&ents[i])
		le.PutUint32(p, uint32(sz))
		putEntry(p[4:4+sz], &ents[i])
		p = p[4+sz:]
	}
	le.PutUint32(b, uint32(n-walHdr))
	le.PutUint64(b[8:], w.id)
	le.PutUint32(b[4:], crc32.Checksum(b[8:], castagnoli))
	return b
}

// decodeFrame decodes a payload whose CRC checked out. Errors here mean a
// frame that was written wrong, since its CRC matched.
func decodeFrame(p []byte) (walFrame, error) {
	var fr walFrame
	le := binary.LittleEndian
	short := fmt.Errorf("payload of %d bytes ends early", len(p))
	if len(p) < 33+4 {
		return fr, short
	}
	if p[0]&1 != 0 {
		fr.hs = &pb.HardState{Term: le.Uint64(p[1:]), Vote: le.Uint64(p[9:]), Commit: le.Uint64(p[17:])}
	}
	if p[0]&2 != 0 {
		if fr.next = le.Uint64(p[25:]); fr.next == 0 {
			return fr, fmt.Errorf("a cut to id 0")
		}
	}
	padded := p[0]&walPadded != 0
	p = p[33:]
	if padded {
		if len(p) < 8+4 {
			return fr, short
		}
		fr.padded, fr.prev = true, int64(le.Uint64(p))
		if fr.prev < 0 {
			return fr, fmt.Errorf("padded after offset %d", fr.prev)
		}
		p = p[8:]
	}
	nops := le.Uint32(p)
	p = p[4:]
	for range nops {
		if len(p) < 1 || len(p) < 1+int(p[0])+2 {
			return fr, short
		}
		var op stagedOp
		op.bucket = string(p[1 : 1+int(p[0])])
		p = p[1+int(p[0]):]
		kl := int(le.Uint16(p))
		if len(p) < 2+kl+4 {
			return fr, short
		}
		op.key = string(p[2 : 2+kl])
		p = p[2+kl:]
		vl := le.Uint32(p)
		p = p[4:]
		if vl > 0 {
			if uint64(len(p)) < uint64(vl-1) {
				return fr, short
			}
			op.val = append([]byte{}, p[:vl-1]...)
			p = p[vl-1:]
		}
		op.k = op.bucket + "\x00" + op.key
		fr.ops = append(fr.ops, op)
	}
	if len(p) < 12 {
		return fr, short
	}
	nents := le.Uint32(p)
	idx := le.Uint64(p[4:])
	p = p[12:]
	for i := range nents {
		if len(p) < 4 || uint64(len(p)-4) < uint64(le.Uint32(p)) {
			return fr, short
		}
		sz := le.Uint32(p)
		e, err := decodeEntry(idx+uint64(i), p[4:4+sz])
		if err != nil {
			return fr, err
		}
		fr.ents = append(fr.ents, e)
		p = p[4+sz:]
	}
	if len(p) != 0 {
		return fr, fmt.Errorf("%d bytes past the last entry", len(p))
	}
	return fr, nil
}

// appendWAL writes one frame (a cut when next is not 0) and makes it
// durable, unless lazy: then the flusher's next fdatasync does (flush:
// interval). A hard state is never lazy: raft's term and vote must be on
// disk before the messages that depend on them leave; a cut is lazy only
// when cutLocked says so, and then syncs before any frame after it. The
// caller holds wmu. On an error nothing moves: the next frame goes where
// this one went (padded or not, as it was) and overwrites whatever part of
// it reached the file.
func (db *DB) appendWAL(hs *pb.HardState, next uint64, ops []stagedOp, ents []pb.Entry, lazy bool) (time.Duration, error) {
	lazy = lazy && db.flushEvery > 0 && hs == nil
	w := db.wal
	var t0 int64 // the frame's first record's time (format 6)
	if w.chain && next == 0 {
		t0 = firstRecordTime(ents)
		if err := db.sealIfFullLocked(frameSize(ops, ents), t0); err != nil {
			return 0, err
		}
	}
	seg := w.curSeg()
	if seg.f == nil {
		return 0, ErrClosed
	}
	at, prev := w.off, int64(-1)
	pad := next == 0 && w.mayPad.Load() && padFrame(w.off, frameSize(ops, ents))
	if w.retry {
		pad = w.retryPad
	}
	if pad {
		at, prev = (w.off+walPage-1)/walPage*walPage, w.off
	}
	fr := w.encodeFrame(hs, next, prev, ops, ents)
	if cap(w.buf) > maxKeptBuf {
		w.buf = nil // fr stays valid for this call
	}
	w.retry, w.retryPad = true, pad // until it is written (and synced)
	if end := at + int64(len(fr)); end > seg.size {
		// Rarely: checkpoints are failing, or a batch is huge. Grow by
		// whole steps, each with its fsync, not by every frame.
		grown := seg.size
		step := seg.growStep()
		if err := db.growWAL(seg, (end+step-1)/step*step); err != nil {
			return 0, err
		}
		w.written.Add(seg.size - grown)
		db.syncs.Add(1)
	}
	start := time.Now()
	if _, err := seg.f.WriteAt(fr, at); err != nil {
		return 0, fmt.Errorf("storage: write %s: %w", seg.f.Name(), err)
	}
	w.dirty(at, at+int64(len(fr)))
	w.lastAt = at
	if w.segFirst == 0 {
		w.segFirst = t0
	}
	w.sinceMark.Add(int64(len(fr)))
	if lazy {
		w.off, w.retry = at+int64(len(fr)), false
		return time.Since(start), nil
	}
	if err := db.syncCutLocked(); err != nil {
		return 0, err // the cut this frame follows: first
	}
	if err := walSync(seg.f); err != nil {
		return 0, fmt.Errorf("storage: sync %s: %w", seg.f.Name(), err)
	}
	if db.syncDelay > 0 {
		time.Sleep(db.syncDelay)
	}
	w.synced.Store(at + int64(len(fr)))
	w.off, w.retry = at+int64(len(fr)), false
	w.flushed(w.off)
	db.syncs.Add(1)
	return time.Since(start), nil
}

// dirty notes that bytes [from, to) of the current file were written.
// The caller holds wmu.
func (w *walLog) dirty(from, to int64) {
	from, to = from/walPage*walPage, (to+walPage-1)/walPage*walPage
	if w.dirtyHi == w.dirtyLo {
		w.dirtyLo, w.dirtyHi = from, to
		return
	}
	w.dirtyLo, w.dirtyHi = min(w.dirtyLo, from), max(w.dirtyHi, to)
}

// dirtyPages is the bytes of the dirty pages an fdatasync covering the
// current file up to off writes. The caller holds wmu.
func (w *walLog) dirtyPages(off int64) int64 {
	if w.dirtyHi == w.dirtyLo {
		return 0
	}
	return min(w.dirtyHi, (off+walPage-1)/walPage*walPage) - w.dirtyLo
}

// flushed counts the pages an fdatasync covering the current file up to
// off wrote. The caller holds wmu.
func (w *walLog) flushed(off int64) {
	if w.dirtyHi == w.dirtyLo {
		return
	}
	n := w.dirtyPages(off)
	w.written.Add(n)
	hi := w.dirtyLo + n
	if hi >= w.dirtyHi {
		w.dirtyLo, w.dirtyHi = 0, 0
	} else {
		w.dirtyLo = hi
	}
}

// flusher fdatasyncs the WAL every Options.FlushInterval while frames were
// written without a sync of their own (flush: interval), until Close. A
// failing sync is logged when it starts and stops failing; the frames stay
// written, so a process crash still loses nothing, and the next tick tries
// again.
func (db *DB) flusher() {
	defer close(db.flDone)
	t := time.NewTicker(db.flushEvery)
	defer t.Stop()
	failing := false
	for {
		select {
		case <-db.flStop:
			return
		case <-t.C:
		}
		err := db.syncWAL()
		switch {
		case err != nil && !failing:
			db.log.Warn("periodic fdatasync of the WAL failed; retrying", "error", err)
		case err == nil && failing:
			db.log.Info("periodic fdatasyncs of the WAL work again")
		}
		failing = err != nil
	}
}

// syncWAL makes the current WAL file's frames durable, and first the cut
// that leads to them if its sync is owed (unsyncedCut). The fdatasyncs run
// without wmu, so Saves go on writing meanwhile; they cover every frame
// written before they started.
func (db *DB) syncWAL() error {
	db.wmu.Lock()
	w := db.wal
	cur, id, off := w.cur, w.id, w.off
	f := w.curSeg().f
	p := w.unsyncedCut // read with cur: the cut that leads to cur's frames
	db.wmu.Unlock()
	if err := db.syncCutUnlocked(p); err != nil {
		return err
	}
	if f == nil || off <= w.synced.Load() {
		return nil
	}
	if err := fdatasync(f); err != nil {
		return fmt.Errorf("storage: sync %s: %w", f.Name(), err)
	}
	if db.syncDelay > 0 {
		time.Sleep(db.syncDelay)
	}
	db.syncs.Add(1)
	db.wmu.Lock()
	if w.cur == cur && w.id == id && off > w.synced.Load() {
		w.synced.Store(off) // a cut since then synced, and reset, itself
		w.flushed(off)
	}
	db.wmu.Unlock()
	return nil
}
