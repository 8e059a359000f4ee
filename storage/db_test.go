package storage

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
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
	cur, synced := db.wal.cur, db.wal.synced.Load()
	for i, name := range []string{WALName + ".0", WALName + ".1", FileName} {
		b, err := os.ReadFile(filepath.Join(src, name))
		if err != nil {
			t.Fatal(err)
		}
		if i == cur && int64(len(b)) > synced {
			clear(b[synced:]) // not synced yet: lost in the crash
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
// value, and where the entry is in it, its length field included.
func entryAt(lb *bolt.Bucket, idx uint64) (k, v []byte, start, end int, err error) {
	k, v = seekKey(lb.Cursor(), idx)
	if k == nil {
		return nil, nil, 0, 0, fmt.Errorf("no entry %d", idx)
	}
	first, run, err := keyFirst(k, v)
	if err != nil {
		return nil, nil, 0, 0, err
	}
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
				if s, _ := db.Snapshot(); !reflect.DeepEqual(s.Metadata.ConfState, cs) {
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
// 2. The raft.Storage contract

func TestRaftStorageContract(t *testing.T) {
	noop := func(ents []pb.Entry) []pb.Entry { ents[0].Data = nil; return ents } // a new leader's empty entry
	steps := []struct {
		hs   pb.HardState
		ents []pb.Entry
	}{
		{pb.HardState{Term: 1, Vote: 1}, noop(makeEntries(1, 1, 1))},
		{pb.HardState{Term: 1, Vote: 1, Commit: 1}, makeEntries(2, 2, 1)},
		{pb.HardState{Term: 1, Vote: 1, Commit: 3}, makeEntries(4, 5, 1)},
		{pb.HardState{Term: 1, Vote: 1, Commit: 8}, makeEntries(9, 10, 1)},
		{pb.HardState{Term: 1, Vote: 1, Commit: 18}, makeEntries(19, 12, 1)},
		{pb.HardState{Term: 1, Vote: 1, Commit: 30}, nil}, // hard state only
		{pb.HardState{Term: 2, Vote: 2, Commit: 30}, noop(makeEntries(31, 15, 2))},
		{pb.HardState{}, makeEntries(46, 15, 2)},
		// A new leader overwrites the uncommitted tail, shorter than it was.
		{pb.HardState{Term: 3, Vote: 3, Commit: 30}, makeEntries(41, 5, 3)},
		{pb.HardState{}, makeEntries(46, 5, 3)},
		// And once more, at the last index only, growing the log.
		{pb.HardState{Term: 4, Vote: 1, Commit: 40}, makeEntries(50, 3, 4)},
	}
	for _, tc := range []struct {
		name string
		tail int
	}{
		{"whole log in tail cache", 0},
		{"tail cache of one entry", 1},
		{"tail cache ends mid log", 600},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			opts := &Options{TailBytes: tc.tail}
			db := testOpen(t, dir, opts)
			ms := raft.NewMemoryStorage()
			checkLog(t, db, ms)
			if _, err := db.Entries(1, 2, math.MaxUint64); !errors.Is(err, raft.ErrUnavailable) {
				t.Fatalf("Entries(1, 2) on an empty log: err = %v, want ErrUnavailable", err)
			}
			for _, s := range steps {
				mustSave(t, db, s.hs, s.ents)
				if err := ms.Append(s.ents); err != nil {
					t.Fatal(err)
				}
				if !raft.IsEmptyHardState(s.hs) {
					if err := ms.SetHardState(s.hs); err != nil {
						t.Fatal(err)
					}
				}
				// What raft reads right after persisting.
				last, _ := ms.LastIndex()
				if got, _ := db.LastIndex(); got != last {
					t.Fatalf("after Save from %d: LastIndex = %d, want %d", firstIdx(s.ents), got, last)
				}
				wantTerm, _ := ms.Term(last)
				if got, err := db.Term(last); err != nil || got != wantTerm {
					t.Fatalf("after Save from %d: Term(%d) = %d, %v; want %d", firstIdx(s.ents), last, got, err, wantTerm)
				}
			}
			checkLog(t, db, ms)
			wantHS, _, _ := ms.InitialState()
			if hs, _, _ := db.InitialState(); !reflect.DeepEqual(hs, wantHS) {
				t.Errorf("hard state = %+v, want %+v", hs, wantHS)
			}

			mustClose(t, db)
			db = testOpen(t, dir, opts)
			checkLog(t, db, ms)
			if hs, _, _ := db.InitialState(); !reflect.DeepEqual(hs, wantHS) {
				t.Errorf("hard state after reopen = %+v, want %+v", hs, wantHS)
			}
		})
	}
}

// The raft.Storage methods may be called from any goroutine while the
// replication loop saves: readers must always see a consistent log.
func TestConcurrentReadsDuringSaves(t *testing.T) {
	db := testOpen(t, t.TempDir(), &Options{TailBytes: 2000})
	done := make(chan struct{})
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			for {
				select {
				case <-done:
					return
				default:
				}
				last, _ := db.LastIndex()
				if last == 0 {
					continue
				}
				lo := uint64(1)
				if last > 40 {
					lo = last - 40
				}
				got, err := db.Entries(lo, last+1, math.MaxUint64)
				if err != nil {
					t.Errorf("Entries(%d, %d): %v", lo, last+1, err)
					return
				}
				if d := diffEntries(got, makeEntries(lo, last+1-lo, 1)); d != "" {
					t.Errorf("Entries(%d, %d): %s", lo, last+1, d)
					return
				}
				if term, err := db.Term(lo); err != nil || term != 1 {
					t.Errorf("Term(%d) = %d, %v", lo, term, err)
					return
				}
				_ = db.Stats()
			}
		})
	}
	next := uint64(1)
	for i := range 120 {
		n := uint64(i%7 + 1)
		mustSave(t, db, pb.HardState{Term: 1, Commit: next - 1}, makeEntries(next, n, 1))
		next += n
	}
	close(done)
	wg.Wait()
}

