package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/spf13/cobra"

	"github.com/tandem-edge/tandem/replication"
	"github.com/tandem-edge/tandem/storage"
)

// Metadata a promotion leaves on the promoted node, for the deposed master
// to rejoin by.
const (
	metaFork    = "cluster.fork"    // last index before the promotion
	metaDeposed = "cluster.deposed" // the removed master's Member JSON
)

// errNotDeposed answers a rejoin knock from a node this one did not depose.
const errNotDeposed = "not deposed by this node"

// rejoinEvery is how often a master that cannot reach a member asks it
// whether it was promoted over this one.
const rejoinEvery = 2 * time.Second

// failoverState is the keeper's view of the master's silence, for
// failover: auto.
type failoverState struct {
	heard atomic.Int64 // Unix nanoseconds of the last raft message received
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
func (c *cluster) admitRejoin(ctx context.Context, r replication.Remote, req joinRequest) (joinReply, error) {
	d := c.d
	dep, err := d.db.GetMeta(metaDeposed)
	if err != nil {
		return joinReply{}, err
	}
	var old replication.Member
	if len(dep) == 0 || json.Unmarshal(dep, &old) != nil || old.Fingerprint != r.Fingerprint || req.Member.ID != r.ID || req.Member.Fingerprint != r.Fingerprint || req.Gen >= c.generation() {
		return joinReply{}, errors.New(errNotDeposed)
	}
	n := d.node()
	if n.Leader() != n.ID() {
		return joinReply{}, errors.New("this gateway is not the master now")
	}
	fb, _ := d.db.GetMeta(metaFork)
	fork, _ := strconv.ParseUint(string(fb), 10, 64)
	rep, err := c.addMember(ctx, req.Member, func() {})
	if err != nil {
		return joinReply{}, err
	}
	rep.Fork = fork
	if t, err := d.db.Term(fork); err == nil {
		rep.ForkTerm = t
	}
	// It may rejoin this way once: afterwards it is a member like any.
	_ = d.db.PutMeta(metaDeposed, nil)
	d.log.Info("the deposed master rejoins as slave", "peer", req.Member.Name, "fork_index", fork)
	return rep, nil
}

// checkDeposed runs on a master whose members are out of reach: it asks
// each whether it promoted itself meanwhile, and if one did, steps down:
// its raft state goes, what it logged after the fork is re-published on the
// new master, and it rejoins as the slave (DESIGN.md: the old master must
// not talk raft to the new one before that wipe; it never does, as the new
// master no longer admits its certificate to a member link).
func (c *cluster) checkDeposed(ctx context.Context, lost []replication.Member) {
	payload, _ := json.Marshal(joinRequest{Rejoin: true, Member: c.d.self(), Gen: c.generation()})
	for _, m := range lost {
		for _, addr := range c.peerAddrs(m) {
			kctx, cancel := context.WithTimeout(ctx, 3*time.Second)
			reply, remote, err := c.tr.Knock(kctx, addr, m.Fingerprint, replication.KnockJoin, payload)
			cancel()
			if err != nil {
				if errors.Is(err, replication.ErrRemote) {
					break // it answered: not deposed by it, or not now
				}
				continue
			}
			var rep joinReply
			if json.Unmarshal(reply, &rep) != nil || rep.Generation <= c.generation() || remote.ID != m.ID {
				continue
			}
			c.rejoin(rep, m)
			return
		}
	}
}

// rejoin turns this deposed master into the slave of the node promoted
// over it.
func (c *cluster) rejoin(rep joinReply, by replication.Member) {
	d := c.d
	applied := d.db.Applied()
	var requeued int
	err := d.restartNode(func() error {
		before, _ := d.db.DataRecords()
		if err := d.db.ResetRaftFrom(forkFrom(d.db, rep)); err != nil {
			return err
		}
		after, _ := d.db.DataRecords()
		requeued = before - after
		if err := c.startCatchUp(rep); err != nil {
			return err
		}
		return c.setMeta(d.db, rep.Cluster, rep.Generation)
	}, true, min(rep.Fork, applied))
	if err != nil {
		d.log.Error("stepping down for the promoted master failed", "error", err)
		return
	}
	c.setFloor(rep.Members)
	c.tr.Reconnect()
	c.depositions.Add(1)
	d.log.Warn("deposed: another gateway was promoted to master; rejoined as its slave", "master", by.Name, "generation", rep.Generation, "fork_index", rep.Fork, "records_requeued", requeued)
}

// checkFailover promotes this node, the slave of a 2-gateway cluster with
// failover: auto, once the master has been silent for failover_after.
func (c *cluster) checkFailover(n *replication.Node) {
	d := c.d
	if d.cfg.Cluster.Failover != "auto" {
		return
	}
	ms := n.Members()
	if len(ms) != 2 {
		return
	}
	for _, m := range ms {
		if m.ID == n.ID() && m.Voter {
			return // the master
		}
	}
	silent := time.Since(time.Unix(0, c.failover.heard.Load()))
	if silent < d.cfg.Cluster.FailoverAfter.Duration() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := c.promote(ctx, true, fmt.Sprintf("failover: auto, the master silent for %v", silent.Round(time.Second))); err != nil {
		d.log.Error("automatic failover failed; will retry", "error", err)
		c.failover.heard.Store(time.Now().UnixNano())
	}
}

// promoteRequest and promoteResponse are POST /v1/cluster/promote.
type promoteRequest struct {
	Force bool `json:"force,omitempty"`
}

type promoteResponse struct {
	Deposed    string `json:"deposed"`
	Generation uint64 `json:"generation"`
}

func (d *Daemon) handlePromote(w http.ResponseWriter, r *http.Request) {
	var req promoteRequest
	if err := decodeBody(r, &req); err != nil {
		writeAPIError(w, statusOf(err), err)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	old, err := d.cl.promote(ctx, req.Force, "tandem promote")
	if err != nil {
		writeAPIError(w, statusOf(err), err)
		return
	}
	writeJSON(w, 200, promoteResponse{Deposed: old.Name, Generation: d.cl.generation()})
}

// newPromoteCmd is `tandem promote`: the manual failover of a 2-gateway
// cluster, run on the slave.
func newPromoteCmd() *cobra.Command {
	var af apiFlags
	var force bool
	cmd := &cobra.Command{
		Use:   "promote",
		Short: "Make this slave the master of its 2-gateway cluster (the master is dead or gone)",
		Long: "Make this gateway, the slave of a 2-gateway cluster, its master: it becomes the only voter and the " +
			"cluster generation goes up. When the old master comes back it finds it was replaced, re-publishes " +
			"what it took after the fork on the new master, and rejoins as the slave. Refused while the master " +
			"is still in contact, unless --force.",
		Args: cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			var out promoteResponse
			if err := af.call("/v1/cluster/promote", promoteRequest{Force: force}, &out); err != nil {
				return err
			}
			fmt.Fprintf(c.OutOrStdout(), "promoted: this gateway is the master (generation %d); %s is deposed and rejoins as slave when it returns\n", out.Generation, out.Deposed)
			return nil
		},
	}
	cmd.Flags().BoolVar(&force, "force", false, "promote even though the master is still in contact (two masters until it learns)")
	af.add(cmd)
	return cmd
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
func forkFrom(db *storage.DB, rep joinReply) uint64 {
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
