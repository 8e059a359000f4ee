package storage

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"reflect"
	"slices"
	"sync"
	"testing"

	"go.etcd.io/raft/v3"
	pb "go.etcd.io/raft/v3/raftpb"
)

// ---------------------------------------------------------------------------
// 2. The raft.Storage contract

func TestRaftStorageContract(t *testing.T) { forFormats(t, testRaftStorageContract) }

func testRaftStorageContract(t *testing.T, seg bool) {
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
			opts := &Options{TailBytes: tc.tail, segmented: seg}
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
func TestConcurrentReadsDuringSaves(t *testing.T) { forFormats(t, testConcurrentReadsDuringSaves) }

func testConcurrentReadsDuringSaves(t *testing.T, seg bool) {
	db := testOpen(t, t.TempDir(), &Options{TailBytes: 2000, segmented: seg})
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
	forFormats(t, testConflictingAppendRequeuesOverwrittenData)
}

func testConflictingAppendRequeuesOverwrittenData(t *testing.T, seg bool) {
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
				opts := &Options{TailBytes: tail, segmented: seg}
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
	forFormats(t, testRequeueKeepsEntriesOverwrittenTwice)
}

func testRequeueKeepsEntriesOverwrittenTwice(t *testing.T, seg bool) {
	dir := t.TempDir()
	db := testOpen(t, dir, &Options{segmented: seg})
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

// Once the tail holds its budget, appending moves it within its array:
// no allocation per batch (a sliced-off front let append copy the whole
// tail into a new array every quarter tail), and readers still get every
// entry right, before and after the tail moved back to the array's start.
func TestTailKeepsItsArrayOnceFull(t *testing.T) {
	// The tail alone: every entry counts as checkpointed, so the budget
	// may drop any of them.
	db := &DB{maxTail: 4000, boltLast: math.MaxUint64}
	batches := make([][]pb.Entry, 0, 500)
	for i := range uint64(500) {
		batches = append(batches, makeEntries(1+5*i, 5, 1))
	}
	for _, b := range batches[:100] {
		db.appendTailLocked(b)
	}
	k := 100
	// Run twice (AllocsPerRun's warm-up, then the run counted): the
	// allocations of the second 200 batches.
	allocs := testing.AllocsPerRun(1, func() {
		for range 200 {
			db.appendTailLocked(batches[k])
			k++
		}
	})
	if allocs != 0 {
		t.Fatalf("%.0f allocations in 200 batches appended to a full tail, want 0", allocs)
	}
	if len(db.tail) < 20 || db.tail[len(db.tail)-1].Index != 5*uint64(k) {
		t.Fatalf("the tail kept %d entries, up to %d, after %d batches", len(db.tail), db.tail[len(db.tail)-1].Index, k)
	}
	lo := db.tail[0].Index
	if d := diffEntries(db.tail, makeEntries(lo, uint64(len(db.tail)), 1)); d != "" {
		t.Fatalf("tail after %d batches: %s", k, d)
	}
}

// RequeuedIDs walks the whole bucket a chunk at a time, oldest index
// first, and leaves out what is staged to drop and entries holding no
// record, as Requeued does.
func TestRequeuedIDsWalksTheBucketInChunks(t *testing.T) {
	db := testOpen(t, t.TempDir(), nil)
	defer mustClose(t, db)
	var ents []pb.Entry
	for i := uint64(1); i <= 10; i++ {
		r := Record{Origin: 3, Seq: 100 + i, ClientID: "c", Topic: "a/b", Payload: []byte("x")}
		ents = append(ents, pb.Entry{Index: i, Term: 1, Data: AppendRecord(nil, &r)})
	}
	ents[4].Data = []byte("not a record")
	mustSave(t, db, pb.HardState{Term: 1}, ents)
	mustSave(t, db, pb.HardState{Term: 2}, makeEntries(1, 1, 2)) // requeues 1..10
	all, err := db.Requeued(100)
	if err != nil || len(all) != 10 {
		t.Fatalf("Requeued = %d entries, %v; want 10", len(all), err)
	}
	db.DropRequeued(all[1].Key) // seq 102
	for _, chunk := range []int{1, 3, 10, 100} {
		var got []uint64
		if err := db.RequeuedIDs(chunk, func(origin, seq uint64) {
			if origin != 3 {
				t.Errorf("origin %d", origin)
			}
			got = append(got, seq)
		}); err != nil {
			t.Fatal(err)
		}
		want := []uint64{101, 103, 104, 106, 107, 108, 109, 110}
		if !slices.Equal(got, want) {
			t.Errorf("chunk %d: ids %v; want %v", chunk, got, want)
		}
	}
}
