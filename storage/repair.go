package storage

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"sort"
	"strings"
	"time"

	bolt "go.etcd.io/bbolt"
	pb "go.etcd.io/raft/v3/raftpb"
)

// Repair (`tandem repair`) copies what can still be read of a data dir
// that fails its checks into a new data dir, for a lone gateway: every
// entry whose CRC checks out, at its own index, the raft state, and every
// other bucket's keys (sessions, retained messages, cursors, uplink
// positions, members, requeued records), then the WAL's frames over them,
// as Open would replay them. It only reads the damaged files (bbolt
// read-only, with page faults and bbolt's panics on damaged pages turned
// into errors and recovered from key by key); the new dir is written
// through DB's own write path.
//
// An index whose entry cannot be read becomes an empty entry (what raft
// itself appends at each election, which the broker skips): every later
// index, cursor and uplink position keeps its meaning, and the gap is
// reported by index range. The log is filled up to the commit and applied
// indexes the file records, so nothing that refers to an index past the
// damage points at a future record.

// LostRange is a run of log indexes, From to To inclusive, whose entries
// Repair could not read.
type LostRange struct{ From, To uint64 }

func (r LostRange) String() string {
	if r.From == r.To {
		return fmt.Sprintf("index %d", r.From)
	}
	return fmt.Sprintf("index %d to %d", r.From, r.To)
}

// RepairReport says what Repair copied and what it could not read.
type RepairReport struct {
	NodeID      uint64
	First, Last uint64         // the new log's first and last index (Last < First: empty)
	Entries     int            // entries copied as they were
	Records     int            // of them, data records
	Lost        []LostRange    // indexes that could not be read (empty entries now)
	Keys        map[string]int // keys copied per bucket (the WAL's included)
	Unreadable  []string       // everything else that could not be read, in words
	Notes       []string       // how it was read, where that is not the usual way, in sentences
	WALFrames   int            // WAL frames replayed
	Members     int            // voters and learners of the conf state (0: unreadable)
	Applied     uint64         // the applied index recorded in the new dir
	// EndKnown says the file's commit index could be read: without it,
	// records past Last may have been lost unseen.
	EndKnown bool
}

// LostEntries is the number of indexes in Lost.
func (r *RepairReport) LostEntries() uint64 {
	var n uint64
	for _, l := range r.Lost {
		n += l.To - l.From + 1
	}
	return n
}

// RepairOptions tune Repair; nil means the defaults.
type RepairOptions struct {
	// NodeID is recorded in the new dir when the file's own node id cannot
	// be read: the id of the node's key (replication derives it).
	NodeID uint64
	// AllowCluster repairs the dir of a cluster member too. Without it
	// Repair refuses one, before writing anything: a member's peers hold
	// its log, and it re-syncs from them.
	AllowCluster bool
	// Logger receives the new DB's messages; nil discards them.
	Logger *slog.Logger
}

// ErrClusterMember is returned by Repair for the data dir of a member of a
// cluster of two or three.
var ErrClusterMember = errors.New("the data dir belongs to a member of a cluster")

// Verify opens dir read-only as a start would check it (every entry's CRC,
// the meta pages, the size, the WAL) and reports the first problem, nil for
// a dir that passes. A damaged page gives ErrCorrupt, never a crash.
func Verify(dir string) (err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%s: reading the file failed (%v): %w", filepath.Join(dir, FileName), r, ErrCorrupt)
		}
	}()
	path := filepath.Join(dir, FileName)
	if err := checkFile(path); err != nil {
		return err
	}
	if err := verifyFile(path, time.Second); err != nil && !errors.Is(err, errFresh) {
		return err
	}
	db, err := Open(dir, &Options{ReadOnly: true, LockTimeout: time.Second})
	if err != nil {
		return err
	}
	return db.Close()
}

// maxJump bounds how far past the next expected index a log key may point
// before it is taken for a damaged key rather than a gap to fill.
const maxJump = 1 << 22

