package storage

import (
	"encoding/binary"
	"fmt"

	bolt "go.etcd.io/bbolt"
	pb "go.etcd.io/raft/v3/raftpb"
)

// Backfill: the records before an installed snapshot.
//
// A member that installed a snapshot at index X has the broker state at X
// but none of the records before it; the master may still hold some of
// them (from its first index on), and the sessions' cursors point into
// them. The replication layer pulls them, newest first, in chunks that end
// where the last one began (BackfillWanted, PutBackfill), into the backfill
// bucket, one entry per 8-byte key: what it holds always runs without a
// gap up to the log's first index, so Scan reads it as the log's past and
// a session replaying from before X finds them, the most recent first.
// Raft never sees them (FirstIndex stays X+1), and they are not applied:
// the snapshot's state includes them. Retention drops them first, being
// the oldest records, and that ends the pull: older ones would only go
// again.
//
// Progress is kept in the meta bucket with each chunk (backfill_below: the
// oldest index held, X+1 at first): a restart resumes there. It goes once
// the pull reaches the master's first index.

var (
	bucketBackfill   = []byte("backfill")
	keyBackfillBelow = []byte("backfill_below")
)

// BackfillWanted reports whether records before the installed snapshot
// are wanted, and below which index: the records before below.
func (db *DB) BackfillWanted() (below uint64, ok bool) {
	err := db.bolt.View(func(tx *bolt.Tx) error {
		below = metaU64(tx, bucketMeta, keyBackfillBelow)
		return nil
	})
	return below, err == nil && below > 1
}

// PutBackfill stores ents, the records that end just before the oldest one
// held (BackfillWanted), in index order; done says no older ones are to
// come (the master holds none).
func (db *DB) PutBackfill(ents []pb.Entry, done bool) error {
	if db.ro {
		return fmt.Errorf("storage: backfill on a read-only file")
	}
	err := db.commit(func(tx *bolt.Tx) error {
		below := metaU64(tx, bucketMeta, keyBackfillBelow)
		if below == 0 {
			return nil // a newer snapshot, a reset or retention since the request
		}
		m := tx.Bucket(bucketMeta)
		if k := len(ents); k > 0 {
			if ents[k-1].Index != below-1 {
				return fmt.Errorf("records %d..%d do not end before %d", ents[0].Index, ents[k-1].Index, below)
			}
			b, err := tx.CreateBucketIfNotExists(bucketBackfill)
			if err != nil {
				return err
			}
			for i := range ents {
				v := make([]byte, entrySize(&ents[i]))
				putEntry(v, &ents[i])
				if err := b.Put(u64(ents[i].Index), v); err != nil {
					return err
				}
			}
			below = ents[0].Index
		}
		if done || below <= 1 {
			return m.Delete(keyBackfillBelow)
		}
		return m.Put(keyBackfillBelow, u64(below))
	})
	if err != nil {
		return fmt.Errorf("storage: backfill: %w", err)
	}
	return nil
}

// OldestIndex is the index of the oldest record this member holds: the
// oldest one pulled from before an installed snapshot, else the first
// index.
func (db *DB) OldestIndex() uint64 {
	first, _ := db.FirstIndex()
	_ = db.bolt.View(func(tx *bolt.Tx) error {
		if b := tx.Bucket(bucketBackfill); b != nil {
			if k, _ := b.Cursor().First(); len(k) == 8 {
				first = min(first, binary.BigEndian.Uint64(k))
			}
		}
		return nil
	})
	return first
}

// scanBackfill calls fn for the backfilled entries from index from on,
// below first, in order; more is false when fn stopped.
func scanBackfill(tx *bolt.Tx, from, first uint64, fn func(e pb.Entry) bool) (more bool, err error) {
	b := tx.Bucket(bucketBackfill)
	if b == nil {
		return true, nil
	}
	c := b.Cursor()
	for k, v := c.Seek(u64(from)); k != nil; k, v = c.Next() {
		if len(k) != 8 {
			return false, fmt.Errorf("backfill key %x: %w", k, ErrCorrupt)
		}
		idx := binary.BigEndian.Uint64(k)
		if idx >= first {
			break
		}
		e, err := decodeEntry(idx, v)
		if err != nil {
			return false, err
		}
		if !fn(e) {
			return false, nil
		}
	}
	return true, nil
}

// startBackfill records, in an install's transaction, that the records
// before index+1 are wanted (none when index is 0), and drops what an
// earlier backfill held.
func startBackfill(tx *bolt.Tx, index uint64) error {
	if tx.Bucket(bucketBackfill) != nil {
		if err := tx.DeleteBucket(bucketBackfill); err != nil {
			return err
		}
	}
	m := tx.Bucket(bucketMeta)
	if index == 0 {
		return m.Delete(keyBackfillBelow)
	}
	return m.Put(keyBackfillBelow, u64(index+1))
}

// dropBackfill deletes backfilled entries, oldest first, until the bytes
// freed pass want, and returns how many it freed. Once retention takes any,
// the backfill stops: what it would pull next would only go again.
func dropBackfill(tx *bolt.Tx, want int64) (int64, error) {
	b := tx.Bucket(bucketBackfill)
	if b == nil || want <= 0 {
		return 0, nil
	}
	var gone [][]byte
	var freed int64
	c := b.Cursor()
	for k, v := c.First(); k != nil && freed < want; k, v = c.Next() {
		freed += int64(len(k) + len(v))
		gone = append(gone, k)
	}
	for _, k := range gone {
		if err := b.Delete(k); err != nil {
			return freed, err
		}
	}
	if len(gone) > 0 {
		if err := tx.Bucket(bucketMeta).Delete(keyBackfillBelow); err != nil {
			return freed, err
		}
	}
	return freed, nil
}
