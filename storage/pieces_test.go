package storage

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	bolt "go.etcd.io/bbolt"
	"go.etcd.io/raft/v3"
	pb "go.etcd.io/raft/v3/raftpb"
)

// sizedEntries returns entries from index lo at term, one per size, each
// with that many bytes of data that differ from index to index and along
// the entry, so that a piece out of place or of another entry shows.
func sizedEntries(lo, term uint64, sizes ...int) []pb.Entry {
	ents := make([]pb.Entry, len(sizes))
	for i, n := range sizes {
		idx := lo + uint64(i)
		d := make([]byte, n)
		for j := range d {
			d[j] = byte(idx*31 + term + uint64(j/997))
		}
		ents[i] = pb.Entry{Index: idx, Term: term, Type: pb.EntryNormal, Data: d}
	}
	return ents
}

// pieceSizes are data sizes around the run limit of pages of ps bytes,
// and large ones: the largest entry a run holds, the smallest in pieces,
// one that fills its pieces exactly, records of 64 KiB, 300 KiB and 1 MiB,
// small ones between them.
func pieceSizes(ps int) []int {
	rb, pcs := runBytes(ps), pieceBytes(ps)
	return []int{
		10, rb - entryHdr - 2, rb - entryHdr - 1, 100,
		3*pcs - 3 - entryHdr, 5, 64 << 10, 300 << 10, 10, 1 << 20, 7,
	}
}

// logKeys counts the log bucket's keys by kind and the bucket's overflow
// pages.
func logKeys(t *testing.T, path string) (singles, runs, pieces, overflow int) {
	t.Helper()
	boltView(t, path, func(tx *bolt.Tx) error {
		lb := tx.Bucket(bucketLog)
		c := lb.Cursor()
		for k, _ := c.First(); k != nil; k, _ = c.Next() {
			_, kind, _, err := keyIndex(k)
			if err != nil {
				return err
			}
			switch kind {
			case keySingle:
				singles++
			case keyRun:
				runs++
			case keyPiece:
				pieces++
			}
		}
		overflow = lb.Stats().LeafOverflowN
		return nil
	})
	return
}

func fileFormat(t *testing.T, path string) uint64 {
	t.Helper()
	var f uint64
	boltView(t, path, func(tx *bolt.Tx) error {
		f = metaU64(tx, bucketMeta, keyFormat)
		return nil
	})
	return f
}

// Entries too big for a run are stored in pieces of a page each and read
// back whole through every reader: raft's Entries and Term over every
// range, Scan from every index (a seek into the middle of the log, into
// and past an entry in pieces), after a restart and read-only; the file
// holds no overflow pages for them, and says format 4 so that a release
// that cannot read pieces refuses it.
func TestEntriesInPiecesReadBackWhole(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, FileName)
	opts := &Options{TailBytes: 1} // reads come from the file
	db := testOpen(t, dir, opts)
	ps := db.bolt.Info().PageSize
	ms := raft.NewMemoryStorage()
	sizes := pieceSizes(ps)
	ents := sizedEntries(1, 1, sizes...)
	// Two checkpoints, the second appending to a log that ends in pieces.
	for i, part := range [][]pb.Entry{ents[:8], ents[8:]} {
		mustSave(t, db, pb.HardState{Term: 1, Vote: 1, Commit: part[len(part)-1].Index}, part)
		mustCheckpoint(t, db)
		if err := ms.Append(part); err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			seekPastPieces(t, db, part[len(part)-1])
		}
	}
	checkLog(t, db, ms)
	scanAll := func(db *DB) {
		t.Helper()
		for from := uint64(0); from <= uint64(len(ents))+1; from++ {
			var got []pb.Entry
			if err := db.Scan(from, func(e pb.Entry) bool { got = append(got, e); return true }); err != nil {
				t.Fatalf("Scan(%d): %v", from, err)
			}
			want := ents[min(max(from, 1)-1, uint64(len(ents))):]
			if d := diffEntries(got, want); d != "" {
				t.Fatalf("Scan(%d): %s", from, d)
			}
		}
	}
	scanAll(db)
	if n, err := db.DataRecords(); err != nil || n != len(ents) {
		t.Errorf("DataRecords = %d, %v; want %d", n, err, len(ents))
	}
	mustClose(t, db)

	_, runs, pieces, overflow := logKeys(t, path)
	if pieces == 0 || runs == 0 {
		t.Errorf("the log holds %d runs and %d pieces, want some of each", runs, pieces)
	}
	if min := (1<<20 + 300<<10) / pieceBytes(ps); pieces < min {
		t.Errorf("%d pieces, want at least %d", pieces, min)
	}
	if overflow > 1 {
		t.Errorf("the log bucket has %d overflow pages, want one at most (the last leaf)", overflow)
	}
	if f := fileFormat(t, path); f != formatPieces {
		t.Errorf("format %d with entries in pieces, want %d", f, formatPieces)
	}

	for _, ro := range []bool{false, true} {
		db := testOpen(t, dir, &Options{TailBytes: 1, ReadOnly: ro})
		checkLog(t, db, ms)
		scanAll(db)
		mustClose(t, db)
	}
}

