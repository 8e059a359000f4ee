package cluster

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	raftpb "go.etcd.io/raft/v3/raftpb"

	"github.com/tandem-edge/tandem/discovery"
	"github.com/tandem-edge/tandem/replication"
	"github.com/tandem-edge/tandem/storage"

	"github.com/tandem-edge/tandem/internal/clock"
)

// Requests one member makes of another over the peer link (tandem's own,
// beside raft's messages).
const (
	reqForward byte = 'F' // a publish taken on a slave, for the master to log
	reqAdmin   byte = 'A' // a cluster command (invite, remove) for the master
	reqTopics  byte = 'T' // this member's topic rules hash; the answer is the peer's
	reqUpdate  byte = 'U' // this member's current details (name, addresses)
	reqLeave   byte = 'L' // the master tells a node it removed: raft never will
)

// reqBackfill asks the master for records before the snapshot a member
// installed (replication.Node.HandleBackfill).
const reqBackfill byte = 'B'

// lingerRemoved is how long the transport keeps a link to a removed
// member: long enough for the master to tell it.
const lingerRemoved = 10 * time.Second

// Metadata keys of the cluster a node belongs to.
const (
	metaClusterID  = "cluster.id"
	metaGeneration = "cluster.gen"
)

// cluster is the daemon's part of replication: the peer transport, the
// cluster id and generation, invites, and the watchers that keep the
// membership in the shape DESIGN.md gives (2 gateways: voter + learner; 3:
// three voters).
type cluster struct {
	d  *Gateway
	tr *replication.PeerTransport

	id  sync.Mutex // guards clusterID
	cid string
	gen uint64

	invites *inviteBook

	// topicsMu guards peerTopics: each member's topic rules hash as it
	// last told us, and whether a mismatch was already logged.
	topicsMu   sync.Mutex
	peerTopics map[uint64]string
	warned     map[uint64]string

	// joinedAt is the master's commit index when this node joined (0 if
	// it did not join in this run); seenSelf is set once this node has
	// seen itself a member past it. Guarded by d.swapMu.
	joinedAt  uint64
	seenSelf  bool
	catchUpTo uint64 // the node's Config.CatchUpTo; 0 when caught up

	// lingerMu guards lingering: removed members the transport keeps a
	// link to for a while, by id.
	lingerMu  sync.Mutex
	lingering map[uint64]replication.PeerInfo

	last  []replication.PeerInfo // the members' peers, as last set; lingerMu
	floor []replication.PeerInfo // peers kept while catching up after a join; lingerMu

	// mDNS, keeper-owned: the advertiser (nil when off), what it last
	// said, and when members were last looked for.
	adv        *discovery.Advertiser
	advTried   bool
	lastInfo   discovery.Info
	lastBrowse time.Time

	failover failoverState
	rejoins  rejoinState // a deposed master's knocking (rejoin.go)
	rtt      rttEstimate // round trip to the members, measured

	members    membersWriter // MembersFile, the membership kept beside the data file (resync.go)
	membersSig chan struct{} // a membership change applied: the keeper writes MembersFile
	resynced   resyncBook    // on the master: the damaged members it re-admitted

	// promotions and depositions count this process's failovers.
	promotions, depositions atomic.Uint64

	// Background tasks of the keeper that are running.
	bgBrowse, bgTend, bgLeave, bgFailover, bgRepublished atomic.Bool

	addrsMu sync.Mutex
	addrs   []string // this node's peer addresses as other gateways should dial them

	stopc chan struct{}
	wg    sync.WaitGroup // every goroutine goFunc started; Gateway.Stop waits
}

// goFunc runs f on a goroutine that Gateway.Stop waits for (hashicorp
// raft's goFunc). Stop closes stopc before it waits, and every caller either
// runs before Stop or on a goroutine goFunc started, so no Add races with
// the Wait.
func (c *cluster) goFunc(f func()) {
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		f()
	}()
}

// metaCatchUp records a join or rejoin whose history this node is still
// replaying: the master's commit index then, and the members it named.
const metaCatchUp = "cluster.catchup"

// catchUpState is metaCatchUp's value.
type catchUpState struct {
	Commit  uint64               `json:"commit"`
	Members []replication.Member `json:"members"`
}

// startCatchUp records, durably, that this node replays the history of the
// cluster rep describes; d.swapMu is held. A restart in the middle goes on
// catching up: it neither campaigns, nor takes an old removal of itself
// for a new one, nor forgets how to reach today's master.
func (c *cluster) startCatchUp(rep JoinReply) error {
	b, _ := json.Marshal(catchUpState{Commit: rep.Commit, Members: rep.Members})
	if err := c.d.db.PutMeta(metaCatchUp, b); err != nil {
		return err
	}
	c.joinedAt, c.seenSelf, c.catchUpTo = rep.Commit, false, rep.Commit
	return nil
}

