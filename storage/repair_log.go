package storage

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"

	bolt "go.etcd.io/bbolt"
	pb "go.etcd.io/raft/v3/raftpb"
)

// Copying the log: entry by entry through bbolt (repair.go says how
// Repair decides what is lost), and, when bbolt cannot reach it, page by page.

// add appends entry e, read intact, to the new log; indexes between the
// last one written and e's are lost.
func (s *salvager) add(e pb.Entry) error {
	if e.Index < s.next {
		return nil // already written (a WAL frame over the file's entries)
	}
	if e.Index > s.next {
		if err := s.lose(e.Index); err != nil {
			return err
		}
	}
	if e.Term < s.term {
		return s.lose(e.Index + 1) // impossible for an intact log: not trusted
	}
	s.rep.Entries++
	if e.Type == pb.EntryNormal && len(e.Data) > 0 {
		s.rep.Records++
		if origin, seq, err := RecordID(e.Data); err == nil && origin == s.nodeID {
			s.maxEpoch = max(s.maxEpoch, seq>>32)
		}
	}
	s.term = e.Term
	return s.push(e)
}

// lose fills the indexes from s.next up to before end with empty entries
// and reports them lost.
func (s *salvager) lose(end uint64) error {
	if end <= s.next {
		return nil
	}
	if n := len(s.rep.Lost); n > 0 && s.rep.Lost[n-1].To+1 == s.next {
		s.rep.Lost[n-1].To = end - 1
	} else {
		s.rep.Lost = append(s.rep.Lost, LostRange{s.next, end - 1})
	}
	for s.next < end {
		// Term 0 is raft's "no entry": a fill at the head gets term 1,
		// which every entry after it has at least.
		if err := s.push(pb.Entry{Index: s.next, Term: max(s.term, 1), Type: pb.EntryNormal}); err != nil {
			return err
		}
	}
	return nil
}

func (s *salvager) push(e pb.Entry) error {
	s.batch = append(s.batch, e)
	s.batchBytes += entrySize(&e)
	s.next = e.Index + 1
	if len(s.batch) >= 4096 || s.batchBytes >= 256<<10 {
		return s.flushBatch()
	}
	return nil
}

func (s *salvager) flushBatch() error {
	if len(s.batch) == 0 {
		return nil
	}
	err := s.out.Save(pb.HardState{}, s.batch)
	s.batch, s.batchBytes = s.batch[:0:0], 0
	return err
}

// probeLimit is the highest index worth looking for past a damaged page:
// what the file says it committed or applied, with some room.
func (s *salvager) probeLimit() uint64 {
	return max(s.hs.Commit, s.applied, s.next) + 4096
}

// copyLog copies the log bucket's readable entries. Past a damaged page it
// seeks each following index until a key can be read again.
func (s *salvager) copyLog() error {
	from, seek := s.next, false
	floor := uint64(0) // past the key the last probe found: progress
	for {
		resume, err := s.scanLog(from, seek)
		if err != nil {
			return err
		}
		if resume == 0 {
			return nil
		}
		s.rep.Unreadable = appendOnce(s.rep.Unreadable, "damaged pages of the log bucket (the entries on them are the lost indexes above)")
		// Look for the next key bbolt can reach, index by index.
		found := uint64(0)
		for p := max(resume, s.next, floor); p <= s.probeLimit(); p++ {
			var k []byte
			perr := guard(func() error {
				return s.bdb.View(func(tx *bolt.Tx) error {
					k, _ = tx.Bucket(bucketLog).Cursor().Seek(u64(p))
					if k != nil {
						k = slices.Clone(k)
					}
					return nil
				})
			})
			if perr != nil {
				continue
			}
			if k == nil || len(k) < 8 {
				return nil // nothing readable past the damage: the tail is lost
			}
			found = binary.BigEndian.Uint64(k)
			break
		}
		if found == 0 {
			return nil
		}
		from, seek, floor = found, true, found+1
	}
}

// scanLog copies entries from the key at or before index from (seek: the
// first key at or after it) to the end of the bucket. It returns 0 at the
// end, or the index after the last entry read when a damaged page stopped
// it.
func (s *salvager) scanLog(from uint64, seek bool) (resume uint64, err error) {
	var werr error // a write error: not damage, the repair fails
	perr := guard(func() error {
		return s.bdb.View(func(tx *bolt.Tx) error {
			lb := tx.Bucket(bucketLog)
			if lb == nil {
				return errors.New("no log bucket")
			}
			c := lb.Cursor()
			var k, v []byte
			if seek {
				k, v = c.Seek(u64(from))
			} else {
				k, v = seekKey(c, from)
			}
			for ; k != nil; k, v = c.Next() {
				if werr = s.copyKey(c, k, v); werr != nil {
					return nil
				}
			}
			return nil
		})
	})
	if werr != nil {
		return 0, werr
	}
	if perr != nil {
		return s.next, nil
	}
	return 0, nil
}

