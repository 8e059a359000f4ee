package storage

import (
	"bytes"
	"maps"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"
	pb "go.etcd.io/raft/v3/raftpb"
)

// logRuns counts the log bucket's keys: the runs a data file holds.
func logRuns(t *testing.T, db *DB) int {
	t.Helper()
	n := 0
	if err := db.bolt.View(func(tx *bolt.Tx) error { n = tx.Bucket(bucketLog).Stats().KeyN; return nil }); err != nil {
		t.Fatal(err)
	}
	return n
}

// A data dir of format 5, left by a clean stop or by a crash with frames
// and metadata only in its WAL, opens in format 6 when the build makes
// that format: the same log and metadata, the log moved from the file's
// runs into segments and the file rewritten without them, format 5's WAL
// files gone. It goes on in segments, and stays in format 6 at the next
// Open.
func TestUpgradeToFormat6KeepsTheLog(t *testing.T) {
	src := t.TempDir()
	db := testOpen(t, src, &Options{TailBytes: 8 << 10})
	var want []pb.Entry
	next := uint64(1)
	save := func(db *DB, n uint64, term uint64) {
		ents := bigEntries(next, n, term, 700)
		mustSave(t, db, pb.HardState{Term: term, Vote: 1, Commit: next - 1}, ents)
		want = append(want, ents...)
		next += n
	}
	for range 60 {
		save(db, 40, 1)
	}
	mustCheckpoint(t, db)
	save(db, 25, 1) // in the WAL only
	db.Stage(BucketSessions, "s", []byte("in the WAL"))
	save(db, 1, 1)
	crash := crashCopy(t, db)
	mustClose(t, db)
	if f := fileFormat(t, filepath.Join(src, FileName)); f >= formatChain {
		t.Fatalf("the data dir before the upgrade says format %d", f)
	}
	before := append([]pb.Entry(nil), want...)
	fi, err := os.Stat(filepath.Join(src, FileName))
	if err != nil {
		t.Fatal(err)
	}
	oldSize := fi.Size()

	for _, tc := range []struct{ name, dir string }{{"clean stop", src}, {"crash", crash}} {
		t.Run(tc.name, func(t *testing.T) {
			want = append([]pb.Entry(nil), before...)
			next = want[len(want)-1].Index + 1
			db := testOpen(t, tc.dir, &Options{segmented: true, TailBytes: 8 << 10})
			if !db.chain {
				t.Fatal("not in format 6 after an Open that upgrades")
			}
			if n := logRuns(t, db); n != 0 {
				t.Fatalf("%d runs left in the data file after the upgrade", n)
			}
			if fi, err := os.Stat(filepath.Join(tc.dir, FileName)); err != nil || fi.Size()*4 > oldSize {
				t.Fatalf("data file of %d bytes after the upgrade, %d before: the log's bytes are still in it (%v)", fi.Size(), oldSize, err)
			}
			sameLog(t, db, want)
			var got string
			if err := db.ForEach(BucketSessions, "s", func(k, v []byte) error { got = string(v); return nil }); err != nil {
				t.Fatal(err)
			}
			if got != "in the WAL" {
				t.Fatalf("staged value %q after the upgrade, want the one only the WAL held", got)
			}
			for _, n := range []string{WALName + ".0", WALName + ".1", upgradeName} {
				if slices.Contains(dirNames(t, tc.dir), n) {
					t.Fatalf("%s left after the upgrade", n)
				}
			}
			if n := len(segmentFiles(t, tc.dir)); n < 2 {
				t.Fatalf("%d segments for a log of %d entries of 700 B", n, len(want))
			}
			// The log goes on, into segments.
			w0 := db.Written()
			for range 60 {
				save(db, 40, 2)
			}
			if w := db.Written(); (w.Data-w0.Data)*10 > w.WAL-w0.WAL {
				t.Errorf("the data file wrote %d bytes, the WAL %d, after the upgrade: entries still copied into runs", w.Data-w0.Data, w.WAL-w0.WAL)
			}
			sameLog(t, db, want)
			mustClose(t, db)
			if f := fileFormat(t, filepath.Join(tc.dir, FileName)); f != formatChain {
				t.Fatalf("after a clean stop the file says format %d, want %d", f, formatChain)
			}
			db = testOpen(t, tc.dir, nil)
			if !db.chain {
				t.Fatal("an upgraded data dir opened without the upgrade option is not in format 6")
			}
			sameLog(t, db, want)
			mustClose(t, db)
		})
	}
}

