package daemon

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/tandem-edge/tandem/admin"
	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/testutil"
	"github.com/tandem-edge/tandem/replication"
)

// scrape fetches /metrics and parses the exposition format.
func scrape(t *testing.T, d *Daemon) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get("http://" + d.HTTPAddr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("GET /metrics: %s: %s", resp.Status, b)
	}
	p := expfmt.NewTextParser(model.LegacyValidation)
	mfs, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parsing /metrics: %v", err)
	}
	return mfs
}

// metric finds the sample of family name whose labels include want
// (name=value pairs); nil when there is none.
func metric(mfs map[string]*dto.MetricFamily, name string, want ...string) *dto.Metric {
	mf := mfs[name]
	if mf == nil {
		return nil
	}
next:
	for _, m := range mf.Metric {
		have := map[string]string{}
		for _, lp := range m.Label {
			have[lp.GetName()] = lp.GetValue()
		}
		for i := 0; i+1 < len(want); i += 2 {
			if have[want[i]] != want[i+1] {
				continue next
			}
		}
		return m
	}
	return nil
}

// value is a counter's or gauge's value, -1 when the sample is missing.
func value(mfs map[string]*dto.MetricFamily, name string, labels ...string) float64 {
	m := metric(mfs, name, labels...)
	switch {
	case m == nil:
		return -1
	case m.Counter != nil:
		return m.Counter.GetValue()
	case m.Gauge != nil:
		return m.Gauge.GetValue()
	}
	return -1
}

// requireWired stops a test whose daemon.go does not yet hand the field
// view to the broker and the storage (mqtt.Config.Observer,
// storage.Options.OnCommit). In CI it fails: a release must not ship
// without its hot-path metrics.
func requireWired(t *testing.T, d *Daemon) {
	t.Helper()
	if d.fv != nil && d.fv.Wired() {
		return
	}
	msg := "daemon.go does not pass the field view to storage.Options.OnCommit and mqtt.Config.Observer yet"
	if os.Getenv("CI") == "true" {
		t.Fatal(msg)
	}
	t.Skip(msg)
}