// salvager is one Repair: what it read of src and where it writes.
type salvager struct {
	src string
	bdb *bolt.DB
	out *DB
	rep *RepairReport

	hs                  pb.HardState
	cs                  pb.ConfState
	hsOK, csOK          bool
	snapIndex, snapTerm uint64
	applied             uint64
	nodeID              uint64
	walID               uint64
	walSeg              int
	walOK               bool
	epoch, maxEpoch     uint64
	meta                map[string][]byte // the meta bucket's other keys

	next, term uint64 // the next index to write, the last written one's term
	batch      []pb.Entry
	batchBytes int
	walOps     []stagedOp
	walEnts    []pb.Entry // the WAL's entries, in order
	stateOK    bool       // the meta and raftstate buckets could be read
	path       string     // the bbolt file read: src's data file
}

// guard runs fn with page faults turned into panics and recovers from
// them: bbolt reads a damaged page as it finds it.
func guard(fn func() error) (err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%v: %w", r, ErrCorrupt)
		}
	}()
	return fn()
}

// Repair copies what can be read of the data dir src into dst, which must
// not hold a data file yet (see the comment at the top of this file).
// Nobody may hold src meanwhile: the caller checks that (a running
// gateway holds its data file's lock).
func Repair(src, dst string, opts *RepairOptions) (*RepairReport, error) {
	if opts == nil {
		opts = &RepairOptions{}
	}
	if _, err := os.Stat(filepath.Join(dst, FileName)); err == nil {
		return nil, fmt.Errorf("storage: repair into %s: it already holds a data file", dst)
	}
	path := filepath.Join(src, FileName)
	s, err := newSalvager(src, path)
	if err != nil {
		return nil, err
	}
	if !s.stateOK {
		// The newest commit's top pages are gone (a truncated file, a
		// damaged root): read the commit before it, through a copy of
		// the file whose newest meta page is made invalid, the way bbolt
		// falls back past a torn one.
		older := dst + ".older"
		defer os.Remove(older)
		if ok, err := copyWithoutNewestMeta(path, older); err != nil {
			s.close()
			return nil, err
		} else if ok {
			if o, err := newSalvager(src, older); err == nil && o.stateOK {
				s.close()
				s = o
				s.rep.Notes = append(s.rep.Notes, "The data file's newest commit could not be read (its top pages are damaged or missing): the commit before it was read instead, then the WAL over it.")
			} else if err == nil {
				o.close()
			}
		}
	}
	defer s.close()
	var found map[uint64]pb.Entry
	if !s.stateOK {
		// One line for the engineer instead of one per bucket bbolt
		// could not reach.
		s.rep.Unreadable = nil
		if s.bdb != nil {
			s.rep.Notes = append(s.rep.Notes, "The data file's index pages could not be read, from either of its last two commits.")
		}
		s.rep.Notes = append(s.rep.Notes, "Its log was read page by page instead, every entry checked by its CRC.")
		if found, err = scanLeaves(path); err != nil {
			s.rep.Unreadable = append(s.rep.Unreadable, err.Error())
		}
		// Where the log started is unknown: at the oldest entry found
		// (retention may have dropped what came before).
		oldest := uint64(0)
		for i := range found {
			if oldest == 0 || i < oldest {
				oldest = i
			}
		}
		if oldest > 1 {
			s.snapIndex, s.snapTerm = oldest-1, found[oldest].Term
		}
	}
	s.loadWAL()
	if s.nodeID == 0 {
		s.nodeID = opts.NodeID
	}
	s.rep.NodeID = s.nodeID
	if s.csOK {
		s.rep.Members = len(s.cs.Voters) + len(s.cs.Learners)
	}
	if s.rep.Members > 1 && !opts.AllowCluster {
		return s.rep, fmt.Errorf("%w of %d (its peers hold its log: it re-syncs from them)", ErrClusterMember, s.rep.Members)
	}
	if !s.csOK {
		s.cs = pb.ConfState{Voters: []uint64{s.nodeID}}
		if s.stateOK {
			s.rep.Unreadable = append(s.rep.Unreadable, "the membership (conf state): this gateway is made the lone voter")
		}
	}
	if s.out, err = Open(dst, &Options{Logger: opts.Logger, MinFree: -1}); err != nil {
		return nil, err
	}
	if err := s.write(found); err != nil {
		s.out.Close()
		return s.rep, err
	}
	if err := s.out.Close(); err != nil {
		return s.rep, err
	}
	// What was written must pass the checks a start makes.
	if err := Verify(dst); err != nil {
		return s.rep, fmt.Errorf("storage: the repaired data dir fails its checks: %w", err)
	}
	return s.rep, nil
}

