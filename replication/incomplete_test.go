package replication

import (
	"encoding/binary"
	"errors"
	"fmt"
	"testing"
	"time"

	"go.etcd.io/raft/v3"
	pb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/storage"
)

// proposeState proposes n retained records of size bytes on topics s/0..,
// their payloads starting with gen, through tn, and waits for them.
func proposeState(t *testing.T, tn *testNode, gen string, n, size int) {
	t.Helper()
	const window = 16
	for sent := 0; sent < n; sent += window {
		k := min(window, n-sent)
		ch := make(chan result, k)
		for i := range k {
			payload := fmt.Appendf(nil, "%s:%d:", gen, sent+i)
			payload = append(payload, make([]byte, size-len(payload))...)
			r := storage.Record{Origin: tn.ID(), Seq: tn.NextSeq(), ClientID: "c", Topic: fmt.Sprintf("s/%d", sent+i), QoS: 1, Retain: true,
				Time: time.Now().UnixNano(), Payload: payload}
			tn.Propose(storage.AppendRecord(nil, &r), Async, func(i uint64, err error) { ch <- result{i, err} })
		}
		for range k {
			if r := wait(t, ch); r.err != nil {
				t.Fatal(r.err)
			}
		}
	}
}

// builtSnapshot waits for tn's data file to build a snapshot and returns it.
func builtSnapshot(t *testing.T, tn *testNode) pb.Snapshot {
	t.Helper()
	var snap pb.Snapshot
	waitFor(t, "a snapshot built", func() bool {
		var err error
		snap, err = tn.db.Snapshot()
		if err != nil && !errors.Is(err, raft.ErrSnapshotTemporarilyUnavailable) {
			t.Fatal(err)
		}
		return err == nil
	})
	return snap
}

// A slave whose broker state is known incomplete (the master's snapshot
// was being merged into it in place when it stopped) restarts in a
// cluster whose master still holds every entry it lacks: raft alone would
// send those entries, applied onto a state part old, part new. The member
// refuses them and asks for the snapshot; it applies nothing before the
// snapshot is installed, stands for no election meanwhile, and ends with
// the master's state whole.
func TestIncompleteStateGetsAWholeSnapshotThoughTheMasterHasEveryEntry(t *testing.T) {
	t.Run("in raft's message", func(t *testing.T) { incompleteGetsSnapshot(t, false) })
	t.Run("pulled", func(t *testing.T) { incompleteGetsSnapshot(t, true) })
}

// incompleteGetsSnapshot is
// TestIncompleteStateGetsAWholeSnapshotThoughTheMasterHasEveryEntry with a
// snapshot that travels in raft's message, or one past the inline limit
// that the member pulls in chunks.
func incompleteGetsSnapshot(t *testing.T, pulled bool) {
	const n, size = 800, 1000 // 0.8 MB of state: merged in place, not staged
	c := newCluster(t, 0)
	c.storeOpts = &storage.Options{MaxBytes: 64 << 20} // nothing is dropped from the log
	for range 3 {
		id := c.newDir()
		c.peers = append(c.peers, raft.Peer{ID: id})
	}
	withPull := func(id uint64) func(*Config) {
		return func(cfg *Config) {
			cfg.Backfill = memBackfiller{c.net, id}
			// A pull of several chunks that lasts a few election timeouts.
			cfg.snapChunk, cfg.snapEvery = 64<<10, 40*time.Millisecond
		}
	}
	for _, id := range c.ids {
		c.startState(id, false, withPull(id))
	}
	lead := c.leader()
	if pulled {
		lead.db.SetSnapshotInline(64 << 10)
	}
	var slave uint64
	for _, id := range c.ids {
		if id != lead.ID() {
			slave = id
		}
	}
	proposeState(t, lead, "old", n, size)
	waitSameState(t, lead, c.nodes[slave])
	c.stop(slave)

	// Meanwhile the others change every key, then some.
	proposeState(t, lead, "new", n, size)
	snap := builtSnapshot(t, lead)
	if f, _ := lead.db.FirstIndex(); f != 1 {
		t.Fatalf("the master's log starts at %d: it must hold every entry the slave lacks", f)
	}

	// The slave, stopped, had that snapshot merged into its state in part.
	db, err := storage.Open(c.dirs[slave], c.storeOpts)
	if err != nil {
		t.Fatal(err)
	}
	db.Stage(storage.BucketSessions, "R\x00zz-mine", []byte("not in the master's state"))
	if err := db.Flush(); err != nil {
		t.Fatal(err)
	}
	body := snap.Data
	ref, isRef := storage.ParseSnapshotRef(body)
	if isRef != pulled {
		t.Fatalf("the snapshot is pulled %v, want %v", isRef, pulled)
	}
	if isRef {
		body = nil
		for uint64(len(body)) < ref.Size {
			p, err := lead.db.ReadSnapshot(ref, uint64(len(body)), 1<<20)
			if err != nil {
				t.Fatal(err)
			}
			body = append(body, p...)
		}
	} else {
		ref = storage.SnapshotRef{Index: snap.Metadata.Index, Size: uint64(len(body)), CRC: binary.BigEndian.Uint32(body[len(body)-4:])}
	}
	in, err := db.ReceiveSnapshot(ref)
	if err != nil {
		t.Fatal(err)
	}
	for !db.InstallInterrupted() {
		if in.Done() {
			t.Fatal("the whole snapshot was received without a merge in place")
		}
		if err := in.Write(body[in.Offset():min(in.Offset()+64<<10, ref.Size)]); err != nil {
			t.Fatal(err)
		}
	}
	in.Close() // the pull is cut
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
	proposeState(t, lead, "newer", 20, size) // past the snapshot

	member, app := c.startState(slave, false, withPull(slave))
	if !member.StateIncomplete() {
		t.Fatal("restarted after a merge in place began: the state is not marked incomplete")
	}
	if _, err := ForcePromote(member.db, Member{ID: slave}, lead.ID()); !errors.Is(err, ErrStateIncomplete) {
		t.Errorf("a forced promotion of a member whose state is incomplete: %v", err)
	}
	waitFor(t, "the snapshot installed", func() bool { return !member.StateIncomplete() })
	waitSameState(t, lead, member)
	if k := app.onIncomplete.Load(); k > 0 {
		t.Errorf("%d entries were applied onto the incomplete state", k)
	}
	if app.restores.Load() == 0 {
		t.Error("the state became whole without a snapshot installed")
	}
	if got := sessionsOf(t, member)["R\x00zz-mine"]; got != "" {
		t.Errorf("the member's own key the master lacks survived: %q", got)
	}
	// It takes what follows as a member.
	proposeState(t, lead, "last", 10, size)
	waitSameState(t, lead, member)
	// A new election here is no fault (the race detector on a loaded
	// machine can starve a heartbeat): the member's state is whole now.
	if l := c.leader(); l.ID() != lead.ID() {
		t.Logf("the master changed to %s", IDString(l.ID()))
	}
}
