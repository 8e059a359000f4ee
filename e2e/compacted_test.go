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
// A refusal (0x97: the log full of what a member lacks) fails the test.
func floodBytes(t *testing.T, g *gw, n int) { floodUntil(t, g, n, 0) }

// floodUntil is floodBytes that takes refusals for up to refusing in all
// (a cut-off member holding the log until the master stops counting it),
// trying again after each.
func floodUntil(t *testing.T, g *gw, n int, refusing time.Duration) {
	t.Helper()
	const clients, size = 4, 1 << 10
	payload := []byte(strings.Repeat("x", size))
	publishAll(t, g, "flood", clients, refusing, func(i, k int) *paho.Publish {
		if k >= n/size/clients {
			return nil
		}
		return &paho.Publish{Topic: fmt.Sprintf("bulk/%d", i), QoS: 1, Payload: payload}
	})
}

// publishAll publishes through g from clients devices at once (prefix-N):
// device i sends pub(i, 0), pub(i, 1), … until pub returns nil. A refusal
// for a full log (0x97) is taken until refusing has passed, the publish
// tried again after a back-off; any other refusal or error fails the test.
func publishAll(t *testing.T, g *gw, prefix string, clients int, refusing time.Duration, pub func(i, k int) *paho.Publish) {
	t.Helper()
	deadline := time.Now().Add(refusing)
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	for i := range clients {
		c, err := device(t, g, fmt.Sprintf("%s-%d", prefix, i), nil)
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer c.Disconnect(&paho.Disconnect{})
			for k := 0; ; k++ {
				p := pub(i, k)
				if p == nil {
					return
				}
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				r, err := c.Publish(ctx, p)
				cancel()
				if r != nil && r.ReasonCode == 0x97 && time.Now().Before(deadline) {
					k--
					time.Sleep(100 * time.Millisecond) // load generator back-off, not a synchronisation
					continue
				}
				if err != nil || r.ReasonCode >= 0x80 {
					errs <- fmt.Errorf("%s %d publish %d on %s: %v %+v", prefix, i, k, p.Topic, err, r)
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
	t.Parallel()
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
	tok, err := g1.cli("cluster", "invite")
	if err != nil {
		t.Fatal(err)
	}
	tok, _, _ = strings.Cut(tok, "\n")
	out, err := g3.cli("cluster", "join", tok)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("gw-3's join said:\n%s", out)
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

// persistentDevice connects client id to g with a persistent session
// (expiry one hour); clean starts a new one.
func persistentDevice(t *testing.T, g *gw, id string, clean bool, onMsg func(*paho.Publish)) (*paho.Client, *paho.Connack) {
	t.Helper()
	expiry := uint32(3600)
	c, ca, err := connectDevice(t, g, &paho.Connect{ClientID: id, CleanStart: clean, KeepAlive: 30, Properties: &paho.ConnectProperties{SessionExpiryInterval: &expiry}}, onMsg)
	if err != nil {
		t.Fatalf("connect %s to %s: %v", id, g.name, err)
	}
	return c, ca
}

// A slave cut off for longer than ten election timeouts no longer holds
// the master's log: the master drops past it and keeps taking publishes.
// Healed, the slave installs the master's snapshot: the retained messages
// set while it was away, and the persistent session it had, which its
// device resumes there.
func TestSlaveCutOffPastTheCompactionPointInstallsTheSnapshot(t *testing.T) {
	t.Parallel()
	nt := netns.New(t, 2)
	g1, g2 := newGW(t, nt.Hosts[0], "gw-1", smallBudget), newGW(t, nt.Hosts[1], "gw-2", smallBudget)
	g1.start()
	g2.start()
	g2.join(g1)
	waitShape(t, g1, 0, 1, 15*time.Second)
	keeper, _ := persistentDevice(t, g2, "keeper", true, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := keeper.Subscribe(ctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: "persist/#", QoS: 1}}}); err != nil {
		t.Fatal(err)
	}
	keeper.Disconnect(&paho.Disconnect{})
	publishRetained(t, g1, "ret/before", "b")

	nt.Partition([]*netns.Host{nt.Hosts[0]}, []*netns.Host{nt.Hosts[1]})
	stateEnd := g1.status().Log.LastIndex
	publishRetained(t, g1, "ret/while-away", "w")
	floodUntil(t, g1, 3*8<<20, 30*time.Second)
	testutil.WaitFor(t, 30*time.Second, "gw-1 to drop what gw-2 lacks", func() bool { return firstIndex(g1) > stateEnd })
	nt.HealAll()
	testutil.WaitFor(t, 30*time.Second, "gw-2 to install the snapshot", func() bool { return firstIndex(g2) > stateEnd })
	waitShape(t, g1, 0, 1, 30*time.Second)
	const sentinel = "ret/zz-healed"
	publishRetained(t, g1, sentinel, "end")
	if master, got := retainedSet(t, g1, sentinel), retainedSet(t, g2, sentinel); !maps.Equal(got, master) || got["ret/while-away"] != "w" {
		t.Errorf("gw-2 retains %v after healing, gw-1 %v", got, master)
	}
	got := make(chan string, 16)
	back, ca := persistentDevice(t, g2, "keeper", false, func(p *paho.Publish) { got <- string(p.Payload) })
	defer back.Disconnect(&paho.Disconnect{})
	if !ca.SessionPresent {
		t.Fatal("keeper's session is not present on gw-2 after the snapshot")
	}
	pub, err := device(t, g1, "late-pub", nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel = context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if r, err := pub.Publish(ctx, &paho.Publish{Topic: "persist/after", QoS: 1, Payload: []byte("fresh")}); err != nil || r.ReasonCode != 0 {
		t.Fatalf("publish on gw-1: %v %+v", err, r)
	}
	select {
	case p := <-got:
		if p != "fresh" {
			t.Errorf("keeper on gw-2 got %q", p)
		}
	case <-ctx.Done():
		t.Fatal("keeper on gw-2 got nothing of its subscription")
	}
	for _, g := range []*gw{g2, g1} {
		if g.status() == nil {
			t.Errorf("%s does not answer", g.name)
		}
		g.stop()
	}
}