// ---------------------------------------------------------------------------
// 3. Conflicting appends and the requeue bucket

// requeued returns the requeue bucket's entries, with the index each had in
// the log (the first 8 bytes of the key).
func requeued(t *testing.T, db *DB) []pb.Entry {
	t.Helper()
	var out []pb.Entry
	err := db.ForEach("requeue", "", func(k, v []byte) error {
		if len(k) < 8 {
			return fmt.Errorf("requeue key %x does not start with the entry's index", k)
		}
		e, err := decodeEntry(binary.BigEndian.Uint64(k), v)
		if err != nil {
			return err
		}
		out = append(out, e)
		return nil
	})
	if err != nil {
		t.Fatalf("ForEach(requeue): %v", err)
	}
	return out
}

func sortEntries(ents []pb.Entry) {
	slices.SortFunc(ents, func(a, b pb.Entry) int {
		if a.Index != b.Index {
			return int(a.Index) - int(b.Index)
		}
		return int(a.Term) - int(b.Term)
	})
}

func TestConflictingAppendRequeuesOverwrittenData(t *testing.T) {
	// The tail a deposed master had: entries 1..10 at term 1, with a conf
	// change at 4, a v2 conf change at 7 and a leader's empty entry at 8.
	base := func() []pb.Entry {
		ents := makeEntries(1, 10, 1)
		ents[3].Type = pb.EntryConfChange
		ents[6].Type = pb.EntryConfChangeV2
		ents[7].Data = nil
		return ents
	}
	for _, tc := range []struct {
		name     string
		from, n  uint64   // the new leader's entries, at term 2
		requeued []uint64 // overwritten data entries
	}{
		{"middle of the log, shorter", 5, 3, []uint64{5, 6, 9, 10}},
		{"whole log", 1, 2, []uint64{1, 2, 3, 5, 6, 9, 10}},
		{"last entry only", 10, 1, []uint64{10}},
		{"overwrite and extend", 9, 5, []uint64{9, 10}},
		{"only a conf change and an empty entry", 7, 2, []uint64{9, 10}},
	} {
		for _, tail := range []int{0, 1} {
			t.Run(fmt.Sprintf("%s/tail=%d", tc.name, tail), func(t *testing.T) {
				dir := t.TempDir()
				opts := &Options{TailBytes: tail}
				db := testOpen(t, dir, opts)
				ms := raft.NewMemoryStorage()
				old := base()
				mustSave(t, db, pb.HardState{Term: 1, Vote: 1}, old)
				if err := ms.Append(old); err != nil {
					t.Fatal(err)
				}
				// Entries read before the overwrite must not be disturbed by it.
				before, err := db.Entries(1, 11, math.MaxUint64)
				if err != nil {
					t.Fatal(err)
				}
				if got := requeued(t, db); len(got) != 0 {
					t.Fatalf("requeue holds %s before any conflict", briefEntries(got))
				}

				ents := makeEntries(tc.from, tc.n, 2)
				mustSave(t, db, pb.HardState{Term: 2, Vote: 2}, ents)
				if err := ms.Append(ents); err != nil {
					t.Fatal(err)
				}

				var want []pb.Entry
				for _, i := range tc.requeued {
					want = append(want, old[i-1])
				}
				check := func() {
					t.Helper()
					got := requeued(t, db)
					sortEntries(got)
					if d := diffEntries(got, want); d != "" {
						t.Errorf("requeue bucket: %s", d)
					}
					checkLog(t, db, ms)
				}
				check()
				if d := diffEntries(before, base()); d != "" {
					t.Errorf("a slice Entries returned before the overwrite changed: %s", d)
				}
				mustClose(t, db)
				db = testOpen(t, dir, opts)
				check()
			})
		}
	}
}

