package storage

import (
	"encoding/binary"
	"fmt"
	"os"
	"slices"
	"time"

	bolt "go.etcd.io/bbolt"
	pb "go.etcd.io/raft/v3/raftpb"
)

// A checkpoint moves what the WAL holds into bbolt: a cut (a frame that
// sends the next frames to the other WAL file, under a new id), then one
// bbolt transaction with the entries up to the cut, the staged operations,
// the hard state, and the new file and id. The background ones run on a
// goroutine of their own, so Save goes on appending to the other file
// meanwhile; Open, Close and the writes that go to bbolt directly run one
// synchronously (commit).
//
// Locks: ckMu, then wmu. ckMu is held for a whole checkpoint, wmu only for
// the cut by a background one, so Save waits for an fdatasync at most
// (under flush: interval for none: the cut's fdatasync runs after wmu).

// cut is the part of the log a checkpoint writes: everything up to the
// cut frame.
type cut struct {
	seg   int    // the file the frames after the cut go to
	id    uint64 // and the id they carry
	off   int64  // in format 6, where in seg they start (no cut frame)
	since int64  // and the bytes of frames before it since the last one
	last  uint64 // the last entry before the cut
	bytes int    // the size of the entries past boltLast up to last
	gen   uint64 // the stage generation at the cut
	hs    pb.HardState
	ents  []pb.Entry // the entries past boltLast up to last
}

// takeFresh copies the staged writes no WAL frame holds yet into buf.
func (db *DB) takeFresh(buf []stagedOp) []stagedOp {
	db.stageMu.Lock()
	defer db.stageMu.Unlock()
	return append(buf[:0], db.fresh...)
}

// dropFresh removes the fresh writes staged no later than gen: a frame or
// the file holds them now. Both remove from the front, in stage order, so
// a Save and a checkpoint may do it in either order.
func (db *DB) dropFresh(gen uint64) {
	db.stageMu.Lock()
	n := 0
	for n < len(db.fresh) && db.fresh[n].gen <= gen {
		n++
	}
	m := copy(db.fresh, db.fresh[n:])
	clear(db.fresh[m:]) // the values belong to the stage, or to nobody now
	db.fresh = db.fresh[:m]
	db.stageMu.Unlock()
}

// cutLocked writes a cut frame and switches the WAL to the other file. The
// caller holds ckMu (no checkpoint of an earlier cut is pending, so the
// other file's frames are dead) and wmu.
//
// With lazy, under flush: interval, the cut frame is written without its
// fdatasync: the caller syncs it after it lets go of wmu (syncCut). On
// slow flash an fdatasync takes tens of milliseconds, and Saves waiting
// for wmu meanwhile would put it on every ack of a checkpoint's moment:
// with checkpoints back to back (two more fdatasyncs each, bbolt's), a
// third of the time. Until that sync, nothing after the cut counts as
// durable (see unsyncedCut).
func (db *DB) cutLocked(lazy bool) (*cut, error) {
	if err := db.syncCutLocked(); err != nil {
		return nil, err
	}
	if db.chain {
		return db.markLocked(lazy)
	}
	id := newWALID()
	lazy = lazy && db.flushEvery > 0
	if _, err := db.appendWAL(nil, id, nil, nil, lazy); err != nil {
		return nil, err
	}
	w := db.wal
	if lazy {
		seg := &w.segs[w.cur]
		w.unsyncedCut = &unsyncedCut{f: seg.f, seg: w.cur, from: w.synced.Load(), pages: w.dirtyPages(w.off)}
		w.dirtyLo, w.dirtyHi = 0, 0
	}
	w.cur, w.off, w.id = 1-w.cur, 0, id
	w.synced.Store(0)
	return db.snapshot(w.cur, id), nil
}

