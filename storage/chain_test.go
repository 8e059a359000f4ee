package storage

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	pb "go.etcd.io/raft/v3/raftpb"
)

// crashCopyChain is crashCopyHeld in format 6: every file of the data dir,
// with the current segment cleared past what was synced. It holds wmu
// throughout: a file read while frames are appended could show a later
// frame without an earlier one, which no crash leaves.
func crashCopyChain(t *testing.T, db *DB, src, dir string) string {
	t.Helper()
	db.wmu.Lock()
	defer db.wmu.Unlock()
	cur, synced := db.wal.cur, db.wal.synced.Load()
	des, err := os.ReadDir(src)
	if err != nil {
		t.Fatal(err)
	}
	for _, de := range des {
		name := de.Name()
		if name != FileName && !strings.HasPrefix(name, WALName+".") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(src, name))
		if err != nil {
			t.Fatal(err)
		}
		if name == filepath.Base(walPath(src, cur)) && int64(len(b)) > synced {
			clear(b[synced:])
		}
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o640); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// bigEntries returns n entries from lo of term, each with size bytes of
// data, so that a few thousand fill several segments.
func bigEntries(lo, n, term uint64, size int) []pb.Entry {
	ents := makeEntries(lo, n, term)
	for i := range ents {
		ents[i].Data = append(ents[i].Data, bytes.Repeat([]byte{byte(i)}, size)...)
	}
	return ents
}

// sameLog checks that db's whole log is want, through Entries (in one
// call and entry by entry), Term and Scan.
func sameLog(t *testing.T, db *DB, want []pb.Entry) {
	t.Helper()
	first, _ := db.FirstIndex()
	last, _ := db.LastIndex()
	if len(want) > 0 && (first != want[0].Index || last != want[len(want)-1].Index) {
		t.Fatalf("log is [%d, %d], want [%d, %d]", first, last, want[0].Index, want[len(want)-1].Index)
	}
	got, err := db.Entries(first, last+1, math.MaxUint64)
	if err != nil {
		t.Fatalf("Entries(%d, %d): %v", first, last+1, err)
	}
	if d := diffEntries(got, want); d != "" {
		t.Fatalf("Entries: %s", d)
	}
	for i := range want {
		if term, err := db.Term(want[i].Index); err != nil || term != want[i].Term {
			t.Fatalf("Term(%d) = %d, %v; want %d", want[i].Index, term, err, want[i].Term)
		}
		one, err := db.Entries(want[i].Index, want[i].Index+1, 0)
		if err != nil {
			t.Fatalf("Entries(%d): %v", want[i].Index, err)
		}
		if d := diffEntries(one, want[i:i+1]); d != "" {
			t.Fatalf("Entries(%d): %s", want[i].Index, d)
		}
	}
	var scanned []pb.Entry
	if err := db.Scan(first, func(e pb.Entry) bool { scanned = append(scanned, e); return true }); err != nil {
		t.Fatalf("Scan: %v", err)
	}
	if d := diffEntries(scanned, want); d != "" {
		t.Fatalf("Scan: %s", d)
	}
}

// segmentFiles lists the data dir's segments.
func segmentFiles(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	for _, n := range dirNames(t, dir) {
		if strings.HasPrefix(n, WALName+".") && n != WALName+".0" && n != WALName+".1" {
			out = append(out, n)
		}
	}
	return out
}