// A node can be deposed twice before replication has drained the requeue
// bucket (a 3-gateway cluster flapping): the second overwrite must not
// destroy what the first one requeued at the same indexes.
func TestRequeueKeepsEntriesOverwrittenTwice(t *testing.T) {
	dir := t.TempDir()
	db := testOpen(t, dir, nil)
	t1 := makeEntries(1, 10, 1)
	mustSave(t, db, pb.HardState{Term: 1}, t1)
	t2 := makeEntries(5, 3, 2) // overwrites 5..10 of term 1
	mustSave(t, db, pb.HardState{Term: 2}, t2)
	t3 := makeEntries(6, 3, 3) // overwrites 6..7 of term 2
	mustSave(t, db, pb.HardState{Term: 3}, t3)

	want := append(slices.Clone(t1[4:]), t2[1:]...)
	sortEntries(want)
	got := requeued(t, db)
	sortEntries(got)
	if d := diffEntries(got, want); d != "" {
		t.Errorf("requeue bucket after two overlapping overwrites: %s\n"+
			"(every overwritten data entry must survive until replication re-proposes it)", d)
	}
	if l, _ := db.LastIndex(); l != 8 {
		t.Errorf("LastIndex = %d, want 8", l)
	}
}

// ---------------------------------------------------------------------------
// 4. Staged metadata

func sessions(t *testing.T, db *DB, prefix string) map[string]string {
	t.Helper()
	m := map[string]string{}
	err := db.ForEach(BucketSessions, prefix, func(k, v []byte) error {
		m[string(k)] = string(v)
		return nil
	})
	if err != nil {
		t.Fatalf("ForEach(%s, %q): %v", BucketSessions, prefix, err)
	}
	return m
}

func TestStagedMetadataCommitsWithSave(t *testing.T) {
	dir := t.TempDir()
	db := testOpen(t, dir, nil)
	db.Stage(BucketSessions, "old", []byte("to be deleted"))
	if err := db.Flush(); err != nil {
		t.Fatal(err)
	}

	db.Stage(BucketSessions, "c/1", []byte("one"))
	db.Stage(BucketSessions, "c/2", []byte("first"))
	db.Stage(BucketSessions, "c/2", []byte("two")) // the last write wins
	db.Stage(BucketSessions, "d/1", nil)           // an empty value, not a delete
	db.StageDelete(BucketSessions, "old")
	if !db.Pending() {
		t.Fatal("Pending() = false after Stage")
	}
	mustSave(t, db, pb.HardState{Term: 1}, makeEntries(1, 3, 1))
	if db.Pending() {
		t.Error("Pending() = true after Save")
	}

	want := map[string]string{"c/1": "one", "c/2": "two", "d/1": ""}
	wantC := map[string]string{"c/1": "one", "c/2": "two"}
	check := func(what string, db *DB) {
		t.Helper()
		if got := sessions(t, db, ""); !reflect.DeepEqual(got, want) {
			t.Errorf("%s: sessions = %v, want %v", what, got, want)
		}
		if got := sessions(t, db, "c/"); !reflect.DeepEqual(got, wantC) {
			t.Errorf("%s: sessions with prefix c/ = %v, want %v", what, got, wantC)
		}
	}
	check("live", db)
	// Committed with the entries: a kill -9 right after Save keeps it.
	crashed := testOpen(t, crashCopy(t, db), &Options{ReadOnly: true})
	check("after a crash right after Save", crashed)
	mustClose(t, db)
	check("after reopen", testOpen(t, dir, nil))
}

func TestSyncMakesStagedDurableWithoutSave(t *testing.T) {
	db := testOpen(t, t.TempDir(), nil)
	db.Stage(BucketSessions, "client/a", []byte("session"))
	// Staging itself costs no fsync: a crash now would not have it. (This
	// checks the crash copy sees only committed data.)
	if got := sessions(t, testOpen(t, crashCopy(t, db), &Options{ReadOnly: true}), ""); len(got) != 0 {
		t.Fatalf("a crash copy taken before Sync holds %v: the crash simulation is broken", got)
	}
	if err := db.Sync(); err != nil {
		t.Fatal(err)
	}
	if db.Pending() {
		t.Error("Pending() = true after Sync")
	}
	want := map[string]string{"client/a": "session"}
	if got := sessions(t, db, ""); !reflect.DeepEqual(got, want) {
		t.Errorf("live sessions after Sync = %v, want %v", got, want)
	}
	if got := sessions(t, testOpen(t, crashCopy(t, db), &Options{ReadOnly: true}), ""); !reflect.DeepEqual(got, want) {
		t.Errorf("sessions after a crash right after Sync = %v, want %v", got, want)
	}
}