func TestMetricsMoveWithPublishes(t *testing.T) {
	d := testGateway(t, t.TempDir(), func(c *config.Config) {
		c.Node.Name = "gw-metrics"
		c.Cluster.SyncTimeout = config.Duration(200 * time.Millisecond)
		c.Topics = []config.TopicRule{{Match: "s/#", Ack: "sync"}}
	})
	pub, _ := v5(t, d.MQTTAddr(), "metrics-pub", nil)
	const n1, n2, n0 = 20, 5, 3
	for i := range n0 {
		publish(t, pub, &paho.Publish{Topic: "a/q0", QoS: 0, Payload: []byte{byte(i)}})
	}
	for i := range n1 {
		if r := publish(t, pub, &paho.Publish{Topic: "a/q1", QoS: 1, Payload: []byte{byte(i)}}); r.ReasonCode != 0 {
			t.Fatalf("async QoS 1 publish: reason %#x", r.ReasonCode)
		}
	}
	for i := range n2 {
		if r := publish(t, pub, &paho.Publish{Topic: "a/q2", QoS: 2, Payload: []byte{byte(i)}}); r.ReasonCode != 0 {
			t.Fatalf("async QoS 2 publish: reason %#x", r.ReasonCode)
		}
	}
	publish(t, pub, &paho.Publish{Topic: "a/kept", QoS: 1, Retain: true, Payload: []byte("r")})
	// A lone gateway cannot ack a sync topic: refused after sync_timeout.
	if r, _ := pub.Publish(context.Background(), &paho.Publish{Topic: "s/1", QoS: 1, Payload: []byte("x")}); r == nil || r.ReasonCode != 0x80 {
		t.Fatalf("sync publish on a lone gateway: %+v, want 0x80", r)
	}
	requireWired(t, d)

	var mfs map[string]*dto.MetricFamily
	testutil.WaitFor(t, 5*time.Second, "the retained message applied", func() bool {
		mfs = scrape(t, d)
		return value(mfs, "tandem_mqtt_retained_messages") == 1
	})
	for _, c := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"tandem_mqtt_publishes_received_total", []string{"ack", "async", "qos", "0"}, n0},
		{"tandem_mqtt_publishes_received_total", []string{"ack", "async", "qos", "1"}, n1 + 1},
		{"tandem_mqtt_publishes_received_total", []string{"ack", "async", "qos", "2"}, n2},
		{"tandem_mqtt_publishes_received_total", []string{"ack", "sync", "qos", "1"}, 1},
		{"tandem_mqtt_acks_sent_total", []string{"ack", "async", "outcome", "ok"}, n1 + n2 + 1},
		{"tandem_mqtt_acks_sent_total", []string{"ack", "sync", "outcome", "timeout"}, 1},
		{"tandem_mqtt_acks_sent_total", []string{"ack", "sync", "outcome", "ok"}, 0},
		{"tandem_raft_role", []string{"role", "master"}, 1},
		{"tandem_raft_role", []string{"role", "slave"}, 0},
		{"tandem_cluster_members", nil, 1},
		{"tandem_mqtt_clients_connected", nil, 1},
		{"tandem_node_info", []string{"name", "gw-metrics", "id", replication.IDString(d.id.ID)}, 1},
		{"tandem_status_up", nil, 1},
	} {
		if got := value(mfs, c.name, c.labels...); got != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
	records := float64(n0 + n1 + n2 + 2)
	for _, c := range []struct {
		name     string
		atLeast  float64
		whatElse string
	}{
		{"tandem_raft_term", 1, ""},
		{"tandem_raft_leader_changes_total", 1, "a lone gateway elects itself"},
		{"tandem_log_last_index", records, "every record is an entry"},
		{"tandem_log_first_index", 1, ""},
		{"tandem_disk_used_bytes", 1, ""},
		{"tandem_disk_free_bytes", 1, ""},
		{"tandem_storage_commits_total", 1, ""},
	} {
		if got := value(mfs, c.name); got < c.atLeast {
			t.Errorf("%s = %v, want ≥ %v %s", c.name, got, c.atLeast, c.whatElse)
		}
	}
	// A record of the gateway's own (a settlement) may be between its
	// save and its commit at the scrape: a lone gateway commits what it
	// logs within a commit's time.
	testutil.WaitFor(t, 5*time.Second, "commit index to reach the last index", func() bool {
		m := scrape(t, d)
		return value(m, "tandem_log_commit_index") == value(m, "tandem_log_last_index")
	})

	// Histograms: every successful ack has a latency, none for the refusal.
	lat := metric(mfs, "tandem_mqtt_ack_latency_seconds", "ack", "async")
	if lat == nil || lat.Histogram.GetSampleCount() != n1+n2+1 || lat.Histogram.GetSampleSum() <= 0 {
		t.Errorf("async ack latency histogram: %v, want %d samples with a positive sum", lat, n1+n2+1)
	} else if b := lat.Histogram.Bucket; b[len(b)-1].GetCumulativeCount() != n1+n2+1 {
		t.Errorf("async ack latency: %d samples in the last bucket (10 s), want all", b[len(b)-1].GetCumulativeCount())
	}
	if syn := metric(mfs, "tandem_mqtt_ack_latency_seconds", "ack", "sync"); syn == nil || syn.Histogram.GetSampleCount() != 0 {
		t.Errorf("sync ack latency: %v, want an empty histogram (its one publish was refused)", syn)
	}
	fs := metric(mfs, "tandem_storage_fsync_duration_seconds")
	if fs == nil || fs.Histogram.GetSampleCount() < 1 || fs.Histogram.GetSampleSum() <= 0 {
		t.Errorf("fsync histogram: %v", fs)
	}
	// Each record went through one commit: the batch sizes add up to at
	// least the records (raft's own entries come on top).
	be := metric(mfs, "tandem_storage_commit_entries")
	if be == nil || be.Histogram.GetSampleSum() < records || be.Histogram.GetSampleCount() > uint64(be.Histogram.GetSampleSum()) {
		t.Errorf("entries per commit histogram: %v, want a sum ≥ %v", be, records)
	}
	if fs != nil && be != nil && fs.Histogram.GetSampleCount() < be.Histogram.GetSampleCount() {
		t.Errorf("%d fsyncs for %d commits of entries", fs.Histogram.GetSampleCount(), be.Histogram.GetSampleCount())
	}

	// Counters only grow, and the state gauges follow the status.
	publish(t, pub, &paho.Publish{Topic: "a/q1", QoS: 1, Payload: []byte("again")})
	after := scrape(t, d)
	if got := value(after, "tandem_mqtt_acks_sent_total", "ack", "async", "outcome", "ok"); got != n1+n2+2 {
		t.Errorf("acks after one more publish: %v, want %v", got, n1+n2+2)
	}
	if value(after, "tandem_log_last_index") <= value(mfs, "tandem_log_last_index") {
		t.Errorf("last index did not move: %v then %v", value(mfs, "tandem_log_last_index"), value(after, "tandem_log_last_index"))
	}
	if mf := after["tandem_mqtt_ack_latency_seconds"]; mf == nil || mf.GetType() != dto.MetricType_HISTOGRAM {
		t.Errorf("ack latency is not exposed as a histogram: %v", mf)
	}
}

