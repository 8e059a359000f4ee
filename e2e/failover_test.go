package e2e

import (
	"fmt"
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/internal/netns"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// waitRole waits until g reports role (and, for a slave, leader).
func waitRole(t *testing.T, g *gw, role, leader string, within time.Duration) {
	t.Helper()
	var s *gwStatus
	testutil.WaitFor(t, within, fmt.Sprintf("%s %s (of %q)", g.name, role, leader), func() bool {
		s = g.status()
		return s != nil && s.Role == role && (leader == "" || s.Leader != nil && s.Leader.Name == leader)
	}, func() string { return fmt.Sprintf("%+v", s) })
}

// waitRequeued waits until g has re-published everything it set aside.
func waitRequeued(t *testing.T, g *gw, within time.Duration) {
	t.Helper()
	testutil.WaitFor(t, within, g.name+" re-publishing its requeued records", func() bool {
		s := g.status()
		return s != nil && s.Cluster.RequeuePending == 0
	})
}

// merge joins the acked sets of several loads.
func merge(ls ...*load) map[string]time.Time {
	out := map[string]time.Time{}
	for _, l := range ls {
		maps.Copy(out, l.stop())
	}
	return out
}

func TestTwoGatewaysPromoteAndRejoin(t *testing.T) {
	t.Parallel()
	nt := netns.New(t, 2)
	g1, g2 := startPair(t, nt)
	both := func(i int) []*gw { return []*gw{[]*gw{g1, g2}[i%2], []*gw{g1, g2}[(i+1)%2]} }
	ls := startLoad(t, 2, "s/mix", both)
	la := startLoad(t, 2, "a/mix", both)
	la.waitAcks(t, 200, 20*time.Second)
	retained := map[string]string{"ret/before": "kept"}
	publishRetained(t, g1, "ret/before", "kept")

	g1.kill()
	deadline := time.Now().Add(20 * time.Second)
	for {
		_, err := g2.cli("promote")
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("promote: %v", err)
		}
		time.Sleep(100 * time.Millisecond) // the link to the dead master is still going down
	}
	waitRole(t, g2, "master", "", 5*time.Second)
	la.waitAcks(t, 200, 20*time.Second)
	g1.start()
	waitRole(t, g1, "slave", "gw-2", 20*time.Second)
	waitShape(t, g2, 0, 1, 20*time.Second)
	ls.waitAcks(t, 100, 20*time.Second)
	waitRequeued(t, g1, 10*time.Second)
	acked := merge(ls, la)
	logLine(t, g1, "rejoined as its slave")
	converge(t, 20*time.Second, g1, g2)
	// The rejoined old master holds the same retained set as the new.
	sameRetained(t, g2, retained, g1, g2)
	g1.stop()
	g2.stop()
	checkAll(t, acked, g2, g1)
}

// logLine fails unless g's output has a line containing want within a few
// seconds (some lines follow the state tests poll for: the deposed line
// waits for the re-publish to be done), and logs it.
func logLine(t *testing.T, g *gw, want string) string {
	t.Helper()
	var line string
	testutil.WaitFor(t, 5*time.Second, fmt.Sprintf("%s: a log line with %q", g.name, want), func() bool {
		for _, l := range strings.Split(g.proc.Output(), "\n") {
			if strings.Contains(l, want) {
				line = l
				return true
			}
		}
		return false
	})
	t.Logf("%s: %s", g.name, line)
	return line
}

