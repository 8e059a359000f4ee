package storage

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	bolt "go.etcd.io/bbolt"
	pb "go.etcd.io/raft/v3/raftpb"
)

// stage queues a metadata write for the next WAL frame.
func (db *DB) stage(bucket, key string, val []byte) {
	db.stageMu.Lock()
	db.stageGen++
	k := bucket + "\x00" + key
	op := stagedOp{k: k, bucket: bucket, key: key, val: val, gen: db.stageGen}
	db.staged[k] = op
	db.fresh = append(db.fresh, op)
	db.stageMu.Unlock()
}

// Stage queues key=val in bucket (BucketSessions) for the next write: it
// becomes durable no later than any entry saved after Stage returns, and
// ForEach sees it at once. val must not be modified afterwards.
func (db *DB) Stage(bucket, key string, val []byte) {
	if val == nil {
		val = []byte{}
	}
	db.stage(bucket, key, val)
}

// StageDelete queues the deletion of key in bucket, like Stage.
func (db *DB) StageDelete(bucket, key string) { db.stage(bucket, key, nil) }

// takeFresh copies the staged writes no WAL frame holds yet into buf.
func (db *DB) takeFresh(buf []stagedOp) []stagedOp {
	db.stageMu.Lock()
	defer db.stageMu.Unlock()
	return append(buf[:0], db.fresh...)
}

// dropFresh removes the first n fresh writes, which a frame now holds.
func (db *DB) dropFresh(n int) {
	db.stageMu.Lock()
	db.fresh = append(db.fresh[:0], db.fresh[n:]...)
	db.stageMu.Unlock()
}

// commit checkpoints (see commitLocked) with fn in the same transaction.
func (db *DB) commit(fn func(tx *bolt.Tx) error) error {
	db.wmu.Lock()
	defer db.wmu.Unlock()
	return db.commitLocked(0, fn)
}

// commitLocked is a checkpoint: one bbolt transaction that writes every
// staged operation, the entries only the WAL and the tail hold, the hard
// state and a new WAL id, then fn (which appends entries more, the batch
// size Options.OnCommit reports). Once it commits, the WAL's frames are
// dead and the next one goes at its start. Staged operations leave the
// stage only once the commit succeeded, so a failed one (a full disk)
// loses none of them. The caller holds wmu.
func (db *DB) commitLocked(entries int, fn func(tx *bolt.Tx) error) error {
	db.mu.RLock()
	from, last, hs := db.boltLast+1, db.last, db.hs
	var pend []pb.Entry
	if last >= from {
		pend = db.tail[from-db.tail[0].Index:]
	}
	db.mu.RUnlock()
	id := newWALID()
	var taken []stagedOp
	var maxGen uint64
	var built time.Time // when fn is done and bbolt starts writing and syncing
	err := db.bolt.Update(func(tx *bolt.Tx) error {
		defer func() { built = time.Now() }()
		// Copied into a slice kept from commit to commit, not a cloned
		// map: a clone is as large as the map ever grew, at every commit.
		db.stageMu.Lock()
		taken = db.takeBuf[:0]
		for _, op := range db.staged {
			taken = append(taken, op)
			maxGen = max(maxGen, op.gen)
		}
		db.takeBuf = taken
		db.stageMu.Unlock()
		var buckets map[string]*bolt.Bucket
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
		if err := db.putEntries(tx, pend, true); err != nil {
			return err
		}
		// After the staged operations: the hard state in memory is never
		// older than a staged commit-only one.
		if !isEmptyHardState(hs) {
			b, err := hs.Marshal()
			if err != nil {
				return err
			}
			if err := tx.Bucket(bucketRaftState).Put(keyHardState, b); err != nil {
				return err
			}
		}
		m := tx.Bucket(bucketMeta)
		if err := m.Put(keyFormat, u64(FormatVersion)); err != nil {
			return err
		}
		if err := m.Put(keyWAL, u64(id)); err != nil {
			return err
		}
		if fn != nil {
			return fn(tx)
		}
		return nil
	})
	if err != nil {
		return err
	}
	if db.syncDelay > 0 {
		time.Sleep(2 * db.syncDelay) // bbolt's two fdatasyncs, on slow flash
	}
	db.wal.id, db.wal.off = id, 0
	db.mu.Lock()
	db.boltLast, db.pendBytes = max(db.boltLast, last), 0
	db.format, db.walID = FormatVersion, id
	db.mu.Unlock()
	db.syncs.Add(2)
	db.committed()
	if db.onCommit != nil {
		db.onCommit(time.Since(built), entries+len(pend))
	}
	db.stageMu.Lock()
	for _, op := range taken {
		if cur, ok := db.staged[op.k]; ok && cur.gen == op.gen {
			delete(db.staged, op.k)
		}
	}
	// Fresh writes staged before the transaction took the stage are in
	// the file now; those staged since still need a frame.
	n := 0
	for n < len(db.fresh) && db.fresh[n].gen <= maxGen {
		n++
	}
	db.fresh = append(db.fresh[:0], db.fresh[n:]...)
	db.stageMu.Unlock()
	return nil
}

