package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/tandem-edge/tandem/internal/netns"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// smallDisk mounts a tmpfs of size under the gateway's data dir's parent,
// before it starts, and unmounts it when the test ends.
func (g *gw) smallDisk(size string) {
	g.t.Helper()
	dir := filepath.Dir(g.dir)
	cfg, err := os.ReadFile(g.cfg) // the mount hides it
	if err != nil {
		g.t.Fatal(err)
	}
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size="+size, "tandem-e2e", dir).CombinedOutput(); err != nil {
		g.t.Fatalf("mount a tmpfs for %s: %v %s", g.name, err, out)
	}
	g.t.Cleanup(func() { exec.Command("umount", "-l", dir).Run() })
	if err := os.WriteFile(g.cfg, cfg, 0o600); err != nil {
		g.t.Fatal(err)
	}
}

// fill takes the gateway's filesystem down to about left bytes free, as
// another program on the card would; the returned func gives the space back.
func (g *gw) fill(left int64) func() {
	g.t.Helper()
	var st syscall.Statfs_t
	if err := syscall.Statfs(g.dir, &st); err != nil {
		g.t.Fatal(err)
	}
	take := int64(st.Bavail)*int64(st.Bsize) - left
	filler := filepath.Join(filepath.Dir(g.dir), "other-program.log")
	if out, err := exec.Command("fallocate", "-l", fmt.Sprint(take), filler).CombinedOutput(); err != nil {
		g.t.Fatalf("fallocate: %v %s", err, out)
	}
	return func() { os.Remove(filler) }
}

// A master whose disk falls below storage.min_free hands the mastership to
// a member that can write: its devices stay connected and their publishes
// succeed, logged by the new master (the old one forwards them), and its
// subscribers still get every message; /healthz on it says 200 again once
// the new master leads. Space back, it takes publishes as before.
func TestMasterBelowMinFreeHandsOver(t *testing.T) {
	t.Parallel()
	nt := netns.New(t, 3)
	const storage = "storage:\n  min_free: 16MiB" // a section after cluster's lines
	g1, g2, g3 := newGW(t, nt.Hosts[0], "gw-1", storage), newGW(t, nt.Hosts[1], "gw-2", storage), newGW(t, nt.Hosts[2], "gw-3", storage)
	for _, g := range []*gw{g1, g2, g3} {
		g.smallDisk("64m")
		g.start()
	}
	g2.join(g1)
	g3.join(g1)
	waitShape(t, g1, 2, 0, 20*time.Second)

	got := make(chan string, 64)
	watcher, err := device(t, g1, "watcher", func(p *paho.Publish) { got <- string(p.Payload) })
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	if _, err := watcher.Subscribe(ctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: "d/#", QoS: 1}}}); err != nil {
		t.Fatal(err)
	}
	cancel()
	pub, err := device(t, g1, "pub", nil)
	if err != nil {
		t.Fatal(err)
	}
	publishOK := func(payload string) bool {
		ctx, cancel := context.WithTimeout(context.Background(), 6*time.Second)
		defer cancel()
		r, err := pub.Publish(ctx, &paho.Publish{Topic: "d/x", QoS: 1, Payload: []byte(payload)})
		return err == nil && r.ReasonCode == 0
	}
	if !publishOK("before") {
		t.Fatal("publish before the disk filled")
	}

	giveBack := g1.fill(8 << 20)
	defer giveBack()
	testutil.WaitFor(t, 10*time.Second, "gw-1 handing the mastership over", func() bool {
		s := g1.status()
		return s != nil && s.Role == "slave" && s.Leader != nil && s.Leader.Name != "gw-1"
	})
	testutil.WaitFor(t, 10*time.Second, "a publish on gw-1 acked through the new master", func() bool { return publishOK("during") })
	// The serving watch looks again on its own clock: /healthz follows
	// the new master within a look or two.
	testutil.WaitFor(t, 5*time.Second, "gw-1 /healthz 200 while it forwards to a master with space", func() bool { return g1.healthz() == 200 })
	want := map[string]bool{"before": true, "during": true}
	deadline := time.After(10 * time.Second)
	for len(want) > 0 {
		select {
		case p := <-got:
			delete(want, p)
		case <-deadline:
			t.Fatalf("gw-1's subscriber is missing %v", want)
		}
	}
	newMaster := g1.status().Leader.Name
	t.Logf("gw-1 below min_free; master now %s", newMaster)
	for _, g := range []*gw{g2, g3} {
		if g.name == newMaster {
			if s := g.status(); s == nil || s.Role != "master" {
				t.Fatalf("%s is not the master it is said to be: %+v", g.name, s)
			}
		}
	}

	giveBack()
	testutil.WaitFor(t, 10*time.Second, "a publish after space returned", func() bool { return publishOK("after") })
	for _, g := range []*gw{g1, g2, g3} {
		g.stop()
	}
}
