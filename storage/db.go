package storage

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	bolt "go.etcd.io/bbolt"
	bolterrors "go.etcd.io/bbolt/errors"
	"go.etcd.io/raft/v3"
	pb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/internal/clock"
)

var (
	errCompacted   = raft.ErrCompacted
	errUnavailable = raft.ErrUnavailable
)

// FileName is the name of the data file inside the data dir.
const FileName = "tandem.db"

// FormatVersion is the newest layout of buckets and values this build
// reads and writes. A file with a higher version is refused rather than
// misread. Version 2 has a WAL (WALName) that may hold records the file does
// not: a build that knows only version 1 would ignore it, so it refuses the
// file instead. Version 3 stores the log in runs of entries (logrun.go),
// which version 2 cannot read. Older files become version 3 at their first
// checkpoint, which is part of the first read-write open; their entries stay
// as they are, readable alike. Version 4 has entries in pieces (logrun.go):
// a file becomes version 4 with the first entry too big for a run, not
// before, so that a data dir that never held one still opens on the
// releases that read version 3. Version 5 is a file whose WAL may hold
// padded frames (wal.go, padFrame), which a build before them takes for
// damage: the file says 5 from its first checkpoint of a read-write open
// until a clean Close leaves no live frame, and then says again what it
// said before (keyFormatRest), so a release before this one refuses a data
// dir left by a crash, naming both versions, and opens one left by a clean
// stop. Version 6 is a file whose WAL segments are its log past the runs
// (chain.go): being built, it is only ever written by this package's tests
// and test builds (tandem_format6), which upgrade older data dirs to it.
const FormatVersion = formatChain

// The format versions this build writes.
const (
	formatRuns   = 3
	formatPieces = 4
	formatPadded = 5
)

// Bucket names. Big-endian uint64 keys in the log bucket keep cursor order
// equal to log order.
var (
	bucketLog       = []byte("log")       // runs of entries by first index (logrun.go)
	bucketRaftState = []byte("raftstate") // hard state, conf state, snapshot metadata
	bucketMeta      = []byte("meta")      // format version, node id, applied index
	bucketRequeue   = []byte("requeue")   // data entries a conflicting append overwrote
	// BucketSessions holds the broker's persistent state (sessions,
	// subscriptions, in-flight messages, retained messages), written through
	// Stage so it commits with the log.
	BucketSessions = "sessions"
	// BucketMembers holds the cluster members' details, by node id,
	// written by replication as membership changes apply.
	BucketMembers = "members"
)

