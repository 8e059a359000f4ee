package storage

import (
	"encoding/binary"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"time"

	bolt "go.etcd.io/bbolt"
	pb "go.etcd.io/raft/v3/raftpb"
)

// Retention drops the log's oldest runs, whole, from the front of the log
// bucket: bbolt deletes, no rewrite. It runs inside a checkpoint's
// transaction (commitCut), so it costs no commit and no fdatasync of its
// own, and bbolt reuses the pages it frees for the entries that checkpoint
// and the next ones write: the data file stops growing once it holds a
// budget's worth.
//
// The drop point becomes raft's compaction point: the snapshot metadata
// (index and term of the last entry dropped) is written in the same
// transaction, FirstIndex moves past it, and Entries and Term answer
// ErrCompacted below it, as raft expects of a compacted log.
//
// What may be dropped is bounded by the floor the replication layer sets
// (SetRetentionFloor: what every member already holds), by the applied
// index and by the commit index. When the budget cannot be met within that
// bound, the DB reports Refusing until it can.
//
// The budget covers the whole data dir: the two WAL files, the data file's
// pages in use, and a reserve for what bbolt adds before it can reuse freed
// pages (one checkpoint's entries, written copy-on-write while the pages the
// same transaction frees are still pending) and for the chunk it grows the
// file by (growChunk). What the data dir may exceed the budget by (the
// documented slack) is retentionSlack.

// maxDropShare: one retention pass drops at most 1/maxDropShare of the log
// for its budget (dropFront).
const maxDropShare = 4

// growChunk is what bbolt grows the data file by once it is larger than
// that (bolt.DB.AllocSize; bbolt's default 16 MiB would be most of a small
// budget): the file stays within a MiB of its pages in use, at the cost of
// one ftruncate and fsync per MiB of growth, none once retention runs.
const growChunk = 1 << 20

// retentionSlack is how far past MaxBytes the data dir may go: the pages of
// one checkpoint that bbolt cannot reuse yet and a grow chunk, both of which
// the reserve accounts for from the second checkpoint after a budget is
// reached on; the first one past it can still add them. Documented in
// docs/configuration.md (storage.max_bytes).
const retentionSlack = 2 << 20

// RetentionSlack is how far past Options.MaxBytes the data dir may grow.
const RetentionSlack = retentionSlack

// retention is the DB's retention state. floor, over and blockedAt are read
// and written without mu: atomics, since replication sets the floor every
// tick and the checkpointer reads it.
type retention struct {
	maxBytes int64
	maxAge   time.Duration
	now      func() time.Time
}

// SetRetentionFloor sets the highest index retention may drop: what every
// member of the group already holds (replication computes it from raft's
// progress). Until it is set nothing is dropped. Raising it past the point
// where retention was blocked wakes a checkpoint, which drops then.
func (db *DB) SetRetentionFloor(i uint64) {
	db.floorSet.Store(true)
	if db.floor.Swap(i) == i || db.ro || !db.retainOn() {
		return
	}
	if b := db.blockedAt.Load(); b != 0 && i >= b {
		db.kickRetention()
	}
}

// retainOn says whether any retention is configured.
func (db *DB) retainOn() bool { return db.ret.maxBytes > 0 || db.ret.maxAge > 0 }

// kickRetention wakes the checkpointer for a retention pass.
func (db *DB) kickRetention() {
	db.retainDue.Store(true)
	select {
	case db.ckSig <- struct{}{}:
	default:
	}
}

// ageDue says whether the oldest record is past max_age and retention may
// drop it (it is not waiting for the floor to rise).
func (db *DB) ageDue() bool {
	t := db.oldest.Load()
	if t == 0 || t >= db.ret.now().Add(-db.ret.maxAge).UnixNano() {
		return false
	}
	b := db.blockedAt.Load()
	return b == 0 || db.dropFloor() >= b
}

// Refusing reports whether the log is over its budget with nothing it may
// drop: what is left is what a member still lacks or has not been applied.
func (db *DB) Refusing() bool { return db.refusing.Load() }

// RetentionStats is what retention reports for status and metrics.
type RetentionStats struct {
	// UsedBytes is the size of every file in the data dir.
	UsedBytes int64
	// BudgetBytes is Options.MaxBytes, 0 when unset.
	BudgetBytes int64
	// Oldest is the publish time of the oldest record in the log, zero
	// when it holds none.
	Oldest time.Time
	// Dropped counts the records retention dropped since Open.
	Dropped uint64
	// Refusing: see Refusing.
	Refusing bool
}

// RetentionStats returns the data dir's size and what retention did.
func (db *DB) RetentionStats() RetentionStats {
	s := RetentionStats{BudgetBytes: db.ret.maxBytes, Dropped: db.dropped.Load(), Refusing: db.refusing.Load()}
	if t := db.oldest.Load(); t != 0 {
		s.Oldest = time.Unix(0, t)
	}
	s.UsedBytes = dirBytes(filepath.Dir(db.path))
	return s
}

