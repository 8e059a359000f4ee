package storage

import (
	"encoding/binary"
	"fmt"

	bolt "go.etcd.io/bbolt"
	pb "go.etcd.io/raft/v3/raftpb"
)

// InitialState implements raft.Storage.
func (db *DB) InitialState() (pb.HardState, pb.ConfState, error) {
	db.mu.RLock()
	defer db.mu.RUnlock()
	return db.hs, db.cs, nil
}

// FirstIndex implements raft.Storage.
func (db *DB) FirstIndex() (uint64, error) {
	db.mu.RLock()
	defer db.mu.RUnlock()
	return db.first, nil
}

// LastIndex implements raft.Storage.
func (db *DB) LastIndex() (uint64, error) {
	db.mu.RLock()
	defer db.mu.RUnlock()
	return db.last, nil
}

// ApplySnapshot installs a snapshot raft received from the master: this
// member was behind the master's first index. In one transaction the whole
// log goes, the log starts again after the snapshot's index (which becomes
// the commit and applied index), and the buckets the snapshot carries (the
// broker state: snapshot.go) replace this member's. A snapshot without
// data (from a build before snapshots carried the broker state) carries the
// membership only. The records before the snapshot's index are not on this
// member afterwards.
//
// The buckets come from the staging (snapin.go): a snapshot pulled by
// reference is there already, and raft's snapshot carries its staged ref;
// one that came whole in raft's message is checked, then staged first.
// Either way the install moves them in place rather than writing them, and
// the log up to the applied index was dropped before they were staged, so
// the data dir holds the broker state twice at most, not the log besides.
//
// Except the ones only this member may hold: the entries past its commit
// index that it wrote as the master (in the term NoteLed recorded last) are
// records it may have acked as async while cut off, and a master whose log
// has since passed them sends a snapshot, not an append that would
// overwrite them. They move to the requeue bucket, as overwritten ones do,
// and are re-published (DESIGN.md: storage never drops a persisted data
// entry silently). Those the cluster had after all come back as duplicates
// the master cannot tell by id once its retention dropped its copies: the
// records a cut-off master had sent, but not heard committed.
func (db *DB) ApplySnapshot(snap pb.Snapshot) error {
	if db.ro {
		return fmt.Errorf("storage: apply snapshot on a read-only file")
	}
	md := snap.Metadata
	var staged *SnapshotRef
	if ref, ok := ParseStagedSnapshot(snap.Data); ok {
		if ref.Index != md.Index {
			return fmt.Errorf("storage: apply snapshot: it was received at index %d, its metadata says %d: %w", ref.Index, md.Index, ErrCorrupt)
		}
		staged = &ref
	} else if len(snap.Data) > 0 {
		ref, err := db.stageSnapshot(snap.Data, md.Index)
		if err != nil {
			return fmt.Errorf("storage: apply snapshot at %d: %w", md.Index, err)
		}
		staged = &ref
	}
	hs := db.HardState()
	led, err := db.ledTerm()
	if err != nil {
		return fmt.Errorf("storage: apply snapshot: %w", err)
	}
	last, _ := db.LastIndex()
	requeue := led != 0 && led <= hs.Term && last > hs.Commit
	from := hs.Commit + 1
	hs.Commit = max(hs.Commit, md.Index)
	if md.Term > hs.Term {
		hs.Term, hs.Vote = md.Term, 0
	}
	var chainNext, chainID uint64
	err = db.commitSync(0, func(tx *bolt.Tx) error {
		if requeue {
			if err := requeueFrom(tx, tx.Bucket(bucketLog), from, led); err != nil {
				return err
			}
			if db.chain {
				if err := db.chainRequeueTx(tx, from, led); err != nil {
					return err
				}
			}
			db.requeued.Store(true)
		}
		if db.chain {
			var err error
			if chainNext, chainID, err = db.restartChainLocked(tx); err != nil {
				return err
			}
		}
		if err := tx.DeleteBucket(bucketLog); err != nil {
			return err
		}
		if _, err := tx.CreateBucket(bucketLog); err != nil {
			return err
		}
		if staged != nil {
			if err := db.installStaged(tx, *staged); err != nil {
				return err
			}
			if err := startBackfill(tx, md.Index); err != nil {
				return err
			}
		}
		cs, err := md.ConfState.Marshal()
		if err != nil {
			return err
		}
		rs := tx.Bucket(bucketRaftState)
		meta := make([]byte, 16)
		binary.BigEndian.PutUint64(meta, md.Index)
		binary.BigEndian.PutUint64(meta[8:], md.Term)
		if err := rs.Put(keySnapMeta, meta); err != nil {
			return err
		}
		if err := rs.Put(keyConfState, cs); err != nil {
			return err
		}
		if err := putHardState(tx, hs); err != nil {
			return err
		}
		return tx.Bucket(bucketMeta).Put(keyApplied, u64(md.Index))
	}, func() {
		db.mu.Lock()
		db.hs, db.cs = hs, md.ConfState
		db.snapIndex, db.snapTerm = md.Index, md.Term
		db.first, db.last, db.boltLast = md.Index+1, md.Index, md.Index
		db.applied = md.Index
		db.tail, db.tailArr, db.tailBytes = nil, nil, 0
		db.mu.Unlock()
		db.oldest.Store(0)
		db.forgetBuilt()
		if staged != nil {
			db.installing.Store(false) // installStaged cleared keyInstalling
		}
		if db.chain {
			db.finishRestartLocked(chainNext, chainID)
		}
	})
	if err != nil {
		return fmt.Errorf("storage: apply snapshot: %w", err)
	}
	return nil
}

