package storage

import (
	"bytes"
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
// leaf. An entry bigger than that is stored in pieces of its own (format
// 4), each a value of at most pieceBytes under pieceKey(index, number):
// stored as one value, it took a run of contiguous free pages as long as
// itself, which the one-page writes of each commit leave none of once
// retention frees pages here and there, so the file grew past its budget
// (12 to 15 MiB on an 8 MiB budget with 256 KiB records). Pieces take
// single pages, as every other write does. Readers join them (a copy).
//
// A run's value is a sequence of uvarint(length) | entry value, with entry
// values as before (CRC, term, type, data: putEntry). A first piece's value
// is uvarint(length) | the entry value's head, the next pieces' the rest in
// order; a missing or torn piece is damage, as a failed CRC is. Files
// written before runs (format 2) hold one entry per 8-byte key; all kinds
// sort by index together, since runKey and pieceKey append to the index,
// and logCursor reads them alike. Old entries are never rewritten: they
// stay as they are until the log is reset.
const (
	runTag   = 1 // the ninth byte of a run's key
	pieceTag = 2 // the ninth byte of a piece's key, its number after it
)

// pieceKeyLen is the length of a piece's key: the index, pieceTag and the
// piece's number, big-endian so that the pieces sort in order.
const pieceKeyLen = 13

// leafElem is what bbolt keeps in a leaf per key besides the key and the
// value.
const leafElem = 16

// runBytes is the most a run holds with pages of pageSize: two runs and
// their element headers (16 bytes, and a 9-byte key) in a page after its
// 16-byte header.
func runBytes(pageSize int) int { return (pageSize-16)/2 - leafElem - 9 }

// pieceBytes is the most a piece holds: two pieces fill a page as two runs
// do, their keys being longer.
func pieceBytes(pageSize int) int { return runBytes(pageSize) - (pieceKeyLen - 9) }

// runKey is the key of the run whose first entry is first.
func runKey(first uint64) []byte {
	k := make([]byte, 9)
	binary.BigEndian.PutUint64(k, first)
	k[8] = runTag
	return k
}

// pieceKey is the key of piece n of entry idx.
func pieceKey(idx uint64, n uint32) []byte {
	k := make([]byte, pieceKeyLen)
	binary.BigEndian.PutUint64(k, idx)
	k[8] = pieceTag
	binary.BigEndian.PutUint32(k[9:], n)
	return k
}

// keyKind is what a log key holds.
type keyKind uint8

const (
	keySingle keyKind = iota // one entry (format 2)
	keyRun                   // a run of entries
	keyPiece                 // a piece of one entry
)

// keyIndex parses log key k: the index of its (first) entry, what it
// holds, and a piece's number.
func keyIndex(k []byte) (first uint64, kind keyKind, piece uint32, err error) {
	switch {
	case len(k) == 8:
		return binary.BigEndian.Uint64(k), keySingle, 0, nil
	case len(k) == 9 && k[8] == runTag:
		return binary.BigEndian.Uint64(k), keyRun, 0, nil
	case len(k) == pieceKeyLen && k[8] == pieceTag:
		return binary.BigEndian.Uint64(k), keyPiece, binary.BigEndian.Uint32(k[9:]), nil
	}
	return 0, 0, 0, fmt.Errorf("log key %x is not an index, a run or a piece: %w", k, ErrCorrupt)
}

// logItem is what the log bucket holds from one key on: a run, a single
// entry, or an entry's pieces.
type logItem struct {
	first uint64
	run   bool   // v is a run; else one entry's value
	v     []byte // aliases bbolt's page, except joined pieces (a copy)
	// head says v is only the first piece's part of the entry (readHead):
	// its headers, for what reads no further.
	head   bool
	pieces int // the entry's pieces; 0 for a run or a single entry
	size   int // the keys, values and leaf elements it takes in the file
}

// keys returns the item's keys, k being its first.
func (it *logItem) keys(k []byte) [][]byte {
	if it.pieces == 0 {
		return [][]byte{bytes.Clone(k)}
	}
	ks := make([][]byte, it.pieces)
	for i := range ks {
		ks[i] = pieceKey(it.first, uint32(i))
	}
	return ks
}

// readItem reads the item at key k (value v), where c is. An entry in
// pieces is read through its last piece, where c is left (so that c.Next
// moves past the item, also when a piece is missing or torn, which is
// ErrCorrupt), and joined.
func readItem(c *bolt.Cursor, k, v []byte) (logItem, error) { return readItemAs(c, k, v, false) }

// readHead is readItem that joins no pieces: v holds the first piece's
// part of an entry in pieces (its headers), for readers of terms and
// record times. The pieces' keys and lengths are checked all the same.
func readHead(c *bolt.Cursor, k, v []byte) (logItem, error) { return readItemAs(c, k, v, true) }

// maxPrealloc bounds what readItem allocates on the word of a first piece's
// length field before the pieces confirm it.
const maxPrealloc = 16 << 20

func readItemAs(c *bolt.Cursor, k, v []byte, head bool) (it logItem, err error) {
	first, kind, n, err := keyIndex(k)
	if err != nil {
		return it, err
	}
	it.first, it.size = first, len(k)+len(v)+leafElem
	if kind != keyPiece {
		if len(v) == 0 {
			// An empty value (or a nested bucket, whose value bbolt
			// gives as nil) holds no entry at all: damage, never a key
			// to skip.
			return it, fmt.Errorf("entry %d: empty value under its key: %w", first, ErrCorrupt)
		}
		it.run, it.v = kind == keyRun, v
		return it, nil
	}
	it.pieces = 1
	var total uint64
	var got int // the entry's bytes the pieces hold
	if n != 0 {
		err = fmt.Errorf("entry %d: its pieces before piece %d are missing: %w", first, n, ErrCorrupt)
	} else if t, w := binary.Uvarint(v); w <= 0 || t < entryHdr || t < uint64(len(v)-w) {
		err = fmt.Errorf("entry %d: its first piece is damaged (length field): %w", first, ErrCorrupt)
	} else {
		total, got = t, len(v)-w
		if head {
			it.v = v[w:]
		} else {
			it.v = append(make([]byte, 0, min(total, maxPrealloc)), v[w:]...)
		}
	}
	for want := n + 1; ; want++ {
		nk, nv := c.Next()
		if nk == nil {
			break // c stays on the last key
		}
		nf, nkind, nn, kerr := keyIndex(nk)
		if kerr != nil || nkind != keyPiece || nf != first {
			c.Prev()
			break
		}
		it.pieces++
		it.size += len(nk) + len(nv) + leafElem
		switch {
		case err != nil:
		case nn != want:
			err = fmt.Errorf("entry %d: piece %d is missing: %w", first, want, ErrCorrupt)
		case uint64(got+len(nv)) > total || len(nv) == 0:
			err = fmt.Errorf("entry %d: piece %d is damaged (%d bytes past the %d of the entry's %d its pieces before held): %w", first, nn, len(nv), got, total, ErrCorrupt)
		default:
			got += len(nv)
			if !head {
				it.v = append(it.v, nv...)
			}
		}
		want = nn
	}
	if err == nil && uint64(got) != total {
		err = fmt.Errorf("entry %d: its %d pieces hold %d of its %d bytes (a piece is missing or torn): %w", first, it.pieces, got, total, ErrCorrupt)
	}
	if err != nil {
		it.v = nil
		return it, err
	}
	it.head = head
	return it, nil
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

// load makes the item at k, v the current one (the cursor moves past an
// entry's pieces). Past the first item, its first index must follow the
// previous item's last entry: a gap is damage.
func (lc *logCursor) load(k, v []byte) error {
	it, err := readItem(lc.c, k, v)
	if err != nil {
		return err
	}
	if lc.started && it.first != lc.next {
		return fmt.Errorf("log index %d where %d was expected (gap or overlap): %w", it.first, lc.next, ErrCorrupt)
	}
	lc.next, lc.rest, lc.run, lc.started = it.first, it.v, it.run, true
	return nil
}

// seekKey moves c to the key holding entry i (a run that starts before i,
// or i's own key, its first piece for one in pieces), else to the first key
// after i, and returns it.
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
	if f, kind, n, err := keyIndex(pk); err == nil && kind == keyPiece && n != 0 {
		return c.Seek(u64(f)) // the last piece of the entry before i: its first
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
	first, kind, _, err := keyIndex(k)
	if err != nil || kind != keyRun {
		return first, err
	}
	if len(v) == 0 {
		return 0, fmt.Errorf("entry %d: empty value under its key: %w", first, ErrCorrupt)
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
// runs, and each entry too big for a run in pieces. Their bytes are one
// buffer: bbolt keeps the slices it is given until the transaction commits,
// so they go after what runBuf holds already (commitCut empties it before
// a transaction; the caller holds ckMu).
func (db *DB) putEntries(tx *bolt.Tx, ents []pb.Entry) error {
	if len(ents) == 0 {
		return nil
	}
	size := 0
	for i := range ents {
		size += binary.MaxVarintLen32 + entrySize(&ents[i])
	}
	if cap(db.runBuf)-len(db.runBuf) < size {
		// Earlier slices keep the old array until the commit.
		db.runBuf = make([]byte, 0, max(size, 2*cap(db.runBuf)))
	}
	buf := db.runBuf[len(db.runBuf):len(db.runBuf):cap(db.runBuf)]
	defer func() { db.runBuf = db.runBuf[:len(db.runBuf)+len(buf)] }()
	lb := tx.Bucket(bucketLog)
	lb.FillPercent = 1.0 // appends are sequential: full pages halve growth
	ps := tx.DB().Info().PageSize
	limit := runBytes(ps)
	start, first := 0, ents[0].Index
	for i := range ents {
		n := entrySize(&ents[i])
		big := uvarintLen(uint64(n))+n > limit
		if len(buf) > start && (big || len(buf)-start+uvarintLen(uint64(n))+n > limit) {
			if err := lb.Put(runKey(first), buf[start:len(buf):len(buf)]); err != nil {
				return err
			}
			start = len(buf)
		}
		if len(buf) == start {
			first = ents[i].Index
		}
		buf = binary.AppendUvarint(buf, uint64(n))
		buf = buf[:len(buf)+n]
		putEntry(buf[len(buf)-n:], &ents[i])
		if big {
			if err := putPieces(tx, lb, first, buf[start:], pieceBytes(ps)); err != nil {
				return err
			}
			start = len(buf)
		}
	}
	if len(buf) == start {
		return nil
	}
	return lb.Put(runKey(first), buf[start:len(buf):len(buf)])
}

// putPieces writes b, an entry's length field and value, as the pieces of
// entry idx, and marks the file as holding pieces (format 4): a build
// that cannot read them refuses it rather than take it for damage.
func putPieces(tx *bolt.Tx, lb *bolt.Bucket, idx uint64, b []byte, limit int) error {
	for n := 0; len(b) > 0; n++ {
		p := b[:min(limit, len(b)):min(limit, len(b))]
		if err := lb.Put(pieceKey(idx, uint32(n)), p); err != nil {
			return err
		}
		b = b[len(p):]
	}
	key := keyFormat
	if metaU64(tx, bucketMeta, keyFormat) >= formatPadded {
		key = keyFormatRest // what a clean Close puts back (FormatVersion)
	}
	if metaU64(tx, bucketMeta, key) < formatPieces {
		return tx.Bucket(bucketMeta).Put(key, u64(formatPieces))
	}
	return nil
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
		it, err := readItem(c, k, v)
		if err != nil {
			return err
		}
		first, run := it.first, it.run
		rest, idx := it.v, first
		for len(rest) > 0 {
			ev, after := rest, []byte(nil)
			if run {
				if ev, after, err = nextInRun(idx, rest); err != nil {
					return err
				}
			}
			if idx == from && first < from {
				h := append([]byte(nil), it.v[:len(it.v)-len(rest)]...)
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
			gone = append(gone, it.keys(k)...)
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