// putEntries writes ents to the log bucket, all values in one buffer: the
// one reused from checkpoint to checkpoint (bbolt holds the slices only
// until the commit) when reuse, else a new one.
func (db *DB) putEntries(tx *bolt.Tx, ents []pb.Entry, reuse bool) error {
	if len(ents) == 0 {
		return nil
	}
	size := 0
	for i := range ents {
		size += 8 + entrySize(&ents[i])
	}
	var buf []byte
	if reuse {
		if cap(db.entBuf) < size {
			db.entBuf = make([]byte, size)
		}
		buf = db.entBuf[:size]
	} else {
		buf = make([]byte, size)
	}
	lb := tx.Bucket(bucketLog)
	lb.FillPercent = 1.0 // appends are sequential: full pages halve growth
	off := 0
	for i := range ents {
		k := buf[off : off+8]
		binary.BigEndian.PutUint64(k, ents[i].Index)
		n := entrySize(&ents[i])
		v := buf[off+8 : off+8+n]
		putEntry(v, &ents[i])
		off += 8 + n
		if err := lb.Put(k, v); err != nil {
			return err
		}
	}
	return nil
}

// Pending reports whether staged metadata waits for a durable write.
func (db *DB) Pending() bool {
	db.stageMu.Lock()
	defer db.stageMu.Unlock()
	return len(db.fresh) > 0
}

// Flush makes staged metadata durable now (a WAL frame of its own).
func (db *DB) Flush() error {
	db.mu.RLock()
	closed := db.closed
	db.mu.RUnlock()
	if closed {
		return ErrClosed
	}
	if !db.Pending() {
		return nil
	}
	if err := db.flushStaged(); err != nil {
		return fmt.Errorf("storage: flush: %w", err)
	}
	return nil
}

// Sync makes everything staged so far durable before it returns, even what
// a Save in progress has already taken: Sync waits for that Save.
func (db *DB) Sync() error {
	db.mu.RLock()
	closed := db.closed
	db.mu.RUnlock()
	if closed {
		return ErrClosed
	}
	if err := db.flushStaged(); err != nil {
		return fmt.Errorf("storage: sync: %w", err)
	}
	return nil
}

// flushStaged writes the fresh staged operations in a WAL frame.
func (db *DB) flushStaged() error {
	db.wmu.Lock()
	defer db.wmu.Unlock()
	return db.appendLocked(nil, nil)
}