// chromium returns the headless browser to check pages with. It skips the
// test without one, except in CI, which installs it (.ci/run).
func chromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("chromium not found, and CI installs it: the status page test cannot run")
	}
	t.Skip("chromium not found (apt-get install chromium): the status page is not checked in a browser")
	return ""
}

// renderedNode is one row of the page's gateway table, as the browser
// rendered it.
type renderedNode struct{ Name, Role string }

var nodeRowRE = regexp.MustCompile(`<tr data-node="([^"]*)" data-role="([^"]*)"`)

// loadPage loads url in headless Chromium, returns the gateways its DOM
// shows, and saves a phone-sized screenshot as shot. For a cluster, call it
// with each gateway's HTTPAddr: every page lists all members.
func loadPage(t *testing.T, url, shot string) ([]renderedNode, string) {
	t.Helper()
	bin := chromium(t)
	run := func(args ...string) []byte {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		base := []string{"--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-dev-shm-usage",
			"--user-data-dir=" + t.TempDir(), "--window-size=412,1100", "--hide-scrollbars"}
		cmd := exec.CommandContext(ctx, bin, append(base, args...)...)
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		if err := cmd.Run(); err != nil {
			t.Fatalf("chromium %v: %v\n%s", args, err, errb.String())
		}
		return out.Bytes()
	}
	dom := string(run("--dump-dom", url))
	var nodes []renderedNode
	for _, m := range nodeRowRE.FindAllStringSubmatch(dom, -1) {
		nodes = append(nodes, renderedNode{Name: m[1], Role: m[2]})
	}
	run("--screenshot="+shot, url)
	if st, err := os.Stat(shot); err != nil || st.Size() < 1000 {
		t.Fatalf("no screenshot at %s: %v", shot, err)
	}
	return nodes, dom
}

// twoGateways forms a 2-gateway cluster on loopback: gw-1 the master,
// gw-2 its learner slave, caught up.
func twoGateways(t *testing.T, prefix string) (master, slave *Daemon) {
	t.Helper()
	topics := func(c *config.Config) {
		c.Topics = append(c.Topics, config.TopicRule{Match: "telemetry/+", Ack: "async"})
	}
	master = clusterGateway(t, prefix+"-1", topics)
	slave = clusterGateway(t, prefix+"-2", topics)
	joinWith(t, slave, inviteToken(t, master))
	testutil.WaitFor(t, 10*time.Second, prefix+"-2 a caught-up learner", func() bool {
		v, l, ok := shape(statusOfGW(t, master))
		return v == 0 && l == 1 && ok && statusOfGW(t, slave).Role == "slave"
	})
	return master, slave
}