// copyKey copies the readable entries under one log key, or of the entry
// whose pieces start there (c is left on the last of them).
func (s *salvager) copyKey(c *bolt.Cursor, k, v []byte) error {
	it, err := readItem(c, k, v)
	if err != nil || it.first > s.next+maxJump {
		return nil // a damaged key or piece: its entries show up as a gap
	}
	if !it.run {
		return s.copyValue(it.first, it.v)
	}
	for idx, rest := it.first, it.v; len(rest) > 0; idx++ {
		ev, after, err := nextInRun(idx, rest)
		if err != nil {
			return nil // the rest of the run is lost
		}
		if err := s.copyValue(idx, ev); err != nil {
			return err
		}
		rest = after
	}
	return nil
}

// copyValue copies one entry value whose CRC checks out.
func (s *salvager) copyValue(idx uint64, v []byte) error {
	if idx < s.next {
		return nil
	}
	e, err := decodeEntry(idx, v)
	if err != nil {
		return nil // lost: the next entry read fills the gap
	}
	return s.add(e)
}

// bbolt v1.5.0's page layout (internal/common/page.go), for scanLeaves.
const (
	boltLeafFlag    = 0x02
	boltLeafElemLen = 16 // flags, pos, ksize, vsize: 4 bytes each
)

// scanLeaves is the last resort when bbolt cannot reach the log bucket
// from either meta page (the top of the tree is past a truncation or
// damaged): it reads every page of the file that is a leaf of log runs and
// returns the entries whose CRC checks out, by index. bbolt has no public
// reader of pages by number, hence this much of its layout; the entries'
// own CRCs, not the pages, decide what is trusted. A stale page (freed by a
// later commit) holds the same entries as the live one, since a lone
// gateway's log is never overwritten.
func scanLeaves(path string) (map[uint64]pb.Entry, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("storage: repair: %w", err)
	}
	defer f.Close()
	var sizes []int64
	for _, off := range []int64{0, 4096, 16384, 65536} {
		if m, err := readBoltMeta(f, off); err == nil {
			sizes = []int64{int64(m.pageSize)}
			break
		}
	}
	if sizes == nil {
		// No meta page says: each page size bbolt may have used, and
		// the one that finds the most.
		sizes = []int64{4096, 16384, 65536}
	}
	b, err := io.ReadAll(f)
	if err != nil {
		return nil, fmt.Errorf("storage: repair: %w", err)
	}
	var best map[uint64]pb.Entry
	for _, ps := range sizes {
		if found := leafEntries(b, ps); len(found) > len(best) {
			best = found
		}
	}
	return best, nil
}

// leafEntries returns the entries of the log leaves among the pages of
// size ps in b (the whole file). An entry in pieces is read if all of them
// are found and it passes its CRC.
func leafEntries(b []byte, ps int64) map[uint64]pb.Entry {
	le := binary.LittleEndian
	found := map[uint64]pb.Entry{}
	pieces := map[uint64]map[uint32][]byte{}
	take := func(idx uint64, ev []byte) {
		if ent, err := decodeEntry(idx, ev); err == nil {
			if old, ok := found[idx]; !ok || ent.Term > old.Term {
				found[idx] = ent
			}
		}
	}
	for off := 2 * ps; off+boltPageHdrSize <= int64(len(b)); off += ps {
		p := b[off:]
		if le.Uint16(p[8:]) != boltLeafFlag {
			continue
		}
		count := int64(le.Uint16(p[10:]))
		end := min(int64(len(p)), (1+int64(le.Uint32(p[12:])))*ps)
		for i := int64(0); i < count; i++ {
			e := boltPageHdrSize + i*boltLeafElemLen
			if e+boltLeafElemLen > end {
				break
			}
			pos, ks, vs := int64(le.Uint32(p[e+4:])), int64(le.Uint32(p[e+8:])), int64(le.Uint32(p[e+12:]))
			if le.Uint32(p[e:]) != 0 || e+pos+ks+vs > end {
				break // a bucket, or not a page of ours
			}
			k, v := p[e+pos:e+pos+ks], p[e+pos+ks:e+pos+ks+vs]
			first, kind, n, err := keyIndex(k)
			if err != nil || len(v) == 0 {
				break
			}
			if kind == keyPiece {
				if pieces[first] == nil {
					pieces[first] = map[uint32][]byte{}
				}
				pieces[first][n] = v
				continue
			}
			for idx, rest := first, v; len(rest) > 0; idx++ {
				ev := rest
				if kind == keyRun {
					if ev, rest, err = nextInRun(idx, rest); err != nil {
						break
					}
				} else {
					rest = nil
				}
				take(idx, ev)
			}
		}
	}
	for idx, ps := range pieces {
		// uvarint(length) | value, in pieces numbered from 0.
		var joined []byte
		for n := uint32(0); ps[n] != nil; n++ {
			joined = append(joined, ps[n]...)
		}
		if t, w := binary.Uvarint(joined); w > 0 && t == uint64(len(joined)-w) {
			take(idx, joined[w:])
		}
	}
	return found
}

// copyFound copies the entries scanLeaves found, in index order.
func (s *salvager) copyFound(found map[uint64]pb.Entry) error {
	idx := make([]uint64, 0, len(found))
	for i := range found {
		idx = append(idx, i)
	}
	slices.Sort(idx)
	for _, i := range idx {
		if err := s.add(found[i]); err != nil {
			return err
		}
	}
	return nil
}
