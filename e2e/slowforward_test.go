package e2e

import (
	"fmt"
	"testing"
	"time"

	"github.com/tandem-edge/tandem/internal/netns"
	"github.com/tandem-edge/tandem/internal/testutil"
)

// TestSlowLinkRefusedForwardsAreAbsent: devices on the slave of 2
// gateways whose link slows to 1,000 ms each way with 1 % loss, appends
// still flowing (issue #32). The slave forwards their publishes to the
// master, whose answers now come late: every publish the slave refused
// (0x80) is in neither log (or aborted there), every acked one is in
// both, and both gateways stop on SIGTERM within 5 s.
func TestSlowLinkRefusedForwardsAreAbsent(t *testing.T) {
	// Mostly waiting on a slow link of its own network: it runs beside the
	// other waiting ones (make test's time).
	t.Parallel()
	netns.Skip(t, "iptables")
	nt := netns.New(t, 2)
	link := nt.Relay(nt.Hosts[0], nt.Hosts[1], peerPort)
	g1, g2 := newGW(t, nt.Hosts[0], "gw-1"), newGW(t, nt.Hosts[1], "gw-2")
	g1.start()
	g2.start()
	g2.join(g1)
	waitShape(t, g1, 0, 1, 15*time.Second)
	// One publish in flight each, as many devices do: several, so that
	// the forward batches carry records of both kinds at once.
	var pubs []*outcomes
	for i := range 3 {
		pubs = append(pubs,
			startOutcomePublisher(t, g2, fmt.Sprintf("slow-sync-%d", i), fmt.Sprintf("s/slow/%d", i)),
			startOutcomePublisher(t, g2, fmt.Sprintf("slow-async-%d", i), fmt.Sprintf("a/slow/%d", i)))
	}
	acks := func() (min int) {
		min = -1
		for _, o := range pubs {
			if a, _ := o.count(); min < 0 || a < min {
				min = a
			}
		}
		return min
	}
	testutil.WaitFor(t, 20*time.Second, "20 acks of each publisher on the clean link", func() bool { return acks() >= 20 })
	link.SetDelay(time.Second)
	link.SetLoss(0.01)
	t.Logf("1000 ms each way and 1%% loss from %s", time.Now().UTC().Format("15:04:05.000"))
	before := g2.status()
	hold(30 * time.Second)
	after := g2.status()
	if before == nil || after == nil || after.Role != "slave" || after.Log.LastIndex <= before.Log.LastIndex {
		t.Fatalf("gw-2 over the slow link: before %+v, after %+v: appends must flow and gw-2 stay a slave, or the test proves nothing", before, after)
	}
	link.SetLoss(0)
	link.SetDelay(0)
	a0 := acks()
	testutil.WaitFor(t, 30*time.Second, "10 more acks of each publisher on the clean link", func() bool { return acks() >= a0+10 })
	for _, o := range pubs {
		o.stop()
	}
	converge(t, 30*time.Second, g1, g2)
	timeline(t, g1, g2)
	g1.stopWithin(5 * time.Second)
	g2.stopWithin(5 * time.Second)
	for _, o := range pubs {
		checkRefusedAbsent(t, o, g1, g2)
	}
}