func TestTwoGatewaysAutoFailoverSplitBrainRepaired(t *testing.T) {
	t.Parallel()
	nt := netns.New(t, 2)
	auto := []string{"  failover: auto", "  failover_after: 3s"}
	g1, g2 := newGW(t, nt.Hosts[0], "gw-1", auto...), newGW(t, nt.Hosts[1], "gw-2", auto...)
	g1.start()
	g2.start()
	g2.join(g1)
	waitShape(t, g1, 0, 1, 15*time.Second)
	// Devices of the master keep reaching it through the cut.
	la := startLoad(t, 3, "a/split", func(int) []*gw { return []*gw{g1} })
	la.waitAcks(t, 200, 20*time.Second)
	nt.Cut(nt.Hosts[0], nt.Hosts[1])
	t.Logf("cut at %s", time.Now().UTC().Format("15:04:05.000"))
	waitRole(t, g2, "master", "", 15*time.Second) // promoted itself
	la.waitAcks(t, 200, 20*time.Second)           // the old master acked on alone
	nt.Heal(nt.Hosts[0], nt.Hosts[1])
	waitRole(t, g1, "slave", "gw-2", 30*time.Second)
	la.waitAcks(t, 100, 20*time.Second) // through the new master
	waitRequeued(t, g1, 20*time.Second)
	acked := merge(la)
	logLine(t, g2, "promoted to master")
	logLine(t, g1, "rejoined as its slave")
	if s := g2.status(); s.Role != "master" || s.Cluster.Generation != 1 {
		t.Fatalf("gw-2 after healing: %+v", s)
	}
	g1.stop()
	g2.stop()
	checkAll(t, acked, g2)
}

func TestThreeGatewaysMasterCutOff(t *testing.T) {
	t.Parallel()
	nt := netns.New(t, 3)
	g1, g2, g3 := startThree(t, nt)
	g2.join(g1)
	g3.join(g1)
	waitShape(t, g1, 2, 0, 20*time.Second)
	la := startLoad(t, 3, "a/cut", func(int) []*gw { return []*gw{g1} })
	la.waitAcks(t, 200, 20*time.Second)
	cut := time.Now()
	nt.Partition([]*netns.Host{nt.Hosts[0]}, []*netns.Host{nt.Hosts[1], nt.Hosts[2]})
	master := waitMaster(t, time.Now().Add(10*time.Second), g2, g3)
	// The old master steps down (check-quorum): it stops acking.
	waitRoleNot(t, g1, "master", 5*time.Second)
	healed := time.Now()
	nt.HealAll()
	waitRole(t, g1, "slave", master.name, 20*time.Second)
	la.waitAcks(t, 100, 30*time.Second)
	waitRequeued(t, g1, 20*time.Second)
	acked := merge(la)
	during := 0
	for _, at := range acked {
		if at.After(cut) && at.Before(healed) {
			during++
		}
	}
	t.Logf("the cut-off master acked %d async publishes before it stepped down", during)
	for _, g := range []*gw{g1, g2, g3} {
		g.stop()
	}
	checkAll(t, acked, master)
}

// waitRoleNot waits until g reports a role other than role.
func waitRoleNot(t *testing.T, g *gw, role string, within time.Duration) {
	t.Helper()
	testutil.WaitFor(t, within, g.name+" no longer "+role, func() bool {
		s := g.status()
		return s != nil && s.Role != role
	})
}

func TestRestartsUnderLoadLoseNothing(t *testing.T) {
	t.Parallel()
	nt := netns.New(t, 3)
	gws := []*gw{newGW(t, nt.Hosts[0], "gw-1"), newGW(t, nt.Hosts[1], "gw-2"), newGW(t, nt.Hosts[2], "gw-3")}
	for _, g := range gws {
		g.start()
	}
	gws[1].join(gws[0])
	gws[2].join(gws[0])
	waitShape(t, gws[0], 2, 0, 20*time.Second)
	spread := func(i int) []*gw { return []*gw{gws[i%3], gws[(i+1)%3], gws[(i+2)%3]} }
	ls := startLoad(t, 3, "s/restart", spread)
	la := startLoad(t, 3, "a/restart", spread)
	la.waitAcks(t, 200, 20*time.Second)
	// All at once.
	for _, g := range gws {
		g.kill()
	}
	for _, g := range gws {
		g.start()
	}
	ls.waitAcks(t, 200, 30*time.Second)
	// One member, again and again.
	for round := 0; round < 3; round++ {
		g := gws[round%3]
		g.kill()
		la.waitAcks(t, 50, 20*time.Second)
		g.start()
		ls.waitAcks(t, 100, 30*time.Second)
	}
	acked := merge(ls, la)
	converge(t, 30*time.Second, gws...)
	for _, g := range gws {
		g.stop()
	}
	checkAll(t, acked, gws...)
}
