package storage

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
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
	// AcceptIncomplete clears the mark of a broker state a snapshot's
	// interrupted install left part old, part new (InstallInterrupted),
	// accepting that state as it is: the way out for a member no master
	// will ever send a snapshot again (a lone gateway, or the slave of a
	// master gone for good). Without it the mark is copied. With it a
	// dir not marked is refused (ErrNotIncomplete) before anything is
	// written.
	AcceptIncomplete bool
	// Logger receives the new DB's messages; nil discards them.
	Logger *slog.Logger
}

// ErrClusterMember is returned by Repair for the data dir of a member of a
// cluster of two or three.
var ErrClusterMember = errors.New("the data dir belongs to a member of a cluster")

// ErrNotIncomplete is returned by Repair with AcceptIncomplete for a data
// dir whose broker state is not marked incomplete: there is nothing to
// accept.
var ErrNotIncomplete = errors.New("its broker state is not marked incomplete: nothing to accept")

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
	walOff              int64  // format 6: the replay point's offset in segment walSeg
	segHead, segHeadID  uint64 // format 6: the chain's head, if read
	chain               *chainSalvage
	format              uint64 // the file's format version, if read
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
	switch {
	case s.format >= formatChain:
		s.loadChain()
	case s.format == 0 && hasSegments(src):
		// The file no longer says its format: format 6's log, or
		// format 5's WAL beside segments an upgrade cut short left.
		// Both are read; an index only the older holds is kept.
		s.loadChain()
		s.loadWAL()
	default:
		s.loadWAL()
	}
	if !s.stateOK && s.snapIndex == 0 && s.chain != nil && len(s.chain.frames) > 0 {
		// Where the log started is unknown: at the chain's first entry
		// (retention may have dropped what came before).
		if first := s.chain.frames[0].first; first > 1 {
			s.snapIndex, s.snapTerm = first-1, s.chain.firstTerm
		}
	}
	if s.nodeID == 0 {
		s.nodeID = opts.NodeID
	}
	s.rep.NodeID = s.nodeID
	if s.csOK {
		s.rep.Members = len(s.cs.Voters) + len(s.cs.Learners)
	}
	mark, marked := s.meta[string(keyInstalling)]
	if opts.AcceptIncomplete && !marked {
		return s.rep, ErrNotIncomplete
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
	if marked {
		ref, _ := ParseSnapshotRef(mark)
		if opts.AcceptIncomplete {
			delete(s.meta, string(keyInstalling))
			s.rep.Notes = append(s.rep.Notes, fmt.Sprintf("WARNING: the broker state was marked incomplete (the install of a snapshot of index %d was interrupted) and is accepted as it is: retained messages, sessions, cursors and uplink positions may be part from that snapshot, part older. The mark is cleared: the gateway applies its log from index %d on and takes devices again.", ref.Index, s.applied+1))
		} else {
			s.rep.Notes = append(s.rep.Notes, fmt.Sprintf("The broker state is marked incomplete (the install of a snapshot of index %d was interrupted) and stays so: the gateway waits for its master's snapshot. With no master to send one, --accept-incomplete accepts the state as it is.", ref.Index))
		}
	}
	if s.out, err = Open(dst, &Options{Logger: opts.Logger, MinFree: -1, chainFrom: lastSegment(src) + 1}); err != nil {
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
	if s.chain != nil {
		if err := s.chain.each(s.add); err != nil {
			return err
		}
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
					if len(v) == 8 {
						s.format = binary.BigEndian.Uint64(v)
					}
				case string(keyWAL):
					if len(v) == 16 {
						s.walID, s.walSeg, s.walOK = binary.BigEndian.Uint64(v), int(binary.BigEndian.Uint64(v[8:])&1), true
					} else if len(v) == 24 {
						s.walID, s.walSeg, s.walOK = binary.BigEndian.Uint64(v), int(binary.BigEndian.Uint64(v[8:])), true
						s.walOff = int64(binary.BigEndian.Uint64(v[16:]))
					}
				case string(keySegHead):
					// The new dir names its own chain, if it has one.
					if len(v) == 16 {
						s.segHead, s.segHeadID = binary.BigEndian.Uint64(v), binary.BigEndian.Uint64(v[8:])
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