// seekPastPieces checks a seek past the end of a log whose last entry,
// last, is in pieces: the cursor goes back to its first piece, reads it
// whole, and ends there.
func seekPastPieces(t *testing.T, db *DB, last pb.Entry) {
	t.Helper()
	err := db.bolt.View(func(tx *bolt.Tx) error {
		lb := tx.Bucket(bucketLog)
		if k, _ := seekKey(lb.Cursor(), last.Index+1); !bytes.Equal(k, pieceKey(last.Index, 0)) {
			return fmt.Errorf("seekKey past the end gave key %x, want the last entry's first piece", k)
		}
		lc := newLogCursor(lb)
		if err := lc.seek(last.Index + 1); err != nil {
			return err
		}
		if idx, v, err := lc.entry(); err != nil || v != nil {
			return fmt.Errorf("entry after seeking past the end: %d, %d bytes, %v; want the end", idx, len(v), err)
		}
		return eachEntry(lb, last.Index, func(idx uint64, v []byte) (bool, error) {
			e, err := decodeEntry(idx, v)
			if err == nil && diffEntries([]pb.Entry{e}, []pb.Entry{last}) != "" {
				err = fmt.Errorf("entry %d read back as %s", idx, diffEntries([]pb.Entry{e}, []pb.Entry{last}))
			}
			return false, err
		})
	})
	if err != nil {
		t.Fatal(err)
	}
}

// A file whose log holds no entry in pieces stays at format 3, which the
// releases before pieces read: going back to one stays possible until an
// entry needs pieces.
func TestFormatStaysThreeWithoutPieces(t *testing.T) {
	dir := t.TempDir()
	db := testOpen(t, dir, nil)
	ps := db.bolt.Info().PageSize
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1, Commit: 3}, sizedEntries(1, 1, 10, runBytes(ps)-entryHdr-2, 100))
	mustClose(t, db)
	if f := fileFormat(t, filepath.Join(dir, FileName)); f != formatRuns {
		t.Errorf("format %d without entries in pieces, want %d", f, formatRuns)
	}
	if _, _, pieces, _ := logKeys(t, filepath.Join(dir, FileName)); pieces != 0 {
		t.Errorf("%d pieces for entries that fit runs", pieces)
	}
}

// A new leader's append over entries in pieces moves them to the requeue
// bucket whole and deletes every piece; the log reads on as the oracle's.
func TestOverwriteOfEntriesInPieces(t *testing.T) {
	dir := t.TempDir()
	db := testOpen(t, dir, &Options{TailBytes: 1})
	ps := db.bolt.Info().PageSize
	ms := raft.NewMemoryStorage()
	ents := sizedEntries(1, 1, pieceSizes(ps)...)
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1, Commit: 5}, ents)
	mustCheckpoint(t, db)
	if err := ms.Append(ents); err != nil {
		t.Fatal(err)
	}
	// From 7 (64 KiB) on, term 2: smaller, then one in pieces again.
	over := sizedEntries(7, 2, 50, 200<<10, 3)
	mustSave(t, db, pb.HardState{Term: 2, Vote: 2, Commit: 5}, over)
	mustCheckpoint(t, db)
	if err := ms.Append(over); err != nil {
		t.Fatal(err)
	}
	checkLog(t, db, ms)
	got := requeued(t, db)
	sortEntries(got)
	if d := diffEntries(got, ents[6:]); d != "" {
		t.Errorf("requeued after the overwrite: %s", d)
	}
	mustClose(t, db)
	db = testOpen(t, dir, &Options{TailBytes: 1})
	checkLog(t, db, ms)
	mustClose(t, db)
}