// newSalvager opens the bbolt file path (src's data file, or a copy of
// it) read-only and reads its state.
func newSalvager(src, path string) (*salvager, error) {
	s := &salvager{src: src, path: path, rep: &RepairReport{Keys: map[string]int{}}, meta: map[string][]byte{}}
	bdb, err := openBolt(path, time.Second, true)
	switch {
	case errors.Is(err, ErrCorrupt):
		// Neither meta page checks out: bbolt cannot open the file at
		// all, and only the page by page read is left.
		s.rep.Notes = append(s.rep.Notes, "Neither of the data file's two meta pages can be read, so bbolt cannot open it.")
		return s, nil
	case err != nil:
		return nil, err
	}
	s.bdb = bdb
	s.stateOK = s.readState()
	return s, nil
}

// close closes the bbolt file, if one could be opened.
func (s *salvager) close() {
	if s.bdb != nil {
		s.bdb.Close()
	}
}

// copyWithoutNewestMeta copies the data file path to dst with the newest
// of its meta pages made invalid, if the other one is valid (ok).
func copyWithoutNewestMeta(path, dst string) (ok bool, err error) {
	f, err := os.Open(path)
	if err != nil {
		return false, fmt.Errorf("storage: repair: %w", err)
	}
	defer f.Close()
	m0, err0 := readBoltMeta(f, 0)
	if err0 != nil {
		return false, nil // page 0 is the bad one already: bbolt reads page 1
	}
	m1, err1 := readBoltMeta(f, int64(m0.pageSize))
	if err1 != nil {
		return false, nil
	}
	newest := int64(0)
	if m1.txid > m0.txid {
		newest = int64(m0.pageSize)
	}
	out, err := os.OpenFile(dst, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return false, fmt.Errorf("storage: repair: %w", err)
	}
	defer out.Close()
	if _, err := io.Copy(out, f); err != nil {
		return false, fmt.Errorf("storage: repair: copy %s: %w", path, err)
	}
	// Its checksum, zeroed.
	if _, err := out.WriteAt(make([]byte, 8), newest+boltPageHdrSize+boltSumOffset); err != nil {
		return false, fmt.Errorf("storage: repair: %w", err)
	}
	return true, nil
}

// write copies the log (the entries found page by page, when the tree
// could not be read), the WAL and the buckets into s.out.
func (s *salvager) write(found map[uint64]pb.Entry) error {
	if s.nodeID != 0 {
		if err := s.out.SetNodeID(s.nodeID); err != nil {
			return err
		}
	}
	if s.snapIndex > 0 {
		snap := pb.Snapshot{Metadata: pb.SnapshotMetadata{Index: s.snapIndex, Term: s.snapTerm, ConfState: s.cs}}
		if err := s.out.ApplySnapshot(snap); err != nil {
			return err
		}
	}
	s.next, s.term = s.snapIndex+1, s.snapTerm
	s.rep.First = s.next
	if s.stateOK {
		if err := s.copyLog(); err != nil {
			return err
		}
	} else if err := s.copyFound(found); err != nil {
		return err
	}
	for _, e := range s.walEnts {
		if err := s.add(e); err != nil {
			return err
		}
	}
	// Up to what the file says was committed and applied: cursors and
	// positions never point past the new log's end.
	if end := max(s.hs.Commit, s.applied); end >= s.next {
		if err := s.lose(end + 1); err != nil {
			return err
		}
	}
	if err := s.flushBatch(); err != nil {
		return err
	}
	last := s.next - 1
	s.rep.Last, s.rep.EndKnown = last, s.hsOK
	// A lone voter commits what it holds; a member (AllowCluster) keeps
	// its commit index, never past what the master may hold otherwise.
	hs := pb.HardState{Term: max(s.hs.Term, s.term, 1), Commit: last}
	if s.rep.Members > 1 {
		hs.Commit = min(s.hs.Commit, last)
	}
	if s.hsOK && s.hs.Term == hs.Term {
		hs.Vote = s.hs.Vote
	}
	if err := s.out.Save(hs, nil); err != nil {
		return err
	}
	if err := s.copyBuckets(); err != nil {
		return err
	}
	for _, op := range s.walOps {
		if op.val == nil {
			s.out.StageDelete(op.bucket, op.key)
		} else {
			s.out.Stage(op.bucket, op.key, op.val)
			s.rep.Keys[op.bucket]++
		}
	}
	s.out.SetConfState(s.cs)
	if !s.stateOK {
		// The broker state in the buckets is gone with the tree: the
		// gateway applies the whole log again at start, which rebuilds
		// retained messages and sessions (they are functions of it).
		s.applied = 0
		s.rep.Unreadable = append(s.rep.Unreadable, "the broker state (sessions, retained messages, cursors, uplink positions): the gateway rebuilds it from the log at start; uplinks send the log again from its start")
	}
	s.rep.Applied = min(max(s.applied, s.snapIndex), last)
	s.out.SetApplied(s.rep.Applied)
	// Record sequence numbers start at epoch<<32: never below a
	// record's of this node that was read.
	s.out.Stage(string(bucketMeta), string(keyEpoch), u64(max(s.epoch, s.maxEpoch)))
	return s.out.Flush()
}

