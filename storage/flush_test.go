package storage

import (
	"path/filepath"
	"testing"
	"time"

	pb "go.etcd.io/raft/v3/raftpb"
)

// processCrashCopy copies an open DB's files whole: what a kill -9 leaves,
// since the kernel keeps what was written whether or not it was synced.
func processCrashCopy(t *testing.T, db *DB) string {
	t.Helper()
	db.ckMu.Lock()
	defer db.ckMu.Unlock()
	db.wmu.Lock()
	defer db.wmu.Unlock()
	return copyDataDir(t, filepath.Dir(db.Path()))
}

// Under flush: interval a Save returns without an fdatasync, the WAL is
// synced about once per interval however many Saves come, a process crash
// loses nothing and a power cut at most what came after the last sync.
func TestFlushIntervalSyncsOncePerInterval(t *testing.T) {
	const interval = 100 * time.Millisecond
	db := testOpen(t, t.TempDir(), &Options{FlushInterval: interval})
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1}, nil) // a vote: synced at once
	before := db.Syncs()
	start := time.Now()
	pace := time.NewTicker(time.Millisecond)
	defer pace.Stop()
	next := uint64(1)
	for time.Since(start) < time.Second {
		mustSave(t, db, pb.HardState{}, makeEntries(next, 1, 1))
		next++
		<-pace.C
	}
	elapsed := time.Since(start)
	syncs := db.Syncs() - before
	saves := next - 1
	t.Logf("%d saves in %v: %d fdatasyncs (%.1f/s, interval %v)", saves, elapsed, syncs, float64(syncs)/elapsed.Seconds(), interval)
	if want := float64(elapsed) / float64(interval); float64(syncs) < want/2 || float64(syncs) > want*1.5+2 {
		t.Errorf("%d fdatasyncs in %v, want about %.0f (one per %v)", syncs, elapsed, want, interval)
	}
	if saves < 100 || syncs*10 > saves {
		t.Errorf("%d saves, %d syncs: saves are not acked before their sync", saves, syncs)
	}

	// kill -9 now: every Save that returned is there.
	crashed := testOpen(t, processCrashCopy(t, db), &Options{ReadOnly: true})
	if l, _ := crashed.LastIndex(); l != next-1 {
		t.Errorf("after a process crash the log ends at %d, want %d", l, next-1)
	}
	// A power cut right after the flusher's sync: everything too.
	waitSynced := time.Now().Add(10 * time.Second)
	for {
		db.wmu.Lock()
		done := db.wal.synced.Load() == db.wal.off
		db.wmu.Unlock()
		if done {
			break
		}
		if time.Now().After(waitSynced) {
			t.Fatal("the flusher never synced the last frames")
		}
		time.Sleep(5 * time.Millisecond)
	}
	cut := crashCopyRO(t, db)
	if l, _ := cut.LastIndex(); l != next-1 {
		t.Errorf("after a power cut past the last sync the log ends at %d, want %d", l, next-1)
	}
	if hs := cut.HardState(); hs.Vote != 1 {
		t.Errorf("the vote was lost: %+v", hs)
	}
	// Sync is durable at once, as under flush: always.
	mustSave(t, db, pb.HardState{}, makeEntries(next, 1, 1))
	db.Stage(BucketSessions, "s", []byte("v"))
	if err := db.Sync(); err != nil {
		t.Fatal(err)
	}
	cut = crashCopyRO(t, db)
	if l, _ := cut.LastIndex(); l != next {
		t.Errorf("after Sync and a power cut the log ends at %d, want %d", l, next)
	}
	if got := sessions(t, cut, ""); got["s"] != "v" {
		t.Errorf("after Sync and a power cut the staged session is %q", got["s"])
	}
}

// Under flush: interval a background checkpoint's cut does not hold Saves
// for its fdatasync (on slow flash that fdatasync was on every ack of the
// moment), and nothing after the cut is synced before the cut is: a power
// cut while its sync is owed keeps only what was synced before, and a Sync
// then syncs the cut first and keeps everything.
func TestIntervalCutSyncsWithoutHoldingSaves(t *testing.T) {
	db := testOpen(t, t.TempDir(), &Options{FlushInterval: time.Hour, TailBytes: 64 << 10})
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1}, nil) // synced at once
	entered, release := make(chan struct{}, 4), make(chan struct{})
	hold := func() {
		entered <- struct{}{}
		<-release
	}
	db.faults.cutSync.Store(&hold)
	released := false
	defer func() {
		if !released {
			close(release)
		}
	}()
	waitEntered := func(what string) {
		t.Helper()
		select {
		case <-entered:
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: no sync of a cut frame reached within 10 s", what)
		}
	}

	// Enough for a checkpoint (a quarter of TailBytes), not for a Save to
	// checkpoint itself.
	mustSave(t, db, pb.HardState{}, makeEntries(1, 600, 1))
	waitEntered("the background checkpoint")

	// The cut's sync is held: Saves go on.
	saved := make(chan error, 1)
	go func() { saved <- db.Save(pb.HardState{}, makeEntries(601, 10, 1)) }()
	select {
	case err := <-saved:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a Save waited for the checkpoint's cut to be synced")
	}

	// A power cut now: the checkpointer holds ckMu, stopped before its
	// commit, so the copy is of one instant. The entries were never
	// synced, those after the cut included.
	cut := testOpen(t, crashCopyHeld(t, db), &Options{ReadOnly: true})
	if l, _ := cut.LastIndex(); l != 0 {
		t.Errorf("after a power cut with the cut's sync owed the log ends at %d, want 0 (nothing was synced)", l)
	}
	if hs := cut.HardState(); hs.Vote != 1 {
		t.Errorf("the vote was lost: %+v", hs)
	}

	// Sync must sync the cut before it returns: it is what makes the
	// frames after it live.
	synced := make(chan error, 1)
	go func() { synced <- db.Sync() }()
	waitEntered("Sync")
	close(release)
	released = true
	if err := <-synced; err != nil {
		t.Fatal(err)
	}
	after := crashCopyRO(t, db)
	if l, _ := after.LastIndex(); l != 610 {
		t.Errorf("after Sync and a power cut the log ends at %d, want 610", l)
	}
}