// NoteLed records that this node is the master of term: the entries it
// writes in that term are its own, acked perhaps before any other member
// holds them, which ApplySnapshot keeps. Staged: durable no later than the
// first entry saved after it, the one raft appends for the new term.
func (db *DB) NoteLed(term uint64) { db.stage(string(bucketMeta), string(keyLed), u64(term)) }

// ledTerm returns the term NoteLed recorded last, 0 if none.
func (db *DB) ledTerm() (uint64, error) {
	v, err := db.GetMeta(string(keyLed))
	if err != nil || len(v) != 8 {
		return 0, err
	}
	return binary.BigEndian.Uint64(v), nil
}

// Term implements raft.Storage.
func (db *DB) Term(i uint64) (uint64, error) {
	db.mu.RLock()
	defer db.mu.RUnlock()
	switch {
	case i == db.snapIndex:
		return db.snapTerm, nil
	case i < db.snapIndex:
		return 0, ErrCompacted
	case i > db.last:
		return 0, ErrUnavailable
	}
	if e, ok := db.tailEntryLocked(i); ok {
		return e.Term, nil
	}
	if db.chain && i > db.boltLast {
		return db.chainTermLocked(i)
	}
	var term uint64
	err := db.bolt.View(func(tx *bolt.Tx) error {
		lc := newLogCursor(tx.Bucket(bucketLog))
		if err := lc.seek(i); err != nil {
			return err
		}
		idx, v, err := lc.entry()
		if err != nil {
			return err
		}
		if v == nil || idx != i {
			return fmt.Errorf("entry %d missing: %w", i, ErrCorrupt)
		}
		term, err = checkEntry(i, v)
		return err
	})
	return term, err
}

// Entries implements raft.Storage: entries [lo, hi), at most maxSize bytes
// but at least one.
func (db *DB) Entries(lo, hi, maxSize uint64) ([]pb.Entry, error) {
	db.mu.RLock()
	defer db.mu.RUnlock()
	if lo <= db.snapIndex {
		return nil, ErrCompacted
	}
	if hi > db.last+1 || lo > hi {
		return nil, fmt.Errorf("entries [%d, %d) past last index %d: %w", lo, hi, db.last, ErrUnavailable)
	}
	if lo == hi {
		return nil, nil
	}
	if len(db.tail) > 0 && lo >= db.tail[0].Index {
		off := db.tail[0].Index
		ents := db.tail[lo-off : hi-off]
		n := limitSize(ents, maxSize)
		return append([]pb.Entry(nil), ents[:n]...), nil
	}
	if db.chain {
		return db.chainEntriesAllLocked(lo, hi, maxSize)
	}
	// [lo, hi) starts before the tail, so before boltLast+1: the file has
	// the head, the tail the rest.
	out, err := db.readEntries(lo, min(hi, db.boltLast+1), maxSize)
	if err != nil || hi <= db.boltLast+1 || out[len(out)-1].Index < db.boltLast {
		return out, err
	}
	off := db.tail[0].Index
	rest := db.tail[db.boltLast+1-off : hi-off]
	all := append(out, rest...)
	return all[:limitSize(all, maxSize)], nil
}