var (
	keyHardState = []byte("hardstate")
	keyConfState = []byte("confstate")
	keySnapMeta  = []byte("snapshot")
	keyFormat    = []byte("format")
	keyNodeID    = []byte("node_id")
	keyApplied   = []byte("applied")
	keyEpoch     = []byte("epoch")
	keyLed       = []byte("led") // the last term this node was the master of
	keyWAL       = []byte("wal") // the id live WAL frames carry
	// keyFormatRest is what keyFormat says once the WAL holds no live
	// frame, while it says formatPadded (see FormatVersion).
	keyFormatRest = []byte("format_rest")
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// errFresh marks a bbolt file without a single bucket: created, then the
// process died before tandem's first transaction. It is initialised.
var errFresh = errors.New("storage: file has no buckets yet")

// Options tune Open. A nil *Options means the defaults.
type Options struct {
	// Logger receives open and recovery messages; nil discards them.
	Logger *slog.Logger
	// LockTimeout bounds the wait for the file lock another process holds;
	// zero means 1s. bbolt's own default waits forever.
	LockTimeout time.Duration
	// ReadOnly opens the file without writing to it, for `tandem inspect`.
	ReadOnly bool
	// SyncDelay is added to each fdatasync (one per WAL append, two per
	// bbolt commit), to measure what a slow flash device would give (an SD
	// card or eMMC flushes in 1–5 ms). Benchmarks only; zero in production.
	SyncDelay time.Duration
	// TailBytes bounds the in-memory copy of the newest entries, which
	// serves raft's reads of what was just appended and of what slaves are
	// about to fetch, and holds every entry not yet checkpointed (a
	// checkpoint is due at a quarter of it); zero means 1 MiB (some 4,000
	// records of 100 bytes), which keeps a gateway's memory small: twice
	// that took 3–5 MB more RSS under load, for no more throughput.
	TailBytes int
	// OnCommit, when set, is called after each durable write of the log
	// (a WAL append or a checkpoint into bbolt), with how long it took to
	// write and fdatasync and how many log entries it held (0 for one of
	// metadata or raft state only). It runs on the writing goroutine, the
	// replication loop's for Save: it must be quick.
	OnCommit func(sync time.Duration, entries int)
	// MaxBytes is the data dir's budget (WAL and data file): retention
	// drops the log's oldest runs to stay within it plus RetentionSlack
	// (retention.go). Zero means no budget.
	MaxBytes int64
	// MaxAge drops runs whose newest record is older than this. Zero
	// means records are kept whatever their age.
	MaxAge time.Duration
	// Now is the clock MaxAge is measured with; nil means Clock's, or
	// time.Now without one.
	Now func() time.Time
	// Clock is the gateway's time of day (internal/clock): the data dir
	// keeps its offset across restarts and raises it to its last
	// checkpoint's time at Open (clock.go). Nil keeps none.
	Clock *clock.Clock
	// MinFree is the free space the data dir's filesystem must keep, in
	// bytes: below it the DB reports LowOnSpace and the replication layer
	// refuses publishes until space returns (watermark.go). Zero means the
	// default, 5 % of the filesystem or 256 MiB, whichever is smaller;
	// negative turns the watermark off.
	MinFree int64
	// FreeSpace, when set, replaces the reading of the free and total
	// bytes of the filesystem holding dir (statfs): tests fill a disk
	// without filling one.
	FreeSpace func(dir string) (free, total int64, err error)
	// FlushInterval, when set, is flush: interval (RocketMQ's
	// ASYNC_FLUSH): Save returns once its WAL frame is written, and the
	// WAL is fdatasynced every FlushInterval. A process crash loses
	// nothing (the kernel has the frames); a power cut loses up to one
	// interval of them. Frames with a raft term or vote, WAL cuts,
	// checkpoints into the data file and Sync stay synchronous. Zero is
	// flush: always.
	FlushInterval time.Duration
	// faults, set by this package's tests only, are the DB's failpoints
	// (faults.go); nil means none.
	faults *faults
	// segmented creates a new data file in format 6, whose WAL is its
	// log (chain.go). This package's tests only, until that format is
	// complete.
	segmented bool
	// chainFrom, when past firstSegment, is the seq a new data file's
	// chain starts at: Repair's, so that its segments take no name the
	// damaged dir's hold, and replacing the one with the other can be
	// cut short anywhere.
	chainFrom uint64
}

// DB is the node's data file: the raft log, raft state and metadata in one
// bbolt file, with a WAL in front of it. It implements raft.Storage. The
// write methods (Save, Stage*, Flush) may be called from any goroutine, but
// the replication loop is the only caller of Save, which keeps the log's
// order.
type DB struct {
	clock   *clock.Clock // Options.Clock, kept in the meta bucket; nil: none
	path    string
	bolt    *bolt.DB
	log     *slog.Logger
	ro      bool
	maxTail int
	faults  *faults // tests' failpoints; never nil, all zero in production

	// wmu serialises the writers of the WAL and of bbolt (Save, Flush,
	// Sync, checkpoints): a checkpoint must see no frame appear while it
	// moves the WAL's contents into bbolt. wal is guarded by it.
	wmu sync.Mutex
	wal *walLog

	// ckMu serialises checkpoints (checkpoint.go) and guards pendingCut: a
	// cut whose checkpoint failed, to be committed before any new cut.
	ckMu       sync.Mutex
	pendingCut *cut
	// runBuf holds the bytes putEntries gives bbolt, which keeps them
	// until its transaction ends: each commitCut starts it again (ckMu),
	// rather than allocate the checkpoint's entries afresh.
	runBuf   []byte
	ckSig    chan struct{} // wakes the checkpointer
	ckStop   chan struct{} // closed by Close
	ckDone   chan struct{} // closed when the checkpointer ends
	ckFailed atomic.Bool   // the last checkpoint failed (see behind)

	// mu guards the in-memory view of the file below. raft reads it on the
	// replication goroutine; status and metrics read it from others.
	mu        sync.RWMutex
	hs        pb.HardState
	cs        pb.ConfState
	snapIndex uint64
	snapTerm  uint64
	first     uint64 // first index in the log bucket (snapIndex+1)
	last      uint64 // last index of the log (snapIndex when empty)
	boltLast  uint64 // last index in the log bucket; those past it are in the WAL and the tail
	pendBytes int    // bytes of the entries past boltLast
	applied   uint64
	nodeID    uint64
	format    uint64 // the file's format version, as Open loaded it
	walID     uint64 // the WAL id the file records, as Open loaded it
	walSeg    int    // and the WAL file it names
	walOff    int64  // and in format 6 the offset frames are replayed from
	// chain is set for a file of format 6: the WAL's segments are the
	// log past boltLast (chain.go), seg what reads need of them.
	chain     bool
	seg       segState
	segHeadID uint64     // the id of the chain's first segment, as Open loaded it
	tail      []pb.Entry // newest entries; tail ends at last and holds all past boltLast
	// tailArr is tail's backing array, whole: appendTailLocked moves the
	// tail back to its start rather than allocate another (nil: tail has
	// none of its own yet).
	tailArr   []pb.Entry
	tailBytes int
	closed    bool

	commits atomic.Uint64 // durable writes (WAL appends and bbolt commits)
	// sinceRelease counts the bytes checkpointed since the data file's
	// mappings were last released (mapped.go).
	sinceRelease atomic.Int64
	syncs        atomic.Uint64 // fdatasyncs they cost, for fsyncs-per-message figures
	// fileWritten counts the bytes checkpoints wrote into the data file
	// (walLog.written those of the WAL): what the log costs the device.
	fileWritten atomic.Int64
	// snapWritten counts the bytes of the snapshot bodies built into
	// their file (snapshot.go).
	snapWritten atomic.Int64
	syncDelay   time.Duration            // Options.SyncDelay
	onCommit    func(time.Duration, int) // Options.OnCommit
	requeued    atomic.Bool              // entries were moved to the requeue bucket (TakeRequeueSignal)

	// flush: interval (Options.FlushInterval): the flusher goroutine.
	flushEvery     time.Duration
	flStop, flDone chan struct{}

	// Retention (retention.go).
	ret       retention
	floor     atomic.Uint64 // SetRetentionFloor
	hold      atomic.Uint64 // SetHoldFloor + 1; 0: nothing held (hold.go)
	floorSet  atomic.Bool   // SetRetentionFloor was called: only then may a floor refuse
	blockedAt atomic.Uint64 // the floor the next drop waits for; 0 when none
	// blockedByHold: what refuses is the hold (an uplink's position), not
	// a member (SetHoldFloor).
	blockedByHold atomic.Bool
	retainDue     atomic.Bool   // a retention pass is wanted even if no checkpoint is due
	applyAt       atomic.Uint64 // applied past it, an idle checkpointer runs a retention pass (dropResult.applyAt)
	refusing      atomic.Bool   // over budget with nothing droppable
	space         watermark     // free space on the data dir's filesystem
	dropped       atomic.Uint64 // records dropped since Open
	oldest        atomic.Int64  // publish time of the oldest record in the file, 0 if none

	// stageMu guards staged and fresh. staged holds the metadata writes
	// not yet in bbolt (readers see them through it), fresh those of them
	// not yet in the WAL either, in the order they were staged: the next
	// WAL frame carries them, so they become durable together with the
	// entries proposed after them, at no extra fsync.
	stageMu  sync.Mutex
	staged   map[string]stagedOp
	fresh    []stagedOp
	stageGen uint64
	takeBuf  []stagedOp // reused by commitCut, under ckMu
	opsBuf   []stagedOp // reused by Save, under wmu

	// snapMu guards snaps, the snapshot built for raft and the build in
	// progress (snapshot.go); bgWG counts the builds, which Close waits
	// for before it closes the file.
	snapMu   sync.Mutex
	snaps    snapState
	snapStop chan struct{} // closed by Close: background snapshot work ends
	bgWG     sync.WaitGroup

	// snapInMu guards snapIn, the owner of the staging a snapshot being
	// received is decoded into (snapin.go).
	snapInMu sync.Mutex
	snapIn   snapInState
	// installing: keyInstalling is set (InstallInterrupted).
	installing atomic.Bool
	// inPlaceMin is the smallest bucket a snapshot received is merged
	// into in place (snapin.go); tests lower it.
	inPlaceMin int64
	// chainFrom is the seq a new data file's chain starts at (Options.chainFrom).
	chainFrom uint64
}

type stagedOp struct {
	k      string // its key in DB.staged
	bucket string
	key    string
	val    []byte // nil means delete
	gen    uint64 // when it was staged: a commit clears only what it wrote
}

// Open opens (creating if needed) the data file in dir. A file that is empty,
// truncated, locked by another process or fails its checks is reported and
// left exactly as it is.
func Open(dir string, opts *Options) (*DB, error) {
	if opts == nil {
		opts = &Options{}
	}
	lg := opts.Logger
	if lg == nil {
		lg = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	timeout := opts.LockTimeout
	if timeout == 0 {
		timeout = time.Second
	}
	maxTail := opts.TailBytes
	if maxTail == 0 {
		maxTail = 1 << 20
	}
	path := filepath.Join(dir, FileName)
	if opts.ReadOnly {
		if _, err := os.Stat(path); err != nil {
			return nil, fmt.Errorf("storage: %w", err)
		}
	} else if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, fmt.Errorf("storage: data dir: %w", err)
	}
	if err := checkFile(path); err != nil {
		return nil, err
	}
	st, statErr := os.Stat(path)
	exists := statErr == nil && st.Size() > 0
	if exists && !opts.ReadOnly {
		// Check the whole file read-only first: any write (even bbolt's
		// own meta page) would change a file we may be about to refuse, and
		// bbolt's read-write open walks the pages in a goroutine of its own
		// where a damaged page panics beyond any recover.
		switch err := verifyFile(path, timeout); {
		case errors.Is(err, errFresh):
			exists = false
		case err != nil:
			return nil, err
		}
	}
	bdb, err := openBolt(path, timeout, opts.ReadOnly)
	if err != nil {
		return nil, err
	}
	db := &DB{path: path, bolt: bdb, log: lg, ro: opts.ReadOnly, maxTail: maxTail, staged: map[string]stagedOp{}, syncDelay: opts.SyncDelay, onCommit: opts.OnCommit,
		snapStop: make(chan struct{}), inPlaceMin: inPlaceMin}
	db.ret = retention{maxBytes: opts.MaxBytes, maxAge: opts.MaxAge, now: opts.Now}
	db.chainFrom = max(opts.chainFrom, firstSegment)
	if db.faults = opts.faults; db.faults == nil {
		db.faults = &faults{}
	}
	if !opts.ReadOnly {
		db.space.statfs = opts.FreeSpace
		db.space.init(path, opts.MinFree, lg)
	}
	if !opts.ReadOnly {
		db.flushEvery = opts.FlushInterval
	}
	if db.ret.now == nil && opts.Clock != nil {
		db.ret.now = opts.Clock.Now
	}
	if db.ret.now == nil {
		db.ret.now = time.Now
	}
	if !opts.ReadOnly {
		bdb.AllocSize = growChunk
	}
	fail := func(err error) (*DB, error) {
		bdb.Close()
		if db.wal != nil {
			db.wal.close()
		}
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if exists {
		// A read-only open is not verified beforehand: check every entry now.
		if opts.ReadOnly {
			db.readAhead()
		}
		if err := db.load(opts.ReadOnly); err != nil {
			return fail(err)
		}
	}
	// The WAL exists before the file records a format that needs it.
	chain := db.chain || (!exists && (opts.segmented || newDirsSegmented))
	if chain {
		db.wal = &walLog{chain: true}
	} else if db.wal, err = openWALs(dir, opts.ReadOnly, exists && db.format >= 2); err != nil {
		bdb.Close()
		return nil, err
	}
	if !exists && !opts.ReadOnly {
		if err := db.create(chain); err != nil {
			return fail(err)
		}
		if err := db.load(false); err != nil {
			return fail(err)
		}
	}
	var replayed int
	if chain {
		replayed, err = db.openChain(opts.ReadOnly)
	} else {
		var frames []walFrame
		frames, err = db.wal.readAll(db.walSeg, db.walID)
		if err == nil {
			err = db.replay(frames)
		}
		replayed = len(frames)
	}
	if err != nil {
		bdb.Close()
		db.wal.close()
		return nil, err
	}
	if !opts.ReadOnly {
		// Move what the WAL held into the file and start a new WAL id:
		// from here on the WAL holds only what this process appends.
		for i := range db.wal.segs {
			if chain {
				break
			}
			if err := db.growWAL(&db.wal.segs[i], walPrealloc); err != nil {
				return fail(err)
			}
		}
		if err := db.loadOldest(); err != nil {
			return fail(err)
		}
		if err := db.loadInstalling(); err != nil {
			return fail(err)
		}
		// Before the first checkpoint writes the clock, and before
		// anything is stamped with it.
		if err := db.restoreClock(opts.Clock); err != nil {
			return fail(err)
		}
		if err := db.checkpointReplayed(); err != nil {
			return fail(err)
		}
		if !chain && (opts.segmented || newDirsSegmented) {
			up, err := db.upgradeToChain(timeout)
			if err != nil {
				return fail(err)
			}
			if up {
				db.wal.close()
				if err := bdb.Close(); err != nil {
					return nil, fmt.Errorf("%s: %w", path, err)
				}
				if err := finishUpgrade(dir); err != nil {
					return nil, err
				}
				lg.Info("data dir upgraded to data format 6: the log is in the WAL's segments", "path", path, "format_before", db.format, "last_index", db.last)
				// Opened again in its new format, as any data dir of
				// format 6 is.
				return Open(dir, opts)
			}
		}
		db.ckSig, db.ckStop, db.ckDone = make(chan struct{}, 1), make(chan struct{}), make(chan struct{})
		if chain {
			db.ckSig <- struct{}{} // to make the next segment ready
		}
		go db.checkpointer()
		if db.flushEvery > 0 {
			db.flStop, db.flDone = make(chan struct{}), make(chan struct{})
			go db.flusher()
		}
	}
	// Open read every page of the file through the mapping (the checks
	// of load, bbolt's rebuild of its freelist): without a release they
	// would count in the gateway's RSS for as long as it runs (a gateway
	// on a 111 MB file: RssFile 124 MB, 16 MB with the release).
	db.releaseMapped()
	lg.Info("data file opened", "path", path, "first_index", db.first, "last_index", db.last, "applied", db.applied, "wal_frames_replayed", replayed)
	return db, nil
}

// replay applies the live WAL frames to the in-memory view: entries to the
// tail, metadata to the stage (where readers see it), the hard state. A
// read-write Open then checkpoints it all into the file.
func (db *DB) replay(frames []walFrame) error {
	var prevTerm uint64
	if len(db.tail) > 0 {
		prevTerm = db.tail[len(db.tail)-1].Term
	}
	for _, fr := range frames {
		if fr.next != 0 {
			continue // a cut carries nothing else
		}
		where := fmt.Sprintf("%s: frame at offset %d", walPath(filepath.Dir(db.path), fr.seg), fr.off)
		if err := db.replayOps(fr); err != nil {
			return fmt.Errorf("%s: %w", where, err)
		}
		if len(fr.ents) > 0 {
			if fr.ents[0].Index != db.last+1 {
				return fmt.Errorf("%s starts at index %d, the log ends at %d: %w", where, fr.ents[0].Index, db.last, ErrCorrupt)
			}
			for i := range fr.ents {
				if fr.ents[i].Term < prevTerm {
					return fmt.Errorf("%s: entry %d has term %d after term %d: %w", where, fr.ents[i].Index, fr.ents[i].Term, prevTerm, ErrCorrupt)
				}
				prevTerm = fr.ents[i].Term
				db.pendBytes += entrySize(&fr.ents[i])
			}
			db.last = fr.ents[len(fr.ents)-1].Index
			db.appendTailLocked(fr.ents)
		}
	}
	if db.hs.Commit > db.last {
		return fmt.Errorf("%s: commit index %d is past the last entry %d: %w", WALName, db.hs.Commit, db.last, ErrCorrupt)
	}
	return nil
}

// replayOps applies what a replayed frame carries besides its entries:
// its staged operations, staged again for the next checkpoint, then its
// hard state. Its callers check the entries after it: those checks read
// neither, and a frame that fails them fails Open.
func (db *DB) replayOps(fr walFrame) error {
	for _, op := range fr.ops {
		db.stageGen++
		op.gen = db.stageGen
		db.staged[op.k] = op
		if err := db.loadStaged(op); err != nil {
			return err
		}
	}
	if fr.hs != nil {
		db.hs = *fr.hs
	}
	return nil
}

// loadStaged updates the in-memory state a replayed metadata write changes.
func (db *DB) loadStaged(op stagedOp) error {
	var err error
	switch {
	case op.val == nil:
	case op.bucket == string(bucketRaftState) && op.key == string(keyHardState):
		err = db.hs.Unmarshal(op.val)
	case op.bucket == string(bucketRaftState) && op.key == string(keyConfState):
		db.cs = pb.ConfState{}
		err = db.cs.Unmarshal(op.val)
	case op.bucket == string(bucketMeta) && op.key == string(keyApplied) && len(op.val) == 8:
		db.applied = binary.BigEndian.Uint64(op.val)
	}
	if err != nil {
		return fmt.Errorf("%s/%s: %v: %w", op.bucket, op.key, err, ErrCorrupt)
	}
	return nil
}

func openBolt(path string, timeout time.Duration, ro bool) (*bolt.DB, error) {
	bdb, err := bolt.Open(path, 0o640, &bolt.Options{
		Timeout:        timeout,
		ReadOnly:       ro,
		NoFreelistSync: true,
		// First fit (the lowest free run long enough), not the map
		// freelist's pick of any longer run: that one splits the long runs
		// retention frees at the log's front for the one-page writes of
		// every commit, until a record larger than a page (a run of
		// contiguous pages) finds none and bbolt grows the file, past the
		// budget (a mix of 100 B to 64 KiB records: 15 MiB for 12 MiB).
		// Retention keeps the free pages few (about a checkpoint's worth
		// and a grow chunk), so the array's linear search stays short.
		FreelistType: bolt.FreelistArrayType,
	})
	if err == nil {
		return bdb, nil
	}
	if errors.Is(err, bolterrors.ErrTimeout) {
		return nil, fmt.Errorf("%s: %w", path, ErrInUse)
	}
	if errors.Is(err, bolterrors.ErrInvalid) || errors.Is(err, bolterrors.ErrChecksum) || errors.Is(err, bolterrors.ErrVersionMismatch) {
		return nil, fmt.Errorf("%s: %v: %w", path, err, ErrCorrupt)
	}
	return nil, fmt.Errorf("storage: open %s: %w", path, err)
}

// verifyFile opens path read-only and reads every page: the log's entries
// with their CRCs, every other bucket's keys, the state. Faults and bbolt's
// panics on damaged pages become ErrCorrupt.
func verifyFile(path string, timeout time.Duration) (err error) {
	bdb, err := openBolt(path, timeout, true)
	if err != nil {
		return err
	}
	defer bdb.Close()
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%s: reading the file failed (%v): %w", path, r, ErrCorrupt)
		}
	}()
	db := &DB{path: path, bolt: bdb, ro: true, maxTail: 1}
	db.readAhead()
	if err := db.load(true); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return bdb.View(func(tx *bolt.Tx) error {
		return tx.ForEach(func(name []byte, b *bolt.Bucket) error {
			c := b.Cursor()
			for k, _ := c.First(); k != nil; k, _ = c.Next() {
			}
			return nil
		})
	})
}

