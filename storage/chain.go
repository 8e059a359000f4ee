package storage

import (
	"encoding/binary"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"

	bolt "go.etcd.io/bbolt"
	pb "go.etcd.io/raft/v3/raftpb"
)

// The DB's side of format 6, the WAL as the log (segments.go): a chain of
// segments from the head bbolt records (keySegHead) to the one frames go
// to; the replay point (keyWAL: id, seq and offset) says from where Open
// replays frames' staged operations and hard states, which the checkpoints
// before it wrote into bbolt. Entries are never copied into bbolt: the
// log bucket is empty (an upgrade from an older format moves its runs
// into segments: chainup.go), and boltLast is the compaction point.
//
// Retention drops whole segments from the head (dropSegments), before the
// replay point's segment, and keeps one dropped file for reuse: written
// once with zeros, a segment costs the device nothing more when it comes
// back. A segment is cut when a frame would not fit in it (unless it is
// less than half full: then it grows), and when its records span more
// than a sixteenth of max_age, so that max_age drops records at most that
// much late.
//
// Being built: until it is complete, only a data dir created with
// Options.segmented (this package's tests) or by a test build
// (tandem_format6) is in format 6, and those upgrade a data dir of an
// older format at Open (upgradeToChain). The offline tools read it past
// damage (salvage_chain.go).

// keySegHead is the seq and id of the chain's first segment.
var keySegHead = []byte("seg_head")

// formatChain is the format of a data dir whose WAL is its log.
const formatChain = 6

// segState is the chain as the DB reads it. Guarded by DB.mu.
type segState struct {
	x     segIndex
	ids   map[uint64]uint64 // the id of each live segment, by seq: head on, no gap
	head  uint64            // the first live segment
	files *segFiles
	// recycled is a dropped segment kept for the next makeSegment,
	// "" when none; guarded by recycleMu (retention drops under ckMu,
	// a cut makes a segment under wmu).
	recycleMu sync.Mutex
	recycled  string
}

// segStep is what a segment grows by when a frame does not fit (a
// record larger than walPrealloc): little past what it needs.
const segStep = 64 << 10

// segAgeShare is the share of max_age a segment's records may span
// (sealIfFullLocked).
const segAgeShare = 16

// firstRecordTime returns the publish time of the first record in ents,
// 0 when none holds one.
func firstRecordTime(ents []pb.Entry) int64 {
	for i := range ents {
		if ents[i].Type == pb.EntryNormal {
			if t, ok := recordTime(ents[i].Data); ok {
				return t
			}
		}
	}
	return 0
}

// spareName is the file the next segment is made ready in, renamed to its
// seq when the current one's seq is known for sure (readySpare).
const spareName = WALName + ".next"