// readState reads the meta and raftstate buckets, key by key where a
// damaged page allows, and reports whether both could be read.
func (s *salvager) readState() bool {
	rep := s.rep
	err := guard(func() error {
		return s.bdb.View(func(tx *bolt.Tx) error {
			m := tx.Bucket(bucketMeta)
			if m == nil {
				return errors.New("no meta bucket")
			}
			return m.ForEach(func(k, v []byte) error {
				switch string(k) {
				case string(keyFormat):
				case string(keyWAL):
					if len(v) == 16 {
						s.walID, s.walSeg, s.walOK = binary.BigEndian.Uint64(v), int(binary.BigEndian.Uint64(v[8:])&1), true
					}
				case string(keyNodeID):
					if len(v) == 8 {
						s.nodeID = binary.BigEndian.Uint64(v)
					}
				case string(keyApplied):
					if len(v) == 8 {
						s.applied = binary.BigEndian.Uint64(v)
					}
				case string(keyEpoch):
					if len(v) == 8 {
						s.epoch = binary.BigEndian.Uint64(v)
					}
				default:
					if v != nil {
						s.meta[string(k)] = slices.Clone(v)
					}
				}
				return nil
			})
		})
	})
	ok := err == nil
	if err != nil {
		rep.Unreadable = append(rep.Unreadable, fmt.Sprintf("bucket meta (node id, applied index, start counter, cluster settings): %v", err))
	}
	err = guard(func() error {
		return s.bdb.View(func(tx *bolt.Tx) error {
			rs := tx.Bucket(bucketRaftState)
			if rs == nil {
				return errors.New("no raftstate bucket")
			}
			if v := rs.Get(keyHardState); v != nil {
				if err := s.hs.Unmarshal(v); err != nil {
					return fmt.Errorf("hard state: %v", err)
				}
			}
			s.hsOK = true
			if v := rs.Get(keyConfState); v != nil {
				if err := s.cs.Unmarshal(v); err != nil {
					return fmt.Errorf("conf state: %v", err)
				}
				s.csOK = true
			}
			if v := rs.Get(keySnapMeta); len(v) == 16 {
				s.snapIndex, s.snapTerm = binary.BigEndian.Uint64(v), binary.BigEndian.Uint64(v[8:])
			}
			return nil
		})
	})
	if err != nil {
		rep.Unreadable = append(rep.Unreadable, fmt.Sprintf("bucket raftstate (term, vote, commit index, membership): %v", err))
	}
	return ok && err == nil
}

// add appends entry e, read intact, to the new log; indexes between the
// last one written and e's are lost.
func (s *salvager) add(e pb.Entry) error {
	if e.Index < s.next {
		return nil // already written (a WAL frame over the file's entries)
	}
	if e.Index > s.next {
		if err := s.lose(e.Index); err != nil {
			return err
		}
	}
	if e.Term < s.term {
		return s.lose(e.Index + 1) // impossible for an intact log: not trusted
	}
	s.rep.Entries++
	if e.Type == pb.EntryNormal && len(e.Data) > 0 {
		s.rep.Records++
		if origin, seq, err := RecordID(e.Data); err == nil && origin == s.nodeID {
			s.maxEpoch = max(s.maxEpoch, seq>>32)
		}
	}
	s.term = e.Term
	return s.push(e)
}