// unsyncedCut is a cut frame written without its fdatasync (cutLocked). A
// power cut may lose it, and with it every frame of the other file, which
// only it makes live: so no frame after it is synced, by a write of its
// own or by the flusher, before it is (syncCutLocked, syncWAL).
type unsyncedCut struct {
	f    *os.File
	seg  int   // the file it ends
	from int64 // what of that file was synced before: what a power cut keeps
	// pages counts the bytes of the pages its fdatasync covers (written).
	pages int64
}

// syncCutLocked syncs a pending cut frame. The caller holds wmu.
func (db *DB) syncCutLocked() error {
	p := db.wal.unsyncedCut
	if p == nil {
		return nil
	}
	if err := db.syncCutFile(p); err != nil {
		return err
	}
	db.cutSyncedLocked(p)
	return nil
}

// syncCut syncs a pending cut frame without holding wmu while it waits.
func (db *DB) syncCut() error {
	db.wmu.Lock()
	p := db.wal.unsyncedCut
	db.wmu.Unlock()
	return db.syncCutUnlocked(p)
}

// syncCutUnlocked syncs p, taken from unsyncedCut under wmu (nil: nothing
// to do), without holding wmu while it waits.
func (db *DB) syncCutUnlocked(p *unsyncedCut) error {
	if p == nil {
		return nil
	}
	if err := db.syncCutFile(p); err != nil {
		return err
	}
	db.wmu.Lock()
	db.cutSyncedLocked(p)
	db.wmu.Unlock()
	return nil
}

// syncCutFile is p's fdatasync. Two may run at once (the checkpointer's and
// the flusher's): both then cover it.
func (db *DB) syncCutFile(p *unsyncedCut) error {
	if h := db.faults.cutSync.Load(); h != nil {
		(*h)()
	}
	if err := walSync(p.f); err != nil {
		return fmt.Errorf("storage: sync %s: %w", p.f.Name(), err)
	}
	if db.syncDelay > 0 {
		time.Sleep(db.syncDelay)
	}
	db.syncs.Add(1)
	return nil
}

// cutSyncedLocked notes that p is on disk, unless another sync noted it
// first. The caller holds wmu.
func (db *DB) cutSyncedLocked(p *unsyncedCut) {
	if w := db.wal; w.unsyncedCut == p {
		w.unsyncedCut = nil
		w.written.Add(p.pages)
	}
}

// snapshot returns the cut of everything so far, whose frames go on in
// file seg under id.
func (db *DB) snapshot(seg int, id uint64) *cut {
	c := &cut{seg: seg, id: id}
	db.stageMu.Lock()
	c.gen = db.stageGen
	db.stageMu.Unlock()
	db.mu.RLock()
	c.last, c.bytes, c.hs = db.last, db.pendBytes, db.hs
	if c.last > db.boltLast && !db.chain {
		// A copy of the entries' headers (their data is never written
		// to): appendTailLocked moves the tail within its array.
		c.ents = slices.Clone(db.tail[db.boltLast+1-db.tail[0].Index:])
	}
	db.mu.RUnlock()
	return c
}

// checkpointReplayed is Open's checkpoint of what it replayed. It writes
// no cut: the frames replayed may already end with one that no commit has
// recorded (a checkpoint that failed before the crash), and a second cut
// would send the next frames over the live ones of the file that cut
// left. Nothing is appended before this returns, so it can start the
// current file afresh under a new id instead.
func (db *DB) checkpointReplayed() error {
	db.ckMu.Lock()
	defer db.ckMu.Unlock()
	db.wmu.Lock()
	defer db.wmu.Unlock()
	w := db.wal
	if db.chain {
		c, err := db.markLocked(false)
		if err != nil {
			return err
		}
		return db.commitCut(c, 0, nil)
	}
	c := db.snapshot(w.cur, newWALID())
	if err := db.commitCut(c, 0, nil); err != nil {
		return err
	}
	w.off, w.id = 0, c.id
	w.synced.Store(0)
	return nil
}