// An upgrade cut short before its rename leaves the data dir in format 5,
// whole, with files of its own that the next upgrade removes and writes
// anew; one cut short after it leaves format 5's WAL files to the next
// Open, which removes them. A filesystem without the room for a copy of
// the log leaves the data dir in format 5, working, until a start finds
// the room.
func TestUpgradeToFormat6CutShort(t *testing.T) {
	dir := t.TempDir()
	db := testOpen(t, dir, nil)
	want := bigEntries(1, 200, 1, 500)
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1}, want)
	mustClose(t, db)
	wal0, err := os.ReadFile(walPath(dir, 0))
	if err != nil {
		t.Fatal(err)
	}

	full := func(string) (int64, int64, error) { return 1 << 20, 1 << 30, nil }
	db = testOpen(t, dir, &Options{segmented: true, FreeSpace: full, MinFree: -1})
	if db.chain {
		t.Fatal("upgraded without the room for a copy of the log")
	}
	more := bigEntries(201, 10, 1, 500)
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1}, more)
	want = append(want, more...)
	mustClose(t, db)
	if fileFormat(t, filepath.Join(dir, FileName)) >= formatChain || len(segmentFiles(t, dir)) != 0 {
		t.Fatal("an upgrade without room changed the data dir")
	}

	// Before the rename: a new file and segments of an upgrade that
	// did not finish.
	for name, size := range map[string]int{upgradeName: 4096, filepath.Base(walPath(dir, firstSegment)): walPrealloc, filepath.Base(walPath(dir, firstSegment+5)): 100} {
		if err := os.WriteFile(filepath.Join(dir, name), bytes.Repeat([]byte{7}, size), 0o640); err != nil {
			t.Fatal(err)
		}
	}
	db = testOpen(t, dir, &Options{segmented: true})
	if !db.chain {
		t.Fatal("not upgraded")
	}
	sameLog(t, db, want)
	mustClose(t, db)
	if names := dirNames(t, dir); slices.Contains(names, upgradeName) || slices.Contains(names, filepath.Base(walPath(dir, firstSegment+5))) {
		t.Fatalf("an earlier upgrade's files left: %v", names)
	}
	// After it: format 5's file back, as a crash would have left it.
	if err := os.WriteFile(walPath(dir, 0), wal0, 0o640); err != nil {
		t.Fatal(err)
	}
	db = testOpen(t, dir, nil)
	if !db.chain {
		t.Fatal("not in format 6")
	}
	sameLog(t, db, want)
	if slices.Contains(dirNames(t, dir), WALName+".0") {
		t.Fatal("format 5's WAL file left in an upgraded data dir after an Open")
	}
	mustClose(t, db)
}

