package cluster

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/tandem-edge/tandem/replication"
	raftpb "go.etcd.io/raft/v3/raftpb"
)

// The keeper: what every member runs in the background to keep its own
// details current and the membership in DESIGN.md's shape, and the
// topic-rule hashes members exchange.

// keeper runs on every node: it keeps this node's own member details
// current in the cluster and exchanges topic rule hashes; on the master it
// also keeps the membership in DESIGN.md's shape.
func (c *cluster) keeper() {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	// ctx ends the background tasks' network calls at Stop.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var lastTopics time.Time
	defer func() {
		if c.adv != nil {
			_ = c.adv.Close()
		}
	}()
	defer func() {
		if n := c.d.node(); n != nil {
			c.recordMembers(n.Members())
		}
	}()
	for {
		select {
		case <-c.stopc:
			return
		case <-c.membersSig:
			// A membership change applied: the copy beside the data file
			// follows at once, off the raft goroutine.
			if n := c.d.node(); n != nil {
				c.recordMembers(n.Members())
			}
			continue
		case <-t.C:
		}
		n := c.d.node()
		if n == nil {
			continue
		}
		select {
		case <-c.d.host.Serving(): // the broker serves: its address is known
			c.startDiscovery()
		default:
		}
		c.refreshAddrs()
		c.announce()
		// Here rather than as changes apply: never an fsync on the raft
		// goroutine, and a file write only when the membership changed.
		c.recordMembers(n.Members())
		// Quick decisions first, on the keeper itself: nothing that waits
		// on the network may delay a failover.
		c.checkFailover(n)
		if g := c.supersededGen(); g > c.generation() {
			c.fence(g, "an earlier run") // also after this node elected itself again
		}
		if !c.d.swapMu.TryLock() {
			continue // a join, leave or promotion is replacing the node
		}
		gone := c.removed(n)
		c.d.swapMu.Unlock()
		if gone {
			c.leave()
			continue
		}
		// What talks to peers runs in the background, one of each kind
		// at a time.
		if lost := c.lostMembers(n); len(lost) > 0 {
			if c.adv != nil && time.Since(c.lastBrowse) >= browseEvery {
				c.lastBrowse = time.Now()
				c.background(&c.bgBrowse, func() { c.browse(ctx) })
			}
			if n.Leader() == n.ID() && c.rejoins.due() {
				c.knockRound(ctx, lost)
			}
		}
		topics := time.Since(lastTopics) > 10*time.Second
		if topics {
			lastTopics = time.Now()
		}
		c.background(&c.bgTend, func() {
			tctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			c.refreshSelf(tctx, n)
			if n.Leader() == n.ID() {
				c.shape(tctx, n)
				c.settleDeposed(tctx, n)
			}
			if topics {
				c.exchangeTopics(tctx, n)
			}
		})
	}
}

// background runs fn on a goroutine of its own unless the previous run
// flagged by running is still going.
func (c *cluster) background(running *atomic.Bool, fn func()) {
	if !running.CompareAndSwap(false, true) {
		return
	}
	c.goFunc(func() {
		defer running.Store(false)
		fn()
	})
}

// lostMembers returns the members other than this node without a link.
func (c *cluster) lostMembers(n *replication.Node) []replication.Member {
	var lost []replication.Member
	for _, m := range n.Members() {
		if m.ID != n.ID() && !c.tr.Reachable(m.ID) {
			lost = append(lost, m)
		}
	}
	return lost
}

// removed reports whether this node has seen its own removal applied;
// d.swapMu is held.
// A joining node replays the cluster's history first, in which it is not
// yet a member: only a node that saw itself a member, past the point it
// joined at, can have been removed.
func (c *cluster) removed(n *replication.Node) bool {
	in := false
	for _, m := range n.Members() {
		if m.ID == n.ID() {
			in = true
		}
	}
	if in {
		if !c.seenSelf && c.d.db.Applied() >= c.joinedAt {
			c.seenSelf = true
			c.caughtUp()
		}
		return false
	}
	return c.seenSelf
}

// leave turns a removed node back into a lone gateway of a new cluster:
// its raft state goes (its records are the cluster's, which has them), and
// it stays reachable for a new invite.
func (c *cluster) leave() {
	c.d.log.Warn("this gateway was removed from the cluster: it now runs alone, in a new cluster")
	err := c.d.restartNode(func() error {
		c.seenSelf, c.joinedAt, c.catchUpTo = false, 0, 0
		_ = c.d.db.PutMeta(metaCatchUp, nil)
		if err := c.d.db.ResetRaft(false); err != nil {
			return err
		}
		return c.setMeta(c.d.db, newClusterID(), 0)
	}, false, 0)
	if err == nil {
		c.tr.SetPeers(nil)
		c.tr.Reconnect()
	}
}

