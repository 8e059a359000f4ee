package storage

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"
	"go.etcd.io/raft/v3"
	pb "go.etcd.io/raft/v3/raftpb"
)

// bucketContents reads a bucket through ForEach, staged writes included.
func bucketContents(t *testing.T, db *DB, bucket string) map[string]string {
	t.Helper()
	out := map[string]string{}
	if err := db.ForEach(bucket, "", func(k, v []byte) error { out[string(k)] = string(v); return nil }); err != nil {
		t.Fatal(err)
	}
	return out
}

// waitSnapshot asks Snapshot until the background build is done, as raft
// does at each heartbeat.
func waitSnapshot(t *testing.T, db *DB) pb.Snapshot {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		snap, err := db.Snapshot()
		if err == nil {
			return snap
		}
		if !errors.Is(err, raft.ErrSnapshotTemporarilyUnavailable) || time.Now().After(deadline) {
			t.Fatalf("Snapshot: %v", err)
		}
		time.Sleep(time.Millisecond)
	}
}

// A member behind the master's first index installs the master's
// snapshot: its log starts after the snapshot's index, and the buckets the
// snapshot carries (members, sessions, a registered one, converted)
// replace its own, staged writes included, also after a restart.
func TestSnapshotCarriesTheBrokerStateToAnotherMember(t *testing.T) {
	forFormats(t, testSnapshotCarriesTheBrokerStateToAnotherMember)
}

func testSnapshotCarriesTheBrokerStateToAnotherMember(t *testing.T, seg bool) {
	master := testOpen(t, t.TempDir(), &Options{segmented: seg})
	master.SnapshotBucket("uplinks", nil)
	// Converted: keys starting with "local" stay on the member.
	master.SnapshotBucket(BucketSessions, func(scan func(string, func(k, v []byte) error) error, emit func(k, v []byte) error) error {
		return scan("", func(k, v []byte) error {
			if strings.HasPrefix(string(k), "local") {
				return nil
			}
			return emit(k, v)
		})
	})
	cs := pb.ConfState{Voters: []uint64{1}, Learners: []uint64{2}}
	mustSave(t, master, pb.HardState{Term: 2, Commit: 30}, makeEntries(1, 30, 2))
	master.SetConfState(cs)
	master.Stage(BucketSessions, "R\x00a/b", []byte("retained"))
	master.Stage(BucketSessions, "S\x00dev", []byte("session"))
	master.Stage(BucketSessions, "local\x00x", []byte("mine"))
	master.Stage(BucketMembers, "01", []byte("member"))
	master.Stage("uplinks", "cloud", []byte{0, 0, 0, 0, 0, 0, 0, 20})
	master.SetApplied(25)
	// The snapshot reads the file: checkpoint what is staged.
	if err := master.commit(nil); err != nil {
		t.Fatal(err)
	}
	snap := waitSnapshot(t, master)
	if snap.Metadata.Index != 25 || snap.Metadata.Term != 2 {
		t.Fatalf("snapshot at %d/%d, want the applied index 25, term 2", snap.Metadata.Index, snap.Metadata.Term)
	}

	dir := t.TempDir()
	joiner := testOpen(t, dir, &Options{segmented: seg})
	mustSave(t, joiner, pb.HardState{Term: 1, Commit: 3}, makeEntries(1, 3, 1))
	joiner.Stage(BucketSessions, "S\x00old", []byte("gone"))   // replaced
	joiner.Stage(BucketSessions, "local\x00x", []byte("gone")) // replaced too: the bucket goes whole
	if err := joiner.ApplySnapshot(snap); err != nil {
		t.Fatal(err)
	}
	check := func(db *DB) {
		t.Helper()
		want := map[string]string{"R\x00a/b": "retained", "S\x00dev": "session"}
		if got := bucketContents(t, db, BucketSessions); !maps.Equal(got, want) {
			t.Errorf("sessions %q, want %q", got, want)
		}
		if got := bucketContents(t, db, BucketMembers); got["01"] != "member" || len(got) != 1 {
			t.Errorf("members %q", got)
		}
		if got := bucketContents(t, db, "uplinks"); len(got["cloud"]) != 8 {
			t.Errorf("uplinks %q", got)
		}
		if f, _ := db.FirstIndex(); f != 26 {
			t.Errorf("first index %d, want 26", f)
		}
		if term, err := db.Term(25); term != 2 || err != nil {
			t.Errorf("Term(25) = %d, %v", term, err)
		}
		if db.Applied() != 25 {
			t.Errorf("applied %d, want 25", db.Applied())
		}
		if _, got, _ := db.InitialState(); !sameConf(got, cs) {
			t.Errorf("conf state %+v, want %+v", got, cs)
		}
	}
	check(joiner)
	mustClose(t, joiner)
	joiner = testOpen(t, dir, &Options{segmented: seg})
	check(joiner)
}