// commitCut writes c into bbolt, then fn in the same transaction (fn
// appends entries more, the batch size Options.OnCommit reports). Staged
// operations leave the stage only once the commit succeeded, so a failed
// one (a full disk) loses none of them. The caller holds ckMu.
func (db *DB) commitCut(c *cut, entries int, fn func(tx *bolt.Tx) error) error {
	var taken []stagedOp
	var built time.Time // when fn is done and bbolt starts writing and syncing
	var drop dropResult
	st := db.bolt.Stats()
	alloc := st.TxStats.GetPageAlloc()
	db.runBuf = db.runBuf[:0] // bbolt's last transaction has ended
	defer func() {
		if cap(db.runBuf) > maxKeptBuf {
			db.runBuf = nil
		}
	}()
	err := db.bolt.Update(func(tx *bolt.Tx) error {
		defer func() { built = time.Now() }()
		// Copied into a slice kept from commit to commit, not a cloned
		// map: a clone is as large as the map ever grew, at every commit.
		// All of the stage, not only what the cut covers: a value staged
		// since is at worst written early, and frames after the cut that
		// replay over it are newer still.
		db.stageMu.Lock()
		taken = db.takeBuf[:0]
		for _, op := range db.staged {
			taken = append(taken, op)
		}
		db.takeBuf = taken
		db.stageMu.Unlock()
		var buckets map[string]*bolt.Bucket
		// While a snapshot is received, the values it noted as this
		// member's own are kept before they change (snapin.go).
		var same *bolt.Bucket
		if st := tx.Bucket(bucketSnapIn); st != nil && len(taken) > 0 {
			same = st.Bucket(snapInSame)
		}
		for _, op := range taken {
			b := buckets[op.bucket]
			if b == nil {
				var err error
				if b, err = tx.CreateBucketIfNotExists([]byte(op.bucket)); err != nil {
					return err
				}
				if buckets == nil {
					buckets = make(map[string]*bolt.Bucket, 4)
				}
				buckets[op.bucket] = b
			}
			if same != nil {
				if err := db.keepSnapshotValue(tx, same, b, op.bucket, op.key); err != nil {
					return err
				}
				if tx.Bucket(bucketSnapIn) == nil {
					same = nil // dropped: it was wrong
				}
			}
			var err error
			if op.val == nil {
				err = b.Delete([]byte(op.key))
			} else {
				err = b.Put([]byte(op.key), op.val)
			}
			if err != nil {
				return fmt.Errorf("%s/%s: %w", op.bucket, op.key, err)
			}
		}
		if !db.chain {
			if err := db.putEntries(tx, c.ents); err != nil {
				return err
			}
		}
		// After the staged operations: a staged commit-only hard state
		// may be ahead of the entries the cut covers.
		if err := putHardState(tx, c.hs); err != nil {
			return err
		}
		m := tx.Bucket(bucketMeta)
		if err := markPadded(tx); err != nil {
			return err
		}
		v := make([]byte, 16)
		binary.BigEndian.PutUint64(v, c.id)
		binary.BigEndian.PutUint64(v[8:], uint64(c.seg))
		if db.chain {
			v = walValue(c.id, uint64(c.seg), c.off)
		}
		if err := m.Put(keyWAL, v); err != nil {
			return err
		}
		if err := db.putClock(m); err != nil {
			return err
		}
		if fn != nil {
			if err := fn(tx); err != nil {
				return err
			}
		}
		var err error
		adding := c.bytes
		if db.chain {
			// The entries stay in the segments; what the file gains is
			// the staged writes (a broker state staged at once can be
			// megabytes, which a segment then holds until dropped).
			adding = 0
			for _, op := range taken {
				adding += len(op.key) + len(op.val)
			}
		}
		if drop, err = db.dropFront(tx, adding); err != nil {
			return err
		}
		return db.faults.commitErr()
	})
	if err != nil {
		db.undoDrop(drop)
		return err
	}
	// The file says formatPadded now: frames from here on may be padded.
	db.wal.mayPad.Store(true)
	if db.syncDelay > 0 {
		time.Sleep(2 * db.syncDelay) // bbolt's two fdatasyncs, on slow flash
	}
	// The pages the commit allocated are the ones it wrote (copy on
	// write; no freelist: NoFreelistSync), then one meta page.
	st = db.bolt.Stats()
	db.fileWritten.Add(st.TxStats.GetPageAlloc() - alloc + int64(db.bolt.Info().PageSize))
	db.mu.Lock()
	if !db.chain {
		db.boltLast = max(db.boltLast, c.last)
	}
	db.pendBytes -= c.bytes
	db.mu.Unlock()
	db.wal.sinceMark.Add(-c.since)
	if !db.chain {
		db.shrinkDeadWAL(&db.wal.segs[1-c.seg])
	}
	db.applyDrop(drop)
	if db.chain {
		db.applySegmentDrop(drop, 0)
	}
	db.syncs.Add(2)
	db.committed(c.bytes)
	if db.onCommit != nil {
		db.onCommit(time.Since(built), entries+len(c.ents))
	}
	db.stageMu.Lock()
	for _, op := range taken {
		if cur, ok := db.staged[op.k]; ok && cur.gen == op.gen {
			delete(db.staged, op.k)
		}
	}
	clear(taken) // the values belong to the stage, or to nobody now
	if cap(taken) > maxKeptOps {
		db.takeBuf = nil
	}
	db.stageMu.Unlock()
	// Only what was staged before the cut leaves fresh: a write staged
	// since must still get a frame after the cut, or an older value of
	// its key framed there would replay over the file's newer one.
	db.dropFresh(c.gen)
	return nil
}