// makeSegment makes the file at path a segment frames may go to: the
// dropped segment retention kept for reuse if there is one, else a new
// file (or one a crash left there), written with zeros to walPrealloc;
// synced with its directory entry, so that a cut may lead to it from
// then on. Its old frames, if any, carry ids no cut will name again.
func (db *DB) makeSegment(path string) (*walSeg, error) {
	db.seg.recycleMu.Lock()
	defer db.seg.recycleMu.Unlock()
	if old := db.seg.recycled; old != "" {
		db.seg.recycled = ""
		if err := os.Rename(old, path); err != nil {
			_ = os.Remove(old)
		}
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o640)
	if err != nil {
		return nil, fmt.Errorf("storage: create %s: %w", path, err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("storage: stat %s: %w", path, err)
	}
	s := &walSeg{f: f, size: st.Size(), step: segStep}
	if s.size > walPrealloc {
		// A record larger than a segment grew it: back to the size of
		// one, the frames there are dead.
		if err := f.Truncate(walPrealloc); err != nil {
			f.Close()
			return nil, fmt.Errorf("storage: truncate %s: %w", path, err)
		}
		s.size = walPrealloc
	}
	grown := s.size
	if err := db.growWAL(s, walPrealloc); err != nil {
		f.Close()
		return nil, err
	}
	db.wal.written.Add(s.size - grown)
	if err := syncDir(filepath.Dir(path)); err != nil {
		f.Close()
		return nil, err
	}
	return s, nil
}

// readySpare makes the segment after the current one ready, unless it is:
// the checkpointer's work, after each cut, so that the cut itself finds it
// and the Save that cuts waits for no zeros. It is made under spareName,
// without wmu, and renamed to its seq under wmu: a cut may come between,
// which makes its own. The caller holds ckMu.
func (db *DB) readySpare() error {
	db.wmu.Lock()
	w := db.wal
	need := w.chain && w.spare == nil && w.cseg != nil
	db.wmu.Unlock()
	if !need {
		return nil
	}
	dir := filepath.Dir(db.path)
	tmp := filepath.Join(dir, spareName)
	s, err := db.makeSegment(tmp)
	if err != nil {
		return err
	}
	db.wmu.Lock()
	defer db.wmu.Unlock()
	if w.spare != nil || w.cseg == nil {
		// A cut made its own meanwhile: this one is kept for the
		// next, unless one is kept already.
		s.f.Close()
		db.seg.recycleMu.Lock()
		if db.seg.recycled == "" {
			db.seg.recycled = tmp
		} else if db.seg.recycled != tmp {
			_ = os.Remove(tmp)
		}
		db.seg.recycleMu.Unlock()
		return nil
	}
	if err := os.Rename(tmp, walPath(dir, w.cur+1)); err != nil {
		s.f.Close()
		return fmt.Errorf("storage: %w", err)
	}
	if err := syncDir(dir); err != nil {
		s.f.Close()
		return err
	}
	w.spare = s
	return nil
}

// sealIfFullLocked ends the current segment with a cut when a frame of n
// bytes would not fit in what is left of it, or when its first record,
// published at t0, is more than segAgeShare of max_age younger than the
// segment's first: the next one goes to the segment after it, under a
// new id. The caller holds wmu.
//
// The second keeps what max_age drops close to what it names: retention
// drops whole segments, once the newest record in one is past max_age, so
// a segment spanning more than a share of it would keep records that much
// longer.
func (db *DB) sealIfFullLocked(n int, t0 int64) error {
	w := db.wal
	if w.retry || w.cseg == nil || w.off == 0 {
		// A frame that failed is written again where it went first, in
		// this segment: a cut there could leave it readable after the cut.
		return nil
	}
	aged := db.ret.maxAge > 0 && w.segFirst != 0 && t0 != 0 && t0-w.segFirst > int64(db.ret.maxAge/segAgeShare)
	// A segment less than half full grows for a large frame rather than
	// be cut: cut, most of it would stay empty for as long as it lives
	// (a 1 MiB record after a few small ones, over and over).
	full := w.off+int64(n)+walPage > w.cseg.size && w.off >= walPrealloc/2
	if !full && !aged {
		return nil
	}
	return db.sealLocked()
}

// sealLocked ends the current segment with a cut: the frames after it go
// to the next segment, under a new id. The caller holds wmu.
func (db *DB) sealLocked() error {
	w := db.wal
	next := w.cur + 1
	if w.spare == nil {
		s, err := db.makeSegment(walPath(filepath.Dir(db.path), next))
		if err != nil {
			return err
		}
		w.spare = s
	}
	id := nextSegmentID(w.id)
	if _, err := db.appendWAL(nil, id, nil, nil, false); err != nil {
		return err
	}
	old := w.cseg
	w.cseg, w.spare = w.spare, nil
	w.cur, w.off, w.id = next, 0, id
	w.segFirst = 0
	w.synced.Store(0)
	// The flusher may be syncing the old file without wmu: it is closed
	// at the next cut, not under that sync.
	if w.sealed != nil && w.sealed.f != nil {
		_ = w.sealed.f.Close()
	}
	w.sealed = old
	db.mu.Lock()
	db.seg.ids[uint64(next)] = id
	db.mu.Unlock()
	select {
	case db.ckSig <- struct{}{}: // to make the next spare ready
	default:
	}
	return nil
}

// createChain starts the chain of a new data file: its first segment, and
// the keys that name it, written in the transaction create makes.
func (db *DB) createChain() (head uint64, id uint64, err error) {
	s, err := db.makeSegment(walPath(filepath.Dir(db.path), int(db.chainFrom)))
	if err != nil {
		return 0, 0, err
	}
	s.f.Close()
	return db.chainFrom, newWALID(), nil
}

// segHeadValue encodes keySegHead.
func segHeadValue(seq, id uint64) []byte {
	v := make([]byte, 16)
	binary.BigEndian.PutUint64(v, seq)
	binary.BigEndian.PutUint64(v[8:], id)
	return v
}

// openChain reads the chain from its head: every frame's CRC, the entries
// into the index and the tail, and from the replay point on the staged
// operations and hard states, as replay does for formats up to 5. It
// leaves the WAL at the end of the last segment, where the next frame
// goes. It returns how many frames it replayed.
func (db *DB) openChain(ro bool) (int, error) {
	dir := filepath.Dir(db.path)
	w := db.wal
	w.chain = true
	db.seg.ids = map[uint64]uint64{}
	db.seg.files = newSegFiles(dir)
	seq, id := db.seg.head, db.segHeadID
	var prevTerm uint64
	if len(db.tail) > 0 {
		prevTerm = db.tail[len(db.tail)-1].Term
	}
	replayed := 0
	var segFirst int64
	for {
		path := walPath(dir, int(seq))
		seg, err := openWAL(path, ro, true)
		if err != nil {
			return 0, err
		}
		seg.step = segStep
		fail := func(err error) (int, error) {
			seg.f.Close()
			return 0, err
		}
		frames, end, err := seg.readFrames(id)
		if err != nil {
			return fail(err)
		}
		db.seg.ids[seq] = id
		for _, fr := range frames {
			if fr.next != 0 {
				continue
			}
			where := fmt.Sprintf("%s: frame at offset %d", path, fr.off)
			live := seq > uint64(db.walSeg) || (seq == uint64(db.walSeg) && fr.off >= db.walOff)
			if live {
				replayed++
				if err := db.replayOps(fr); err != nil {
					return fail(fmt.Errorf("%s: %w", where, err))
				}
			}
			if len(fr.ents) == 0 {
				continue
			}
			first, last := fr.ents[0].Index, fr.ents[len(fr.ents)-1].Index
			if first > db.last+1 || first <= db.boltLast {
				return fail(fmt.Errorf("%s starts at index %d, the log ends at %d (%d in the data file): %w", where, first, db.last, db.boltLast, ErrCorrupt))
			}
			if first <= db.last {
				prevTerm = 0 // an overwrite, by a later term
			}
			for i := range fr.ents {
				if fr.ents[i].Term < prevTerm {
					return fail(fmt.Errorf("%s: entry %d has term %d after term %d: %w", where, fr.ents[i].Index, fr.ents[i].Term, prevTerm, ErrCorrupt))
				}
				prevTerm = fr.ents[i].Term
				if live {
					db.pendBytes += entrySize(&fr.ents[i])
				}
			}
			db.seg.x.note(first, last, seq, fr.off)
			if segFirst == 0 {
				segFirst = firstRecordTime(fr.ents)
			}
			db.last = last
			db.appendTailLocked(fr.ents)
		}
		if n := len(frames); n > 0 && frames[n-1].next != 0 {
			seg.f.Close()
			seq, id = seq+1, frames[n-1].next
			segFirst = 0
			continue
		}
		if seq < uint64(db.walSeg) || (seq == uint64(db.walSeg) && end < db.walOff) {
			return fail(fmt.Errorf("%s: the log ends at offset %d, before the data file's replay point (segment %d, offset %d): frames the file has checkpointed are missing: %w", path, end, db.walSeg, db.walOff, ErrCorrupt))
		}
		if err := chainGoesOn(dir, seq, id, end); err != nil {
			return fail(err)
		}
		w.cseg = &seg
		w.cur, w.off, w.id = int(seq), end, id
		w.segFirst = segFirst
		w.synced.Store(end)
		break
	}
	if db.hs.Commit > db.last {
		return 0, fmt.Errorf("%s: commit index %d is past the last entry %d: %w", WALName, db.hs.Commit, db.last, ErrCorrupt)
	}
	if !ro {
		removeDroppedSegments(dir, db.seg.head)
	}
	return replayed, nil
}

// nextSegmentID returns the id of the segment after the one carrying id
// (splitmix64's finaliser, never 0). The cut names it too; derived, it
// can also be looked for when the cut is gone (chainGoesOn). It is as
// hard to guess as the random id the chain starts from.
func nextSegmentID(id uint64) uint64 {
	z := id + 0x9e3779b97f4a7c15
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	if z ^= z >> 31; z == 0 {
		return 1
	}
	return z
}

// maxSegmentsAhead bounds how far past the chain's end nextChainSegment
// looks: only the next segment can exist there in a data dir tandem
// wrote.
const maxSegmentsAhead = 1 << 10

// chainGoesOn reports a segment past seq, the last the chain reaches
// (carrying id, its frames ending at end), that holds a frame of the
// chain: one carrying the id a cut from seq on would have named. A cut is
// synced before any frame goes to the segment it names, so such a frame
// means seq lost its cut, or the frames before it, after they were
// synced: damage, and the acknowledged records past it would be lost if
// Open went on. The segment made ready for the next cut holds zeros or a
// dropped segment's frames, whose ids no cut names again.
func chainGoesOn(dir string, seq, id uint64, end int64) error {
	if k, _, at := nextChainSegment(dir, seq, id); k != 0 {
		return fmt.Errorf("%s ends at offset %d without the cut to the next segment, and %s holds a frame of the chain at offset %d: the segment was damaged after it was synced, and acknowledged records past the damage would be lost: %w", walPath(dir, int(seq)), end, walPath(dir, int(k)), at, ErrCorrupt)
	}
	return nil
}

// nextChainSegment returns the first segment past seq (whose frames carry
// id), within maxSegmentsAhead, that holds a frame of the chain, its id
// and where that frame is; 0 if none does.
func nextChainSegment(dir string, seq, id uint64) (uint64, uint64, int64) {
	seqs := walSeqs(dir)
	top := seq + maxSegmentsAhead
	if n := len(seqs); n > 0 {
		top = min(top, seqs[n-1])
	}
	for k := seq + 1; k <= top; k++ {
		id = nextSegmentID(id)
		if !slices.Contains(seqs, k) {
			continue
		}
		b, err := os.ReadFile(walPath(dir, int(k)))
		if err != nil {
			continue
		}
		if at, ok := findFrame(b, 0, id); ok {
			return k, id, at
		}
	}
	return 0, 0, 0
}

// walSeqs returns the numbers of the WAL files in dir (tandem.wal.N: format
// 5's two, format 6's segments), sorted.
func walSeqs(dir string) []uint64 {
	des, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	var seqs []uint64
	for _, de := range des {
		n, ok := strings.CutPrefix(de.Name(), WALName+".")
		if k, err := strconv.ParseUint(n, 10, 64); ok && err == nil {
			seqs = append(seqs, k)
		}
	}
	slices.Sort(seqs)
	return seqs
}

// Files lists the files of the data dir dir that storage owns: the data
// file and every file of the WAL (format 6's segments, format 5's two
// files, a segment made ready, an upgrade's new data file), the data file
// last. Whoever replaces or moves a data dir's store (repair, a re-sync
// that keeps a damaged one aside) moves these, and the data file last:
// until it is in place, the others are not read as its log.
func Files(dir string) ([]string, error) {
	des, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("storage: %w", err)
	}
	var out []string
	db := false
	for _, de := range des {
		switch n := de.Name(); {
		case n == FileName:
			db = true
		case strings.HasPrefix(n, WALName+".") || n == upgradeName:
			out = append(out, n)
		}
	}
	if db {
		out = append(out, FileName)
	}
	return out, nil
}

