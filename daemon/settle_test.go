package daemon

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/internal/cloudtest"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// drainUntil reads ch until a publish with payload last arrives and
// returns the payloads in arrival order; it fails on a timeout.
func drainUntil(t *testing.T, ch chan *paho.Publish, last string, within time.Duration) []string {
	t.Helper()
	return testutil.CollectUntil(t, ch, func(p *paho.Publish) string { return string(p.Payload) }, last, within)
}

// offlineSession makes a persistent session subscribed to filter and
// leaves it offline.
func offlineSession(t *testing.T, addr, id, filter string) {
	t.Helper()
	c, _, _ := resume(t, addr, id, 3600)
	subscribe(t, c, filter, 1)
	if err := c.Disconnect(&paho.Disconnect{}); err != nil {
		t.Fatal(err)
	}
}

// syncRecordLogged fails unless the log holds a record on topic: a refused
// sync publish is committed, so only the hold keeps it from subscribers.
func syncRecordLogged(t *testing.T, d *Daemon, topic string) {
	t.Helper()
	for _, r := range logRecords(t, d) {
		if r.Topic == topic && r.Sync {
			return
		}
	}
	t.Fatalf("no sync record on %s in the log", topic)
}

// TestSyncRefusalOnLoneGatewayNeverDelivered: a lone gateway commits a
// sync record at once but can never meet its rule; after sync_timeout the
// publisher gets 0x80 and no session ever gets the record: not a live
// one, not a persistent one replaying from its cursor, before or after a
// restart, and it is not retained. Async topics flow meanwhile.
func TestSyncRefusalOnLoneGatewayNeverDelivered(t *testing.T) {
	dir := t.TempDir()
	mutate := func(c *config.Config) {
		c.Cluster.SyncTimeout = config.Duration(1500 * time.Millisecond)
		c.Topics = []config.TopicRule{{Match: "s/#", Ack: "sync"}}
	}
	d := testGateway(t, dir, mutate)
	offlineSession(t, d.MQTTAddr(), "p-before", "#")
	offlineSession(t, d.MQTTAddr(), "p-after", "#")
	all, gotAll := v5(t, d.MQTTAddr(), "sub-all", nil)
	subscribe(t, all, "#", 1)
	asy, gotAsync := v5(t, d.MQTTAddr(), "sub-async", nil)
	subscribe(t, asy, "a/#", 1)
	syncPub, _ := v5(t, d.MQTTAddr(), "pub-sync", nil)
	asyncPub, _ := v5(t, d.MQTTAddr(), "pub-async", nil)

	res := make(chan *paho.PublishResponse, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		r, _ := syncPub.Publish(ctx, &paho.Publish{Topic: "s/1", QoS: 1, Retain: true, Payload: []byte("refused")})
		res <- r
	}()
	// The sync publish is pending: an async subscriber is not held up.
	publish(t, asyncPub, &paho.Publish{Topic: "a/1", QoS: 1, Payload: []byte("a1")})
	if p := receive(t, gotAsync, 5*time.Second); string(p.Payload) != "a1" {
		t.Fatalf("async subscriber got %q", p.Payload)
	}
	select {
	case r := <-res:
		t.Fatalf("the sync publish was answered (%+v) before the async one was delivered", r)
	default:
	}
	if r := <-res; r == nil || r.ReasonCode != 0x80 {
		t.Fatalf("sync publish on a lone gateway: %+v, want PUBACK 0x80", r)
	}
	syncRecordLogged(t, d, "s/1")
	publish(t, asyncPub, &paho.Publish{Topic: "a/2", QoS: 1, Payload: []byte("a2")})
	if got := drainUntil(t, gotAll, "a2", 5*time.Second); fmt.Sprint(got) != "[a1 a2]" {
		t.Fatalf("a subscriber to # got %q, want [a1 a2]: the refused record must not reach it", got)
	}
	if n := d.broker.Retained(); n != 0 {
		t.Fatalf("%d retained messages: the refused retained publish must not be one", n)
	}
	_, got, _ := resume(t, d.MQTTAddr(), "p-before", 3600)
	if got := drainUntil(t, got, "a2", 5*time.Second); fmt.Sprint(got) != "[a1 a2]" {
		t.Fatalf("a persistent session replaying from its cursor got %q, want [a1 a2]", got)
	}

	// After a restart the record is still aborted.
	d.Stop()
	d = testGateway(t, dir, mutate)
	_, got, _ = resume(t, d.MQTTAddr(), "p-after", 3600)
	if got := drainUntil(t, got, "a2", 5*time.Second); fmt.Sprint(got) != "[a1 a2]" {
		t.Fatalf("after a restart, a persistent session replaying from its cursor got %q, want [a1 a2]", got)
	}
	if n := d.broker.Retained(); n != 0 {
		t.Fatalf("%d retained messages after a restart", n)
	}
	assertAnswersAndStops(t, d)
}

