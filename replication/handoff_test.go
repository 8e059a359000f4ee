package replication

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"

	"go.etcd.io/raft/v3"

	"github.com/tandem-edge/tandem/storage"
)

// diskCluster is a 3-voter cluster whose members' free space the test
// sets, each below or above storage.min_free.
type diskCluster struct {
	*cluster
	free map[uint64]*atomic.Int64
}

func newDiskCluster(t *testing.T) *diskCluster {
	c := &diskCluster{cluster: newCluster(t, 0), free: map[uint64]*atomic.Int64{}}
	byDir := map[string]*atomic.Int64{}
	for range 3 {
		dir := t.TempDir()
		ident, err := LoadOrCreateIdentity(dir)
		if err != nil {
			t.Fatal(err)
		}
		f := &atomic.Int64{}
		f.Store(4 << 30)
		c.free[ident.ID], byDir[dir] = f, f
		c.ids, c.dirs[ident.ID] = append(c.ids, ident.ID), dir
		c.peers = append(c.peers, raft.Peer{ID: ident.ID})
	}
	c.storeOpts = &storage.Options{MinFree: 256 << 20, FreeSpace: func(dir string) (int64, int64, error) {
		return byDir[dir].Load(), 16 << 30, nil
	}}
	for _, id := range c.ids {
		c.start(id)
	}
	return c
}

// setLow puts member id's filesystem below min_free (or back above it)
// and waits until its watermark has seen it.
func (c *diskCluster) setLow(id uint64, low bool) {
	c.t.Helper()
	free := int64(4 << 30)
	if low {
		free = 10 << 20
	}
	c.free[id].Store(free)
	waitFor(c.t, "the watermark to see the change", func() bool { return c.nodes[id].db.LowOnSpace() == low })
}

// master waits for the one member that is master with the others following.
func (c *diskCluster) masterNot(not ...uint64) *testNode {
	c.t.Helper()
	var lead *testNode
	waitFor(c.t, "a master that can write", func() bool {
		lead = nil
		for id, tn := range c.nodes {
			if s, err := tn.Status(context.Background()); err == nil && s.Role == "master" {
				lead = c.nodes[id]
			}
		}
		if lead == nil {
			return false
		}
		for _, id := range not {
			if lead.ID() == id {
				return false
			}
		}
		return true
	})
	return lead
}

// A master below min_free hands the mastership to a voter that can write;
// its own publishes then succeed through the new master. A member low on
// space is never a target: when the new master fills up too, the
// mastership goes to the third member, not back; when every voter is low,
// the master keeps it and says why; once space returns somewhere, it moves
// there.
func TestMasterThatCannotWriteHandsOver(t *testing.T) {
	c := newDiskCluster(t)
	a := c.leader()
	if r := c.propose("before", Sync); r.err != nil {
		t.Fatal(r.err)
	}
	c.setLow(a.ID(), true)
	b := c.masterNot(a.ID())
	if to, _ := a.Handoff(); to != b.ID() {
		t.Errorf("Handoff() names %s, the new master is %s", IDString(to), IDString(b.ID()))
	}
	// The old master's devices publish through the new one.
	if r := wait(t, a.propose(t, "via-new-master", Sync)); r.err != nil {
		t.Fatalf("a publish on the low former master: %v", r.err)
	}

	c.setLow(b.ID(), true)
	third := c.masterNot(a.ID(), b.ID())

	c.setLow(third.ID(), true)
	waitFor(t, "the last master to say it cannot hand over", func() bool {
		_, stuck := third.Handoff()
		return strings.Contains(stuck, "no other voter reports free space")
	})
	if s, err := third.Status(context.Background()); err != nil || s.Role != "master" {
		t.Fatalf("with every voter low the master gave up the mastership: %+v %v", s, err)
	}
	if r := wait(t, third.propose(t, "all-low", Async)); r.err == nil {
		t.Fatal("a master below min_free acked a publish")
	}

	c.setLow(a.ID(), false)
	if got := c.masterNot(b.ID(), third.ID()); got.ID() != a.ID() {
		t.Fatalf("master %s, want the member with space again", IDString(got.ID()))
	}
	if r := c.propose("after", Sync); r.err != nil {
		t.Fatal(r.err)
	}
}

// A member that cannot write does not win an election: with the master
// gone, the member with space becomes the master, whichever times out
// first.
func TestMemberThatCannotWriteDoesNotStandForElection(t *testing.T) {
	for round := range 3 {
		c := newDiskCluster(t)
		lead := c.leader()
		var low, ok uint64
		for _, id := range c.ids {
			if id == lead.ID() {
				continue
			}
			if low == 0 {
				low = id
			} else {
				ok = id
			}
		}
		c.setLow(low, true)
		c.stop(lead.ID())
		if got := c.masterNot(lead.ID()); got.ID() != ok {
			t.Fatalf("round %d: the member below min_free won the election", round)
		}
	}
}