// removeDroppedSegments deletes the segments before head: retention
// dropped them, and a crash came before their files went (or one was
// kept for reuse). Format 5's two WAL files (.0 and .1) are before any
// head: dead in a data dir upgraded from it.
func removeDroppedSegments(dir string, head uint64) {
	removed := false
	for _, seq := range walSeqs(dir) {
		if seq < head && os.Remove(walPath(dir, int(seq))) == nil {
			removed = true
		}
	}
	if removed {
		_ = syncDir(dir)
	}
}

// segView is what a reader needs of the chain, copied under mu: the
// index's points for a range, and the segments' ids.
type segView struct {
	pts   []segPoint
	ids   map[uint64]uint64
	files *segFiles
}

// segViewLocked copies the points a read of [lo, hi) uses, and the ids of
// the segments it may reach: from its first point's segment on, since a
// reader only goes forward. The caller holds mu.
func (db *DB) segViewLocked(lo, hi uint64) segView {
	x := &db.seg.x
	i := max(sort.Search(len(x.pts), func(i int) bool { return x.pts[i].idx > lo })-1, 0)
	j := sort.Search(len(x.pts), func(j int) bool { return x.pts[j].idx >= hi })
	j = max(i, j)
	from := db.seg.head
	if i < j {
		from = x.pts[i].seq
	}
	ids := map[uint64]uint64{}
	for s := from; ; s++ {
		id, ok := db.seg.ids[s]
		if !ok {
			break
		}
		ids[s] = id
	}
	return segView{pts: append([]segPoint(nil), x.pts[i:j]...), ids: ids, files: db.seg.files}
}

