package daemon

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/testutil"
	"github.com/tandem-edge/tandem/replication"
	"github.com/tandem-edge/tandem/storage"
)

// The topics the gateway's own records travelled on before record kinds:
// a device that reached one could stop every member (issue: a will on
// $tandem/settle whose payload was not JSON).
var controlTopics = []string{"$tandem/settle", "$tandem/session", "$tandem/cursors", "$tandem/uplinks"}

// A will on a $ topic is refused at CONNECT, as a PUBLISH there is: MQTT 5
// gets CONNACK 0x90 Topic Name invalid, MQTT 3.1.1 (no code for it) is
// closed; nothing reaches the log and the gateway goes on serving.
func TestWillOnAControlTopicIsRefused(t *testing.T) {
	d, _ := startGateway(t, nil)
	for _, topic := range append(controlTopics, "$SYS/broker/x", "$share") {
		_, ca := dialMQTTOpts(t, d.MQTTAddr(), connOpts{version: 5, id: "w5", willTopic: topic})
		if ca.closed || ca.code != 0x90 {
			t.Fatalf("MQTT 5 will on %s: %+v, want CONNACK 0x90", topic, ca)
		}
		_, ca = dialMQTTOpts(t, d.MQTTAddr(), connOpts{version: 4, id: "w4", willTopic: topic})
		if !ca.closed && ca.code == 0 {
			t.Fatalf("MQTT 3.1.1 will on %s accepted: %+v", topic, ca)
		}
		// A publish there is refused too (0x87 to MQTT 5).
		c := mustConnect(t, d.MQTTAddr(), connOpts{version: 5, id: "p5"})
		c.pub(topic, 1, false, 3, nil, "not json")
		if r := c.ack(0x40, 3); r < 0x80 {
			t.Fatalf("publish on %s: PUBACK %#x, want a refusal", topic, r)
		}
		c.Close()
	}
	recs := assertServing(t, d, "", "")
	for _, r := range recs {
		if strings.HasPrefix(r.Topic, "$") && r.Kind == storage.KindMessage {
			t.Fatalf("a device record on %s reached the log", r.Topic)
		}
	}
}

// A clean-session client's will under an ACL is checked as the user who
// connected, not as anonymous: its session is gone when the will fires.
func TestCleanSessionWillIsCheckedAsItsUser(t *testing.T) {
	d, _ := aclGateway(t)
	w := mustConnect(t, d.MQTTAddr(), connOpts{version: 4, id: "clean-willer", user: ptr("alice"), pass: ptr("a"), willTopic: "alice/will"})
	testutil.WaitFor(t, 5*time.Second, "one client", func() bool { return d.broker.Clients() == 1 })
	w.Close() // no DISCONNECT: the will fires
	testutil.WaitFor(t, 5*time.Second, "the will in the log", func() bool { return countTopic(t, d, "alice/will") == 1 })
	assertServing(t, d, "bob", "b")
}

// badControl is one record a test writes straight into a member's log
// that no member can apply; kind is the label it is counted under.
type badControl struct {
	kind string
	data []byte
}

// badControls are a record of each control kind whose payload cannot be
// decoded, in the header's encoding and the legacy one, one of a kind
// this build does not know, and a will on $tandem/settle in the legacy
// encoding (a device's record, which must not be obeyed at all).
func badControls(n *replication.Node) []badControl {
	var out []badControl
	add := func(kind string, r storage.Record) {
		r.Origin, r.Seq, r.Time = n.ID(), n.NextSeq(), time.Now().UnixNano()
		out = append(out, badControl{kind, storage.AppendRecord(nil, &r)})
	}
	for _, k := range []storage.Kind{storage.KindSettle, storage.KindSession, storage.KindCursors, storage.KindUplinks} {
		add(k.String(), storage.Record{Kind: k, Topic: k.LegacyTopic(), Payload: []byte("not json {")})
		add(k.String(), storage.Record{Kind: k, Legacy: true, Topic: k.LegacyTopic(), Payload: []byte("not json {")})
	}
	add("feature", storage.Record{Kind: storage.KindFeature, Payload: []byte{2, 3}})
	add("kind-200", storage.Record{Kind: storage.Kind(200), Topic: "later", Payload: []byte{1, 2}})
	add("", storage.Record{Topic: "$tandem/settle", Will: true, QoS: 1, Payload: []byte("not json {")})
	add("", storage.Record{Topic: "$tandem/uplinks", Will: true, Payload: []byte(`{"name":"cloud","paused":true}`)})
	return out
}

