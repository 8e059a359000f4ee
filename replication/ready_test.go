package replication

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"
)

// A master whose disk fails (its saves fail, and it retries) must not
// refuse a record that may be logged yet: it sends its appends to the
// slaves while it saves them, and the slaves commit them without it,
// under a new master once it stays silent, or it logs them itself when
// its disk recovers. A publisher told "refused" (ErrStorage: 0x97) would
// see its record delivered. Only what raft never took is refused; the
// rest is answered by what becomes of its entry.
func TestSaveFailureRefusesOnlyWhatCanNeverBeLogged(t *testing.T) {
	c := newCluster(t, 3)
	old := c.leader()
	if r := c.propose("before", Async); r.err != nil {
		t.Fatal(r.err)
	}
	last := map[uint64]uint64{}
	for _, id := range c.ids {
		last[id], _ = c.nodes[id].db.LastIndex()
	}
	failing := fmt.Errorf("write: input/output error (test)")
	old.saveFault.Store(&failing)
	doomed := old.propose(t, "doomed", Async)
	// The append reaches the slaves while the master's save fails.
	waitFor(t, "the slaves hold the master's append", func() bool {
		for _, id := range c.ids {
			if id == old.ID() {
				continue
			}
			if l, _ := c.nodes[id].db.LastIndex(); l <= last[id] {
				return false
			}
		}
		return true
	})
	// Cut off at once: a stuck node's full inbox would hold up the
	// memNet senders.
	c.net.isolate(old.ID())
	// What comes after the failure, with the save failing still, is
	// refused at once: raft never takes it.
	if r := wait(t, old.propose(t, "after-failure", Async)); !errors.Is(r.err, ErrStorage) {
		t.Fatalf("a publish on a master whose saves fail: %v, want ErrStorage", r.err)
	}
	// Its status answers meanwhile: the operator must see the failing
	// disk, not a status that times out (CI saw /v1/status hang on a full
	// disk).
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	st, err := old.Status(ctx)
	cancel()
	if err != nil {
		t.Fatalf("a master whose saves fail does not answer its status: %v", err)
	}
	if st.ID != old.ID() || st.Last < last[old.ID()] {
		t.Fatalf("status of the stuck master: %+v", st)
	}
	// The master stays stuck; the slaves go on without it.
	var lead *testNode
	waitFor(t, "a new master among the others", func() bool {
		for _, id := range c.ids {
			if id == old.ID() {
				continue
			}
			if s, err := c.nodes[id].Status(context.Background()); err == nil && s.Role == "master" {
				lead = c.nodes[id]
				return true
			}
		}
		return false
	})
	if r := wait(t, lead.propose(t, "next", Sync)); r.err != nil {
		t.Fatalf("on the new master: %v", r.err)
	}
	for _, id := range c.ids {
		if id == old.ID() {
			continue
		}
		waitFor(t, "the slaves apply what the new master logged", func() bool { return slices.Contains(c.applied(id), "next") })
		if slices.Contains(c.applied(id), "after-failure") {
			t.Fatalf("member %s applied a record refused before raft took it", IDString(id))
		}
	}
	logged := slices.Contains(c.applied(lead.ID()), "doomed")
	select {
	case r := <-doomed:
		if r.err != nil && logged {
			t.Fatalf("refused with %v, yet committed and applied by the other members", r.err)
		}
	default:
	}
	// The disk recovers: the answer comes, and says what became of it.
	old.saveFault.Store(nil)
	c.net.heal()
	r := wait(t, doomed)
	if logged && r.err != nil {
		t.Fatalf("answered %v once the disk recovered, yet in the log", r.err)
	}
	if !logged && r.err == nil {
		t.Fatalf("acked once the disk recovered, yet not in the new master's log")
	}
}