// liveViewLocked is the chain as a reader under mu sees it: the index and
// the ids themselves, not copies, valid only while the caller holds mu.
func (db *DB) liveViewLocked() segView {
	return segView{pts: db.seg.x.pts, ids: db.seg.ids, files: db.seg.files}
}

// pointFor returns the point entry i is read from: the greatest at or
// below it.
func (v *segView) pointFor(i uint64) (segPoint, bool) {
	x := segIndex{pts: v.pts, last: ^uint64(0)}
	return x.find(i)
}

// after says whether point p comes after position (seq, off).
func (p segPoint) after(seq uint64, off int64) bool {
	return p.seq > seq || (p.seq == seq && p.off > off)
}

// walk calls fn with the live entries [lo, hi) in order, each value
// aliasing the reader's buffer (valid until fn returns), until fn returns
// false. A frame that should be there and is not is ErrCorrupt, and so is
// a segment whose file went after the view was taken, or that the view's
// ids lack (errSegGone): a caller that may race retention (scanChain)
// checks the first index before it believes either.
func (v *segView) walk(lo, hi uint64, fn func(idx uint64, val []byte) (bool, error)) error {
	if lo >= hi {
		return nil
	}
	p, ok := v.pointFor(lo)
	if !ok {
		return fmt.Errorf("entry %d is not in the segments: %w", lo, ErrUnavailable)
	}
	r := segReader{files: v.files, ids: func(seq uint64) (uint64, bool) { id, ok := v.ids[seq]; return id, ok }}
	if err := r.at(p); err != nil {
		return err
	}
	want := lo
	cur, _ := v.pointFor(want)
	for want < hi {
		fp, seq, at, ok, err := r.frame()
		if err != nil {
			return err
		}
		if !ok {
			return fmt.Errorf("entry %d: %s has no live frame at offset %d: %w", want, walPath(v.files.dir, int(r.seq)), r.off, ErrCorrupt)
		}
		stop := false
		var ferr error
		err = frameEntries(fp, func(idx uint64, ev []byte) bool {
			if idx != want || cur.after(seq, at) {
				return idx <= want // before want, or an earlier generation
			}
			more, err := fn(idx, ev)
			if err != nil || !more {
				stop, ferr = true, err
				return false
			}
			want++
			if want >= hi {
				stop = true
				return false
			}
			cur, _ = v.pointFor(want)
			return true
		})
		if err != nil {
			return fmt.Errorf("%s: frame at offset %d: %w", walPath(v.files.dir, int(seq)), at, err)
		}
		if stop {
			return ferr
		}
	}
	return nil
}

