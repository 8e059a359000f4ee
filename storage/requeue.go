package storage

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"fmt"

	bolt "go.etcd.io/bbolt"
)

// Requeued is a data entry that a conflicting append overwrote: a deposed
// master's tail, which it may have acked as async. Replication proposes it
// again to the current master and drops it once that is done.
type Requeued struct {
	Key   string // its key in the requeue bucket
	Index uint64 // where it was in the overwritten log
	Term  uint64
	Data  []byte // the record
}

// Requeued returns up to limit requeued entries, oldest index first.
func (db *DB) Requeued(limit int) ([]Requeued, error) {
	dropped := db.droppedRequeued()
	var out []Requeued
	err := db.bolt.View(func(tx *bolt.Tx) error {
		c := tx.Bucket(bucketRequeue).Cursor()
		for k, v := c.First(); k != nil && len(out) < limit; k, v = c.Next() {
			if len(k) != 16 {
				return fmt.Errorf("requeue key of %d bytes: %w", len(k), ErrCorrupt)
			}
			if dropped[string(k)] {
				continue
			}
			idx := binary.BigEndian.Uint64(k)
			e, err := decodeEntry(idx, v)
			if err != nil {
				return err
			}
			out = append(out, Requeued{Key: string(k), Index: idx, Term: e.Term, Data: e.Data})
		}
		return nil
	})
	return out, err
}

// RequeuedIDs calls fn with the record id of each requeued entry not yet
// dropped, oldest index first. Unlike Requeued it copies no record: it
// reads chunk entries per read transaction and keeps only their ids until
// fn has seen them, outside the transaction. A deposed master's requeue
// bucket can hold a log budget's worth of records, and whoever answers
// the publishers waiting for them needs their ids alone. An entry that
// fails its check is passed over and the first such error returned at
// the end; one whose data is no record (a conf change, an empty entry) is
// passed over.
func (db *DB) RequeuedIDs(chunk int, fn func(origin, seq uint64)) error {
	chunk = max(chunk, 1)
	dropped := db.droppedRequeued()
	type recID struct{ origin, seq uint64 }
	ids := make([]recID, 0, chunk)
	var after []byte // the last key read: the next chunk starts past it
	var bad error
	for {
		ids = ids[:0]
		more := false
		err := db.bolt.View(func(tx *bolt.Tx) error {
			c := tx.Bucket(bucketRequeue).Cursor()
			k, v := c.First()
			if after != nil {
				if k, v = c.Seek(after); k != nil && bytes.Equal(k, after) {
					k, v = c.Next()
				}
			}
			for read := 0; k != nil; k, v = c.Next() {
				if read == chunk {
					more = true
					return nil
				}
				read++
				if len(k) != 16 {
					return fmt.Errorf("requeue key of %d bytes: %w", len(k), ErrCorrupt)
				}
				after = append(after[:0], k...)
				if dropped[string(k)] {
					continue
				}
				if _, err := checkEntry(binary.BigEndian.Uint64(k), v); err != nil {
					bad = cmp.Or(bad, err)
					continue
				}
				if origin, seq, err := RecordID(v[entryHdr:]); err == nil {
					ids = append(ids, recID{origin, seq})
				}
			}
			return nil
		})
		for _, id := range ids {
			fn(id.origin, id.seq)
		}
		if err != nil {
			return err
		}
		if !more {
			return bad
		}
	}
}

// RequeuePending counts the requeued entries not yet re-published, for
// status and metrics: without reading them, as Requeued does.
func (db *DB) RequeuePending() (int, error) {
	n := 0
	err := db.bolt.View(func(tx *bolt.Tx) error {
		n = tx.Bucket(bucketRequeue).Stats().KeyN
		return nil
	})
	return max(0, n-len(db.droppedRequeued())), err
}

// droppedRequeued returns the keys whose removal from the requeue bucket
// is staged but not yet in the file.
func (db *DB) droppedRequeued() map[string]bool {
	db.stageMu.Lock()
	defer db.stageMu.Unlock()
	var out map[string]bool
	for _, op := range db.staged {
		if op.bucket == string(bucketRequeue) && op.val == nil {
			if out == nil {
				out = map[string]bool{}
			}
			out[op.key] = true
		}
	}
	return out
}

// DropRequeued removes a requeued entry, with the next transaction.
func (db *DB) DropRequeued(key string) { db.stage(string(bucketRequeue), key, nil) }

// TakeRequeueSignal reports whether entries were requeued since the last
// call.
func (db *DB) TakeRequeueSignal() bool { return db.requeued.Swap(false) }
