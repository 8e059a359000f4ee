package replication

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/internal/testutil"
	"github.com/tandem-edge/tandem/storage"
)

// recorder is an Applier that keeps what it was given.
type recorder struct {
	mu   sync.Mutex
	idx  []uint64
	recs []storage.Record
}

func (r *recorder) Apply(i uint64, data []byte) error {
	rec, err := storage.DecodeRecord(data)
	if err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.idx = append(r.idx, i)
	r.recs = append(r.recs, rec)
	return nil
}

func (r *recorder) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.recs)
}

type testNode struct {
	*Node
	db  *storage.DB
	app *recorder
	dir string
}

// openTestNode opens dir and starts a node on it with fast timers; mutate
// adjusts the config (the identity, storage and applier are filled in).
func openTestNode(t *testing.T, dir string, mutate func(*Config)) *testNode {
	t.Helper()
	return openTestNodeOpts(t, dir, nil, mutate)
}

// openTestNodeOpts is openTestNode with storage options (retention).
func openTestNodeOpts(t *testing.T, dir string, opts *storage.Options, mutate func(*Config)) *testNode {
	t.Helper()
	id, err := LoadOrCreateIdentity(dir)
	if err != nil {
		t.Fatal(err)
	}
	db, err := storage.Open(dir, opts)
	if err != nil {
		t.Fatal(err)
	}
	app := &recorder{}
	cfg := Config{Identity: id, Storage: db, Applier: app, SyncTimeout: 2 * time.Second, Heartbeat: 10 * time.Millisecond, ElectionTimeout: 100 * time.Millisecond}
	if mutate != nil {
		mutate(&cfg)
	}
	n, err := NewNode(cfg)
	if err != nil {
		db.Close()
		t.Fatal(err)
	}
	return &testNode{Node: n, db: db, app: app, dir: dir}
}

func startNode(t *testing.T, dir string, syncTimeout time.Duration) *testNode {
	t.Helper()
	tn := openTestNode(t, dir, func(c *Config) { c.SyncTimeout = syncTimeout })
	t.Cleanup(tn.stop)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := tn.WaitLeader(ctx); err != nil {
		t.Fatal(err)
	}
	return tn
}

func (tn *testNode) stop() {
	tn.Node.Stop()
	tn.db.Close()
}

func (tn *testNode) record(t *testing.T, topic string) []byte {
	t.Helper()
	r := storage.Record{Origin: tn.ID(), Seq: tn.NextSeq(), ClientID: "c", Topic: topic, QoS: 1, Time: time.Now().UnixNano(), Payload: []byte(topic)}
	return storage.AppendRecord(nil, &r)
}

type result struct {
	index uint64
	err   error
}

func (tn *testNode) propose(t *testing.T, topic string, mode AckMode) chan result {
	ch := make(chan result, 1)
	tn.Propose(tn.record(t, topic), mode, func(i uint64, err error) { ch <- result{i, err} })
	return ch
}

func wait(t *testing.T, ch chan result) result {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("proposal never resolved")
		return result{}
	}
}

// waitFor is testutil.WaitFor with the deadline every test here uses.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testutil.WaitFor(t, 20*time.Second, what, cond) // ample: these run under -race, qemu and beside other packages
}

func TestAsyncProposalResolvesWhenDurable(t *testing.T) {
	tn := startNode(t, t.TempDir(), time.Second)
	r := wait(t, tn.propose(t, "a/1", Async))
	if r.err != nil || r.index == 0 {
		t.Fatalf("async proposal: index %d err %v", r.index, r.err)
	}
	// Acked means on disk: the entry is in the file's log now.
	last, _ := tn.db.LastIndex()
	if last < r.index {
		t.Fatalf("acked index %d but the log ends at %d", r.index, last)
	}
	ents, err := tn.db.Entries(r.index, r.index+1, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	rec, err := storage.DecodeRecord(ents[0].Data)
	if err != nil || rec.Topic != "a/1" {
		t.Fatalf("entry %d holds %+v (%v)", r.index, rec, err)
	}
	waitFor(t, "apply", func() bool { return tn.app.count() == 1 })
}

func TestSyncProposalOnLoneNodeTimesOut(t *testing.T) {
	tn := startNode(t, t.TempDir(), 150*time.Millisecond)
	start := time.Now()
	r := wait(t, tn.propose(t, "s/1", Sync))
	if !errors.Is(r.err, ErrAckTimeout) {
		t.Fatalf("sync on a lone node: %v, want ErrAckTimeout", r.err)
	}
	if el := time.Since(start); el < 150*time.Millisecond || el > 2*time.Second {
		t.Fatalf("timed out after %v, want about 150ms", el)
	}
	// Async proposals behind it are unaffected.
	if r := wait(t, tn.propose(t, "a/1", Async)); r.err != nil {
		t.Fatal(r.err)
	}
}

func TestStopFailsPendingProposals(t *testing.T) {
	tn := startNode(t, t.TempDir(), time.Minute)
	ch := tn.propose(t, "s/1", Sync)
	waitFor(t, "the proposal to be logged", func() bool { return tn.app.count() == 1 })
	tn.Node.Stop()
	if r := wait(t, ch); !errors.Is(r.err, ErrStopped) {
		t.Fatalf("pending sync proposal at stop: %v, want ErrStopped", r.err)
	}
	// After Stop, proposals fail at once instead of hanging.
	if r := wait(t, tn.propose(t, "a/2", Async)); r.err == nil {
		t.Fatal("proposal after Stop succeeded")
	}
}

func TestConcurrentProposersKeepTheirOrder(t *testing.T) {
	tn := startNode(t, t.TempDir(), 5*time.Second)
	const writers, each = 8, 200
	var wg sync.WaitGroup
	for w := 0; w < writers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			chans := make([]chan result, each)
			for i := range chans {
				chans[i] = tn.propose(t, fmt.Sprintf("w%d/%04d", w, i), Async)
			}
			var prev uint64
			for i, ch := range chans {
				r := wait(t, ch)
				if r.err != nil {
					t.Errorf("writer %d #%d: %v", w, i, r.err)
					return
				}
				if r.index <= prev {
					t.Errorf("writer %d: #%d got index %d after %d", w, i, r.index, prev)
				}
				prev = r.index
			}
		}(w)
	}
	wg.Wait()
	waitFor(t, "apply", func() bool { return tn.app.count() == writers*each })
	// The applier saw the log in order, each record once.
	tn.app.mu.Lock()
	defer tn.app.mu.Unlock()
	seen := map[string]bool{}
	for i, idx := range tn.app.idx {
		if i > 0 && idx <= tn.app.idx[i-1] {
			t.Fatalf("applied %d after %d", idx, tn.app.idx[i-1])
		}
		if seen[tn.app.recs[i].Topic] {
			t.Fatalf("%s applied twice", tn.app.recs[i].Topic)
		}
		seen[tn.app.recs[i].Topic] = true
	}
}

