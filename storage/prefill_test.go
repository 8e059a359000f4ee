package storage

import (
	"os"
	"syscall"
	"testing"

	bolt "go.etcd.io/bbolt"
	pb "go.etcd.io/raft/v3/raftpb"
)

// Commits append pages to blocks already written, not to a hole: the space
// past bbolt's high-water mark is allocated on disk, and the entries written
// through it read back after a reopen.
func TestPrefillKeepsSpaceWrittenAhead(t *testing.T) {
	dir := t.TempDir()
	db := testOpen(t, dir, nil)
	for i := uint64(0); i < 40; i++ {
		ents := makeEntries(1+i*100, 100, 1)
		for j := range ents {
			ents[j].Data = make([]byte, 300)
			ents[j].Data[0] = byte(j)
		}
		mustSave(t, db, pb.HardState{Term: 1, Vote: 1}, ents)
	}
	var hw int64
	if err := db.bolt.View(func(tx *bolt.Tx) error { hw = tx.Size(); return nil }); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(db.Path())
	if err != nil {
		t.Fatal(err)
	}
	// The last commit used some of the space written ahead (about 40 KiB
	// here); the next one refills it.
	allocated := fi.Sys().(*syscall.Stat_t).Blocks * 512
	if allocated < hw+prefillLow/2 {
		t.Errorf("%d bytes allocated on disk, want at least the high-water mark %d plus %d written ahead", allocated, hw, prefillLow/2)
	}
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
	db = testOpen(t, dir, nil)
	ents, err := db.Entries(1, 4001, 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) != 4000 || ents[3999].Index != 4000 || ents[3999].Data[0] != 99 || len(ents[3999].Data) != 300 {
		t.Fatalf("after reopen: %d entries, last %+v", len(ents), ents[len(ents)-1].Index)
	}
}
