package cluster

import (
	"context"
	"time"

	"github.com/tandem-edge/tandem/replication"
)

// The control plane as the daemon and its admin endpoints use it. Every
// method here is safe to call from any goroutine once newGateway returned.

// Node is the replication node in force. A join, a removal or a rejoin
// replaces it; a caller that gets replication.ErrStopped from it can ask
// NodeAfterSwap for the new one.
func (d *Gateway) Node() *replication.Node { return d.node() }

// NodeAfterSwap waits for a node swap under way to end and returns the
// node in force then.
func (d *Gateway) NodeAfterSwap() *replication.Node {
	d.swapMu.Lock()
	defer d.swapMu.Unlock()
	return d.node()
}

// StartNode starts the node in force on the data file as it is and takes
// its membership as the cluster's.
func (d *Gateway) StartNode() error {
	// A restart in the middle of a join's catch-up, before the master's
	// first entry arrived, must wait for the master, not start a group of
	// its own on the empty log.
	last, _ := d.db.LastIndex()
	if err := d.startNode(d.cl.catchUpTo > 0 && last == 0); err != nil {
		return err
	}
	d.cl.setMembers(d.node().Members())
	return nil
}

// StartNodeResyncing starts the node on the fresh data file of a damaged
// member as a member-to-be (no bootstrap, no campaign, no acks) until
// Resync has brought it into its cluster.
func (d *Gateway) StartNodeResyncing() error { return d.startNode(true) }

// ClusterID is the id of the cluster this gateway belongs to.
func (d *Gateway) ClusterID() string { return d.cl.clusterID() }

// Generation counts the promotions the cluster has seen.
func (d *Gateway) Generation() uint64 { return d.cl.generation() }

// PeerAddrs are this gateway's peer addresses as other gateways dial them.
func (d *Gateway) PeerAddrs() []string { return d.cl.myAddrs() }

// Reachable reports whether the peer link to member id is up.
func (d *Gateway) Reachable(id uint64) bool { return d.cl.tr.Reachable(id) }

// PeerBuild is what member id's build said in its latest peer hello: the
// highest feature level it knows and its release.
func (d *Gateway) PeerBuild(id uint64) (level int, build string, ok bool) {
	return d.cl.tr.PeerBuild(id)
}

// TopicsOf is member id's topic rules hash as it last told it, "" when
// unknown; TopicsHash is this gateway's.
func (d *Gateway) TopicsOf(id uint64) string { return d.cl.topicsOf(id) }

// TopicsHash is the hash of this gateway's topic rules in force.
func (d *Gateway) TopicsHash() string { return d.topicsHash() }

// HasSyncTopics reports whether a topic rule in force asks for sync acks.
func (d *Gateway) HasSyncTopics() bool { return d.hasSyncTopics() }

// PairState says whether pairing is open here, and until when.
func (d *Gateway) PairState() (open bool, expires time.Time) { return d.cl.pairState() }

// PairGuesses counts the pairing attempts this gateway answered since it
// started, by outcome (the names in PairOutcomes): checked and right or
// wrong, or refused unchecked, over the global cap or with no pairing open.
func (d *Gateway) PairGuesses() map[string]uint64 {
	n := d.cl.invites.pair.counts()
	out := make(map[string]uint64, len(n))
	for i, v := range n {
		out[PairOutcomes[i]] = v
	}
	return out
}

// StrangerRefusals counts the peer port's connections that admission
// refused or evicted since the start, by reason (the names in
// replication.StrangerRefusals); nil before the transport starts.
func (d *Gateway) StrangerRefusals() map[string]uint64 {
	if d.cl.tr == nil {
		return nil
	}
	n := d.cl.tr.Stats().StrangerRefusals
	out := make(map[string]uint64, len(n))
	for i, v := range n {
		out[replication.StrangerRefusals[i]] = v
	}
	return out
}

// Promotions and Depositions count this process's promotions to master and
// the times it found itself replaced as master.
func (d *Gateway) Promotions() uint64 { return d.cl.promotions.Load() }

// Depositions: see Promotions.
func (d *Gateway) Depositions() uint64 { return d.cl.depositions.Load() }

// Invite asks the master for a join token valid for ttl (0: the default).
func (d *Gateway) Invite(ctx context.Context, ttl time.Duration) (token string, err error) {
	rep, err := d.cl.admin(ctx, adminRequest{Op: "invite", TTL: ttl})
	return rep.Token, err
}

// Remove asks the master to remove member node (a name or an id).
func (d *Gateway) Remove(ctx context.Context, node string, force bool) (removed string, err error) {
	rep, err := d.cl.admin(ctx, adminRequest{Op: "remove", Node: node, Force: force})
	return rep.Removed, err
}

// OpenPairing asks the master to open pairing for ttl. An empty code means
// a master that does not know pairing.
func (d *Gateway) OpenPairing(ctx context.Context, ttl time.Duration) (code string, expires time.Time, err error) {
	rep, err := d.cl.admin(ctx, adminRequest{Op: "pair", TTL: ttl})
	return rep.Code, rep.Expires, err
}

// Joined describes the cluster a join or a pairing made this gateway a
// member of.
type Joined struct {
	Cluster, Master string
	Members         []string // names
	// Voter says this gateway and every other member vote in elections:
	// three members, all promoted (a 2-gateway slave never votes).
	Voter bool
	// CatchUpTo is the master's commit index when it took this gateway
	// in: the history it replays (or takes in as a snapshot) first.
	CatchUpTo uint64
}

func joinedOf(rep JoinReply) Joined {
	out := Joined{Cluster: rep.Cluster, Master: rep.Master, CatchUpTo: rep.Commit}
	for _, m := range rep.Members {
		out.Members = append(out.Members, m.Name)
	}
	return out
}

// Join makes this gateway a member of the cluster that issued token.
func (d *Gateway) Join(ctx context.Context, token string, mode JoinMode) (Joined, error) {
	rep, err := d.cl.join(ctx, token, mode)
	j := joinedOf(rep)
	j.Voter = err == nil && d.cl.allVote()
	return j, err
}

// PairJoin makes this gateway a member of the cluster that opened pairing
// with code, found within the given time over mDNS or knocked at addr.
func (d *Gateway) PairJoin(ctx context.Context, code string, mode JoinMode, within time.Duration, addr string) (Joined, error) {
	rep, err := d.cl.pairJoin(ctx, code, mode, within, addr)
	j := joinedOf(rep)
	j.Voter = err == nil && d.cl.allVote()
	return j, err
}

// Promote makes this slave the master (tandem promote) and returns the
// master it replaced and the cluster's generation now.
func (d *Gateway) Promote(ctx context.Context, force bool) (deposed string, generation uint64, err error) {
	old, err := d.cl.promote(ctx, force, "tandem promote")
	return old.Name, d.cl.generation(), err
}

// Self is this gateway as a member: id, name, peer addresses, fingerprint.
func (d *Gateway) Self() replication.Member { return d.self() }