// shrinkDeadWAL cuts the WAL file the commit just made dead back to
// walPrealloc, if frames outpacing a checkpoint grew it, when the data dir
// has a budget: the data file does not shrink, so a WAL that stayed grown
// would keep the data dir past the budget by as much for good (retention
// only frees pages in the file, which keeps its size). The file is not
// written again before the next cut, which needs ckMu, held by the caller;
// its frames are dead, so a truncation a crash undoes loses nothing. A
// failed one is only retried at the next commit.
func (db *DB) shrinkDeadWAL(seg *walSeg) {
	if db.ret.maxBytes <= 0 || seg.f == nil || seg.size <= walPrealloc {
		return
	}
	if err := seg.f.Truncate(walPrealloc); err != nil {
		return
	}
	seg.size = walPrealloc
}

// maxKeptBuf and maxKeptOps bound the buffers kept from one write to the
// next: a larger one, grown for an unusual batch, goes back to the garbage
// collector.
const (
	maxKeptBuf = 2 << 20
	maxKeptOps = 4096
)

// walBehindAt is how far the WAL may grow while checkpoints fail before a
// write checkpoints itself, and fails if it cannot: frames of metadata
// alone never make the entries' budget run over.
const walBehindAt = 4 * walPrealloc

// chainBehindAt is walBehindAt in format 6.
const chainBehindAt = 3 * walCheckpointAt

// behind says whether a write must checkpoint before its frame: the
// entries only the WAL holds pass the tail's budget (a quarter of it, what
// a checkpoint takes, once one has failed), or the WAL is far past its
// preallocated size.
func (db *DB) behind() bool {
	if db.chain {
		// The tail holds no entry for want of a checkpoint, and the
		// segments are the log: what bounds the WAL is the frames Open
		// would replay, and the segments retention cannot drop yet
		// (those past the replay point), which the background
		// checkpoints keep at walCheckpointAt unless writes outrun them.
		return db.wal.sinceMark.Load() > chainBehindAt
	}
	limit := db.maxTail
	if db.ckFailed.Load() {
		// A full disk: a WAL that ran far ahead would need bbolt to grow
		// by as much (more: its file grows by doubling) before anything
		// could be checkpointed once space returns.
		limit = db.maxTail / 4
	}
	db.mu.RLock()
	pend := db.pendBytes > limit
	db.mu.RUnlock()
	return pend || db.wal.synced.Load() > walBehindAt
}