func TestStatusPageInChromium(t *testing.T) {
	chromium(t) // skips before the cluster is built, when there is none
	g1, g2 := twoGateways(t, "gw-page")
	pub, _ := v5(t, g1.MQTTAddr(), "page-pub", nil)
	publish(t, pub, &paho.Publish{Topic: "telemetry/t1", QoS: 1, Payload: []byte("21.5")})

	// Served as HTML with no outside reference: the page works offline.
	resp, err := http.Get("http://" + g1.HTTPAddr() + "/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/html") {
		t.Fatalf("GET /: %s %s", resp.Status, resp.Header.Get("Content-Type"))
	}
	if regexp.MustCompile(`(src|href|url)[=(]"?https?:`).Match(body) {
		t.Fatalf("the page loads something from elsewhere:\n%s", body)
	}
	if r, err := http.Get("http://" + g1.HTTPAddr() + "/nothing-here"); err != nil || r.StatusCode != http.StatusNotFound {
		t.Fatalf("GET /nothing-here: %v %v, want 404 (the page is / only)", r, err)
	}

	// Each gateway's page shows both, with their roles.
	want := []renderedNode{{"gw-page-1", "master"}, {"gw-page-2", "slave"}}
	dir := t.TempDir()
	if keep := os.Getenv("TANDEM_PAGE_SHOTS"); keep != "" {
		dir = keep // to look at them after the test
	}
	for i, g := range []*Daemon{g1, g2} {
		shot := filepath.Join(dir, fmt.Sprintf("status-page-gw-%d.png", i+1))
		nodes, dom := loadPage(t, "http://"+g.HTTPAddr()+"/", shot)
		t.Logf("screenshot of gw-page-%d: %s", i+1, shot)
		slices.SortFunc(nodes, func(a, b renderedNode) int { return strings.Compare(a.Name, b.Name) })
		if !slices.Equal(nodes, want) {
			t.Errorf("gw-page-%d's page shows %+v, want %+v", i+1, nodes, want)
		}
		for _, s := range []string{"s/#", "telemetry/+", "everything else"} {
			if !strings.Contains(dom, s) {
				t.Errorf("gw-page-%d's page lacks %q", i+1, s)
			}
		}
		// The master knows its slave is a learner (the 2-gateway shape).
		if g == g1 && !strings.Contains(dom, "learner") {
			t.Errorf("the master's page does not say gw-page-2 is a learner")
		}
		if t.Failed() {
			t.Fatalf("DOM of gw-page-%d:\n%s", i+1, dom)
		}
	}
}