// readAhead asks for readahead on the mapping before a check reads the
// whole file, in the log's order, which is mostly the file's. bbolt maps it
// with MADV_RANDOM, so each page came in by a read of its own: 21,926 reads
// and 1.37 s to open a 91 MB file out of the page cache (BenchmarkOpenCold),
// 16 and 0.15 s with the advice; a gateway started on a 111 MB file in
// 1.68 s, 0.22 s now. Flash cards serve few small reads a second, so on a
// gateway's SD card the difference grows (not measured here).
func (db *DB) readAhead() {
	_ = db.bolt.View(func(tx *bolt.Tx) error {
		adviseSequential(db.bolt.Info().Data, uintptr(tx.Size()))
		return nil
	})
}

// create makes the buckets of a new file.
func (db *DB) create(chain bool) error {
	var head, id uint64
	if chain {
		var err error
		if head, id, err = db.createChain(); err != nil {
			return err
		}
	}
	return db.bolt.Update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{bucketLog, bucketRaftState, bucketMeta, bucketRequeue, []byte(BucketSessions)} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		m := tx.Bucket(bucketMeta)
		if !chain {
			return m.Put(keyFormat, u64(formatRuns))
		}
		if err := m.Put(keySegHead, segHeadValue(head, id)); err != nil {
			return err
		}
		if err := m.Put(keyWAL, walValue(id, head, 0)); err != nil {
			return err
		}
		return m.Put(keyFormat, u64(formatChain))
	})
}

