package storage

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"os"
	"slices"
	"strings"

	bolt "go.etcd.io/bbolt"
	pb "go.etcd.io/raft/v3/raftpb"
)

// stage queues a metadata write for the next WAL frame. A key bbolt cannot
// store (an MQTT client id or topic may be 64 KiB long) is refused here, with
// an error in the log: written, it would make every checkpoint fail.
func (db *DB) stage(bucket, key string, val []byte) {
	if len(bucket) == 0 || len(bucket) > 255 || len(key) == 0 || len(key) > bolt.MaxKeySize {
		db.log.Error("metadata not persisted: its key or bucket is empty or too long for the data file", "bucket", bucket, "key_bytes", len(key))
		return
	}
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

// Pending reports whether staged metadata waits for a durable write.
func (db *DB) Pending() bool {
	db.stageMu.Lock()
	defer db.stageMu.Unlock()
	return len(db.fresh) > 0
}

// Flush makes staged metadata durable now (a WAL frame of its own); under
// flush: interval, at the flusher's next fdatasync, as entries are.
func (db *DB) Flush() error { return db.flushStaged("flush", true) }

// Sync makes everything staged so far durable before it returns, under
// flush: interval too. It is Flush: a staged write leaves the fresh list
// only once a written frame or a committed checkpoint holds it, so what a
// Save in progress has taken is still fresh, and Sync waits for that Save's
// frame. Under flush: interval it also syncs the frames written before.
func (db *DB) Sync() error {
	if err := db.flushStaged("sync", false); err != nil {
		return err
	}
	if db.flushEvery > 0 {
		// What earlier lazy frames hold (a Save's records the staged
		// state may refer to) must be as durable as the frame above.
		if err := db.syncWAL(); err != nil {
			return fmt.Errorf("storage: sync: %w", err)
		}
	}
	return nil
}

// flushStaged writes the fresh staged operations in a WAL frame; op names
// the caller in errors.
func (db *DB) flushStaged(op string, lazy bool) error {
	db.mu.RLock()
	closed := db.closed
	db.mu.RUnlock()
	switch {
	case closed:
		return ErrClosed
	case !db.Pending():
		return nil
	case db.ro:
		return fmt.Errorf("storage: %s: write to a read-only file", op)
	}
	if err := db.catchUp(); err != nil {
		return fmt.Errorf("storage: %s: %w", op, err)
	}
	db.wmu.Lock()
	defer db.wmu.Unlock()
	if err := db.appendLocked(nil, nil, lazy); err != nil {
		return fmt.Errorf("storage: %s: %w", op, err)
	}
	db.kickCheckpoint()
	return nil
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
				staged := false // a staged write of k replaces the file's
				for len(over) > 0 && over[0].key <= string(k) {
					staged = over[0].key == string(k)
					if err := emit(over[0]); err != nil {
						return err
					}
					over = over[1:]
				}
				if !staged {
					if err := fn(k, v); err != nil {
						return err
					}
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
// keep them. Below the first index it reads the records pulled from before
// an installed snapshot (backfill.go), if any; entries retention has
// dropped are not shown.
//
// It reads the file in chunks (scanChunkMin growing to scanChunkMax bytes
// of entries), each in a read transaction of its own that ends before fn
// sees the chunk: a reader pins every page that was in the file when it
// began (bbolt reuses none of them until it ends), so one transaction
// across a whole scan, or across a slow fn, let the file grow by whatever
// retention freed meanwhile, up to the whole log past the budget. Between
// two chunks retention may drop the oldest entries: the scan then goes on
// at the new first index, and the indexes fn is given show the gap.
func (db *DB) Scan(from uint64, fn func(e pb.Entry) bool) error {
	boltLast, pend := db.pending()
	var batch []pb.Entry
	for limit := scanChunkMin; from <= boltLast; limit = min(2*limit, scanChunkMax) {
		first, _ := db.FirstIndex()
		batch = batch[:0]
		size, full := 0, false
		collect := func(e pb.Entry) bool {
			batch = append(batch, e)
			size += len(e.Data)
			full = size >= limit
			return !full
		}
		err := db.bolt.View(func(tx *bolt.Tx) error {
			at := from
			if at < first {
				// Records before an installed snapshot, pulled since.
				more, err := scanBackfill(tx, at, first, collect)
				if err != nil || !more {
					return err
				}
				at = first
			}
			return eachEntry(tx.Bucket(bucketLog), at, func(i uint64, v []byte) (bool, error) {
				if i > boltLast {
					return false, nil // a checkpoint since pending(): the copy has it
				}
				e, err := decodeEntry(i, v)
				if err != nil {
					return false, err
				}
				return collect(e), nil
			})
		})
		for i := range batch {
			if !fn(batch[i]) {
				return nil
			}
		}
		if err != nil {
			return err // after the entries before the damage
		}
		if !full {
			break // the file has no more up to boltLast
		}
		from = batch[len(batch)-1].Index + 1
	}
	if db.chain {
		return db.scanChain(max(from, boltLast+1), fn)
	}
	// The copy of what the checkpoint has not moved yet may hold records
	// retention dropped meanwhile: none before the first index is shown.
	first, _ := db.FirstIndex()
	from = max(from, first)
	for i := range pend {
		if pend[i].Index >= from && !fn(pend[i]) {
			return nil
		}
	}
	return nil
}

// scanChunkMin and scanChunkMax bound the bytes of entries Scan reads in
// one read transaction: small at first, for the callers that stop after a
// few records (a session's replay batch), larger for long scans.
const (
	scanChunkMin = 64 << 10
	scanChunkMax = 1 << 20
)

// pending returns the last index in the log bucket and a copy of the
// entries past it, which only the WAL and the tail hold.
func (db *DB) pending() (uint64, []pb.Entry) {
	db.mu.RLock()
	defer db.mu.RUnlock()
	if db.last <= db.boltLast || db.chain {
		return db.boltLast, nil // in format 6, Scan reads the rest itself
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

// DataRecords counts the data entries (records) in the log, less the
// feature level's: a lone gateway logs its own at first start, which is
// no data of anyone's (a join resets the level with the raft state).
func (db *DB) DataRecords() (int, error) {
	boltLast, pend := db.pending()
	n := 0
	err := db.bolt.View(func(tx *bolt.Tx) error {
		return eachEntry(tx.Bucket(bucketLog), 0, func(i uint64, v []byte) (bool, error) {
			if i > boltLast {
				return false, nil
			}
			if len(v) > entryHdr && pb.EntryType(v[12]) == pb.EntryNormal && !isFeatureRecord(v[entryHdr:]) {
				n++
			}
			return true, nil
		})
	})
	count := func(e pb.Entry) bool {
		if e.Type == pb.EntryNormal && len(e.Data) > 0 && !isFeatureRecord(e.Data) {
			n++
		}
		return true
	}
	for i := range pend {
		count(pend[i])
	}
	if db.chain && err == nil {
		err = db.scanChain(boltLast+1, count)
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
	var chainNext, chainID uint64
	err := db.commitSync(0, func(tx *bolt.Tx) error {
		lb := tx.Bucket(bucketLog)
		if requeue {
			if err := requeueFrom(tx, lb, from, 0); err != nil {
				return err
			}
			if db.chain {
				if err := db.chainRequeueTx(tx, from, 0); err != nil {
					return err
				}
			}
		}
		if db.chain {
			var err error
			if chainNext, chainID, err = db.restartChainLocked(tx); err != nil {
				return err
			}
		}
		if err := startBackfill(tx, 0); err != nil {
			return err
		}
		// A snapshot being received was of the cluster this node leaves.
		if err := db.dropStagingIn(tx); err != nil {
			return err
		}
		for _, b := range [][]byte{bucketLog, []byte(BucketMembers), []byte(BucketFeature)} {
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
		m := tx.Bucket(bucketMeta)
		if err := m.Delete(keyApplied); err != nil {
			return err
		}
		// The terms start again with the raft state: a term this node led
		// before means nothing in the log it joins (ApplySnapshot).
		return m.Delete(keyLed)
	}, func() {
		db.mu.Lock()
		db.hs, db.cs = pb.HardState{}, pb.ConfState{}
		db.snapIndex, db.snapTerm, db.applied = 0, 0, 0
		db.first, db.last, db.boltLast = 1, 0, 0
		db.tail, db.tailArr, db.tailBytes = nil, nil, 0
		db.mu.Unlock()
		db.oldest.Store(0)
		db.blockedAt.Store(0)
		db.forgetBuilt()
		if db.chain {
			db.finishRestartLocked(chainNext, chainID)
		}
	})
	if err != nil {
		return fmt.Errorf("storage: reset: %w", err)
	}
	if requeue {
		db.requeued.Store(true)
	}
	return nil
}
