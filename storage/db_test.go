package storage

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"
	"go.etcd.io/raft/v3"
	pb "go.etcd.io/raft/v3/raftpb"
)

// ---------------------------------------------------------------------------
// Helpers

// testOpen opens the data dir and closes the DB when the test ends (Close is
// idempotent, so tests may also close it themselves).
func testOpen(t *testing.T, dir string, opts *Options) *DB {
	t.Helper()
	db, err := Open(dir, opts)
	if err != nil {
		t.Fatalf("Open(%s): %v", dir, err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

// mustCheckpoint writes what the WAL holds into bbolt, in one commit.
func mustCheckpoint(t *testing.T, db *DB) {
	t.Helper()
	if err := db.commit(nil); err != nil {
		t.Fatalf("checkpoint: %v", err)
	}
}

func mustClose(t *testing.T, db *DB) {
	t.Helper()
	if err := db.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
}

func mustSave(t *testing.T, db *DB, hs pb.HardState, ents []pb.Entry) {
	t.Helper()
	if err := db.Save(hs, ents); err != nil {
		t.Fatalf("Save(%+v, %d entries from %d): %v", hs, len(ents), firstIdx(ents), err)
	}
}

func firstIdx(ents []pb.Entry) uint64 {
	if len(ents) == 0 {
		return 0
	}
	return ents[0].Index
}

// makeEntries returns n data entries from index lo at term. Each entry's data
// names its term and index, so an overwritten entry is recognisable, and the
// lengths differ, so maxSize limits fall between entries.
func makeEntries(lo, n, term uint64) []pb.Entry {
	ents := make([]pb.Entry, n)
	for i := range ents {
		ents[i] = makeEntry(lo+uint64(i), term)
	}
	return ents
}

func makeEntry(idx, term uint64) pb.Entry {
	d := fmt.Appendf(nil, "t%d/i%d/", term, idx)
	d = append(d, bytes.Repeat([]byte{byte('a' + idx%26)}, int(idx*7%40))...)
	return pb.Entry{Index: idx, Term: term, Type: pb.EntryNormal, Data: d}
}

// diffEntries describes how got differs from want, "" when they are equal.
// Data is compared by content: nil and empty are the same entry.
func diffEntries(got, want []pb.Entry) string {
	if len(got) != len(want) {
		return fmt.Sprintf("%d entries %s, want %d %s", len(got), briefEntries(got), len(want), briefEntries(want))
	}
	for i := range got {
		g, w := got[i], want[i]
		if g.Index != w.Index || g.Term != w.Term || g.Type != w.Type || !bytes.Equal(g.Data, w.Data) {
			return fmt.Sprintf("entry %d: got {i%d t%d %v %q}, want {i%d t%d %v %q}",
				i, g.Index, g.Term, g.Type, g.Data, w.Index, w.Term, w.Type, w.Data)
		}
	}
	return ""
}

func briefEntries(ents []pb.Entry) string {
	if len(ents) == 0 {
		return "[]"
	}
	return fmt.Sprintf("[%d..%d]", ents[0].Index, ents[len(ents)-1].Index)
}

func fileHash(t *testing.T, path string) [32]byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	return sha256.Sum256(b)
}

func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	des, err := os.ReadDir(dir)
	if err != nil {
		t.Fatalf("read dir: %v", err)
	}
	var names []string
	for _, de := range des {
		names = append(names, de.Name())
	}
	return names
}

// crashCopy copies the data file and the WAL of an open DB into a new dir:
// what a kill -9 or a power loss at this instant would leave. That is what
// bbolt committed and the WAL frames already synced; a frame being written
// now is left out. (bbolt's flock is advisory; reading the file is allowed.)
func crashCopy(t *testing.T, db *DB) string {
	t.Helper()
	db.ckMu.Lock()
	defer db.ckMu.Unlock()
	return crashCopyHeld(t, db)
}

// crashCopyHeld is crashCopy for a caller that holds ckMu. A crash is an
// instant and copying three files is not: with ckMu held no checkpoint can
// cut to the other WAL file or commit meanwhile, so the data file and the
// WAL copied agree; Saves go on appending, past the synced mark.
func crashCopyHeld(t *testing.T, db *DB) string {
	t.Helper()
	dir := t.TempDir()
	src := filepath.Dir(db.Path())
	if db.chain {
		return crashCopyChain(t, db, src, dir)
	}
	db.wmu.Lock()
	cur, synced, p := db.wal.cur, db.wal.synced.Load(), db.wal.unsyncedCut
	db.wmu.Unlock()
	for i, name := range []string{WALName + ".0", WALName + ".1", FileName} {
		b, err := os.ReadFile(filepath.Join(src, name))
		if err != nil {
			t.Fatal(err)
		}
		if i == cur && int64(len(b)) > synced {
			clear(b[synced:]) // not synced yet: lost in the crash
		}
		if p != nil && i == p.seg && int64(len(b)) > p.from {
			clear(b[p.from:]) // a cut whose sync is owed, and what came before it
		}
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o640); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// xorByte damages the byte at off in the file at path, as a bad medium
// would: it is xored with mask.
func xorByte(t *testing.T, path string, off int64, mask byte) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var b [1]byte
	if _, err := f.ReadAt(b[:], off); err != nil {
		t.Fatal(err)
	}
	b[0] ^= mask
	if _, err := f.WriteAt(b[:], off); err != nil {
		t.Fatal(err)
	}
}

// crashCopyRO opens a crash copy of db read-only, closing it right away
// when the test ends.
func crashCopyRO(t *testing.T, db *DB) *DB {
	t.Helper()
	return testOpen(t, crashCopy(t, db), &Options{ReadOnly: true})
}

// boltUpdate edits a closed data file with bbolt directly, the way a
// damaged disk or a newer tandem would leave it.
func boltUpdate(t *testing.T, path string, fn func(tx *bolt.Tx) error) {
	t.Helper()
	bdb, err := bolt.Open(path, 0o640, &bolt.Options{Timeout: time.Second, NoFreelistSync: true, FreelistType: bolt.FreelistMapType})
	if err != nil {
		t.Fatalf("bolt open %s: %v", path, err)
	}
	defer bdb.Close()
	if err := bdb.Update(fn); err != nil {
		t.Fatalf("bolt update: %v", err)
	}
}

// boltView reads a closed data file with bbolt directly.
func boltView(t *testing.T, path string, fn func(tx *bolt.Tx) error) {
	t.Helper()
	bdb, err := bolt.Open(path, 0o640, &bolt.Options{Timeout: time.Second, ReadOnly: true})
	if err != nil {
		t.Fatalf("bolt open %s: %v", path, err)
	}
	defer bdb.Close()
	if err := bdb.View(fn); err != nil {
		t.Fatalf("bolt view: %v", err)
	}
}

// writeLog creates a closed data file in dir holding entries 1..n (term 1,
// 200 bytes of data each), a hard state and a conf state.
func writeLog(t *testing.T, dir string, n uint64) []pb.Entry {
	t.Helper()
	db, err := Open(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	var all []pb.Entry
	for lo := uint64(1); lo <= n; lo += 50 {
		ents := make([]pb.Entry, 0, 50)
		for i := lo; i < lo+50 && i <= n; i++ {
			d := fmt.Appendf(nil, "record %d ", i)
			d = append(d, bytes.Repeat([]byte{byte(i)}, 200-len(d))...)
			ents = append(ents, pb.Entry{Index: i, Term: 1, Data: d})
		}
		mustSave(t, db, pb.HardState{Term: 1, Vote: 1, Commit: ents[len(ents)-1].Index}, ents)
		all = append(all, ents...)
	}
	db.SetConfState(pb.ConfState{Voters: []uint64{1}})
	mustClose(t, db)
	return all
}

// corruptLive flips a data byte of entry idx inside the open DB's file,
// leaving its CRC stale, as a bit flip on the medium would.
func corruptLive(t *testing.T, db *DB, idx uint64) {
	t.Helper()
	err := db.bolt.Update(func(tx *bolt.Tx) error { return flipLastByte(tx, idx) })
	if err != nil {
		t.Fatal(err)
	}
}

func flipLastByte(tx *bolt.Tx, idx uint64) error {
	b := tx.Bucket(bucketLog)
	k, v, _, end, err := entryAt(b, idx)
	if err != nil {
		return err
	}
	c := bytes.Clone(v)
	c[end-1] ^= 0x01
	return b.Put(bytes.Clone(k), c)
}

// entryAt finds entry idx in the log bucket: the key holding it, that key's
// value, and where the entry is in it, its length field included. Of an
// entry in pieces it gives the last piece, all of its value.
func entryAt(lb *bolt.Bucket, idx uint64) (k, v []byte, start, end int, err error) {
	c := lb.Cursor()
	k, v = seekKey(c, idx)
	if k == nil {
		return nil, nil, 0, 0, fmt.Errorf("no entry %d", idx)
	}
	first, kind, _, err := keyIndex(k)
	if err != nil {
		return nil, nil, 0, 0, err
	}
	if kind == keyPiece {
		if first != idx {
			return nil, nil, 0, 0, fmt.Errorf("no entry %d", idx)
		}
		for nk, nv := c.Next(); nk != nil && bytes.HasPrefix(nk, k[:9]); nk, nv = c.Next() {
			k, v = nk, nv
		}
		return k, v, 0, len(v), nil
	}
	run := kind == keyRun
	if !run {
		if first != idx {
			return nil, nil, 0, 0, fmt.Errorf("no entry %d", idx)
		}
		return k, v, 0, len(v), nil
	}
	for i, rest := first, v; len(rest) > 0; i++ {
		_, after, err := nextInRun(i, rest)
		if err != nil {
			return nil, nil, 0, 0, err
		}
		if i == idx {
			return k, v, len(v) - len(rest), len(v) - len(after), nil
		}
		rest = after
	}
	return nil, nil, 0, 0, fmt.Errorf("no entry %d", idx)
}

// putCommit records a hard state of term 1 with the given commit index.
func putCommit(tx *bolt.Tx, commit uint64) error {
	b, err := (&pb.HardState{Term: 1, Vote: 1, Commit: commit}).Marshal()
	if err != nil {
		return err
	}
	return tx.Bucket(bucketRaftState).Put(keyHardState, b)
}

// rekeyRun moves the run holding idx to the key rekey makes of its own.
func rekeyRun(tx *bolt.Tx, idx uint64, rekey func(k []byte) []byte) error {
	b := tx.Bucket(bucketLog)
	k, v, _, _, err := entryAt(b, idx)
	if err != nil {
		return err
	}
	k, v = bytes.Clone(k), bytes.Clone(v)
	if err := b.Delete(k); err != nil {
		return err
	}
	return b.Put(rekey(k), v)
}

// splitRunAround rewrites the run holding idx as two runs, before and
// after it: the entry is gone and the log has a gap there.
func splitRunAround(tx *bolt.Tx, idx uint64) error {
	b := tx.Bucket(bucketLog)
	k, v, start, end, err := entryAt(b, idx)
	if err != nil {
		return err
	}
	k, v = bytes.Clone(k), bytes.Clone(v)
	if err := b.Delete(k); err != nil {
		return err
	}
	if start > 0 {
		if err := b.Put(k, v[:start]); err != nil {
			return err
		}
	}
	if end < len(v) {
		return b.Put(runKey(idx+1), v[end:])
	}
	return nil
}

// checkLog compares db with the MemoryStorage oracle through the whole
// raft.Storage read interface: bounds, Term of every index (including the
// one before the first), Entries for every [lo, hi) and several size limits,
// and the errors past either end. It also appends to every slice Entries
// returns, as raft may, and checks afterwards that storage did not change.
func checkLog(t *testing.T, db *DB, ms *raft.MemoryStorage) {
	t.Helper()
	first, _ := ms.FirstIndex()
	last, _ := ms.LastIndex()
	if got, err := db.FirstIndex(); err != nil || got != first {
		t.Fatalf("FirstIndex = %d, %v; want %d", got, err, first)
	}
	if got, err := db.LastIndex(); err != nil || got != last {
		t.Fatalf("LastIndex = %d, %v; want %d", got, err, last)
	}
	checkTerms := func() {
		t.Helper()
		for i := first - 1; i <= last; i++ {
			want, _ := ms.Term(i)
			if got, err := db.Term(i); err != nil || got != want {
				t.Fatalf("Term(%d) = %d, %v; want %d", i, got, err, want)
			}
		}
	}
	checkTerms()
	if _, err := db.Term(last + 1); !errors.Is(err, raft.ErrUnavailable) {
		t.Fatalf("Term(last+1=%d): err = %v, want ErrUnavailable", last+1, err)
	}
	if _, err := db.Entries(first, last+2, math.MaxUint64); !errors.Is(err, raft.ErrUnavailable) {
		t.Fatalf("Entries(%d, %d) past the last index: err = %v, want ErrUnavailable", first, last+2, err)
	}
	if _, err := db.Entries(first-1, last+1, math.MaxUint64); !errors.Is(err, raft.ErrCompacted) {
		t.Fatalf("Entries(%d, ...) before the first index: err = %v, want ErrCompacted", first-1, err)
	}
	if last < first {
		return
	}
	all, err := ms.Entries(first, last+1, math.MaxUint64)
	if err != nil {
		t.Fatal(err)
	}
	for lo := first; lo <= last; lo++ {
		for hi := lo + 1; hi <= last+1; hi++ {
			var total uint64
			for _, e := range all[lo-first : hi-first] {
				total += uint64(e.Size())
			}
			firstSize := uint64(all[lo-first].Size())
			for _, maxSize := range []uint64{0, firstSize, total - 1, total, math.MaxUint64} {
				want, err := ms.Entries(lo, hi, maxSize)
				if err != nil {
					t.Fatal(err)
				}
				got, err := db.Entries(lo, hi, maxSize)
				if err != nil {
					t.Fatalf("Entries(%d, %d, %d): %v", lo, hi, maxSize, err)
				}
				if d := diffEntries(got, want); d != "" {
					t.Fatalf("Entries(%d, %d, %d): %s", lo, hi, maxSize, d)
				}
				// raft owns the slice and may append to it.
				entrySink = append(got, pb.Entry{Index: hi, Term: math.MaxUint64, Data: []byte("caller's own")})
			}
		}
	}
	got, err := db.Entries(first, last+1, math.MaxUint64)
	if err != nil {
		t.Fatal(err)
	}
	if d := diffEntries(got, all); d != "" {
		t.Fatalf("after callers appended to returned slices, Entries(%d, %d): %s", first, last+1, d)
	}
	checkTerms()
}

var entrySink []pb.Entry

// ---------------------------------------------------------------------------
// 1. Open and reopen

func TestOpenCreatesAndReopenKeepsState(t *testing.T) {
	cs := pb.ConfState{Voters: []uint64{1, 2}, Learners: []uint64{3}, VotersOutgoing: []uint64{1}, LearnersNext: []uint64{4}, AutoLeave: true}
	hs := pb.HardState{Term: 2, Vote: 1, Commit: 3}
	const nodeID = 0x8badf00d12345678
	for _, tc := range []struct {
		name    string
		persist func(db *DB) error // makes SetConfState and SetApplied durable
	}{
		{"Save", func(db *DB) error { return db.Save(pb.HardState{}, nil) }},
		{"Flush", (*DB).Flush},
		{"Sync", (*DB).Sync},
		{"Close", func(*DB) error { return nil }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "var", "lib", "tandem") // does not exist yet
			db := testOpen(t, dir, nil)
			path := filepath.Join(dir, FileName)
			if db.Path() != path {
				t.Errorf("Path() = %q, want %q", db.Path(), path)
			}
			fi, err := os.Stat(path)
			if err != nil {
				t.Fatalf("Open did not create %s: %v", FileName, err)
			}
			if fi.Mode().Perm()&0o007 != 0 {
				t.Errorf("%s has mode %v: readable by any user", FileName, fi.Mode().Perm())
			}

			// A fresh file: an empty log, no state.
			if f, _ := db.FirstIndex(); f != 1 {
				t.Errorf("fresh FirstIndex = %d, want 1", f)
			}
			if l, _ := db.LastIndex(); l != 0 {
				t.Errorf("fresh LastIndex = %d, want 0", l)
			}
			if h, c, err := db.InitialState(); err != nil || !reflect.DeepEqual(h, pb.HardState{}) || !reflect.DeepEqual(c, pb.ConfState{}) {
				t.Errorf("fresh InitialState = %+v, %+v, %v", h, c, err)
			}
			if db.Applied() != 0 || db.NodeID() != 0 {
				t.Errorf("fresh Applied = %d, NodeID = %d, want 0, 0", db.Applied(), db.NodeID())
			}

			ents := makeEntries(1, 5, 2)
			mustSave(t, db, hs, ents)
			// raft hands an empty HardState when it did not change: it must
			// not erase the stored one.
			more := makeEntries(6, 2, 2)
			mustSave(t, db, pb.HardState{}, more)
			ents = append(ents, more...)
			db.SetConfState(cs)
			db.SetApplied(3)
			if err := db.SetNodeID(nodeID); err != nil {
				t.Fatal(err)
			}
			for want := uint64(1); want <= 2; want++ {
				if e, err := db.NextEpoch(); err != nil || e != want {
					t.Fatalf("NextEpoch = %d, %v; want %d", e, err, want)
				}
			}
			if err := tc.persist(db); err != nil {
				t.Fatal(err)
			}
			mustClose(t, db)

			check := func(t *testing.T, db *DB) {
				t.Helper()
				if f, _ := db.FirstIndex(); f != 1 {
					t.Errorf("FirstIndex = %d, want 1", f)
				}
				if l, _ := db.LastIndex(); l != 7 {
					t.Errorf("LastIndex = %d, want 7", l)
				}
				gotHS, gotCS, err := db.InitialState()
				if err != nil {
					t.Fatal(err)
				}
				if !reflect.DeepEqual(gotHS, hs) {
					t.Errorf("hard state = %+v, want %+v", gotHS, hs)
				}
				if !reflect.DeepEqual(gotCS, cs) {
					t.Errorf("conf state = %+v, want %+v", gotCS, cs)
				}
				if s, _ := db.BuildSnapshot(); !reflect.DeepEqual(s.Metadata.ConfState, cs) {
					t.Errorf("snapshot conf state = %+v, want %+v", s.Metadata.ConfState, cs)
				}
				if got := db.HardState(); !reflect.DeepEqual(got, hs) {
					t.Errorf("HardState() = %+v, want %+v", got, hs)
				}
				if db.Applied() != 3 {
					t.Errorf("Applied = %d, want 3", db.Applied())
				}
				if db.NodeID() != nodeID {
					t.Errorf("NodeID = %x, want %x", db.NodeID(), uint64(nodeID))
				}
				got, err := db.Entries(1, 8, math.MaxUint64)
				if err != nil {
					t.Fatal(err)
				}
				if d := diffEntries(got, ents); d != "" {
					t.Errorf("Entries after reopen: %s", d)
				}
				st := db.Stats()
				if st.FirstIndex != 1 || st.LastIndex != 7 || st.Commit != 3 || st.Applied != 3 || st.FileBytes <= 0 {
					t.Errorf("Stats = %+v", st)
				}
			}

			db = testOpen(t, dir, nil)
			check(t, db)
			if e, err := db.NextEpoch(); err != nil || e != 3 {
				t.Errorf("NextEpoch after reopen = %d, %v; want 3", e, err)
			}
			mustClose(t, db)

			// `tandem inspect` sees the same through a read-only open.
			db = testOpen(t, dir, &Options{ReadOnly: true})
			check(t, db)
			if _, err := db.NextEpoch(); err == nil {
				t.Error("NextEpoch on a read-only file succeeded")
			}
		})
	}
}

