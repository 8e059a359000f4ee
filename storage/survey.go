package storage

import (
	"encoding/binary"
	"errors"
	"fmt"
	"path/filepath"
	"runtime/debug"
	"time"

	bolt "go.etcd.io/bbolt"
	pb "go.etcd.io/raft/v3/raftpb"
)

// IndexRange is the log indexes First..Last, both included.
type IndexRange struct {
	First uint64 `json:"first"`
	Last  uint64 `json:"last"`
}

// String gives "7" or "7-12".
func (r IndexRange) String() string {
	if r.First == r.Last {
		return fmt.Sprint(r.First)
	}
	return fmt.Sprintf("%d-%d", r.First, r.Last)
}

// Survey is what could be read of a data dir that failed its checks: the
// log indexes whose entries pass their CRC and those that do not (or sit in
// a damaged run), as far as the file shows its extent.
type Survey struct {
	// Opened is false when the data file could not be read at all (both
	// meta pages torn, truncated below its last transaction, not a bbolt
	// file): then nothing of its log is known.
	Opened bool `json:"opened"`
	// Readable and Unreadable are sorted and do not overlap.
	Readable   []IndexRange `json:"readable"`
	Unreadable []IndexRange `json:"unreadable"`
	// Last is the highest index the file shows (readable or not), 0 when
	// unknown.
	Last uint64 `json:"last"`
	// Why is what stopped the reading, when Opened is false.
	Why string `json:"why,omitempty"`
}

// SurveyDamaged reads, without writing anything, what it can of the log in
// the data dir dir whose Open failed with ErrCorrupt: it walks every run of
// the log bucket and checks each entry on its own, where Open stops at the
// first bad one. Entries only in the WAL are not looked at (a clean stop
// leaves none). In format 6 it reads the log's segments frame by frame
// past a damaged one (salvageChain).
func SurveyDamaged(dir string) (s Survey) {
	path := filepath.Join(dir, FileName)
	if err := checkFile(path); err != nil {
		s.Why = err.Error()
		return s
	}
	bdb, err := openBolt(path, 100*time.Millisecond, true)
	if err != nil {
		s.Why = err.Error()
		return s
	}
	defer bdb.Close()
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			// A page fault or bbolt's panic part way: keep what was read,
			// the rest past it is unknown.
			s.Why = fmt.Sprintf("reading the file failed (%v)", r)
		}
	}()
	var acc rangeAcc
	var chain *chainSalvage
	err = bdb.View(func(tx *bolt.Tx) error {
		if m := tx.Bucket(bucketMeta); m != nil && metaU64(tx, bucketMeta, keyFormat) >= formatChain {
			var err error
			chain, err = salvageChainOf(dir, m)
			if err != nil {
				return err
			}
			s.Opened = true
			for _, r := range chain.frames {
				for i := r.first; i <= r.last; i++ {
					acc.add(i, true)
				}
			}
			return nil
		}
		lb := tx.Bucket(bucketLog)
		if lb == nil {
			return errors.New("no log bucket")
		}
		s.Opened = true
		c := lb.Cursor()
		k, v := c.First()
		for k != nil {
			it, err := readItem(c, k, v) // through an entry's last piece
			nk, nv := c.Next()
			switch {
			case err != nil && it.pieces > 0:
				acc.add(it.first, false) // a piece missing or torn
			case err != nil:
				// A key that names no index, or an empty value: its
				// entries are counted by the gap it leaves.
			case !it.run:
				acc.add(it.first, checkOK(it.first, it.v))
			default:
				idx, rest := it.first, it.v
				for len(rest) > 0 {
					ev, after, err := nextInRun(idx, rest)
					if err != nil {
						// The run's framing is gone: what is left of it, up to the
						// next key, cannot be read.
						end := idx
						if nf, _, _, err := keyIndex(nk); nk != nil && err == nil && nf > idx {
							end = nf - 1
						}
						for i := idx; i <= end; i++ {
							acc.add(i, false)
						}
						break
					}
					acc.add(idx, checkOK(idx, ev))
					idx, rest = idx+1, after
				}
			}
			k, v = nk, nv
		}
		return nil
	})
	if err != nil && s.Why == "" {
		s.Why = err.Error()
	}
	s.Readable, s.Unreadable, s.Last = acc.readable, acc.unreadable, acc.last
	return s
}

// checkOK reports whether the entry value v at idx passes its CRC.
func checkOK(idx uint64, v []byte) bool {
	_, err := checkEntry(idx, v)
	return err == nil
}

