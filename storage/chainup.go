package storage

import (
	"bytes"
	"cmp"
	"fmt"
	"os"
	"path/filepath"
	"time"

	bolt "go.etcd.io/bbolt"
	pb "go.etcd.io/raft/v3/raftpb"
)

// upgradeName is the data file an upgrade to format 6 writes, renamed
// over FileName once whole.
const upgradeName = FileName + ".upgrade"

// upgradeFrame is the size of the frames an upgrade writes the log in:
// four to a segment, one fdatasync each.
const upgradeFrame = 256 << 10

// upgradeTxMax bounds what one transaction of the upgrade's copy of the
// data file holds in memory.
const upgradeTxMax = 16 << 20

// upgradeToChain makes a data dir of format 3 to 5 one of format 6, in
// place, at a read-write Open that has moved what the WAL held into the
// file (checkpointReplayed) and started no goroutine yet. It writes the
// log's entries from the file's runs into a chain of segments, and
// everything else of the file into a new file (upgradeName) without the
// runs, which names the chain and says format 6. The caller closes the
// DB, and finishUpgrade renames the new file over the old one: the data
// dir is in format 6 from that rename on, and in its old format, whole,
// before it. Why not keep the runs and drop them first: bbolt does not
// give a file's freed pages back, so the log's old bytes would stay in the
// data file beside the segments, twice the budget.
//
// It returns whether the upgrade was written. One that cannot be (the
// filesystem lacks the room for a copy of the log, a write fails) is
// undone and logged, and the data dir runs in its own format until the
// next start tries again.
func (db *DB) upgradeToChain(timeout time.Duration) (bool, error) {
	dir := filepath.Dir(db.path)
	removeUpgradeLeftovers(dir)
	fi, err := os.Stat(db.path)
	if err != nil {
		return false, fmt.Errorf("storage: %w", err)
	}
	// The segments take about what the runs take, the new file what the
	// rest does: the old file's size bounds both.
	need := fi.Size() + 4*walPrealloc
	if db.space.statfs != nil {
		// The room is needed for the while of the upgrade only: the
		// old file goes at its end, so MinFree's margin may be used.
		if free, _, err := db.space.statfs(dir); err == nil && free < need {
			db.log.Warn("data dir not upgraded to format 6: the filesystem lacks the room for a copy of the log; it runs in its format and tries again at the next start",
				"free", free, "needed", need)
			return false, nil
		}
	}
	head, last, end, err := db.writeChainFromRuns(dir)
	if err == nil {
		err = db.copyWithoutRuns(filepath.Join(dir, upgradeName), timeout, upgradeTxMax, func(m *bolt.Bucket) error {
			if err := m.Put(keySegHead, segHeadValue(firstSegment, head)); err != nil {
				return err
			}
			if err := m.Put(keyWAL, walValue(last.id, last.seq, end)); err != nil {
				return err
			}
			// A clean Close of format 6 puts back no older format.
			if err := m.Delete(keyFormatRest); err != nil {
				return err
			}
			return m.Put(keyFormat, u64(formatChain))
		})
	}
	if err != nil {
		removeUpgradeLeftovers(dir)
		db.log.Warn("data dir not upgraded to format 6; it runs in its format and tries again at the next start", "err", err)
		return false, nil
	}
	return true, nil
}

// segRef names a segment: its seq and id.
type segRef struct{ seq, id uint64 }

// writeChainFromRuns writes the file's log into a new chain of segments
// from firstSegment on, synced, and returns the head's id, the last
// segment and where its frames end. It uses the WAL's own append and cut,
// through a chain WAL put in place of format 5's for the while.
func (db *DB) writeChainFromRuns(dir string) (head uint64, last segRef, end int64, err error) {
	db.ckMu.Lock()
	defer db.ckMu.Unlock()
	db.wmu.Lock()
	defer db.wmu.Unlock()
	s, err := db.makeSegment(walPath(dir, firstSegment))
	if err != nil {
		return 0, segRef{}, 0, err
	}
	old := db.wal
	w := &walLog{chain: true, cseg: s, cur: firstSegment, id: newWALID()}
	db.wal = w
	head = w.id
	db.mu.Lock()
	db.seg.ids = map[uint64]uint64{firstSegment: head}
	first := db.first
	db.mu.Unlock()
	defer func() {
		w.close()
		db.wal = old
	}()
	var batch []pb.Entry
	size := 0
	var wrote uint64 // the last index in a frame
	flush := func() error {
		if len(batch) == 0 {
			return nil
		}
		if _, err := db.appendWAL(nil, 0, nil, batch, false); err != nil {
			return err
		}
		wrote = batch[len(batch)-1].Index
		batch, size = batch[:0], 0
		return nil
	}
	var werr error // Scan returns nil when its callback stops it
	err = db.Scan(first, func(e pb.Entry) bool {
		batch = append(batch, e)
		if size += len(e.Data); size >= upgradeFrame {
			werr = flush()
		}
		return werr == nil
	})
	if err == nil && werr == nil {
		werr = flush()
	}
	if err = cmp.Or(err, werr); err != nil {
		return 0, segRef{}, 0, err
	}
	db.mu.RLock()
	logLast := db.last
	db.mu.RUnlock()
	if first <= logLast && wrote != logLast {
		// Every entry went into a frame, or the upgrade is not made.
		return 0, segRef{}, 0, fmt.Errorf("upgrade to format %d: the segments end at index %d, the log at %d: %w", formatChain, wrote, logLast, ErrCorrupt)
	}
	if err := syncDir(dir); err != nil {
		return 0, segRef{}, 0, err
	}
	return head, segRef{uint64(w.cur), w.id}, w.off, nil
}

