package mqtt

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
)

// collectUntil reads ch until a publish with payload last arrives and
// returns the payloads in arrival order.
func collectUntil(t *testing.T, ch chan *paho.Publish, last string) []string {
	t.Helper()
	var got []string
	deadline := time.After(10 * time.Second)
	for {
		select {
		case p := <-ch:
			got = append(got, string(p.Payload))
			if string(p.Payload) == last {
				return got
			}
		case <-deadline:
			t.Fatalf("no %q; got %q", last, got)
		}
	}
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
