package daemon

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/testutil"
	"github.com/tandem-edge/tandem/storage"
)

// inspectLog runs `tandem inspect` on a stopped gateway's data dir.
func inspectLog(t *testing.T, dir string) []inspectLine {
	t.Helper()
	code, out, errOut := runMain(t, "inspect", "--data", dir)
	if code != 0 {
		t.Fatalf("inspect: exit %d: %s", code, errOut)
	}
	var recs []inspectLine
	sc := bufio.NewScanner(strings.NewReader(out))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var r inspectLine
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatalf("inspect line %q: %v", sc.Text(), err)
		}
		recs = append(recs, r)
	}
	return recs
}

// A gateway with an 8MiB budget takes three budgets' worth of publishes: its
// data dir never passes the budget plus the documented slack, the newest
// records are all there and the oldest gone, status says so, and it
// restarts cleanly on the trimmed log.
func TestRetentionKeepsTheDataDirWithinBudget(t *testing.T) {
	const budget = 8 << 20
	const clients, each, size = 4, 6144, 1 << 10 // 24MiB in all
	dir := t.TempDir()
	withBudget := func(c *config.Config) { c.Storage.MaxBytes = budget }
	d := testGateway(t, dir, withBudget)

	var peak atomic.Int64
	stop := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			if u := d.db.RetentionStats().UsedBytes; u > peak.Load() {
				peak.Store(u)
			}
			select {
			case <-stop:
				return
			case <-tick.C:
			}
		}
	}()
	pad := strings.Repeat("x", size)
	publishMany(t, d, clients, each, func(c, i int) (string, []byte) {
		return fmt.Sprintf("ret/%d", c), []byte(fmt.Sprintf("c%d-%06d-%s", c, i, pad)[:size])
	})
	// One more checkpoint's worth of time for the last drops: wait for
	// the first index to settle past the start rather than sleeping.
	testutil.WaitFor(t, 10*time.Second, "records dropped", func() bool { return statusOfGW(t, d).Log.FirstIndex > 1 })
	close(stop)
	<-sampled
	s := statusOfGW(t, d)
	t.Logf("budget %d, data dir peak %d, now %d; first index %d, last %d, %d records dropped",
		budget, peak.Load(), s.Storage.UsedBytes, s.Log.FirstIndex, s.Log.LastIndex, s.Storage.DroppedRecords)
	if p := peak.Load(); p > budget+storage.RetentionSlack {
		t.Errorf("data dir reached %d bytes: budget %d + slack %d", p, budget, storage.RetentionSlack)
	}
	if s.Storage.BudgetBytes != budget || s.Storage.UsedBytes <= 0 || s.Storage.UsedBytes > budget+storage.RetentionSlack ||
		s.Storage.DroppedRecords == 0 || s.Storage.IsRefusing() || s.Disk.UsedBytes != s.Storage.UsedBytes {
		t.Errorf("status storage %+v, disk %+v", s.Storage, s.Disk)
	}
	if s.Storage.OldestAgeSeconds <= 0 || s.Storage.OldestAgeSeconds > 600 {
		t.Errorf("oldest_age_seconds %v", s.Storage.OldestAgeSeconds)
	}
	if code, out, errOut := runMain(t, "status", "--http", d.HTTPAddr()); code != ExitOK || !strings.Contains(out, "budget 8.0 MiB") || !strings.Contains(out, "records dropped") {
		t.Errorf("tandem status: exit %d %s\n%s", code, errOut, out)
	}
	first := s.Log.FirstIndex
	d.Stop()

	// What the log holds: from the first index on, in order, the newest
	// records of every client, none of the oldest.
	recs := inspectLog(t, dir)
	if len(recs) == 0 || recs[0].Index < first {
		t.Fatalf("inspect: %d records, first at %v; status said first index %d", len(recs), recs, first)
	}
	// Per client, what is kept is a suffix of what it published: its
	// newest records, without a hole, up to its last one.
	seqs := make([][]int, clients)
	for _, r := range recs {
		p, err := base64.StdEncoding.DecodeString(r.Payload)
		if err != nil {
			t.Fatal(err)
		}
		var c, i int
		if _, err := fmt.Sscanf(string(p[:9]), "c%d-%06d", &c, &i); err != nil {
			t.Fatalf("record %d: payload %q: %v", r.Index, p[:10], err)
		}
		seqs[c] = append(seqs[c], i)
	}
	total := 0
	for c, got := range seqs {
		total += len(got)
		if len(got) == 0 || got[0] == 0 || got[len(got)-1] != each-1 {
			t.Fatalf("client %d: kept %d records, from %v", c, len(got), got[:min(len(got), 1)])
		}
		for k := range got {
			if got[k] != got[0]+k {
				t.Fatalf("client %d: record %d kept after a hole at %d", c, got[k], got[0]+k)
			}
		}
	}
	// About 3MiB of 1KiB records beside the 2MiB WAL and bbolt's reserve.
	if total < 2000 {
		t.Errorf("only %d records kept", total)
	}
	for i := 1; i < len(recs); i++ {
		if recs[i].Index != recs[i-1].Index+1 {
			t.Fatalf("log index %d after %d", recs[i].Index, recs[i-1].Index)
		}
	}

	// A restart on the trimmed log: it opens, keeps its first index, and
	// takes publishes again.
	d = testGateway(t, dir, withBudget)
	if s := statusOfGW(t, d); s.Log.FirstIndex < first || s.Log.LastIndex < recs[len(recs)-1].Index {
		t.Fatalf("after restart: log %+v, before first %d last %d", s.Log, first, recs[len(recs)-1].Index)
	}
	pub, _ := v5(t, d.MQTTAddr(), "again", nil)
	publish(t, pub, &paho.Publish{Topic: "ret/again", QoS: 1, Payload: []byte("after restart")})
	if got := logRecords(t, d); got[len(got)-1].Topic != "ret/again" {
		t.Fatalf("last record after restart: %+v", got[len(got)-1])
	}
}

