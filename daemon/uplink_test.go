package daemon

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/admin"
	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/cloudtest"
	"github.com/tandem-edge/tandem/internal/testutil"
	"github.com/tandem-edge/tandem/replication"
	"github.com/tandem-edge/tandem/storage"
	"github.com/tandem-edge/tandem/uplink"
)

// dialTo dials addr, for the cloud helpers.
func dialTo(addr string) func() (net.Conn, error) {
	return func() (net.Conn, error) { return net.DialTimeout("tcp", addr, 5*time.Second) }
}

// withUplink configures one uplink "cloud" to broker: dev/# goes up as
// site/dev/#, the cloud's cmd/# comes down as down/cmd/#.
func withUplink(broker string, mutate func(*config.UplinkConfig)) func(*config.Config) {
	return func(c *config.Config) {
		u := config.UplinkConfig{
			Name: "cloud", Broker: broker,
			Topics:       []config.UplinkTopic{{Match: "dev/#", RemotePrefix: "site/"}},
			Downlink:     []config.UplinkDownlink{{Remote: "cmd/#", LocalPrefix: "down/"}},
			KeepAlive:    config.Duration(2 * time.Second),
			ReconnectMin: config.Duration(50 * time.Millisecond),
			ReconnectMax: config.Duration(200 * time.Millisecond),
		}
		if mutate != nil {
			mutate(&u)
		}
		c.Uplinks = []config.UplinkConfig{u}
	}
}

