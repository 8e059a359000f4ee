package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/tandem-edge/tandem/replication"
	"github.com/tandem-edge/tandem/storage"

	"github.com/tandem-edge/tandem/internal/clock"
)

// Metadata a promotion leaves on the promoted node, for the deposed master
// to rejoin by.
const (
	metaFork    = "cluster.fork"    // last index before the promotion
	metaDeposed = "cluster.deposed" // the removed master's Member JSON
)

// ErrNotDeposed answers a rejoin knock from a node this one did not depose.
const ErrNotDeposed = "not deposed by this node"

// failoverState is the keeper's view of the master's silence, for
// failover: auto.
type failoverState struct {
	// heard is when anything last arrived from the master (clock.Mono:
	// a wall-clock jump neither fires nor stalls a failover): raft messages of any kind, heartbeats included, and
	// requests. A delayed link that still flows keeps moving it.
	heard   atomic.Int64
	slowLog rateLimit // the "slow, not dead" warning
}

// silence is how long nothing has arrived from the master.
func (f *failoverState) silence() time.Duration {
	return clock.Mono() - time.Duration(f.heard.Load())
}

// spokeSince reports whether the master has shown itself alive since
// heard was mark: anything arrived from it since, or it has been silent
// for less than after. A probe on a slow lossy link can fail (its request
// stalled on a link whose TCP is backing off, a fresh connection slower
// than the probe's patience) while the raft link still brings a heartbeat
// now and then; a master heard during the probe is alive, however long
// its silence before it was (CI saw a promotion 4 s after a heartbeat that
// arrived in the middle of a failed 6 s probe).
func (f *failoverState) spokeSince(mark int64, after time.Duration) bool {
	return f.heard.Load() != mark || f.silence() < after
}

// promote makes this node, the slave of a 2-gateway cluster, its master
// (DESIGN.md: forced promotion). Unless force, it refuses while the master
// is in contact: two masters would then take writes.
func (c *cluster) promote(ctx context.Context, force bool, reason string) (replication.Member, error) {
	d := c.d
	n := d.node()
	ms := n.Members()
	var old replication.Member
	selfVoter := false
	for _, m := range ms {
		if m.ID == n.ID() {
			selfVoter = m.Voter
		} else {
			old = m
		}
	}
	switch {
	case len(ms) == 3:
		return old, errors.New("a 3-gateway cluster elects a new master by itself: promote is for the slave of 2 gateways")
	case len(ms) < 2:
		return old, errors.New("this gateway is not in a cluster: nothing to promote over")
	case selfVoter:
		return old, errors.New("this gateway is the master already")
	case n.StateIncomplete():
		// Only the master has the state whole (replication/incomplete.go).
		return old, fmt.Errorf("%w: promoted, this gateway would serve it; start the master again (if it is gone for good: stop this gateway, run `tandem repair --accept-incomplete --force --data DIR` on it, start it and promote it)", replication.ErrStateIncomplete)
	case !force && n.Leader() == old.ID && c.tr.Reachable(old.ID):
		return old, fmt.Errorf("the master %s is alive and in contact: promoting now would give the cluster two masters (stop it first, or use --force)", old.Name)
	}
	var fork uint64
	gen := c.generation() + 1
	err := d.restartNode(func() error {
		f, err := replication.ForcePromote(d.db, d.self(), old.ID)
		if err != nil {
			return err
		}
		fork = f
		dep, _ := json.Marshal(old)
		if err := d.db.PutMeta(metaDeposed, dep); err != nil {
			return err
		}
		if err := d.db.PutMeta(metaFork, []byte(strconv.FormatUint(fork, 10))); err != nil {
			return err
		}
		if err := c.setMeta(d.db, c.clusterID(), gen); err != nil {
			return err
		}
		// No link made under the old generation outlives the promotion.
		c.tr.Reconnect()
		return nil
	}, false, 0)
	if err != nil {
		return old, err
	}
	c.promotions.Add(1)
	d.log.Warn("promoted to master", "reason", reason, "deposed", old.Name, "generation", gen, "fork_index", fork)
	return old, nil
}