// load reads the state of the file. With verify it checks every entry's
// CRC: a damaged page must stop the daemon at start, not after it has acked
// more publishes on top of it.
func (db *DB) load(verify bool) (err error) {
	defer func() {
		// bbolt panics on some damaged pages; that is corruption, not a bug.
		if r := recover(); r != nil {
			err = fmt.Errorf("reading the file failed (%v): %w", r, ErrCorrupt)
		}
	}()
	return db.bolt.View(func(tx *bolt.Tx) error {
		m := tx.Bucket(bucketMeta)
		if m == nil {
			if err := tx.ForEach(func([]byte, *bolt.Bucket) error { return ErrCorrupt }); err == nil {
				// No bucket at all: bbolt made the file, a crash came
				// before our first transaction.
				return errFresh
			}
			return fmt.Errorf("no meta bucket (not a tandem data file): %w", ErrCorrupt)
		}
		if v := m.Get(keyFormat); len(v) != 8 {
			return fmt.Errorf("no format version: %w", ErrCorrupt)
		} else if f := binary.BigEndian.Uint64(v); f > FormatVersion {
			return fmt.Errorf("data format %d, this build reads up to %d: %w", f, FormatVersion, ErrUnknownVersion)
		} else {
			db.format = f
		}
		if err := checkFeatureLevel(tx); err != nil {
			return err
		}
		if v := m.Get(keyWAL); len(v) == 16 {
			db.walID = binary.BigEndian.Uint64(v)
			db.walSeg = int(binary.BigEndian.Uint64(v[8:]) & 1)
		} else if len(v) == 24 && db.format >= formatChain {
			db.walID = binary.BigEndian.Uint64(v)
			db.walSeg = int(binary.BigEndian.Uint64(v[8:]))
			db.walOff = int64(binary.BigEndian.Uint64(v[16:]))
		}
		if db.format >= formatChain {
			v := m.Get(keySegHead)
			if len(v) != 16 {
				return fmt.Errorf("data format %d without the head of its log's chain: %w", db.format, ErrCorrupt)
			}
			db.chain = true
			db.seg.head = binary.BigEndian.Uint64(v)
			db.segHeadID = binary.BigEndian.Uint64(v[8:])
		}
		if v := m.Get(keyNodeID); len(v) == 8 {
			db.nodeID = binary.BigEndian.Uint64(v)
		}
		if v := m.Get(keyApplied); len(v) == 8 {
			db.applied = binary.BigEndian.Uint64(v)
		}
		rs := tx.Bucket(bucketRaftState)
		if rs == nil {
			return fmt.Errorf("no raftstate bucket: %w", ErrCorrupt)
		}
		if v := rs.Get(keyHardState); v != nil {
			if err := db.hs.Unmarshal(v); err != nil {
				return fmt.Errorf("hard state: %v: %w", err, ErrCorrupt)
			}
		}
		if v := rs.Get(keyConfState); v != nil {
			if err := db.cs.Unmarshal(v); err != nil {
				return fmt.Errorf("conf state: %v: %w", err, ErrCorrupt)
			}
		}
		if v := rs.Get(keySnapMeta); len(v) == 16 {
			db.snapIndex = binary.BigEndian.Uint64(v)
			db.snapTerm = binary.BigEndian.Uint64(v[8:])
		}
		db.first, db.last = db.snapIndex+1, db.snapIndex
		lb := tx.Bucket(bucketLog)
		if lb == nil {
			return fmt.Errorf("no log bucket: %w", ErrCorrupt)
		}
		return db.scanLocked(lb, verify)
	})
}