// A snapshot whose bytes were damaged on the way is refused and changes
// nothing.
func TestDamagedSnapshotIsRefused(t *testing.T) {
	master := testOpen(t, t.TempDir(), nil)
	mustSave(t, master, pb.HardState{Term: 1, Commit: 5}, makeEntries(1, 5, 1))
	master.Stage(BucketSessions, "R\x00t", []byte("x"))
	master.SetApplied(5)
	if err := master.commit(nil); err != nil {
		t.Fatal(err)
	}
	snap, err := master.BuildSnapshot()
	if err != nil {
		t.Fatal(err)
	}
	for _, mangle := range []func([]byte) []byte{
		func(b []byte) []byte { b[len(b)/2] ^= 1; return b },
		func(b []byte) []byte { return b[:len(b)-3] },
		func(b []byte) []byte { b[4] = 9; return b },
	} {
		joiner := testOpen(t, t.TempDir(), nil)
		mustSave(t, joiner, pb.HardState{Term: 1, Commit: 2}, makeEntries(1, 2, 1))
		bad := snap
		bad.Data = mangle(append([]byte(nil), snap.Data...))
		if err := joiner.ApplySnapshot(bad); !errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrUnknownVersion) {
			t.Errorf("damaged snapshot: %v, want ErrCorrupt or ErrUnknownVersion", err)
		}
		if l, _ := joiner.LastIndex(); l != 2 {
			t.Errorf("last index %d after a refused snapshot, want 2", l)
		}
	}
}

// BenchmarkBuildSnapshot builds the snapshot of a broker state of 10,000
// retained messages of 200 bytes (about 2 MiB).
func BenchmarkBuildSnapshot(b *testing.B) {
	db, err := Open(b.TempDir(), nil)
	if err != nil {
		b.Fatal(err)
	}
	defer db.Close()
	val := []byte(strings.Repeat("v", 200))
	for i := range 10000 {
		db.Stage(BucketSessions, fmt.Sprintf("R\x00sensors/%05d", i), val)
	}
	if err := db.Save(pb.HardState{Term: 1, Commit: 1}, makeEntries(1, 1, 1)); err != nil {
		b.Fatal(err)
	}
	db.SetApplied(1)
	if err := db.commit(nil); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	var size int
	for range b.N {
		snap, err := db.BuildSnapshot()
		if err != nil {
			b.Fatal(err)
		}
		size = len(snap.Data)
	}
	b.ReportMetric(float64(size), "bytes/snapshot")
}

// installed is a data file that installed a snapshot at index 20 and
// saved entries 21 and 22 after it.
func installed(t *testing.T, dir string) *DB {
	t.Helper()
	master := testOpen(t, t.TempDir(), nil)
	mustSave(t, master, pb.HardState{Term: 1, Commit: 20}, makeEntries(1, 20, 1))
	master.SetApplied(20)
	if err := master.commit(nil); err != nil {
		t.Fatal(err)
	}
	snap, err := master.BuildSnapshot()
	if err != nil {
		t.Fatal(err)
	}
	db := testOpen(t, dir, nil)
	if err := db.ApplySnapshot(snap); err != nil {
		t.Fatal(err)
	}
	mustSave(t, db, pb.HardState{Term: 1, Commit: 22}, makeEntries(21, 2, 1))
	return db
}

// scanIndexes is every index Scan from 1 gives.
func scanIndexes(t *testing.T, db *DB) []uint64 {
	t.Helper()
	var got []uint64
	if err := db.Scan(1, func(e pb.Entry) bool { got = append(got, e.Index); return true }); err != nil {
		t.Fatal(err)
	}
	return got
}

// After a snapshot the records before it are wanted, newest first; those
// pulled are read by Scan as the log's past, kept across a restart, and
// the first that retention drops (they are the oldest), which ends the
// pull.
func TestBackfillBeforeTheSnapshot(t *testing.T) { forFormats(t, testBackfillBeforeTheSnapshot) }

func testBackfillBeforeTheSnapshot(t *testing.T, seg bool) {
	dir := t.TempDir()
	db := installed(t, dir)
	if below, ok := db.BackfillWanted(); !ok || below != 21 {
		t.Fatalf("BackfillWanted = %d, %v; want 21, true", below, ok)
	}
	if err := db.PutBackfill(makeEntries(12, 8, 1), false); err == nil {
		t.Error("records 12..19, not ending before 21, were taken")
	}
	if err := db.PutBackfill(makeEntries(15, 6, 1), false); err != nil { // 15..20
		t.Fatal(err)
	}
	want := []uint64{15, 16, 17, 18, 19, 20, 21, 22}
	if got := scanIndexes(t, db); !slices.Equal(got, want) {
		t.Errorf("Scan from 1: %v, want %v", got, want)
	}
	if o := db.OldestIndex(); o != 15 {
		t.Errorf("OldestIndex %d, want 15", o)
	}
	mustClose(t, db)
	db = testOpen(t, dir, &Options{segmented: seg})
	if below, ok := db.BackfillWanted(); !ok || below != 15 {
		t.Errorf("after a restart BackfillWanted = %d, %v; want 15, true", below, ok)
	}
	if got := scanIndexes(t, db); !slices.Equal(got, want) {
		t.Errorf("Scan from 1 after a restart: %v, want %v", got, want)
	}
	if err := db.commit(func(tx *bolt.Tx) error { _, err := dropBackfill(tx, 1); return err }); err != nil {
		t.Fatal(err)
	}
	if got := scanIndexes(t, db); !slices.Equal(got, want[1:]) {
		t.Errorf("Scan after retention took one: %v, want %v", got, want[1:])
	}
	if _, ok := db.BackfillWanted(); ok {
		t.Error("still wanted after retention dropped part of it")
	}
}