// A Stage that returned before a Save started is durable when that Save
// returns, whichever goroutines they run on.
func TestStageBeforeSaveIsNeverLost(t *testing.T) {
	db := testOpen(t, t.TempDir(), &Options{TailBytes: 4096})
	const n = 150
	key := func(i int) string { return fmt.Sprintf("s/%03d", i) }
	staged := make(chan int, n)
	go func() { // the broker
		defer close(staged)
		for i := range n {
			db.Stage(BucketSessions, key(i), []byte(key(i)))
			staged <- i
		}
	}()
	next := uint64(1)
	for i := range staged { // the replication loop
		mustSave(t, db, pb.HardState{Term: 1}, makeEntries(next, 1, 1))
		next++
		// Read from a crash copy: the live DB shows the stage at once.
		if _, ok := sessions(t, crashCopyRO(t, db), key(i))[key(i)]; !ok {
			t.Errorf("%s staged before Save, but not durable after it", key(i))
		}
	}
	if got := sessions(t, crashCopyRO(t, db), "s/"); len(got) != n {
		t.Errorf("%d sessions in the file, want %d", len(got), n)
	}
}

// A hard state that only moved the commit index costs no commit of its own:
// it is written with the next transaction, and a full hard state saved later
// wins over it.
func TestSetCommitRidesWithNextTransaction(t *testing.T) {
	dir := t.TempDir()
	db := testOpen(t, dir, nil)
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1}, makeEntries(1, 5, 1))
	onDisk := func() pb.HardState {
		t.Helper()
		hs, _, err := testOpen(t, crashCopy(t, db), &Options{ReadOnly: true}).InitialState()
		if err != nil {
			t.Fatal(err)
		}
		return hs
	}

	commits := db.Commits()
	c3 := pb.HardState{Term: 1, Vote: 1, Commit: 3}
	db.SetCommit(c3)
	if got := db.HardState(); got != c3 {
		t.Errorf("HardState() after SetCommit = %+v, want %+v", got, c3)
	}
	if db.Commits() != commits {
		t.Errorf("SetCommit cost %d commits of its own", db.Commits()-commits)
	}
	if got := onDisk(); got.Commit != 0 {
		t.Errorf("commit index on disk before the next transaction = %d, want 0", got.Commit)
	}
	mustSave(t, db, pb.HardState{}, makeEntries(6, 2, 1))
	if db.Commits() != commits+1 {
		t.Errorf("Save after SetCommit: %d commits, want 1", db.Commits()-commits)
	}
	if got := onDisk(); got != c3 {
		t.Errorf("hard state on disk after the next Save = %+v, want %+v", got, c3)
	}

	// A staged commit-only hard state must not overwrite a newer full one.
	db.SetCommit(pb.HardState{Term: 1, Vote: 1, Commit: 5})
	full := pb.HardState{Term: 2, Vote: 2, Commit: 5}
	mustSave(t, db, full, makeEntries(8, 1, 2))
	if err := db.Flush(); err != nil {
		t.Fatal(err)
	}
	if got := onDisk(); got != full {
		t.Errorf("hard state on disk = %+v, want the full one saved last %+v", got, full)
	}

	// The applied index on disk never runs ahead of the commit index there:
	// what lies between is applied again after a restart.
	db.SetApplied(7)
	if err := db.Flush(); err != nil {
		t.Fatal(err)
	}
	mustClose(t, db)
	db = testOpen(t, dir, nil)
	if hs, _, _ := db.InitialState(); hs != full {
		t.Errorf("hard state after reopen = %+v, want %+v", hs, full)
	}
	if db.Applied() != 5 {
		t.Errorf("Applied() after reopen = %d, want 5 (the commit index on disk)", db.Applied())
	}
}

// withFileSizeLimit runs fn with RLIMIT_FSIZE set to limit, so any write
// that would grow a file past it fails (EFBIG), as on a full disk. The Go
// runtime ignores the SIGXFSZ this raises. The limit is process-wide: the
// caller must not run in parallel with other tests.
func withFileSizeLimit(t *testing.T, limit int64, fn func()) {
	t.Helper()
	var old syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_FSIZE, &old); err != nil {
		t.Skipf("getrlimit: %v", err)
	}
	lim := old
	lim.Cur = uint64(limit)
	if err := syscall.Setrlimit(syscall.RLIMIT_FSIZE, &lim); err != nil {
		t.Skipf("setrlimit: %v", err)
	}
	restore := func() {
		if err := syscall.Setrlimit(syscall.RLIMIT_FSIZE, &old); err != nil {
			t.Fatalf("restoring RLIMIT_FSIZE: %v", err)
		}
	}
	defer restore()
	fn()
}