// max_age drops records older than it even with no publish to trigger a
// checkpoint, and keeps the younger ones.
func TestRetentionDropsRecordsPastMaxAge(t *testing.T) {
	d := testGateway(t, t.TempDir(), func(c *config.Config) { c.Storage.MaxAge = config.Duration(time.Second) })
	pub, _ := v5(t, d.MQTTAddr(), "aging", nil)
	for i := range 50 {
		publish(t, pub, &paho.Publish{Topic: "age/old", QoS: 1, Payload: fmt.Appendf(nil, "old %d", i)})
	}
	oldLast := statusOfGW(t, d).Log.LastIndex
	testutil.WaitFor(t, 15*time.Second, "records past max_age dropped", func() bool {
		return statusOfGW(t, d).Log.FirstIndex > oldLast
	})
	for _, r := range logRecords(t, d) {
		if r.Topic == "age/old" {
			t.Fatalf("record %q past max_age still in the log", r.Payload)
		}
	}
	publish(t, pub, &paho.Publish{Topic: "age/new", QoS: 1, Payload: []byte("new")})
	got := logRecords(t, d)
	if len(got) == 0 || got[len(got)-1].Topic != "age/new" {
		t.Fatalf("the young record is not in the log: %+v", got)
	}
	// The first index moves inside the transaction that drops, the
	// count once it committed.
	testutil.WaitFor(t, 5*time.Second, "dropped_records to count the 50", func() bool { return statusOfGW(t, d).Storage.DroppedRecords >= 50 })
}

// A 2-gateway cluster whose slave is stopped: the master keeps what the
// slave lacks, and once its budget holds nothing else it refuses
// publishes with 0x97 and says so; when the slave is back and caught up,
// it drops and takes publishes again.
func TestRetentionRefusesWhatAStoppedSlaveLacks(t *testing.T) {
	const budget = 8 << 20
	withBudget := func(c *config.Config) {
		c.Storage.MaxBytes = budget
		// A silent member holds retention for 10 election timeouts,
		// within which the budget must fill: 5 s with the tests' fast
		// 500 ms, which four publishers missed under a loaded CI (21,480
		// records dropped, none refused). 50 s here.
		c.Cluster.ElectionTimeout = config.Duration(5 * time.Second)
	}
	g1 := clusterGateway(t, "gw-1", withBudget)
	g2 := clusterGateway(t, "gw-2", withBudget)
	joinWith(t, g2, inviteToken(t, g1))
	testutil.WaitFor(t, 10*time.Second, "gw-2 a caught-up learner", func() bool {
		v, l, ok := shape(statusOfGW(t, g1))
		return v == 0 && l == 1 && ok
	})
	slaveDir := g2.cfg.Node.DataDir
	slaveLast := statusOfGW(t, g2).Log.LastIndex
	g2.Stop()

	// Four publishers: the budget must fill within the time a silent
	// member holds retention (10 election timeouts, see withBudget),
	// after which the master lets it go (it gets a snapshot when it
	// returns).
	payload := make([]byte, 1<<10)
	var left atomic.Int64
	left.Store(3 * budget / int64(len(payload)))
	var refused atomic.Bool
	var failed atomic.Value
	var wg sync.WaitGroup
	for f := range 4 {
		pub, _ := v5(t, g1.MQTTAddr(), fmt.Sprintf("filler-%d", f), nil)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !refused.Load() && left.Add(-1) >= 0 {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				r, err := pub.Publish(ctx, &paho.Publish{Topic: "a/fill", QoS: 1, Payload: payload})
				cancel()
				switch {
				case r != nil && r.ReasonCode == 0x97:
					refused.Store(true)
				case err != nil:
					failed.CompareAndSwap(nil, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if err, _ := failed.Load().(error); err != nil {
		t.Fatalf("publish: %v", err)
	}
	if !refused.Load() {
		t.Fatalf("3 budgets published with the slave stopped, none refused: %+v", statusOfGW(t, g1).Storage)
	}
	s := statusOfGW(t, g1)
	if !s.Storage.IsRefusing() || s.Log.FirstIndex > slaveLast+1 {
		t.Fatalf("master while the slave lacks its log from %d: storage %+v, log %+v", slaveLast+1, s.Storage, s.Log)
	}
	if s.Storage.UsedBytes > budget+storage.RetentionSlack {
		t.Errorf("data dir %d bytes while refusing, budget %d + slack %d", s.Storage.UsedBytes, budget, storage.RetentionSlack)
	}
	for path, want := range map[string]string{"/": "over budget", "/metrics": "tandem_storage_refusing 1"} {
		resp, err := http.Get("http://" + g1.HTTPAddr() + path)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if !strings.Contains(string(body), want) {
			t.Errorf("GET %s while refusing does not say %q", path, want)
		}
	}

	// The slave comes back: it catches up, the master drops and takes
	// publishes again.
	g2 = testGateway(t, slaveDir, func(c *config.Config) { clusterTestConfig(c, "gw-2"); withBudget(c) })
	testutil.WaitFor(t, 30*time.Second, "the master to drop once the slave caught up", func() bool {
		s := statusOfGW(t, g1)
		return !s.Storage.IsRefusing() && s.Log.FirstIndex > slaveLast+1
	})
	pub, _ := v5(t, g1.MQTTAddr(), "filler-after", nil)
	if r := publish(t, pub, &paho.Publish{Topic: "a/after", QoS: 1, Payload: []byte("after")}); r.ReasonCode != 0 {
		t.Fatalf("publish after the slave caught up: reason %#x", r.ReasonCode)
	}
}