// lose fills the indexes from s.next up to before end with empty entries
// and reports them lost.
func (s *salvager) lose(end uint64) error {
	if end <= s.next {
		return nil
	}
	if n := len(s.rep.Lost); n > 0 && s.rep.Lost[n-1].To+1 == s.next {
		s.rep.Lost[n-1].To = end - 1
	} else {
		s.rep.Lost = append(s.rep.Lost, LostRange{s.next, end - 1})
	}
	for s.next < end {
		// Term 0 is raft's "no entry": a fill at the head gets term 1,
		// which every entry after it has at least.
		if err := s.push(pb.Entry{Index: s.next, Term: max(s.term, 1), Type: pb.EntryNormal}); err != nil {
			return err
		}
	}
	return nil
}

func (s *salvager) push(e pb.Entry) error {
	s.batch = append(s.batch, e)
	s.batchBytes += entrySize(&e)
	s.next = e.Index + 1
	if len(s.batch) >= 4096 || s.batchBytes >= 256<<10 {
		return s.flushBatch()
	}
	return nil
}

func (s *salvager) flushBatch() error {
	if len(s.batch) == 0 {
		return nil
	}
	err := s.out.Save(pb.HardState{}, s.batch)
	s.batch, s.batchBytes = s.batch[:0:0], 0
	return err
}

// probeLimit is the highest index worth looking for past a damaged page:
// what the file says it committed or applied, with some room.
func (s *salvager) probeLimit() uint64 {
	return max(s.hs.Commit, s.applied, s.next) + 4096
}

// copyLog copies the log bucket's readable entries. Past a damaged page it
// seeks each following index until a key can be read again.
func (s *salvager) copyLog() error {
	from, seek := s.next, false
	floor := uint64(0) // past the key the last probe found: progress
	for {
		resume, err := s.scanLog(from, seek)
		if err != nil {
			return err
		}
		if resume == 0 {
			return nil
		}
		s.rep.Unreadable = appendOnce(s.rep.Unreadable, "damaged pages of the log bucket (the entries on them are the lost indexes above)")
		// Look for the next key bbolt can reach, index by index.
		found := uint64(0)
		for p := max(resume, s.next, floor); p <= s.probeLimit(); p++ {
			var k []byte
			perr := guard(func() error {
				return s.bdb.View(func(tx *bolt.Tx) error {
					k, _ = tx.Bucket(bucketLog).Cursor().Seek(u64(p))
					if k != nil {
						k = slices.Clone(k)
					}
					return nil
				})
			})
			if perr != nil {
				continue
			}
			if k == nil || len(k) < 8 {
				return nil // nothing readable past the damage: the tail is lost
			}
			found = binary.BigEndian.Uint64(k)
			break
		}
		if found == 0 {
			return nil
		}
		from, seek, floor = found, true, found+1
	}
}

// scanLog copies entries from the key at or before index from (seek: the
// first key at or after it) to the end of the bucket. It returns 0 at the
// end, or the index after the last entry read when a damaged page stopped
// it.
func (s *salvager) scanLog(from uint64, seek bool) (resume uint64, err error) {
	var werr error // a write error: not damage, the repair fails
	perr := guard(func() error {
		return s.bdb.View(func(tx *bolt.Tx) error {
			lb := tx.Bucket(bucketLog)
			if lb == nil {
				return errors.New("no log bucket")
			}
			c := lb.Cursor()
			var k, v []byte
			if seek {
				k, v = c.Seek(u64(from))
			} else {
				k, v = seekKey(c, from)
			}
			for ; k != nil; k, v = c.Next() {
				if werr = s.copyKey(c, k, v); werr != nil {
					return nil
				}
			}
			return nil
		})
	})
	if werr != nil {
		return 0, werr
	}
	if perr != nil {
		return s.next, nil
	}
	return 0, nil
}

// copyKey copies the readable entries under one log key, or of the entry
// whose pieces start there (c is left on the last of them).
func (s *salvager) copyKey(c *bolt.Cursor, k, v []byte) error {
	it, err := readItem(c, k, v)
	if err != nil || it.first > s.next+maxJump {
		return nil // a damaged key or piece: its entries show up as a gap
	}
	if !it.run {
		return s.copyValue(it.first, it.v)
	}
	for idx, rest := it.first, it.v; len(rest) > 0; idx++ {
		ev, after, err := nextInRun(idx, rest)
		if err != nil {
			return nil // the rest of the run is lost
		}
		if err := s.copyValue(idx, ev); err != nil {
			return err
		}
		rest = after
	}
	return nil
}