// scanLocked checks every entry of the log bucket (CRC, contiguous indexes,
// non-decreasing terms), then fills the tail cache from the newest end.
func (db *DB) scanLocked(lb *bolt.Bucket, verify bool) error {
	if verify {
		var prevTerm uint64
		next := db.snapIndex + 1
		err := eachEntry(lb, 0, func(idx uint64, v []byte) (bool, error) {
			if idx != next {
				return false, fmt.Errorf("log index %d where %d was expected (gap or lost head): %w", idx, next, ErrCorrupt)
			}
			term, err := checkEntry(idx, v)
			if err != nil {
				return false, err
			}
			if term < prevTerm {
				return false, fmt.Errorf("entry %d has term %d after term %d: %w", idx, term, prevTerm, ErrCorrupt)
			}
			prevTerm = term
			db.last = idx
			next++
			return true, nil
		})
		if err != nil {
			return err
		}
	} else {
		last, err := lastLogIndex(lb)
		if err != nil {
			return err
		}
		db.last = max(db.last, last)
	}
	if db.hs.Commit > db.last && !db.chain { // in format 6, openChain checks it
		return fmt.Errorf("commit index %d is past the last entry %d: %w", db.hs.Commit, db.last, ErrCorrupt)
	}
	db.boltLast = db.last
	return db.fillTailLocked(lb)
}

