package replication

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/storage"
)

// proposeSync proposes a record taken under a sync rule, as the daemon
// encodes one (flagged), and returns its outcome channel.
func (tn *testNode) proposeSync(topic string) chan result {
	r := storage.Record{Origin: tn.ID(), Seq: tn.NextSeq(), ClientID: "c", Topic: topic, QoS: 1, Sync: true, Time: time.Now().UnixNano(), Payload: []byte(topic)}
	ch := make(chan result, 1)
	tn.Propose(storage.AppendRecord(nil, &r), Sync, func(i uint64, err error) { ch <- result{i, err} })
	return ch
}

// indexOf returns the index at which the applier got the record on topic.
func (r *recorder) indexOf(topic string) uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, rec := range r.recs {
		if rec.Topic == topic {
			return r.idx[i]
		}
	}
	return 0
}

// settledAs returns what the settlements applied so far say of index:
// settled at all, aborted, and confirmed in doubt.
func (r *recorder) settledAs(t *testing.T, index uint64) (settled, aborted, doubt bool) {
	t.Helper()
	settled, aborted, doubt, err := r.settlement(index)
	if err != nil {
		t.Fatal(err)
	}
	return settled, aborted, doubt
}

func (r *recorder) settlement(index uint64) (settled, aborted, doubt bool, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, rec := range r.recs {
		if rec.Topic != SettleTopic {
			continue
		}
		s, err := DecodeSettlement(rec.Payload)
		if err != nil {
			return false, false, false, err
		}
		if slices.Contains(s.Abort, index) || (s.Alone && index <= s.Doubt) {
			return true, true, false, nil
		}
		if index <= s.Upto {
			return true, false, index <= s.Doubt, nil
		}
	}
	return false, false, false, nil
}

// Holding implements Holder the dumb way: a sync record no settlement
// covers yet.
func (r *recorder) Holding() bool {
	r.mu.Lock()
	var syncs []uint64
	for i, rec := range r.recs {
		if rec.Sync {
			syncs = append(syncs, r.idx[i])
		}
	}
	r.mu.Unlock()
	for _, idx := range syncs {
		if s, _, _, _ := r.settlement(idx); !s {
			return true
		}
	}
	return false
}

func TestLoneMasterAbortsTheSyncRecordItRefused(t *testing.T) {
	tn := startNode(t, t.TempDir(), 150*time.Millisecond)
	if r := wait(t, tn.proposeSync("s/1")); !errors.Is(r.err, ErrAckTimeout) {
		t.Fatalf("sync on a lone node: %v, want ErrAckTimeout", r.err)
	}
	idx := tn.app.indexOf("s/1")
	if idx == 0 {
		t.Fatal("the refused record was never committed: nothing for the settlement to do")
	}
	waitFor(t, "a settlement of the refused record", func() bool { s, _, _ := tn.app.settledAs(t, idx); return s })
	if _, aborted, _ := tn.app.settledAs(t, idx); !aborted {
		t.Fatalf("record %d refused with a timeout is settled as confirmed", idx)
	}
}

func TestSyncRecordAckedByAReplicaIsConfirmedEverywhere(t *testing.T) {
	c := newCluster(t, 3)
	l := c.leader()
	r := wait(t, l.proposeSync("s/ok"))
	if r.err != nil {
		t.Fatal(r.err)
	}
	for id, tn := range c.nodes {
		waitFor(t, "the settlement on "+IDString(id), func() bool { s, _, _ := tn.app.settledAs(t, r.index); return s })
		if _, aborted, doubt := tn.app.settledAs(t, r.index); aborted || doubt {
			t.Fatalf("node %s: acked record %d aborted=%v doubt=%v", IDString(id), r.index, aborted, doubt)
		}
	}
}

// unmetOnASlave cuts one slave of c's 3 members off and has the master
// propose a sync record on topic, which commits on the master and the
// other slave (kept) without meeting a rule of 2 replicas: the master,
// kept, the proposal's outcome and the record's index.
func unmetOnASlave(t *testing.T, c *cluster, topic string) (old, kept *testNode, ch chan result, idx uint64) {
	t.Helper()
	old = c.leader()
	var cut *testNode
	for _, tn := range c.nodes {
		switch {
		case tn == old:
		case kept == nil:
			kept = tn
		default:
			cut = tn
		}
	}
	c.net.isolate(cut.ID())
	ch = old.proposeSync(topic)
	waitFor(t, "the record committed on the slave", func() bool { return kept.app.indexOf(topic) > 0 })
	return old, kept, ch, kept.app.indexOf(topic)
}