// In format 6 the log is written once, into the WAL's segments, and read
// from there: Entries, Term and Scan return what Save was given across
// many segments and checkpoints, after a clean reopen, read-only, and
// from a crash copy taken at any moment; the data file takes none of the
// entries' bytes.
func TestChainKeepsTheLogInTheWAL(t *testing.T) {
	dir := t.TempDir()
	db := testOpen(t, dir, &Options{segmented: true, TailBytes: 8 << 10})
	if !db.chain {
		t.Fatal("a new data dir opened with segmented is not in format 6")
	}
	rng := rand.New(rand.NewPCG(1, 2))
	var want []pb.Entry
	var crashes []struct {
		dir  string
		want int
	}
	next := uint64(1)
	var staged string
	for len(want) < 3000 {
		n := uint64(1 + rng.IntN(40))
		ents := bigEntries(next, n, 1, 1000)
		mustSave(t, db, pb.HardState{Term: 1, Vote: 1, Commit: next - 1}, ents)
		staged = fmt.Sprint(next)
		db.Stage(BucketSessions, "s", []byte(staged))
		want = append(want, ents...)
		next += n
		if rng.IntN(10) == 0 {
			mustCheckpoint(t, db)
		}
		if rng.IntN(40) == 0 {
			crashes = append(crashes, struct {
				dir  string
				want int
			}{crashCopy(t, db), len(want)})
		}
	}
	if n := len(segmentFiles(t, dir)); n < 3 {
		t.Fatalf("%d segments for %d entries of 1 KiB: the WAL did not go on into new ones", n, len(want))
	}
	sameLog(t, db, want)
	w := db.Written()
	if w.Data*20 > w.WAL {
		t.Errorf("the data file wrote %d bytes, the WAL %d: the entries were written twice", w.Data, w.WAL)
	}
	mustClose(t, db)

	db = testOpen(t, dir, &Options{TailBytes: 8 << 10})
	sameLog(t, db, want)
	var got string
	if err := db.ForEach(BucketSessions, "s", func(k, v []byte) error { got = string(v); return nil }); err != nil {
		t.Fatal(err)
	}
	if got != staged {
		t.Fatalf("staged value after a reopen: %q, want %q, the last staged", got, staged)
	}
	mustClose(t, db)
	sameLog(t, testOpen(t, dir, &Options{ReadOnly: true}), want)

	if len(crashes) == 0 {
		t.Fatal("no crash copy taken")
	}
	for _, c := range crashes {
		db := testOpen(t, c.dir, nil)
		sameLog(t, db, want[:c.want])
		// It goes on from where the crash left it.
		more := bigEntries(uint64(c.want)+1, 5, 2, 10)
		mustSave(t, db, pb.HardState{Term: 2, Vote: 1}, more)
		mustClose(t, db)
		sameLog(t, testOpen(t, c.dir, nil), append(append([]pb.Entry(nil), want[:c.want]...), more...))
	}
}

// An append that overwrites entries wins over them, within a segment and
// back across segments, and the data entries it overwrites move to the
// requeue bucket in the same frame: nothing a deposed master acked is
// dropped. A reopen, and a crash copy, see the same.
func TestChainOverwritesRequeue(t *testing.T) {
	dir := t.TempDir()
	db := testOpen(t, dir, &Options{segmented: true, TailBytes: 4 << 10})
	log := bigEntries(1, 1500, 1, 1000) // two segments and more
	for i := 0; i < len(log); i += 50 {
		mustSave(t, db, pb.HardState{Term: 1, Vote: 1}, log[i:i+50])
	}
	// Term 2 takes over from 1001 (back in an earlier segment), then
	// term 3 from 1201.
	over := bigEntries(1001, 300, 2, 100)
	mustSave(t, db, pb.HardState{Term: 2, Vote: 2}, over)
	want := append(append([]pb.Entry(nil), log[:1000]...), over...)
	sameLog(t, db, want)
	over3 := bigEntries(1201, 10, 3, 100)
	mustSave(t, db, pb.HardState{Term: 3, Vote: 3}, over3)
	want = append(want[:1200], over3...)
	sameLog(t, db, want)
	rq, err := db.Requeued(10000)
	if err != nil {
		t.Fatal(err)
	}
	// 500 of term 1 (1001–1500) and 100 of term 2 (1201–1300).
	if len(rq) != 600 {
		t.Fatalf("%d entries requeued, want 600", len(rq))
	}
	seen := map[[2]uint64]bool{}
	for _, r := range rq {
		seen[[2]uint64{r.Index, r.Term}] = true
	}
	for i := uint64(1001); i <= 1500; i++ {
		if !seen[[2]uint64{i, 1}] || (i >= 1201 && i <= 1300 && !seen[[2]uint64{i, 2}]) {
			t.Fatalf("entry %d of an overwritten term is not requeued", i)
		}
	}
	cp := crashCopy(t, db)
	mustClose(t, db)
	sameLog(t, testOpen(t, dir, nil), want)
	sameLog(t, testOpen(t, cp, nil), want)
}

