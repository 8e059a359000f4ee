package e2e

import (
	"context"
	"fmt"
	"maps"
	"sync"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
)

// publishRetained publishes a retained QoS 1 message through g.
func publishRetained(t *testing.T, g *gw, topic, payload string) {
	t.Helper()
	c, err := device(t, g, fmt.Sprintf("ret-pub-%d", time.Now().UnixNano()), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Disconnect(&paho.Disconnect{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r, err := c.Publish(ctx, &paho.Publish{Topic: topic, QoS: 1, Retain: true, Payload: []byte(payload)})
	if err != nil || r.ReasonCode != 0 {
		t.Fatalf("retained publish %s on %s: %v %+v", topic, g.name, err, r)
	}
}

// retainedSet reads g's retained messages (topic → payload) by
// subscribing to "ret/#": a SUBSCRIBE brings them in the order of the
// records that set them, so the set is whole once sentinel, set last, has
// come among them.
func retainedSet(t *testing.T, g *gw, sentinel string) map[string]string {
	t.Helper()
	var mu sync.Mutex
	got := map[string]string{}
	done := make(chan struct{})
	var once sync.Once
	c, err := device(t, g, fmt.Sprintf("ret-read-%d", time.Now().UnixNano()), func(p *paho.Publish) {
		if !p.Retain {
			return
		}
		mu.Lock()
		got[p.Topic] = string(p.Payload)
		mu.Unlock()
		if p.Topic == sentinel {
			once.Do(func() { close(done) })
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Disconnect(&paho.Disconnect{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// Without Retain As Published only the retained messages a SUBSCRIBE
	// brings carry the retain flag [MQTT-3.3.1-12]: the sentinel, acked
	// before it is applied, may also come live, ahead of the rest. Until
	// it is applied a SUBSCRIBE does not bring it: subscribe again then.
	for {
		if _, err := c.Subscribe(ctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: "ret/#", QoS: 1}}}); err != nil {
			t.Fatal(err)
		}
		select {
		case <-done:
		case <-time.After(time.Second):
			continue
		case <-ctx.Done():
			mu.Lock()
			defer mu.Unlock()
			t.Fatalf("%s: the retained sentinel %s never came; had %v", g.name, sentinel, got)
		}
		break
	}
	mu.Lock()
	defer mu.Unlock()
	return maps.Clone(got)
}

// sameRetained sets a sentinel through via and checks that every gateway
// holds want and the sentinel, and nothing else under ret/.
func sameRetained(t *testing.T, via *gw, want map[string]string, gws ...*gw) {
	t.Helper()
	sentinel := fmt.Sprintf("ret/zz-sentinel-%d", time.Now().UnixNano())
	publishRetained(t, via, sentinel, "end")
	want = maps.Clone(want)
	want[sentinel] = "end"
	for _, g := range gws {
		got := retainedSet(t, g, sentinel)
		if !maps.Equal(got, want) {
			t.Errorf("%s retains %v, want %v", g.name, got, want)
		}
	}
}