// caughtUp ends a catch-up; d.swapMu is held.
func (c *cluster) caughtUp() {
	if c.catchUpTo == 0 {
		return
	}
	c.catchUpTo = 0
	if err := c.d.db.PutMeta(metaCatchUp, nil); err != nil {
		c.d.log.Warn("recording the end of a catch-up failed", "error", err)
	}
	c.lingerMu.Lock()
	c.floor = nil
	c.lingerMu.Unlock()
	c.setPeers()
	c.d.log.Info("caught up with the cluster's log")
}

// loadClusterMeta reads (or, on a new data dir, creates) the cluster id and
// generation.
func (c *cluster) loadMeta(db *storage.DB) error {
	v, err := db.GetMeta(metaClusterID)
	if err != nil {
		return err
	}
	if len(v) == 0 {
		v = []byte(newClusterID())
		if err := db.PutMeta(metaClusterID, v); err != nil {
			return err
		}
	}
	c.cid = string(v)
	if cu, err := db.GetMeta(metaCatchUp); err != nil {
		return err
	} else if len(cu) > 0 {
		var st catchUpState
		if err := json.Unmarshal(cu, &st); err != nil {
			return fmt.Errorf("%s: %v: %w", metaCatchUp, err, storage.ErrCorrupt)
		}
		c.joinedAt, c.catchUpTo, c.floor = st.Commit, st.Commit, peersOf(st.Members)
	}
	g, err := db.GetMeta(metaGeneration)
	if err != nil {
		return err
	}
	if len(g) > 0 {
		if c.gen, err = strconv.ParseUint(string(g), 10, 64); err != nil {
			return fmt.Errorf("%s %q: %w", metaGeneration, g, storage.ErrCorrupt)
		}
	}
	return nil
}

// setMeta makes id and gen this node's cluster, durably.
func (c *cluster) setMeta(db *storage.DB, id string, gen uint64) error {
	if err := db.PutMeta(metaClusterID, []byte(id)); err != nil {
		return err
	}
	if err := db.PutMeta(metaGeneration, []byte(strconv.FormatUint(gen, 10))); err != nil {
		return err
	}
	// A higher generation learned earlier belonged to the cluster this
	// node was in; whatever it now joins, rejoins or starts, it is not
	// superseded in it.
	if err := db.PutMeta(metaSuperseded, nil); err != nil {
		return err
	}
	c.id.Lock()
	c.cid, c.gen = id, gen
	c.id.Unlock()
	return nil
}

// clusterID returns the cluster this node belongs to.
func (c *cluster) clusterID() string {
	c.id.Lock()
	defer c.id.Unlock()
	return c.cid
}

// generation returns the cluster generation this node is in.
func (c *cluster) generation() uint64 {
	c.id.Lock()
	defer c.id.Unlock()
	return c.gen
}

// newClusterID returns a random cluster id: 16 hex digits.
func newClusterID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// advertised returns the addresses other gateways should dial: the
// configured ones, else the peer listener's own address, or, for a
// listener on every interface, each non-loopback address of this host.
func advertised(cfg []string, ln net.Addr) []string {
	if len(cfg) > 0 {
		return slices.Clone(cfg)
	}
	ta, ok := ln.(*net.TCPAddr)
	if !ok {
		return nil
	}
	port := strconv.Itoa(ta.Port)
	if !ta.IP.IsUnspecified() {
		return []string{net.JoinHostPort(ta.IP.String(), port)}
	}
	var out []string
	ifs, _ := net.Interfaces()
	for _, ifc := range ifs {
		if ifc.Flags&net.FlagUp == 0 || ifc.Flags&net.FlagLoopback != 0 {
			continue
		}
		addrs, _ := ifc.Addrs()
		for _, a := range addrs {
			ipn, ok := a.(*net.IPNet)
			if !ok || !ipn.IP.IsGlobalUnicast() {
				continue
			}
			if ipn.IP.To4() == nil && ta.IP.To4() != nil && ta.IP.String() == "0.0.0.0" {
				continue // an IPv4-only listener
			}
			out = append(out, net.JoinHostPort(ipn.IP.String(), port))
		}
	}
	if len(out) == 0 {
		out = []string{net.JoinHostPort("127.0.0.1", port)}
	}
	return out
}

// self is this node's member entry as it should be in the cluster.
func (d *Gateway) self() replication.Member {
	return replication.Member{ID: d.id.ID, Name: d.cfg.Node.Name, Addrs: d.cl.myAddrs(), Fingerprint: d.id.Fingerprint}
}