// ForEach calls fn for every key in bucket with the given prefix, in key
// order, staged writes included. k and v are only valid during the call.
func (db *DB) ForEach(bucket, prefix string, fn func(k, v []byte) error) error {
	var over []stagedOp
	db.stageMu.Lock()
	for _, op := range db.staged {
		if op.bucket == bucket && strings.HasPrefix(op.key, prefix) {
			over = append(over, op)
		}
	}
	db.stageMu.Unlock()
	slices.SortFunc(over, func(a, b stagedOp) int { return strings.Compare(a.key, b.key) })
	emit := func(op stagedOp) error {
		if op.val == nil {
			return nil
		}
		return fn([]byte(op.key), op.val)
	}
	return db.bolt.View(func(tx *bolt.Tx) error {
		b := tx.Bucket([]byte(bucket))
		if b != nil {
			c := b.Cursor()
			p := []byte(prefix)
			for k, v := c.Seek(p); k != nil && bytes.HasPrefix(k, p); k, v = c.Next() {
				for len(over) > 0 && over[0].key < string(k) {
					if err := emit(over[0]); err != nil {
						return err
					}
					over = over[1:]
				}
				if len(over) > 0 && over[0].key == string(k) {
					if err := emit(over[0]); err != nil {
						return err
					}
					over = over[1:]
					continue
				}
				if err := fn(k, v); err != nil {
					return err
				}
			}
		}
		for _, op := range over {
			if err := emit(op); err != nil {
				return err
			}
		}
		return nil
	})
}

// stagedValue returns the staged write of bucket/key, if there is one.
func (db *DB) stagedValue(bucket, key string) (stagedOp, bool) {
	db.stageMu.Lock()
	defer db.stageMu.Unlock()
	op, ok := db.staged[bucket+"\x00"+key]
	return op, ok
}

// NodeID returns the node id recorded in the file, 0 if none yet.
func (db *DB) NodeID() uint64 {
	db.mu.RLock()
	defer db.mu.RUnlock()
	return db.nodeID
}

// SetNodeID records the node id the file belongs to, durably. A data dir is
// bound to one identity: replication refuses a file of another node.
func (db *DB) SetNodeID(id uint64) error {
	if db.ro {
		return fmt.Errorf("storage: set node id on a read-only file")
	}
	err := db.commit(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketMeta).Put(keyNodeID, u64(id))
	})
	if err != nil {
		return fmt.Errorf("storage: set node id: %w", err)
	}
	db.mu.Lock()
	db.nodeID = id
	db.mu.Unlock()
	return nil
}

// Scan calls fn for each entry with index >= from, in order, until fn
// returns false or the log ends. Entries are decoded and CRC-checked; fn may
// keep them.
func (db *DB) Scan(from uint64, fn func(e pb.Entry) bool) error {
	boltLast, pend := db.pending()
	more := true
	err := db.bolt.View(func(tx *bolt.Tx) error {
		c := tx.Bucket(bucketLog).Cursor()
		for k, v := c.Seek(u64(from)); k != nil; k, v = c.Next() {
			i := binary.BigEndian.Uint64(k)
			if i > boltLast {
				break // a checkpoint since pending(): the copy has it
			}
			e, err := decodeEntry(i, v)
			if err != nil {
				return err
			}
			if more = fn(e); !more {
				return nil
			}
		}
		return nil
	})
	for i := 0; err == nil && more && i < len(pend); i++ {
		if pend[i].Index >= from {
			more = fn(pend[i])
		}
	}
	return err
}

// pending returns the last index in the log bucket and a copy of the
// entries past it, which only the WAL and the tail hold.
func (db *DB) pending() (uint64, []pb.Entry) {
	db.mu.RLock()
	defer db.mu.RUnlock()
	if db.last <= db.boltLast {
		return db.boltLast, nil
	}
	return db.boltLast, append([]pb.Entry(nil), db.tail[db.boltLast+1-db.tail[0].Index:]...)
}

// Stats is a snapshot of the file's size and the log's bounds.
type Stats struct {
	FirstIndex, LastIndex, Commit, Applied uint64
	FileBytes                              int64
}

// Stats returns the log bounds and the file size.
func (db *DB) Stats() Stats {
	db.mu.RLock()
	s := Stats{FirstIndex: db.first, LastIndex: db.last, Commit: db.hs.Commit, Applied: db.applied}
	db.mu.RUnlock()
	if fi, err := os.Stat(db.path); err == nil {
		s.FileBytes = fi.Size()
	}
	return s
}