// Readers of the segments run while Saves fill them, cut to new ones and
// checkpoints move the replay point: every entry a reader gets is the one
// saved at its index (run it under the race detector).
func TestChainReadsWhileSaving(t *testing.T) {
	db := testOpen(t, t.TempDir(), &Options{segmented: true, TailBytes: 16 << 10})
	all := bigEntries(1, 2500, 1, 1000)
	done := make(chan struct{})
	errc := make(chan error, 3)
	reader := func(scan bool, seed uint64) {
		rng := rand.New(rand.NewPCG(seed, 9))
		for {
			select {
			case <-done:
				errc <- nil
				return
			default:
			}
			last, _ := db.LastIndex()
			if last == 0 {
				continue
			}
			lo := 1 + uint64(rng.IntN(int(last)))
			var got []pb.Entry
			var err error
			if scan {
				err = db.Scan(lo, func(e pb.Entry) bool { got = append(got, e); return len(got) < 300 })
			} else {
				got, err = db.Entries(lo, min(last+1, lo+200), math.MaxUint64)
			}
			if err != nil {
				errc <- err
				return
			}
			for _, e := range got {
				if d := diffEntries([]pb.Entry{e}, all[e.Index-1:e.Index]); d != "" {
					errc <- fmt.Errorf("read from %d: %s", lo, d)
					return
				}
			}
		}
	}
	go reader(true, 1)
	go reader(false, 2)
	for i := 0; i < len(all); i += 25 {
		mustSave(t, db, pb.HardState{Term: 1, Vote: 1}, all[i:i+25])
	}
	close(done)
	for range 2 {
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
	}
	sameLog(t, db, all)
}

// TestChainBytesWrittenPerRecord is TestBytesWrittenPerRecord for format
// 6, where each record is written once: the WAL's frames, with no copy
// into the data file. Measured on a log at its budget, where retention
// drops a segment for each one the WAL fills and the dropped ones are
// reused, so no segment costs its zeros again; and, for the record, while
// the log grows to its budget, each new segment written with zeros once.
func TestChainBytesWrittenPerRecord(t *testing.T) {
	payload := bytes.Repeat([]byte{0}, 100)
	if os.Getpagesize() != walPage {
		t.Skipf("the bounds are for 4 KiB pages; this host's are %d bytes", os.Getpagesize())
	}
	for _, tc := range []struct {
		name          string
		batch         func(s int) int
		saves         int
		walMax, dbMax float64 // bytes per record, at the budget
		measure       int     // records measured at the budget
	}{
		// Measured: WAL ~4,100, data file ~20 (a checkpoint of the
		// metadata per 512 KiB of frames).
		{"one record per fdatasync", func(int) int { return 1 }, 3000, 4096 * 1.5, 40, 3000},
		// Measured: WAL 248, data file 3 (5 runs of 5): under issue
		// 36's goal of 300 B per 100 B message, where format 5 writes
		// 466. A segment made with zeros, when a cut comes before the
		// checkpoint has made the next one ready from a dropped one,
		// adds to it (282–300 seen before the next one was made after
		// the retention pass).
		{"40 records per fdatasync", func(s int) int { return 20 + s*17%41 }, 600, 248 * 1.5, 10, 60000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const budget = 5 << 20 // two or three segments of log
			db := testOpen(t, t.TempDir(), &Options{segmented: true, MaxBytes: budget})
			db.SetRetentionFloor(math.MaxUint64)
			next := uint64(1)
			save := func(s int) int {
				ents := benchEntries(next, tc.batch(s), s, payload)
				next += uint64(len(ents))
				mustSave(t, db, pb.HardState{Term: 1, Vote: 1, Commit: next - 1}, ents)
				db.SetApplied(next - 1)
				return len(ents)
			}
			// Growth: until retention has dropped a segment.
			w0 := db.Written()
			n := 0
			for s := 0; db.RetentionStats().Dropped == 0; s++ {
				n += save(s)
				if s%100 == 0 {
					mustCheckpoint(t, db)
				}
			}
			w1 := db.Written()
			t.Logf("growing to the budget: WAL %.0f bytes, data file %.0f bytes per record (%d records)", float64(w1.WAL-w0.WAL)/float64(n), float64(w1.Data-w0.Data)/float64(n), n)
			// At the budget.
			n = 0
			for s := 0; n < tc.measure; s++ {
				n += save(s)
				if s%tc.saves == 0 {
					mustCheckpoint(t, db)
				}
			}
			mustCheckpoint(t, db)
			w2 := db.Written()
			walPer, filePer := float64(w2.WAL-w1.WAL)/float64(n), float64(w2.Data-w1.Data)/float64(n)
			t.Logf("at the budget: WAL %.0f bytes, data file %.0f bytes per record (%d records, %d dropped in all)", walPer, filePer, n, db.RetentionStats().Dropped)
			if walPer > tc.walMax {
				t.Errorf("the WAL wrote %.0f bytes per record, more than %.0f", walPer, tc.walMax)
			}
			if filePer > tc.dbMax {
				t.Errorf("checkpoints wrote %.0f bytes per record into the data file, more than %.0f", filePer, tc.dbMax)
			}
		})
	}
}

