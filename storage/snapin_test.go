package storage

import (
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"math"
	"path/filepath"
	"strings"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"
	pb "go.etcd.io/raft/v3/raftpb"
)

// retainedKey is the sessions bucket's key of retained message i.
func retainedKey(i int) string { return fmt.Sprintf("R\x00ret/big/%05d", i) }

// brokerState stages n retained messages of size bytes each (a retained
// record's value as the broker stores it is about that) into db's
// sessions bucket, each made of value(i).
func brokerState(db *DB, n, size int, value func(i int) string) {
	for i := range n {
		db.Stage(BucketSessions, retainedKey(i), []byte(strings.Repeat(value(i), size)))
	}
}

// snapshotOf builds a snapshot of master's state at index last, after
// entries 1..last, and returns it with the ref of its body.
func snapshotOf(t *testing.T, master *DB, last uint64) (pb.Snapshot, SnapshotRef) {
	t.Helper()
	for lo := uint64(1); lo <= last; lo += 10000 {
		n := min(10000, last+1-lo)
		mustSave(t, master, pb.HardState{Term: 1, Commit: lo + n - 1}, makeEntries(lo, n, 1))
	}
	master.SetApplied(last)
	mustCheckpoint(t, master)
	snap, err := master.BuildSnapshot()
	if err != nil {
		t.Fatal(err)
	}
	body := snap.Data
	return snap, SnapshotRef{Index: snap.Metadata.Index, Size: uint64(len(body)), CRC: binary.BigEndian.Uint32(body[len(body)-4:])}
}

// dirPeak keeps the largest size of a data dir seen, and where.
type dirPeak struct {
	dir   string
	bytes int64
	at    string
}

func (p *dirPeak) sample(where string) {
	if n := dirBytes(p.dir); n > p.bytes {
		p.bytes, p.at = n, where
	}
}

// receive has db receive snap (its body in chunks of chunk bytes, after
// each of which during runs, with the chunk's number) and install it.
func receive(t *testing.T, db *DB, snap pb.Snapshot, ref SnapshotRef, chunk uint64, during func(i int)) {
	t.Helper()
	body := snap.Data
	in, err := db.ReceiveSnapshot(ref)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; !in.Done(); i++ {
		if err := in.Write(body[in.Offset():min(in.Offset()+chunk, ref.Size)]); err != nil {
			t.Fatal(err)
		}
		if during != nil {
			during(i)
		}
	}
	data, err := in.Finish()
	if err != nil {
		t.Fatal(err)
	}
	snap.Data = data
	if err := db.ApplySnapshot(snap); err != nil {
		t.Fatal(err)
	}
	in.Close() // after the install: changes nothing
}

// noStaging fails the test if the data file in dir (closed) still holds
// the staging.
func noStaging(t *testing.T, dir string) {
	t.Helper()
	boltView(t, filepath.Join(dir, FileName), func(tx *bolt.Tx) error {
		if tx.Bucket(bucketSnapIn) != nil {
			t.Error("the staging is still in the data file after the install")
		}
		return nil
	})
}

// A member on a 16MiB budget whose log fills it beside 5 to 11 MB of broker
// state receives a snapshot of the master's (changed: a tenth of it, when
// it was away for a while; all of it, when it holds another cluster's, its
// second half, or the two thirds that are retained messages beside
// sessions that stay), in chunks of 1MiB, installs it and pulls the
// history before it, as the log goes on: its data dir stays within the
// budget and the slack throughout, it ends with the master's state, and
// nothing of the staging is left. Staging all of the state beside its own,
// as before the merge in place, took the data dir to 21.1 MB with all of
// 8 MB changed and to 19.9 MB with its second half (limit 18.9 MB); a
// quarter of the 11 MB state staged before the merge began, 20.6 MB; now
// none grows past the log's own peak (16.6, 16.7 and 15.9 MB).
func TestSnapshotInstallStaysWithinTheBudget(t *testing.T) {
	forFormats(t, testSnapshotInstallStaysWithinTheBudget)
}