// A Save that fails (disk full) is retried by replication once space is
// back. Metadata staged before it - the membership, the broker's sessions -
// must still reach the file; dropping it silently would, after a restart,
// give raft a stale conf state.
func TestFailedSaveKeepsStagedMetadata(t *testing.T) {
	dir := t.TempDir()
	db := testOpen(t, dir, nil)
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1}, makeEntries(1, 3, 1))
	cs := pb.ConfState{Voters: []uint64{1, 2}}
	db.SetConfState(cs)
	db.SetApplied(2)
	db.Stage(BucketSessions, "client/a", []byte("session a"))

	big := makeEntries(4, 1, 1)
	big[0].Data = bytes.Repeat([]byte("x"), 2*walPrealloc) // needs the WAL (or the file) to grow
	hs := pb.HardState{Term: 1, Vote: 1, Commit: 3}
	var limit int64
	for _, name := range []string{FileName, WALName + ".0", WALName + ".1"} {
		fi, err := os.Stat(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		limit = max(limit, fi.Size())
	}
	withFileSizeLimit(t, limit, func() {
		if err := db.Save(hs, big); err == nil {
			t.Fatal("Save grew the file past RLIMIT_FSIZE without an error: the full-disk simulation does not work here")
		}
	})
	if l, _ := db.LastIndex(); l != 3 {
		t.Fatalf("LastIndex after a failed Save = %d, want 3", l)
	}
	mustSave(t, db, hs, big) // the retry, with space back

	if got := sessions(t, crashCopyRO(t, db), ""); got["client/a"] != "session a" {
		t.Errorf("a session staged before a failed Save is not durable after the retried Save: sessions = %v", got)
	}
	db = testOpen(t, crashCopy(t, db), nil) // a crash, not a Close that checkpoints
	if _, got, _ := db.InitialState(); !reflect.DeepEqual(got, cs) {
		t.Errorf("conf state after reopen = %+v, want %+v (staged before a failed Save)", got, cs)
	}
	if db.Applied() != 2 {
		t.Errorf("applied after reopen = %d, want 2", db.Applied())
	}
	if l, _ := db.LastIndex(); l != 4 {
		t.Errorf("LastIndex after reopen = %d, want 4", l)
	}
}

// ---------------------------------------------------------------------------
// 5. Bad files

// openChecked runs Open and turns a panic into a test failure, so one bad
// case does not take the whole package down.
func openChecked(t *testing.T, dir string, opts *Options) (db *DB, err error) {
	t.Helper()
	defer func() {
		if r := recover(); r != nil {
			t.Fatalf("Open panicked: %v", r)
		}
	}()
	return Open(dir, opts)
}