// copyValue copies one entry value whose CRC checks out.
func (s *salvager) copyValue(idx uint64, v []byte) error {
	if idx < s.next {
		return nil
	}
	e, err := decodeEntry(idx, v)
	if err != nil {
		return nil // lost: the next entry read fills the gap
	}
	return s.add(e)
}

// loadWAL reads the WAL's live frames, frame by frame past a damaged one:
// their metadata writes over what the file held, their entries kept for
// write to append after the file's.
func (s *salvager) loadWAL() {
	w, err := openWALs(s.src, true, false)
	if err != nil {
		s.rep.Unreadable = append(s.rep.Unreadable, fmt.Sprintf("the WAL: %v", err))
		return
	}
	defer w.close()
	if !s.walOK {
		s.guessWAL(w)
		return
	}
	seg, id := s.walSeg, s.walID
	for hop := 0; hop < 2 && id != 0; hop++ {
		frames, bad := w.segs[seg].salvageFrames(id)
		for _, b := range bad {
			s.rep.Unreadable = append(s.rep.Unreadable, fmt.Sprintf("%s: %s", walPath(s.src, seg), b))
		}
		next := uint64(0)
		for _, fr := range frames {
			if fr.next != 0 {
				next = fr.next
				continue
			}
			s.takeFrame(fr)
		}
		if next == 0 {
			break
		}
		seg, id = 1-seg, next
	}
}

// guessWAL reads the WAL when the data file no longer says which of its
// frames are live: each file's frames under the id of its first one,
// the file whose entries are older first. Entries are added by index, so
// those the data file holds already are skipped.
func (s *salvager) guessWAL(w *walLog) {
	type segFrames struct {
		first  uint64
		frames []walFrame
	}
	var segs []segFrames
	for i := range w.segs {
		seg := &w.segs[i]
		var hdr [walHdr]byte
		if seg.f == nil || seg.size < walHdr {
			continue
		}
		if _, err := seg.f.ReadAt(hdr[:], 0); err != nil {
			continue
		}
		frames, _ := seg.salvageFrames(binary.LittleEndian.Uint64(hdr[8:]))
		sf := segFrames{frames: frames}
		for _, fr := range frames {
			if len(fr.ents) > 0 {
				sf.first = fr.ents[0].Index
				break
			}
		}
		if len(frames) > 0 {
			segs = append(segs, sf)
		}
	}
	slices.SortFunc(segs, func(a, b segFrames) int { return cmp.Compare(a.first, b.first) })
	for _, sf := range segs {
		for _, fr := range sf.frames {
			if fr.next != 0 {
				continue
			}
			s.takeFrame(fr)
		}
	}
	slices.SortStableFunc(s.walEnts, func(a, b pb.Entry) int { return cmp.Compare(a.Index, b.Index) })
	if len(segs) > 0 {
		s.rep.Notes = append(s.rep.Notes, "The data file no longer says which WAL frames are live: every frame that checks out was read, the newest last.")
	}
}

// takeFrame takes one live frame that is not a cut.
func (s *salvager) takeFrame(fr walFrame) {
	s.rep.WALFrames++
	for _, op := range fr.ops {
		s.walOp(op)
	}
	s.walEnts = append(s.walEnts, fr.ents...)
	if fr.hs != nil {
		s.hs, s.hsOK = *fr.hs, true
	}
}

// walOp takes a replayed metadata write: the raft state and the keys
// Repair sets itself are read, the rest is staged after the buckets.
func (s *salvager) walOp(op stagedOp) {
	switch {
	case op.bucket == string(bucketRaftState) && op.key == string(keyHardState) && op.val != nil:
		var hs pb.HardState
		if hs.Unmarshal(op.val) == nil {
			s.hs, s.hsOK = hs, true
		}
	case op.bucket == string(bucketRaftState) && op.key == string(keyConfState) && op.val != nil:
		var cs pb.ConfState
		if cs.Unmarshal(op.val) == nil {
			s.cs, s.csOK = cs, true
			s.rep.Members = len(cs.Voters) + len(cs.Learners)
		}
	case op.bucket == string(bucketRaftState):
	case op.bucket == string(bucketMeta) && op.key == string(keyApplied):
		if len(op.val) == 8 {
			s.applied = binary.BigEndian.Uint64(op.val)
		}
	case op.bucket == string(bucketMeta) && op.key == string(keyEpoch):
		if len(op.val) == 8 {
			s.epoch = max(s.epoch, binary.BigEndian.Uint64(op.val))
		}
	case op.bucket == string(bucketMeta) && (op.key == string(keyFormat) || op.key == string(keyWAL) || op.key == string(keyNodeID)):
	default:
		s.walOps = append(s.walOps, op)
	}
}

