package storage

import (
	"encoding/binary"
	"fmt"

	bolt "go.etcd.io/bbolt"
	pb "go.etcd.io/raft/v3/raftpb"
)

// The log bucket holds runs of entries. A checkpoint writes the entries it
// takes as runs, each one bbolt value under the key runKey(first index): one
// Put per run instead of one per entry, which was most of a checkpoint's CPU
// and of its allocations (bbolt searches the tree from the root and builds a
// cursor on every Put).
//
// A run fills at most half a page less the headers (runBytes), so that two
// fit in a leaf page, the least bbolt puts in one when it splits a node:
// bigger values would make every leaf spill into overflow pages, which
// bbolt allocates afresh on every commit and rewrites whole with the last
// leaf. An entry bigger than that is a run of its own, as it was a key of
// its own.
//
// A run's value is a sequence of uvarint(length) | entry value, with entry
// values as before (CRC, term, type, data: putEntry). Files written before
// runs (format 2) hold one entry per 8-byte key; both kinds sort by index
// together, since runKey appends a byte to the index, and logCursor reads
// them alike. Old entries are never rewritten: they stay single until the
// log is reset.
const runTag = 1 // the ninth byte of a run's key

// runBytes is the most a run holds with pages of pageSize: two runs and
// their element headers (16 bytes, and a 9-byte key) in a page after its
// 16-byte header.
func runBytes(pageSize int) int { return (pageSize-16)/2 - 16 - 9 }

// runKey is the key of the run whose first entry is first.
func runKey(first uint64) []byte {
	k := make([]byte, 9)
	binary.BigEndian.PutUint64(k, first)
	k[8] = runTag
	return k
}

// keyFirst returns the index of the first entry under log key k, whose
// value is v, and whether k is a run (else a single entry of format 2). An
// empty value (or a nested bucket, whose value bbolt gives as nil) holds no
// entry at all: damage, never a key to skip.
func keyFirst(k, v []byte) (first uint64, run bool, err error) {
	switch {
	case len(k) == 8:
		first = binary.BigEndian.Uint64(k)
	case len(k) == 9 && k[8] == runTag:
		first, run = binary.BigEndian.Uint64(k), true
	default:
		return 0, false, fmt.Errorf("log key %x is not an index or a run: %w", k, ErrCorrupt)
	}
	if len(v) == 0 {
		return 0, false, fmt.Errorf("entry %d: empty value under its key: %w", first, ErrCorrupt)
	}
	return first, run, nil
}

// nextInRun splits the first entry value off a run's remaining bytes.
func nextInRun(idx uint64, rest []byte) (v, after []byte, err error) {
	n, w := binary.Uvarint(rest)
	if w <= 0 || n < entryHdr || n > uint64(len(rest)-w) {
		return nil, nil, fmt.Errorf("entry %d: run damaged (length field %d of %d bytes left): %w", idx, n, len(rest), ErrCorrupt)
	}
	return rest[w : w+int(n)], rest[w+int(n):], nil
}

// logCursor reads the log bucket in index order, entry by entry, across
// runs and single entries. Values alias bbolt's pages: valid only in the
// transaction.
type logCursor struct {
	c    *bolt.Cursor
	next uint64 // index of the entry at the head of rest
	rest []byte // entries left in the current key's value
	run  bool   // rest is a run; else one entry
	// started is false until a key is loaded: the first key sets next
	// instead of being checked against it.
	started bool
}

func newLogCursor(lb *bolt.Bucket) *logCursor { return &logCursor{c: lb.Cursor()} }

// load makes k, v the current key. Past the first key, its first index must
// follow the previous key's last entry: a gap is damage.
func (lc *logCursor) load(k, v []byte) error {
	first, run, err := keyFirst(k, v)
	if err != nil {
		return err
	}
	if lc.started && first != lc.next {
		return fmt.Errorf("log index %d where %d was expected (gap or overlap): %w", first, lc.next, ErrCorrupt)
	}
	lc.next, lc.rest, lc.run, lc.started = first, v, run, true
	return nil
}

// seekKey moves c to the key holding entry i (a run that starts before i,
// or i's own key), else to the first key after i, and returns it.
func seekKey(c *bolt.Cursor, i uint64) (k, v []byte) {
	k, v = c.Seek(u64(i))
	if k != nil && len(k) >= 8 && binary.BigEndian.Uint64(k) <= i {
		return k, v
	}
	var pk, pv []byte
	if k == nil {
		pk, pv = c.Last()
	} else {
		pk, pv = c.Prev()
	}
	if pk == nil {
		return c.Seek(u64(i)) // nothing before: back to where Seek was
	}
	return pk, pv
}

// seek positions lc at entry i: the next call to entry returns it, or the
// first entry after i when i is not in the log, or the end.
func (lc *logCursor) seek(i uint64) error {
	lc.rest, lc.started = nil, false
	k, v := seekKey(lc.c, i)
	if k == nil {
		return nil
	}
	if err := lc.load(k, v); err != nil {
		return err
	}
	for lc.next < i && len(lc.rest) > 0 {
		if _, _, err := lc.entry(); err != nil {
			return err
		}
	}
	return nil
}