// rangeAcc collects indexes, in increasing order, into readable and
// unreadable ranges; an index skipped between two is unreadable.
type rangeAcc struct {
	readable, unreadable []IndexRange
	last                 uint64
}

func (a *rangeAcc) add(idx uint64, ok bool) {
	if a.last != 0 && idx > a.last+1 {
		appendRange(&a.unreadable, a.last+1, idx-1)
	}
	if ok {
		appendRange(&a.readable, idx, idx)
	} else {
		appendRange(&a.unreadable, idx, idx)
	}
	a.last = max(a.last, idx)
}

// appendRange adds first..last to rs, merging it with the last range when
// they touch.
func appendRange(rs *[]IndexRange, first, last uint64) {
	if n := len(*rs); n > 0 && (*rs)[n-1].Last+1 >= first {
		(*rs)[n-1].Last = max((*rs)[n-1].Last, last)
		return
	}
	*rs = append(*rs, IndexRange{first, last})
}

// RequeueSalvaged puts the data entries past index from that pass their CRC
// in the damaged data file of dir (in format 6, in its segments; dir is a
// directory a damaged data dir's files were moved to) into this DB's
// requeue bucket, to be re-published on the master like a deposed
// master's tail: what a damaged member held alone and can still read is
// not lost. It returns how many it put there. The damaged files are only
// read.
func (db *DB) RequeueSalvaged(dir string, from uint64) (n int, err error) {
	path := filepath.Join(dir, FileName)
	if err := checkFile(path); err != nil {
		return 0, err
	}
	bdb, err := openBolt(path, 100*time.Millisecond, true)
	if err != nil {
		return 0, err
	}
	defer bdb.Close()
	type kv struct{ k, v []byte }
	var found []kv
	func() {
		defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
		defer func() {
			if r := recover(); r != nil {
				err = fmt.Errorf("%s: reading the file failed (%v): %w", path, r, ErrCorrupt)
			}
		}()
		err = bdb.View(func(tx *bolt.Tx) error {
			if m := tx.Bucket(bucketMeta); m != nil && metaU64(tx, bucketMeta, keyFormat) >= formatChain {
				chain, err := salvageChainOf(dir, m)
				if err != nil {
					return err
				}
				return chain.each(func(e pb.Entry) error {
					if e.Index > from && e.Type == pb.EntryNormal && len(e.Data) > 0 {
						ev := make([]byte, entrySize(&e))
						putEntry(ev, &e)
						found = append(found, kv{append(u64(e.Index), ev[4:12]...), ev})
					}
					return nil
				})
			}
			lb := tx.Bucket(bucketLog)
			if lb == nil {
				return fmt.Errorf("%s: no log bucket: %w", path, ErrCorrupt)
			}
			c := lb.Cursor()
			for k, v := seekKey(c, from+1); k != nil; k, v = c.Next() {
				it, err := readItem(c, k, v)
				if err != nil {
					continue // damaged: what it held is not requeued
				}
				for idx, rest := it.first, it.v; len(rest) > 0; idx++ {
					ev, after := rest, []byte(nil)
					if it.run {
						if ev, after, err = nextInRun(idx, rest); err != nil {
							break
						}
					}
					rest = after
					if idx <= from || !checkOK(idx, ev) || pb.EntryType(ev[12]) != pb.EntryNormal || len(ev) == entryHdr {
						continue
					}
					found = append(found, kv{append(u64(idx), ev[4:12]...), append([]byte(nil), ev...)})
				}
			}
			return nil
		})
	}()
	if err != nil || len(found) == 0 {
		return 0, err
	}
	err = db.commitSync(0, func(tx *bolt.Tx) error {
		rq := tx.Bucket(bucketRequeue)
		for _, m := range found {
			if err := rq.Put(m.k, m.v); err != nil {
				return err
			}
		}
		return nil
	}, func() { db.requeued.Store(true) })
	if err != nil {
		return 0, err
	}
	return len(found), nil
}

// salvageChainOf reads the chain of the format 6 data dir dir whose meta
// bucket is m, past damage (salvageChain).
func salvageChainOf(dir string, m *bolt.Bucket) (*chainSalvage, error) {
	h, w := m.Get(keySegHead), m.Get(keyWAL)
	if len(h) != 16 || len(w) != 24 {
		return nil, fmt.Errorf("data format %d without the head of its log's chain or its replay point: %w", formatChain, ErrCorrupt)
	}
	head, id := binary.BigEndian.Uint64(h), binary.BigEndian.Uint64(h[8:])
	return salvageChain(dir, head, id, binary.BigEndian.Uint64(w[8:]), int64(binary.BigEndian.Uint64(w[16:]))), nil
}