// fillTailLocked reads the newest maxTail bytes of entries (at least one)
// into the tail cache.
func (db *DB) fillTailLocked(lb *bolt.Bucket) error {
	c := lb.Cursor()
	var start uint64
	size := 0
	for k, v := c.Last(); k != nil && size < db.maxTail; k, v = c.Prev() {
		first, _, _, err := keyIndex(k)
		if err != nil {
			return err
		}
		start, size = first, size+len(v)
	}
	if size == 0 {
		return nil
	}
	var tail []pb.Entry
	size = 0
	err := eachEntry(lb, start, func(idx uint64, v []byte) (bool, error) {
		e, err := decodeEntry(idx, v)
		if err != nil {
			return false, err
		}
		size += entrySize(&e)
		tail = append(tail, e)
		return true, nil
	})
	if err != nil {
		return err
	}
	// As many of the newest as the budget holds, and the one that crosses
	// it, as appendTailLocked keeps.
	drop := 0
	for drop < len(tail)-1 && size-entrySize(&tail[drop]) >= db.maxTail {
		size -= entrySize(&tail[drop])
		drop++
	}
	clear(tail[:drop])
	db.tail, db.tailArr, db.tailBytes = tail[drop:], nil, size
	return nil
}

// Close writes everything the WAL and the stage hold into the file and
// closes it.
func (db *DB) Close() error {
	db.mu.Lock()
	if db.closed {
		db.mu.Unlock()
		return nil
	}
	db.closed = true
	db.mu.Unlock()
	db.snapMu.Lock()
	if !db.snaps.closed && db.snapStop != nil {
		close(db.snapStop)
	}
	db.snaps.closed = true
	db.snapMu.Unlock()
	db.bgWG.Wait() // a snapshot build checkpoints and reads the file
	var ferr error
	if !db.ro {
		if db.flStop != nil {
			close(db.flStop)
			<-db.flDone
		}
		close(db.ckStop)
		<-db.ckDone
		// Its checkpoint leaves no live frame: the file may say again,
		// in the same commit, what a release before padded frames reads.
		if err := db.commit(unmarkPadded); err != nil {
			db.mu.RLock()
			from, to, bytes := db.boltLast+1, db.last, db.pendBytes
			db.mu.RUnlock()
			what := "no entries, only metadata"
			if to >= from {
				what = fmt.Sprintf("entries %d to %d, %d bytes", from, to, bytes)
			}
			ferr = fmt.Errorf("%w (%s): %w", ErrNotCheckpointed, what, err)
		}
	}
	// Under the writers' locks: a Flush or Sync that passed its closed
	// check before Close began gets ErrClosed, not a closed file.
	db.ckMu.Lock()
	db.wmu.Lock()
	db.wal.close()
	db.wmu.Unlock()
	db.ckMu.Unlock()
	if db.seg.files != nil {
		db.seg.files.close() // the segments readers opened
	}
	err := db.bolt.Close()
	if err != nil {
		return err
	}
	return ferr
}