func testSnapshotInstallStaysWithinTheBudget(t *testing.T, seg bool) {
	const (
		budget = 16 << 20
		size   = 1750 // a retained message of 1,100 bytes, base64 and JSON
	)
	for _, tc := range []struct {
		name    string
		n       int
		changed func(i int) bool
	}{
		{"a tenth changed", 4000, func(i int) bool { return i%10 == 3 }},
		{"all changed", 3000, func(int) bool { return true }},
		{"all of 8 MB changed", 4500, func(int) bool { return true }},
		{"the second half changed", 4000, func(i int) bool { return i >= 2000 }},
		{"two thirds of 11 MB changed", 5400, func(i int) bool { return i < 3600 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			master := testOpen(t, t.TempDir(), &Options{segmented: seg})
			brokerState(master, tc.n, size, func(i int) string {
				if tc.changed(i) {
					return "n"
				}
				return "o"
			})
			snap, ref := snapshotOf(t, master, 60000)

			dir := t.TempDir()
			db := testOpen(t, dir, &Options{MaxBytes: budget, segmented: seg})
			db.SetRetentionFloor(math.MaxUint64)
			peak := dirPeak{dir: dir}
			brokerState(db, tc.n, size, func(int) string { return "o" })
			db.Stage(BucketSessions, "R\x00ret/gone", []byte("the master has no such message"))
			now := time.Now()
			at := func(uint64) time.Time { return now }
			next := uint64(1)
			for written := 0; written < 2*budget; written += 100 * 1024 {
				saveApplied(t, db, recordEntries(next, 100, 1024, at))
				next += 100
				peak.sample("filling the log")
			}
			mustCheckpoint(t, db)
			before := dirBytes(dir)

			receive(t, db, snap, ref, 1<<20, func(i int) {
				if i == 0 {
					if f, _ := db.FirstIndex(); f != next {
						t.Errorf("first index %d once a snapshot is received, want %d: the log up to the applied index goes", f, next)
					}
				}
				peak.sample(fmt.Sprintf("received chunk %d", i))
			})
			peak.sample("installed")
			installed := dirBytes(dir)

			// The history before the snapshot, newest first, 256 KiB at
			// a time, as the master would answer; the log goes on.
			pulled := 0
			for below, ok := db.BackfillWanted(); ok && below > 1; below, ok = db.BackfillWanted() {
				ents := recordEntries(below-250, 250, 1024, at)
				if err := db.PutBackfill(ents, false); err != nil {
					t.Fatal(err)
				}
				pulled += len(ents)
				peak.sample(fmt.Sprintf("backfill, %d records", pulled))
				last, _ := db.LastIndex()
				saveApplied(t, db, recordEntries(last+1, 20, 1024, at))
				if pulled > 4*budget/1024 {
					t.Fatalf("retention never ended the backfill: %d records pulled", pulled)
				}
			}
			mustCheckpoint(t, db)
			peak.sample("caught up")
			t.Logf("data dir: %d before, %d once installed, %d at the end; peak %d (%s); %d records pulled; limit %d",
				before, installed, dirBytes(dir), peak.bytes, peak.at, pulled, budget+RetentionSlack)
			if peak.bytes > budget+RetentionSlack {
				t.Errorf("the data dir reached %d bytes (%s), past the budget and its slack (%d)", peak.bytes, peak.at, budget+RetentionSlack)
			}
			if want, got := bucketContents(t, master, BucketSessions), bucketContents(t, db, BucketSessions); !maps.Equal(want, got) {
				t.Errorf("%d keys in the sessions bucket after the install, the master %d (or values differ)", len(got), len(want))
			}
			mustClose(t, db)
			noStaging(t, dir)
		})
	}
}

// What the broker writes while a snapshot is received (to keys the
// snapshot holds with the value this member has, to keys it holds
// otherwise, to keys it lacks, some deleted) is replaced by the snapshot's
// state at the install: the snapshot wins, as when the install wrote the
// buckets from the whole body, whether the bucket was staged or merged in
// place (the member holds none of the snapshot's values), before or after
// the merge passed the key written. The body comes in chunks of every size
// from 1 byte, which end anywhere in an item.
func TestSnapshotReceivedWhileTheBrokerWrites(t *testing.T) {
	forFormats(t, testSnapshotReceivedWhileTheBrokerWrites)
}