// chainEntriesLocked appends to out the entries [lo, hi) the segments
// hold, within maxSize bytes (at least one in all of out). The caller
// holds mu.
func (db *DB) chainEntriesLocked(out []pb.Entry, lo, hi, maxSize uint64) ([]pb.Entry, bool, error) {
	v := db.liveViewLocked()
	var size uint64
	for i := range out {
		size += uint64(out[i].Size())
	}
	full := false
	err := v.walk(lo, hi, func(idx uint64, val []byte) (bool, error) {
		e, err := decodeEntry(idx, val)
		if err != nil {
			return false, err
		}
		size += uint64(e.Size())
		if len(out) > 0 && size > maxSize {
			full = true
			return false, nil
		}
		out = append(out, e)
		return true, nil
	})
	return out, full, err
}

// chainTermLocked returns the term of entry i, which the segments hold.
// The caller holds mu.
func (db *DB) chainTermLocked(i uint64) (uint64, error) {
	v := db.liveViewLocked()
	var term uint64
	found := false
	err := v.walk(i, i+1, func(idx uint64, val []byte) (bool, error) {
		t, err := checkEntry(idx, val)
		term, found = t, err == nil
		return false, err
	})
	if err == nil && !found {
		err = fmt.Errorf("entry %d missing: %w", i, ErrCorrupt)
	}
	return term, err
}

// chainRequeueOps returns, for an append that overwrites the entries from
// from on, the writes that put those that are data entries into the
// requeue bucket, keyed as requeueFrom keys them: the frame of the append
// carries them, so the overwrite and the requeue are durable together.
func (db *DB) chainRequeueOps(from uint64) ([]stagedOp, error) {
	db.mu.RLock()
	last, tailStart := db.last, db.tailStartLocked()
	var vals [][2][]byte
	keep := func(idx uint64, ev []byte) {
		if len(ev) > entryHdr && pb.EntryType(ev[12]) == pb.EntryNormal {
			vals = append(vals, [2][]byte{append(u64(idx), ev[4:12]...), append([]byte(nil), ev...)})
		}
	}
	var err error
	if from < tailStart {
		v := db.liveViewLocked()
		err = v.walk(from, tailStart, func(idx uint64, ev []byte) (bool, error) {
			if _, err := checkEntry(idx, ev); err != nil {
				return false, err
			}
			keep(idx, ev)
			return true, nil
		})
	}
	for i := max(from, tailStart); err == nil && i <= last; i++ {
		e := &db.tail[i-tailStart]
		ev := make([]byte, entrySize(e))
		putEntry(ev, e)
		keep(i, ev)
	}
	db.mu.RUnlock()
	if err != nil {
		return nil, err
	}
	ops := make([]stagedOp, len(vals))
	for i, kv := range vals {
		b, k := string(bucketRequeue), string(kv[0])
		ops[i] = stagedOp{k: b + "\x00" + k, bucket: b, key: k, val: kv[1]}
	}
	return ops, nil
}

// saveOverwritingChain is Save for an append that overwrites entries in
// format 6: one frame with the entries and the requeue bucket's writes of
// those they overwrite (the index and the tail forget them), then a
// checkpoint, since the requeue bucket is read from the file.
func (db *DB) saveOverwritingChain(hs pb.HardState, ents []pb.Entry) error {
	db.mu.RLock()
	boltLast := db.boltLast
	db.mu.RUnlock()
	if ents[0].Index <= boltLast {
		// Format 6 has no runs past the compaction point (an upgrade
		// moves a data file's runs into segments), and raft appends
		// nothing at or below it.
		return fmt.Errorf("storage: save: an append from index %d, at or below the compaction point %d: %w", ents[0].Index, boltLast, ErrCorrupt)
	}
	if err := db.catchUp(); err != nil {
		return fmt.Errorf("storage: save: %w", err)
	}
	ops, err := db.chainRequeueOps(ents[0].Index)
	if err != nil {
		return fmt.Errorf("storage: save: %w", err)
	}
	var hsp *pb.HardState
	if !isEmptyHardState(hs) {
		hsp = &hs
	}
	db.wmu.Lock()
	err = db.appendWithLocked(hsp, ents, ops, false)
	db.wmu.Unlock()
	if err != nil {
		return fmt.Errorf("storage: save: %w", err)
	}
	if len(ops) > 0 {
		if err := db.commit(nil); err != nil {
			return fmt.Errorf("storage: save: %w", err)
		}
		db.requeued.Store(true)
	}
	return nil
}

// walValue encodes keyWAL in format 6: the id, seq and offset frames are
// replayed from.
func walValue(id, seq uint64, off int64) []byte {
	v := make([]byte, 24)
	binary.BigEndian.PutUint64(v, id)
	binary.BigEndian.PutUint64(v[8:], seq)
	binary.BigEndian.PutUint64(v[16:], uint64(off))
	return v
}

