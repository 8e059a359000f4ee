package cluster

import (
	"context"
	"net"
	"slices"
	"strconv"
	"time"

	"github.com/tandem-edge/tandem/discovery"
	"github.com/tandem-edge/tandem/internal/version"
	"github.com/tandem-edge/tandem/replication"
)

// browseEvery is how often a node with an unreachable member looks for it
// on the LAN under another address (a DHCP lease that changed).
const browseEvery = 5 * time.Second

// startDiscovery advertises this gateway over mDNS, when configured; the
// keeper calls it once the broker serves.
func (c *cluster) startDiscovery() {
	d := c.d
	if !d.cfg.Discovery.MDNS || c.advTried {
		return
	}
	c.advTried = true
	adv, err := discovery.Advertise(discovery.Config{
		Interface: d.cfg.Discovery.Interface,
		Instance:  d.cfg.Node.Name,
		Info:      c.discoveryInfo,
		Logger:    d.log.With("component", "discovery"),
	})
	if err != nil {
		d.log.Error("mDNS advertising failed; peers and devices will not find this gateway on the LAN", "error", err)
		return
	}
	c.adv = adv
	d.log.Info("advertising on the LAN", "backend", adv.Backend(), "service", discovery.ServicePeers)
}

// discoveryInfo is what mDNS says of this gateway now: cheap, it runs
// for every query.
func (c *cluster) discoveryInfo() discovery.Info {
	d := c.d
	n := d.node()
	role := "slave"
	switch lead := n.Leader(); {
	case lead == n.ID() && n.Fenced():
		role = "candidate" // promoted over: it takes no publishes (rejoin.go)
	case lead == n.ID():
		role = "master"
	case lead == 0:
		role = "candidate"
	}
	open, _ := c.pairState()
	info := discovery.Info{
		ID: replication.IDString(d.id.ID), Name: d.cfg.Node.Name, Cluster: c.clusterID(),
		Role: role, Version: version.Version, Gen: c.generation(), Term: n.Term(),
		PeerPort: portOf(c.tr.Addr().String()), PairOpen: open,
	}
	// Devices are told of MQTT only where it listens beyond loopback.
	if host, port, err := net.SplitHostPort(d.host.MQTTAddr()); err == nil {
		if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
			info.MQTTPort, _ = strconv.Atoi(port)
		}
	}
	return info
}

func portOf(addr string) int {
	_, p, _ := net.SplitHostPort(addr)
	n, _ := strconv.Atoi(p)
	return n
}

// announce re-announces a changed state over mDNS.
func (c *cluster) announce() {
	if c.adv == nil {
		return
	}
	if info := c.discoveryInfo(); info != c.lastInfo {
		c.lastInfo = info
		c.adv.Changed()
	}
}

// browse looks for unreachable members under new addresses.
func (c *cluster) browse(ctx context.Context) {
	if peers, ok := c.browsePeers(ctx); ok {
		c.found(peers)
	}
}

// browsePeers is one mDNS browse for gateways, of at most 3 s; false if
// it failed (logged at debug level: the LAN may simply have no mDNS).
func (c *cluster) browsePeers(ctx context.Context) ([]discovery.Peer, bool) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	peers, err := discovery.Browse(ctx, discovery.BrowseOptions{Interface: c.d.cfg.Discovery.Interface, Timeout: 1500 * time.Millisecond})
	if err != nil {
		c.d.log.Debug("browsing for members failed", "error", err)
		return nil, false
	}
	return peers, true
}

// found takes the members' addresses mDNS saw: a member whose addresses
// changed is dialled there (by its pinned fingerprint, so an impostor
// announcing its id gains nothing).
func (c *cluster) found(peers []discovery.Peer) {
	c.lingerMu.Lock()
	changed := false
	for i, p := range c.last {
		for _, fp := range peers {
			if fp.ID == replication.IDString(p.ID) && fp.Cluster == c.clusterID() && fp.Gen > c.generation() {
				// A member says it is in a later generation: it was
				// promoted over this node, maybe. mDNS is not
				// authenticated, so this only makes the next knock
				// (which is) happen now.
				c.rejoins.now.Store(true)
			}
			if fp.ID == replication.IDString(p.ID) && fp.Cluster == c.clusterID() && len(fp.Addrs) > 0 && !slices.Equal(fp.Addrs, p.Addrs) {
				c.d.log.Info("member found at a new address", "peer", fp.Name, "addrs", fp.Addrs, "was", p.Addrs)
				c.last[i].Addrs = slices.Clone(fp.Addrs)
				changed = true
			}
		}
	}
	c.lingerMu.Unlock()
	if changed {
		c.setPeers()
	}
}