func TestRestartResumesAfterAppliedAndKeepsIdentity(t *testing.T) {
	dir := t.TempDir()
	tn := startNode(t, dir, time.Second)
	for i := 0; i < 5; i++ {
		if r := wait(t, tn.propose(t, fmt.Sprintf("r/%d", i), Async)); r.err != nil {
			t.Fatal(r.err)
		}
	}
	waitFor(t, "apply", func() bool { return tn.app.count() == 5 })
	id := tn.ID()
	seq := tn.NextSeq()
	tn.stop()

	tn2 := startNode(t, dir, time.Second)
	if tn2.ID() != id {
		t.Fatalf("node id changed across restart: %x → %x", id, tn2.ID())
	}
	if s := tn2.NextSeq(); s <= seq {
		t.Fatalf("sequence numbers repeat across restarts: %d after %d", s, seq)
	}
	if r := wait(t, tn2.propose(t, "r/after", Async)); r.err != nil {
		t.Fatal(r.err)
	}
	waitFor(t, "apply", func() bool { return tn2.app.count() >= 1 })
	tn2.app.mu.Lock()
	defer tn2.app.mu.Unlock()
	for _, r := range tn2.app.recs {
		if r.Topic != "r/after" {
			t.Fatalf("record %s applied again after restart", r.Topic)
		}
	}
}

func TestDataDirOfAnotherNodeRefused(t *testing.T) {
	dir := t.TempDir()
	tn := startNode(t, dir, time.Second)
	tn.stop()
	other, err := LoadOrCreateIdentity(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	db, err := storage.Open(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	_, err = NewNode(Config{Identity: other, Storage: db, Applier: &recorder{}})
	if !errors.Is(err, ErrIdentity) {
		t.Fatalf("foreign data dir: %v, want ErrIdentity", err)
	}
}

func TestIdentityIsStableAndWellFormed(t *testing.T) {
	dir := t.TempDir()
	a, err := LoadOrCreateIdentity(dir)
	if err != nil {
		t.Fatal(err)
	}
	b, err := LoadOrCreateIdentity(dir)
	if err != nil {
		t.Fatal(err)
	}
	if a.ID != b.ID || a.Fingerprint != b.Fingerprint || a.ID == 0 {
		t.Fatalf("identity not stable: %x/%x", a.ID, b.ID)
	}
	if len(IDString(a.ID)) != 16 || len(ShortID(a.ID)) != 8 {
		t.Fatalf("id formats: %q %q", IDString(a.ID), ShortID(a.ID))
	}
	if a.ID != NodeIDFromPublicKey(a.Cert.Leaf.RawSubjectPublicKeyInfo) {
		t.Fatal("node id does not derive from the public key")
	}
}

// TestStopLeavesNoGoroutineRunning: after Stop nothing a node started is
// left, forward senders included (a slave's publish starts one), so a
// gateway that swaps its node on a join or a removal leaks nothing.
func TestStopLeavesNoGoroutineRunning(t *testing.T) {
	base := runtime.NumGoroutine()
	c := newCluster(t, 3)
	f := c.follower()
	ch := make(chan result, 1)
	f.Propose(f.record(t, "via/slave"), Sync, func(idx uint64, err error) { ch <- result{idx, err} })
	if r := wait(t, ch); r.err != nil {
		t.Fatalf("forwarded publish: %v", r.err)
	}
	for _, id := range c.ids {
		c.stop(id)
	}
	c.net.wg.Wait()
	waitFor(t, "the nodes' goroutines to end", func() bool { return runtime.NumGoroutine() <= base })
}