// catchUp checkpoints when the WAL is behind (see behind), before a write
// adds a frame: a write that fails must have written nothing.
func (db *DB) catchUp() error {
	if !db.behind() {
		return nil
	}
	if err := db.commit(nil); err != nil {
		return fmt.Errorf("the WAL is full and cannot be checkpointed: %w", err)
	}
	return nil
}

// putHardState writes hs to the file, unless it is empty (raft had none).
func putHardState(tx *bolt.Tx, hs pb.HardState) error {
	if isEmptyHardState(hs) {
		return nil
	}
	b, err := hs.Marshal()
	if err != nil {
		return err
	}
	return tx.Bucket(bucketRaftState).Put(keyHardState, b)
}

// commit checkpoints synchronously, with fn in the same transaction.
func (db *DB) commit(fn func(tx *bolt.Tx) error) error { return db.commitSync(0, fn, nil) }

// commitSync is a synchronous checkpoint of everything, with fn (which
// appends entries more) in its transaction, and after run once it
// committed. It holds wmu throughout, so no frame and no other checkpoint
// comes between the cut, fn and after.
func (db *DB) commitSync(entries int, fn func(tx *bolt.Tx) error, after func()) error {
	db.ckMu.Lock()
	defer db.ckMu.Unlock()
	db.wmu.Lock()
	defer db.wmu.Unlock()
	if err := db.finishPending(); err != nil {
		return err
	}
	c, err := db.cutLocked(false)
	if err != nil {
		return err
	}
	if err := db.commitCut(c, entries, fn); err != nil {
		db.pendingCut = c // its frames are live: no new cut until it commits
		db.ckFailed.Store(true)
		return err
	}
	db.ckFailed.Store(false)
	if after != nil {
		after()
	}
	return nil
}

// finishPending commits a cut whose checkpoint failed before. The caller
// holds ckMu.
func (db *DB) finishPending() error {
	if db.pendingCut == nil {
		return nil
	}
	if err := db.commitCut(db.pendingCut, 0, nil); err != nil {
		db.ckFailed.Store(true)
		return err
	}
	db.pendingCut = nil
	db.ckFailed.Store(false)
	return nil
}

// dueLocked says whether the WAL holds enough for a checkpoint: a quarter
// of the tail's budget in entries, or walCheckpointAt in frames of any kind.
// The caller holds wmu.
func (db *DB) dueLocked() bool {
	if db.wal.off >= walCheckpointAt && !db.chain {
		return true
	}
	if db.chain {
		// Frames past the replay point: what Open replays.
		return db.wal.sinceMark.Load() >= walCheckpointAt
	}
	db.mu.RLock()
	defer db.mu.RUnlock()
	return db.pendBytes > db.maxTail/4
}