// copyWithoutRuns copies the data file into a new one at path, all but the
// log bucket's runs (an empty log bucket takes their place), then has
// meta edit the new file's meta bucket, all in transactions of about txMax
// bytes at most; synced, closed.
func (db *DB) copyWithoutRuns(path string, timeout time.Duration, txMax int, meta func(m *bolt.Bucket) error) error {
	dst, err := openBolt(path, timeout, false)
	if err != nil {
		return err
	}
	defer dst.Close()
	tx, err := dst.Begin(true)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	size := 0
	var put func(to *bolt.Bucket, from *bolt.Bucket, path [][]byte) error
	// dstBucket finds a bucket of the current transaction by its path.
	dstBucket := func(path [][]byte) *bolt.Bucket {
		b := tx.Bucket(path[0])
		for _, p := range path[1:] {
			b = b.Bucket(p)
		}
		return b
	}
	put = func(to *bolt.Bucket, from *bolt.Bucket, path [][]byte) error {
		to.FillPercent = 1 // written in key order: pages full
		return from.ForEach(func(k, v []byte) error {
			if size >= txMax {
				if err := tx.Commit(); err != nil {
					return err
				}
				if tx, err = dst.Begin(true); err != nil {
					return err
				}
				to, size = dstBucket(path), 0
				to.FillPercent = 1
			}
			size += len(k) + len(v)
			if v != nil {
				return to.Put(k, v)
			}
			sub, err := to.CreateBucket(k)
			if err != nil {
				return err
			}
			if err := sub.SetSequence(from.Bucket(k).Sequence()); err != nil {
				return err
			}
			if err := put(sub, from.Bucket(k), append(append([][]byte(nil), path...), k)); err != nil {
				return err
			}
			to = dstBucket(path) // the transaction may be a new one
			to.FillPercent = 1
			return nil
		})
	}
	err = db.bolt.View(func(src *bolt.Tx) error {
		return src.ForEach(func(name []byte, b *bolt.Bucket) error {
			to, err := tx.CreateBucket(name)
			if err != nil {
				return err
			}
			if err := to.SetSequence(b.Sequence()); err != nil {
				return err
			}
			if bytes.Equal(name, bucketLog) {
				return nil
			}
			return put(to, b, [][]byte{name})
		})
	})
	if err != nil {
		return err
	}
	if err := meta(tx.Bucket(bucketMeta)); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return err
	}
	return dst.Close()
}

// finishUpgrade makes the upgrade upgradeToChain wrote the data dir's:
// the new file renamed over the old one, which the caller has closed.
// Format 5's WAL files are dead from then on and go at the Open that
// follows (removeDroppedSegments).
func finishUpgrade(dir string) error {
	if err := os.Rename(filepath.Join(dir, upgradeName), filepath.Join(dir, FileName)); err != nil {
		return fmt.Errorf("storage: upgrade to format %d: %w", formatChain, err)
	}
	return syncDir(dir)
}

// removeUpgradeLeftovers removes what an upgrade that did not finish left
// in a data dir still in format 5 or earlier: its new file and its
// segments, none of which that format reads.
func removeUpgradeLeftovers(dir string) {
	for _, seq := range walSeqs(dir) {
		if seq >= firstSegment {
			_ = os.Remove(walPath(dir, int(seq)))
		}
	}
	for _, name := range []string{upgradeName, spareName} {
		_ = os.Remove(filepath.Join(dir, name))
	}
}