// dirBytes is the size of the regular files in dir.
func dirBytes(dir string) int64 { return filesBytes(dir, "") }

// filesBytes is the size of the regular files in dir whose names start
// with prefix.
func filesBytes(dir, prefix string) int64 {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return 0
	}
	var n int64
	for _, e := range ents {
		if !strings.HasPrefix(e.Name(), prefix) {
			continue
		}
		if fi, err := e.Info(); err == nil && fi.Mode().IsRegular() {
			n += fi.Size()
		}
	}
	return n
}

// walBytes is the size of the two WAL files, or in format 6 of the
// segments.
func (db *DB) walBytes() int64 {
	var n int64
	dir := filepath.Dir(db.path)
	if db.chain {
		return segmentBytes(dir)
	}
	for i := range 2 {
		if fi, err := os.Stat(walPath(dir, i)); err == nil {
			n += fi.Size()
		}
	}
	return n
}

// dropResult is what one retention pass did, applied to the in-memory view
// once its transaction committed.
type dropResult struct {
	// segTo is the last segment dropped, 0 when none (format 6).
	segTo               uint64
	snapIndex, snapTerm uint64
	prevIndex, prevTerm uint64 // the compaction point before
	records             uint64
	oldest              int64  // the first remaining record's time; 0 if none
	blocked             bool   // over budget with only what a member lacks: refusing
	blockedAt           uint64 // the floor the next drop needs; 0 when none waits
	some                bool   // something was dropped
	capped              bool   // the pass stopped at maxDropShare: another follows
	applyAt             uint64 // the pass stopped at records not applied yet: the next waits for this index
}

// dropFront drops the runs retention asks for in tx, which will also write
// adding bytes of entries. The caller holds ckMu.
func (db *DB) dropFront(tx *bolt.Tx, adding int) (dropResult, error) {
	var res dropResult
	if !db.retainOn() {
		return res, nil
	}
	// The applied and commit indexes this transaction writes (the stage
	// and the hard state are in it already), not the in-memory ones, which
	// may be ahead of what is staged: after a crash raft restarts from the
	// applied index on disk, and must find the log from there on.
	floor := db.dropFloor()
	limit := min(metaU64(tx, bucketMeta, keyApplied), floor)
	var hs pb.HardState
	if v := tx.Bucket(bucketRaftState).Get(keyHardState); v != nil {
		if err := hs.Unmarshal(v); err != nil {
			return res, fmt.Errorf("hard state: %v: %w", err, ErrCorrupt)
		}
	}
	limit = min(limit, hs.Commit)
	db.mu.RLock()
	snapIndex, lastIndex := db.snapIndex, db.last
	db.mu.RUnlock()
	// One pass drops at most a quarter of the log: what it frees is an
	// estimate (bbolt's branch pages and freelist do not shrink with it),
	// and the next pass, from real page counts, takes the rest. Without
	// the cap a small budget reached after a refusing period could take
	// the whole log in one pass.
	maxDrop := (lastIndex-snapIndex)/maxDropShare + 1
	var excess int64 = math.MinInt64
	if db.ret.maxBytes > 0 {
		// Pages in use as the last commit left them: bbolt's free and
		// pending counts are updated when a writable transaction closes.
		bs := db.bolt.Stats()
		ps := int64(tx.DB().Info().PageSize)
		inUse := tx.Size() - int64(bs.FreePageN+bs.PendingPageN)*ps
		used := inUse + int64(adding) + db.walBytes() + growChunk
		if !db.chain {
			// What the checkpoints will add to the file: in format 6
			// the entries stay in the segments walBytes counts.
			used += int64(db.maxTail)
		} else if !db.keepsSegment() {
			// The segment the frames until the next checkpoint may
			// take besides the one made ready (walBytes counts it), a
			// Save waiting for a checkpoint past chainBehindAt; a
			// dropped one kept for reuse is that segment, counted.
			used += walPrealloc
		}
		excess = used - db.ret.maxBytes
	}
	var cutoff int64 = math.MinInt64
	if db.ret.maxAge > 0 {
		cutoff = db.ret.now().Add(-db.ret.maxAge).UnixNano()
	}
	lb := tx.Bucket(bucketLog)
	c := lb.Cursor()
	var gone [][]byte
	// Records pulled from before an installed snapshot are older than
	// the log's: they go first (backfill.go).
	freed, err := dropBackfill(tx, excess)
	if err != nil {
		return res, err
	}
	if db.chain {
		// Format 6's log bucket is empty: an upgrade moves the runs
		// into segments (chainup.go).
		return res, db.dropSegments(tx, &res, freed, excess, cutoff, limit, floor)
	}
	// at is the item where the drops stop, read already (the cursor is
	// on its last key): the oldest record left is looked for from it on.
	var at *logItem
	for k, v := c.First(); k != nil; k, v = c.Next() {
		it, err := readHead(c, k, v)
		if err != nil {
			return res, err
		}
		last, term, records, newest, err := runInfo(it.first, it.run, it.v)
		if err != nil {
			return res, err
		}
		byBytes := freed < excess
		byAge := cutoff != math.MinInt64 && newest < cutoff
		if !byBytes && !byAge {
			at = &it
			break
		}
		if res.some && byBytes && !byAge && last > snapIndex+maxDrop { // a pass drops a run at least
			res.capped = true
			at = &it
			break
		}
		if last > limit {
			// Only bytes that a member lacks refuse publishes: records
			// past max_age wait for it quietly, and records not yet
			// applied (the applier is a batch behind in a burst) go at
			// a later checkpoint. Before replication has set a floor
			// at all (at Open) nobody is known to lack anything.
			res.blocked, res.blockedAt = byBytes && last > floor && db.floorSet.Load(), last
			if last <= floor {
				// Only not applied yet: the next pass once it is,
				// not at the next write, which may never come.
				res.applyAt = last
			}
			at = &it
			break
		}
		freed += int64(it.size)
		gone = append(gone, it.keys(k)...)
		res.snapIndex, res.snapTerm, res.some = last, term, true
		res.records += records
	}
	// The oldest record left: the first one from at on.
	if at != nil {
		if res.oldest, err = runOldest(at.first, at.run, at.v); err != nil {
			return res, err
		}
		for k, v := c.Next(); k != nil && res.oldest == 0; k, v = c.Next() {
			it, err := readHead(c, k, v)
			if err != nil {
				return res, err
			}
			if res.oldest, err = runOldest(it.first, it.run, it.v); err != nil {
				return res, err
			}
		}
	}
	if !res.some {
		return res, nil
	}
	return res, db.compactTo(tx, gone, &res)
}

