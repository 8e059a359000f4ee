package daemon

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"runtime/pprof"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/admin"
	"github.com/tandem-edge/tandem/cluster"
	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// clusterGateway starts an in-process gateway named name, with the topics
// under s/ acked sync and fast raft timing.
func clusterGateway(t *testing.T, name string, mutate func(*config.Config)) *Daemon {
	t.Helper()
	return testGateway(t, t.TempDir(), func(c *config.Config) {
		clusterTestConfig(c, name)
		if mutate != nil {
			mutate(c)
		}
	})
}

// clusterTestConfig names a test gateway, makes s/# sync and raft fast.
func clusterTestConfig(c *config.Config, name string) {
	c.Node.Name = name
	c.Topics = []config.TopicRule{{Match: "s/#", Ack: "sync"}}
	c.Cluster.Heartbeat = config.Duration(50 * time.Millisecond)
	c.Cluster.ElectionTimeout = config.Duration(500 * time.Millisecond)
	c.Cluster.SyncTimeout = config.Duration(3 * time.Second)
}

// api POSTs req to a gateway's cluster API as the CLI does (JSON, the
// data dir's token); it returns the status and decodes a 200 answer into
// out, else returns the error text.
func api(t *testing.T, d *Daemon, path string, req, out any) (int, string) {
	t.Helper()
	b, _ := json.Marshal(req)
	hr, err := http.NewRequest(http.MethodPost, "http://"+d.HTTPAddr()+path, bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	hr.Header.Set("Content-Type", "application/json")
	hr.Header.Set("Authorization", "Bearer "+apiToken(t, d))
	resp, err := http.DefaultClient.Do(hr)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		var ae admin.ErrorResponse
		_ = json.NewDecoder(resp.Body).Decode(&ae)
		return resp.StatusCode, ae.Error
	}
	if out != nil {
		if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
			t.Fatal(err)
		}
	}
	return resp.StatusCode, ""
}