func testSnapshotReceivedWhileTheBrokerWrites(t *testing.T, seg bool) {
	master := testOpen(t, t.TempDir(), &Options{segmented: seg})
	master.SnapshotBucket("uplinks", nil)
	for i := range 40 {
		master.Stage(BucketSessions, fmt.Sprintf("k%02d", i), []byte(fmt.Sprintf("v%d", i%3)))
	}
	master.Stage("uplinks", "cloud", []byte("position"))
	snap, ref := snapshotOf(t, master, 50)
	want := bucketContents(t, master, BucketSessions)
	for _, tc := range []struct {
		name  string
		value func(i int) string // the member's value of k<i>
	}{
		// A third of the keys the same as the snapshot's, or none (the
		// bucket is merged in place: snapin.go).
		{"", func(i int) string { return fmt.Sprintf("v%d", i%2) }},
		{"all differ/", func(i int) string { return fmt.Sprintf("mine %d", i) }},
	} {
		for _, chunk := range []uint64{1, 2, 3, 7, 64, ref.Size} {
			t.Run(fmt.Sprint(tc.name, chunk), func(t *testing.T) {
				dir := t.TempDir()
				db := testOpen(t, dir, &Options{segmented: seg})
				db.inPlaceMin = 0 // a bucket of 40 keys merged in place
				for i := range 40 {
					if i%4 != 1 { // some the member lacks
						db.Stage(BucketSessions, fmt.Sprintf("k%02d", i), []byte(tc.value(i)))
					}
				}
				db.Stage(BucketSessions, "mine", []byte("not in the snapshot"))
				saveApplied(t, db, makeEntries(1, 10, 1))
				mustCheckpoint(t, db)
				merged := false
				receive(t, db, snap, ref, chunk, func(i int) {
					merged = merged || db.InstallInterrupted()
					// Writes between chunks, committed with the next.
					db.Stage(BucketSessions, fmt.Sprintf("k%02d", i%40), []byte("written meanwhile"))
					db.StageDelete(BucketSessions, fmt.Sprintf("k%02d", (i+20)%40))
					db.Stage(BucketSessions, fmt.Sprintf("new%d", i%5), []byte("not in the snapshot"))
				})
				if tc.name != "" && !merged {
					t.Error("no key the same as the snapshot's, and the bucket was not merged in place")
				}
				if db.InstallInterrupted() {
					t.Error("installed: the state is still marked incomplete")
				}
				if got := bucketContents(t, db, BucketSessions); !maps.Equal(got, want) {
					t.Errorf("sessions after the install: %q, want the snapshot's %q", got, want)
				}
				if got := bucketContents(t, db, "uplinks"); got["cloud"] != "position" {
					t.Errorf("uplinks after the install: %q", got)
				}
				mustClose(t, db)
				noStaging(t, dir)
				db = testOpen(t, dir, &Options{segmented: seg})
				if got := bucketContents(t, db, BucketSessions); !maps.Equal(got, want) {
					t.Errorf("sessions after a restart: %q, want the snapshot's %q", got, want)
				}
			})
		}
	}
}

// A snapshot received in part when the member stops is dropped when it
// starts again (the master sends it again); one received again from the
// start installs.
func TestSnapshotReceivedInPartIsDroppedAtStart(t *testing.T) {
	forFormats(t, testSnapshotReceivedInPartIsDroppedAtStart)
}

func testSnapshotReceivedInPartIsDroppedAtStart(t *testing.T, seg bool) {
	master := testOpen(t, t.TempDir(), &Options{segmented: seg})
	brokerState(master, 200, 500, func(int) string { return "m" })
	snap, ref := snapshotOf(t, master, 30)
	dir := t.TempDir()
	db := testOpen(t, dir, &Options{segmented: seg})
	saveApplied(t, db, makeEntries(1, 10, 1))
	in, err := db.ReceiveSnapshot(ref)
	if err != nil {
		t.Fatal(err)
	}
	if err := in.Write(snap.Data[:ref.Size/2]); err != nil {
		t.Fatal(err)
	}
	mustClose(t, db)
	db = testOpen(t, dir, &Options{segmented: seg})
	db.DropSnapshotFiles()
	mustClose(t, db)
	noStaging(t, dir)
	db = testOpen(t, dir, &Options{segmented: seg})
	receive(t, db, snap, ref, 1000, nil)
	if want, got := bucketContents(t, master, BucketSessions), bucketContents(t, db, BucketSessions); !maps.Equal(want, got) {
		t.Errorf("%d keys after the install, the master %d", len(got), len(want))
	}
}