func TestOpenRejectsBadFiles(t *testing.T) {
	path := func(dir string) string { return filepath.Join(dir, FileName) }
	truncate := func(size func(dir string, need int64) int64) func(t *testing.T, dir string) {
		return func(t *testing.T, dir string) {
			t.Helper()
			writeLog(t, dir, 400)
			var need int64
			boltView(t, path(dir), func(tx *bolt.Tx) error { need = tx.Size(); return nil })
			sz := size(dir, need)
			if sz >= need {
				t.Fatalf("fixture: truncating to %d bytes keeps all %d bytes the file needs", sz, need)
			}
			if err := os.Truncate(path(dir), sz); err != nil {
				t.Fatal(err)
			}
		}
	}
	garbage := func(n int) func(t *testing.T, dir string) {
		return func(t *testing.T, dir string) {
			b := make([]byte, n)
			r := rand.NewChaCha8([32]byte{'t', 'a', 'n', 'd', 'e', 'm'})
			r.Read(b)
			if err := os.WriteFile(path(dir), b, 0o640); err != nil {
				t.Fatal(err)
			}
		}
	}
	cases := []struct {
		name  string
		setup func(t *testing.T, dir string)
		want  error
		names string // a number the message must name, e.g. the entry's index
	}{
		{"zero length", func(t *testing.T, dir string) {
			if err := os.WriteFile(path(dir), nil, 0o640); err != nil {
				t.Fatal(err)
			}
		}, ErrCorrupt, ""},
		// Half of what it needs: the file itself is larger, with zeroed
		// space past bbolt's high-water mark (prefill).
		{"truncated to half", truncate(func(_ string, need int64) int64 { return need / 2 }), ErrCorrupt, ""},
		{"truncated by one page", truncate(func(_ string, need int64) int64 { return need - 4096 }), ErrCorrupt, ""},
		{"truncated to 4096 bytes", truncate(func(string, int64) int64 { return 4096 }), ErrCorrupt, ""},
		{"10 bytes of garbage", garbage(10), ErrCorrupt, ""},
		{"64 KiB of garbage", garbage(64 << 10), ErrCorrupt, ""},
		{"locked by another open DB", func(t *testing.T, dir string) {
			writeLog(t, dir, 10)
			testOpen(t, dir, nil) // held until the test ends
		}, ErrInUse, ""},
		{"entry data byte flipped", func(t *testing.T, dir string) {
			writeLog(t, dir, 50)
			boltUpdate(t, path(dir), func(tx *bolt.Tx) error { return flipLastByte(tx, 37) })
		}, ErrCorrupt, "37"},
		{"entry missing from the log", func(t *testing.T, dir string) {
			writeLog(t, dir, 50)
			boltUpdate(t, path(dir), func(tx *bolt.Tx) error { return splitRunAround(tx, 23) })
		}, ErrCorrupt, "23"},
		{"run key with an unknown tag", func(t *testing.T, dir string) {
			writeLog(t, dir, 50)
			boltUpdate(t, path(dir), func(tx *bolt.Tx) error {
				return rekeyRun(tx, 30, func(k []byte) []byte { k[8] = 7; return k })
			})
		}, ErrCorrupt, ""},
		{"log key of 10 bytes", func(t *testing.T, dir string) {
			writeLog(t, dir, 50)
			boltUpdate(t, path(dir), func(tx *bolt.Tx) error {
				return rekeyRun(tx, 30, func(k []byte) []byte { return append(k, 0) })
			})
		}, ErrCorrupt, ""},
		{"entry length inside a run past its end", func(t *testing.T, dir string) {
			writeLog(t, dir, 50)
			boltUpdate(t, path(dir), func(tx *bolt.Tx) error {
				b := tx.Bucket(bucketLog)
				k, v, start, _, err := entryAt(b, 37)
				if err != nil {
					return err
				}
				v = bytes.Clone(v)
				binary.PutUvarint(v[start:], uint64(len(v))) // same width: entries are 213 bytes
				return b.Put(bytes.Clone(k), v)
			})
		}, ErrCorrupt, "37"},
		{"empty value under the last entry's key (format 2)", func(t *testing.T, dir string) {
			writeLog(t, dir, 50)
			boltUpdate(t, path(dir), func(tx *bolt.Tx) error {
				if err := singleEntryKeys(tx); err != nil {
					return err
				}
				if err := putCommit(tx, 10); err != nil { // no "commit past the last entry" to help
					return err
				}
				return tx.Bucket(bucketLog).Put(u64(50), []byte{})
			})
		}, ErrCorrupt, "50"},
		{"bucket under an entry's key (format 2)", func(t *testing.T, dir string) {
			writeLog(t, dir, 50)
			boltUpdate(t, path(dir), func(tx *bolt.Tx) error {
				if err := singleEntryKeys(tx); err != nil {
					return err
				}
				if err := putCommit(tx, 10); err != nil {
					return err
				}
				b := tx.Bucket(bucketLog)
				if err := b.Delete(u64(50)); err != nil {
					return err
				}
				_, err := b.CreateBucket(u64(50))
				return err
			})
		}, ErrCorrupt, "50"},
		{"commit index past the last entry", func(t *testing.T, dir string) {
			writeLog(t, dir, 50)
			boltUpdate(t, path(dir), func(tx *bolt.Tx) error {
				hs := pb.HardState{Term: 1, Vote: 1, Commit: 80}
				b, err := hs.Marshal()
				if err != nil {
					return err
				}
				return tx.Bucket(bucketRaftState).Put(keyHardState, b)
			})
		}, ErrCorrupt, ""},
		{"format version from a newer tandem", func(t *testing.T, dir string) {
			writeLog(t, dir, 10)
			boltUpdate(t, path(dir), func(tx *bolt.Tx) error { return tx.Bucket(bucketMeta).Put(keyFormat, u64(99)) })
		}, ErrUnknownVersion, "99"},
	}
	for _, tc := range cases {
		for _, ro := range []bool{false, true} {
			mode := "read-write"
			if ro {
				mode = "read-only"
			}
			t.Run(tc.name+"/"+mode, func(t *testing.T) {
				dir := t.TempDir()
				tc.setup(t, dir)
				before := fileHash(t, path(dir))
				names := dirNames(t, dir)
				opts := &Options{ReadOnly: ro, LockTimeout: 100 * time.Millisecond}

				start := time.Now()
				db, err := openChecked(t, dir, opts)
				took := time.Since(start)
				if err == nil {
					db.Close()
					t.Fatalf("Open succeeded, want an error wrapping %q", tc.want)
				}
				if !errors.Is(err, tc.want) {
					t.Errorf("Open: %v\nwant an error wrapping %q", err, tc.want)
				}
				if tc.names != "" {
					msg := strings.ReplaceAll(err.Error(), dir, "<dir>")
					if !regexp.MustCompile(`\b` + tc.names + `\b`).MatchString(msg) {
						t.Errorf("Open: %q does not name %s", msg, tc.names)
					}
				}
				if took > 2*time.Second {
					t.Errorf("Open took %v to fail with LockTimeout 100ms", took)
				}
				if fileHash(t, path(dir)) != before {
					t.Errorf("Open changed the file it rejected (%v)", err)
				}
				if got := dirNames(t, dir); !slices.Equal(got, names) {
					t.Errorf("data dir holds %v after the failed Open, before %v", got, names)
				}
			})
		}
	}
}

