package daemon

import (
	"bytes"
	"context"
	"fmt"
	"maps"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/testutil"
	"github.com/tandem-edge/tandem/storage"
)

// publishMany publishes from clients connections at once, each of them
// each QoS 1 messages that msg makes (client c's i-th), and fails the test
// on the first publish that fails.
func publishMany(t *testing.T, d *Daemon, clients, each int, msg func(c, i int) (topic string, payload []byte)) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	for c := range clients {
		pub, _ := v5(t, d.MQTTAddr(), fmt.Sprintf("pub%d", c), nil)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				topic, payload := msg(c, i)
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				_, err := pub.Publish(ctx, &paho.Publish{Topic: topic, QoS: 1, Payload: payload})
				cancel()
				if err != nil {
					errs <- fmt.Errorf("client %d publish %d: %w", c, i, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

// flood publishes about n bytes of 1 KiB records on bulk/ from a few
// clients.
func flood(t *testing.T, d *Daemon, n int) {
	t.Helper()
	const clients, size = 4, 1 << 10
	payload := []byte(strings.Repeat("x", size))
	publishMany(t, d, clients, n/size/clients, func(c, _ int) (string, []byte) { return fmt.Sprintf("bulk/%d", c), payload })
}

// retainedOf subscribes to ret/# on d and returns the retained messages it
// is sent, topic → payload, once want of them came.
func retainedOf(t *testing.T, d *Daemon, id string, want int) map[string]string {
	t.Helper()
	c, got := v5(t, d.MQTTAddr(), id, nil)
	defer c.Disconnect(&paho.Disconnect{})
	subscribe(t, c, "ret/#", 1)
	out := map[string]string{}
	for len(out) < want {
		p := receive(t, got, 5*time.Second)
		if !p.Retain {
			t.Fatalf("%s: a message that is not retained on %s", id, p.Topic)
		}
		out[p.Topic] = string(p.Payload)
	}
	return out
}

// sessionKeys is client id's persistent session as d's data file holds it:
// its record, cursor and subscriptions.
func sessionKeys(t *testing.T, d *Daemon, id string) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, p := range []string{"S\x00" + id, "K\x00" + id, "B\x00" + id + "\x00"} {
		err := d.db.ForEach(storage.BucketSessions, p, func(k, v []byte) error {
			if p[0] != 'B' && string(k) != p {
				return nil // another id with this one as its prefix
			}
			out[string(k)] = string(v)
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// A gateway that joins a cluster whose log was compacted (first index far
// past the retained messages and the persistent session's records) installs
// the master's snapshot: it holds the same retained set and the same
// persistent session (subscriptions, cursor), pulls the records before the
// snapshot that the session still lacks, serves them to devices, and keeps
// them across a restart.
func TestJoinerToACompactedLogHoldsTheMastersState(t *testing.T) {
	// The broker state (below: 4.2 MiB of retained messages, 5.7 MiB as
	// mqtt.max_retained_bytes counts them) is in the data dir too, and so
	// within the budget: the log gets the rest.
	const budget = 16 << 20
	withBudget := func(c *config.Config) {
		c.Storage.MaxBytes = budget
		c.MQTT.MaxRetainedBytes = budget / 2
	}
	g1 := clusterGateway(t, "gw-1", withBudget)

	const expiry = uint32(3600)
	keeper, _, _ := resume(t, g1.MQTTAddr(), "keeper", expiry)
	subscribe(t, keeper, "persist/#", 1)
	subscribe(t, keeper, "other/+", 0)
	keeper.Disconnect(&paho.Disconnect{})
	pub, _ := v5(t, g1.MQTTAddr(), "retainer", nil)
	const nRetained = 20
	for i := range nRetained {
		publish(t, pub, &paho.Publish{Topic: fmt.Sprintf("ret/%d", i), QoS: 1, Retain: true, Payload: fmt.Appendf(nil, "value-%d", i)})
	}
	publish(t, pub, &paho.Publish{Topic: "ret/3", QoS: 1, Retain: true, Payload: []byte("value-3-again")})
	publish(t, pub, &paho.Publish{Topic: "ret/4", QoS: 1, Retain: true}) // clears ret/4
	// Enough retained bytes that the snapshot does not ride in a raft
	// message: the joiner pulls it from the master in chunks.
	const nBig, bigSize = 72, 60 << 10
	for i := range nBig {
		publish(t, pub, &paho.Publish{Topic: fmt.Sprintf("big/%d", i), QoS: 1, Retain: true, Payload: bytes.Repeat([]byte{byte(i)}, bigSize)})
	}
	stateEnd := statusOfGW(t, g1).Log.LastIndex
	flood(t, g1, 3*budget)
	testutil.WaitFor(t, 20*time.Second, "the master to drop the records that built its state", func() bool {
		return statusOfGW(t, g1).Log.FirstIndex > stateEnd
	})
	// Past the compaction point, before the join: the joiner's snapshot
	// is after it, and it pulls it from the master for keeper.
	publish(t, pub, &paho.Publish{Topic: "persist/pending", QoS: 1, Payload: []byte("pending")})
	wantRetained := retainedOf(t, g1, "look1", nRetained-1)
	if wantRetained["ret/3"] != "value-3-again" || wantRetained["ret/4"] != "" {
		t.Fatalf("the master's retained set: %q", wantRetained)
	}
	wantSession := sessionKeys(t, g1, "keeper")
	if len(wantSession) != 4 {
		t.Fatalf("the master's session of keeper: %q", wantSession)
	}

	dir2 := t.TempDir()
	cfg2 := func(c *config.Config) { clusterTestConfig(c, "gw-2"); withBudget(c) }
	var logs testutil.Buffer
	g2 := startGatewayIn(t, dir2, cfg2, &logs)
	joinWith(t, g2, inviteToken(t, g1))
	testutil.WaitFor(t, 20*time.Second, "gw-2 a caught-up learner", func() bool {
		_, l, ok := shape(statusOfGW(t, g1))
		return l == 1 && ok
	})
	if f := statusOfGW(t, g2).Log.FirstIndex; f <= stateEnd {
		t.Fatalf("gw-2's log starts at %d: it replayed the records, no snapshot was installed", f)
	}
	check := func(g *Daemon, look string) {
		t.Helper()
		if got := retainedOf(t, g, look, nRetained-1); !maps.Equal(got, wantRetained) {
			t.Errorf("%s's retained set %q, the master's %q", g.cfg.Node.Name, got, wantRetained)
		}
		if got := sessionKeys(t, g, "keeper"); !maps.Equal(got, wantSession) {
			t.Errorf("%s's session of keeper %q, the master's %q", g.cfg.Node.Name, got, wantSession)
		}
		if got, want := g.broker.Retained(), g1.broker.Retained(); got != want || want != nRetained-1+nBig {
			t.Errorf("%s holds %d retained messages, the master %d, want %d", g.cfg.Node.Name, got, want, nRetained-1+nBig)
		}
	}
	pullFrom := time.Now()
	testutil.WaitFor(t, 20*time.Second, "gw-2 to pull the records before its snapshot", func() bool { return !statusOfGW(t, g2).Log.CatchingUp })
	t.Logf("gw-2 pulled the records before its snapshot in %v (gw-1's log: %d records, data dir %d bytes)", time.Since(pullFrom).Round(time.Millisecond),
		statusOfGW(t, g1).Log.LastIndex-statusOfGW(t, g1).Log.FirstIndex, g1.db.RetentionStats().UsedBytes)
	if !strings.Contains(logs.String(), "installed its snapshot") || !strings.Contains(logs.String(), "took in the cluster's sessions") ||
		!strings.Contains(logs.String(), "pulling the master's snapshot") {
		t.Errorf("gw-2's log says nothing of a snapshot:\n%s", logs.String())
	}
	check(g2, "look2")

	// A restart keeps it.
	if err := g2.Stop(); err != nil {
		t.Fatal(err)
	}
	g2 = testGateway(t, dir2, cfg2)
	check(g2, "look3")
	// The device finds its session on the new member, and gets what is
	// published from then on.
	c, got, ca := resume(t, g2.MQTTAddr(), "keeper", expiry)
	defer c.Disconnect(&paho.Disconnect{})
	if !ca.SessionPresent {
		t.Fatal("keeper on gw-2: session not present")
	}
	publish(t, pub, &paho.Publish{Topic: "persist/after", QoS: 1, Payload: []byte("fresh")})
	for _, want := range []string{"pending", "fresh"} {
		if p := receive(t, got, 5*time.Second); string(p.Payload) != want {
			t.Fatalf("keeper on gw-2 got %s %q, want %q", p.Topic, p.Payload, want)
		}
	}
	assertAnswersAndStops(t, g2)
	assertAnswersAndStops(t, g1)
}