// The offline tools read format 6's segments past damage: Verify as Open
// does; the damage survey, Repair and the requeue of what a damaged member
// held frame by frame past a damaged one, and segment by segment past a
// lost cut. Repair keeps every other entry at its index, the lost ones as
// empty entries, and the metadata only the frames past the replay point
// held.
func TestChainOfflineToolsReadPastDamage(t *testing.T) {
	src := t.TempDir()
	db := testOpen(t, src, &Options{segmented: true})
	now := time.Now()
	at := func(uint64) time.Time { return now }
	var want []pb.Entry
	next := uint64(1)
	for next < 4000 {
		ents := recordEntries(next, 20, 1000, at)
		saveApplied(t, db, ents)
		want = append(want, ents...)
		next += 20
		if next%400 == 1 {
			mustCheckpoint(t, db)
		}
	}
	db.ckMu.Lock() // no checkpoint: the key below only in a frame
	db.Stage(BucketSessions, "s", []byte("late"))
	ents := recordEntries(next, 20, 1000, at)
	saveApplied(t, db, ents)
	want = append(want, ents...)
	next += 20
	src = crashCopyHeld(t, db)
	ids := maps.Clone(db.seg.ids)
	head := db.seg.head
	db.ckMu.Unlock()
	mustClose(t, db)
	if err := Verify(src); err != nil {
		t.Fatalf("Verify of a sound format 6 data dir: %v", err)
	}
	frames := func(seq uint64) ([]walFrame, int64) { return segmentFrames(t, src, seq, ids[seq]) }
	damaged := func(seq uint64, from, to int64) string {
		dir := copyDataDir(t, src)
		clearSegment(t, dir, seq, from, to)
		if _, err := Open(dir, nil); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("Open of the damaged copy: %v, want ErrCorrupt", err)
		}
		return dir
	}
	fr, end := frames(head + 1)
	mid := fr[len(fr)/2]
	cut := fr[len(fr)-1]
	beforeCut := fr[len(fr)-2]
	for _, tc := range []struct {
		name     string
		from, to int64
		lost     IndexRange
	}{
		{"a frame", mid.off, mid.off + walHdr + 8, IndexRange{mid.ents[0].Index, mid.ents[len(mid.ents)-1].Index}},
		{"the last frame and the cut", beforeCut.off, end, IndexRange{beforeCut.ents[0].Index, beforeCut.ents[len(beforeCut.ents)-1].Index}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if cut.next == 0 {
				t.Fatalf("segment %d does not end with a cut", head+1)
			}
			dir := damaged(head+1, tc.from, tc.to)
			sv := SurveyDamaged(dir)
			if !sv.Opened || sv.Last != next-1 || !slices.Equal(sv.Unreadable, []IndexRange{tc.lost}) {
				t.Fatalf("survey %+v; want the log to %d, %v unreadable", sv, next-1, tc.lost)
			}

			dst := t.TempDir()
			rep, err := Repair(dir, dst, nil)
			if err != nil {
				t.Fatalf("Repair: %v (report %+v)", err, rep)
			}
			if !slices.Equal(rep.Lost, []LostRange{{tc.lost.First, tc.lost.Last}}) || rep.Last != next-1 {
				t.Fatalf("Repair lost %v, log to %d; want %v lost, to %d (report %+v)", rep.Lost, rep.Last, tc.lost, next-1, rep)
			}
			out := testOpen(t, dst, nil)
			got, err := out.Entries(1, next, math.MaxUint64)
			if err != nil {
				t.Fatal(err)
			}
			for i := range want {
				idx := want[i].Index
				lost := idx >= tc.lost.First && idx <= tc.lost.Last
				if lost && len(got[i].Data) != 0 || !lost && !bytes.Equal(got[i].Data, want[i].Data) {
					t.Fatalf("entry %d after the repair: %d bytes (lost %v)", idx, len(got[i].Data), lost)
				}
			}
			var late string
			if err := out.ForEach(BucketSessions, "s", func(k, v []byte) error { late = string(v); return nil }); err != nil {
				t.Fatal(err)
			}
			if late != "late" {
				t.Fatalf("key only in a frame past the replay point: %q after the repair", late)
			}
			mustClose(t, out)

			rq := testOpen(t, t.TempDir(), &Options{segmented: true})
			n, err := rq.RequeueSalvaged(dir, 0)
			if err != nil {
				t.Fatal(err)
			}
			if lost := int(tc.lost.Last - tc.lost.First + 1); n != len(want)-lost {
				t.Fatalf("%d entries requeued, want the %d readable", n, len(want)-lost)
			}
			mustClose(t, rq)
		})
	}
}