func TestOpenInUseUntilHolderCloses(t *testing.T) {
	dir := t.TempDir()
	want := writeLog(t, dir, 20)
	holder := testOpen(t, dir, nil)
	const lockTimeout = 100 * time.Millisecond
	start := time.Now()
	_, err := openChecked(t, dir, &Options{LockTimeout: lockTimeout})
	took := time.Since(start)
	if !errors.Is(err, ErrInUse) {
		t.Fatalf("Open of a held file: %v, want ErrInUse", err)
	}
	if took > lockTimeout+time.Second {
		t.Errorf("ErrInUse after %v with LockTimeout %v", took, lockTimeout)
	}
	mustClose(t, holder)
	// The next daemon starts once the old one has let go.
	db := testOpen(t, dir, &Options{LockTimeout: lockTimeout})
	got, err := db.Entries(1, 21, math.MaxUint64)
	if err != nil || diffEntries(got, want) != "" {
		t.Errorf("entries after the holder closed: %v %s", err, diffEntries(got, want))
	}
}

func TestReadOnlyOpenOfMissingDirCreatesNothing(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "no", "such", "dir")
	db, err := openChecked(t, dir, &Options{ReadOnly: true})
	if err == nil {
		db.Close()
		t.Fatal("read-only Open of a missing dir succeeded")
	}
	if _, serr := os.Stat(filepath.Dir(filepath.Dir(dir))); !errors.Is(serr, fs.ErrNotExist) {
		t.Errorf("read-only Open created %s (stat: %v)", filepath.Dir(filepath.Dir(dir)), serr)
	}

	// An existing dir without a data file: nothing created either.
	empty := t.TempDir()
	if db, err := openChecked(t, empty, &Options{ReadOnly: true}); err == nil {
		db.Close()
		t.Fatal("read-only Open of a dir without a data file succeeded")
	}
	if names := dirNames(t, empty); len(names) != 0 {
		t.Errorf("read-only Open created %v", names)
	}
}

// A power cut tears the newest meta page; bbolt then opens the previous
// commit (one that was never acked). That must work whatever page size the
// file was created with: bbolt uses the OS page size, which is 16 KiB on a
// Raspberry Pi 5 kernel and 64 KiB on some arm64 distributions.
func TestOpenFallsBackPastTornMetaPage(t *testing.T) {
	for _, pageSize := range []int{4096, 16384, 65536} {
		for _, torn := range []int{0, 1} {
			t.Run(fmt.Sprintf("page=%d/meta%d", pageSize, torn), func(t *testing.T) {
				dir := t.TempDir()
				path := filepath.Join(dir, FileName)
				bdb, err := bolt.Open(path, 0o640, &bolt.Options{PageSize: pageSize})
				if err != nil {
					t.Fatal(err)
				}
				bdb.Close()

				db := testOpen(t, dir, nil)
				first := makeEntries(1, 5, 1)
				mustSave(t, db, pb.HardState{Term: 1, Commit: 5}, first)
				mustCheckpoint(t, db)
				var txid int
				if err := db.bolt.View(func(tx *bolt.Tx) error { txid = tx.ID(); return nil }); err != nil {
					t.Fatal(err)
				}
				if (txid+1)%2 != torn { // bbolt writes commit N to meta page N%2
					if _, err := db.NextEpoch(); err != nil {
						t.Fatal(err)
					}
				}
				second := makeEntries(6, 5, 1)
				mustSave(t, db, pb.HardState{Term: 1, Commit: 10}, second)
				mustClose(t, db) // its checkpoint is the commit whose meta page tears

				boltView(t, path, func(tx *bolt.Tx) error {
					if tx.ID()%2 != torn || tx.DB().Info().PageSize != pageSize {
						t.Fatalf("fixture: last commit %d with page size %d, want meta%d and %d", tx.ID(), tx.DB().Info().PageSize, torn, pageSize)
					}
					return nil
				})
				xorByte(t, path, int64(torn*pageSize)+16+56, 0xff) // the meta page's checksum
				// bbolt itself falls back to the previous commit.
				boltView(t, path, func(tx *bolt.Tx) error {
					if last, err := lastLogIndex(tx.Bucket(bucketLog)); err != nil || last != 5 {
						t.Fatalf("fixture: bbolt does not fall back to the commit holding entries 1..5")
					}
					return nil
				})

				// The WAL frames of 6..10 carry the id that commit records:
				// they are replayed, so the torn checkpoint loses nothing.
				want := append(slices.Clone(first), second...)
				for _, ro := range []bool{true, false} {
					db, err := openChecked(t, dir, &Options{ReadOnly: ro})
					if err != nil {
						t.Fatalf("Open(ReadOnly=%v) after a torn meta page: %v", ro, err)
					}
					got, err := db.Entries(1, 11, math.MaxUint64)
					if d := diffEntries(got, want); err != nil || d != "" {
						t.Errorf("ReadOnly=%v: entries after the fallback: %v %s", ro, err, d)
					}
					if l, _ := db.LastIndex(); l != 10 {
						t.Errorf("ReadOnly=%v: LastIndex = %d, want 10", ro, l)
					}
					mustClose(t, db)
				}
			})
		}
	}
}

