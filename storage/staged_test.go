package storage

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"syscall"
	"testing"

	pb "go.etcd.io/raft/v3/raftpb"
)

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

// withFileSizeLimit runs fn with db's WAL files limited to limit bytes, so
// a write that would grow one past it fails (EFBIG), as on a full disk. The
// limit is db's alone (faults.go), not the process's RLIMIT_FSIZE.
func withFileSizeLimit(db *DB, limit int64, fn func()) {
	db.faults.fileLimit.Store(limit)
	defer db.faults.fileLimit.Store(0)
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
	withFileSizeLimit(db, limit, func() {
		if err := db.Save(hs, big); !errors.Is(err, syscall.EFBIG) {
			t.Fatalf("Save growing the WAL past its limit: %v, want EFBIG", err)
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