// A member most of whose broker state the snapshot changes merges it in
// place (see snapin.go), and its state is then neither its own nor the
// snapshot's until the install. Crash safety, with the commits made to
// fail (a full disk) and the member stopped at each step:
//   - a chunk whose commit fails takes nothing: the state and the marker
//     are as before it, and the same bytes written again go on;
//   - stopped once the merge began, the member starts with its state
//     marked incomplete (InstallInterrupted), never taken for whole, and
//     the staging gone; a snapshot received again from the start installs
//     the master's state and clears the mark, also across a restart;
//   - an install whose commit fails leaves the mark; the snapshot
//     received again installs.
func TestSnapshotMergedInPlaceIsKnownIncompleteUntilInstalled(t *testing.T) {
	forFormats(t, testSnapshotMergedInPlaceIsKnownIncompleteUntilInstalled)
}

func testSnapshotMergedInPlaceIsKnownIncompleteUntilInstalled(t *testing.T, seg bool) {
	const n, size = 1000, 700 // 0.7 MB: past inPlaceMin
	master := testOpen(t, t.TempDir(), &Options{segmented: seg})
	brokerState(master, n, size, func(int) string { return "n" })
	snap, ref := snapshotOf(t, master, 30)
	want := bucketContents(t, master, BucketSessions)

	dir := t.TempDir()
	db := testOpen(t, dir, &Options{segmented: seg})
	brokerState(db, n, size, func(int) string { return "o" })
	db.Stage(BucketSessions, "R\x00zz-mine", []byte("not in the snapshot"))
	saveApplied(t, db, makeEntries(1, 10, 1))
	mustCheckpoint(t, db)
	own := bucketContents(t, db, BucketSessions)

	in, err := db.ReceiveSnapshot(ref)
	if err != nil {
		t.Fatal(err)
	}
	const chunk = 64 << 10
	full := errors.New("disk full")
	for !db.InstallInterrupted() {
		if in.Done() {
			t.Fatal("the whole snapshot was received without a merge in place: all of the state changed")
		}
		part := snap.Data[in.Offset():min(in.Offset()+chunk, ref.Size)]
		db.faults.commit.Store(&full)
		if err := in.Write(part); !errors.Is(err, full) {
			t.Fatalf("a chunk written to a full disk: %v", err)
		}
		db.faults.commit.Store(nil)
		if got := bucketContents(t, db, BucketSessions); db.InstallInterrupted() || !maps.Equal(got, own) {
			t.Fatalf("a chunk whose commit failed changed the state (%d keys, marked incomplete %v)", len(got), db.InstallInterrupted())
		}
		if err := in.Write(part); err != nil {
			t.Fatal(err)
		}
	}
	if got := bucketContents(t, db, BucketSessions); maps.Equal(got, own) || maps.Equal(got, want) {
		t.Fatal("merging in place: the state is still the member's own, or the snapshot's already")
	}
	mustClose(t, db) // the member stops, the merge half done

	db = testOpen(t, dir, &Options{segmented: seg})
	db.DropSnapshotFiles()
	if !db.InstallInterrupted() {
		t.Fatal("restarted after a merge in place began: the state is not marked incomplete")
	}
	mustClose(t, db)
	noStaging(t, dir)

	db = testOpen(t, dir, &Options{segmented: seg})
	in, err = db.ReceiveSnapshot(ref)
	if err != nil {
		t.Fatal(err)
	}
	for !in.Done() {
		if err := in.Write(snap.Data[in.Offset():min(in.Offset()+chunk, ref.Size)]); err != nil {
			t.Fatal(err)
		}
	}
	data, err := in.Finish()
	if err != nil {
		t.Fatal(err)
	}
	staged := snap
	staged.Data = data
	db.faults.commit.Store(&full)
	if err := db.ApplySnapshot(staged); !errors.Is(err, full) {
		t.Fatalf("an install on a full disk: %v", err)
	}
	db.faults.commit.Store(nil)
	if !db.InstallInterrupted() {
		t.Fatal("an install that failed cleared the mark")
	}
	in.Close()
	receive(t, db, snap, ref, chunk, nil) // received again: the pull starts over
	if db.InstallInterrupted() {
		t.Fatal("installed: the state is still marked incomplete")
	}
	if got := bucketContents(t, db, BucketSessions); !maps.Equal(got, want) {
		t.Errorf("%d keys after the install, the master %d (or values differ)", len(got), len(want))
	}
	mustClose(t, db)
	noStaging(t, dir)
	db = testOpen(t, dir, &Options{segmented: seg})
	if db.InstallInterrupted() {
		t.Error("restarted after the install: the state is marked incomplete")
	}
	if got := bucketContents(t, db, BucketSessions); !maps.Equal(got, want) {
		t.Errorf("%d keys after a restart, the master %d (or values differ)", len(got), len(want))
	}
}