// salvageFrames returns the frames carrying id from the start of the file
// up to a cut, skipping a damaged frame when a good one follows it (where
// Open refuses), and what it skipped, in words.
func (w *walSeg) salvageFrames(id uint64) ([]walFrame, []string) {
	if w.f == nil || w.size == 0 || id == 0 {
		return nil, nil
	}
	b := make([]byte, w.size)
	if _, err := w.f.ReadAt(b, 0); err != nil && err != io.EOF {
		return nil, []string{fmt.Sprintf("read: %v", err)}
	}
	var pat [8]byte
	binary.LittleEndian.PutUint64(pat[:], id)
	var frames []walFrame
	var bad []string
	off := int64(0)
	for off < int64(len(b)) {
		payload, ok := frameAt(b, off, id)
		if ok {
			fr, err := decodeFrame(payload)
			if err == nil {
				fr.off = off
				frames = append(frames, fr)
				off += walHdr + int64(len(payload))
				if fr.next != 0 {
					break
				}
				continue
			}
		}
		// A bad frame: the end of the log, unless a good one follows.
		nextGood := int64(-1)
		for p := off + 1 + 8; p < int64(len(b)); {
			i := bytes.Index(b[p:], pat[:])
			if i < 0 {
				break
			}
			if _, ok := frameAt(b, p+int64(i)-8, id); ok {
				nextGood = p + int64(i) - 8
				break
			}
			p += int64(i) + 1
		}
		if nextGood < 0 {
			break
		}
		bad = append(bad, fmt.Sprintf("bytes %d to %d (damaged frames; their records are listed as lost)", off, nextGood-1))
		off = nextGood
	}
	return frames, bad
}

// copyBuckets copies every bucket but the log and the raft state, key by
// key, and the meta bucket's keys Repair does not set itself.
func (s *salvager) copyBuckets() error {
	if s.bdb == nil {
		return nil
	}
	var names []string
	err := guard(func() error {
		return s.bdb.View(func(tx *bolt.Tx) error {
			return tx.ForEach(func(name []byte, _ *bolt.Bucket) error {
				switch string(name) {
				case string(bucketLog), string(bucketRaftState), string(bucketMeta):
				default:
					names = append(names, string(name))
				}
				return nil
			})
		})
	})
	if err != nil && s.stateOK {
		s.rep.Unreadable = append(s.rep.Unreadable, fmt.Sprintf("the list of buckets (%v): those after %q are not copied", err, strings.Join(names, ", ")))
	}
	sort.Strings(names)
	staged := 0
	for _, name := range names {
		var lastKey []byte
		n := 0
		err := guard(func() error {
			return s.bdb.View(func(tx *bolt.Tx) error {
				return tx.Bucket([]byte(name)).ForEach(func(k, v []byte) error {
					lastKey = slices.Clone(k)
					if v == nil {
						return nil // a nested bucket: tandem writes none
					}
					s.out.Stage(name, string(k), slices.Clone(v))
					n++
					staged += len(k) + len(v)
					if staged >= 4<<20 {
						staged = 0
						return s.out.Flush()
					}
					return nil
				})
			})
		})
		s.rep.Keys[name] += n
		if err != nil && !errors.Is(err, ErrCorrupt) {
			return err
		}
		if err != nil {
			where := "any of its keys"
			if lastKey != nil {
				where = fmt.Sprintf("its keys after %q", lastKey)
			}
			s.rep.Unreadable = append(s.rep.Unreadable, fmt.Sprintf("bucket %s: %s (%v)", name, where, err))
		}
	}
	keys := make([]string, 0, len(s.meta))
	for k := range s.meta {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		s.out.Stage(string(bucketMeta), k, s.meta[k])
		s.rep.Keys[string(bucketMeta)]++
	}
	return nil
}

func appendOnce(list []string, s string) []string {
	if slices.Contains(list, s) {
		return list
	}
	return append(list, s)
}