// Commits returns how many durable writes of the log (WAL appends and bbolt
// commits) were made since Open.
func (db *DB) Commits() uint64 { return db.commits.Load() }

// Syncs returns how many fdatasyncs those writes cost: one per WAL append,
// two per bbolt commit.
func (db *DB) Syncs() uint64 { return db.syncs.Load() }

// Written is what the storage layer wrote into the data dir since Open, in
// bytes, by file. Flash wears by these, not by the records' size; the
// device writes more besides (the file system's journal and metadata),
// which only its own counters show.
type Written struct {
	// WAL is the pages each WAL fdatasync covered, and the zeros a WAL
	// segment is grown with.
	WAL int64
	// Data is the pages the data file's commits wrote: checkpoints, and
	// the received snapshots merged in through them.
	Data int64
	// Snapshot is the bodies of the snapshots built for members that
	// fell behind, as written into their file (not synced: one removed
	// soon may never reach the device).
	Snapshot int64
}

// Written returns what the storage layer wrote since Open.
func (db *DB) Written() Written {
	return Written{WAL: db.wal.written.Load(), Data: db.fileWritten.Load(), Snapshot: db.snapWritten.Load()}
}

// Path returns the data file's path.
func (db *DB) Path() string { return db.path }

// u64 returns v as an 8-byte big-endian key.
func u64(v uint64) []byte {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], v)
	return b[:]
}