// ---------------------------------------------------------------------------
// 7. Scan

func TestScan(t *testing.T) {
	db := testOpen(t, t.TempDir(), &Options{TailBytes: 1})
	ents := makeEntries(1, 30, 1)
	mustSave(t, db, pb.HardState{Term: 1, Commit: 30}, ents[:20])
	mustCheckpoint(t, db)                                         // 1..20 from the file,
	mustSave(t, db, pb.HardState{Term: 1, Commit: 30}, ents[20:]) // 21..30 from the WAL
	for _, tc := range []struct {
		name      string
		from      uint64
		stopAfter int // fn returns false on this call; 0 never
		want      []pb.Entry
	}{
		{"all from 1", 1, 0, ents},
		{"from 0", 0, 0, ents},
		{"from the middle", 12, 0, ents[11:]},
		{"from the last", 30, 0, ents[29:]},
		{"past the last", 31, 0, nil},
		{"stop after 5", 7, 5, ents[6:11]},
		{"stop at once", 1, 1, ents[:1]},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got []pb.Entry
			err := db.Scan(tc.from, func(e pb.Entry) bool {
				got = append(got, e)
				return len(got) != tc.stopAfter
			})
			if err != nil {
				t.Fatal(err)
			}
			if d := diffEntries(got, tc.want); d != "" {
				t.Errorf("Scan(%d): %s", tc.from, d)
			}
		})
	}

	// fn may keep the entries: later writes must not change them.
	var kept []pb.Entry
	if err := db.Scan(1, func(e pb.Entry) bool { kept = append(kept, e); return true }); err != nil {
		t.Fatal(err)
	}
	mustSave(t, db, pb.HardState{Term: 2, Commit: 20}, makeEntries(21, 500, 2))
	if d := diffEntries(kept, ents); d != "" {
		t.Errorf("entries kept from Scan changed after later writes: %s", d)
	}

	// Every read checks the CRC.
	corruptLive(t, db, 17)
	var seen []uint64
	err := db.Scan(1, func(e pb.Entry) bool { seen = append(seen, e.Index); return true })
	if !errors.Is(err, ErrCorrupt) || !regexp.MustCompile(`\b17\b`).MatchString(err.Error()) {
		t.Errorf("Scan over a damaged entry 17: %v, want ErrCorrupt naming 17", err)
	}
	if len(seen) != 16 || seen[len(seen)-1] != 16 {
		t.Errorf("Scan handed %v to fn before the damaged entry 17, want 1..16", seen)
	}
	if err := db.Scan(18, func(pb.Entry) bool { return true }); err != nil {
		t.Errorf("Scan from after the damaged entry: %v", err)
	}
	if _, err := db.Entries(10, 20, math.MaxUint64); !errors.Is(err, ErrCorrupt) {
		t.Errorf("Entries over a damaged entry (read from the file): %v, want ErrCorrupt", err)
	}
	if _, err := db.Term(17); !errors.Is(err, ErrCorrupt) {
		t.Errorf("Term of a damaged entry (read from the file): %v, want ErrCorrupt", err)
	}
	// An entry gone from the file is a gap every reader reports.
	if err := db.bolt.Update(func(tx *bolt.Tx) error { return splitRunAround(tx, 5) }); err != nil {
		t.Fatal(err)
	}
	if err := db.Scan(1, func(pb.Entry) bool { return true }); !errors.Is(err, ErrCorrupt) || !regexp.MustCompile(`\b5\b`).MatchString(err.Error()) {
		t.Errorf("Scan over a missing entry 5: %v, want ErrCorrupt naming 5", err)
	}
	if _, err := db.DataRecords(); !errors.Is(err, ErrCorrupt) {
		t.Errorf("DataRecords over a missing entry: %v, want ErrCorrupt", err)
	}

	// A length field damaged inside a run: an error from every reader,
	// never a panic (the daemon reads the file long after Open checked it).
	if err := db.bolt.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketLog)
		k, v, start, _, err := entryAt(b, 12)
		if err != nil {
			return err
		}
		v = bytes.Clone(v)
		binary.PutUvarint(v[start:], uint64(len(v)))
		return b.Put(bytes.Clone(k), v)
	}); err != nil {
		t.Fatal(err)
	}
	if err := db.Scan(6, func(pb.Entry) bool { return true }); !errors.Is(err, ErrCorrupt) {
		t.Errorf("Scan over a damaged run: %v, want ErrCorrupt", err)
	}
	if _, err := db.Entries(8, 15, math.MaxUint64); !errors.Is(err, ErrCorrupt) {
		t.Errorf("Entries over a damaged run: %v, want ErrCorrupt", err)
	}
	if _, err := db.Term(13); !errors.Is(err, ErrCorrupt) {
		t.Errorf("Term past a damaged length in its run: %v, want ErrCorrupt", err)
	}
}