// publishFrom publishes n QoS 1 messages from each of the devices, each
// on dev/DEVICE with payload DEVICE-i, concurrently, and returns the
// reason codes the gateway answered.
func publishFrom(t *testing.T, d *Daemon, devices []string, n int) map[byte]int {
	t.Helper()
	var mu sync.Mutex
	codes := map[byte]int{}
	var wg sync.WaitGroup
	for _, dev := range devices {
		c, _ := v5(t, d.MQTTAddr(), dev, nil)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range n {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				r, err := c.Publish(ctx, &paho.Publish{Topic: "dev/" + dev, QoS: 1, Payload: fmt.Appendf(nil, "%s-%d", dev, i)})
				cancel()
				mu.Lock()
				switch {
				case r != nil: // paho answers a refusal with an error too
					codes[r.ReasonCode]++
				case err != nil:
					codes[0xff]++
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return codes
}

// checkOrder fails unless every device's messages arrived at the cloud in
// the order it published them (duplicates aside) and carry a tandem-id.
func checkOrder(t *testing.T, msgs []cloudtest.Msg) {
	t.Helper()
	last := map[string]int{}
	for _, m := range msgs {
		if m.ID == "" {
			t.Fatalf("message %s arrived without tandem-id", m.Payload)
		}
		dev, num, _ := strings.Cut(m.Payload, "-")
		var i int
		fmt.Sscan(num, &i)
		if prev, ok := last[dev]; ok && i < prev {
			t.Fatalf("device %s: %d arrived after %d", dev, i, prev)
		}
		last[dev] = i
		if want := "site/dev/" + dev; m.Topic != want {
			t.Fatalf("topic %q at the cloud, want %q", m.Topic, want)
		}
	}
}

// cloudLater starts the cloud at addr, which the uplink of d has been
// failing to reach, with a recorder subscribed before the uplink may
// connect: the uplink is paused meanwhile.
func cloudLater(t *testing.T, d *Daemon, addr string) *cloudtest.Recorder {
	t.Helper()
	if code, msg := api(t, d, "/v1/uplink/pause", admin.UplinkRequest{Name: "cloud"}, nil); code != 200 {
		t.Fatalf("pause: %d %s", code, msg)
	}
	host, port, _ := net.SplitHostPort(addr)
	var p int
	fmt.Sscan(port, &p)
	cloud := cloudtest.Start(t, host, p, nil)
	rec := cloudtest.Record(t, dialTo(cloud.Addr()), "site/#")
	if code, msg := api(t, d, "/v1/uplink/resume", admin.UplinkRequest{Name: "cloud"}, nil); code != 200 {
		t.Fatalf("resume: %d %s", code, msg)
	}
	return rec
}

func uplinkStatus(t *testing.T, d *Daemon) uplink.Status {
	t.Helper()
	s := statusOfGW(t, d)
	if len(s.Uplinks) != 1 || s.Uplinks[0].Name != "cloud" {
		t.Fatalf("status uplinks = %+v", s.Uplinks)
	}
	return s.Uplinks[0]
}

// The uplink end to end on one gateway: everything acked reaches the
// cloud in per-device order, once; status, metrics, pause and resume
// show and steer it; the downlink reaches a local subscriber once; and a
// restart resumes from the replicated position without duplicates.
func TestUplinkForwardsWhatIsAckedAndResumesAfterRestart(t *testing.T) {
	cloud := cloudtest.Start(t, "127.0.0.1", 0, nil)
	rec := cloudtest.Record(t, dialTo(cloud.Addr()), "site/#")
	dir := t.TempDir()
	d := testGateway(t, dir, withUplink(cloud.URL(), nil))
	devices := []string{"a", "b", "c"}
	if codes := publishFrom(t, d, devices, 40); codes[0] != 120 {
		t.Fatalf("publish answers %v", codes)
	}
	testutil.WaitFor(t, 10*time.Second, "120 messages at the cloud", func() bool { n, _ := rec.Distinct(); return n == 120 })
	checkOrder(t, rec.Msgs())
	if _, dups := rec.Distinct(); dups != 0 {
		t.Errorf("%d duplicates at the cloud without any failover", dups)
	}
	testutil.WaitFor(t, 5*time.Second, "an empty backlog", func() bool {
		s := uplinkStatus(t, d)
		return s.Connected && s.Running && s.BacklogRecords == 0
	})

	// Metrics carry the uplink.
	resp, err := http.Get("http://" + d.HTTPAddr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, m := range []string{`tandem_uplink_connected{uplink="cloud"} 1`, `tandem_uplink_forwarded_total{uplink="cloud"} 120`, `tandem_uplink_backlog_records{uplink="cloud"} 0`} {
		if !strings.Contains(string(body), m) {
			t.Errorf("/metrics lacks %s", m)
		}
	}

	// And so does the status page, a row per uplink.
	resp, err = http.Get("http://" + d.HTTPAddr() + "/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), `data-uplink="cloud"`) {
		t.Errorf("the status page has no row for the uplink")
	}

	// Paused, it holds the records back; resumed, they go.
	var pr admin.UplinkResponse
	if code, msg := api(t, d, "/v1/uplink/pause", admin.UplinkRequest{Name: "cloud"}, &pr); code != 200 || !pr.Paused {
		t.Fatalf("pause: %d %s %+v", code, msg, pr)
	}
	if code, msg := api(t, d, "/v1/uplink/pause", admin.UplinkRequest{Name: "nope"}, nil); code != 400 || !strings.Contains(msg, "no uplink named") {
		t.Errorf("pause of an unknown uplink: %d %s", code, msg)
	}
	testutil.WaitFor(t, 5*time.Second, "the paused uplink to disconnect", func() bool { s := uplinkStatus(t, d); return !s.Connected && s.Paused })
	publishFrom(t, d, []string{"e"}, 10)
	testutil.WaitFor(t, 5*time.Second, "a backlog of 10", func() bool { return uplinkStatus(t, d).BacklogRecords == 10 })
	if n, _ := rec.Distinct(); n != 120 {
		t.Fatalf("%d messages at the cloud while paused, want 120", n)
	}
	if code, out, errOut := runMain(t, "status", "--http", d.HTTPAddr()); code != 0 || !strings.Contains(out, "UPLINK") || !strings.Contains(out, "paused") {
		t.Errorf("tandem status (exit %d, %s) lacks the paused uplink:\n%s", code, errOut, out)
	}
	if code, msg := api(t, d, "/v1/uplink/resume", admin.UplinkRequest{Name: "cloud"}, &pr); code != 200 || pr.Paused {
		t.Fatalf("resume: %d %s", code, msg)
	}
	testutil.WaitFor(t, 10*time.Second, "130 messages at the cloud", func() bool { n, _ := rec.Distinct(); return n == 130 })

	// The downlink reaches a local subscriber, once.
	sub, got := v5(t, d.MQTTAddr(), "listener", nil)
	subscribe(t, sub, "down/#", 1)
	cloudtest.Publish(t, dialTo(cloud.Addr()), "cmd/valve", "open")
	if p := receive(t, got, 10*time.Second); p.Topic != "down/cmd/valve" || string(p.Payload) != "open" {
		t.Fatalf("downlink delivered %s %q", p.Topic, p.Payload)
	}
	select {
	case p := <-got:
		t.Fatalf("downlink delivered twice: %s %q", p.Topic, p.Payload)
	case <-time.After(300 * time.Millisecond):
	}

	// A restart resumes from the replicated position: nothing is sent
	// again, and what is published next goes up. A pause outlives it.
	if code, msg := api(t, d, "/v1/uplink/pause", admin.UplinkRequest{Name: "cloud"}, &pr); code != 200 || !pr.Paused {
		t.Fatalf("pause: %d %s %+v", code, msg, pr)
	}
	if err := d.Stop(); err != nil {
		t.Fatal(err)
	}
	d = testGateway(t, dir, withUplink(cloud.URL(), nil))
	testutil.WaitFor(t, 5*time.Second, "the uplink running, still paused, after the restart", func() bool {
		s := uplinkStatus(t, d)
		return s.Running && s.Paused && !s.Connected
	})
	if code, msg := api(t, d, "/v1/uplink/resume", admin.UplinkRequest{Name: "cloud"}, &pr); code != 200 || pr.Paused {
		t.Fatalf("resume: %d %s", code, msg)
	}
	testutil.WaitFor(t, 5*time.Second, "the uplink to connect after the restart", func() bool { return uplinkStatus(t, d).Connected })
	publishFrom(t, d, []string{"f"}, 5)
	testutil.WaitFor(t, 10*time.Second, "135 messages at the cloud", func() bool { n, _ := rec.Distinct(); return n == 135 })
	if _, dups := rec.Distinct(); dups != 0 {
		t.Errorf("%d duplicates at the cloud after a clean restart", dups)
	}
	checkOrder(t, rec.Msgs())
	assertAnswersAndStops(t, d)
}

// With on_full: refuse, a full backlog refuses publishes to the uplink's
// topics with 0x97 (others go on), and service resumes once the cloud
// takes the backlog.
func TestUplinkFullBacklogRefuses(t *testing.T) {
	addr := testutil.FreeAddr(t) // the cloud comes later
	d := testGateway(t, t.TempDir(), withUplink("tcp://"+addr, func(u *config.UplinkConfig) {
		u.MaxBacklog = 1 << 10
		u.Downlink = nil
	}))
	testutil.WaitFor(t, 5*time.Second, "the uplink to run", func() bool { return uplinkStatus(t, d).Running })
	codes := publishFrom(t, d, []string{"a"}, 60)
	if codes[0x97] == 0 || codes[0] == 0 {
		t.Fatalf("publish answers %v: want some accepted, then 0x97", codes)
	}
	c, _ := v5(t, d.MQTTAddr(), "other", nil)
	if r := publish(t, c, &paho.Publish{Topic: "elsewhere", QoS: 1, Payload: []byte("x")}); r.ReasonCode != 0 {
		t.Errorf("publish to a topic no uplink forwards: reason %#x", r.ReasonCode)
	}
	rec := cloudLater(t, d, addr)
	accepted := codes[0]
	testutil.WaitFor(t, 15*time.Second, "the accepted messages at the cloud", func() bool {
		n, _ := rec.Distinct()
		return n == accepted || uplinkStatus(t, d).BacklogRecords == 0 && n >= accepted
	})
	if n, _ := rec.Distinct(); n != accepted {
		t.Errorf("%d at the cloud, %d accepted", n, accepted)
	}
	if codes := publishFrom(t, d, []string{"b"}, 3); codes[0] != 3 {
		t.Errorf("after the drain: publish answers %v", codes)
	}
	assertAnswersAndStops(t, d)
}

// With on_full: drop_oldest, the oldest records go first, and what the
// cloud misses is what the uplink counts as dropped.
func TestUplinkDropOldestCountsWhatTheCloudMisses(t *testing.T) {
	addr := testutil.FreeAddr(t)
	d := testGateway(t, t.TempDir(), withUplink("tcp://"+addr, func(u *config.UplinkConfig) {
		u.MaxBacklog = 1 << 10
		u.OnFull = uplink.OnFullDropOldest
		u.Downlink = nil
	}))
	const n = 80
	if codes := publishFrom(t, d, []string{"a"}, n); codes[0] != n {
		t.Fatalf("publish answers %v: drop_oldest refuses nothing", codes)
	}
	rec := cloudLater(t, d, addr)
	testutil.WaitFor(t, 15*time.Second, "an empty backlog", func() bool { return uplinkStatus(t, d).BacklogRecords == 0 && uplinkStatus(t, d).Connected })
	testutil.WaitFor(t, 5*time.Second, "the last message at the cloud", func() bool {
		m := rec.Msgs()
		return len(m) > 0 && m[len(m)-1].Payload == fmt.Sprintf("a-%d", n-1)
	})
	dropped := d.ups.list[0].Counters().Dropped
	got, _ := rec.Distinct()
	if dropped == 0 || uint64(got)+dropped != n {
		t.Fatalf("%d at the cloud + %d dropped, want %d", got, dropped, n)
	}
	// The oldest went: what arrived is the newest, a-dropped on.
	if first := rec.Msgs()[0].Payload; first != fmt.Sprintf("a-%d", dropped) {
		t.Errorf("first at the cloud %s, want a-%d", first, dropped)
	}
	checkOrder(t, rec.Msgs())
	assertAnswersAndStops(t, d)
}

// An uplink whose rule is # forwards device messages only: the gateway's
// own records (its feature level, a control kind of a later release: they
// have no device topic, or one that # would match) never reach the cloud,
// count in no backlog, and do not stop the uplink.
func TestUplinkOfEverythingForwardsNoControlRecord(t *testing.T) {
	cloud := cloudtest.Start(t, "127.0.0.1", 0, nil)
	rec := cloudtest.Record(t, dialTo(cloud.Addr()), "#")
	d := testGateway(t, t.TempDir(), withUplink(cloud.URL(), func(u *config.UplinkConfig) {
		u.Topics = []config.UplinkTopic{{Match: "#", RemotePrefix: "site/"}}
		u.Downlink = nil
	}))
	n := d.gw.Node()
	for _, r := range []storage.Record{
		{Kind: storage.Kind(200), Topic: "dev/looks-like-a-device", Payload: []byte("later")},
		{Kind: storage.KindFeature, Payload: []byte{storage.FeatureLevel}},
	} {
		r.Origin, r.Seq, r.Time = n.ID(), n.NextSeq(), time.Now().UnixNano()
		done := make(chan error, 1)
		n.Propose(storage.AppendRecord(nil, &r), replication.Async, func(_ uint64, err error) { done <- err })
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	if codes := publishFrom(t, d, []string{"a"}, 5); codes[0] != 5 {
		t.Fatalf("publish answers %v", codes)
	}
	testutil.WaitFor(t, 10*time.Second, "the 5 device messages at the cloud, and an empty backlog", func() bool {
		s := uplinkStatus(t, d)
		n, _ := rec.Distinct()
		return n >= 5 && s.Connected && s.BacklogRecords == 0
	}, func() string { return fmt.Sprintf("%+v; cloud has %d", uplinkStatus(t, d), len(rec.Msgs())) })
	for _, m := range rec.Msgs() {
		if m.Topic != "site/dev/a" {
			t.Fatalf("the cloud got %q on %q: not a device message", m.Payload, m.Topic)
		}
	}
	if s := uplinkStatus(t, d); s.LastError != "" {
		t.Fatalf("uplink error: %s", s.LastError)
	}
}

// A QoS 2 publish in the log twice, the resend a device made on the member
// it moved to and its original committed after it (mqtt: inboundDup),
// reaches the cloud once: the second copy has another record id, so a
// consumer could not drop it by tandem-id. The records are the ones such
// a move leaves, from two other members, with no local subscriber.
func TestUplinkForwardsAQoS2ResendAndItsLateOriginalOnce(t *testing.T) {
	cloud := cloudtest.Start(t, "127.0.0.1", 0, nil)
	rec := cloudtest.Record(t, dialTo(cloud.Addr()), "#")
	d := testGateway(t, t.TempDir(), withUplink(cloud.URL(), func(u *config.UplinkConfig) {
		u.Topics = []config.UplinkTopic{{Match: "in/#", RemotePrefix: "site/"}}
		u.Downlink = nil
	}))
	const left, came = 0xa1, 0xb2 // the member the device left, the one it came to
	now := time.Now().UnixNano()
	for _, r := range []storage.Record{
		{Kind: storage.KindSession, Origin: came, Seq: 10, ClientID: "dev", Topic: "$tandem/session", Payload: []byte(`{"op":"start","expiry":600}`)},
		{Kind: storage.KindSession, Origin: came, Seq: 12, ClientID: "dev", Topic: "$tandem/session", Payload: []byte(`{"op":"resend","in":[7],"seq":11}`)},
		{Origin: came, Seq: 11, ClientID: "dev", Topic: "in/x", QoS: 2, PacketID: 7, Payload: []byte("once")},
		{Origin: left, Seq: 40, ClientID: "dev", Topic: "in/x", QoS: 2, PacketID: 7, Payload: []byte("once")},
		{Origin: came, Seq: 13, ClientID: "dev", Topic: "in/y", QoS: 1, PacketID: 8, Payload: []byte("marker")},
	} {
		r.Time = now
		done := make(chan error, 1)
		d.gw.Node().Propose(storage.AppendRecord(nil, &r), replication.Async, func(_ uint64, err error) { done <- err })
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	testutil.WaitFor(t, 10*time.Second, "the marker at the cloud", func() bool {
		msgs := rec.Msgs()
		return len(msgs) > 0 && msgs[len(msgs)-1].Payload == "marker"
	}, func() string { return fmt.Sprintf("%+v; cloud has %d", uplinkStatus(t, d), len(rec.Msgs())) })
	var got []string
	for _, m := range rec.Msgs() {
		got = append(got, m.Payload)
	}
	if fmt.Sprint(got) != "[once marker]" {
		t.Fatalf("the cloud got %q, want the message once, then the marker", got)
	}
	assertAnswersAndStops(t, d)
}
