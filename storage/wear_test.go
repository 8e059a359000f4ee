package storage

import (
	"bytes"
	"fmt"
	"os"
	"testing"
	"time"

	pb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// TestBytesWrittenPerRecord bounds what the log costs a gateway's SD card
// or eMMC per record: the pages each WAL fdatasync writes and the pages the
// checkpoints write into the data file, counted as the storage layer issues
// them (DB.Written), not timed. Records of a 100-byte payload (186 bytes an
// entry, as a bench publish is), in the two shapes a gateway sees: many
// devices at once, about 40 records per fdatasync, and a single device,
// one record per fdatasync. The bounds are about 1.5 times what this
// build writes, so a change that doubles the bytes of either part fails.
//
// What this build writes: one page per fdatasync for a lone record (a frame
// that fits in its page's rest shares it; one that would spill into a page
// more than it needs starts on a fresh page), the frame's own pages for a
// batch, and each record once more into the data file at a checkpoint, in
// full leaves.
func TestBytesWrittenPerRecord(t *testing.T) {
	payload := bytes.Repeat([]byte{0}, 100)
	if os.Getpagesize() != walPage {
		t.Skipf("the bounds are for 4 KiB pages; this host's are %d bytes", os.Getpagesize())
	}
	for _, tc := range []struct {
		name          string
		batch         func(s int) int // records in Save number s
		saves         int
		walMax, dbMax float64 // bytes per record
	}{
		// Measured: WAL 4,100 (a page per fdatasync, and the cuts),
		// data file 224 per record. Before frames were aligned, the WAL
		// wrote 4,350 (a frame in 13 straddled two pages).
		{"one record per fdatasync", func(int) int { return 1 }, 3000, 4096 * 1.5, 224 * 1.5},
		// 20 to 60 records per fdatasync, 40 on average. Measured: WAL
		// ~245, data file ~220 per record. Before frames were aligned,
		// the WAL wrote ~290 (each fdatasync rewrote the page the
		// previous frame had ended in).
		{"40 records per fdatasync", func(s int) int { return 20 + s*17%41 }, 150, 245 * 1.5, 220 * 1.5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			db, err := Open(t.TempDir(), nil)
			if err != nil {
				t.Fatal(err)
			}
			defer db.Close()
			w0 := db.Written()
			n := 0
			last, err := db.LastIndex()
			if err != nil {
				t.Fatal(err)
			}
			next := last + 1
			for s := range tc.saves {
				ents := benchEntries(next, tc.batch(s), s, payload)
				n += len(ents)
				next += uint64(len(ents))
				mustSave(t, db, pb.HardState{Term: 1, Vote: 1, Commit: next - 1}, ents)
			}
			// The checkpoint of the rest: every record reaches the file.
			if err := db.commit(nil); err != nil {
				t.Fatal(err)
			}
			w1 := db.Written()
			walPer, filePer := float64(w1.WAL-w0.WAL)/float64(n), float64(w1.Data-w0.Data)/float64(n)
			t.Logf("per record: WAL %.0f bytes, data file %.0f bytes (%d records in %d fdatasyncs)", walPer, filePer, n, tc.saves)
			if walPer > tc.walMax {
				t.Errorf("the WAL wrote %.0f bytes per record, more than %.0f", walPer, tc.walMax)
			}
			if filePer > tc.dbMax {
				t.Errorf("checkpoints wrote %.0f bytes per record into the data file, more than %.0f", filePer, tc.dbMax)
			}
		})
	}
}

// A snapshot built for a member behind is a file of the data dir too: its
// body counts in Written, so the written-bytes metric leaves out none of
// what the storage layer puts on the device.
func TestBuiltSnapshotCountsInWritten(t *testing.T) {
	db := testOpen(t, t.TempDir(), nil)
	mustSave(t, db, pb.HardState{Term: 1, Commit: 5}, makeEntries(1, 5, 1))
	db.Stage(BucketSessions, "R\x00t", []byte("x"))
	db.SetApplied(5)
	before := db.Written().Snapshot
	// raft's call: the first starts the build in the background.
	var snap pb.Snapshot
	testutil.WaitFor(t, 10*time.Second, "the snapshot built", func() bool {
		var err error
		snap, err = db.Snapshot()
		return err == nil
	})
	// Inline (small): the data is the body its file held.
	if got := db.Written().Snapshot - before; got != int64(len(snap.Data)) || got == 0 {
		t.Errorf("building a snapshot of %d bytes counted %d", len(snap.Data), got)
	}
}

// benchEntries returns n entries from next on holding records as a bench
// publisher sends them (client s%50 of 50), with payload.
func benchEntries(next uint64, n, s int, payload []byte) []pb.Entry {
	ents := make([]pb.Entry, n)
	for i := range ents {
		r := Record{
			Origin: 0x0102030405060708, Seq: next, ClientID: fmt.Sprintf("tandem-bench-%06d-pub-%d", 123456, s%50),
			Topic: fmt.Sprintf("bench/%d", s%50), QoS: 1, PacketID: uint16(next),
			Time: 1_700_000_000_000_000_000 + int64(next), Payload: payload,
		}
		ents[i] = pb.Entry{Index: next, Term: 1, Type: pb.EntryNormal, Data: AppendRecord(nil, &r)}
		next++
	}
	return ents
}