// refreshSelf puts this node's current name and addresses into the
// membership when they differ from what the cluster has.
func (c *cluster) refreshSelf(ctx context.Context, n *replication.Node) {
	want := c.d.self()
	var cur replication.Member
	found := false
	for _, m := range n.Members() {
		if m.ID == want.ID {
			cur, found = m, true
		}
	}
	if !found || sameDetails(cur, want) {
		return
	}
	lead := n.Leader()
	var err error
	switch {
	case lead == 0:
		return
	case lead == n.ID():
		typ := raftpb.ConfChangeAddLearnerNode
		if cur.Voter {
			typ = raftpb.ConfChangeAddNode
		}
		err = n.ChangeMember(ctx, typ, want)
	default:
		b, _ := json.Marshal(want)
		_, err = c.tr.Request(ctx, lead, reqUpdate, b)
	}
	if err != nil {
		c.d.log.Debug("updating this node's details in the cluster failed; will retry", "error", err)
	}
}

// shape keeps the master's cluster as DESIGN.md says: with 3 members, the
// learners are promoted once they have caught up; with 2, one voter and one
// learner (the slave), so a 3 → 2 shrink demotes the remaining slave.
func (c *cluster) shape(ctx context.Context, n *replication.Node) {
	ms := n.Members()
	voters := 0
	for _, m := range ms {
		if m.Voter {
			voters++
		}
	}
	switch {
	case len(ms) == 3 && voters < 3:
		st, err := n.Status(ctx)
		if err != nil {
			return
		}
		for _, p := range st.Members {
			// Caught up: close enough to the master's log that promoting
			// it cannot stall commits for long.
			if p.Learner && p.Match+64 >= st.Last {
				for _, m := range ms {
					if m.ID == p.ID {
						if err := n.ChangeMember(ctx, raftpb.ConfChangeAddNode, m); err != nil {
							c.d.log.Warn("promoting a learner to voter failed; will retry", "peer", m.Name, "error", err)
						} else {
							c.d.log.Info("member promoted to voter", "peer", m.Name, "id", replication.IDString(m.ID))
						}
					}
				}
				return // one change at a time
			}
		}
	case len(ms) == 2 && voters == 2:
		for _, m := range ms {
			if m.ID != n.ID() && m.Voter {
				if err := n.ChangeMember(ctx, raftpb.ConfChangeAddLearnerNode, m); err != nil {
					c.d.log.Warn("demoting the slave to learner failed; will retry", "peer", m.Name, "error", err)
				} else {
					c.d.log.Info("member demoted to learner: a 2-gateway cluster has one voter", "peer", m.Name)
				}
				return
			}
		}
	}
}

// topicsHash is the hash of this node's topic rules, in order.
func (d *Gateway) topicsHash() string {
	rules := d.host.Live().Topics
	h := sha256.New()
	for _, r := range rules {
		fmt.Fprintf(h, "%q %q\n", r.Match, r.Ack)
	}
	return hex.EncodeToString(h.Sum(nil)[:8])
}

// exchangeTopics tells every member this node's topic rules hash and
// learns theirs.
func (c *cluster) exchangeTopics(ctx context.Context, n *replication.Node) {
	mine := c.d.topicsHash()
	for _, m := range n.Members() {
		if m.ID == n.ID() || !c.tr.Reachable(m.ID) {
			continue
		}
		start := time.Now()
		reply, err := c.tr.Request(ctx, m.ID, reqTopics, []byte(mine))
		if err == nil {
			c.rtt.observe(time.Since(start))
			c.noteTopics(m.ID, string(reply))
		}
	}
}

// noteTopics records a member's topic rules hash and logs a mismatch once
// per change.
func (c *cluster) noteTopics(from uint64, hash string) {
	mine := c.d.topicsHash()
	c.topicsMu.Lock()
	defer c.topicsMu.Unlock()
	c.peerTopics[from] = hash
	if hash != mine && c.warned[from] != hash+mine {
		c.warned[from] = hash + mine
		c.d.log.Warn("topic rules differ from a member's: a publish's ack mode depends on the gateway that takes it", "peer", replication.IDString(from), "ours", mine, "theirs", hash)
	} else if hash == mine {
		delete(c.warned, from)
	}
}

// topicsOf returns a member's topic rules hash, "" if unknown.
func (c *cluster) topicsOf(id uint64) string {
	c.topicsMu.Lock()
	defer c.topicsMu.Unlock()
	return c.peerTopics[id]
}