// bbolt v1.5.0's page layout (internal/common/page.go), for scanLeaves.
const (
	boltLeafFlag    = 0x02
	boltLeafElemLen = 16 // flags, pos, ksize, vsize: 4 bytes each
)

// scanLeaves is the last resort when bbolt cannot reach the log bucket
// from either meta page (the top of the tree is past a truncation or
// damaged): it reads every page of the file that is a leaf of log runs and
// returns the entries whose CRC checks out, by index. bbolt has no public
// reader of pages by number, hence this much of its layout; the entries'
// own CRCs, not the pages, decide what is trusted. A stale page (freed by a
// later commit) holds the same entries as the live one, since a lone
// gateway's log is never overwritten.
func scanLeaves(path string) (map[uint64]pb.Entry, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("storage: repair: %w", err)
	}
	defer f.Close()
	var sizes []int64
	for _, off := range []int64{0, 4096, 16384, 65536} {
		if m, err := readBoltMeta(f, off); err == nil {
			sizes = []int64{int64(m.pageSize)}
			break
		}
	}
	if sizes == nil {
		// No meta page says: each page size bbolt may have used, and
		// the one that finds the most.
		sizes = []int64{4096, 16384, 65536}
	}
	b, err := io.ReadAll(f)
	if err != nil {
		return nil, fmt.Errorf("storage: repair: %w", err)
	}
	var best map[uint64]pb.Entry
	for _, ps := range sizes {
		if found := leafEntries(b, ps); len(found) > len(best) {
			best = found
		}
	}
	return best, nil
}

// leafEntries returns the entries of the log leaves among the pages of
// size ps in b (the whole file). An entry in pieces is read if all of them
// are found and it passes its CRC.
func leafEntries(b []byte, ps int64) map[uint64]pb.Entry {
	le := binary.LittleEndian
	found := map[uint64]pb.Entry{}
	pieces := map[uint64]map[uint32][]byte{}
	take := func(idx uint64, ev []byte) {
		if ent, err := decodeEntry(idx, ev); err == nil {
			if old, ok := found[idx]; !ok || ent.Term > old.Term {
				found[idx] = ent
			}
		}
	}
	for off := 2 * ps; off+boltPageHdrSize <= int64(len(b)); off += ps {
		p := b[off:]
		if le.Uint16(p[8:]) != boltLeafFlag {
			continue
		}
		count := int64(le.Uint16(p[10:]))
		end := min(int64(len(p)), (1+int64(le.Uint32(p[12:])))*ps)
		for i := int64(0); i < count; i++ {
			e := boltPageHdrSize + i*boltLeafElemLen
			if e+boltLeafElemLen > end {
				break
			}
			pos, ks, vs := int64(le.Uint32(p[e+4:])), int64(le.Uint32(p[e+8:])), int64(le.Uint32(p[e+12:]))
			if le.Uint32(p[e:]) != 0 || e+pos+ks+vs > end {
				break // a bucket, or not a page of ours
			}
			k, v := p[e+pos:e+pos+ks], p[e+pos+ks:e+pos+ks+vs]
			first, kind, n, err := keyIndex(k)
			if err != nil || len(v) == 0 {
				break
			}
			if kind == keyPiece {
				if pieces[first] == nil {
					pieces[first] = map[uint32][]byte{}
				}
				pieces[first][n] = v
				continue
			}
			for idx, rest := first, v; len(rest) > 0; idx++ {
				ev := rest
				if kind == keyRun {
					if ev, rest, err = nextInRun(idx, rest); err != nil {
						break
					}
				} else {
					rest = nil
				}
				take(idx, ev)
			}
		}
	}
	for idx, ps := range pieces {
		// uvarint(length) | value, in pieces numbered from 0.
		var joined []byte
		for n := uint32(0); ps[n] != nil; n++ {
			joined = append(joined, ps[n]...)
		}
		if t, w := binary.Uvarint(joined); w > 0 && t == uint64(len(joined)-w) {
			take(idx, joined[w:])
		}
	}
	return found
}

// copyFound copies the entries scanLeaves found, in index order.
func (s *salvager) copyFound(found map[uint64]pb.Entry) error {
	idx := make([]uint64, 0, len(found))
	for i := range found {
		idx = append(idx, i)
	}
	slices.Sort(idx)
	for _, i := range idx {
		if err := s.add(found[i]); err != nil {
			return err
		}
	}
	return nil
}