// myAddrs returns the peer addresses other gateways should dial.
func (c *cluster) myAddrs() []string {
	c.addrsMu.Lock()
	defer c.addrsMu.Unlock()
	if c.addrs == nil {
		c.addrs = advertised(c.d.cfg.Peer.Advertise, c.tr.Addr())
	}
	return slices.Clone(c.addrs)
}

// refreshAddrs notices this host's addresses changing (a new DHCP lease):
// refreshSelf then tells the cluster.
func (c *cluster) refreshAddrs() {
	now := advertised(c.d.cfg.Peer.Advertise, c.tr.Addr())
	c.addrsMu.Lock()
	defer c.addrsMu.Unlock()
	if c.addrs != nil && !slices.Equal(now, c.addrs) {
		c.d.log.Info("this gateway's addresses changed", "addrs", now, "was", c.addrs)
	}
	c.addrs = now
}

// startTransport opens the peer port. Raft traffic is admitted only from
// members' pinned certificates; a stranger may only knock with a join
// secret.
func (c *cluster) startTransport() error {
	d := c.d
	tr, err := replication.NewPeerTransport(replication.TransportConfig{
		Identity:   d.id,
		Listen:     d.cfg.Peer.Listen,
		Logger:     d.log, // the transport adds component=peer
		ClusterID:  c.clusterID,
		Generation: c.generation,
		FeatureLevel: func() int {
			if n := d.node(); n != nil {
				return n.FeatureLevel()
			}
			return d.db.FeatureLevelOf()
		},
		OnGeneration: func(_, gen uint64) bool {
			// A member in a later generation promoted itself over this
			// node: no raft with it before the wipe; the keeper's
			// rejoin check asks it by knock, at once, and a master
			// stops acking meanwhile. The hello is authenticated (a
			// pinned member certificate), so it may fence.
			if gen > c.generation() {
				c.superseded(gen, "peer handshake")
				return false
			}
			return true
		},
		OnRaft: func(_ uint64, msgs []raftpb.Message) {
			c.failover.heard.Store(int64(clock.Mono()))
			n := d.node()
			if n == nil {
				return // still starting: raft resends
			}
			for _, m := range msgs {
				n.Step(m)
			}
		},
		OnUnreachable: func(id uint64) {
			if n := d.node(); n != nil {
				n.ReportUnreachable(id)
			}
		},
		OnRequest:             c.onRequest,
		OnStranger:            c.onStranger,
		MaxStrangers:          d.cfg.Peer.MaxStrangers,
		MaxStrangersPerSource: d.cfg.Peer.MaxStrangersPerAddress,
	})
	if err != nil {
		return err
	}
	c.tr = tr
	tr.Start()
	return nil
}

// peersOf turns members into the transport's peer list.
func peersOf(members []replication.Member) []replication.PeerInfo {
	out := make([]replication.PeerInfo, 0, len(members))
	for _, m := range members {
		out = append(out, replication.PeerInfo{ID: m.ID, Addrs: m.Addrs, Fingerprint: m.Fingerprint})
	}
	return out
}

// onMembership follows a membership change: links to new members, none
// to removed ones, and a node that finds itself removed leaves.
func (c *cluster) onMembership(members []replication.Member) {
	c.lingerMu.Lock()
	defer c.lingerMu.Unlock()
	peers := peersOf(members)
	if c.lingering == nil {
		c.lingering = map[uint64]replication.PeerInfo{}
	}
	for _, p := range c.last {
		if !slices.ContainsFunc(peers, func(q replication.PeerInfo) bool { return q.ID == p.ID }) {
			c.lingering[p.ID] = p
			time.AfterFunc(lingerRemoved, func() {
				c.lingerMu.Lock()
				delete(c.lingering, p.ID)
				c.lingerMu.Unlock()
				c.setPeers()
			})
		}
	}
	for _, p := range peers {
		delete(c.lingering, p.ID)
	}
	c.last = peers
	if c.tr != nil {
		c.tr.SetPeers(c.peersLocked())
	}
	select {
	case c.membersSig <- struct{}{}:
	default:
	}
	c.d.log.Info("membership changed", "members", memberNames(members))
}

// setPeers gives the transport the members and the lingering removed.
func (c *cluster) setPeers() {
	c.lingerMu.Lock()
	defer c.lingerMu.Unlock()
	if c.tr != nil {
		c.tr.SetPeers(c.peersLocked())
	}
}

func (c *cluster) peersLocked() []replication.PeerInfo {
	out := slices.Clone(c.last)
	for _, p := range c.lingering {
		out = append(out, p)
	}
	// While a joining node replays the cluster's history, the membership
	// it applies is an old one, maybe without today's master: the members
	// the master named at the join stay linked until it has caught up.
	for _, p := range c.floor {
		if !slices.ContainsFunc(out, func(q replication.PeerInfo) bool { return q.ID == p.ID }) {
			out = append(out, p)
		}
	}
	return out
}