// An upgraded data dir is within its budget as a data dir made in
// format 6 is: the file holds none of the log, whose segments retention
// drops from the oldest on, never leaving a gap.
func TestUpgradedDataDirStaysWithinItsBudget(t *testing.T) {
	const budget = 8 << 20
	dir := t.TempDir()
	now := time.Now()
	at := func(uint64) time.Time { return now }
	db := testOpen(t, dir, &Options{MaxBytes: budget})
	db.SetRetentionFloor(math.MaxUint64)
	next := uint64(1)
	for written := 0; written < 2*budget; written += 50 * 1000 {
		saveApplied(t, db, recordEntries(next, 50, 1000, at))
		next += 50
	}
	mustClose(t, db)
	first5, _ := func() (uint64, error) {
		db := testOpen(t, dir, &Options{ReadOnly: true})
		defer db.Close()
		return db.FirstIndex()
	}()

	db = testOpen(t, dir, &Options{MaxBytes: budget, segmented: true})
	db.SetRetentionFloor(math.MaxUint64)
	if f, _ := db.FirstIndex(); !db.chain || f != first5 {
		t.Fatalf("after the upgrade: format 6 %v, first index %d, was %d", db.chain, f, first5)
	}
	peak := dirBytes(dir)
	upgradedAt := next - 1
	for written := 0; written < 3*budget; written += 50 * 1000 {
		saveApplied(t, db, recordEntries(next, 50, 1000, at))
		next += 50
		peak = max(peak, dirBytes(dir))
	}
	mustCheckpoint(t, db)
	peak = max(peak, dirBytes(dir))
	first, _ := db.FirstIndex()
	last, _ := db.LastIndex()
	if first <= upgradedAt || last != next-1 {
		t.Fatalf("log %d..%d after writing 1..%d, upgraded at %d: what the upgrade moved not dropped, or the newest lost", first, last, next-1, upgradedAt)
	}
	if limit := int64(budget + RetentionSlack + 1000); peak > limit {
		t.Errorf("data dir reached %d bytes: budget %d + slack %d", peak, budget, RetentionSlack)
	}
	want := first
	if err := db.Scan(first, func(e pb.Entry) bool {
		if e.Index != want {
			t.Fatalf("Scan gave %d, want %d", e.Index, want)
		}
		want++
		return true
	}); err != nil {
		t.Fatal(err)
	}
	if want != next {
		t.Fatalf("Scan ended at %d, want %d", want, next)
	}
	mustClose(t, db)
}

// A follower's tail not yet committed at the upgrade can be overwritten
// by a new master: the entries it overwrites move to the requeue bucket,
// and the log is the new master's from there on, after a reopen and a
// crash too.
func TestUpgradedDataDirOverwritesItsTail(t *testing.T) {
	dir := t.TempDir()
	db := testOpen(t, dir, nil)
	log := bigEntries(1, 100, 1, 200)
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1, Commit: 50}, log)
	mustClose(t, db)

	db = testOpen(t, dir, &Options{segmented: true})
	more := bigEntries(101, 10, 1, 200)
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1, Commit: 50}, more)
	over := bigEntries(80, 11, 2, 100)
	mustSave(t, db, pb.HardState{Term: 2, Vote: 2, Commit: 50}, over)
	want := append(append([]pb.Entry(nil), log[:79]...), over...)
	sameLog(t, db, want)
	rq, err := db.Requeued(1000)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[uint64]bool{}
	for _, r := range rq {
		if r.Term == 1 {
			seen[r.Index] = true
		}
	}
	for i := uint64(80); i <= 110; i++ {
		if !seen[i] {
			t.Fatalf("entry %d of term 1, overwritten, is not requeued (%d requeued)", i, len(rq))
		}
	}
	tail := bigEntries(91, 20, 2, 100)
	mustSave(t, db, pb.HardState{Term: 2, Vote: 2, Commit: 90}, tail)
	want = append(want, tail...)
	sameLog(t, db, want)
	cp := crashCopy(t, db)
	mustClose(t, db)
	sameLog(t, testOpen(t, dir, nil), want)
	sameLog(t, testOpen(t, cp, nil), want)
}