// skipped reads tandem_records_skipped_total by kind.
func skipped(t *testing.T, d *Daemon) map[string]float64 {
	t.Helper()
	out := map[string]float64{}
	if f := scrape(t, d)["tandem_records_skipped_total"]; f != nil {
		for _, m := range f.GetMetric() {
			out[labelOf(m, "kind")] += m.GetCounter().GetValue()
		}
	}
	return out
}

func labelOf(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

// A control record that cannot be decoded, written straight into the
// log, is counted and skipped by every member at the same index; both
// keep serving, and a restart goes past it as well.
func TestUnreadableControlRecordsAreSkippedOnEveryMember(t *testing.T) {
	// An uplink on each (to a cloud that never answers): the members
	// read the uplink records.
	cloud := withUplink("tcp://127.0.0.1:1", nil)
	master := clusterGateway(t, "gw-bad-1", cloud)
	slave := clusterGateway(t, "gw-bad-2", cloud)
	joinWith(t, slave, inviteToken(t, master))
	testutil.WaitFor(t, 10*time.Second, "a caught-up slave", func() bool {
		v, l, ok := shape(statusOfGW(t, master))
		return v == 0 && l == 1 && ok && statusOfGW(t, slave).Role == "slave"
	})
	bad := badControls(master.gw.Node())
	var last uint64
	for _, b := range bad {
		done := make(chan error, 1)
		master.gw.Node().Propose(b.data, replication.Async, func(i uint64, err error) {
			last = max(last, i)
			done <- err
		})
		if err := <-done; err != nil {
			t.Fatalf("proposing a %s record: %v", b.kind, err)
		}
	}
	want := map[string]float64{}
	for _, b := range bad {
		if b.kind != "" {
			want[b.kind]++
		}
	}
	for _, d := range []*Daemon{master, slave} {
		testutil.WaitFor(t, 10*time.Second, d.cfg.Node.Name+" applying past the records", func() bool { return d.db.Applied() >= last })
		testutil.WaitFor(t, 5*time.Second, d.cfg.Node.Name+" counting them", func() bool {
			got := skipped(t, d)
			for k, n := range want {
				if got[k] < n {
					return false
				}
			}
			return true
		}, func() string { return fmt.Sprint(skipped(t, d)) })
		if err := d.Err(); err != nil {
			t.Fatalf("%s stopped: %v", d.cfg.Node.Name, err)
		}
		// The device's will on $tandem/uplinks paused nothing.
		if d.ups.byName("cloud").Status().Paused {
			t.Fatalf("%s: a device record on $tandem/uplinks paused the uplink", d.cfg.Node.Name)
		}
	}
	t.Logf("skipped on the master: %v, on the slave: %v (last index %d)", skipped(t, master), skipped(t, slave), last)
	assertServing(t, master, "", "")
	// The slave serves its subscribers and forwards publishes.
	assertServing(t, slave, "", "")

	// A restart applies the same log again (or starts past it) and runs.
	dir, peer := slave.cfg.Node.DataDir, slave.PeerAddr()
	slave.Stop()
	slave = testGateway(t, dir, func(c *config.Config) {
		clusterTestConfig(c, "gw-bad-2")
		cloud(c)
		c.Peer.Listen = peer
	})
	testutil.WaitFor(t, 15*time.Second, "the slave back", func() bool { return statusOfGW(t, slave).Role == "slave" })
	assertServing(t, slave, "", "")
	stopWithin(t, master, 5*time.Second)
	stopWithin(t, slave, 5*time.Second)
}

// stopWithin stops d and fails when that takes longer than limit.
func stopWithin(t *testing.T, d *Daemon, limit time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	done := make(chan struct{})
	go func() { d.Stop(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
		t.Fatalf("%s did not stop within %v", d.cfg.Node.Name, limit)
	}
}

// A data dir whose cluster runs a feature level this build does not know
// is refused at start with both levels named, and left as it is.
func TestDataDirOfANewerFeatureLevelIsRefused(t *testing.T) {
	dir := t.TempDir()
	d := testGateway(t, dir, nil)
	d.db.StageFeatureLevel(storage.FeatureLevel + 1)
	if err := d.db.Flush(); err != nil {
		t.Fatal(err)
	}
	d.Stop()
	before, err := os.ReadFile(dir + "/tandem.db")
	if err != nil {
		t.Fatal(err)
	}
	cfg := config.DefaultConfig()
	cfg.Node.DataDir = dir
	cfg.MQTT.Listen, cfg.HTTP.Listen, cfg.Peer.Listen = "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
	d2, err := New(cfg, nil)
	if err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		err = d2.Start(ctx)
		cancel()
		if err == nil {
			d2.Stop()
		}
	}
	if !errors.Is(err, storage.ErrUnknownVersion) || !strings.Contains(err.Error(), fmt.Sprintf("feature level %d", storage.FeatureLevel+1)) || !strings.Contains(err.Error(), fmt.Sprintf("up to %d", storage.FeatureLevel)) {
		t.Fatalf("start on a data dir of feature level %d: %v", storage.FeatureLevel+1, err)
	}
	after, err := os.ReadFile(dir + "/tandem.db")
	if err != nil || string(after) != string(before) {
		t.Fatalf("the refused data file changed (%v)", err)
	}
}

// A cluster of this build runs at its feature level (a lone gateway raises
// it at once; a joiner takes it from the log); status shows it with each
// member's release, and the control records carry their kind in the
// header on every member.
func TestFeatureLevelOfAClusterInStatusAndRecords(t *testing.T) {
	master, slave := twoGateways(t, "gw-level")
	for _, d := range []*Daemon{master, slave} {
		testutil.WaitFor(t, 10*time.Second, fmt.Sprintf("%s at feature level %d", d.cfg.Node.Name, storage.FeatureLevel), func() bool {
			return statusOfGW(t, d).Cluster.FeatureLevel == storage.FeatureLevel
		})
		s := statusOfGW(t, d)
		if len(s.Members) != 1 || s.Members[0].FeatureLevel != storage.FeatureLevel || s.Members[0].Version == "" {
			t.Fatalf("%s: members %+v, want the other's build and level", d.cfg.Node.Name, s.Members)
		}
	}
	// A persistent session's records, written now, are control records
	// in the header's encoding on both members' logs.
	offlineSession(t, slave.MQTTAddr(), "level-session", "a/#")
	for _, d := range []*Daemon{master, slave} {
		testutil.WaitFor(t, 10*time.Second, d.cfg.Node.Name+" holding the session record", func() bool {
			found := false
			_ = d.db.Scan(1, func(e pbEntry) bool {
				if e.Type == 0 && len(e.Data) > 0 && e.Data[0] == storage.RecordVersionControl {
					if r, err := storage.DecodeRecord(e.Data); err == nil && r.Kind == storage.KindSession && r.ClientID == "level-session" {
						found = true
					}
				}
				return !found
			})
			return found
		})
	}
	for _, r := range logRecords(t, master) {
		if r.Kind == storage.KindSession && r.ClientID == "level-session" && r.Legacy {
			t.Fatal("a session record after the raise in the legacy encoding")
		}
	}
}
