package storage

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"
	"go.etcd.io/raft/v3"
	pb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// allEntries reads the whole log of db.
func allEntries(t *testing.T, db *DB) []pb.Entry {
	t.Helper()
	first, _ := db.FirstIndex()
	last, _ := db.LastIndex()
	if last < first {
		return nil
	}
	ents, err := db.Entries(first, last+1, math.MaxUint64)
	if err != nil {
		t.Fatalf("Entries(%d, %d): %v", first, last+1, err)
	}
	return ents
}

// boltLastIndex is the last index in the log bucket of a closed file.
func boltLastIndex(t *testing.T, dir string) uint64 {
	t.Helper()
	var last uint64
	boltView(t, filepath.Join(dir, FileName), func(tx *bolt.Tx) error {
		var err error
		last, err = lastLogIndex(tx.Bucket(bucketLog))
		return err
	})
	return last
}

// What Save returned is durable through the WAL alone: a kill -9 before any
// checkpoint leaves it only there, and the next Open has all of it back,
// read-only and read-write, and writes it into the file.
func TestWALReplaysWhatOnlyItHolds(t *testing.T) {
	db := testOpen(t, t.TempDir(), nil)
	want := makeEntries(1, 30, 1)
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1}, want[:10])
	mustCheckpoint(t, db)
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1, Commit: 10}, want[10:25])
	db.Stage(BucketSessions, "client/a", []byte("session"))
	db.SetApplied(9)
	mustSave(t, db, pb.HardState{}, want[25:])
	db.SetCommit(pb.HardState{Term: 1, Vote: 1, Commit: 28})
	if err := db.Flush(); err != nil {
		t.Fatal(err)
	}
	crashed := crashCopy(t, db)
	if got := boltLastIndex(t, crashed); got != 10 {
		t.Fatalf("fixture: the file holds entries up to %d, want 10 (the rest only in the WAL)", got)
	}
	for _, ro := range []bool{true, false} {
		db := testOpen(t, crashed, &Options{ReadOnly: ro})
		if d := diffEntries(allEntries(t, db), want); d != "" {
			t.Errorf("ReadOnly=%v: entries after the crash: %s", ro, d)
		}
		if hs, _, _ := db.InitialState(); hs != (pb.HardState{Term: 1, Vote: 1, Commit: 28}) {
			t.Errorf("ReadOnly=%v: hard state %+v", ro, hs)
		}
		if db.Applied() != 9 {
			t.Errorf("ReadOnly=%v: applied %d, want 9", ro, db.Applied())
		}
		if got := sessions(t, db, ""); got["client/a"] != "session" {
			t.Errorf("ReadOnly=%v: sessions %v", ro, got)
		}
		var scanned []pb.Entry
		if err := db.Scan(1, func(e pb.Entry) bool { scanned = append(scanned, e); return true }); err != nil {
			t.Fatal(err)
		}
		if d := diffEntries(scanned, want); d != "" {
			t.Errorf("ReadOnly=%v: Scan: %s", ro, d)
		}
		if n, err := db.DataRecords(); err != nil || n != 30 {
			t.Errorf("ReadOnly=%v: DataRecords = %d, %v; want 30", ro, n, err)
		}
		mustClose(t, db)
	}
	if got := boltLastIndex(t, crashed); got != 30 {
		t.Errorf("after a read-write open the file holds entries up to %d, want 30", got)
	}
}