// entry returns the next entry's index and value (nil at the end of the
// log) and moves past it.
func (lc *logCursor) entry() (uint64, []byte, error) {
	for len(lc.rest) == 0 {
		if !lc.started {
			return 0, nil, nil // empty bucket
		}
		k, v := lc.c.Next()
		if k == nil {
			return 0, nil, nil
		}
		if err := lc.load(k, v); err != nil {
			return 0, nil, err
		}
	}
	idx := lc.next
	v := lc.rest
	if lc.run {
		var err error
		if v, lc.rest, err = nextInRun(idx, lc.rest); err != nil {
			return 0, nil, err
		}
	} else {
		lc.rest = nil
	}
	lc.next++
	return idx, v, nil
}

// eachEntry calls fn with the index and value (aliasing bbolt's page) of
// every entry of the log bucket from index from on, in order, until the log
// ends, fn returns false, or an error.
func eachEntry(lb *bolt.Bucket, from uint64, fn func(idx uint64, v []byte) (more bool, err error)) error {
	lc := newLogCursor(lb)
	if err := lc.seek(from); err != nil {
		return err
	}
	for {
		idx, v, err := lc.entry()
		if err != nil || v == nil {
			return err
		}
		if more, err := fn(idx, v); err != nil || !more {
			return err
		}
	}
}

// lastLogIndex returns the index of the log bucket's last entry, 0 when it
// is empty.
func lastLogIndex(lb *bolt.Bucket) (uint64, error) {
	k, v := lb.Cursor().Last()
	if k == nil {
		return 0, nil
	}
	first, run, err := keyFirst(k, v)
	if err != nil || !run {
		return first, err
	}
	last := first
	for rest := v; ; last++ {
		if _, rest, err = nextInRun(last, rest); err != nil {
			return 0, err
		}
		if len(rest) == 0 {
			return last, nil
		}
	}
}

// putEntries writes ents, contiguous and following the log's last entry, as
// runs. Their bytes are one buffer: bbolt keeps the slices it is given until
// the transaction commits.
func (db *DB) putEntries(tx *bolt.Tx, ents []pb.Entry) error {
	if len(ents) == 0 {
		return nil
	}
	size := 0
	for i := range ents {
		size += binary.MaxVarintLen32 + entrySize(&ents[i])
	}
	buf := make([]byte, 0, size)
	lb := tx.Bucket(bucketLog)
	lb.FillPercent = 1.0 // appends are sequential: full pages halve growth
	limit := runBytes(tx.DB().Info().PageSize)
	start, first := 0, ents[0].Index
	for i := range ents {
		n := entrySize(&ents[i])
		if len(buf) > start && len(buf)-start+uvarintLen(uint64(n))+n > limit {
			if err := lb.Put(runKey(first), buf[start:len(buf):len(buf)]); err != nil {
				return err
			}
			start, first = len(buf), ents[i].Index
		}
		buf = binary.AppendUvarint(buf, uint64(n))
		buf = buf[:len(buf)+n]
		putEntry(buf[len(buf)-n:], &ents[i])
	}
	return lb.Put(runKey(first), buf[start:])
}

// requeueFrom moves the data entries from index from on out of the log into
// the requeue bucket, keyed by their old index and term: a node overwritten
// twice at the same indexes keeps both generations. A run that starts
// before from keeps its head, written anew. With term set, only the
// entries of that term move; the others go with the log all the same.
func requeueFrom(tx *bolt.Tx, lb *bolt.Bucket, from, term uint64) error {
	type kv struct{ k, v []byte }
	var gone [][]byte // keys to delete
	var moved []kv    // requeue bucket puts
	var head *kv      // the part before from of a run that straddles it
	c := lb.Cursor()
	k, v := seekKey(c, from)
	for ; k != nil; k, v = c.Next() {
		first, run, err := keyFirst(k, v)
		if err != nil {
			return err
		}
		rest, idx := v, first
		for len(rest) > 0 {
			ev, after := rest, []byte(nil)
			if run {
				if ev, after, err = nextInRun(idx, rest); err != nil {
					return err
				}
			}
			if idx == from && first < from {
				h := append([]byte(nil), v[:len(v)-len(rest)]...)
				head = &kv{append([]byte(nil), k...), h}
			}
			if idx >= from && len(ev) > entryHdr && pb.EntryType(ev[12]) == pb.EntryNormal && (term == 0 || binary.BigEndian.Uint64(ev[4:12]) == term) {
				rk := append(u64(idx), ev[4:12]...)
				moved = append(moved, kv{rk, append([]byte(nil), ev...)})
			}
			rest = after
			idx++
		}
		if idx > from {
			gone = append(gone, append([]byte(nil), k...))
		}
	}
	for _, k := range gone {
		if err := lb.Delete(k); err != nil {
			return err
		}
	}
	if head != nil {
		if err := lb.Put(head.k, head.v); err != nil {
			return err
		}
	}
	rq := tx.Bucket(bucketRequeue)
	for _, m := range moved {
		if err := rq.Put(m.k, m.v); err != nil {
			return err
		}
	}
	return nil
}