// segmentFrames reads the frames of segment seq of dir, which carry id,
// up to its cut, and where they end.
func segmentFrames(t *testing.T, dir string, seq, id uint64) ([]walFrame, int64) {
	t.Helper()
	seg, err := openWAL(walPath(dir, int(seq)), true, true)
	if err != nil {
		t.Fatal(err)
	}
	defer seg.f.Close()
	fr, end, err := seg.readFrames(id)
	if err != nil {
		t.Fatal(err)
	}
	return fr, end
}

// clearSegment zeroes bytes [from, to) of segment seq of dir: damage.
func clearSegment(t *testing.T, dir string, seq uint64, from, to int64) {
	t.Helper()
	path := walPath(dir, int(seq))
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	clear(b[from:to])
	if err := os.WriteFile(path, b, 0o640); err != nil {
		t.Fatal(err)
	}
}

// copyDataDir copies the data file and every WAL file of a closed data dir
// into a new one.
func copyDataDir(t *testing.T, src string) string {
	t.Helper()
	dir := t.TempDir()
	for _, name := range dirNames(t, src) {
		if name != FileName && !strings.HasPrefix(name, WALName+".") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(src, name))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o640); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// A segment damaged before its cut, past the replay point, ends the chain
// there, and what follows would be lost without a word: Open reports it
// when a later segment holds a frame of the chain, which is only ever
// written after the cut was synced. It is not fooled by the segment made
// ready for the next cut, zeros or a dropped segment kept for reuse.
func TestChainDamageBeforeACutIsReported(t *testing.T) {
	dir := t.TempDir()
	db := testOpen(t, dir, &Options{segmented: true, MaxBytes: 8 << 20})
	db.SetRetentionFloor(math.MaxUint64)
	now := time.Now()
	at := func(uint64) time.Time { return now }
	next := uint64(1)
	save := func(n uint64) {
		saveApplied(t, db, recordEntries(next, n, 1000, at))
		next += n
	}
	for next < 20000 {
		save(20) // past the budget: segments dropped, one kept for reuse
	}
	mustCheckpoint(t, db)

	// Past the replay point: frames in its segment, a cut, frames in the
	// next, a cut, frames in the one after. No checkpoint comes between
	// (ckMu), so the crash copy's replay point stays before both cuts.
	db.ckMu.Lock()
	db.wmu.Lock()
	mark := uint64(db.wal.cur) // the checkpoint above marked its end
	db.wmu.Unlock()
	for range 2 {
		save(20)
		db.wmu.Lock()
		if err := db.sealLocked(); err != nil {
			t.Fatal(err)
		}
		db.wmu.Unlock()
	}
	save(20)
	src := crashCopyHeld(t, db)
	ids := maps.Clone(db.seg.ids)
	end := uint64(db.wal.cur)
	db.ckMu.Unlock()
	if end != mark+2 {
		t.Fatalf("replay point in segment %d, chain ends at %d: want two cuts past it", mark, end)
	}

	// Undamaged, it opens whole: the crash copy, and the data dir itself
	// with the next segment made ready past its end.
	mustClose(t, db)
	if names := dirNames(t, dir); !slices.Contains(names, filepath.Base(walPath(dir, int(end+1)))) {
		t.Fatalf("no segment made ready past the last one, %d: %v", end, names)
	}
	for _, d := range []string{dir, copyDataDir(t, src)} {
		db := testOpen(t, d, nil)
		if got, _ := db.LastIndex(); got != next-1 {
			t.Fatalf("undamaged: log ends at %d, want %d", got, next-1)
		}
		mustClose(t, db)
	}

	frames := func(seq uint64) ([]walFrame, int64) { return segmentFrames(t, src, seq, ids[seq]) }
	damage := func(t *testing.T, seq uint64, from, to int64) {
		dir := copyDataDir(t, src)
		clearSegment(t, dir, seq, from, to)
		db, err := Open(dir, nil)
		if err == nil {
			l, _ := db.LastIndex()
			db.Close()
			t.Fatalf("Open of a chain damaged in segment %d at [%d, %d) succeeded with the log ending at %d of %d", seq, from, to, l, next-1)
		}
		if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "without the cut") {
			t.Fatalf("Open: %v; want ErrCorrupt naming the missing cut", err)
		}
		t.Log(err)
	}
	t.Run("cut", func(t *testing.T) {
		fr, end := frames(mark)
		if cut := fr[len(fr)-1]; cut.next != 0 {
			damage(t, mark, cut.off, end)
		} else {
			t.Fatalf("segment %d does not end with a cut", mark)
		}
	})
	t.Run("frames and cut", func(t *testing.T) {
		fr, end := frames(mark + 1)
		damage(t, mark+1, fr[0].off, end)
	})
	t.Run("a cut two segments back", func(t *testing.T) {
		_, end := frames(mark)
		from := end - 64
		_, end2 := frames(mark + 1)
		dir := copyDataDir(t, src)
		clearSegment(t, dir, mark, from, end)
		clearSegment(t, dir, mark+1, 0, end2)
		if _, err := Open(dir, nil); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "without the cut") {
			t.Fatalf("Open with segments %d and %d damaged: %v; want ErrCorrupt naming the missing cut", mark, mark+1, err)
		}
	})
}