// The end of the WAL may be a frame torn by the crash (never acked): it is
// ignored. A damaged frame with a good one after it is acked data gone bad:
// Open refuses, names the offset, and changes neither file.
func TestWALTornEndAndDamagedMiddle(t *testing.T) {
	var wal string // the WAL file the fixture's frames are in
	fixture := func(t *testing.T) (dir string, offs []int64, want []pb.Entry) {
		db := testOpen(t, t.TempDir(), nil)
		wal = WALName + []string{".0", ".1"}[db.wal.cur]
		want = makeEntries(1, 12, 1)
		for i := 0; i < 12; i += 4 {
			offs = append(offs, db.wal.off)
			mustSave(t, db, pb.HardState{Term: 1, Vote: 1}, want[i:i+4])
		}
		offs = append(offs, db.wal.off)
		return crashCopy(t, db), offs, want
	}
	flip := func(t *testing.T, dir string, off int64) {
		t.Helper()
		xorByte(t, filepath.Join(dir, wal), off, 0x55)
	}

	t.Run("torn end", func(t *testing.T) {
		dir, offs, want := fixture(t)
		flip(t, dir, offs[3]-3) // inside the last frame's last entry
		db := testOpen(t, dir, nil)
		if d := diffEntries(allEntries(t, db), want[:8]); d != "" {
			t.Errorf("after a torn last frame: %s", d)
		}
		// New frames go where the torn one was, and survive a crash.
		mustSave(t, db, pb.HardState{Term: 1, Vote: 1}, makeEntries(9, 2, 2))
		again := testOpen(t, crashCopy(t, db), &Options{ReadOnly: true})
		if l, _ := again.LastIndex(); l != 10 {
			t.Errorf("LastIndex after saving past a torn end and crashing = %d, want 10", l)
		}
	})

	t.Run("damaged middle", func(t *testing.T) {
		dir, offs, _ := fixture(t)
		flip(t, dir, offs[1]+walHdr+30) // inside the second frame
		hashes := []([32]byte){fileHash(t, filepath.Join(dir, FileName)), fileHash(t, filepath.Join(dir, wal))}
		for _, ro := range []bool{true, false} {
			_, err := openChecked(t, dir, &Options{ReadOnly: ro})
			if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "offset") {
				t.Errorf("ReadOnly=%v: Open with a damaged frame before a good one: %v, want ErrCorrupt naming the offset", ro, err)
			}
		}
		if fileHash(t, filepath.Join(dir, FileName)) != hashes[0] || fileHash(t, filepath.Join(dir, wal)) != hashes[1] {
			t.Error("a refused Open changed the data file or the WAL")
		}
	})

	// A WAL file cut short (truncated by hand, copied in part) lost acked
	// frames: a power cut cannot shorten a file its grow synced. Open
	// refuses, whether the cut falls between frames or inside one.
	for _, cut := range []struct {
		name string
		at   func(offs []int64) int64
	}{
		{"cut after the first frame", func(offs []int64) int64 { return offs[1] }},
		{"cut inside the second frame", func(offs []int64) int64 { return offs[1] + walHdr + 10 }},
	} {
		t.Run(cut.name, func(t *testing.T) {
			dir, offs, _ := fixture(t)
			if err := os.Truncate(filepath.Join(dir, wal), cut.at(offs)); err != nil {
				t.Fatal(err)
			}
			for _, ro := range []bool{true, false} {
				_, err := openChecked(t, dir, &Options{ReadOnly: ro})
				if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "cut short") {
					t.Errorf("ReadOnly=%v: Open of a WAL cut short: %v, want ErrCorrupt saying it is cut short", ro, err)
				}
			}
		})
	}

	// A grow the power cut interrupted leaves the file short of a whole
	// step past every frame: nothing was lost, and Open goes on.
	t.Run("interrupted grow", func(t *testing.T) {
		dir, offs, want := fixture(t)
		if err := os.Truncate(filepath.Join(dir, wal), walPrealloc+4096); err != nil {
			t.Fatal(err)
		}
		db := testOpen(t, dir, nil)
		if d := diffEntries(allEntries(t, db), want); d != "" {
			t.Errorf("after an interrupted grow (frames end at %d): %s", offs[3], d)
		}
	})
}

// After a checkpoint the WAL's frames are dead: the file holds them, and
// the next frames overwrite them from the start. Nothing is replayed twice,
// and an append that overwrote entries (a deposed master rejoining) is not
// undone by frames from before it.
func TestWALFramesBeforeACheckpointAreDead(t *testing.T) {
	db := testOpen(t, t.TempDir(), nil)
	old := makeEntries(1, 10, 1)
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1}, old)
	newer := makeEntries(5, 2, 2)
	mustSave(t, db, pb.HardState{Term: 2, Vote: 2}, newer) // overwrites 5..10
	if db.wal.off != 0 {
		t.Fatalf("WAL offset %d after an overwriting append, want 0 (it checkpoints)", db.wal.off)
	}
	mustSave(t, db, pb.HardState{Term: 2, Vote: 2}, makeEntries(7, 1, 2))
	want := append(append(slices.Clone(old[:4]), newer...), makeEntry(7, 2))
	for _, ro := range []bool{true, false} {
		crashed := testOpen(t, crashCopy(t, db), &Options{ReadOnly: ro})
		if d := diffEntries(allEntries(t, crashed), want); d != "" {
			t.Errorf("ReadOnly=%v: after the crash: %s", ro, d)
		}
		rq, err := crashed.Requeued(100)
		if err != nil || len(rq) != 6 {
			t.Errorf("ReadOnly=%v: %d requeued (%v), want the 6 overwritten", ro, len(rq), err)
		}
	}

	// Many frames, several checkpoints: the log ends up whole, once.
	db2 := testOpen(t, t.TempDir(), &Options{TailBytes: 64 << 10})
	var all []pb.Entry
	for i := uint64(0); i < 300; i++ {
		ents := makeEntries(1+i*10, 10, 1)
		all = append(all, ents...)
		mustSave(t, db2, pb.HardState{Term: 1, Vote: 1}, ents)
	}
	if db2.Syncs() >= 2*db2.Commits() || db2.Syncs() <= db2.Commits() {
		t.Errorf("%d fdatasyncs for %d durable writes: want WAL appends (1) and some checkpoints (2)", db2.Syncs(), db2.Commits())
	}
	crashed := testOpen(t, crashCopy(t, db2), nil)
	if d := diffEntries(allEntries(t, crashed), all); d != "" {
		t.Errorf("after checkpoints and a crash: %s", d)
	}
}

