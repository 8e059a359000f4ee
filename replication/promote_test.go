package replication

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	pb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/storage"
)

// logTopics counts the records in a running node's log by topic.
func logTopics(t *testing.T, tn *testNode) map[string]int {
	t.Helper()
	got := map[string]int{}
	err := tn.db.Scan(1, func(e pb.Entry) bool {
		if e.Type == pb.EntryNormal && len(e.Data) > 0 {
			if r, err := storage.DecodeRecord(e.Data); err == nil {
				got[r.Topic]++
			}
		}
		return true
	})
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// The two traps of DESIGN.md on a 2-gateway cluster, over many seeds of a
// faulty network: the master is cut off and acks async records alone; the
// slave is promoted by force and takes records of its own; the old master
// comes back the way the daemon brings it back (its tail after the fork
// requeued, its raft state wiped, joined as a learner) and every record
// either acked is on the new master, once.
func TestForcedPromotionKeepsTheDeposedMastersAcks(t *testing.T) {
	for round := 0; round < 4; round++ {
		t.Run(fmt.Sprintf("round%d", round), func(t *testing.T) { forcedPromotionRound(t) })
	}
}

func forcedPromotionRound(t *testing.T) {
	c := newCluster(t, 1)
	a := c.leader()
	b := c.startJoiner()
	if err := c.change(pb.ConfChangeAddLearnerNode, b); err != nil {
		t.Fatal(err)
	}
	c.net.setFaults(0.05, 0.05, 2*time.Millisecond)
	var acked []string
	for i := 0; i < 20; i++ {
		topic := fmt.Sprintf("common/%d", i)
		if r := wait(t, a.propose(t, topic, Sync)); r.err == nil {
			acked = append(acked, topic)
		}
	}
	// Cut off, the master acks async records the slave never sees.
	c.net.isolate(a.ID())
	for i := 0; i < 20; i++ {
		topic := fmt.Sprintf("old/%d", i)
		if r := wait(t, a.propose(t, topic, Async)); r.err != nil {
			t.Fatalf("async on the cut-off master: %v", r.err)
		}
		acked = append(acked, topic)
	}
	// The slave is promoted by force.
	bdir := c.dirs[b]
	c.stop(b)
	db, err := storage.Open(bdir, nil)
	if err != nil {
		t.Fatal(err)
	}
	fork, err := ForcePromote(db, Member{ID: b, Name: "gw-b"}, a.ID())
	db.Close()
	if err != nil {
		t.Fatal(err)
	}
	nb := openTestNode(t, bdir, func(cfg *Config) {
		cfg.Transport, cfg.Forwarder = endpoint{c.net, b}, memForwarder{c.net, b}
	})
	c.attach(b, nb)
	waitFor(t, "the promoted slave leading", func() bool { return nb.Leader() == b })
	for i := 0; i < 20; i++ {
		topic := fmt.Sprintf("new/%d", i)
		if r := wait(t, nb.propose(t, topic, Async)); r.err != nil {
			t.Fatalf("async on the promoted master: %v", r.err)
		}
		acked = append(acked, topic)
	}
	// The old master learns it was deposed and rejoins.
	aid, adir := a.ID(), c.dirs[a.ID()]
	c.stop(aid)
	db, err = storage.Open(adir, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := db.ResetRaftFrom(fork + 1); err != nil {
		t.Fatal(err)
	}
	db.Close()
	na := openTestNode(t, adir, func(cfg *Config) {
		cfg.Transport, cfg.Forwarder, cfg.Join = endpoint{c.net, aid}, memForwarder{c.net, aid}, true
	})
	c.attach(aid, na)
	c.net.heal()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := nb.ChangeMember(ctx, pb.ConfChangeAddLearnerNode, Member{ID: aid, Name: "gw-a"}); err != nil {
		t.Fatal(err)
	}
	for _, tn := range []*testNode{nb, na} {
		waitFor(t, "every acked record on both, once", func() bool {
			got := logTopics(t, tn)
			for _, tp := range acked {
				if got[tp] != 1 {
					return false
				}
			}
			return true
		})
	}
}

// A deposed master's tail may hold sync records whose publishers were told
// "refused" (no slave in reach): requeued by the rejoin, they must not be
// re-published, while the async records around them are.
func TestRequeueSkipsRefusedSyncRecords(t *testing.T) {
	dir := t.TempDir()
	tn := openTestNode(t, dir, func(c *Config) { c.SyncTimeout = 100 * time.Millisecond })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := tn.WaitLeader(ctx); err != nil {
		t.Fatal(err)
	}
	if r := wait(t, tn.propose(t, "a/before", Async)); r.err != nil {
		t.Fatal(r.err)
	}
	if r := wait(t, tn.propose(t, "s/refused", Sync)); !errors.Is(r.err, ErrAckTimeout) {
		t.Fatalf("sync on a lone node: %v, want ErrAckTimeout", r.err)
	}
	if r := wait(t, tn.propose(t, "a/after", Async)); r.err != nil {
		t.Fatal(r.err)
	}
	tn.stop()
	tn = rejoinReset(t, dir, 3)
	got := logTopics(t, tn)
	if got["a/before"] != 1 || got["a/after"] != 1 || got["s/refused"] != 0 {
		t.Fatalf("log after the re-publish: %v; want both async records once and no refused sync one", got)
	}
	if tn.RefusedSkipped() != 1 || tn.Requeued() != 2 {
		t.Fatalf("re-published %d, skipped %d as refused; want 2 and 1", tn.Requeued(), tn.RefusedSkipped())
	}
}

// A fenced master refuses every proposal at once, as a slave without a
// master would, and status no longer calls it the master.
func TestFencedMasterRefusesProposals(t *testing.T) {
	tn := startNode(t, t.TempDir(), time.Second)
	if r := wait(t, tn.propose(t, "a/1", Async)); r.err != nil {
		t.Fatal(r.err)
	}
	if !tn.Fence() || tn.Fence() {
		t.Fatal("Fence should report true the first time only")
	}
	if r := wait(t, tn.propose(t, "a/2", Async)); !errors.Is(r.err, ErrNotLeader) {
		t.Fatalf("async on a fenced master: %v, want ErrNotLeader", r.err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := tn.Status(ctx)
	if err != nil || st.Role != "candidate" {
		t.Fatalf("status of a fenced master: %+v %v", st, err)
	}
}

// rejoinReset does what a rejoin does to the stopped node's data dir in
// dir: everything requeued (fork at 0); then it starts the node afresh and
// waits until it has re-published or skipped records records.
func rejoinReset(t *testing.T, dir string, records uint64) *testNode {
	t.Helper()
	db, err := storage.Open(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := db.ResetRaftFrom(1); err != nil {
		t.Fatal(err)
	}
	db.Close()
	tn := openTestNode(t, dir, nil)
	t.Cleanup(tn.stop)
	// The bucket empties as each record is logged; the round's counts
	// are added once the whole round is back, so wait for those.
	waitFor(t, "the requeue drained and counted", func() bool {
		n, err := tn.db.RequeuePending()
		return err == nil && n == 0 && tn.Requeued()+tn.RefusedSkipped() >= records
	})
	return tn
}