// compactTo deletes the log keys gone, in tx, and makes res.snapIndex (the
// last entry they hold, of term res.snapTerm) the compaction point, on
// disk and in memory, where res keeps the point before for undoDrop.
func (db *DB) compactTo(tx *bolt.Tx, gone [][]byte, res *dropResult) error {
	db.mu.RLock()
	snapIndex := db.snapIndex
	db.mu.RUnlock()
	if res.snapIndex <= snapIndex {
		return fmt.Errorf("log bucket holds index %d, compacted up to %d: %w", res.snapIndex, snapIndex, ErrCorrupt)
	}
	lb := tx.Bucket(bucketLog)
	for _, k := range gone {
		if err := lb.Delete(k); err != nil {
			return err
		}
	}
	meta := make([]byte, 16)
	binary.BigEndian.PutUint64(meta, res.snapIndex)
	binary.BigEndian.PutUint64(meta[8:], res.snapTerm)
	if err := tx.Bucket(bucketRaftState).Put(keySnapMeta, meta); err != nil {
		return err
	}
	// Readers answer ErrCompacted for the dropped indexes from now on,
	// before the commit makes them vanish from the file: a reader that
	// saw the old first index and the new file would take the missing
	// entries for damage. Until the commit they are still there, so
	// answering ErrCompacted early is only conservative; a failed commit
	// puts the old bounds back (undoDrop).
	db.mu.Lock()
	res.prevIndex, res.prevTerm = db.snapIndex, db.snapTerm
	db.snapIndex, db.snapTerm, db.first = res.snapIndex, res.snapTerm, res.snapIndex+1
	db.mu.Unlock()
	return nil
}

// undoDrop restores the log's bounds after the transaction that would have
// dropped res failed.
func (db *DB) undoDrop(res dropResult) {
	if !res.some {
		return
	}
	db.mu.Lock()
	if db.snapIndex == res.snapIndex {
		db.snapIndex, db.snapTerm, db.first = res.prevIndex, res.prevTerm, res.prevIndex+1
	}
	db.mu.Unlock()
}

// metaU64 reads an 8-byte value, 0 when unset.
func metaU64(tx *bolt.Tx, bucket, key []byte) uint64 {
	if v := tx.Bucket(bucket).Get(key); len(v) == 8 {
		return binary.BigEndian.Uint64(v)
	}
	return 0
}