// The WAL is part of the data: a file of format 2 without it is refused
// (it may have held acked records), unless an empty one is put there on
// purpose. A format 1 file, from before the WAL, opens and is upgraded.
func TestWALMissingAndUpgrade(t *testing.T) {
	dir := t.TempDir()
	want := writeLog(t, dir, 60)
	wal := filepath.Join(dir, WALName+".1")
	if err := os.Remove(wal); err != nil {
		t.Fatal(err)
	}
	for _, ro := range []bool{true, false} {
		_, err := openChecked(t, dir, &Options{ReadOnly: ro})
		if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), WALName) {
			t.Errorf("ReadOnly=%v: Open without the WAL: %v, want ErrCorrupt naming %s", ro, err, WALName)
		}
	}
	if names := dirNames(t, dir); !reflect.DeepEqual(names, []string{FileName, WALName + ".0"}) {
		t.Errorf("a refused Open left %v in the data dir", names)
	}
	if err := os.WriteFile(wal, nil, 0o640); err != nil {
		t.Fatal(err)
	}
	db := testOpen(t, dir, nil)
	if d := diffEntries(allEntries(t, db), want); d != "" {
		t.Errorf("with an empty WAL put back: %s", d)
	}
	mustClose(t, db)

	// Format 1: no WAL, no WAL id, an entry per key.
	boltUpdate(t, filepath.Join(dir, FileName), func(tx *bolt.Tx) error {
		if err := singleEntryKeys(tx); err != nil {
			return err
		}
		m := tx.Bucket(bucketMeta)
		if err := m.Put(keyFormat, u64(1)); err != nil {
			return err
		}
		return m.Delete(keyWAL)
	})
	for _, name := range []string{WALName + ".0", WALName + ".1"} {
		if err := os.Remove(filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	db = testOpen(t, dir, nil)
	if d := diffEntries(allEntries(t, db), want); d != "" {
		t.Errorf("format 1 file: %s", d)
	}
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1, Commit: 61}, makeEntries(61, 1, 1))
	mustClose(t, db)
	boltView(t, filepath.Join(dir, FileName), func(tx *bolt.Tx) error {
		if f := binary.BigEndian.Uint64(tx.Bucket(bucketMeta).Get(keyFormat)); f != formatRuns {
			t.Errorf("format %d after a read-write open, want %d", f, formatRuns)
		}
		return nil
	})
	if _, err := os.Stat(wal); err != nil {
		t.Errorf("no WAL after the upgrade: %v", err)
	}
}

// failCommits makes every checkpoint of the DB with failpoints f fail, as
// a full disk would, until the test stores nil in f.commit, and returns the
// error.
func failCommits(f *faults) error {
	full := errors.New("no space left on device (simulated)")
	f.commit.Store(&full)
	return full
}

// stopAfterCut makes a background checkpoint's cut and stops it there, as
// if its commit had not run yet or had failed: frames go on in the other
// file, and those before the cut stay live. It returns with ckMu held, so
// no checkpoint runs until the test unlocks it.
func stopAfterCut(t *testing.T, db *DB) {
	t.Helper()
	db.ckMu.Lock()
	db.wmu.Lock()
	c, err := db.cutLocked(false)
	db.wmu.Unlock()
	if err != nil {
		db.ckMu.Unlock()
		t.Fatal(err)
	}
	db.pendingCut = c
}

// A crash between a checkpoint's cut and its commit leaves live frames in
// both WAL files: those before the cut in one, those after in the other.
// Open replays both, in order.
func TestWALReplaysAcrossACut(t *testing.T) {
	db := testOpen(t, t.TempDir(), nil)
	want := makeEntries(1, 20, 1)
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1}, want[:8])
	stopAfterCut(t, db) // the background checkpoint, stopped after its cut
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1, Commit: 8}, want[8:15])
	db.Stage(BucketSessions, "after/cut", []byte("yes"))
	mustSave(t, db, pb.HardState{}, want[15:])
	crashed := crashCopyHeld(t, db)
	db.ckMu.Unlock()
	if got := boltLastIndex(t, crashed); got != 0 {
		t.Fatalf("fixture: the file holds entries up to %d, want none", got)
	}
	for _, ro := range []bool{true, false} {
		db := testOpen(t, crashed, &Options{ReadOnly: ro})
		if d := diffEntries(allEntries(t, db), want); d != "" {
			t.Errorf("ReadOnly=%v: after a crash within a checkpoint: %s", ro, d)
		}
		if hs, _, _ := db.InitialState(); hs.Commit != 8 {
			t.Errorf("ReadOnly=%v: commit index %d, want 8", ro, hs.Commit)
		}
		if got := sessions(t, db, ""); got["after/cut"] != "yes" {
			t.Errorf("ReadOnly=%v: sessions %v", ro, got)
		}
		mustClose(t, db)
	}
	// The pending cut commits with the next checkpoint; nothing is lost.
	mustCheckpoint(t, db)
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1, Commit: 20}, makeEntries(21, 1, 1))
	again := testOpen(t, crashCopy(t, db), nil)
	if l, _ := again.LastIndex(); l != 21 {
		t.Errorf("LastIndex after the pending cut committed and a crash = %d, want 21", l)
	}
}