// NextEpoch increments and returns the node's start counter, durably. Record
// sequence numbers start at epoch<<32, so they never repeat across restarts
// even on a gateway whose clock starts in 1970.
func (db *DB) NextEpoch() (uint64, error) {
	var epoch uint64
	err := db.commit(func(tx *bolt.Tx) error {
		m := tx.Bucket(bucketMeta)
		if v := m.Get(keyEpoch); len(v) == 8 {
			epoch = binary.BigEndian.Uint64(v)
		}
		epoch++
		return m.Put(keyEpoch, u64(epoch))
	})
	if err != nil {
		return 0, fmt.Errorf("storage: next epoch: %w", err)
	}
	return epoch, nil
}

// GetMeta returns a copy of the metadata value of key, nil if unset.
func (db *DB) GetMeta(key string) ([]byte, error) {
	if op, ok := db.stagedValue(string(bucketMeta), key); ok {
		return append([]byte(nil), op.val...), nil
	}
	var out []byte
	err := db.bolt.View(func(tx *bolt.Tx) error {
		if v := tx.Bucket(bucketMeta).Get([]byte(key)); v != nil {
			out = append([]byte{}, v...)
		}
		return nil
	})
	return out, err
}

// PutMeta sets the metadata value of key, durably, before it returns.
func (db *DB) PutMeta(key string, val []byte) error {
	err := db.commit(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketMeta).Put([]byte(key), val)
	})
	if err != nil {
		return fmt.Errorf("storage: %s: %w", key, err)
	}
	return nil
}

// DataRecords counts the data entries (records) in the log.
func (db *DB) DataRecords() (int, error) {
	boltLast, pend := db.pending()
	n := 0
	err := db.bolt.View(func(tx *bolt.Tx) error {
		c := tx.Bucket(bucketLog).Cursor()
		for k, v := c.First(); k != nil && binary.BigEndian.Uint64(k) <= boltLast; k, v = c.Next() {
			if len(v) > entryHdr && pb.EntryType(v[12]) == pb.EntryNormal {
				n++
			}
		}
		return nil
	})
	for i := range pend {
		if pend[i].Type == pb.EntryNormal && len(pend[i].Data) > 0 {
			n++
		}
	}
	return n, err
}

// ResetRaft wipes the raft state (log, hard and conf state, applied index,
// members) so the node can join another cluster. With requeue its records
// move to the requeue bucket first, to be re-published into that cluster;
// without, they are discarded. No Node may run on db meanwhile.
func (db *DB) ResetRaft(requeue bool) error {
	var from uint64
	if requeue {
		from = 1
	}
	return db.ResetRaftFrom(from)
}

// ResetRaftFrom is ResetRaft that requeues the data entries from index
// from on (none when from is 0): how a deposed master keeps what it logged
// after the point where the promoted slave's log forked from its own.
func (db *DB) ResetRaftFrom(from uint64) error {
	requeue := from > 0
	err := db.commit(func(tx *bolt.Tx) error {
		lb := tx.Bucket(bucketLog)
		var last uint64
		if k, _ := lb.Cursor().Last(); len(k) == 8 {
			last = binary.BigEndian.Uint64(k)
		}
		if requeue && last >= from {
			if err := requeueFrom(tx, lb, from, last); err != nil {
				return err
			}
		}
		for _, b := range [][]byte{bucketLog, []byte(BucketMembers)} {
			if tx.Bucket(b) != nil {
				if err := tx.DeleteBucket(b); err != nil {
					return err
				}
			}
			if _, err := tx.CreateBucket(b); err != nil {
				return err
			}
		}
		rs := tx.Bucket(bucketRaftState)
		for _, k := range [][]byte{keyHardState, keyConfState, keySnapMeta} {
			if err := rs.Delete(k); err != nil {
				return err
			}
		}
		return tx.Bucket(bucketMeta).Delete(keyApplied)
	})
	if err != nil {
		return fmt.Errorf("storage: reset: %w", err)
	}
	db.mu.Lock()
	db.hs, db.cs = pb.HardState{}, pb.ConfState{}
	db.snapIndex, db.snapTerm, db.applied = 0, 0, 0
	db.first, db.last, db.boltLast = 1, 0, 0
	db.tail, db.tailBytes = nil, 0
	db.mu.Unlock()
	if requeue {
		db.requeued.Store(true)
	}
	return nil
}