// What a power cut leaves of entries in pieces reads back: those only in
// the WAL, and those a checkpoint wrote into the file, with later ones in
// the WAL again.
func TestEntriesInPiecesSurviveAPowerCut(t *testing.T) {
	db := testOpen(t, t.TempDir(), &Options{TailBytes: 4 << 20})
	ps := db.bolt.Info().PageSize
	ents := sizedEntries(1, 1, pieceSizes(ps)...)
	check := func(what string, upTo int) {
		t.Helper()
		c := testOpen(t, crashCopy(t, db), &Options{ReadOnly: true, TailBytes: 1})
		defer mustClose(t, c)
		got, err := c.Entries(1, uint64(upTo)+1, math.MaxUint64)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if d := diffEntries(got, ents[:upTo]); d != "" {
			t.Errorf("%s: %s", what, d)
		}
	}
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1, Commit: 8}, ents[:8])
	check("in the WAL only", 8)
	mustCheckpoint(t, db)
	check("checkpointed", 8)
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1, Commit: uint64(len(ents))}, ents[8:])
	check("checkpointed, then more in the WAL", len(ents))
	mustCheckpoint(t, db)
	check("all checkpointed", len(ents))
}

// pieceDamages are what a bad medium may do to an entry in pieces, each a
// damage the checks must name, never skip.
var pieceDamages = []struct {
	name   string
	damage func(lb *bolt.Bucket, idx uint64, n int) error // n: the entry's pieces
	says   string                                         // in Open's error
}{
	{"first piece missing", func(lb *bolt.Bucket, idx uint64, n int) error {
		return lb.Delete(pieceKey(idx, 0))
	}, "pieces before piece 1 are missing"},
	{"middle piece missing", func(lb *bolt.Bucket, idx uint64, n int) error {
		return lb.Delete(pieceKey(idx, uint32(n/2)))
	}, "is missing"},
	{"last piece missing", func(lb *bolt.Bucket, idx uint64, n int) error {
		return lb.Delete(pieceKey(idx, uint32(n-1)))
	}, "a piece is missing or torn"},
	{"piece torn", func(lb *bolt.Bucket, idx uint64, n int) error {
		k := pieceKey(idx, uint32(n/2))
		v := bytes.Clone(lb.Get(k))
		return lb.Put(k, v[:len(v)/2])
	}, "a piece is missing or torn"},
	{"piece flipped", func(lb *bolt.Bucket, idx uint64, n int) error {
		k := pieceKey(idx, uint32(n/2))
		v := bytes.Clone(lb.Get(k))
		v[len(v)/3] ^= 0x10
		return lb.Put(k, v)
	}, "fails its CRC"},
}

// countPieces is the number of pieces of entry idx in the closed file.
func countPieces(t *testing.T, path string, idx uint64) int {
	t.Helper()
	n := 0
	boltView(t, path, func(tx *bolt.Tx) error {
		c := tx.Bucket(bucketLog).Cursor()
		for k, _ := c.Seek(u64(idx)); k != nil && binary.BigEndian.Uint64(k) == idx; k, _ = c.Next() {
			n++
		}
		return nil
	})
	return n
}