// A write staged after a checkpoint's cut keeps its claim to a frame even
// when the checkpoint writes it into the file: an older value of its key,
// framed after the cut, would otherwise replay over it after a crash.
func TestStagedAfterCutIsFramed(t *testing.T) {
	db := testOpen(t, t.TempDir(), nil)
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1}, makeEntries(1, 2, 1))
	stopAfterCut(t, db)
	db.Stage(BucketSessions, "k", []byte("v1"))
	mustSave(t, db, pb.HardState{}, makeEntries(3, 1, 1)) // frames v1 after the cut
	db.Stage(BucketSessions, "k", []byte("v2"))
	err := db.finishPending() // the checkpoint commits, with v2 from the stage
	db.ckMu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	mustSave(t, db, pb.HardState{}, makeEntries(4, 1, 1)) // a Save after Stage(v2) returns
	crashed := testOpen(t, crashCopy(t, db), &Options{ReadOnly: true})
	if got := sessions(t, crashed, ""); got["k"] != "v2" {
		t.Errorf("after a crash: k = %q, want v2 (staged before the last Save)", got["k"])
	}
}

// Open's own checkpoint may fail (a full disk), again at every restart of
// the service. Each failed Open must leave the WAL as it found it, even when
// the frames it replayed already cross a cut that no commit recorded: a new
// cut there would send the next frames over live ones.
func TestOpenWhoseCheckpointFailsKeepsTheWAL(t *testing.T) {
	db := testOpen(t, t.TempDir(), &Options{TailBytes: 64 << 20})
	var want []pb.Entry
	save := func(n int) {
		ents := makeEntries(uint64(len(want)+1), uint64(n), 1)
		for i := range ents {
			ents[i].Data = append(ents[i].Data, make([]byte, 1000)...)
		}
		want = append(want, ents...)
		mustSave(t, db, pb.HardState{Term: 1, Vote: 1}, ents)
	}
	save(300)
	stopAfterCut(t, db) // a background checkpoint cut, then its commit failed
	save(300)
	dir := crashCopyHeld(t, db)
	db.ckMu.Unlock()
	mustClose(t, db)

	fs := &faults{}
	full := failCommits(fs)
	for i := range 2 {
		if db, err := openChecked(t, dir, &Options{faults: fs}); !errors.Is(err, full) {
			if err == nil {
				db.Close()
			}
			t.Fatalf("Open %d with failing commits: %v, want the commit's error", i, err)
		}
	}
	db = testOpen(t, dir, nil) // failpoints are per DB: this one has none
	if d := diffEntries(allEntries(t, db), want); d != "" {
		t.Errorf("after two Opens whose checkpoint failed: %s", d)
	}
}

// decodeFrame runs only on payloads whose CRC matched, but a frame written
// by a buggy or newer build must still give an error, never a panic that
// would crash-loop the daemon at Open.
func FuzzDecodeFrame(f *testing.F) {
	w := &walLog{id: 1}
	hs := pb.HardState{Term: 2, Vote: 1, Commit: 3}
	ops := []stagedOp{
		{bucket: BucketSessions, key: "k", val: []byte("v")},
		{bucket: strings.Repeat("b", 255), key: "deleted"},
	}
	f.Add(slices.Clone(w.encodeFrame(&hs, 0, -1, ops, makeEntries(7, 3, 2))[walHdr:]))
	f.Add(slices.Clone(w.encodeFrame(nil, 9, -1, nil, nil)[walHdr:]))
	f.Add(slices.Clone(w.encodeFrame(nil, 0, 4000, ops, makeEntries(7, 3, 2))[walHdr:]))
	f.Add([]byte{0})
	f.Fuzz(func(t *testing.T, p []byte) {
		fr, err := decodeFrame(p)
		if err != nil {
			return
		}
		// What decodes encodes to a frame that decodes the same.
		prev := int64(-1)
		if fr.padded {
			prev = fr.prev
		}
		again, err := decodeFrame(slices.Clone(w.encodeFrame(fr.hs, fr.next, prev, fr.ops, fr.ents)[walHdr:]))
		if err != nil {
			t.Fatalf("a decoded frame, encoded again, fails to decode: %v", err)
		}
		if !reflect.DeepEqual(again, fr) {
			t.Errorf("decode, encode, decode changed the frame:\n%+v\n%+v", fr, again)
		}
	})
}