// setMembers links to members (at start: the membership on disk).
func (c *cluster) setMembers(members []replication.Member) {
	c.lingerMu.Lock()
	c.last = peersOf(members)
	c.lingerMu.Unlock()
	c.setPeers()
	c.recordMembers(members)
}

// setFloor links to members, the cluster a join or rejoin named, and keeps
// them linked while this node catches up (caughtUp drops the floor).
func (c *cluster) setFloor(members []replication.Member) {
	c.lingerMu.Lock()
	c.floor = peersOf(members)
	c.last = c.floor
	c.lingerMu.Unlock()
	c.setPeers()
}

// tellRemoved tells a node the master just removed that it is out: raft
// stops talking to it once the removal applies, often before it has
// learned the removal is committed.
func (c *cluster) tellRemoved(ctx context.Context, id uint64) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if _, err := c.tr.Request(ctx, id, reqLeave, nil); err != nil {
		c.d.log.Warn("could not tell the removed node it is out; it stays without a master until it is reset", "peer", replication.IDString(id), "error", err)
	}
}

func memberNames(ms []replication.Member) []string {
	out := make([]string, 0, len(ms))
	for _, m := range ms {
		role := "learner"
		if m.Voter {
			role = "voter"
		}
		out = append(out, fmt.Sprintf("%s(%s,%s)", m.Name, replication.ShortID(m.ID), role))
	}
	return out
}

// forwarder carries replication's forward stream (batches of publishes
// taken on this node while it is a slave) to the master over the peer link.
type forwarder struct{ c *cluster }

// Forward sends one batch and returns the master's answer
// (replication.Forwarder).
func (f forwarder) Forward(ctx context.Context, master uint64, batch []byte) ([]byte, error) {
	return f.c.tr.Request(ctx, master, reqForward, batch)
}

// Backfill asks the master for records before the snapshot this member
// installed (replication.Backfiller).
func (f forwarder) Backfill(ctx context.Context, master uint64, req []byte) ([]byte, error) {
	return f.c.tr.Request(ctx, master, reqBackfill, req)
}

// onRequest answers a member's request.
func (c *cluster) onRequest(ctx context.Context, from uint64, kind byte, payload []byte) ([]byte, error) {
	n := c.d.node()
	if n == nil {
		return nil, errors.New("this gateway is still starting")
	}
	if from == n.Leader() {
		c.failover.heard.Store(int64(clock.Mono())) // the master is alive
	}
	switch kind {
	case reqForward:
		return n.HandleForward(ctx, from, payload)
	case reqBackfill:
		return n.HandleBackfill(payload)
	case reqAdmin:
		return c.handleAdmin(ctx, payload)
	case reqTopics:
		c.noteTopics(from, string(payload))
		return []byte(c.d.topicsHash()), nil
	case reqUpdate:
		return nil, c.handleUpdate(ctx, from, payload)
	case reqLeave:
		n := c.d.node()
		if from != n.Leader() {
			return nil, errors.New("only the master can say this node was removed")
		}
		select {
		case <-c.stopc:
			return nil, errors.New("this gateway is stopping")
		default:
		}
		c.background(&c.bgLeave, c.leave)
		return nil, nil
	}
	return nil, fmt.Errorf("unknown request kind %q", kind)
}

// handleUpdate applies a member's new details (its addresses after a
// restart on another DHCP lease, a new name) on the master.
func (c *cluster) handleUpdate(ctx context.Context, from uint64, payload []byte) error {
	var m replication.Member
	if err := json.Unmarshal(payload, &m); err != nil {
		return err
	}
	n := c.d.node()
	var cur replication.Member
	found := false
	for _, x := range n.Members() {
		if x.ID == from {
			cur, found = x, true
		}
	}
	if !found || m.ID != from || m.Fingerprint != cur.Fingerprint {
		return errors.New("update refused: not this member's details")
	}
	typ := raftpb.ConfChangeAddLearnerNode
	if cur.Voter {
		typ = raftpb.ConfChangeAddNode
	}
	return n.ChangeMember(ctx, typ, m)
}

// sameDetails reports whether a and b name the same node the same way.
func sameDetails(a, b replication.Member) bool {
	return a.ID == b.ID && a.Name == b.Name && slices.Equal(a.Addrs, b.Addrs) && a.Fingerprint == b.Fingerprint
}

// logError logs err at level unless it is nil.
func logError(log *slog.Logger, msg string, err error) {
	if err != nil {
		log.Error(msg, "error", err)
	}
}

// equalFP compares fingerprints.
func equalFP(a, b [32]byte) bool { return bytes.Equal(a[:], b[:]) }