// childEnv, when set, makes TestOpenDamagedPage open that dir and print the
// outcome instead of running: bbolt may crash the process on a damaged
// page, and only a child process can show that without killing the suite.
const childEnv = "TANDEM_STORAGE_TEST_OPEN_DIR"

// A page of the log damaged on the medium (SD cards and eMMC do that) must
// stop the daemon with ErrCorrupt and a message, not a Go panic, and must
// not be written to.
func TestOpenDamagedPage(t *testing.T) {
	if dir := os.Getenv(childEnv); dir != "" {
		_, err := Open(dir, &Options{ReadOnly: os.Getenv(childEnv+"_RO") == "1", LockTimeout: 100 * time.Millisecond})
		fmt.Printf("\nOPEN-RESULT corrupt=%v err=%v\n", errors.Is(err, ErrCorrupt), err)
		return
	}
	for _, ro := range []bool{true, false} {
		t.Run(fmt.Sprintf("ReadOnly=%v", ro), func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, FileName)
			writeLog(t, dir, 400)
			// Give the first leaf page under the log bucket's root an
			// impossible page type.
			var leaf uint64
			var pageSize int64
			boltView(t, path, func(tx *bolt.Tx) error {
				pageSize = int64(tx.DB().Info().PageSize)
				root := uint64(tx.Bucket(bucketLog).RootPage())
				hdr := make([]byte, 32)
				f, err := os.Open(path)
				if err != nil {
					return err
				}
				defer f.Close()
				if _, err := f.ReadAt(hdr, int64(root)*pageSize); err != nil {
					return err
				}
				if hdr[8]&0x01 == 0 {
					t.Fatalf("fixture: the log bucket's root page %d is not a branch page", root)
				}
				leaf = binary.LittleEndian.Uint64(hdr[16+8:])
				return nil
			})
			f, err := os.OpenFile(path, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := f.WriteAt([]byte{0x20, 0}, int64(leaf)*pageSize+8); err != nil {
				t.Fatal(err)
			}
			f.Close()
			before := fileHash(t, path)

			cmd := exec.Command(os.Args[0], "-test.run=^TestOpenDamagedPage$", "-test.count=1")
			cmd.Env = append(os.Environ(), childEnv+"="+dir, fmt.Sprintf("%s_RO=%d", childEnv, map[bool]int{false: 0, true: 1}[ro]))
			out, err := cmd.CombinedOutput()
			var ee *exec.Error
			if errors.As(err, &ee) || errors.Is(err, syscall.ENOEXEC) {
				t.Skipf("cannot run the test binary as a child: %v", err)
			}
			result := regexp.MustCompile(`OPEN-RESULT .*`).Find(out)
			switch {
			case err != nil || result == nil:
				lines := strings.SplitN(string(out), "\n", 12)
				t.Errorf("Open of a file with a damaged page crashed the process (%v) instead of returning ErrCorrupt:\n%s",
					err, strings.Join(lines[:min(len(lines), 11)], "\n"))
			case !bytes.Contains(result, []byte("corrupt=true")):
				t.Errorf("Open of a file with a damaged page: %s, want ErrCorrupt", result)
			}
			if fileHash(t, path) != before {
				t.Error("Open wrote to a file with a damaged page")
			}
		})
	}
}

// ---------------------------------------------------------------------------
// 6. Read-only open

func TestReadOnlyOpenReadsWithoutWriting(t *testing.T) {
	dir := t.TempDir()
	want := writeLog(t, dir, 120)
	path := filepath.Join(dir, FileName)
	before := fileHash(t, path)

	db := testOpen(t, dir, &Options{ReadOnly: true})
	other := testOpen(t, dir, &Options{ReadOnly: true}) // two `tandem inspect` at once
	for _, db := range []*DB{db, other} {
		var got []pb.Entry
		if err := db.Scan(1, func(e pb.Entry) bool { got = append(got, e); return true }); err != nil {
			t.Fatal(err)
		}
		if d := diffEntries(got, want); d != "" {
			t.Errorf("Scan on a read-only open: %s", d)
		}
	}
	if hs, cs, _ := db.InitialState(); hs.Commit != 120 || !reflect.DeepEqual(cs.Voters, []uint64{1}) {
		t.Errorf("InitialState = %+v, %+v", hs, cs)
	}
	if err := db.Save(pb.HardState{Term: 1, Commit: 121}, makeEntries(121, 1, 1)); err == nil {
		t.Error("Save on a read-only open succeeded")
	}
	if l, _ := db.LastIndex(); l != 120 {
		t.Errorf("LastIndex after a refused Save = %d, want 120", l)
	}
	if err := db.SetNodeID(7); err == nil {
		t.Error("SetNodeID on a read-only open succeeded")
	}
	db.Stage(BucketSessions, "k", []byte("v"))
	db.SetApplied(5)
	mustClose(t, db)
	mustClose(t, other)
	if fileHash(t, path) != before {
		t.Error("a read-only open changed the file")
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
