package mqtt

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/internal/testutil"
)

// collectUntil reads ch until a publish with payload last arrives and
// returns the payloads in arrival order.
func collectUntil(t *testing.T, ch chan *paho.Publish, last string) []string {
	t.Helper()
	return testutil.CollectUntil(t, ch, func(p *paho.Publish) string { return string(p.Payload) }, last, 10*time.Second)
}

func subscribeOK(t *testing.T, c *paho.Client, filter string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := c.Subscribe(ctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: filter, QoS: 1}}}); err != nil {
		t.Fatal(err)
	}
}

func pubOK(t *testing.T, c *paho.Client, topic, payload string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := c.Publish(ctx, &paho.Publish{Topic: topic, QoS: 1, Payload: []byte(payload)}); err != nil {
		t.Fatalf("publish %s: %v", topic, err)
	}
}

// TestHeldSyncRecordDeliveredOnceInOrder: a sync record reaches no session
// until its settlement; a session whose filters it matches waits at it,
// then gets it and what came after, once each, in log order; one that takes
// only async topics is never held up; an aborted record reaches nobody.
func TestHeldSyncRecordDeliveredOnceInOrder(t *testing.T) {
	srv, log := testServer(t, nil, func(c *Config) { c.Topics = []TopicPolicy{{Filter: "s/#", Ack: Sync}} })
	all, gotAll := pahoClient(t, srv.Addr(), "all", nil)
	subscribeOK(t, all, "#")
	asy, gotAsync := pahoClient(t, srv.Addr(), "async", nil)
	subscribeOK(t, asy, "a/#")
	pub, _ := pahoClient(t, srv.Addr(), "pub", nil)

	pubOK(t, pub, "s/1", "s1")
	held := log.lastIndex()
	pubOK(t, pub, "a/1", "a1")
	if got := collectUntil(t, gotAsync, "a1"); len(got) != 1 {
		t.Fatalf("async subscriber: %q", got)
	}
	if n := len(gotAll); n != 0 {
		t.Fatalf("%d publishes reached a subscriber of the held record before its settlement", n)
	}
	log.settle(held)
	pubOK(t, pub, "a/2", "a2")
	if got := collectUntil(t, gotAll, "a2"); fmt.Sprint(got) != "[s1 a1 a2]" {
		t.Fatalf("after the settlement: %q, want [s1 a1 a2]", got)
	}

	pubOK(t, pub, "s/2", "aborted")
	log.settle(held, log.lastIndex())
	pubOK(t, pub, "a/3", "a3")
	if got := collectUntil(t, gotAll, "a3"); fmt.Sprint(got) != "[a3]" {
		t.Fatalf("after an abort: %q, want [a3]", got)
	}
}

// TestHeldRetainedMessage: a retained sync record replaces the topic's
// retained message only once confirmed, never when aborted, and not over a
// later record that set or cleared the topic meanwhile.
func TestHeldRetainedMessage(t *testing.T) {
	srv, log := testServer(t, nil, func(c *Config) { c.Topics = []TopicPolicy{{Filter: "s/#", Ack: Sync}} })
	pub, _ := pahoClient(t, srv.Addr(), "pub", nil)
	retainOK := func(topic, payload string) uint64 {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if _, err := pub.Publish(ctx, &paho.Publish{Topic: topic, QoS: 1, Retain: true, Payload: []byte(payload)}); err != nil {
			t.Fatal(err)
		}
		return log.lastIndex()
	}
	retainedIs := func(topic, want string) {
		t.Helper()
		testutil.WaitFor(t, 5*time.Second, topic+" retained as "+want, func() bool {
			srv.retained.mu.RLock()
			defer srv.retained.mu.RUnlock()
			r := srv.retained.m[topic]
			return (r == nil && want == "") || (r != nil && string(r.m.Payload) == want)
		})
	}
	first := retainOK("s/a", "v1")
	// A marker applied after it: the store is looked at once it is.
	markerApplied := func() {
		t.Helper()
		pubOK(t, pub, "m/x", "marker")
		last := log.lastIndex()
		testutil.WaitFor(t, 5*time.Second, "the marker applied", func() bool { return srv.applied.Load() >= last })
	}
	markerApplied()
	retainedIs("s/a", "")
	log.settle(first)
	retainedIs("s/a", "v1")

	aborted := retainOK("s/a", "v2")
	log.settle(first, aborted)
	markerApplied()
	retainedIs("s/a", "v1")

	// Held, then the topic cleared by an async retained publish (the
	// rules changed meanwhile) applied before the settlement.
	held := retainOK("s/a", "v3")
	srv.SetTopics(nil)
	retainOK("s/a", "")
	log.settle(held)
	markerApplied()
	retainedIs("s/a", "")
}

// TestAbortedIndexesForgottenPastRetention: the aborted set is kept with
// the sessions only while the log holds the records it names.
func TestAbortedIndexesForgottenPastRetention(t *testing.T) {
	srv, log := testServer(t, nil, func(c *Config) { c.Topics = []TopicPolicy{{Filter: "s/#", Ack: Sync}} })
	pub, _ := pahoClient(t, srv.Addr(), "pub", nil)
	pubOK(t, pub, "s/1", "refused")
	idx := log.lastIndex()
	log.settle(idx, idx)
	key := holdKey(keyAborted, idx)
	stored := func() bool {
		log.store.mu.Lock()
		defer log.store.mu.Unlock()
		_, ok := log.store.m[key]
		return ok
	}
	testutil.WaitFor(t, 5*time.Second, "the abort in the store", stored)
	log.mu.Lock()
	log.first = idx + 1 // retention dropped the record
	log.mu.Unlock()
	for range pruneEvery {
		log.settle(idx)
	}
	testutil.WaitFor(t, 5*time.Second, "the abort forgotten", func() bool { return !stored() })
}