// apiToken is the API token d wrote into its data dir.
func apiToken(t *testing.T, d *Daemon) string {
	t.Helper()
	tok, err := admin.ReadToken(admin.TokenFile(d.cfg))
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

func inviteToken(t *testing.T, d *Daemon) string {
	t.Helper()
	// The test gateways share loopback: --loopback.
	code, out, errOut := runMain(t, "cluster", "invite", "--loopback", "--http", d.HTTPAddr(), "--data", d.cfg.Node.DataDir)
	if code != 0 {
		t.Fatalf("cluster invite: exit %d: %s", code, errOut)
	}
	tok, _, _ := strings.Cut(out, "\n")
	return tok
}

func joinWith(t *testing.T, d *Daemon, token string, extra ...string) {
	t.Helper()
	args := append([]string{"cluster", "join", token, "--http", d.HTTPAddr(), "--data", d.cfg.Node.DataDir}, extra...)
	if code, out, errOut := runMain(t, args...); code != 0 {
		t.Fatalf("cluster join: exit %d: %s%s", code, out, errOut)
	}
}

func statusOfGW(t *testing.T, d *Daemon) *admin.Status {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	s, err := d.status(ctx)
	if err != nil {
		// A gateway that does not answer is hung: the goroutines say where.
		var b strings.Builder
		_ = pprof.Lookup("goroutine").WriteTo(&b, 2)
		t.Logf("%s did not answer its status: goroutines:\n%s", d.cfg.Node.Name, b.String())
		t.Fatal(err)
	}
	return s
}

// shape reports a master's view: how many members besides itself are
// voters and learners, and whether all have caught up.
func shape(s *admin.Status) (voters, learners int, caughtUp bool) {
	caughtUp = s.Role == "master"
	for _, m := range s.Members {
		if m.Voter {
			voters++
		} else {
			learners++
		}
		if m.MatchIndex < s.Log.LastIndex-2 {
			caughtUp = false
		}
	}
	return voters, learners, caughtUp
}

func TestClusterInviteJoinReplicateAndShrink(t *testing.T) {
	g1 := clusterGateway(t, "gw-1", nil)
	g2 := clusterGateway(t, "gw-2", nil)
	g3 := clusterGateway(t, "gw-3", nil)

	// A lone gateway has no slave: sync is refused, async works.
	pub1, got1 := v5(t, g1.MQTTAddr(), "pub1", nil)
	subscribe(t, pub1, "#", 1)
	if r := publish(t, pub1, &paho.Publish{Topic: "a/before", QoS: 1, Payload: []byte("0")}); r.ReasonCode != 0 {
		t.Fatalf("async on a lone gateway: reason %#x", r.ReasonCode)
	}
	receive(t, got1, 5*time.Second)

	// 1 → 2: the slave is a learner; it replays the history quietly.
	joinWith(t, g2, inviteToken(t, g1))
	testutil.WaitFor(t, 10*time.Second, "gw-2 a caught-up learner", func() bool {
		v, l, ok := shape(statusOfGW(t, g1))
		return v == 0 && l == 1 && ok
	})
	s2 := statusOfGW(t, g2)
	if s2.Role != "slave" || s2.Leader == nil || s2.Leader.Name != "gw-1" || s2.Cluster.ID != statusOfGW(t, g1).Cluster.ID {
		t.Fatalf("gw-2 status: role %s leader %+v cluster %s", s2.Role, s2.Leader, s2.Cluster.ID)
	}

	// A device on the slave publishes (sync and async) and subscribes.
	dev2, got2 := v5(t, g2.MQTTAddr(), "dev2", nil)
	subscribe(t, dev2, "#", 1)
	for _, topic := range []string{"s/on-slave", "a/on-slave"} {
		if r := publish(t, dev2, &paho.Publish{Topic: topic, QoS: 1, Payload: []byte(topic)}); r.ReasonCode != 0 {
			t.Fatalf("%s published on the slave: reason %#x", topic, r.ReasonCode)
		}
	}
	if r := publish(t, pub1, &paho.Publish{Topic: "s/on-master", QoS: 1, Payload: []byte("m")}); r.ReasonCode != 0 {
		t.Fatalf("sync on the master with a slave: reason %#x", r.ReasonCode)
	}
	want := map[string]bool{"s/on-slave": true, "a/on-slave": true, "s/on-master": true}
	for _, ch := range []chan *paho.Publish{got1, got2} {
		seen := map[string]bool{}
		for len(seen) < len(want) {
			p := receive(t, ch, 5*time.Second)
			if p.Topic == "a/before" {
				t.Fatal("the slave's subscriber got a record from before it joined")
			}
			seen[p.Topic] = true
		}
	}
	for _, g := range []*Daemon{g1, g2} {
		topics := map[string]int{}
		for _, r := range logRecords(t, g) {
			topics[r.Topic]++
		}
		for tp := range want {
			if topics[tp] != 1 {
				t.Fatalf("%s's log holds %s %d times, want once: %v", g.cfg.Node.Name, tp, topics[tp], topics)
			}
		}
	}

	// 2 → 3: the third joins as a learner, then all three are voters.
	joinWith(t, g3, inviteToken(t, g2)) // a slave passes the invite to the master
	testutil.WaitFor(t, 15*time.Second, "three voters", func() bool {
		v, l, ok := shape(statusOfGW(t, g1))
		return v == 2 && l == 0 && ok
	})
	// A fourth is refused.
	if code, msg := api(t, g1, "/v1/cluster/invite", admin.InviteRequest{}, nil); code != http.StatusConflict || !strings.Contains(msg, "at most") && !strings.Contains(msg, "most tandem runs") {
		t.Fatalf("invite in a full cluster: %d %q", code, msg)
	}

	// 3 → 2, asked on a slave: the removed node goes, the remaining
	// slave is demoted to learner, and the removed one runs alone.
	var rr admin.RemoveResponse
	if code, msg := api(t, g2, "/v1/cluster/remove", admin.RemoveRequest{Node: "gw-3"}, &rr); code != 200 || rr.Removed != "gw-3" {
		t.Fatalf("remove gw-3: %d %q", code, msg)
	}
	testutil.WaitFor(t, 10*time.Second, "voter + learner", func() bool {
		s := statusOfGW(t, g1)
		v, l, _ := shape(s)
		return v == 0 && l == 1 && len(s.Members) == 1
	})
	testutil.WaitFor(t, 10*time.Second, "gw-3 alone", func() bool {
		s := statusOfGW(t, g3)
		return s.Role == "master" && len(s.Members) == 0 && s.Cluster.ID != statusOfGW(t, g1).Cluster.ID
	})
	if r := publish(t, pub1, &paho.Publish{Topic: "s/after-shrink", QoS: 1, Payload: []byte("x")}); r.ReasonCode != 0 {
		t.Fatalf("sync after 3 → 2: reason %#x", r.ReasonCode)
	}

	// Removing the slave would leave sync topics unackable: refused
	// without --force; the master cannot remove itself.
	if code, msg := api(t, g1, "/v1/cluster/remove", admin.RemoveRequest{Node: "gw-2"}, nil); code != http.StatusConflict || !strings.Contains(msg, "min_sync_replicas") {
		t.Fatalf("remove the only slave: %d %q", code, msg)
	}
	if code, msg := api(t, g1, "/v1/cluster/remove", admin.RemoveRequest{Node: "gw-1"}, nil); code != http.StatusConflict || !strings.Contains(msg, "master") {
		t.Fatalf("remove the master: %d %q", code, msg)
	}
	if code, msg := api(t, g1, "/v1/cluster/remove", admin.RemoveRequest{Node: "gw-9"}, nil); code != http.StatusConflict || !strings.Contains(msg, "not a member") {
		t.Fatalf("remove a stranger: %d %q", code, msg)
	}
	if v, l, _ := shape(statusOfGW(t, g1)); v != 0 || l != 1 {
		t.Fatalf("membership changed by refused removals: %d voters %d learners", v, l)
	}
}

func TestClusterJoinRefusals(t *testing.T) {
	g1 := clusterGateway(t, "gw-1", nil)
	g2 := clusterGateway(t, "gw-2", nil)
	other := clusterGateway(t, "other", nil)

	tok := inviteToken(t, g1)
	// Garbled and expired tokens: usage errors, nothing asked of anyone.
	for _, bad := range []string{"hello", tok[:len(tok)-9], expiredToken(t, tok)} {
		code, _, errOut := runMain(t, "cluster", "join", bad, "--http", g2.HTTPAddr(), "--data", g2.cfg.Node.DataDir)
		if code != ExitUsage || !strings.Contains(errOut, "token") {
			t.Fatalf("join with a bad token: exit %d: %s", code, errOut)
		}
	}
	// A node holding records must say what becomes of them.
	dev, _ := v5(t, g2.MQTTAddr(), "dev", nil)
	publish(t, dev, &paho.Publish{Topic: "a/x", QoS: 1, Payload: []byte("kept")})
	code, _, errOut := runMain(t, "cluster", "join", tok, "--http", g2.HTTPAddr(), "--data", g2.cfg.Node.DataDir)
	if code != ExitUsage || !strings.Contains(errOut, "--requeue") {
		t.Fatalf("join of a node with records: exit %d: %s", code, errOut)
	}
	// --requeue: its record is published into the cluster.
	joinWith(t, g2, tok, "--requeue")
	testutil.WaitFor(t, 10*time.Second, "the requeued record on the master", func() bool {
		for _, r := range logRecords(t, g1) {
			if r.Topic == "a/x" && string(r.Payload) == "kept" && r.Republished {
				return true
			}
		}
		return false
	})
	// The token was used: a second node cannot use it again.
	code, _, errOut = runMain(t, "cluster", "join", tok, "--http", other.HTTPAddr(), "--data", other.cfg.Node.DataDir)
	if code != ExitFailure || !strings.Contains(errOut, "already used") {
		t.Fatalf("replayed token: exit %d: %s", code, errOut)
	}
	// A member of one cluster cannot join another.
	code, _, errOut = runMain(t, "cluster", "join", inviteToken(t, other), "--http", g2.HTTPAddr(), "--data", g2.cfg.Node.DataDir)
	if code != ExitFailure || !strings.Contains(errOut, "another cluster") {
		t.Fatalf("join from another cluster: exit %d: %s", code, errOut)
	}
	if s := statusOfGW(t, other); len(s.Members) != 0 {
		t.Fatalf("the other cluster changed: %+v", s.Members)
	}
	if s := statusOfGW(t, g1); len(s.Members) != 1 {
		t.Fatalf("the cluster changed: %+v", s.Members)
	}
	// Removing the last voter of a lone gateway is refused.
	if code, msg := api(t, other, "/v1/cluster/remove", admin.RemoveRequest{Node: "other"}, nil); code == 200 || !strings.Contains(msg, "last voter") {
		t.Fatalf("remove the last voter: %d %q", code, msg)
	}
}

// expiredToken rewrites tok's expiry into the past.
func expiredToken(t *testing.T, tok string) string {
	t.Helper()
	jt, _, err := cluster.ParseToken(tok, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	jt.Expires = time.Now().Add(-time.Minute).Unix()
	return jt.Encode()
}

func TestTopicRuleMismatchShownInStatus(t *testing.T) {
	g1 := clusterGateway(t, "gw-1", nil)
	g2 := clusterGateway(t, "gw-2", func(c *config.Config) { c.Topics = []config.TopicRule{{Match: "other/#", Ack: "sync"}} })
	joinWith(t, g2, inviteToken(t, g1))
	for _, g := range []*Daemon{g1, g2} {
		testutil.WaitFor(t, 15*time.Second, g.cfg.Node.Name+" seeing the other's rules differ", func() bool {
			s := statusOfGW(t, g)
			return len(s.Members) == 1 && s.Members[0].TopicsMatch != nil && !*s.Members[0].TopicsMatch
		})
	}
	g3 := clusterGateway(t, "gw-3", nil)
	joinWith(t, g3, inviteToken(t, g1))
	testutil.WaitFor(t, 15*time.Second, "gw-1 seeing gw-3's rules match", func() bool {
		for _, m := range statusOfGW(t, g1).Members {
			if m.Name == "gw-3" {
				return m.TopicsMatch != nil && *m.TopicsMatch
			}
		}
		return false
	})
}