// admitRejoin answers a deposed master's knock: if this node promoted
// itself over it (a higher generation, and the certificate of the master
// it removed), the old master comes back as the slave; it learns where the
// logs forked, so that it re-publishes what it took after that.
//
// It answers every such knock the same way, for as long as the deposed
// master has not rejoined: an answer lost on a slow link must not turn the
// next knock away. settleDeposed drops the record once the old master is a
// member again and has caught up past the fork.
func (c *cluster) admitRejoin(ctx context.Context, r replication.Remote, req JoinRequest) (JoinReply, error) {
	d := c.d
	old, fork, ok, err := c.deposedRecord()
	if err != nil {
		return JoinReply{}, err
	}
	if !ok || old.Fingerprint != r.Fingerprint || req.Member.ID != r.ID || req.Member.Fingerprint != r.Fingerprint || req.Gen >= c.generation() {
		return JoinReply{}, errors.New(ErrNotDeposed)
	}
	n := d.node()
	if n.Leader() != n.ID() {
		return JoinReply{}, errors.New("this gateway is not the master now")
	}
	// Already a member (an earlier answer was lost): addMember changes
	// nothing and answers as it did.
	rep, err := c.addMember(ctx, req.Member, func() {})
	if err != nil {
		return JoinReply{}, err
	}
	rep.Fork = fork
	if t, err := d.db.Term(fork); err == nil {
		rep.ForkTerm = t
	}
	d.log.Info("the deposed master rejoins as slave", "peer", req.Member.Name, "fork_index", fork, "knock_from", r.Addr)
	return rep, nil
}

// deposedRecord returns the member this node promoted itself over and the
// fork index, while that member has not rejoined; ok is false when there
// is none.
func (c *cluster) deposedRecord() (old replication.Member, fork uint64, ok bool, err error) {
	dep, err := c.d.db.GetMeta(metaDeposed)
	if err != nil || len(dep) == 0 {
		return old, 0, false, err
	}
	if json.Unmarshal(dep, &old) != nil {
		return old, 0, false, nil
	}
	fb, _ := c.d.db.GetMeta(metaFork)
	fork, _ = strconv.ParseUint(string(fb), 10, 64)
	return old, fork, true, nil
}

// settleDeposed runs on the master: once the member it promoted itself
// over is in the membership again and its log has passed the fork (the
// promotion's own entries included), the rejoin is done and the record
// that admitted it goes.
func (c *cluster) settleDeposed(ctx context.Context, n *replication.Node) {
	old, fork, ok, err := c.deposedRecord()
	if err != nil || !ok || !slices.ContainsFunc(n.Members(), func(m replication.Member) bool { return m.ID == old.ID }) {
		return
	}
	st, err := n.Status(ctx)
	if err != nil {
		return
	}
	for _, p := range st.Members {
		if p.ID == old.ID && p.Match >= fork+2 {
			if err := c.d.db.PutMeta(metaDeposed, nil); err != nil {
				c.d.log.Warn("dropping the deposed master's record failed; will retry", "error", err)
				return
			}
			c.d.log.Info("the deposed master has rejoined and caught up past the fork", "peer", old.Name, "fork_index", fork, "match_index", p.Match)
			return
		}
	}
}

// rejoin turns this deposed master into the slave of the node promoted
// over it. The records it logged after the fork go to the requeue bucket,
// to be re-published on the new master; those it delivered to its own
// subscribers already are remembered, so they are not delivered again when
// they come back (daemon/redeliver.go, through Host.Remember).
func (c *cluster) rejoin(rep JoinReply, by replication.Member) {
	d := c.d
	applied := d.db.Applied()
	err := d.restartNode(func() error {
		from := forkFrom(d.db, rep)
		// Applied now, with the node stopped: every record up to here
		// reached this node's subscribers.
		if err := d.host.Remember(from); err != nil {
			return err
		}
		if err := d.db.ResetRaftFrom(from); err != nil {
			return err
		}
		if err := c.startCatchUp(rep); err != nil {
			return err
		}
		return c.setMeta(d.db, rep.Cluster, rep.Generation)
	}, true, min(rep.Fork, applied))
	if err != nil {
		d.log.Error("stepping down for the promoted master failed; will knock again", "error", err)
		return
	}
	// What the bucket holds now is the tail, exactly (counting records
	// before and after the wipe would count the whole log).
	requeued, _ := d.db.RequeuePending()
	c.setFloor(rep.Members)
	c.tr.Reconnect()
	c.depositions.Add(1)
	d.log.Warn("stepping down: another gateway was promoted to master; re-publishing this gateway's tail there", "master", by.Name, "generation", rep.Generation, "fork_index", rep.Fork, "records_requeued", requeued)
	c.background(&c.bgRepublished, func() { c.reportDeposed(by, rep, requeued) })
}