// The entries and the metadata the WAL holds reach the file in the
// background, without another write to wait for: Saves of entries, and
// Flushes of metadata alone.
func TestCheckpointsRunInTheBackground(t *testing.T) {
	db := testOpen(t, t.TempDir(), &Options{TailBytes: 64 << 10})
	inFile := func() uint64 {
		db.mu.RLock()
		defer db.mu.RUnlock()
		return db.boltLast
	}
	ents := makeEntries(1, 200, 1)
	for i := range ents {
		ents[i].Data = append(ents[i].Data, make([]byte, 200)...) // 200 entries, some 45 KiB
	}
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1}, ents)
	testutil.WaitFor(t, 10*time.Second, "the saved entries are in the file", func() bool { return inFile() == 200 })

	// Flushes past the WAL's checkpoint mark: the one that crosses it
	// wakes the checkpointer, whose cut takes at least what was flushed up
	// to there. (What is flushed after that cut waits for the next mark or
	// Close: the WAL holds it, and readers see it in the stage.)
	big := make([]byte, 64<<10)
	for i := range walCheckpointAt/len(big) + 1 {
		db.Stage(BucketSessions, fmt.Sprintf("s/%02d", i), big)
		if err := db.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	testutil.WaitFor(t, 10*time.Second, "the first flushed metadata is in the file", func() bool {
		_, staged := db.stagedValue(BucketSessions, "s/00")
		return !staged
	})
	var inBolt bool
	if err := db.bolt.View(func(tx *bolt.Tx) error {
		inBolt = tx.Bucket([]byte(BucketSessions)).Get([]byte("s/00")) != nil
		return nil
	}); err != nil || !inBolt {
		t.Errorf("s/00 left the stage but is not in the file (%v)", err)
	}
}

// When checkpoints keep failing (a full disk), the WAL does not grow
// without end: past its bound, a write checkpoints itself and fails with
// the checkpoint's error, having written nothing, and works again once
// checkpoints do. In format 6 the bound is on the frames past the replay
// point, the segments being the log.
func TestWALStopsGrowingWhileCheckpointsFail(t *testing.T) {
	forFormats(t, testWALStopsGrowingWhileCheckpointsFail)
}

func testWALStopsGrowingWhileCheckpointsFail(t *testing.T, seg bool) {
	dir := t.TempDir()
	db := testOpen(t, dir, &Options{segmented: seg})
	full := failCommits(db.faults)
	big := make([]byte, 256<<10)
	var err error
	staged := 0
	for staged < 100 && err == nil {
		db.Stage(BucketSessions, fmt.Sprintf("s/%03d", staged), big)
		err = db.Flush()
		staged++
	}
	if !errors.Is(err, full) {
		t.Fatalf("%d Flushes of 256 KiB with failing checkpoints: %v, want the checkpoint's error", staged, err)
	}
	if seg {
		if n := db.wal.sinceMark.Load(); n > chainBehindAt+int64(len(big))+walPage {
			t.Errorf("%d bytes of frames past the replay point, want at most about %d", n, chainBehindAt)
		}
	} else {
		db.wmu.Lock()
		size := db.wal.segs[db.wal.cur].size
		db.wmu.Unlock()
		if size > walBehindAt+walPrealloc {
			t.Errorf("the WAL file grew to %d bytes, want at most %d", size, walBehindAt+walPrealloc)
		}
		if size%walPrealloc != 0 {
			t.Errorf("the WAL file is %d bytes: it grows by whole steps of %d", size, walPrealloc)
		}
	}
	if err := db.Save(pb.HardState{Term: 1, Vote: 1}, makeEntries(1, 1, 1)); !errors.Is(err, full) {
		t.Errorf("Save with the WAL full and failing checkpoints: %v, want the checkpoint's error", err)
	}
	db.faults.commit.Store(nil)
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1}, makeEntries(1, 1, 1))
	if err := db.Flush(); err != nil {
		t.Fatal(err)
	}
	again := testOpen(t, crashCopy(t, db), &Options{ReadOnly: true})
	if got := sessions(t, again, "s/"); len(got) != staged {
		t.Errorf("%d sessions durable, want all %d staged", len(got), staged)
	}
}

// Stage refuses what bbolt cannot store (an MQTT client id or topic may be
// 64 KiB long, bbolt's keys 32 KiB): written, it would fail every
// checkpoint, and the daemon at every start.
func TestStageRefusesKeysTheFileCannotHold(t *testing.T) {
	dir := t.TempDir()
	db := testOpen(t, dir, nil)
	db.Stage(BucketSessions, strings.Repeat("k", bolt.MaxKeySize+1), []byte("v"))
	db.Stage("", "k", []byte("v"))
	db.Stage(BucketSessions, "", []byte("v"))
	db.Stage(BucketSessions, "ok", []byte("v"))
	if got := sessions(t, db, ""); len(got) != 1 || got["ok"] != "v" {
		t.Errorf("sessions %v, want only ok=v", got)
	}
	mustCheckpoint(t, db)
	mustClose(t, db)
	db = testOpen(t, dir, nil)
	if got := sessions(t, db, ""); len(got) != 1 {
		t.Errorf("sessions after reopen %v, want only ok", got)
	}
}