// Entry values: CRC-32C of the rest (4) | term (8) | type (1) | data.
const entryHdr = 13

func entrySize(e *pb.Entry) int { return entryHdr + len(e.Data) }

func putEntry(dst []byte, e *pb.Entry) {
	binary.BigEndian.PutUint64(dst[4:], e.Term)
	dst[12] = byte(e.Type)
	copy(dst[entryHdr:], e.Data)
	binary.BigEndian.PutUint32(dst, crc32.Checksum(dst[4:], castagnoli))
}

// checkEntry verifies a log value's CRC and returns its term.
func checkEntry(idx uint64, v []byte) (uint64, error) {
	if len(v) < entryHdr {
		return 0, fmt.Errorf("entry %d is %d bytes, shorter than its header: %w", idx, len(v), ErrCorrupt)
	}
	if got, want := crc32.Checksum(v[4:], castagnoli), binary.BigEndian.Uint32(v); got != want {
		return 0, fmt.Errorf("entry %d fails its CRC (stored %08x, computed %08x): %w", idx, want, got, ErrCorrupt)
	}
	return binary.BigEndian.Uint64(v[4:]), nil
}

// decodeEntry decodes a log value, copying its data out of the bbolt page.
func decodeEntry(idx uint64, v []byte) (pb.Entry, error) {
	term, err := checkEntry(idx, v)
	if err != nil {
		return pb.Entry{}, err
	}
	e := pb.Entry{Index: idx, Term: term, Type: pb.EntryType(v[12])}
	if len(v) > entryHdr {
		e.Data = append([]byte(nil), v[entryHdr:]...)
	}
	return e, nil
}
