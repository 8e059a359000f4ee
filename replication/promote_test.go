package replication

import (
	"context"
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