// checkpointer runs the background checkpoints until Close. After a
// failure (a full disk) it waits a second before the next try, and it logs
// only when checkpoints start and stop failing: Save checkpoints itself once
// the WAL holds too much and fails if it cannot, which is where a lasting
// failure surfaces.
func (db *DB) checkpointer() {
	defer close(db.ckDone)
	failing := false
	// Records age without any write to trigger a checkpoint: look for
	// expired ones a few times per max_age.
	var ageC <-chan time.Time
	if db.ret.maxAge > 0 {
		t := time.NewTicker(min(max(db.ret.maxAge/8, 100*time.Millisecond), time.Second))
		defer t.Stop()
		ageC = t.C
	}
	// A pass that stopped at records not applied yet goes on once they
	// are: at the next checkpoint under load, or within a second on an
	// idle gateway, which may see no write for hours (and would stay over
	// its budget meanwhile).
	var applyC <-chan time.Time
	if db.ret.maxBytes > 0 {
		t := time.NewTicker(time.Second)
		defer t.Stop()
		applyC = t.C
	}
	var spaceC <-chan time.Time
	if db.space.on() {
		db.space.check()
		t := time.NewTicker(watermarkEvery)
		defer t.Stop()
		spaceC = t.C
	}
	for {
		select {
		case <-db.ckStop:
			return
		case <-db.ckSig:
		case <-spaceC:
			db.space.check()
			continue
		case <-ageC:
			if !db.ageDue() {
				continue
			}
			db.retainDue.Store(true)
		case <-applyC:
			// Reads map the file's pages too (retained payloads and
			// sessions read from the data file, replays): release
			// them once a second, as writes do every releaseBytes.
			db.releaseMapped()
			if b := db.applyAt.Load(); b == 0 || db.Applied() < b {
				continue
			}
			db.retainDue.Store(true)
		}
		err := db.checkpoint()
		db.space.check()
		switch {
		case err != nil && !failing:
			db.log.Warn("checkpoint of the WAL into the data file failed; retrying", "error", err)
		case err == nil && failing:
			db.log.Info("checkpoints of the WAL into the data file work again")
		}
		failing = err != nil
		if failing {
			select {
			case <-db.ckStop:
				return
			case <-time.After(time.Second):
			}
		}
	}
}

// checkpoint is one background checkpoint: the cut under wmu, the commit
// without it.
func (db *DB) checkpoint() error {
	db.ckMu.Lock()
	defer db.ckMu.Unlock()
	err := db.checkpointLocked()
	// After the commit, whose retention pass may have dropped a segment
	// to reuse: made afresh, the next segment costs its zeros.
	if e := db.readySpare(); err == nil {
		err = e
	}
	return err
}

// checkpointLocked is checkpoint's work. The caller holds ckMu.
func (db *DB) checkpointLocked() error {
	if db.pendingCut == nil {
		db.wmu.Lock()
		due, retain := db.dueLocked(), db.retainDue.Swap(false)
		if !due && !retain {
			db.wmu.Unlock()
			return nil // a checkpoint since the signal did it
		}
		c, err := db.cutLocked(true)
		db.wmu.Unlock()
		if err != nil {
			return err
		}
		db.pendingCut = c
	}
	// Before the commit, so that the file the commit makes dead is never
	// the one whose sync is owed; Saves go on meanwhile. In format 6, so
	// that no frame before the replay point the commit records can be
	// lost to a power cut.
	if err := db.syncCut(); err != nil {
		return err
	}
	if db.chain {
		if err := db.syncWAL(); err != nil {
			return err
		}
	}
	return db.finishPending()
}

// kickCheckpoint wakes the checkpointer if the WAL holds enough. The
// caller holds wmu.
func (db *DB) kickCheckpoint() {
	if !db.dueLocked() {
		return
	}
	select {
	case db.ckSig <- struct{}{}:
	default:
	}
}

// markPadded makes the file say formatPadded, and keeps what it said in
// keyFormatRest (at least formatRuns, which every checkpoint makes it) for
// a clean Close to put back: see FormatVersion.
func markPadded(tx *bolt.Tx) error {
	f := metaU64(tx, bucketMeta, keyFormat)
	if f >= formatPadded {
		return nil
	}
	m := tx.Bucket(bucketMeta)
	if err := m.Put(keyFormatRest, u64(max(f, formatRuns))); err != nil {
		return err
	}
	return m.Put(keyFormat, u64(formatPadded))
}

// unmarkPadded makes the file say again what it said before markPadded,
// in the transaction of a clean Close's checkpoint, which leaves no live
// WAL frame: a release that knows no padded frame opens the file. (A
// torn commit falls back to one that says formatPadded, as it must.)
func unmarkPadded(tx *bolt.Tx) error {
	m := tx.Bucket(bucketMeta)
	rest := m.Get(keyFormatRest)
	if len(rest) != 8 {
		return nil
	}
	if err := m.Put(keyFormat, append([]byte(nil), rest...)); err != nil {
		return err
	}
	return m.Delete(keyFormatRest)
}
