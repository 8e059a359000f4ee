package replication

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"go.etcd.io/raft/v3"
	pb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/storage"
)

// proposeBytes proposes async records of 1 KiB until about n bytes were
// acked, a window of them at a time, or until the log refuses them as
// full; it returns the last index acked and whether it was refused.
func proposeBytes(t *testing.T, tn *testNode, n int) (last uint64, full bool) {
	t.Helper()
	const size, window = 1 << 10, 256
	payload := make([]byte, size)
	for sent := 0; sent < n && !full; sent += window * size {
		ch := make(chan result, window)
		for range window {
			r := storage.Record{Origin: tn.ID(), Seq: tn.NextSeq(), ClientID: "c", Topic: "big", QoS: 1, Time: time.Now().UnixNano(), Payload: payload}
			tn.Propose(storage.AppendRecord(nil, &r), Async, func(i uint64, err error) { ch <- result{i, err} })
		}
		for range window {
			r := wait(t, ch)
			switch {
			case errors.Is(r.err, ErrLogFull):
				full = true
			case r.err != nil:
				t.Fatalf("proposal: %v", r.err)
			}
			last = max(last, r.index)
		}
	}
	return last, full
}

// A 2-gateway cluster whose slave is stopped: the master's log goes past
// its budget, but nothing the slave lacks is dropped; it says it is
// refusing. Once the slave is back and caught up, the master drops.
func TestRetentionKeepsWhatAStoppedSlaveLacks(t *testing.T) {
	const budget = 8 << 20
	// The slave holds the log however long the three budgets take (a loaded
	// machine took longer than the default hold, and the master rightly
	// stopped waiting for a silent slave).
	c := newClusterWith(t, 0, func(cfg *Config) {
		cfg.SilentMemberHold = time.Hour
		// The daemon's takes a resumed session's start record.
		cfg.PastBudget = func(data []byte) bool {
			_, topic, _, err := storage.RecordHead(data)
			return err == nil && string(topic) == "past-budget"
		}
	})
	c.storeOpts = &storage.Options{MaxBytes: budget}
	dir := t.TempDir()
	ident, err := LoadOrCreateIdentity(dir)
	if err != nil {
		t.Fatal(err)
	}
	a := ident.ID
	c.ids, c.dirs[a], c.peers = append(c.ids, a), dir, []raft.Peer{{ID: a}}
	c.start(a)
	b := c.startJoiner()
	if err := c.change(pb.ConfChangeAddLearnerNode, b); err != nil {
		t.Fatal(err)
	}
	if r := c.propose("before", Sync); r.err != nil {
		t.Fatalf("sync with the slave: %v", r.err)
	}
	slaveLast, _ := c.nodes[b].db.LastIndex()
	c.stop(b)

	master := c.nodes[a]
	last, full := proposeBytes(t, master, 3*budget)
	if !full {
		t.Fatalf("3 budgets' worth taken with the slave stopped, none refused (data dir %d bytes)", master.db.RetentionStats().UsedBytes)
	}
	waitFor(t, "the master to say it is over budget", master.db.Refusing)
	if first, _ := master.db.FirstIndex(); first > slaveLast+1 {
		t.Fatalf("master dropped up to %d; the stopped slave had only %d", first-1, slaveLast)
	}
	if r := wait(t, master.propose(t, "refused", Async)); !errors.Is(r.err, ErrLogFull) || !errors.Is(r.err, ErrStorage) {
		t.Fatalf("a publish while the log is full of what the slave lacks: %v, want ErrLogFull", r.err)
	}
	if r := wait(t, master.propose(t, "past-budget", Async)); r.err != nil {
		t.Fatalf("a record PastBudget takes, while the log is full: %v", r.err)
	}
	st, err := master.Status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if st.RetentionFloor > slaveLast {
		t.Errorf("retention floor %d past the slave's match %d", st.RetentionFloor, slaveLast)
	}

	// The slave comes back, catches up; the master drops then.
	c.start(b)
	waitFor(t, "the slave to catch up", func() bool {
		l, _ := c.nodes[b].db.LastIndex()
		return l >= last
	})
	// The floor rising wakes a checkpoint that drops, with no write.
	deadline := time.Now().Add(20 * time.Second)
	for {
		first, _ := master.db.FirstIndex()
		if first > slaveLast+1 && !master.db.Refusing() {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after the slave caught up: first index %d, refusing %v", first, master.db.Refusing())
		}
		time.Sleep(5 * time.Millisecond)
	}
	if r := c.propose("after", Async); r.err != nil {
		t.Fatalf("a publish once the slave caught up: %v", r.err)
	}
	used := master.db.RetentionStats().UsedBytes
	t.Logf("master data dir %d bytes after the drop, budget %d", used, budget)
	// Refusing kept it near the budget while it could not drop: past it
	// by what was in flight when the checkpoint saw the budget reached.
	if used > budget+storage.RetentionSlack {
		t.Errorf("data dir %d bytes, budget %d + slack %d", used, budget, storage.RetentionSlack)
	}
}

