package e2e

import (
	"testing"
	"time"

	"github.com/tandem-edge/tandem/internal/netns"
)

// startThree starts gateways gw-1, gw-2 and gw-3 on the first three hosts
// of nt, each alone for now.
func startThree(t *testing.T, nt *netns.Net) (g1, g2, g3 *gw) {
	t.Helper()
	g1, g2, g3 = newGW(t, nt.Hosts[0], "gw-1"), newGW(t, nt.Hosts[1], "gw-2"), newGW(t, nt.Hosts[2], "gw-3")
	for _, g := range []*gw{g1, g2, g3} {
		g.start()
	}
	return g1, g2, g3
}

// startPair starts gw-1 and gw-2 on the first two hosts of nt and makes
// gw-2 gw-1's slave.
func startPair(t *testing.T, nt *netns.Net) (g1, g2 *gw) {
	t.Helper()
	g1, g2 = newGW(t, nt.Hosts[0], "gw-1"), newGW(t, nt.Hosts[1], "gw-2")
	g1.start()
	g2.start()
	g2.join(g1)
	waitShape(t, g1, 0, 1, 15*time.Second)
	return g1, g2
}