// readEntries reads entries [lo, hi) from the file.
func (db *DB) readEntries(lo, hi, maxSize uint64) ([]pb.Entry, error) {
	var out []pb.Entry
	err := db.bolt.View(func(tx *bolt.Tx) error {
		lc := newLogCursor(tx.Bucket(bucketLog))
		if err := lc.seek(lo); err != nil {
			return err
		}
		var size uint64
		for i := lo; i < hi; i++ {
			idx, v, err := lc.entry()
			if err != nil {
				return err
			}
			if v == nil || idx != i {
				return fmt.Errorf("entry %d missing: %w", i, ErrCorrupt)
			}
			e, err := decodeEntry(i, v)
			if err != nil {
				return err
			}
			size += uint64(e.Size())
			if len(out) > 0 && size > maxSize {
				break
			}
			out = append(out, e)
		}
		if len(out) == 0 {
			return fmt.Errorf("entry %d missing: %w", lo, ErrCorrupt)
		}
		return nil
	})
	return out, err
}

// limitSize returns how many of ents fit in maxSize bytes, at least one.
func limitSize(ents []pb.Entry, maxSize uint64) int {
	var size uint64
	for i := range ents {
		size += uint64(ents[i].Size())
		if i > 0 && size > maxSize {
			return i
		}
	}
	return len(ents)
}

func (db *DB) tailEntryLocked(i uint64) (pb.Entry, bool) {
	if len(db.tail) == 0 || i < db.tail[0].Index || i > db.last {
		return pb.Entry{}, false
	}
	return db.tail[i-db.tail[0].Index], true
}

// appendTailLocked adds ents (contiguous, ending at db.last) to the tail
// cache, cutting a conflicting suffix first and dropping the oldest entries
// past the byte budget. The tail slides along its array, which is reused:
// once the end is reached, the live entries move back to the start, and a
// new array (half as large again) is made only when they fill most of it.
// A tail that sliced off its front and let append grow it would allocate
// an array of the whole tail every quarter of a tail appended, some 240
// bytes per record at the default budget.
func (db *DB) appendTailLocked(ents []pb.Entry) {
	if len(ents) == 0 {
		return
	}
	if len(db.tail) > 0 {
		first := db.tail[0].Index
		switch {
		case ents[0].Index <= first:
			clear(db.tail)
			db.tail, db.tailBytes = db.tail[:0], 0
		case ents[0].Index <= db.tail[len(db.tail)-1].Index+1:
			cut := db.tail[ents[0].Index-first:]
			for i := range cut {
				db.tailBytes -= entrySize(&cut[i])
			}
			clear(cut)
			db.tail = db.tail[:ents[0].Index-first]
		default:
			clear(db.tail)
			db.tail, db.tailBytes = db.tail[:0], 0
		}
	}
	for i := range ents {
		db.tailBytes += entrySize(&ents[i])
	}
	db.roomTailLocked(len(ents))
	db.tail = append(db.tail, ents...)
	drop := 0
	// Never an entry past boltLast: the tail is the only copy of those
	// that readers have until the next checkpoint. In format 6 readers
	// have the segments.
	for db.tailBytes > db.maxTail && drop < len(db.tail)-1 && (db.chain || db.tail[drop].Index <= db.boltLast) {
		db.tailBytes -= entrySize(&db.tail[drop])
		drop++
	}
	clear(db.tail[:drop]) // their data is not pinned by the array
	db.tail = db.tail[drop:]
}