// A member that joins after the master dropped the head of its log gets
// the compaction point (raft's snapshot) and the log after it, and acks
// sync records from then on. (The records before the point it never gets:
// the broker-state snapshot and catch-up are a later step.)
func TestJoinerAfterCompactionInstallsTheCompactionPoint(t *testing.T) {
	const budget = 8 << 20
	c := newCluster(t, 0)
	c.storeOpts = &storage.Options{MaxBytes: budget}
	dir := t.TempDir()
	ident, err := LoadOrCreateIdentity(dir)
	if err != nil {
		t.Fatal(err)
	}
	a := ident.ID
	c.ids, c.dirs[a], c.peers = append(c.ids, a), dir, []raft.Peer{{ID: a}}
	c.start(a)
	master := c.leader()
	if _, full := proposeBytes(t, master, 3*budget); full {
		t.Fatal("a lone gateway refused: nobody lacks anything")
	}
	waitFor(t, "the master to drop", func() bool { f, _ := master.db.FirstIndex(); return f > 1 })
	first, _ := master.db.FirstIndex()

	b := c.startJoiner()
	if err := c.change(pb.ConfChangeAddLearnerNode, b); err != nil {
		t.Fatal(err)
	}
	if r := c.propose("after-join", Sync); r.err != nil {
		t.Fatalf("sync with the joined slave: %v", r.err)
	}
	joiner := c.nodes[b]
	ml, _ := master.db.LastIndex()
	waitFor(t, "the joiner to hold the master's log", func() bool { l, _ := joiner.db.LastIndex(); return l >= ml })
	if jf, _ := joiner.db.FirstIndex(); jf <= 1 || jf < first {
		t.Errorf("joiner's first index %d, the master's was %d when it joined", jf, first)
	}
	// It restarts on the installed point.
	c.stop(b)
	c.start(b)
	if r := c.propose("after-restart", Sync); r.err != nil {
		t.Fatalf("sync after the joiner restarted: %v", r.err)
	}
}

// Below storage.min_free a master refuses publishes with ErrDiskLow (an
// ErrStorage: MQTT 5 devices get 0x97) and takes them again, by itself,
// once space returns.
func TestMasterRefusesBelowMinFreeAndResumes(t *testing.T) {
	var free atomic.Int64
	free.Store(4 << 30)
	c := newCluster(t, 0)
	c.storeOpts = &storage.Options{MinFree: 256 << 20, FreeSpace: func(string) (int64, int64, error) {
		return free.Load(), 16 << 30, nil
	}}
	dir := t.TempDir()
	ident, err := LoadOrCreateIdentity(dir)
	if err != nil {
		t.Fatal(err)
	}
	c.ids, c.dirs[ident.ID], c.peers = append(c.ids, ident.ID), dir, []raft.Peer{{ID: ident.ID}}
	master := c.start(ident.ID)
	if r := c.propose("before", Async); r.err != nil {
		t.Fatalf("a publish with space: %v", r.err)
	}
	free.Store(10 << 20)
	waitFor(t, "the master to see the disk nearly full", master.db.LowOnSpace)
	if r := wait(t, master.propose(t, "refused", Async)); !errors.Is(r.err, ErrDiskLow) || !errors.Is(r.err, ErrStorage) {
		t.Fatalf("a publish below min_free: %v, want ErrDiskLow", r.err)
	}
	free.Store(1 << 30)
	waitFor(t, "the master to see space again", func() bool { return !master.db.LowOnSpace() })
	if r := c.propose("after", Async); r.err != nil {
		t.Fatalf("a publish once space returned: %v", r.err)
	}
}