// TestSyncRefusedWhileSlaveDownNeverDelivered: in a 2-gateway cluster the
// master alone commits, so with its slave down a sync record is committed
// and refused. Neither member ever delivers it, the slave once back
// included; the sync records acked once the slave is back are delivered
// exactly once, in order with the async ones around them, on both.
func TestSyncRefusedWhileSlaveDownNeverDelivered(t *testing.T) {
	fast := func(c *config.Config) { c.Cluster.SyncTimeout = config.Duration(time.Second) }
	master := clusterGateway(t, "gw-st-1", fast)
	slave := clusterGateway(t, "gw-st-2", fast)
	joinWith(t, slave, inviteToken(t, master))
	caughtUp := func() bool {
		v, l, ok := shape(statusOfGW(t, master))
		return v == 0 && l == 1 && ok && statusOfGW(t, slave).Role == "slave"
	}
	testutil.WaitFor(t, 10*time.Second, "a caught-up slave", caughtUp)
	offlineSession(t, slave.MQTTAddr(), "on-slave", "#")
	sub, got := v5(t, master.MQTTAddr(), "sub-master", nil)
	subscribe(t, sub, "#", 1)
	pub, _ := v5(t, master.MQTTAddr(), "pub", nil)

	dir, peer := slave.cfg.Node.DataDir, slave.PeerAddr()
	slave.Stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	refusedFrom := time.Now()
	if r, _ := pub.Publish(ctx, &paho.Publish{Topic: "s/1", QoS: 1, Payload: []byte("refused")}); r == nil || r.ReasonCode != 0x80 {
		t.Fatalf("sync publish with the slave down: %+v, want PUBACK 0x80", r)
	}
	t.Logf("refused after %v", time.Since(refusedFrom))
	syncRecordLogged(t, master, "s/1")
	slave = testGateway(t, dir, func(c *config.Config) {
		clusterTestConfig(c, "gw-st-2")
		fast(c)
		c.Peer.Listen = peer
	})
	testutil.WaitFor(t, 15*time.Second, "the slave back and caught up", caughtUp)

	var want []string
	for i := range 4 {
		for _, topic := range []string{"s/ok", "a/ok"} {
			p := fmt.Sprintf("%s-%d", topic, i)
			if r := publish(t, pub, &paho.Publish{Topic: topic, QoS: 1, Payload: []byte(p)}); r.ReasonCode != 0 {
				t.Fatalf("publish %s with the slave back: reason %#x", p, r.ReasonCode)
			}
			want = append(want, p)
		}
	}
	last := want[len(want)-1]
	if g := drainUntil(t, got, last, 10*time.Second); fmt.Sprint(g) != fmt.Sprint(want) {
		t.Fatalf("subscriber on the master got %q, want %q", g, want)
	}
	syncRecordLogged(t, slave, "s/1")
	_, onSlave, _ := resume(t, slave.MQTTAddr(), "on-slave", 3600)
	if g := drainUntil(t, onSlave, last, 10*time.Second); fmt.Sprint(g) != fmt.Sprint(want) {
		t.Fatalf("persistent session on the slave got %q, want %q", g, want)
	}
	// Nothing more comes: no copy of a confirmed record, not the refused one.
	publish(t, pub, &paho.Publish{Topic: "a/end", QoS: 1, Payload: []byte("end")})
	for _, ch := range []chan *paho.Publish{got, onSlave} {
		if g := drainUntil(t, ch, "end", 10*time.Second); len(g) != 1 {
			t.Fatalf("after the last record: %q, want only [end]", g)
		}
	}
	assertAnswersAndStops(t, slave)
	assertAnswersAndStops(t, master)
}

// TestUplinkNeverForwardsARefusedSyncRecord: an uplink follows the rule
// sessions follow: the refused record on a lone gateway never reaches the
// cloud, what came after it does, once, and the backlog drains to zero.
func TestUplinkNeverForwardsARefusedSyncRecord(t *testing.T) {
	cloud := cloudtest.Start(t, "127.0.0.1", 0, nil)
	rec := cloudtest.Record(t, dialTo(cloud.Addr()), "site/#")
	up := withUplink(cloud.URL(), nil)
	d := testGateway(t, t.TempDir(), func(c *config.Config) {
		up(c)
		c.Cluster.SyncTimeout = config.Duration(time.Second)
		c.Topics = []config.TopicRule{{Match: "dev/s/#", Ack: "sync"}}
	})
	testutil.WaitFor(t, 10*time.Second, "the uplink connected", func() bool { return uplinkStatus(t, d).Connected })
	pub, _ := v5(t, d.MQTTAddr(), "dev", nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if r, _ := pub.Publish(ctx, &paho.Publish{Topic: "dev/s/1", QoS: 1, Payload: []byte("refused")}); r == nil || r.ReasonCode != 0x80 {
		t.Fatalf("sync publish on a lone gateway: %+v, want 0x80", r)
	}
	syncRecordLogged(t, d, "dev/s/1")
	for _, p := range []string{"a-1", "a-2"} {
		publish(t, pub, &paho.Publish{Topic: "dev/a", QoS: 1, Payload: []byte(p)})
	}
	testutil.WaitFor(t, 10*time.Second, "the async records at the cloud", func() bool { n, _ := rec.Distinct(); return n >= 2 })
	var got []string
	for _, m := range rec.Msgs() {
		got = append(got, m.Payload)
	}
	if fmt.Sprint(got) != "[a-1 a-2]" {
		t.Fatalf("the cloud got %q, want [a-1 a-2]", got)
	}
	testutil.WaitFor(t, 5*time.Second, "an empty backlog", func() bool { return uplinkStatus(t, d).BacklogRecords == 0 })
	assertAnswersAndStops(t, d)
}