// tailStartLocked returns the first index of the tail, last+1 when it is
// empty: in format 6 the segments hold every entry before it. The caller
// holds mu.
func (db *DB) tailStartLocked() uint64 {
	if len(db.tail) > 0 {
		return db.tail[0].Index
	}
	return db.last + 1
}

// chainEntriesAllLocked is Entries in format 6, for [lo, hi) starting
// before the tail: the file's runs, the segments, then the tail. The
// caller holds mu.
func (db *DB) chainEntriesAllLocked(lo, hi, maxSize uint64) ([]pb.Entry, error) {
	var out []pb.Entry
	if lo <= db.boltLast {
		var err error
		out, err = db.readEntries(lo, min(hi, db.boltLast+1), maxSize)
		if err != nil || hi <= db.boltLast+1 || out[len(out)-1].Index < db.boltLast {
			return out, err
		}
		lo = db.boltLast + 1
	}
	tailStart := db.tailStartLocked()
	if lo < min(hi, tailStart) {
		var full bool
		var err error
		out, full, err = db.chainEntriesLocked(out, lo, min(hi, tailStart), maxSize)
		if err != nil || full || hi <= tailStart {
			return out, err
		}
		lo = tailStart
	}
	all := append(out, db.tail[lo-tailStart:hi-tailStart]...)
	return all[:limitSize(all, maxSize)], nil
}

// markLocked is cutLocked in format 6: no cut frame, the replay point
// moves to where the next frame goes. Without lazy, the frames before it
// are synced first (flush: interval leaves them to the flusher); with it,
// the caller syncs them before the commit. The caller holds ckMu and wmu.
func (db *DB) markLocked(lazy bool) (*cut, error) {
	w := db.wal
	if !lazy && w.off > w.synced.Load() {
		seg := w.curSeg()
		if err := walSync(seg.f); err != nil {
			return nil, fmt.Errorf("storage: sync %s: %w", seg.f.Name(), err)
		}
		w.synced.Store(w.off)
		w.flushed(w.off)
		db.syncs.Add(1)
	}
	c := db.snapshot(w.cur, w.id)
	c.off = w.off
	c.since = w.sinceMark.Load() // off sinceMark once the commit is made
	return c, nil
}

// scanChain is Scan past the file's runs in format 6: the segments, in
// chunks read outside mu from a copy of the index, then the tail.
func (db *DB) scanChain(from uint64, fn func(e pb.Entry) bool) error {
	var batch []pb.Entry
	for limit := scanChunkMin; ; limit = min(2*limit, scanChunkMax) {
		db.mu.RLock()
		from = max(from, db.first)
		last := db.last
		if from > last {
			db.mu.RUnlock()
			return nil
		}
		tailStart := db.tailStartLocked()
		if from >= tailStart {
			pend := append([]pb.Entry(nil), db.tail[from-tailStart:]...)
			db.mu.RUnlock()
			for i := range pend {
				if !fn(pend[i]) {
					return nil
				}
			}
			return nil
		}
		v := db.segViewLocked(from, tailStart)
		db.mu.RUnlock()
		batch = batch[:0]
		size := 0
		err := v.walk(from, tailStart, func(idx uint64, val []byte) (bool, error) {
			e, err := decodeEntry(idx, val)
			if err != nil {
				return false, err
			}
			batch = append(batch, e)
			size += len(e.Data)
			return size < limit, nil
		})
		for i := range batch {
			if !fn(batch[i]) {
				return nil
			}
		}
		if len(batch) > 0 {
			from = batch[len(batch)-1].Index + 1
		}
		if err != nil {
			// Retention may have dropped the segments read meanwhile
			// (the one being read, or the ones holding from): then the
			// scan goes on at from, or at the new first index, as it
			// does over the runs. Else it is damage, after the entries
			// before it.
			db.mu.RLock()
			gone := from < db.first || (len(v.pts) > 0 && v.pts[0].seq < db.seg.head)
			db.mu.RUnlock()
			if gone {
				continue
			}
			return err
		}
		if len(batch) == 0 {
			return nil
		}
	}
}

// segmentBytes is the size of the WAL's files in dir: the segments, the
// one made ready for the next cut, the one kept for reuse, and the two
// files of format 5 if an upgrade left them.
func segmentBytes(dir string) int64 { return filesBytes(dir, WALName+".") }

// segRange returns the live entries of segment seq, [lo, hi], from the
// index's points: from its first point to the one before the next
// segment's first; ok is false for a segment none of whose entries is
// live (metadata only, or overwritten since). The caller holds mu.
func (x *segIndex) segRange(seq uint64) (lo, hi uint64, ok bool) {
	i := sort.Search(len(x.pts), func(i int) bool { return x.pts[i].seq >= seq })
	if i == len(x.pts) || x.pts[i].seq != seq {
		return 0, 0, false
	}
	j := sort.Search(len(x.pts), func(j int) bool { return x.pts[j].seq > seq })
	if j == len(x.pts) {
		return x.pts[i].idx, x.last, x.pts[i].idx <= x.last
	}
	return x.pts[i].idx, x.pts[j].idx - 1, x.pts[i].idx < x.pts[j].idx
}

