package storage

import (
	"encoding/binary"
	"fmt"
	"os"
	"time"

	bolt "go.etcd.io/bbolt"
	pb "go.etcd.io/raft/v3/raftpb"
)

// stage queues a metadata write for the next transaction.
func (db *DB) stage(bucket, key string, val []byte) {
	db.stageMu.Lock()
	db.stageGen++
	k := bucket + "\x00" + key
	db.staged[k] = stagedOp{k: k, bucket: bucket, key: key, val: val, gen: db.stageGen}
	db.stageMu.Unlock()
}

// Stage queues key=val in bucket (BucketSessions) for the next transaction:
// it becomes durable no later than any entry saved after Stage returns.
// val must not be modified afterwards.
func (db *DB) Stage(bucket, key string, val []byte) {
	if val == nil {
		val = []byte{}
	}
	db.stage(bucket, key, val)
}

// StageDelete queues the deletion of key in bucket, like Stage.
func (db *DB) StageDelete(bucket, key string) { db.stage(bucket, key, nil) }

// commit runs fn and the staged operations in one write transaction.
// Taking them inside the transaction (under bbolt's writer lock) keeps the
// order: what was staged before an entry was proposed commits with it or
// before it. They leave the stage only once the commit succeeded, so a
// failed commit (a full disk) loses none of them.
func (db *DB) commit(fn func(tx *bolt.Tx) error) error { return db.commitEntries(0, fn) }

// commitEntries is commit for a transaction that appends entries log
// entries, the batch size Options.OnCommit reports.
func (db *DB) commitEntries(entries int, fn func(tx *bolt.Tx) error) error {
	var taken []stagedOp
	var built time.Time // when fn is done and bbolt starts writing and syncing
	err := db.bolt.Update(func(tx *bolt.Tx) error {
		defer func() { built = time.Now() }()
		db.prefill(tx) // a read-only file never gets here: bbolt refuses Update
		// Copied into a slice kept from commit to commit (bbolt runs one
		// at a time), not a cloned map: a clone is as large as the map
		// ever grew, at every commit.
		db.stageMu.Lock()
		taken = db.takeBuf[:0]
		for _, op := range db.staged {
			taken = append(taken, op)
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
		if fn != nil {
			// After the staged operations: a full hard state passed to Save
			// supersedes a staged commit-only one.
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
	if db.commits.Add(1)%releaseEvery == 0 {
		db.releaseMapped()
	}
	if db.onCommit != nil {
		db.onCommit(time.Since(built), entries)
	}
	db.stageMu.Lock()
	for _, op := range taken {
		if cur, ok := db.staged[op.k]; ok && cur.gen == op.gen {
			delete(db.staged, op.k)
		}
	}
	db.stageMu.Unlock()
	return nil
}

// Pending reports whether staged metadata waits for a transaction.
func (db *DB) Pending() bool {
	db.stageMu.Lock()
	defer db.stageMu.Unlock()
	return len(db.staged) > 0
}

// Flush commits staged metadata now.
func (db *DB) Flush() error {
	db.mu.RLock()
	closed := db.closed
	db.mu.RUnlock()
	if closed {
		return ErrClosed
	}
	return db.flush()
}

// Sync makes everything staged so far durable before it returns, even what
// a transaction in progress has already taken: bbolt runs this one after it.
func (db *DB) Sync() error {
	db.mu.RLock()
	closed := db.closed
	db.mu.RUnlock()
	if closed {
		return ErrClosed
	}
	if err := db.commit(nil); err != nil {
		return fmt.Errorf("storage: sync: %w", err)
	}
	return nil
}

func (db *DB) flush() error {
	if !db.Pending() {
		return nil
	}
	if err := db.commit(nil); err != nil {
		return fmt.Errorf("storage: flush: %w", err)
	}
	return nil
}

// ForEach calls fn for every key in bucket with the given prefix, in key
// order. k and v are only valid during the call.
func (db *DB) ForEach(bucket, prefix string, fn func(k, v []byte) error) error {
	return db.bolt.View(func(tx *bolt.Tx) error {
		b := tx.Bucket([]byte(bucket))
		if b == nil {
			return nil
		}
		c := b.Cursor()
		p := []byte(prefix)
		for k, v := c.Seek(p); k != nil && len(k) >= len(p) && string(k[:len(p)]) == prefix; k, v = c.Next() {
			if err := fn(k, v); err != nil {
				return err
			}
		}
		return nil
	})
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
	err := db.bolt.Update(func(tx *bolt.Tx) error {
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
	return db.bolt.View(func(tx *bolt.Tx) error {
		c := tx.Bucket(bucketLog).Cursor()
		for k, v := c.Seek(u64(from)); k != nil; k, v = c.Next() {
			e, err := decodeEntry(binary.BigEndian.Uint64(k), v)
			if err != nil {
				return err
			}
			if !fn(e) {
				return nil
			}
		}
		return nil
	})
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
	err := db.bolt.Update(func(tx *bolt.Tx) error {
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
	err := db.bolt.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketMeta).Put([]byte(key), val)
	})
	if err != nil {
		return fmt.Errorf("storage: %s: %w", key, err)
	}
	db.commits.Add(1)
	return nil
}

// DataRecords counts the data entries (records) in the log.
func (db *DB) DataRecords() (int, error) {
	n := 0
	err := db.bolt.View(func(tx *bolt.Tx) error {
		c := tx.Bucket(bucketLog).Cursor()
		for _, v := c.First(); v != nil; _, v = c.Next() {
			if len(v) > entryHdr && pb.EntryType(v[12]) == pb.EntryNormal {
				n++
			}
		}
		return nil
	})
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
	db.first, db.last = 1, 0
	db.tail, db.tailBytes = nil, 0
	db.mu.Unlock()
	if requeue {
		db.requeued.Store(true)
	}
	return nil
}