func TestMetricsOfATwoGatewayCluster(t *testing.T) {
	g1, g2 := twoGateways(t, "gw-m")
	pub, _ := v5(t, g1.MQTTAddr(), "m-pub", nil)
	if r := publish(t, pub, &paho.Publish{Topic: "s/1", QoS: 1, Payload: []byte("x")}); r.ReasonCode != 0 {
		t.Fatalf("sync publish with a slave: reason %#x", r.ReasonCode)
	}
	requireWired(t, g1)
	m := scrape(t, g1)
	s := scrape(t, g2)
	id2 := replication.IDString(g2.id.ID)
	for _, c := range []struct {
		what   string
		mfs    map[string]*dto.MetricFamily
		name   string
		labels []string
		want   float64
	}{
		{"master", m, "tandem_raft_role", []string{"role", "master"}, 1},
		{"master", m, "tandem_cluster_members", nil, 2},
		{"master", m, "tandem_peer_voter", []string{"peer", "gw-m-2", "peer_id", id2}, 0},
		{"master", m, "tandem_peer_reachable", []string{"peer", "gw-m-2"}, 1},
		{"master", m, "tandem_mqtt_acks_sent_total", []string{"ack", "sync", "outcome", "ok"}, 1},
		{"slave", s, "tandem_raft_role", []string{"role", "slave"}, 1},
		{"slave", s, "tandem_raft_role", []string{"role", "master"}, 0},
		{"slave", s, "tandem_cluster_members", nil, 2},
	} {
		if got := value(c.mfs, c.name, c.labels...); got != c.want {
			t.Errorf("%s: %s%v = %v, want %v", c.what, c.name, c.labels, got, c.want)
		}
	}
	// Lag per peer is there (its value depends on timing), in both units.
	for _, name := range []string{"tandem_replication_lag_records", "tandem_replication_lag_seconds", "tandem_replication_match_index"} {
		if v := value(m, name, "peer", "gw-m-2"); v < 0 {
			t.Errorf("master: no %s for gw-m-2", name)
		}
	}
	if lat := metric(m, "tandem_mqtt_ack_latency_seconds", "ack", "sync"); lat == nil || lat.Histogram.GetSampleCount() != 1 {
		t.Errorf("sync ack latency on the master: %v, want one sample", lat)
	}
	if v := value(m, "tandem_raft_term"); v != value(s, "tandem_raft_term") || v < 1 {
		t.Errorf("terms: master %v, slave %v", v, value(s, "tandem_raft_term"))
	}
}

func TestStatusCommand(t *testing.T) {
	d := testGateway(t, t.TempDir(), func(c *config.Config) { c.Node.Name = "gw-cli" })
	pub, _ := v5(t, d.MQTTAddr(), "cli-pub", nil)
	publish(t, pub, &paho.Publish{Topic: "a/b", QoS: 1, Payload: []byte("x")})

	code, out, errOut := runMain(t, "status", "--http", d.HTTPAddr())
	if code != ExitOK {
		t.Fatalf("tandem status: exit %d: %s", code, errOut)
	}
	for _, want := range []string{"gw-cli", "master, term", "clients", "1 connected", "members: none", "last "} {
		if !strings.Contains(out, want) {
			t.Errorf("tandem status lacks %q:\n%s", want, out)
		}
	}

	code, out, errOut = runMain(t, "status", "--http", d.HTTPAddr(), "--json")
	var s admin.Status
	if code != ExitOK || json.Unmarshal([]byte(out), &s) != nil || s.Node.Name != "gw-cli" || s.Role != "master" {
		t.Fatalf("tandem status --json: exit %d, %q, %s", code, out, errOut)
	}

	// --config takes http.listen from the file; a wildcard host is dialled
	// on loopback.
	cfgFile := filepath.Join(t.TempDir(), "tandem.yaml")
	port := d.HTTPAddr()[strings.LastIndex(d.HTTPAddr(), ":"):]
	if err := os.WriteFile(cfgFile, []byte("http:\n  listen: \"0.0.0.0"+port+"\"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if code, out, errOut := runMain(t, "status", "--config", cfgFile); code != ExitOK || !strings.Contains(out, "gw-cli") {
		t.Fatalf("tandem status --config: exit %d: %s%s", code, out, errOut)
	}

	// Nobody listening: a clear message, exit 1.
	code, _, errOut = runMain(t, "status", "--http", testutil.FreeAddr(t))
	if code != ExitFailure || !strings.Contains(errOut, "no tandem daemon answers at") {
		t.Fatalf("tandem status without a daemon: exit %d: %s", code, errOut)
	}
	if code, _, _ := runMain(t, "status", "--http", "nonsense"); code != ExitUsage {
		t.Fatalf("tandem status --http nonsense: exit %d, want %d", code, ExitUsage)
	}
}