// The upgrade's copy of the data file holds every bucket, nested ones
// too, key for key and with their sequences, across as many transactions
// as its size bound makes, and none of the log's runs.
func TestUpgradeCopiesEveryBucketButTheRuns(t *testing.T) {
	dir := t.TempDir()
	db := testOpen(t, dir, nil)
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1}, bigEntries(1, 50, 1, 300))
	mustCheckpoint(t, db)
	if err := db.bolt.Update(func(tx *bolt.Tx) error {
		b, err := tx.CreateBucketIfNotExists([]byte("nest"))
		if err != nil {
			return err
		}
		for i := range 3 {
			sub, err := b.CreateBucket([]byte{'b', byte(i)})
			if err != nil {
				return err
			}
			if err := sub.SetSequence(uint64(40 + i)); err != nil {
				return err
			}
			deeper, err := sub.CreateBucket([]byte("deeper"))
			if err != nil {
				return err
			}
			for j := range 30 {
				k := []byte{byte(i), byte(j)}
				if err := sub.Put(k, bytes.Repeat(k, 20)); err != nil {
					return err
				}
				if err := deeper.Put(k, k); err != nil {
					return err
				}
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	// dump lists every key of a file but the log's, by its path.
	dump := func(tx *bolt.Tx) map[string]string {
		out := map[string]string{}
		var walk func(b *bolt.Bucket, path string)
		walk = func(b *bolt.Bucket, path string) {
			out[path+"#seq"] = strconv.FormatUint(b.Sequence(), 10)
			_ = b.ForEach(func(k, v []byte) error {
				if v == nil {
					walk(b.Bucket(k), path+"/"+string(k))
					return nil
				}
				out[path+"/"+string(k)] = string(v)
				return nil
			})
		}
		_ = tx.ForEach(func(name []byte, b *bolt.Bucket) error {
			if bytes.Equal(name, bucketLog) {
				out["log#keys"] = strconv.Itoa(b.Stats().KeyN)
				return nil
			}
			walk(b, string(name))
			return nil
		})
		return out
	}
	var want map[string]string
	if err := db.bolt.View(func(tx *bolt.Tx) error { want = dump(tx); return nil }); err != nil {
		t.Fatal(err)
	}
	if want["log#keys"] == "0" {
		t.Fatal("no runs in the file to leave out")
	}
	want["log#keys"] = "0"
	path := filepath.Join(t.TempDir(), upgradeName)
	if err := db.copyWithoutRuns(path, time.Second, 200, func(*bolt.Bucket) error { return nil }); err != nil {
		t.Fatal(err)
	}
	mustClose(t, db)
	b, err := bolt.Open(path, 0o640, &bolt.Options{ReadOnly: true, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	var got map[string]string
	if err := b.View(func(tx *bolt.Tx) error { got = dump(tx); return nil }); err != nil {
		t.Fatal(err)
	}
	if !maps.Equal(got, want) {
		for k, v := range want {
			if got[k] != v {
				t.Errorf("%s: %q in the copy, want %q", k, got[k], v)
			}
		}
		for k := range got {
			if _, ok := want[k]; !ok {
				t.Errorf("%s in the copy only", k)
			}
		}
	}
}

// An upgrade whose write fails part way (here a segment that cannot grow
// for a record larger than it) is not made: the data dir opens in its
// format with its whole log, keeps none of the upgrade's files, and the
// next start upgrades it.
func TestUpgradeThatFailsLeavesTheDataDirAsItWas(t *testing.T) {
	dir := t.TempDir()
	db := testOpen(t, dir, nil)
	want := bigEntries(1, 12, 1, 30<<10)
	want = append(want, bigEntries(13, 1, 1, 3<<19)...) // 1.5 MiB: past a segment
	want = append(want, bigEntries(14, 5, 1, 100)...)
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1, Commit: 18}, want)
	mustClose(t, db)

	f := &faults{}
	f.fileLimit.Store(walPrealloc)
	db = testOpen(t, dir, &Options{segmented: true, faults: f})
	if db.chain {
		t.Fatal("upgraded although a segment could not grow for the large record")
	}
	sameLog(t, db, want)
	names := dirNames(t, dir)
	if len(segmentFiles(t, dir)) != 0 || slices.Contains(names, upgradeName) {
		t.Fatalf("a failed upgrade left its files: %v", names)
	}
	mustClose(t, db)

	db = testOpen(t, dir, &Options{segmented: true})
	if !db.chain {
		t.Fatal("not upgraded at the next start")
	}
	sameLog(t, db, want)
	mustClose(t, db)
}