// Repair of a format 6 data dir whose data file cannot be opened at all
// (both meta pages torn) finds the chain's head among the segments, a
// dropped one kept for reuse notwithstanding (after drops one at a time,
// and after many at once, which leave it with no successor), and starts
// the log where the chain does: every record kept from there, none
// reported lost.
func TestChainRepairWithoutTheDataFile(t *testing.T) {
	for _, tc := range []struct {
		name   string
		before int64 // the budget while the log is written; 0: the same
	}{{"dropped one at a time", 0}, {"dropped many at once", 64 << 20}} {
		t.Run(tc.name, func(t *testing.T) {
			const budget = 8 << 20
			dir := t.TempDir()
			var err error
			db := testOpen(t, dir, &Options{segmented: true, MaxBytes: cmp.Or(tc.before, budget)})
			db.SetRetentionFloor(math.MaxUint64)
			now := time.Now()
			at := func(uint64) time.Time { return now }
			var want []pb.Entry
			next := uint64(1)
			save := func() {
				ents := recordEntries(next, 20, 1000, at)
				saveApplied(t, db, ents)
				want = append(want, ents...)
				next += 20
			}
			for next < 20000 {
				save()
			}
			var kept []byte
			if tc.before != 0 {
				mustClose(t, db)
				if kept, err = os.ReadFile(walPath(dir, firstSegment)); err != nil {
					t.Fatal(err)
				}
				db = testOpen(t, dir, &Options{MaxBytes: budget})
				db.SetRetentionFloor(math.MaxUint64)
				save()
				mustCheckpoint(t, db)
			}
			first, _ := db.FirstIndex()
			mustClose(t, db)
			if kept != nil {
				// The oldest of the segments dropped at once, kept for
				// reuse (whether it still is depends on when the next
				// one was made): the segment after it is gone.
				if err := os.WriteFile(walPath(dir, firstSegment), kept, 0o640); err != nil {
					t.Fatal(err)
				}
			}
			if first <= 1 {
				t.Fatal("fixture: retention dropped nothing")
			}
			tearMetaPages(t, filepath.Join(dir, FileName))

			dst := t.TempDir()
			rep, err := Repair(dir, dst, &RepairOptions{NodeID: 1})
			if err != nil {
				t.Fatalf("Repair: %v (report %+v)", err, rep)
			}
			if len(rep.Lost) != 0 || rep.Last != next-1 || rep.First <= 1 || rep.First > first {
				t.Fatalf("repaired log %d..%d, lost %v; want it to start by %d (not at 1) and end at %d, nothing lost (segments %v)", rep.First, rep.Last, rep.Lost, first, next-1, segmentFiles(t, dir))
			}
			out := testOpen(t, dst, &Options{ReadOnly: true})
			got, err := out.Entries(first, next, math.MaxUint64)
			if err != nil {
				t.Fatal(err)
			}
			if d := diffEntries(got, want[first-1:]); d != "" {
				t.Fatalf("after the repair: %s", d)
			}
			mustClose(t, out)
		})
	}
}