// Writes that race Close either land or get ErrClosed, never another
// error; what landed is there at the next Open.
func TestWritesRacingClose(t *testing.T) {
	for round := range 20 {
		dir := t.TempDir()
		db, err := Open(dir, nil)
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		var saved atomic.Uint64
		synced := make([]atomic.Bool, 50)
		wg.Add(2)
		go func() { // the replication loop
			defer wg.Done()
			for i := uint64(1); ; i++ {
				err := db.Save(pb.HardState{Term: 1, Vote: 1}, makeEntries(i, 1, 1))
				if err != nil {
					if !errors.Is(err, ErrClosed) {
						t.Errorf("round %d: Save racing Close: %v, want ErrClosed", round, err)
					}
					return
				}
				saved.Store(i)
			}
		}()
		go func() { // the broker
			defer wg.Done()
			for i := range synced {
				db.Stage(BucketSessions, fmt.Sprintf("s/%02d", i), []byte("v"))
				err := db.Sync()
				if err != nil {
					if !errors.Is(err, ErrClosed) {
						t.Errorf("round %d: Sync racing Close: %v, want ErrClosed", round, err)
					}
					return
				}
				synced[i].Store(true)
			}
		}()
		for saved.Load() < uint64(round) {
			runtime.Gosched()
		}
		if err := db.Close(); err != nil {
			t.Fatalf("Close: %v", err)
		}
		wg.Wait()
		db = testOpen(t, dir, nil)
		if l, _ := db.LastIndex(); l < saved.Load() {
			t.Errorf("round %d: LastIndex %d after reopen, but Save returned for %d", round, l, saved.Load())
		}
		got := sessions(t, db, "s/")
		for i := range synced {
			if k := fmt.Sprintf("s/%02d", i); synced[i].Load() && got[k] == "" {
				t.Errorf("round %d: %s was synced, missing after reopen", round, k)
			}
		}
		mustClose(t, db)
	}

	// A writer that passed its closed check just before Close began gets
	// the WAL lock only after Close let it go: it must get ErrClosed, not
	// a write to a closed file.
	db := testOpen(t, t.TempDir(), nil)
	mustClose(t, db)
	db.wmu.Lock()
	_, err := db.appendWAL(nil, 0, nil, makeEntries(1, 1, 1), false)
	db.wmu.Unlock()
	if !errors.Is(err, ErrClosed) {
		t.Errorf("a WAL write after Close: %v, want ErrClosed", err)
	}
}

// Once a checkpoint has failed (a full disk), the WAL runs ahead of the
// file by no more than a checkpoint's worth: whatever it holds must fit in
// the file, which grows by doubling, once space returns.
func TestWALRunsAheadLittleOnceACheckpointFailed(t *testing.T) {
	db := testOpen(t, t.TempDir(), &Options{TailBytes: 64 << 10})
	full := failCommits(db.faults)
	batch := func(i uint64) []pb.Entry {
		ents := makeEntries(1+i*4, 4, 1)
		for j := range ents {
			ents[j].Data = append(ents[j].Data, make([]byte, 1200)...) // ~5 KiB a batch
		}
		return ents
	}
	i := uint64(0)
	for ; i < 4; i++ { // 20 KiB: past a quarter of the budget, a checkpoint is due
		mustSave(t, db, pb.HardState{Term: 1, Vote: 1}, batch(i))
	}
	testutil.WaitFor(t, 10*time.Second, "the background checkpoint has failed", db.ckFailed.Load)
	if err := db.Save(pb.HardState{Term: 1, Vote: 1}, batch(i)); !errors.Is(err, full) {
		t.Fatalf("Save with 20 KiB waiting and checkpoints failing: %v, want the checkpoint's error (the WAL would run 64 KiB ahead)", err)
	}
	db.faults.commit.Store(nil)
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1}, batch(i))
	if db.ckFailed.Load() {
		t.Error("checkpoints still marked failing after one succeeded")
	}
}

// singleEntryKeys rewrites the log bucket as files before format 3 hold it:
// one entry per 8-byte key.
func singleEntryKeys(tx *bolt.Tx) error {
	lb := tx.Bucket(bucketLog)
	type kv struct{ k, v []byte }
	var singles []kv
	var runs [][]byte
	err := eachEntry(lb, 0, func(idx uint64, v []byte) (bool, error) {
		singles = append(singles, kv{u64(idx), bytes.Clone(v)})
		return true, nil
	})
	if err != nil {
		return err
	}
	c := lb.Cursor()
	for k, _ := c.First(); k != nil; k, _ = c.Next() {
		runs = append(runs, bytes.Clone(k))
	}
	for _, k := range runs {
		if err := lb.Delete(k); err != nil {
			return err
		}
	}
	for _, s := range singles {
		if err := lb.Put(s.k, s.v); err != nil {
			return err
		}
	}
	return nil
}