// A pull that reaches the master's first index completes the backfill.
func TestBackfillCompletes(t *testing.T) {
	db := installed(t, t.TempDir())
	if err := db.PutBackfill(makeEntries(10, 11, 1), true); err != nil { // 10..20
		t.Fatal(err)
	}
	if _, ok := db.BackfillWanted(); ok {
		t.Error("wanted after the pull said the master holds no older records")
	}
	if o := db.OldestIndex(); o != 10 {
		t.Errorf("OldestIndex %d, want 10", o)
	}
}

// A snapshot past the inline limit travels as a ref: the member pulls its
// body in chunks from the master's file, decoding them into its staging,
// checks it and installs it, with the same broker state; a damaged body is
// refused, a stale ref answered ErrSnapshotGone.
func TestLargeSnapshotIsPulledInChunks(t *testing.T) {
	forFormats(t, testLargeSnapshotIsPulledInChunks)
}

func testLargeSnapshotIsPulledInChunks(t *testing.T, seg bool) {
	master := testOpen(t, t.TempDir(), &Options{segmented: seg})
	master.SetSnapshotInline(4 << 10)
	mustSave(t, master, pb.HardState{Term: 1, Commit: 10}, makeEntries(1, 10, 1))
	for i := range 500 {
		master.Stage(BucketSessions, fmt.Sprintf("R\x00t/%d", i), []byte(strings.Repeat("x", 100)))
	}
	master.SetApplied(10)
	if err := master.commit(nil); err != nil {
		t.Fatal(err)
	}
	snap := waitSnapshot(t, master)
	ref, ok := ParseSnapshotRef(snap.Data)
	if !ok || ref.Index != 10 || ref.Size < 50<<10 {
		t.Fatalf("snapshot data of %d bytes, ref %+v %v: want a ref to a body of 50KiB or more", len(snap.Data), ref, ok)
	}
	joiner := testOpen(t, t.TempDir(), &Options{segmented: seg})
	pull := func(ref SnapshotRef, damage bool) ([]byte, error) {
		in, err := joiner.ReceiveSnapshot(ref)
		if err != nil {
			t.Fatal(err)
		}
		for !in.Done() {
			chunk, err := master.ReadSnapshot(ref, in.Offset(), 7777)
			if err != nil {
				in.Close()
				return nil, err
			}
			if damage && in.Offset() > 0 {
				chunk[100] ^= 1 // wherever it lands, the body is refused
			}
			if err := in.Write(chunk); err != nil {
				in.Close()
				return nil, err
			}
		}
		return in.Finish()
	}
	if _, err := pull(ref, true); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("damaged body: %v, want ErrCorrupt", err)
	}
	if joiner.SnapshotStaged(ref) {
		t.Fatal("a damaged body is staged for an install")
	}
	stale := ref
	stale.CRC++
	if _, err := pull(stale, false); !errors.Is(err, ErrSnapshotGone) {
		t.Fatalf("stale ref: %v, want ErrSnapshotGone", err)
	}
	data, err := pull(ref, false)
	if err != nil {
		t.Fatal(err)
	}
	if got, ok := ParseStagedSnapshot(data); !ok || got != ref || !joiner.SnapshotStaged(ref) {
		t.Fatalf("Finish gave %q (%+v %v), want the staged ref %+v", data, got, ok, ref)
	}
	snap.Data = data
	if err := joiner.ApplySnapshot(snap); err != nil {
		t.Fatal(err)
	}
	if want, got := bucketContents(t, master, BucketSessions), bucketContents(t, joiner, BucketSessions); !maps.Equal(want, got) {
		t.Fatalf("joiner holds %d keys, the master %d", len(got), len(want))
	}
	if joiner.SnapshotStaged(ref) {
		t.Error("the install left the snapshot staged")
	}
	// Once installed, the staged ref is not installed again.
	if err := joiner.ApplySnapshot(snap); err == nil {
		t.Error("a second install of the same staged ref succeeded")
	}
}