// chainOldest returns the publish time of the first record in the
// segments from index from on (0: the first), 0 when there is none.
func (db *DB) chainOldest(from uint64) (int64, error) {
	db.mu.RLock()
	from = max(from, db.boltLast+1, db.first)
	last := db.last
	v := db.segViewLocked(from, last+1)
	db.mu.RUnlock()
	if from > last || len(v.pts) == 0 {
		return 0, nil
	}
	var t int64
	err := v.walk(from, last+1, func(_ uint64, ev []byte) (bool, error) {
		if tt, ok := entryTime(ev); ok {
			t = tt
			return false, nil
		}
		return true, nil
	})
	return t, err
}

// dropSegments is dropFront in format 6: whole segments from the head,
// before the segment of the replay point this commit writes (its frames'
// operations may not be in the file yet), as runs are dropped: while the
// bytes are over the budget or the records past max_age, never past
// limit. It records the new head in tx, and the compaction point if it
// moved; commitCut removes the files once the commit is made
// (applySegmentDrop). freed is what the backfill's drop freed already.
//
// Unlike a pass over runs it drops as much as it must at once: what a
// segment frees is its file's size, no estimate to measure again.
func (db *DB) dropSegments(tx *bolt.Tx, res *dropResult, freed, excess, cutoff int64, limit, floor uint64) error {
	m := tx.Bucket(bucketMeta)
	wv := m.Get(keyWAL)
	if len(wv) != 24 {
		return fmt.Errorf("replay point of %d bytes in format %d: %w", len(wv), formatChain, ErrCorrupt)
	}
	replaySeq := binary.BigEndian.Uint64(wv[8:])
	hv := m.Get(keySegHead)
	if len(hv) != 16 {
		return fmt.Errorf("head of the log's chain of %d bytes: %w", len(hv), ErrCorrupt)
	}
	// The head as tx has it: a drop earlier in the same transaction
	// (ReceiveSnapshot's, then the checkpoint's) moved it already, and
	// the in-memory one only moves once tx commits.
	head := binary.BigEndian.Uint64(hv)
	dir := filepath.Dir(db.path)
	db.mu.RLock()
	snapIndex, last := db.snapIndex, db.last
	type segInfo struct {
		lo, hi uint64
		ok     bool
	}
	var infos []segInfo
	for s := head; s < replaySeq; s++ {
		lo, hi, ok := db.seg.x.segRange(s)
		infos = append(infos, segInfo{lo, hi, ok})
	}
	v := db.segViewLocked(snapIndex+1, last+1)
	db.mu.RUnlock()
	next := snapIndex + 1 // the first entry left
	for i, in := range infos {
		s := head + uint64(i)
		records, newest, term := uint64(0), int64(math.MinInt64), uint64(0)
		if in.ok {
			err := v.walk(in.lo, in.hi+1, func(idx uint64, ev []byte) (bool, error) {
				t, err := checkEntry(idx, ev)
				if err != nil {
					return false, err
				}
				term = t
				if pt, ok := entryTime(ev); ok {
					records++
					newest = max(newest, pt)
				}
				return true, nil
			})
			if err != nil {
				return err
			}
		}
		byBytes := freed < excess
		byAge := cutoff != math.MinInt64 && newest < cutoff
		if !byBytes && !byAge {
			break
		}
		if in.ok && in.hi > limit {
			res.blocked, res.blockedAt = byBytes && in.hi > floor && db.floorSet.Load(), in.hi
			if in.hi <= floor {
				res.applyAt = in.hi
			}
			break
		}
		if fi, err := os.Stat(walPath(dir, int(s))); err == nil {
			freed += fi.Size()
		}
		res.segTo, res.some = s, true
		res.records += records
		if in.ok {
			res.snapIndex, res.snapTerm = in.hi, term
			next = in.hi + 1
		}
	}
	// The oldest record left, which applyDrop stores: whether or not
	// anything goes.
	t, err := db.chainOldest(next)
	if err != nil {
		return err
	}
	res.oldest = t
	if res.segTo == 0 {
		res.some = false
		return nil
	}
	// Not v's ids: they start at the segment holding entry snapIndex+1,
	// which may be past the new head (a segment of metadata only).
	db.mu.RLock()
	id, ok := db.seg.ids[res.segTo+1]
	db.mu.RUnlock()
	if !ok {
		return fmt.Errorf("segment %d, after the last one dropped, is not in the chain: %w", res.segTo+1, ErrCorrupt)
	}
	if err := m.Put(keySegHead, segHeadValue(res.segTo+1, id)); err != nil {
		return err
	}
	if res.snapIndex <= snapIndex {
		res.snapIndex, res.snapTerm = 0, 0 // no entry went: the head moved
		return nil
	}
	return db.compactTo(tx, nil, res)
}