// A format 2 file keeps its entries one per key; new entries go in runs
// after them. Every read, an overwrite that cuts into the old entries, and
// a reopen see one log, and the file says format 3 after the first
// read-write open, which format 2 builds refuse.
func TestFormat2EntriesReadAlongsideRuns(t *testing.T) {
	for _, tail := range []int{0, 1} {
		t.Run(fmt.Sprintf("tail=%d", tail), func(t *testing.T) {
			dir := t.TempDir()
			opts := &Options{TailBytes: tail}
			ms := raft.NewMemoryStorage()
			old := makeEntries(1, 30, 1)
			db := testOpen(t, dir, opts)
			mustSave(t, db, pb.HardState{Term: 1, Vote: 1, Commit: 10}, old)
			mustClose(t, db)
			if err := ms.Append(old); err != nil {
				t.Fatal(err)
			}
			boltUpdate(t, filepath.Join(dir, FileName), func(tx *bolt.Tx) error {
				if err := singleEntryKeys(tx); err != nil {
					return err
				}
				return tx.Bucket(bucketMeta).Put(keyFormat, u64(2))
			})
			keys := func() (singles, runs int) {
				boltView(t, filepath.Join(dir, FileName), func(tx *bolt.Tx) error {
					c := tx.Bucket(bucketLog).Cursor()
					for k, _ := c.First(); k != nil; k, _ = c.Next() {
						if len(k) == 8 {
							singles++
						} else {
							runs++
						}
					}
					return nil
				})
				return singles, runs
			}
			if s, r := keys(); s != 30 || r != 0 {
				t.Fatalf("fixture: %d single entries and %d runs, want 30 and 0", s, r)
			}

			db = testOpen(t, dir, opts)
			checkLog(t, db, ms)
			for _, step := range []struct {
				hs   pb.HardState
				ents []pb.Entry
			}{
				{pb.HardState{Term: 1, Vote: 1, Commit: 20}, makeEntries(31, 20, 1)},
				// A new leader overwrites from 26 on: old entries and runs.
				{pb.HardState{Term: 2, Vote: 2, Commit: 25}, makeEntries(26, 10, 2)},
			} {
				mustSave(t, db, step.hs, step.ents)
				mustCheckpoint(t, db)
				if err := ms.Append(step.ents); err != nil {
					t.Fatal(err)
				}
				checkLog(t, db, ms)
			}
			got := requeued(t, db)
			sortEntries(got)
			if d := diffEntries(got, makeEntries(26, 25, 1)); d != "" {
				t.Errorf("requeued after the overwrite: %s", d)
			}
			if n, err := db.DataRecords(); err != nil || n != 35 {
				t.Errorf("DataRecords = %d, %v; want 35", n, err)
			}
			mustClose(t, db)
			if s, r := keys(); s != 25 || r == 0 {
				t.Errorf("after the overwrite: %d single entries and %d runs, want 25 and some", s, r)
			}
			boltView(t, filepath.Join(dir, FileName), func(tx *bolt.Tx) error {
				if f := binary.BigEndian.Uint64(tx.Bucket(bucketMeta).Get(keyFormat)); f != formatRuns {
					t.Errorf("format %d after a read-write open, want %d", f, formatRuns)
				}
				return nil
			})
			for _, ro := range []bool{true, false} {
				db := testOpen(t, dir, &Options{ReadOnly: ro, TailBytes: tail})
				checkLog(t, db, ms)
				mustClose(t, db)
			}
		})
	}
}

// Checkpoints write entries as runs that fit a leaf two by two: far fewer
// keys than entries, and no overflow pages, which bbolt would allocate anew
// and rewrite on every commit. (The last leaf may run over into one: bbolt
// splits no node of four keys or fewer, and the next commit splits it.)
func TestRunsFitInPages(t *testing.T) {
	dir := t.TempDir()
	ents := writeLog(t, dir, 2000)
	boltView(t, filepath.Join(dir, FileName), func(tx *bolt.Tx) error {
		st := tx.Bucket(bucketLog).Stats()
		if st.LeafOverflowN > 1 {
			t.Errorf("the log bucket has %d overflow pages, want one at most", st.LeafOverflowN)
		}
		if st.KeyN > len(ents)/5 {
			t.Errorf("%d keys for %d entries of %d bytes: runs hold too few", st.KeyN, len(ents), entrySize(&ents[0]))
		}
		return nil
	})
}