// roomTailLocked makes room for n more entries at the tail's end in
// tailArr, moving the tail to the array's start, or into a larger array.
// Nothing else holds a slice of the array: readers copy what they take
// from it, and a checkpoint's cut clones its entries.
func (db *DB) roomTailLocked(n int) {
	if len(db.tail)+n <= cap(db.tail) && db.tailArr != nil {
		return // cap(db.tail) runs to the array's end
	}
	need := len(db.tail) + n
	if arr := db.tailArr; arr != nil && need <= cap(arr)-cap(arr)/4 {
		// The same array, once per quarter of it appended at least.
		k := copy(arr[:cap(arr)], db.tail)
		clear(arr[k:cap(arr)])
		db.tail = arr[:k]
		return
	}
	arr := make([]pb.Entry, len(db.tail), need+need/2)
	copy(arr, db.tail)
	db.tail, db.tailArr = arr, arr
}

// Save makes hs and ents durable, together with any staged metadata, in
// one WAL frame: one write and one fdatasync for the whole batch. Once a
// checkpoint is due (dueLocked), the checkpointer writes the WAL's entries
// into bbolt in the background; once the WAL is behind (behind), Save
// checkpoints first itself, which bounds the memory and the disk they take.
// An append that overwrites entries goes to bbolt directly, with the WAL's
// contents: the entries it overwrites move to the requeue bucket, never
// dropped, since a deposed master may have acked them.
func (db *DB) Save(hs pb.HardState, ents []pb.Entry) error {
	if db.ro {
		return fmt.Errorf("storage: save on a read-only file")
	}
	db.mu.RLock()
	closed, last := db.closed, db.last
	db.mu.RUnlock()
	if closed {
		return ErrClosed
	}
	if len(ents) > 0 && ents[0].Index <= last {
		if db.chain {
			return db.saveOverwritingChain(hs, ents)
		}
		return db.saveOverwriting(hs, ents, last)
	}
	// Raft hands a failed batch again: nothing may be written before the
	// frame that could fail.
	if err := db.catchUp(); err != nil {
		return fmt.Errorf("storage: save: %w", err)
	}
	var hsp *pb.HardState
	if !isEmptyHardState(hs) {
		hsp = &hs
	}
	db.wmu.Lock()
	defer db.wmu.Unlock()
	if err := db.appendLocked(hsp, ents, true); err != nil {
		return fmt.Errorf("storage: save: %w", err)
	}
	db.kickCheckpoint()
	return nil
}

// appendLocked writes hs, the fresh staged operations and ents in one WAL
// frame and updates the in-memory view; lazy leaves its fdatasync to the
// flusher under flush: interval (appendWAL). The caller holds wmu.
func (db *DB) appendLocked(hs *pb.HardState, ents []pb.Entry, lazy bool) error {
	return db.appendWithLocked(hs, ents, nil, lazy)
}

// appendWithLocked is appendLocked whose frame also carries extra, staged
// once the frame is written (for the checkpoint to write into the file).
func (db *DB) appendWithLocked(hs *pb.HardState, ents []pb.Entry, extra []stagedOp, lazy bool) error {
	ops := db.takeFresh(db.opsBuf)
	ops = append(ops, extra...)
	db.opsBuf = ops
	if hs == nil && len(ops) == 0 && len(ents) == 0 {
		return nil
	}
	if db.chain && len(ents) > 0 && len(extra) == 0 && frameSize(ops, nil) >= walPrealloc/2 {
		// Metadata of half a segment or more (a broker state staged
		// at once) goes in a frame of its own, before the entries: in
		// format 6 a frame stays until retention drops its segment,
		// and one that held entries too would keep the metadata's
		// bytes for as long as the entries' segment lives. Ahead of
		// the entries is where staged writes may be.
		if _, err := db.appendWAL(nil, 0, ops, nil, lazy); err != nil {
			clear(ops)
			return err
		}
		db.dropFresh(ops[len(ops)-1].gen)
		clear(ops)
		ops = ops[:0]
	}
	took, err := db.appendWAL(hs, 0, ops, ents, lazy)
	if n := len(ops) - len(extra); err == nil && n > 0 {
		db.dropFresh(ops[n-1].gen)
	}
	if err == nil && len(extra) > 0 {
		db.stageMu.Lock()
		for _, op := range extra {
			db.stageGen++
			op.gen = db.stageGen
			db.staged[op.k] = op
		}
		db.stageMu.Unlock()
	}
	clear(ops) // the values belong to the stage
	if cap(ops) > maxKeptOps {
		db.opsBuf = nil
	}
	if err != nil {
		return err
	}
	db.mu.Lock()
	if hs != nil {
		db.hs = *hs
	}
	if len(ents) > 0 {
		db.last = ents[len(ents)-1].Index
		for i := range ents {
			db.pendBytes += entrySize(&ents[i])
		}
		if db.chain {
			db.seg.x.note(ents[0].Index, db.last, uint64(db.wal.cur), db.wal.lastAt)
		}
		db.appendTailLocked(ents)
	}
	db.mu.Unlock()
	if db.ret.maxAge > 0 && db.oldest.Load() == 0 {
		// The first records of an empty log: max_age's ticker needs
		// their age before any checkpoint has seen them.
		for i := range ents {
			if t, ok := entryTime(entryValue(&ents[i])); ok {
				db.oldest.CompareAndSwap(0, t)
				break
			}
		}
	}
	db.committed(0) // the WAL's files are not mapped
	if db.onCommit != nil {
		db.onCommit(took, len(ents))
	}
	return nil
}