// applySegmentDrop removes the segments res dropped, once the commit that
// moved the chain's head past them is made: the first of them is kept for
// makeSegment to reuse (written once with zeros, a segment is worth
// reusing; a segment's worth of the budget, which saves the device a
// segment of zeros per segment of log), the rest are deleted. The caller
// holds ckMu, and wmu or not. A from other than 0 says the in-memory chain starts past them already,
// and the segments go from there.
func (db *DB) applySegmentDrop(res dropResult, from uint64) {
	if res.segTo == 0 {
		return
	}
	dir := filepath.Dir(db.path)
	if from == 0 {
		db.mu.Lock()
		if res.segTo < db.seg.head {
			db.mu.Unlock()
			return // an earlier drop of the same commit took them
		}
		from = db.seg.head
		db.seg.head = res.segTo + 1
		for s := from; s <= res.segTo; s++ {
			delete(db.seg.ids, s)
		}
		db.seg.x.dropThrough(res.segTo)
		db.mu.Unlock()
	}
	for s := from; s <= res.segTo; s++ {
		db.seg.files.forget(s)
	}
	keep := ""
	db.seg.recycleMu.Lock()
	if db.seg.recycled == "" {
		// Back to a segment's size if a large frame grew it: dropped,
		// its bytes must leave the budget now, not at its reuse.
		p := walPath(dir, int(from))
		if fi, err := os.Stat(p); err == nil && (fi.Size() <= walPrealloc || os.Truncate(p, walPrealloc) == nil) {
			keep = p
			db.seg.recycled = keep
		}
	}
	db.seg.recycleMu.Unlock()
	for s := from; s <= res.segTo; s++ {
		if p := walPath(dir, int(s)); p != keep {
			_ = os.Remove(p)
		}
	}
	_ = syncDir(dir)
}

// restartChainLocked starts a new chain in tx, for a log that starts
// again (ApplySnapshot, ResetRaftFrom): the segment after the current one,
// made ready first, becomes the head and the replay point, so that every
// segment before it is dead once tx commits; the frames go there from
// then on (finishRestartLocked). Nothing changes in memory before: if tx
// fails, the old chain goes on as it was. The caller holds ckMu and wmu.
func (db *DB) restartChainLocked(tx *bolt.Tx) (next uint64, id uint64, err error) {
	w := db.wal
	if w.spare == nil {
		s, err := db.makeSegment(walPath(filepath.Dir(db.path), w.cur+1))
		if err != nil {
			return 0, 0, err
		}
		w.spare = s
	}
	next, id = uint64(w.cur+1), newWALID()
	m := tx.Bucket(bucketMeta)
	if err := m.Put(keySegHead, segHeadValue(next, id)); err != nil {
		return 0, 0, err
	}
	return next, id, m.Put(keyWAL, walValue(id, next, 0))
}

// finishRestartLocked moves the WAL and the reads to the chain
// restartChainLocked started, whose commit was made, and removes the
// segments before it (one kept for reuse). The caller holds ckMu and wmu,
// and has reset the log's bounds.
func (db *DB) finishRestartLocked(next, id uint64) {
	w := db.wal
	if w.sealed != nil && w.sealed.f != nil {
		_ = w.sealed.f.Close()
	}
	w.sealed = w.cseg
	w.cseg, w.spare = w.spare, nil
	w.cur, w.off, w.id = int(next), 0, id
	w.segFirst = 0
	w.synced.Store(0)
	w.sinceMark.Store(0)
	db.mu.Lock()
	from := db.seg.head
	db.seg.head = next
	db.seg.ids = map[uint64]uint64{next: id}
	db.seg.x = segIndex{}
	db.mu.Unlock()
	db.applySegmentDrop(dropResult{segTo: next - 1}, from)
}

// chainRequeueTx moves, in tx, the data entries of the segments from
// index from on (of term only, when not 0) to the requeue bucket, as
// requeueFrom does for the runs.
func (db *DB) chainRequeueTx(tx *bolt.Tx, from, term uint64) error {
	db.mu.RLock()
	from = max(from, db.boltLast+1, db.first)
	last := db.last
	v := db.segViewLocked(from, last+1)
	db.mu.RUnlock()
	if from > last {
		return nil
	}
	rq := tx.Bucket(bucketRequeue)
	return v.walk(from, last+1, func(idx uint64, ev []byte) (bool, error) {
		if _, err := checkEntry(idx, ev); err != nil {
			return false, err
		}
		if len(ev) > entryHdr && pb.EntryType(ev[12]) == pb.EntryNormal && (term == 0 || binary.BigEndian.Uint64(ev[4:12]) == term) {
			return true, rq.Put(append(u64(idx), ev[4:12]...), append([]byte(nil), ev...))
		}
		return true, nil
	})
}

// keepsSegment says a dropped segment is kept for reuse.
func (db *DB) keepsSegment() bool {
	db.seg.recycleMu.Lock()
	defer db.seg.recycleMu.Unlock()
	return db.seg.recycled != ""
}