// TestNewMasterConfirmsUnsettledSyncRecordsInDoubt: a master that stops
// between logging a sync record and settling it leaves it to the next
// master, which cannot know whether it was acked and so confirms it,
// saying it is in doubt.
func TestNewMasterConfirmsUnsettledSyncRecordsInDoubt(t *testing.T) {
	// Two replicas needed and one cut off: the record commits on the
	// master and the other slave, and its rule stays unmet.
	c := newClusterWith(t, 3, func(cfg *Config) { cfg.MinSyncReplicas, cfg.SyncTimeout = 2, time.Minute })
	old, kept, ch, idx := unmetOnASlave(t, c, "s/unsettled")
	c.stop(old.ID())
	if r := wait(t, ch); !errors.Is(r.err, ErrStopped) {
		t.Fatalf("unsettled record at stop: %v", r.err)
	}
	c.net.heal()
	waitFor(t, "the next master's settlement", func() bool { s, _, _ := kept.app.settledAs(t, idx); return s })
	if _, aborted, doubt := kept.app.settledAs(t, idx); aborted || !doubt {
		t.Fatalf("inherited record %d: aborted=%v doubt=%v, want confirmed in doubt", idx, aborted, doubt)
	}
}

// TestDeposedMasterTellsWhatTheNextMasterSettled: a master cut off while
// a sync record of its own waits, logged on a slave but short of its rule,
// passes the record's deadline alone; the others elect a master, which
// confirms the record in doubt. The old master must not have told its
// publisher "refused" on its own clock (issue #32, refused is final): the
// publisher hears what the settlement says once the old master is back,
// confirmed.
func TestDeposedMasterTellsWhatTheNextMasterSettled(t *testing.T) {
	c := newClusterWith(t, 3, func(cfg *Config) { cfg.MinSyncReplicas, cfg.SyncTimeout = 2, 500*time.Millisecond })
	old, kept, ch, idx := unmetOnASlave(t, c, "s/deposed")
	c.net.heal()
	c.net.isolate(old.ID())
	select {
	case r := <-ch:
		t.Fatalf("the cut-off master answered its publisher on its own (%v): the next master settles record %d", r.err, idx)
	case <-time.After(time.Second): // two deadlines
	}
	c.masterOtherThan(old.ID())
	waitFor(t, "the next master's settlement", func() bool { s, _, _ := kept.app.settledAs(t, idx); return s })
	if _, aborted, doubt := kept.app.settledAs(t, idx); aborted || !doubt {
		t.Fatalf("inherited record %d: aborted=%v doubt=%v, want confirmed in doubt", idx, aborted, doubt)
	}
	c.net.heal()
	if r := wait(t, ch); r.err != nil || r.index != idx {
		t.Fatalf("the deposed master's publisher heard (%d, %v) for record %d, which the next master confirmed", r.index, r.err, idx)
	}
}

// TestLoneGatewayRestartAbortsItsUnsettledSyncRecords: a lone gateway
// stopped while a sync record waited cannot have acked it (no member
// could hold it): restarted, it aborts it.
func TestLoneGatewayRestartAbortsItsUnsettledSyncRecords(t *testing.T) {
	dir := t.TempDir()
	tn := openTestNode(t, dir, func(c *Config) { c.SyncTimeout = time.Minute })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := tn.WaitLeader(ctx); err != nil {
		t.Fatal(err)
	}
	ch := tn.proposeSync("s/unsettled")
	waitFor(t, "the record applied", func() bool { return tn.app.indexOf("s/unsettled") > 0 })
	idx := tn.app.indexOf("s/unsettled")
	held := tn.app
	tn.stop()
	if r := wait(t, ch); !errors.Is(r.err, ErrStopped) {
		t.Fatalf("unsettled record at stop: %v", r.err)
	}
	tn = openTestNode(t, dir, func(c *Config) { c.Applier = held })
	t.Cleanup(tn.stop)
	waitFor(t, "the restarted master's settlement", func() bool { s, _, _ := held.settledAs(t, idx); return s })
	if _, aborted, _ := held.settledAs(t, idx); !aborted {
		t.Fatalf("record %d of a lone gateway confirmed after a restart, want aborted", idx)
	}
}

// TestSettlementsAreBatched: settling many sync records costs one small
// record per settleEvery at most, not one per record, and each is
// confirmed.
func TestSettlementsAreBatched(t *testing.T) {
	c := newCluster(t, 3)
	l := c.leader()
	const n = 200
	start := time.Now()
	chans := make([]chan result, n)
	for i := range chans {
		chans[i] = l.proposeSync("s/batch")
	}
	var last uint64
	for _, ch := range chans {
		r := wait(t, ch)
		if r.err != nil {
			t.Fatal(r.err)
		}
		last = max(last, r.index)
	}
	waitFor(t, "the last record settled", func() bool { s, _, _ := l.app.settledAs(t, last); return s })
	elapsed := time.Since(start)
	settlements := 0
	l.app.mu.Lock()
	for _, rec := range l.app.recs {
		if rec.Topic == SettleTopic {
			settlements++
		}
	}
	l.app.mu.Unlock()
	if limit := int(elapsed/settleEvery) + 2; settlements > limit {
		t.Fatalf("%d settlements for %d records in %v, want at most %d (one per %v)", settlements, n, elapsed, limit, settleEvery)
	}
	t.Logf("%d records settled by %d settlement records in %v", n, settlements, elapsed)
	if _, aborted, _ := l.app.settledAs(t, last); aborted {
		t.Fatalf("acked record %d aborted", last)
	}
}