// A missing, torn or damaged piece is damage as a failed CRC is: Open and
// Verify refuse the file naming the entry (storage.on_damage takes it from
// there), the survey names that index alone, Repair loses that index alone
// and copies every other entry, and what a damaged member re-publishes
// leaves it out.
func TestDamagedPieceIsDamage(t *testing.T) {
	for _, tc := range pieceDamages {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			db := testOpen(t, dir, nil)
			ps := db.bolt.Info().PageSize
			ents := sizedEntries(1, 1, pieceSizes(ps)...)
			mustSave(t, db, pb.HardState{Term: 1, Vote: 1, Commit: uint64(len(ents))}, ents)
			db.SetConfState(pb.ConfState{Voters: []uint64{1}})
			mustClose(t, db)
			const bad = 8 // the 300 KiB entry
			path := filepath.Join(dir, FileName)
			n := countPieces(t, path, bad)
			if n < 100 {
				t.Fatalf("fixture: entry %d has %d pieces", bad, n)
			}
			boltUpdate(t, path, func(tx *bolt.Tx) error { return tc.damage(tx.Bucket(bucketLog), bad, n) })

			_, err := Open(dir, nil)
			if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), fmt.Sprintf("entry %d", bad)) {
				t.Fatalf("Open: %v, want ErrCorrupt naming entry %d", err, bad)
			}
			if !strings.Contains(err.Error(), tc.says) {
				t.Errorf("Open: %v, want it to say %q", err, tc.says)
			}
			if err := Verify(dir); !errors.Is(err, ErrCorrupt) {
				t.Errorf("Verify: %v, want ErrCorrupt", err)
			}

			last := uint64(len(ents))
			s := SurveyDamaged(dir)
			if want := []IndexRange{{1, bad - 1}, {bad + 1, last}}; !s.Opened || !reflect.DeepEqual(s.Readable, want) {
				t.Errorf("survey: readable %v (opened %v), want %v", s.Readable, s.Opened, want)
			}
			if want := []IndexRange{{bad, bad}}; !reflect.DeepEqual(s.Unreadable, want) {
				t.Errorf("survey: unreadable %v, want %v", s.Unreadable, want)
			}

			got, rep := repairedEntries(t, dir)
			if want := []LostRange{{bad, bad}}; !slices.Equal(rep.Lost, want) {
				t.Errorf("repair lost %v, want %v", rep.Lost, want)
			}
			if len(got) != len(ents) {
				t.Fatalf("%d entries after the repair, want %d", len(got), len(ents))
			}
			for i := range ents {
				switch {
				case ents[i].Index == bad && len(got[i].Data) != 0:
					t.Errorf("lost index %d holds %d bytes, want an empty entry", bad, len(got[i].Data))
				case ents[i].Index != bad && diffEntries(got[i:i+1], ents[i:i+1]) != "":
					t.Errorf("index %d: %s", ents[i].Index, diffEntries(got[i:i+1], ents[i:i+1]))
				}
			}

			into := testOpen(t, t.TempDir(), nil)
			defer mustClose(t, into)
			if k, err := into.RequeueSalvaged(dir, 2); err != nil || k != len(ents)-3 {
				t.Errorf("RequeueSalvaged = %d, %v; want the %d intact entries past 2 but %d", k, err, len(ents)-3, bad)
			}
		})
	}
}

// Repair reads entries in pieces page by page too, when bbolt cannot reach
// the log from either meta page.
func TestRepairFindsPiecesPageByPage(t *testing.T) {
	dir := t.TempDir()
	db := testOpen(t, dir, nil)
	ps := db.bolt.Info().PageSize
	ents := sizedEntries(1, 1, pieceSizes(ps)...)
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1, Commit: uint64(len(ents))}, ents)
	db.SetConfState(pb.ConfState{Voters: []uint64{1}})
	mustClose(t, db)
	path := filepath.Join(dir, FileName)
	zeroPage(t, path, 0, int64(ps))
	zeroPage(t, path, 1, int64(ps))
	got, rep := repairedEntries(t, dir)
	if len(rep.Lost) != 0 {
		t.Errorf("lost %v, want none", rep.Lost)
	}
	if d := diffEntries(got, ents); d != "" {
		t.Errorf("after the repair: %s", d)
	}
}
