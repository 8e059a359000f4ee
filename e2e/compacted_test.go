package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/internal/netns"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// smallBudget is the config section that gives a gateway the smallest log
// budget accepted.
const smallBudget = "storage:\n  max_bytes: 8MiB"

// firstIndex is the first index of g's log, 0 when it does not answer.
func firstIndex(g *gw) uint64 {
	resp, err := g.http.Get("http://127.0.0.1:7880/v1/status")
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	var s struct {
		Log struct {
			FirstIndex uint64 `json:"first_index"`
		} `json:"log"`
	}
	if json.NewDecoder(resp.Body).Decode(&s) != nil {
		return 0
	}
	return s.Log.FirstIndex
}

// floodBytes publishes about n bytes of 1 KiB async records through g.
func floodBytes(t *testing.T, g *gw, n int) {
	t.Helper()
	const clients, size = 4, 1 << 10
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	for i := range clients {
		c, err := device(t, g, fmt.Sprintf("flood-%d", i), nil)
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			payload := []byte(strings.Repeat("x", size))
			for j := 0; j < n/size/clients; j++ {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				r, err := c.Publish(ctx, &paho.Publish{Topic: fmt.Sprintf("bulk/%d", i), QoS: 1, Payload: payload})
				cancel()
				if err != nil || r.ReasonCode >= 0x80 {
					errs <- fmt.Errorf("flood %d publish %d: %v %+v", i, j, err, r)
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

// A third gateway joins a cluster whose log was compacted (the records
// that set the retained messages are gone from it): it installs the
// master's snapshot, holds the same retained set, becomes a voter while
// the master keeps acking sync publishes, and keeps that state across a
// restart.
func TestJoinOfAThirdGatewayToACompactedCluster(t *testing.T) {
	nt := netns.New(t, 3)
	g1, g2, g3 := newGW(t, nt.Hosts[0], "gw-1", smallBudget), newGW(t, nt.Hosts[1], "gw-2", smallBudget), newGW(t, nt.Hosts[2], "gw-3", smallBudget)
	g1.start()
	g2.start()
	g2.join(g1)
	waitShape(t, g1, 0, 1, 15*time.Second)

	want := map[string]string{}
	for i := range 10 {
		topic, payload := fmt.Sprintf("ret/%d", i), fmt.Sprintf("value-%d", i)
		publishRetained(t, g1, topic, payload)
		want[topic] = payload
	}
	stateEnd := g1.status().Log.LastIndex
	floodBytes(t, g1, 3*8<<20)
	testutil.WaitFor(t, 30*time.Second, "gw-1 to drop the records that set the retained messages", func() bool { return firstIndex(g1) > stateEnd })

	g3.start()
	load := startPacedLoad(t, 2, "s/join", func(int) []*gw { return []*gw{g1} }, 20*time.Millisecond)
	g3.join(g1)
	load.waitAcks(t, 10, 15*time.Second)
	acked := load.stop()
	if f := firstIndex(g3); f <= stateEnd {
		t.Fatalf("gw-3's log starts at %d, before the compaction point: it got the records, not a snapshot", f)
	}
	waitShape(t, g1, 2, 0, 30*time.Second)
	t.Logf("%d sync publishes acked while gw-3 joined", len(acked))
	sameRetained(t, g1, want, g1, g2, g3)

	g3.stop()
	g3.start()
	const sentinel = "ret/zz-after-restart"
	publishRetained(t, g1, sentinel, "end")
	if master, got := retainedSet(t, g1, sentinel), retainedSet(t, g3, sentinel); !maps.Equal(got, master) || got["ret/7"] != "value-7" {
		t.Errorf("gw-3 retains %v after a restart, gw-1 %v", got, master)
	}
	for _, g := range []*gw{g3, g2, g1} {
		if g.status() == nil {
			t.Errorf("%s does not answer", g.name)
		}
		g.stop()
	}
}