// applyDrop updates the in-memory view after the transaction that dropped
// res committed.
func (db *DB) applyDrop(res dropResult) {
	if !db.retainOn() {
		return
	}
	if res.records > 0 && db.dropped.Add(res.records) == res.records {
		// Once per Open: after that status and metrics count them.
		db.log.Info("retention dropped the oldest records, whole runs at a time",
			"first_index", res.snapIndex+1, "records", res.records, "max_bytes", db.ret.maxBytes, "max_age", db.ret.maxAge)
	}
	db.oldest.Store(res.oldest)
	db.blockedAt.Store(res.blockedAt)
	db.applyAt.Store(res.applyAt)
	// A floor raised while this pass ran (it read the old one) found no
	// blockedAt to compare with in SetRetentionFloor or SetHoldFloor:
	// look again now that it is stored. Else retention waits for the next
	// write, which a log refusing publishes for that very reason may never
	// take (issue #32: a master with every member live refused every
	// publish until it was killed; TestDeposedMasterGivenASnapshot-
	// RepublishesItsTail waited 20 s in vain once in CI).
	// (Only a pass the floor blocked: one waiting for the applier has
	// blockedAt at or below the floor already, and goes on by applyAt.)
	if res.blocked && db.dropFloor() >= res.blockedAt {
		db.kickRetention()
	}
	if res.capped {
		db.kickRetention() // the rest of the excess, measured again
	}
	// Who holds the oldest records: a member that lacks them, or (the
	// members' floor past them) a reader that is no member, the slowest
	// uplink whose cloud has not taken them.
	byHold := res.blocked && res.blockedAt <= db.floor.Load()
	db.blockedByHold.Store(byHold)
	if was := db.refusing.Swap(res.blocked); was != res.blocked {
		if res.blocked {
			why := "a member lacks the oldest records"
			if byHold {
				why = "an uplink has not delivered the oldest records to its cloud (its position holds them: see its max_backlog and on_full)"
			}
			first, _ := db.FirstIndex()
			db.log.Warn("the log is over its budget and holds nothing it may drop: "+why,
				"max_bytes", db.ret.maxBytes, "first_index", first, "blocked_at_index", res.blockedAt,
				"members_floor", db.floor.Load(), "uplink_hold", int64(db.HoldFloor()))
		} else {
			db.log.Info("the log is within its budget again")
		}
	}
}

// runInfo returns the last index and its term of the log key first (a run
// or a single entry) holding v, how many records it holds and the newest
// record's publish time (math.MinInt64 when it holds none: entries without
// a record, such as membership changes, never hold retention back).
func runInfo(first uint64, run bool, v []byte) (last, term, records uint64, newest int64, err error) {
	newest = math.MinInt64
	rest, idx := v, first
	for len(rest) > 0 {
		ev := rest
		if run {
			if ev, rest, err = nextInRun(idx, rest); err != nil {
				return
			}
		} else {
			rest = nil
		}
		if len(ev) < entryHdr {
			return 0, 0, 0, 0, fmt.Errorf("entry %d is %d bytes, shorter than its header: %w", idx, len(ev), ErrCorrupt)
		}
		last, term = idx, binary.BigEndian.Uint64(ev[4:])
		if t, ok := entryTime(ev); ok {
			records++
			newest = max(newest, t)
		}
		idx++
	}
	return
}

// runOldest returns the publish time of the first record in the log key
// first holding v, 0 when it holds none.
func runOldest(first uint64, run bool, v []byte) (int64, error) {
	rest, idx := v, first
	for len(rest) > 0 {
		ev := rest
		if run {
			var err error
			if ev, rest, err = nextInRun(idx, rest); err != nil {
				return 0, err
			}
		} else {
			rest = nil
		}
		if t, ok := entryTime(ev); ok {
			return t, nil
		}
		idx++
	}
	return 0, nil
}

// entryTime returns the publish time of the record an entry value holds.
func entryTime(ev []byte) (int64, bool) {
	if len(ev) <= entryHdr || ev[12] != 0 { // 0: pb.EntryNormal
		return 0, false
	}
	return recordTime(ev[entryHdr:])
}

// entryValue is the head of e's log value that entryTime reads: the type
// byte at its place, then the data (no CRC: it is not checked there).
func entryValue(e *pb.Entry) []byte {
	v := make([]byte, entryHdr, entryHdr+len(e.Data))
	v[12] = byte(e.Type)
	return append(v, e.Data...)
}

// loadOldest sets the oldest record's time from the file, at Open.
func (db *DB) loadOldest() error {
	if db.chain {
		t, err := db.chainOldest(0)
		db.oldest.Store(t)
		return err
	}
	return db.bolt.View(func(tx *bolt.Tx) error {
		c := tx.Bucket(bucketLog).Cursor()
		for k, v := c.First(); k != nil; k, v = c.Next() {
			it, err := readHead(c, k, v)
			if err != nil {
				return err
			}
			t, err := runOldest(it.first, it.run, it.v)
			if err != nil {
				return err
			}
			if t != 0 {
				db.oldest.Store(t)
				return nil
			}
		}
		return nil
	})
}