// saveOverwriting is Save for an append that overwrites entries from
// ents[0].Index on: a synchronous checkpoint whose transaction also moves
// them to the requeue bucket and writes ents.
func (db *DB) saveOverwriting(hs pb.HardState, ents []pb.Entry, last uint64) error {
	err := db.commitSync(len(ents), func(tx *bolt.Tx) error {
		lb := tx.Bucket(bucketLog)
		if err := requeueFrom(tx, lb, ents[0].Index, 0); err != nil {
			return err
		}
		db.requeued.Store(true)
		if err := db.putEntries(tx, ents); err != nil {
			return err
		}
		return putHardState(tx, hs)
	}, func() {
		db.mu.Lock()
		if !isEmptyHardState(hs) {
			db.hs = hs
		}
		db.last = ents[len(ents)-1].Index
		db.boltLast = db.last
		db.appendTailLocked(ents)
		db.mu.Unlock()
	})
	if err != nil {
		return fmt.Errorf("storage: save: %w", err)
	}
	return nil
}

func isEmptyHardState(hs pb.HardState) bool { return hs == pb.HardState{} }

// SetCommit records a hard state whose term and vote are already on disk
// and whose commit index moved. It is written with the next transaction
// instead of costing a commit of its own: a commit index that lags on disk
// is safe (raft learns it again from the log and the leader), and the
// applied index is clamped to it at start.
func (db *DB) SetCommit(hs pb.HardState) {
	b, err := hs.Marshal()
	if err != nil {
		panic(fmt.Sprintf("storage: marshal hard state: %v", err))
	}
	db.mu.Lock()
	db.hs = hs
	db.mu.Unlock()
	db.stage(string(bucketRaftState), string(keyHardState), b)
}

// SetConfState records the membership raft applied; it is written with the
// next transaction, which is also the one recording the applied index.
func (db *DB) SetConfState(cs pb.ConfState) {
	b, err := cs.Marshal()
	if err != nil {
		panic(fmt.Sprintf("storage: marshal conf state: %v", err))
	}
	db.mu.Lock()
	db.cs = cs
	db.mu.Unlock()
	db.stage(string(bucketRaftState), string(keyConfState), b)
}

// SetApplied records the index of the last entry applied (delivered to
// subscribers and reflected in the retained store). It is written with the
// next transaction, after the metadata staged while applying.
func (db *DB) SetApplied(i uint64) {
	db.mu.Lock()
	// An apply batch from before an installed snapshot must not take the
	// applied index back below it: raft restarts from it and needs the
	// log to follow it.
	i = max(i, db.snapIndex)
	db.applied = i
	db.mu.Unlock()
	db.stage(string(bucketMeta), string(keyApplied), u64(i))
}

// Applied returns the applied index recorded in the file, never past the
// recorded commit index (see SetCommit): what lies between is applied again.
func (db *DB) Applied() uint64 {
	db.mu.RLock()
	defer db.mu.RUnlock()
	return min(db.applied, db.hs.Commit)
}

// HardState returns the persisted raft hard state.
func (db *DB) HardState() pb.HardState {
	db.mu.RLock()
	defer db.mu.RUnlock()
	return db.hs
}