// A frame that would spill into a page more than it needs starts at the
// next page boundary (padFrame), past a gap nobody writes: a crash then
// keeps every frame, the ones after gaps included, and the next Open
// reads on across the gaps.
func TestPaddedFramesSurviveACrash(t *testing.T) {
	db, err := Open(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	// Frames of about 3 KB: each would straddle a page boundary.
	big := func(idx uint64) pb.Entry {
		return pb.Entry{Index: idx, Term: 1, Type: pb.EntryNormal, Data: bytes.Repeat([]byte{byte(idx)}, 3000)}
	}
	for i := uint64(1); i <= 20; i++ {
		mustSave(t, db, pb.HardState{Term: 1, Vote: 1, Commit: i}, []pb.Entry{big(i)})
	}
	frames := liveFrames(t, db)
	padded := 0
	for _, fr := range frames {
		if fr.padded {
			padded++
			if fr.off%walPage != 0 {
				t.Errorf("a padded frame at offset %d, not at a page boundary", fr.off)
			}
		}
	}
	if padded != 19 {
		t.Fatalf("%d of %d frames padded, want 19", padded, len(frames))
	}
	dir := crashCopy(t, db)
	re, err := Open(dir, nil)
	if err != nil {
		t.Fatalf("reopening after a crash with %d padded frames: %v", padded, err)
	}
	defer re.Close()
	ents, err := re.Entries(1, 21, math.MaxUint64)
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) != 20 {
		t.Fatalf("after the crash the log holds %d entries, want 20", len(ents))
	}
	for i, e := range ents {
		if !bytes.Equal(e.Data, big(uint64(i+1)).Data) {
			t.Fatalf("entry %d differs after the crash", i+1)
		}
	}
}

// liveFrames reads the current WAL file's live frames of an idle DB.
func liveFrames(t *testing.T, db *DB) []walFrame {
	t.Helper()
	db.wmu.Lock()
	defer db.wmu.Unlock()
	frames, _, err := db.wal.segs[db.wal.cur].readFrames(db.wal.id)
	if err != nil {
		t.Fatal(err)
	}
	return frames
}

// A frame past a gap is the log's next only if it says it follows the
// frame before the gap: when a frame before the gap is damaged (here one
// of a hard state only, whose loss nothing else would notice), the good
// frame past the gap is an acked one that would be lost, and Open refuses.
func TestDamagedFrameBeforePaddingIsCorruption(t *testing.T) {
	db, err := Open(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1, Commit: 0}, []pb.Entry{{Index: 1, Term: 1, Type: pb.EntryNormal, Data: []byte("small")}})
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1, Commit: 1}, nil)
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1, Commit: 1}, []pb.Entry{{Index: 2, Term: 1, Type: pb.EntryNormal, Data: bytes.Repeat([]byte{'x'}, 4000)}})
	frames := liveFrames(t, db)
	if len(frames) != 3 || frames[1].padded || !frames[2].padded || frames[2].off != walPage {
		t.Fatalf("frames %+v: want two unpadded, then a padded one at %d", frames, walPage)
	}
	dir := crashCopy(t, db)
	xorByte(t, filepath.Join(dir, fmt.Sprintf("%s.%d", WALName, db.wal.cur)), frames[1].off+walHdr+2, 0xff)
	if re, err := Open(dir, nil); !errors.Is(err, ErrCorrupt) {
		if err == nil {
			re.Close()
		}
		t.Fatalf("Open with a damaged frame before a padded good one: %v, want ErrCorrupt", err)
	}
}

// A file whose WAL may hold padded frames says format 5 while it is open,
// so that a release before padded frames, which would take the gap before
// one for damage, refuses a data dir a crash left, naming both versions;
// a clean Close puts back what it said before (3, or 4 once an entry was
// stored in pieces, also while it said 5), so that such a release opens a
// data dir left by a clean stop.
func TestFormatFiveOnlyWhileFramesMayBePadded(t *testing.T) {
	dir := t.TempDir()
	db := testOpen(t, dir, nil)
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1, Commit: 1}, makeEntries(1, 1, 1))
	if f := fileFormat(t, filepath.Join(crashCopy(t, db), FileName)); f != formatPadded {
		t.Errorf("format %d in a crash copy of an open file, want %d", f, formatPadded)
	}
	mustClose(t, db)
	if f := fileFormat(t, filepath.Join(dir, FileName)); f != formatRuns {
		t.Errorf("format %d after a clean close, want %d", f, formatRuns)
	}

	// An entry in pieces while the file says 5: the clean close leaves 4.
	db = testOpen(t, dir, nil)
	ps := db.bolt.Info().PageSize
	mustSave(t, db, pb.HardState{Term: 1, Vote: 1, Commit: 2}, []pb.Entry{{Index: 2, Term: 1, Data: bytes.Repeat([]byte{7}, 3*ps)}})
	if err := db.commit(nil); err != nil {
		t.Fatal(err)
	}
	if f := fileFormat(t, filepath.Join(crashCopy(t, db), FileName)); f != formatPadded {
		t.Errorf("format %d in a crash copy with pieces, want %d", f, formatPadded)
	}
	mustClose(t, db)
	if f := fileFormat(t, filepath.Join(dir, FileName)); f != formatPieces {
		t.Errorf("format %d after a clean close with pieces, want %d", f, formatPieces)
	}
}
