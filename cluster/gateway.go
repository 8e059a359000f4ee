package cluster

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/replication"
	"github.com/tandem-edge/tandem/storage"

	"github.com/tandem-edge/tandem/internal/clock"
)

// Gateway is the control plane of one gateway: the replication node in
// force (started, restarted and swapped here under swapMu) and the cluster
// around it (keeper, join, pairing, promotion, rejoin, forwarding from
// slaves). The daemon makes one per run with newGateway and reaches the
// broker side of a swap through the Host it hands in.
type Gateway struct {
	cfg  *config.Config
	log  *slog.Logger
	id   *replication.Identity
	db   *storage.DB
	host Host

	nodeP atomic.Pointer[replication.Node]
	// swapMu serialises the node replacements of a join or a removal.
	swapMu sync.Mutex
	cl     *cluster
}

// Host is what the control plane needs of the gateway it runs in: the
// broker's side of a node swap, the config in force, and a way to give up.
type Host interface {
	// Live is the configuration in force: the one started with, then
	// each reload's.
	Live() *config.Config
	// Serving is closed once the broker serves, so its address is known.
	Serving() <-chan struct{}
	// MQTTAddr is the broker's listen address, once Serving is closed.
	MQTTAddr() string
	// Applier is what committed records go to (the broker, behind the
	// redelivery filter of a deposed master).
	Applier() replication.Applier
	// AfterResolve is replication.Config.AfterResolve: the broker writes
	// the acks that a run of proposals resolved.
	AfterResolve()
	// Rewind tells the broker that the log was reset under it: deliveries
	// of records up to quietUntil only update the retained store.
	Rewind(quietUntil uint64)
	// Remember records that the records after from up to the applied
	// index reached this node's subscribers already (a deposed master
	// about to hand its tail to the new one).
	Remember(from uint64) error
	// Fail stops the gateway from serving: the node in force failed or
	// could not be replaced.
	Fail(err error)
	// Admit is replication.Config.Admit: whether the master takes a
	// record a slave forwarded (an uplink's full backlog refuses its
	// topics).
	Admit(data []byte) error
	// PastBudget is replication.Config.PastBudget: the records the master
	// takes while its log is over its budget.
	PastBudget(data []byte) bool
}

// node returns the replication node in force: a join or a removal replaces
// it.
func (d *Gateway) node() *replication.Node { return d.nodeP.Load() }

// PeerAddr returns the peer listener's address.
func (d *Gateway) PeerAddr() string { return d.cl.tr.Addr().String() }

// nodeConfig is the replication config of this gateway.
func (d *Gateway) nodeConfig(join bool) replication.Config {
	c := d.cfg
	self, _ := json.Marshal(d.self())
	return replication.Config{
		Identity:        d.id,
		Storage:         d.db,
		Applier:         d.host.Applier(),
		Transport:       d.cl.tr,
		Logger:          d.log, // the node adds its component
		Heartbeat:       c.Cluster.Heartbeat.Duration(),
		ElectionTimeout: c.Cluster.ElectionTimeout.Duration(),
		SyncTimeout:     c.Cluster.SyncTimeout.Duration(),
		MinSyncReplicas: c.Cluster.MinSyncReplicas,
		MemberContext:   self,
		Join:            join,
		CatchUpTo:       d.cl.catchUpTo,
		OnMembership:    d.cl.onMembership,
		Forwarder:       forwarder{d.cl},
		Backfill:        forwarder{d.cl},
		AfterResolve:    d.host.AfterResolve,
		Admit:           d.host.Admit,
		PastBudget:      d.host.PastBudget,
	}
}

// startNode starts the replication node on the data file as it is and
// makes it the one in force.
func (d *Gateway) startNode(join bool) error {
	n, err := replication.NewNode(d.nodeConfig(join))
	if err != nil {
		return err
	}
	d.nodeP.Store(n)
	// The watcher ends with the cluster (Stop waits for it): a node that
	// was replaced without failing leaves it waiting until then.
	d.cl.goFunc(func() {
		select {
		case <-n.Failed():
		case <-d.cl.stopc:
			return
		}
		if d.node() == n {
			d.host.Fail(n.Err())
		}
	})
	return nil
}

// restartNode stops the node in force, runs prep on the stopped data file
// (a raft reset), and starts a new node: how a gateway joins a cluster or
// leaves one. Deliveries of records up to quietUntil only update the
// retained store: they are the history of a cluster this node joins. A
// failure after the stop leaves the gateway unable to serve: it fails.
func (d *Gateway) restartNode(prep func() error, join bool, quietUntil uint64) error {
	d.swapMu.Lock()
	defer d.swapMu.Unlock()
	d.node().Stop()
	if err := prep(); err != nil {
		// prep changes the data file in one transaction or not at all
		// (or the disk failed): serve on with the node as it was.
		if serr := d.startNode(false); serr != nil {
			d.host.Fail(fmt.Errorf("restarting replication: %w", serr))
		}
		return err
	}
	d.host.Rewind(quietUntil)
	d.cl.failover.heard.Store(int64(clock.Mono())) // a new membership: silence counts from now
	if err := d.startNode(join); err != nil {
		err = fmt.Errorf("restarting replication: %w", err)
		d.host.Fail(err)
		return err
	}
	return nil
}

// NewGateway makes the control plane of the gateway started with cfg, on
// its identity and data file, and loads the cluster it belongs to.
func NewGateway(cfg *config.Config, log *slog.Logger, id *replication.Identity, db *storage.DB, host Host) (*Gateway, error) {
	d := &Gateway{cfg: cfg, log: log, id: id, db: db, host: host}
	d.cl = &cluster{d: d, invites: &inviteBook{}, peerTopics: map[uint64]string{}, warned: map[uint64]string{}, stopc: make(chan struct{}), membersSig: make(chan struct{}, 1)}
	d.cl.failover.heard.Store(int64(clock.Mono())) // silence counts from the start
	if err := d.cl.loadMeta(db); err != nil {
		return nil, err
	}
	return d, nil
}

// StartTransport listens on peer.listen.
func (d *Gateway) StartTransport() error { return d.cl.startTransport() }

// StartKeeper starts the keeper, which keeps the membership in shape; stop
// waits for it and for every background round it started.
func (d *Gateway) StartKeeper() {
	d.cl.goFunc(d.cl.keeper)
}

// Stop stops the keeper and its rounds, the peer transport and the node in
// force, in that order.
func (d *Gateway) Stop() {
	close(d.cl.stopc)
	d.cl.wg.Wait()
	if d.cl.tr != nil {
		d.cl.tr.Close()
	}
	d.swapMu.Lock()
	if n := d.node(); n != nil {
		n.Stop()
	}
	d.swapMu.Unlock()
}