// reportDeposed waits for the requeued tail to be re-published, then logs
// the deposition with the count status gives (cluster.requeued), so the
// journal and status agree.
func (c *cluster) reportDeposed(by replication.Member, rep JoinReply, requeued int) {
	d := c.d
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-c.stopc:
			return
		case <-t.C:
		}
		if pending, err := d.db.RequeuePending(); err != nil || pending > 0 {
			continue
		}
		n := d.node()
		if n.Requeued()+n.RefusedSkipped()+n.SettlementsSkipped() < uint64(requeued) {
			// The bucket is empty once the last run is proposed; its count
			// is added when that run is answered.
			continue
		}
		d.log.Warn("deposed: another gateway was promoted to master; rejoined as its slave", "master", by.Name, "generation", rep.Generation, "fork_index", rep.Fork, "records_republished", n.Requeued(), "records_refused_not_republished", n.RefusedSkipped(), "settlements_not_republished", n.SettlementsSkipped(), "records_requeued", requeued)
		return
	}
}

// checkFailover promotes this node, the slave of a 2-gateway cluster with
// failover: auto, once nothing at all has arrived from the master for
// failover_after and the master does not answer a probe either (docs/clusters.md:
// "2 gateways, automatically"). The probe runs in the background: the keeper
// never waits on the network.
func (c *cluster) checkFailover(n *replication.Node) {
	d := c.d
	if d.cfg.Cluster.Failover != "auto" {
		return
	}
	master, ok := FailoverMaster(n)
	if !ok {
		return
	}
	after := d.cfg.Cluster.FailoverAfter.Duration()
	if c.failover.silence() < after {
		return
	}
	c.background(&c.bgFailover, func() { c.failoverRound(master, after) })
}

// failoverRound probes a master that has been silent for after, and
// promotes this node unless the master answered or spoke meanwhile. It
// reports whether it promoted.
func (c *cluster) failoverRound(master replication.Member, after time.Duration) bool {
	d := c.d
	mark := c.failover.heard.Load()
	before := c.failover.silence()
	ctx, cancel := context.WithTimeout(context.Background(), c.probeTimeout(after))
	alive := c.masterAnswers(ctx, master)
	cancel()
	silent := c.failover.silence()
	switch {
	case alive:
		// A slow or lossy link, not a dead master: promoting now would
		// make two masters for as long as the link stays slow.
		c.failover.heard.Store(int64(clock.Mono()))
		if c.failover.slowLog.allow(30 * time.Second) {
			d.log.Warn("the master sent nothing on the raft link for a while but answers a probe: not promoting", "peer", master.Name, "silent", before.Round(time.Millisecond), "rtt", c.rtt.get().Round(time.Millisecond))
		}
		return false
	case c.failover.spokeSince(mark, after):
		return false
	}
	pctx, pcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer pcancel()
	if _, err := c.promote(pctx, true, fmt.Sprintf("failover: auto, nothing from the master for %v and no answer to a probe", silent.Round(time.Second))); err != nil {
		d.log.Error("automatic failover failed; will retry", "error", err)
		c.failover.heard.Store(int64(clock.Mono()))
		return false
	}
	return true
}

// FailoverMaster returns the master of n's cluster if n is the slave of a
// 2-gateway cluster.
func FailoverMaster(n *replication.Node) (replication.Member, bool) {
	ms := n.Members()
	if len(ms) != 2 {
		return replication.Member{}, false
	}
	var master replication.Member
	for _, m := range ms {
		if m.Voter {
			if m.ID == n.ID() {
				return replication.Member{}, false // the master
			}
			master = m
		}
	}
	return master, master.ID != 0
}

// peerAddrs returns where to reach m: the addresses mDNS last found it at
// first, then those the membership has.
func (c *cluster) peerAddrs(m replication.Member) []string {
	c.lingerMu.Lock()
	defer c.lingerMu.Unlock()
	var out []string
	for _, p := range c.last {
		if p.ID == m.ID {
			out = append(out, p.Addrs...)
		}
	}
	for _, a := range m.Addrs {
		if !slices.Contains(out, a) {
			out = append(out, a)
		}
	}
	return out
}

// forkFrom is the first index of this deposed master's log to requeue:
// after the fork, and earlier where its log differs from the promoted
// node's before it. That happens when this node lost entries it had sent
// before its own fsync finished (a crash), then logged others at those
// indexes in a later term: every entry of a term above the promoted
// node's term at the fork is this node's alone.
func forkFrom(db *storage.DB, rep JoinReply) uint64 {
	from := rep.Fork + 1
	if rep.ForkTerm == 0 {
		return from
	}
	first, _ := db.FirstIndex()
	last, _ := db.LastIndex()
	for i := min(rep.Fork, last); i >= first && i > 0; i-- {
		t, err := db.Term(i)
		if err != nil || t <= rep.ForkTerm {
			break
		}
		from = i
	}
	return from
}
